"""Render a plan's KAI envelope as Kubernetes objects a user can `kubectl apply`.

Pure: plain dicts in, a list of manifest dicts out (no client, no I/O). The objects:

- a PodGroup (`scheduling.run.ai/v2alpha2`): minMember = the gang, queue, priorityClassName,
  one subGroup per GPU type (and pod shape), and a topologyConstraint where the plan needs
  one NVLink or rack domain (see `topology_needs`);
- the workload: bare Pods (`workload="pods"`), a JobSet (one replicatedJob per GPU group) or
  a PyTorchJob (one GPU type only: its Master/Worker templates cannot differ by GPU type).
  Every pod carries `schedulerName: kai-scheduler`, the `kai.scheduler/queue` label, the
  `pod-group-name` annotation, the subgroup label, node affinity on GPU Feature Discovery's
  `nvidia.com/gpu.product` (and `nvidia.com/gpu.count` >= the pod's GPUs) per GPU type, and
  `nvidia.com/gpu` limits rendered as strings (the official Python client refuses ints);
- a ConfigMap with the per-rank micro-batch map the training plugin reads
  (`fleetwise.training.load_microbatch_map`), mounted at `MICROBATCH_MAP_PATH`;
- Queues (`scheduling.run.ai/v2`) per team where asked, and a KAI Topology where asked.

The consumer (`fleetwise.kube.consumer`) finds the job's objects by the `fleetwise.io/job`
label and reads the PodGroup's `fleetwise.io/*` annotations to resize it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from fleetwise.planner.exports import (
    GFD_PRODUCT_LABEL,
    KAI_POD_GROUP_ANNOTATION,
    KAI_QUEUE_LABEL,
    KAI_SCHEDULER_NAME,
    KAI_SUBGROUP_LABEL,
    ExportError,
    _dns_label,
    kai_envelope,
    microbatch_map,
)
from fleetwise.schemas import Plan

__all__ = [
    "ANN_GPUS_PER_POD",
    "ANN_SUBGROUPS",
    "DEFAULT_IMAGE",
    "DEFAULT_TOPOLOGY_LEVELS",
    "JOB_LABEL",
    "MICROBATCH_MAP_PATH",
    "WORKLOADS",
    "RenderError",
    "dump_yaml",
    "envelope_configmap_name",
    "pod_group_name",
    "render_envelope",
    "render_plan",
    "render_queues",
    "render_topology",
    "topology_needs",
]

JOB_LABEL = "fleetwise.io/job"
# PodGroup annotations the consumer reads back (JSON): subgroup -> {product, gpus_per_pod, pods}.
ANN_SUBGROUPS = "fleetwise.io/subgroups"
ANN_GPUS_PER_POD = "fleetwise.io/gpus-per-pod"
MICROBATCH_MAP_PATH = "/etc/fleetwise/microbatch-map.json"
DEFAULT_IMAGE = "nvcr.io/nvidia/pytorch:25.01-py3"
WORKLOADS = ("pods", "jobset", "pytorchjob")
GPU_COUNT_LABEL = "nvidia.com/gpu.count"  # GPU Feature Discovery
# KAI Topology levels, widest first (the hostname level must be last, KAI's CRD rule).
# `nvidia.com/gpu.clique` is GFD's multi-node NVLink domain label (GB200 NVL72).
ZONE_LEVEL = "topology.kubernetes.io/zone"
RACK_LEVEL = "fleetwise.io/rack"
NVLINK_LEVEL = "nvidia.com/gpu.clique"
DEFAULT_TOPOLOGY_LEVELS = (ZONE_LEVEL, RACK_LEVEL, NVLINK_LEVEL, "kubernetes.io/hostname")
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PYTORCHJOB_API = "kubeflow.org/v1"
ELASTIC_MAX_RESTARTS = 100  # membership changes and failures an elastic PyTorchJob may go through


class RenderError(ExportError):
    """The envelope cannot be rendered in the asked form; the message names the option."""


def pod_group_name(job: str) -> str:
    """The PodGroup (and `fleetwise.io/job` label value) of a job: its name as a DNS label."""
    return _dns_label(job)


def envelope_configmap_name(pod_group: str) -> str:
    """The ConfigMap holding the job's micro-batch map and envelope."""
    return f"{pod_group}-fleetwise"[:253]


