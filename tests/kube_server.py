"""Pytest plugin: a real Kubernetes API server (etcd + kube-apiserver, no Docker) for tests.

Registered from ``tests/conftest.py`` (``pytest_plugins``), like ``tests.kafka_broker``.

Fixtures
--------
``kube_api`` (session) -> ``KubeCluster``
    A cluster whose ``/readyz`` answered. Chosen in this order:

    1. ``FLEETWISE_KUBECONFIG`` -- a kubeconfig file of an existing cluster (``make test`` sets
       it to the server it started); nothing is started or stopped;
    2. ``KUBECONFIG`` -- an existing cluster (set ``FLEETWISE_KUBE_LOCAL=1`` to ignore it: the
       tests create cluster-scoped objects, Nodes and CRDs, with unique names, and delete them);
    3. a local control plane from ``deploy/kube/kube.sh start <tmpdir>`` (kube-apiserver,
       etcd and kube-controller-manager built from the Go module proxy on first use and
       cached under ``~/.cache/fleetwise/``), stopped with ``kube.sh stop`` at session end.

    When no API server can be had the fixture FAILS (never skips) with the reason.
    ``KubeCluster.kubeconfig`` is the file path; ``.api_client()`` a new
    ``kubernetes.client.ApiClient``; ``.install_crds(paths)`` creates CRDs (idempotent) and
    waits until they are Established; ``.apply(objs, namespace, dry_run=False)`` creates
    manifests (server-side dry-run with ``dry_run=True``) through the dynamic client.

``kube_namespace`` (function) -> ``str``
    A fresh namespace with a ``default`` ServiceAccount and the ``kube-root-ca.crt`` ConfigMap
    (so Pods can be created with or without kube-controller-manager), deleted after the test.

``kube_crds`` (session) -> ``list[str]``
    KAI's CRDs (``deploy/crds/*.yaml``) installed on ``kube_api``; the CRD names.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
KUBE_SH = REPO_ROOT / "deploy" / "kube" / "kube.sh"
CRD_DIR = REPO_ROOT / "deploy" / "crds"
ENV_KUBECONFIG = "FLEETWISE_KUBECONFIG"
ENV_LOCAL = "FLEETWISE_KUBE_LOCAL"
START_TIMEOUT_S = 3600  # a first build of kube-apiserver on a busy 2-core machine


@dataclass
class KubeCluster:
    """A reachable API server: where its kubeconfig is and how the tests talk to it."""

    kubeconfig: str
    source: str  # "FLEETWISE_KUBECONFIG", "KUBECONFIG" or "local"
    state_dir: str | None = None
    _crds: set[str] = field(default_factory=set)

    def api_client(self) -> Any:
        """A new official-client ApiClient for this cluster."""
        from kubernetes import config

        return config.new_client_from_config(config_file=self.kubeconfig)

    def install_crds(self, paths: Iterable[str | Path], timeout_s: float = 60.0) -> list[str]:
        """Create (or keep) the CRDs in ``paths`` and wait until each is Established."""
        import yaml
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api = client.ApiextensionsV1Api(self.api_client())
        names: list[str] = []
        for path in paths:
            for doc in yaml.safe_load_all(Path(path).read_text(encoding="utf-8")):
                if not doc or doc.get("kind") != "CustomResourceDefinition":
                    continue
                name = doc["metadata"]["name"]
                names.append(name)
                if name in self._crds:
                    continue
                try:
                    api.create_custom_resource_definition(doc)
                except ApiException as exc:
                    if exc.status != 409:
                        raise
        deadline = time.monotonic() + timeout_s
        for name in names:
            while True:
                crd = api.read_custom_resource_definition(name)
                conds = {c.type: c.status for c in (crd.status.conditions or [])}
                if conds.get("Established") == "True":
                    self._crds.add(name)
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"CRD {name} not Established after {timeout_s}s: {conds}")
                time.sleep(0.05)
        return names

    def apply(self, objects: Sequence[Mapping[str, Any]], namespace: str | None = None,
              dry_run: bool = False) -> list[Any]:
        """Create each manifest (``dry_run``: server-side dry run, nothing is stored).

        Raises ``kubernetes.client.rest.ApiException`` (status 422 names the bad field).
        """
        from kubernetes import dynamic

        dyn = dynamic.DynamicClient(self.api_client())
        out = []
        for obj in objects:
            res = dyn.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
            kwargs: dict[str, Any] = {"body": dict(obj)}
            if res.namespaced:
                kwargs["namespace"] = obj.get("metadata", {}).get("namespace") or namespace or "default"
            if dry_run:
                kwargs["query_params"] = [("dryRun", "All")]
            out.append(res.create(**kwargs))
        return out


def _readyz(kubeconfig: str, timeout_s: float = 10.0) -> str | None:
    """None when the API server of ``kubeconfig`` answers /readyz "ok", else the reason."""
    try:
        from kubernetes import config

        api = config.new_client_from_config(config_file=kubeconfig)
        method, url, headers, body, _ = api.param_serialize("GET", "/readyz", auth_settings=["BearerToken"])
        resp = api.call_api(method, url, headers, body, _request_timeout=timeout_s)
        resp.read()
        text = resp.data.decode("utf-8", "replace")
        if resp.status == 200 and text.strip() == "ok":
            return None
        return f"/readyz answered HTTP {resp.status}: {text[:200]!r}"
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable", with the reason
        return f"{type(exc).__name__}: {exc}"


def _start_local(request: pytest.FixtureRequest, state_dir: Path) -> str:
    env = dict(os.environ)
    env["KUBE_WATCH_PID"] = str(os.getpid())  # if pytest dies, the control plane goes with it

    def stop() -> None:
        subprocess.run(["bash", str(KUBE_SH), "stop", str(state_dir)], env=env, timeout=120, check=False)

    try:
        proc = subprocess.run(["bash", str(KUBE_SH), "start", str(state_dir)], env=env, capture_output=True,
                              text=True, timeout=START_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired as exc:
        stop()
        pytest.fail(f"{KUBE_SH} start timed out after {START_TIMEOUT_S}s:\n{exc.stderr or ''}", pytrace=False)
    if proc.returncode != 0:
        stop()
        pytest.fail(f"could not start a local API server ({KUBE_SH} start, rc={proc.returncode}):\n"
                    f"{proc.stderr}\n{proc.stdout}", pytrace=False)
    request.addfinalizer(stop)
    lines = proc.stdout.strip().splitlines()
    if not lines:
        pytest.fail(f"{KUBE_SH} start printed no kubeconfig path:\n{proc.stderr}", pytrace=False)
    return lines[-1].strip()


@pytest.fixture(scope="session")
def kube_api(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> KubeCluster:
    """A real Kubernetes API server (see the module docstring for the order)."""
    try:
        import kubernetes  # noqa: F401 - the `kube` extra
    except ImportError:
        pytest.fail("the `kube` extra (kubernetes client) is not installed: pip install -e '.[kube]'",
                    pytrace=False)
    candidates = [(ENV_KUBECONFIG, os.environ.get(ENV_KUBECONFIG, "").strip())]
    if os.environ.get(ENV_LOCAL, "").strip().lower() not in {"1", "true", "yes", "on"}:
        candidates.append(("KUBECONFIG", os.environ.get("KUBECONFIG", "").strip()))
    for name, path in candidates:
        if path:
            reason = _readyz(path)
            if reason:
                pytest.fail(f"{name}={path}: the API server is not ready: {reason}", pytrace=False)
            return KubeCluster(kubeconfig=path, source=name)
    state = tmp_path_factory.mktemp("kube")
    kubeconfig = _start_local(request, state)
    reason = _readyz(kubeconfig)
    if reason:
        pytest.fail(f"local API server ({kubeconfig}) is not ready: {reason}", pytrace=False)
    return KubeCluster(kubeconfig=kubeconfig, source="local", state_dir=str(state))


@pytest.fixture(scope="session")
def kube_crds(kube_api: KubeCluster) -> list[str]:
    """KAI Scheduler's CRDs (deploy/crds/) installed and Established."""
    return kube_api.install_crds(sorted(CRD_DIR.glob("*.yaml")))


