"""KAI Scheduler CRD schemas shipped as package data, and validation of rendered objects.

The YAML files are the CRDs as KAI publishes them (see README.md here). Validation uses each
CRD's `spec.versions[].schema.openAPIV3Schema` with `jsonschema` (the `kube` extra).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

import yaml

__all__ = ["CRD_FILES", "crd_schema", "validate_manifest"]

# kind -> CRD file in this package.
CRD_FILES: dict[str, str] = {
    "PodGroup": "scheduling.run.ai_podgroups.yaml",
    "Queue": "scheduling.run.ai_queues.yaml",
    "Topology": "kai.scheduler_topologies.yaml",
}


@cache
def _crd(kind: str) -> dict[str, Any]:
    if kind not in CRD_FILES:
        raise KeyError(f"no CRD bundled for kind {kind!r}; known: {', '.join(sorted(CRD_FILES))}")
    text = resources.files(__package__).joinpath(CRD_FILES[kind]).read_text(encoding="utf-8")
    for doc in yaml.safe_load_all(text):
        if doc and doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["kind"] == kind:
            return doc
    raise KeyError(f"{CRD_FILES[kind]} has no CustomResourceDefinition for {kind!r}")


def crd_schema(kind: str, version: str | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of `kind` for `version` (default: the storage version)."""
    crd = _crd(kind)
    versions = crd["spec"]["versions"]
    if version is None:
        chosen = next((v for v in versions if v.get("storage")), versions[0])
    else:
        chosen = next((v for v in versions if v["name"] == version), None)
        if chosen is None:
            names = ", ".join(v["name"] for v in versions)
            raise KeyError(f"{kind} has no version {version!r}; served: {names}")
    if not chosen.get("served", True):
        raise KeyError(f"{kind} version {chosen['name']!r} is not served")
    return chosen["schema"]["openAPIV3Schema"]


def validate_manifest(obj: dict[str, Any]) -> list[str]:
    """Schema violations of a rendered KAI object (empty list: valid).

    The CRD is chosen by `kind`, the version by `apiVersion` (group/version); the group must
    match the CRD's.
    """
    import jsonschema  # the `kube` extra

    kind = obj.get("kind")
    api_version = str(obj.get("apiVersion", ""))
    if kind not in CRD_FILES:
        return [f"kind {kind!r} is not a bundled KAI CRD ({', '.join(sorted(CRD_FILES))})"]
    group, _, version = api_version.rpartition("/")
    crd = _crd(kind)
    if group != crd["spec"]["group"]:
        return [f"apiVersion {api_version!r}: group must be {crd['spec']['group']!r}"]
    try:
        schema = crd_schema(kind, version)
    except KeyError as exc:
        return [str(exc.args[0])]
    validator = jsonschema.Draft7Validator(schema)
    return [
        f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in sorted(validator.iter_errors(obj), key=lambda e: list(e.absolute_path))
    ]