def topology_needs(plan: Plan) -> dict[str, dict[str, str]]:
    """Topology constraint per GPU model of the plan (empty: none needed).

    A tensor-parallel group (ranks of one data-parallel replica and one pipeline stage) that
    spans nodes talks every layer: it needs one NVLink domain (required). A GPU type whose
    ranks span several nodes gains from one rack (data-parallel all-reduce and pipeline
    sends stay under one switch): preferred, not required, so the job still runs when no
    rack has room.
    """
    out: dict[str, dict[str, str]] = {}
    groups: dict[tuple[int, int], set[str]] = {}
    for r in plan.ranks:
        groups.setdefault((r.dp_rank, r.stage), set()).add(r.node)
    tp_cross = {r.model for r in plan.ranks if len(groups[(r.dp_rank, r.stage)]) > 1 and plan.tp > 1}
    nodes_of: dict[str, set[str]] = {}
    for r in plan.ranks:
        nodes_of.setdefault(r.model, set()).add(r.node)
    for model, nodes in sorted(nodes_of.items()):
        if model in tp_cross:
            out[model] = {"requiredTopologyLevel": NVLINK_LEVEL}
        elif len(nodes) > 1:
            out[model] = {"preferredTopologyLevel": RACK_LEVEL}
    return out


def _quantity(value: Any) -> str:
    return str(value)