def ensure_namespace_basics(kube: KubeCluster, namespace: str) -> None:
    """A `default` ServiceAccount and `kube-root-ca.crt` ConfigMap in ``namespace`` (what
    kube-controller-manager creates), so Pods can be created whether or not it runs."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core = client.CoreV1Api(kube.api_client())
    for create, body in (
        (core.create_namespaced_service_account, {"metadata": {"name": "default"}}),
        (core.create_namespaced_config_map,
         {"metadata": {"name": "kube-root-ca.crt"}, "data": {"ca.crt": ""}}),
    ):
        try:
            create(namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise


@pytest.fixture
def kube_namespace(kube_api: KubeCluster) -> Iterable[str]:
    """A fresh namespace for one test (deleted after it)."""
    from kubernetes import client

    name = f"fw-test-{uuid.uuid4().hex[:10]}"
    core = client.CoreV1Api(kube_api.api_client())
    core.create_namespace({"metadata": {"name": name, "labels": {"fleetwise.io/test": "true"}}})
    ensure_namespace_basics(kube_api, name)
    yield name
    with contextlib.suppress(Exception):  # cleanup must not fail a passing test
        core.delete_namespace(name, propagation_policy="Background")


def pytest_report_header(config: pytest.Config) -> str:
    for name in (ENV_KUBECONFIG, "KUBECONFIG"):
        if os.environ.get(name, "").strip():
            return f"kube: existing cluster {name}={os.environ[name]}"
    return "kube: local etcd + kube-apiserver started on demand (deploy/kube/kube.sh)"