def _pod_spec(template: Mapping[str, Any], image: str, cm_name: str, job: str,
              command: Sequence[str] | None = None) -> dict[str, Any]:
    """A full pod spec from an envelope pod template (strings for quantities). `FLEETWISE_NODE`
    is the node's name (the downward API): commands name nodes, and a pod's hostname is its own
    name, not its node's."""
    spec = copy.deepcopy(dict(template["spec"]))
    product = spec.get("nodeSelector", {}).get(GFD_PRODUCT_LABEL)
    gpus = int(spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    spec["nodeSelector"] = {GFD_PRODUCT_LABEL: product}
    terms = [{"key": GFD_PRODUCT_LABEL, "operator": "In", "values": [product]}]
    if gpus > 1:
        terms.append({"key": GPU_COUNT_LABEL, "operator": "Gt", "values": [str(gpus - 1)]})
    affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution",
                                   {"nodeSelectorTerms": [{}]})
    for term in required["nodeSelectorTerms"]:  # AND our terms into every existing term
        term.setdefault("matchExpressions", []).extend(copy.deepcopy(terms))
    spec["containers"] = [{
        "name": "trainer",
        "image": image,
        **({"command": list(command)} if command else {}),
        "env": [
            {"name": "FLEETWISE_JOB", "value": job},
            {"name": "FLEETWISE_MICROBATCH_MAP", "value": MICROBATCH_MAP_PATH},
            {"name": "FLEETWISE_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        ],
        "resources": {
            "limits": {"nvidia.com/gpu": _quantity(gpus)},
            "requests": {"nvidia.com/gpu": _quantity(gpus)},
        },
        "volumeMounts": [{"name": "fleetwise", "mountPath": "/etc/fleetwise", "readOnly": True}],
    }]
    spec["volumes"] = [{"name": "fleetwise", "configMap": {"name": cm_name}}]
    spec["schedulerName"] = KAI_SCHEDULER_NAME
    return spec


def render_envelope(
    envelope: Mapping[str, Any],
    *,
    mb_map: Mapping[str, Any] | None = None,
    namespace: str = "default",
    workload: str = "pods",
    image: str = DEFAULT_IMAGE,
    priority_class: str | None = None,
    preemptible: bool | None = None,
    topology: Mapping[str, Mapping[str, str]] | None = None,
    topology_name: str = "fleetwise",
    command: Sequence[str] | None = None,
    elastic: tuple[int, int] | None = None,
) -> list[dict[str, Any]]:
    """Objects for one job from its KAI envelope (`exports.kai_envelope`), in apply order.

    `topology`: GPU model -> constraint (`topology_needs`); with one GPU group it goes on the
    PodGroup, otherwise on each group's subGroup (a mixed job's types sit in different racks).
    `command`: the trainer container's command (default: the image's entrypoint).
    `elastic`: (min, max) pods of an elastic PyTorchJob (`elasticPolicy`, Workers only).
    """
    if workload not in WORKLOADS:
        raise RenderError(f"workload {workload!r}: expected one of {', '.join(WORKLOADS)}")
    if not namespace:
        raise RenderError("namespace is empty")
    if not image:
        raise RenderError("image is empty")
    env = copy.deepcopy(dict(envelope))
    name = env["pod_group_name"]
    job, queue = env["job"], env["queue"]
    labels = {JOB_LABEL: name, KAI_QUEUE_LABEL: queue}
    cm_name = envelope_configmap_name(name)
    groups = env["node_groups"]
    subgroups = {
        g["name"]: {"gpu_model": g["gpu_model"], "product": g["gpu_product"],
                    "gpus_per_pod": g["gpus_per_pod"], "pods": g["pods"]}
        for g in groups
    }

    pod_group = env["pod_group"]
    pod_group["metadata"]["namespace"] = namespace
    pod_group["metadata"]["labels"] = {**pod_group["metadata"].get("labels", {}), JOB_LABEL: name}
    pod_group["metadata"]["annotations"] = {ANN_SUBGROUPS: json.dumps(subgroups, sort_keys=True)}
    spec = pod_group["spec"]
    if priority_class:
        spec["priorityClassName"] = priority_class
    if preemptible is not None:
        spec["preemptibility"] = "preemptible" if preemptible else "non-preemptible"
    topology = dict(topology or {})
    if topology:
        if len(groups) == 1 and groups[0]["gpu_model"] in topology:
            spec["topologyConstraint"] = {"topology": topology_name, **topology[groups[0]["gpu_model"]]}
        else:
            for sub, g in zip(spec["subGroups"], groups, strict=True):
                if g["gpu_model"] in topology:
                    sub["topologyConstraint"] = {"topology": topology_name, **topology[g["gpu_model"]]}

    data: dict[str, str] = {
        "envelope.json": json.dumps(
            {k: env[k] for k in ("job", "queue", "pod_group_name", "gpus", "nodes", "min_member",
                                 "node_groups")},
            indent=1, sort_keys=True),
    }
    if mb_map is not None:
        data["microbatch-map.json"] = json.dumps(mb_map, indent=1, sort_keys=True)
    configmap = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": cm_name, "namespace": namespace, "labels": {JOB_LABEL: name}},
        "data": data,
    }
    objects: list[dict[str, Any]] = [configmap, pod_group]

    templates = []
    for tmpl in env["pod_templates"]:
        sub = tmpl["metadata"]["labels"][KAI_SUBGROUP_LABEL]
        meta = {
            "labels": {**tmpl["metadata"]["labels"], **labels, "fleetwise.io/subgroup": sub},
            "annotations": dict(tmpl["metadata"]["annotations"]),
        }
        pod_spec = _pod_spec(tmpl, image, cm_name, job, command)
        if priority_class:
            pod_spec["priorityClassName"] = priority_class
        templates.append((sub, int(tmpl["replicas"]), meta, pod_spec))

    if workload == "pods":
        for sub, replicas, meta, pod_spec in templates:
            for i in range(replicas):
                objects.append({
                    "apiVersion": "v1", "kind": "Pod",
                    "metadata": {"name": f"{name}-{sub}-{i}"[:253], "namespace": namespace,
                                 **copy.deepcopy(meta)},
                    "spec": {**copy.deepcopy(pod_spec), "restartPolicy": "Never"},
                })
    elif workload == "jobset":
        objects.append({
            "apiVersion": JOBSET_API, "kind": "JobSet",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                         "annotations": {KAI_POD_GROUP_ANNOTATION: name}},
            "spec": {
                "failurePolicy": {"maxRestarts": 0},
                "replicatedJobs": [
                    {"name": sub, "replicas": 1, "template": {"spec": {
                        "parallelism": replicas, "completions": replicas, "backoffLimit": 0,
                        "completionMode": "Indexed",
                        "template": {"metadata": copy.deepcopy(meta),
                                     "spec": {**copy.deepcopy(pod_spec), "restartPolicy": "Never"}},
                    }}}
                    for sub, replicas, meta, pod_spec in templates
                ],
            },
        })
    else:  # pytorchjob
        if len(templates) != 1:
            kinds = ", ".join(sorted({g["gpu_model"] for g in groups}))
            raise RenderError(
                f"workload pytorchjob: a PyTorchJob has one Worker template, but this job needs "
                f"{len(templates)} pod shapes ({kinds}); use --workload jobset or pods")
        sub, replicas, meta, pod_spec = templates[0]
        pod_spec["containers"][0]["name"] = "pytorch"  # the training operator's container name

        def replica(n: int) -> dict[str, Any]:
            return {"replicas": n, "restartPolicy": "Never",
                    "template": {"metadata": copy.deepcopy(meta), "spec": copy.deepcopy(pod_spec)}}

        gang = {"queue": queue, "minAvailable": replicas}
        job_spec: dict[str, Any] = {"runPolicy": {"schedulingPolicy": gang}}
        if elastic is not None:
            # Elastic (torchrun --nnodes=min:max under the training operator): Workers only, so
            # a growth is more Worker replicas (the KAI consumer raises them).
            job_spec["elasticPolicy"] = {"rdzvBackend": "c10d", "minReplicas": elastic[0],
                                         "maxReplicas": elastic[1], "maxRestarts": ELASTIC_MAX_RESTARTS}
            job_spec["pytorchReplicaSpecs"] = {"Worker": replica(replicas)}
        else:
            job_spec["pytorchReplicaSpecs"] = {"Master": replica(1)}
            if replicas > 1:
                job_spec["pytorchReplicaSpecs"]["Worker"] = replica(replicas - 1)
        objects.append({
            "apiVersion": PYTORCHJOB_API, "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels),
                         "annotations": {KAI_POD_GROUP_ANNOTATION: name}},
            "spec": job_spec,
        })
    return objects


def render_plan(
    plan: Plan,
    job: str,
    queue: str,
    *,
    gpus_per_pod: int | None = None,
    namespace: str = "default",
    workload: str = "pods",
    image: str = DEFAULT_IMAGE,
    priority_class: str | None = None,
    preemptible: bool | None = None,
    topology_name: str = "fleetwise",
    with_topology: bool = True,
    command: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """`render_envelope` of the plan's envelope, its micro-batch map and topology needs; a
    PyTorchJob is elastic when the plan's intent lets the job grow (`max_gpus` above its size)."""
    env = kai_envelope(plan, job, queue, gpus_per_pod=gpus_per_pod, namespace=namespace)
    try:
        mb = microbatch_map(plan)
    except ExportError:
        mb = None  # a plan whose replicas do not sum to the batch has no map; the rest renders
    return render_envelope(
        env, mb_map=mb, namespace=namespace, workload=workload, image=image,
        priority_class=priority_class, preemptible=preemptible,
        topology=topology_needs(plan) if with_topology else None, topology_name=topology_name,
        command=command, elastic=_elastic_range(plan, env) if workload == "pytorchjob" else None,
    )


def _elastic_range(plan: Plan, envelope: Mapping[str, Any]) -> tuple[int, int] | None:
    """(min, max) pods of a job whose intent lets it grow or shrink (None: a fixed size): the
    intent's `min_gpus` / `max_gpus` in whole pods of the envelope's first group."""
    c = plan.constraints
    if c is None or (c.max_gpus is None and c.min_gpus is None) or not envelope["node_groups"]:
        return None
    per_pod = int(envelope["node_groups"][0]["gpus_per_pod"])
    pods = sum(int(g["pods"]) for g in envelope["node_groups"])
    high = max(pods, (c.max_gpus or 0) // per_pod)
    low = min(pods, max(1, -(-(c.min_gpus or per_pod) // per_pod)))
    return (low, high) if (low, high) != (pods, pods) else None


def render_queues(
    quotas: Mapping[str, float], parent: str | None = "fleetwise", over_quota_weight: float = 1.0,
) -> list[dict[str, Any]]:
    """KAI Queues: one per team with a GPU quota (GPUs), under one parent queue (whose quota
    is the sum). KAI quotas are per queue, not per GPU type (KAI #145, #1087): the per-type
    split stays in each job's envelope."""
    if not quotas:
        raise RenderError("queues: no team given (expected TEAM=GPUS)")
    out: list[dict[str, Any]] = []
    for team, gpus in quotas.items():
        if not team:
            raise RenderError("queues: empty team name")
        if gpus < 0:
            raise RenderError(f"queues: team {team!r} quota {gpus} must be >= 0")
    if parent:
        out.append(_queue(parent, float(sum(quotas.values())), None, over_quota_weight))
    for team, gpus in quotas.items():
        out.append(_queue(team, float(gpus), parent, over_quota_weight))
    return out


def _queue(name: str, gpus: float, parent: str | None, weight: float) -> dict[str, Any]:
    spec: dict[str, Any] = {"resources": {
        "gpu": {"quota": gpus, "limit": -1, "overQuotaWeight": weight},
        "cpu": {"quota": -1, "limit": -1, "overQuotaWeight": weight},
        "memory": {"quota": -1, "limit": -1, "overQuotaWeight": weight},
    }}
    if parent:
        spec["parentQueue"] = parent
    return {"apiVersion": "scheduling.run.ai/v2", "kind": "Queue", "metadata": {"name": name}, "spec": spec}


def render_topology(
    name: str = "fleetwise", levels: Sequence[str] = DEFAULT_TOPOLOGY_LEVELS,
) -> dict[str, Any]:
    """A KAI Topology (`kai.scheduler/v1alpha1`) whose levels are node labels, widest first."""
    if not levels:
        raise RenderError("topology: at least one level is needed")
    return {"apiVersion": "kai.scheduler/v1alpha1", "kind": "Topology", "metadata": {"name": name},
            "spec": {"levels": [{"nodeLabel": level} for level in levels]}}


def dump_yaml(objects: Sequence[Mapping[str, Any]]) -> str:
    """A multi-document YAML stream (`kubectl apply -f -`)."""
    return yaml.dump_all([dict(o) for o in objects], Dumper=_Dumper, sort_keys=False,
                         default_flow_style=False)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's JSON) as literal blocks, so the YAML stays readable."""


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _str)
