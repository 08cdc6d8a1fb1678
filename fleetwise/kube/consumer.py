"""The KAI-side consumer: carries out `fleetwise.commands.kube` on a Kubernetes cluster.

Two layers:

- the decision (pure): `decide(command, view, ...) -> Decision`, a list of intended API
  `Action`s from a command and a `ClusterView` (the few objects it touches, read from the
  cluster). It reads the cluster's state, not the consumer's memory, so a consumer restarted
  mid-command recomputes what is left (each action is idempotent: cordoning a cordoned node,
  an event that exists, evicting a pod already terminating are no-ops);
- `KubeConsumer`: the lifecycle of DESIGN.md "Command lifecycle" (duplicate by id first, then
  `verify_command`, then `requires`, then act, then ack on `fleetwise.acks` as
  "kube-consumer"), over an `Api` adapter: `ClientApi` (the official `kubernetes` client),
  `DryRunApi` (prints the calls, changes nothing).

What each command does:

- `drain` (node[, gpu][, job]): refused (a `rejected` ack) when it would take the cluster past
  the fleet drain cap (the policy's `rails`: GPUs in the nodes' drained sets, counted on the
  cluster before each new drain; one consumer runs per cluster, so its drains are decided one
  at a time however many workers sent them); else cordon, taint
  `fleetwise.io/drain=<reason>:NoSchedule`, an Event with the reason (all at once: nothing new
  lands there), then, only once every id in
  `requires` (the training side's checkpoint) has a `done` ack, lower the job's PodGroup gang
  by the pods that leave (so KAI does not hold the rest of the gang) and evict the job's pods
  on the node through the Eviction API (PodDisruptionBudgets apply: a refused eviction, HTTP
  429, is retried on the next tick);
- `resize` (`world_size`, `leave`, `join`, `samples`): the PodGroup's minMember and subGroups
  follow the GPUs per type that remain (whole pods), and the envelope ConfigMap records the new
  world size and shares, so KAI reschedules within the new envelope; GPUs that join get pods
  (a job of bare pods: copies of one of its pods, held to the joining node; pods of a JobSet or
  PyTorchJob are their controller's to add), in a new subgroup when the node's GPU product (or
  the pod shape) is one the job did not have;
- `migrate` (`phase`, `checkpoint_uri`, `destination`): a `transfer` with `destination.gpus`
  moves the job (the gang re-targeted to the destination, its pods made there as a growth's,
  the old ones evicted; a PyTorchJob's Worker template re-targeted; a JobSet, whose replicated
  jobs cannot change, deleted and made again for the destination); otherwise the PodGroup and
  the envelope ConfigMap record the phase and destination (a `restore` with
  `destination.gpu_product` and `pods` re-targets the gang);
- `consolidate`: `action: hibernate` cordons the node and labels it
  `fleetwise.io/hibernate=true` (after the moves in `requires` are done); `action: wake`
  removes the label and uncordons (work returns); `action: move` (after the job's checkpoint)
  replaces the job's pods on every node whose GPU count the moves change, the gang following;
- a GPU return (`OperatorAction(action="return_gpu")` on `fleetwise.operator`, signed under the
  operators' keys: `verify_operator`): the GPU leaves the node's drained set; when none is
  left the drain taint goes and the node is uncordoned (only if Fleetwise cordoned it).

The consumer's state lives on the cluster: annotation `fleetwise.io/commands` on the node (or
PodGroup) maps recent command ids to their phase ("applied", "done"); `fleetwise.io/last-seq`
on a job's PodGroup is the last command `seq` applied for it (a restart resumes the sequence).
"""

from __future__ import annotations

import copy
import hashlib
import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from fleetwise.actuators.config import Rails
from fleetwise.actuators.signing import Keyring, operator_keyring, verify_command, verify_operator
from fleetwise.catalog import UnknownGpuError, lookup
from fleetwise.kube.render import (
    ANN_SUBGROUPS,
    GPU_COUNT_LABEL,
    JOB_LABEL,
    JOBSET_API,
    envelope_configmap_name,
    pod_group_name,
)
from fleetwise.planner.exports import GFD_PRODUCT_LABEL, KAI_SUBGROUP_LABEL
from fleetwise.schemas import Ack, Command, JobEnd, OperatorAction

__all__ = [
    "ANN_COMMANDS",
    "ANN_CORDONED_BY",
    "ANN_DRAINED_GPUS",
    "ANN_JOINED_BY",
    "ANN_LAST_SEQ",
    "BY",
    "DRAIN_TAINT",
    "HIBERNATE_LABEL",
    "Action",
    "ActionResult",
    "Api",
    "ClientApi",
    "ClusterView",
    "Decision",
    "DryRunApi",
    "KubeConsumer",
    "count_drained",
    "decide",
    "decide_return",
    "fleet_cap_refusal",
    "required_rbac",
]

BY = "kube-consumer"
DRAIN_TAINT = "fleetwise.io/drain"
HIBERNATE_LABEL = "fleetwise.io/hibernate"
ANN_COMMANDS = "fleetwise.io/commands"  # JSON {command id: "applied" | "done"}, most recent last
ANN_DRAINED_GPUS = "fleetwise.io/drained-gpus"  # JSON list of drained GPU indices (-1: the node)
ANN_CORDONED_BY = "fleetwise.io/cordoned-by"  # "drain" | "hibernate": we uncordon only our own
ANN_MIGRATION = "fleetwise.io/migration"
ANN_WORLD_SIZE = "fleetwise.io/world-size"
ANN_MOVES = "fleetwise.io/consolidation"
ANN_GANG_LEFT = "fleetwise.io/gang-left"  # JSON list of pods the gang no longer counts
ANN_LAST_SEQ = "fleetwise.io/last-seq"  # the job's last applied command seq (on its PodGroup)
ANN_JOINED_BY = "fleetwise.io/joined-by"  # on a pod a resize created: the command's id
ANN_REBUILT_BY = "fleetwise.io/rebuilt-by"  # on a JobSet a move made again: the command's id
JOBSET_KEY = "jobset.json"  # in the envelope ConfigMap: the JobSet a move makes again (read on a resume)
ANN_WORKLOAD = "fleetwise.io/workload-replicas"  # a growth's PyTorchJob Worker replicas (a resume: the same)
HOSTNAME_LABEL = "kubernetes.io/hostname"
KEEP_IDS = 32  # command ids remembered per object
NODE_PAGE = 500  # nodes per list call when counting drained GPUs (a large cluster is never held whole)
EVENT_NAMESPACE = "default"  # where `kubectl describe node` looks for a Node's events
KUBE_TYPES = frozenset({"drain", "resize", "migrate", "consolidate"})


# ---- the cluster as the decision sees it ---------------------------------------------------------


def _command_nodes(command: Command) -> set[str]:
    """The nodes a command's decision reads: its node, a resize's leaving and joining nodes, a
    migration's destination, a consolidation's moves' ends."""
    names = {command.node} if command.node else set()
    dest = command.params.get("destination") or {}
    for pairs in (command.params.get("leave"), command.params.get("join"), dest.get("gpus")):
        names |= {str(p[0]) for p in pairs or [] if p}
    for move in command.params.get("moves") or []:  # a consolidation's
        names |= {str(move[end]["node"]) for end in ("from", "to") if isinstance(move.get(end), Mapping)}
    return names


@dataclass
class ClusterView:
    """What the decision reads: nodes by name, the job's pods, its PodGroup and ConfigMap.

    Nodes: {"labels": {}, "annotations": {}, "unschedulable": bool, "taints": [{key, value,
    effect}], "gpus": int (capacity `nvidia.com/gpu`; absent: unknown)}. Pods: {"name",
    "namespace", "node", "deleting": bool, "subgroup", "owner": "Kind/name" of its controller or
    None, "phase", "manifest": {"metadata": {labels, annotations}, "spec"} (what a new pod copies)}.
    pod_group: {"name", "namespace", "spec", "annotations"} or None. configmap: {"name",
    "namespace", "data"} or None. workload: the controller object that owns the job's pods, or
    None: {"kind": "PyTorchJob" | "JobSet", "name", "namespace", "spec", "labels", "annotations"}.
    """

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: list[dict[str, Any]] = field(default_factory=list)
    pod_group: dict[str, Any] | None = None
    configmap: dict[str, Any] | None = None
    workload: dict[str, Any] | None = None  # the PyTorchJob or JobSet owning the job's pods

    @classmethod
    def assumed(cls, command: Command, namespace: str = "default", pods_per_node: int = 1) -> ClusterView:
        """A plausible cluster for a dry run without one: the command's nodes exist, schedulable,
        each running `pods_per_node` pods of the job."""
        names = _command_nodes(command)
        view = cls(nodes={n: {"labels": {}, "annotations": {}, "unschedulable": False, "taints": []}
                          for n in sorted(names)})
        if command.job:
            pg = pod_group_name(command.job)
            view.pods = [{"name": f"{pg}-{n}-{i}", "namespace": namespace, "node": n, "deleting": False}
                         for n in sorted(names) for i in range(pods_per_node)]
        return view


@dataclass(frozen=True)
class Action:
    """One intended API call. `verb`: patch | create | evict | delete. `kind`: Node, Event, Pod,
    PodGroup, ConfigMap, PyTorchJob, JobSet. `patch`: "strategic" or "merge" for patches."""

    verb: str
    kind: str
    name: str
    body: Mapping[str, Any]
    why: str
    namespace: str | None = None
    patch: str = "strategic"

    def path(self) -> str:
        ns = f"/namespaces/{self.namespace}" if self.namespace else ""
        if self.kind == "Node":
            return f"/api/v1/nodes/{self.name}"
        if self.kind == "Event":
            return f"/api/v1{ns}/events"
        if self.kind == "Pod":
            return f"/api/v1{ns}/pods" if self.verb == "create" else f"/api/v1{ns}/pods/{self.name}/eviction"
        if self.kind == "ConfigMap":
            return f"/api/v1{ns}/configmaps/{self.name}"
        if self.kind == "PodGroup":
            return f"/apis/scheduling.run.ai/v2alpha2{ns}/podgroups/{self.name}"
        if self.kind == "PyTorchJob":
            return f"/apis/kubeflow.org/v1{ns}/pytorchjobs/{self.name}"
        if self.kind == "JobSet":
            base = f"/apis/{JOBSET_API}{ns}/jobsets"
            return base if self.verb == "create" else f"{base}/{self.name}"
        raise ValueError(f"unknown kind {self.kind!r}")

    def describe(self) -> str:
        """The HTTP call, as `--dry-run` prints it."""
        method = {"patch": "PATCH", "create": "POST", "evict": "POST", "delete": "DELETE"}[self.verb]
        ctype = f" ({self.patch}-merge-patch)" if self.verb == "patch" and self.patch == "strategic" else (
            " (merge-patch)" if self.verb == "patch" else "")
        body = json.dumps(self.body, sort_keys=True, separators=(",", ":"))
        return f"{method} {self.path()}{ctype} {body}  # {self.why}"

    def to_dict(self) -> dict[str, Any]:
        return {"verb": self.verb, "kind": self.kind, "name": self.name, "namespace": self.namespace,
                "why": self.why}


@dataclass
class Decision:
    """What to do now (`actions`), whether more waits on `requires` (`waiting`), and whether
    the command is complete once the actions succeed (`done`); `error` refuses it."""

    actions: list[Action] = field(default_factory=list)
    finish: list[Action] = field(default_factory=list)  # run only when every action succeeded
    waiting: list[str] = field(default_factory=list)
    done: bool = False
    error: str | None = None
    detail: str = ""


# ---- pure decision ---------------------------------------------------------------------------


def _ids(annotations: Mapping[str, str]) -> dict[str, str]:
    try:
        data = json.loads(annotations.get(ANN_COMMANDS, "{}"))
    except json.JSONDecodeError:
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _int_or_none(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def command_phase(annotations: Mapping[str, str], command_id: str) -> str | None:
    """The phase the cluster records for a command ("applied", "done") or None."""
    return _ids(annotations).get(command_id)


def _with_id(annotations: Mapping[str, str], command_id: str, phase: str) -> str:
    ids = _ids(annotations)
    ids.pop(command_id, None)
    ids[command_id] = phase
    return json.dumps(dict(list(ids.items())[-KEEP_IDS:]), separators=(",", ":"))


def _drained(annotations: Mapping[str, str]) -> list[int]:
    try:
        return sorted({int(x) for x in json.loads(annotations.get(ANN_DRAINED_GPUS, "[]"))})
    except (json.JSONDecodeError, TypeError, ValueError):
        return []


def count_drained(nodes: Iterable[Mapping[str, Any]]) -> tuple[int, int]:
    """(GPUs in the nodes' drained sets, GPUs on the nodes). A whole node drained counts its
    GPUs (at least one when its capacity is unknown)."""
    drained = total = 0
    for node in nodes:
        gpus = int(node.get("gpus") or 0)
        total += gpus
        listed = _drained(node.get("annotations") or {})
        drained += max(gpus, 1) if -1 in listed else len(listed)
    return drained, total


def fleet_cap_refusal(command: Command, view: ClusterView, drained: int, total: int,
                      rails: Rails) -> str | None:
    """Why a drain is refused by the fleet drain cap (None: it is not). The workers' rule
    (`ActionPolicy`): no new drain while as many GPUs as the cap are out. Only a drain that
    adds to the drained set is refused: a GPU already in its node's drained set (the same drain
    resumed, or another drain of it) is not a new one."""
    node = view.nodes.get(command.node or "")
    if node is None:
        return None  # the decision reports the missing node
    listed = _drained(node.get("annotations") or {})
    if -1 in listed or (command.gpu is not None and int(command.gpu) in listed):
        return None
    cap = rails.fleet_drain_cap(total)
    if drained < cap:
        return None
    where = f"{command.node}/gpu{command.gpu}" if command.gpu is not None else f"node {command.node}"
    return (f"fleet drain cap: {drained} of {total or 'unknown'} GPUs on the cluster are drained (cap "
            f"{cap}): drain of {where} refused")


def _taint_value(reason: str) -> str:
    """A label-value-safe form of the reason (<= 63 chars of [A-Za-z0-9._-])."""
    text = "".join(c if c.isalnum() or c in "._-" else "-" for c in reason)
    text = "-".join(p for p in text.split("-") if p)[:63].strip("._-")
    return text or "fleetwise"


def event_name(command_id: str, target: str) -> str:
    """A deterministic Event name: re-creating it after a crash is a 409, not a second event."""
    return f"fleetwise.{hashlib.sha256(f'{command_id}|{target}'.encode()).hexdigest()[:16]}"


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _event(command: Command, node: str, reason: str, message: str, now: float) -> Action:
    body = {
        "metadata": {"name": event_name(command.id, node), "namespace": EVENT_NAMESPACE,
                     "labels": {"fleetwise.io/command": command.id[:63]}},
        "involvedObject": {"kind": "Node", "name": node, "apiVersion": "v1"},
        "reason": reason, "message": message[:1024], "type": "Warning",
        "source": {"component": "fleetwise-kube-consumer"},
        "reportingComponent": "fleetwise-kube-consumer", "reportingInstance": "fleetwise",
        "firstTimestamp": _iso(now), "lastTimestamp": _iso(now), "count": 1,
    }
    return Action("create", "Event", body["metadata"]["name"], body, f"record {reason} on {node}",
                  namespace=EVENT_NAMESPACE)


def _node_patch(node: str, why: str, *, unschedulable: bool | None = None,
                labels: Mapping[str, str | None] | None = None,
                annotations: Mapping[str, str | None] | None = None,
                taints: Sequence[Mapping[str, Any]] | None = None,
                resource_version: str | None = None) -> Action:
    """A strategic-merge patch of a node. Node taints have no merge key (the list is replaced
    whole), so `taints` is the full new list, sent with the `resource_version` it was computed
    from: a node changed meanwhile answers 409 and the consumer re-reads it."""
    body: dict[str, Any] = {"metadata": {}}
    if labels:
        body["metadata"]["labels"] = dict(labels)
    if annotations:
        body["metadata"]["annotations"] = dict(annotations)
    spec: dict[str, Any] = {}
    if unschedulable is not None:
        spec["unschedulable"] = unschedulable
    if taints is not None:
        spec["taints"] = [dict(t) for t in taints]
        if resource_version:
            body["metadata"]["resourceVersion"] = resource_version
    if spec:
        body["spec"] = spec
    if not body["metadata"]:
        del body["metadata"]
    return Action("patch", "Node", node, body, why)


def _gang_patch(pg: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], why: str) -> Action | None:
    """The PodGroup no longer counting `pods` in its gang (None: it already does not).

    Idempotent: the pods let go are listed on the PodGroup (`fleetwise.io/gang-left`), so a
    retried drain does not shrink the gang twice. KAI would otherwise hold (or evict) the rest
    of a gang that fell below minMember."""
    ann = pg.get("annotations", {})
    try:
        left = set(json.loads(ann.get(ANN_GANG_LEFT, "[]")))
    except (json.JSONDecodeError, TypeError):
        left = set()
    newly = [p for p in pods if p["name"] not in left]
    if not newly:
        return None
    spec = pg.get("spec", {})
    subs = [dict(s) for s in spec.get("subGroups", [])]
    for sub in subs:
        gone = sum(1 for p in newly if p.get("subgroup") == sub["name"])
        sub["minMember"] = max(0, int(sub.get("minMember", 1)) - gone)
    body: dict[str, Any] = {
        "metadata": {"annotations": {ANN_GANG_LEFT: json.dumps(sorted(left | {p["name"] for p in newly}))}},
        "spec": {"minMember": max(1, int(spec.get("minMember", 1)) - len(newly))},
    }
    if subs:
        body["spec"]["subGroups"] = [s for s in subs if s["minMember"] >= 1]
    return Action("patch", "PodGroup", pg["name"], body, why, namespace=pg.get("namespace"), patch="merge")


def _subgroups(pg: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    if not pg:
        return {}
    try:
        data = json.loads(pg.get("annotations", {}).get(ANN_SUBGROUPS, "{}"))
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def decide(
    command: Command, view: ClusterView, *, done_ids: Iterable[str] = (), now: float = 0.0,
) -> Decision:
    """The API calls a verified command needs now, given the cluster (pure).

    `done_ids`: command ids whose `done` ack was seen (to release what waits on `requires`).
    """
    done = set(done_ids)
    waiting = [r for r in command.requires if r not in done]
    if command.type == "drain":
        return _decide_drain(command, view, waiting, now)
    if command.type == "resize":
        return _decide_resize(command, view, waiting)
    if command.type == "migrate":
        return _decide_migrate(command, view, waiting)
    if command.type == "consolidate":
        return _decide_consolidate(command, view, waiting)
    return Decision(error=f"type {command.type!r}: not a Kubernetes command (handled: "
                          f"{', '.join(sorted(KUBE_TYPES))})")


def _node_or_error(command: Command, view: ClusterView) -> tuple[dict[str, Any] | None, str | None]:
    if not command.node:
        return None, f"{command.type}: the command names no node"
    node = view.nodes.get(command.node)
    if node is None:
        return None, f"{command.type}: node {command.node!r} not found on the cluster"
    return node, None


def _decide_drain(command: Command, view: ClusterView, waiting: list[str], now: float) -> Decision:
    node, error = _node_or_error(command, view)
    if error:
        return Decision(error=error)
    assert node is not None and command.node is not None
    name = command.node
    ann = node.get("annotations", {})
    out = Decision(waiting=waiting)
    gpus = _drained(ann)
    gpu = -1 if command.gpu is None else int(command.gpu)
    has_taint = any(t.get("key") == DRAIN_TAINT for t in node.get("taints") or [])
    where = f"{name}/gpu{command.gpu}" if command.gpu is not None else name
    first = command_phase(ann, command.id) is None
    patch_ann: dict[str, str | None] = {}
    if gpu not in gpus:
        patch_ann[ANN_DRAINED_GPUS] = json.dumps(sorted({*gpus, gpu}))
    if first:
        patch_ann[ANN_COMMANDS] = _with_id(ann, command.id, "applied")
    cordon = not node.get("unschedulable")
    if cordon:
        patch_ann[ANN_CORDONED_BY] = "drain"
    taint = [] if has_taint else [{"key": DRAIN_TAINT, "value": _taint_value(command.reason),
                                   "effect": "NoSchedule"}]
    if first:
        # The Event goes before the node records the command: a crash in between re-creates it
        # (a 409, as its name is the command's), so it cannot be lost nor doubled.
        out.actions.append(_event(command, name, "FleetwiseDrain", f"{where}: {command.reason}", now))
    if cordon or taint or patch_ann:
        out.actions.append(_node_patch(name, f"cordon and taint {where}: {command.reason}",
                                       unschedulable=True if cordon else None, annotations=patch_ann,
                                       taints=[*(node.get("taints") or []), *taint] if taint else None,
                                       resource_version=node.get("resourceVersion")))
    pods = [p for p in view.pods if p.get("node") == name and not p.get("deleting")] if command.job else []
    if waiting:
        out.detail = (f"cordoned and tainted {where}; evicting {len(pods)} pod(s) of {command.job} after "
                      f"{', '.join(waiting)} is done")
        return out
    if pods and view.pod_group is not None:
        gang = _gang_patch(view.pod_group, pods, f"the gang of {command.job} lets go of the pods on {name}")
        if gang is not None:
            out.actions.append(gang)
    if pods:
        for p in pods:
            out.actions.append(_evict(p, f"evict {p['name']} of {command.job} from {name} (checkpoint done)"))
    out.finish.append(_node_patch(name, f"{command.id} done", annotations={
        ANN_COMMANDS: _with_id(ann, command.id, "done")}))
    out.done = True
    out.detail = f"drained {where}: cordoned, tainted, {len(pods)} pod(s) evicted"
    return out


def _needs_pg(command: Command, view: ClusterView, waiting: list[str]) -> Decision | None:
    if not command.job:
        return Decision(error=f"{command.type}: the command names no job")
    if view.pod_group is None:
        return Decision(
            error=f"{command.type}: no PodGroup labelled {JOB_LABEL}={pod_group_name(command.job)}")
    if waiting:
        return Decision(waiting=waiting, detail=f"waiting for {', '.join(waiting)}")
    return None


def _cm_patch(view: ClusterView, command: Command, key: str, value: Mapping[str, Any], why: str) -> Action:
    default = envelope_configmap_name(pod_group_name(command.job or ""))
    name = view.configmap["name"] if view.configmap else default
    ns = view.configmap["namespace"] if view.configmap else (view.pod_group or {}).get("namespace")
    return Action("patch", "ConfigMap", name, {"data": {key: json.dumps(value, sort_keys=True)}}, why,
                  namespace=ns, patch="merge")


def _per_node(items: Iterable[Sequence[Any]] | None) -> dict[str, int]:
    """GPUs per node of a resize's `leave` / `join` list ([node, gpu] pairs), nodes sorted."""
    out: dict[str, set[Any]] = {}
    for item in items or []:
        if item:
            out.setdefault(str(item[0]), set()).add(item[1] if len(item) > 1 else None)
    return {n: len(g) for n, g in sorted(out.items())}


def _leaving_subgroup(node: str, view: ClusterView, subs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The subgroup the GPUs leaving `node` count in: that of the job's pod there, else the
    first of the node's GPU product."""
    for p in view.pods:
        if p.get("node") == node and p.get("subgroup") in subs:
            return str(p["subgroup"])
    product = view.nodes.get(node, {}).get("labels", {}).get(GFD_PRODUCT_LABEL)
    return next((k for k, v in sorted(subs.items()) if product and v.get("product") == product), None)


Join = tuple[str, str, str, int, int]  # (subgroup, node, GPU product, pods, GPUs per pod)


def _place(per_node: Mapping[str, int], view: ClusterView, subs: dict[str, dict[str, Any]],
           unknown: list[str]) -> list[Join]:
    """Where GPUs joining on each node go: a subgroup of `subs` whose pods they fill exactly, or
    one made for them (another GPU product, or another pod shape), added to `subs` with no pods
    yet. Nodes without a known GPU product are appended to `unknown`."""
    joins: list[Join] = []
    for node, count in per_node.items():
        product = view.nodes.get(node, {}).get("labels", {}).get(GFD_PRODUCT_LABEL)
        if not product:
            unknown.append(node)
            continue
        sub = _joining_subgroup(product, count, subs)
        if sub is None:
            sub, model = _new_subgroup(product, count, subs)
            subs[sub] = {"product": product, "gpus_per_pod": count, "pods": 0,
                         **({"gpu_model": model} if model else {})}
        per_pod = int(subs[sub]["gpus_per_pod"])
        joins.append((sub, node, product, count // per_pod, per_pod))
    return joins


def _evict(pod: Mapping[str, Any], why: str) -> Action:
    """An eviction through the Eviction API (PodDisruptionBudgets apply; never a delete)."""
    return Action("evict", "Pod", pod["name"], {
        "apiVersion": "policy/v1", "kind": "Eviction",
        "metadata": {"name": pod["name"], "namespace": pod["namespace"]}}, why, namespace=pod["namespace"])


def _joining_subgroup(product: str, gpus: int, subs: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The existing subgroup of `product` whose pods the `gpus` joining on one node fill exactly
    (the largest such pod), or None: they need a subgroup of their own."""
    fits = [(int(v.get("gpus_per_pod", 1)), k) for k, v in subs.items()
            if v.get("product") == product and gpus % max(1, int(v.get("gpus_per_pod", 1))) == 0]
    return max(fits)[1] if fits else None


def _new_subgroup(product: str, gpus: int, subs: Mapping[str, Any]) -> tuple[str, str | None]:
    """(name, catalog model id) of a new subgroup for `gpus`-GPU pods of `product`, named as
    `kai_envelope` names a plan's groups: the model id, with `-x<GPUs>` when the name is taken."""
    try:
        model: str | None = lookup(product).id
    except UnknownGpuError:  # a product the catalog does not know: named after the label
        model = None
    base = pod_group_name((model or product).lower())
    for name in (base, f"{base}-x{gpus}", *(f"{base}-x{gpus}-{i}" for i in range(2, 100))):
        if name not in subs:
            return name, model
    raise ValueError(f"no free subgroup name for {product}")


def _pinned_spec(pod_spec: Mapping[str, Any], product: str, gpus: int,
                 nodes: Sequence[str]) -> dict[str, Any]:
    """A copy of a pod spec asking for `gpus` GPUs of `product` per pod and held to `nodes` (the
    GPUs the control plane chose) by required node affinity; KAI still schedules it with the gang."""
    spec = copy.deepcopy(dict(pod_spec))
    for key in ("nodeName", "priority"):  # set by the scheduler / the priority admission plugin
        spec.pop(key, None)
    # The service-account token volume is the admission plugin's: the new pod gets its own.
    tokens = {v.get("name") for v in spec.get("volumes", [])
              if str(v.get("name", "")).startswith("kube-api-access-")}
    if tokens:
        spec["volumes"] = [v for v in spec["volumes"] if v.get("name") not in tokens]
    for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        if tokens and c.get("volumeMounts"):
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m.get("name") not in tokens]
        for part in ("limits", "requests"):
            res = c.get("resources", {}).get(part)
            if res and "nvidia.com/gpu" in res:
                res["nvidia.com/gpu"] = str(gpus)
    if GFD_PRODUCT_LABEL in spec.get("nodeSelector", {}):
        spec["nodeSelector"][GFD_PRODUCT_LABEL] = product
    pin = {"key": HOSTNAME_LABEL, "operator": "In", "values": list(nodes)}
    required = (spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
                .setdefault("requiredDuringSchedulingIgnoredDuringExecution", {}))
    # Terms are ORed: the node pin (and the GPU terms) go into every one of them.
    terms = required["nodeSelectorTerms"] = required.get("nodeSelectorTerms") or [{}]
    for term in terms:
        exprs = [e for e in term.get("matchExpressions", []) if e.get("key") != HOSTNAME_LABEL]
        for e in exprs:
            if e.get("key") == GFD_PRODUCT_LABEL:
                e["values"] = [product]
        exprs = [e for e in exprs if e.get("key") != GPU_COUNT_LABEL]
        if gpus > 1:
            exprs.append({"key": GPU_COUNT_LABEL, "operator": "Gt", "values": [str(gpus - 1)]})
        term["matchExpressions"] = [*exprs, pin]
    return spec


def _joining_pod(template: Mapping[str, Any], *, name: str, namespace: str, subgroup: str, product: str,
                 gpus: int, node: str, command_id: str) -> dict[str, Any]:
    """A new pod of the job for GPUs joining on `node`: a copy of one of its running pods, in
    `subgroup`, asking for `gpus` GPUs of `product`, held to `node` (`_pinned_spec`)."""
    meta = template.get("metadata", {})
    spec = _pinned_spec(template.get("spec", {}), product, gpus, [node])
    labels = {**(meta.get("labels") or {}), KAI_SUBGROUP_LABEL: subgroup, "fleetwise.io/subgroup": subgroup}
    annotations = {**(meta.get("annotations") or {}), ANN_JOINED_BY: command_id}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
            "spec": spec}


def _live(pod: Mapping[str, Any]) -> bool:
    """Not being deleted and not ended (pending, running or unknown)."""
    return not pod.get("deleting") and pod.get("phase") not in ("Succeeded", "Failed")


def _pods_detail(created: Sequence[str], skipped: str, evicted: Sequence[Mapping[str, Any]]) -> str:
    """The pods part of an ack's detail."""
    return ((f"; pods created: {', '.join(created)}" if created else "") + (f"; {skipped}" if skipped else "")
            + (f"; evicted: {', '.join(p['name'] for p in evicted)}" if evicted else ""))


def _joined_by(pod: Mapping[str, Any]) -> str | None:
    """The command that created a pod (a growth's or a move's), or None."""
    return (pod.get("manifest") or {}).get("metadata", {}).get("annotations", {}).get(ANN_JOINED_BY)


def _template_pod(view: ClusterView, subgroup: str, product: str) -> Mapping[str, Any] | None:
    """A pod of the job to copy for `subgroup`: one of that subgroup, else one on a node of the
    same product, else any (pods being deleted are not copied)."""
    live = [p for p in view.pods if p.get("manifest") and not p.get("deleting")]
    same = [p for p in live if p.get("subgroup") == subgroup]
    if same:
        return same[0]
    node_product = [p for p in live if product == view.nodes.get(p.get("node") or "", {})
                    .get("labels", {}).get(GFD_PRODUCT_LABEL)]
    return (node_product or live or [None])[0]


def _decide_resize(command: Command, view: ClusterView, waiting: list[str]) -> Decision:
    early = _needs_pg(command, view, waiting)
    if early is not None:
        return early
    pg = view.pod_group
    assert pg is not None
    params = command.params
    ann = pg.get("annotations", {})
    subs = _subgroups(pg)
    # A consumer that stopped after the PodGroup took the resize ("applied") only creates the
    # pods still missing: recounting the gang from the updated annotation would count it twice.
    resumed = command_phase(ann, command.id) == "applied"
    new_subs = {k: dict(v) for k, v in subs.items()}
    gpus = {k: int(v.get("pods", 0)) * int(v.get("gpus_per_pod", 1)) for k, v in subs.items()}
    unknown: list[str] = []
    for node, count in _per_node(params.get("leave")).items():
        sub = _leaving_subgroup(node, view, subs)
        if sub is None:
            unknown.append(node)
        else:
            gpus[sub] -= count
    joins = _place(_per_node(params.get("join")), view, new_subs, unknown)
    scale: tuple[list[Action], dict[str, Any] | None, str] | None = None
    if _owned_by(view, "PyTorchJob") and joins:  # a PyTorchJob's: more Worker replicas, of its one template
        scale = _scale_pytorchjob(command, view, joins, ann if resumed else None)
        fits = set(scale[1]["nodes"]) if scale[1] else set()
        joins = [j for j in joins if j[1] in fits]
    for sub, _node, _product, pods, per_pod in joins:
        gpus[sub] = gpus.get(sub, 0) + pods * per_pod
    for name, info in new_subs.items():
        per_pod = max(1, int(info.get("gpus_per_pod", 1)))
        held = max(0, gpus.get(name, 0))
        new_subs[name] = {**info, "pods": held // per_pod, "gpus": held}
    kept = _spec_subgroups(pg, new_subs, keep_others=True)
    has_subs = bool(pg.get("spec", {}).get("subGroups") or new_subs)
    total = sum(int(s["minMember"]) for s in kept) if kept else int(pg.get("spec", {}).get("minMember", 1))
    world = params.get("world_size")
    out = Decision(done=True)
    scaled = {ANN_WORKLOAD: json.dumps(scale[1], sort_keys=True)} if scale and scale[1] else {}
    if not resumed:
        body: dict[str, Any] = {
            "metadata": {"annotations": {ANN_SUBGROUPS: json.dumps(new_subs, sort_keys=True),
                                         ANN_COMMANDS: _with_id(ann, command.id, "applied"), **scaled,
                                         **({ANN_WORLD_SIZE: str(world)} if world is not None else {})}},
            "spec": {"minMember": max(1, total), **({"subGroups": kept} if has_subs else {})},
        }
        out.actions.append(Action("patch", "PodGroup", pg["name"], body,
                                  f"{command.job} resized to {world} ranks: gang {max(1, total)} pod(s)",
                                  namespace=pg.get("namespace"), patch="merge"))
        out.actions.append(_cm_patch(view, command, "resize.json", {
            "command": command.id, "world_size": world, "samples": params.get("samples", {}),
            "leave": params.get("leave", []), "join": params.get("join", [])},
            "the envelope records the new world size and shares"))
    if scale is not None:
        out.actions += scale[0]
        created, skipped = [], scale[2]
    else:
        created, skipped = _joining_pods(command, view, joins, out)
    out.finish.append(_pg_done(pg, command))
    out.detail = f"PodGroup {pg['name']}: minMember {max(1, total)}" + _pods_detail(created, skipped, []) + (
        f"; nodes without a known GPU product: {', '.join(sorted(set(unknown)))}" if unknown else "")
    return out


def _scale_pytorchjob(command: Command, view: ClusterView, joins: Sequence[Join],
                      resumed: Mapping[str, str] | None) -> tuple[list[Action], dict[str, Any] | None, str]:
    """A growth of a job whose pods a PyTorchJob owns: its Worker replicas raised by the pods
    the joins fill with its one template's GPUs (product and GPUs per pod); the training
    operator makes them and KAI places them. (actions, the record kept on the PodGroup, detail).
    The replica count is absolute and recorded, so a resumed consumer sets the same one."""
    wl = view.workload
    assert wl is not None
    worker = (wl["spec"].get("pytorchReplicaSpecs") or {}).get("Worker")
    if not worker or not wl["spec"].get("elasticPolicy"):
        return [], None, (f"no pod added: PyTorchJob {wl['name']} is not elastic (no elasticPolicy and "
                          "Worker replicas to raise)")
    tmpl = (worker.get("template") or {}).get("spec") or {}
    product = (tmpl.get("nodeSelector") or {}).get(GFD_PRODUCT_LABEL)
    per_pod = next((int(c["resources"]["limits"]["nvidia.com/gpu"]) for c in tmpl.get("containers", [])
                    if "nvidia.com/gpu" in (c.get("resources") or {}).get("limits", {})), 0)
    fit = [j for j in joins if j[2] == product and j[4] == per_pod and j[3]]
    other = sorted({j[1] for j in joins if j not in fit})
    before = json.loads(resumed.get(ANN_WORKLOAD, "{}")) if resumed is not None else {}
    if before.get("command") == command.id:
        target = int(before["Worker"])
    else:
        target = int(worker.get("replicas", 0)) + sum(j[3] for j in fit)
    limit = wl["spec"]["elasticPolicy"].get("maxReplicas")
    if limit is not None and target > int(limit):
        return [], None, (f"no pod added: {target} Worker replicas would pass PyTorchJob {wl['name']}'s "
                          f"elasticPolicy.maxReplicas {limit}")
    unfit = (f"; GPUs not of its template ({product}, {per_pod} per pod), no pod for them: {', '.join(other)}"
             if other else "")
    if not fit:
        return [], None, f"no pod added{unfit}"
    action = Action("patch", "PyTorchJob", wl["name"], {"spec": {"pytorchReplicaSpecs": {"Worker": {
        "replicas": target}}}}, f"{command.job} grows: {target} Worker replicas (the operator adds pods)",
        namespace=wl["namespace"], patch="merge")
    record = {"command": command.id, "Worker": target, "nodes": [j[1] for j in fit]}
    return [action], record, f"PyTorchJob {wl['name']}: Worker replicas {target}{unfit}"


def _joining_pods(command: Command, view: ClusterView, joins: Sequence[Join],
                  out: Decision, *, count_live: bool = True) -> tuple[list[str], str]:
    """Create-pod actions for the joining GPUs (into `out`): (their names, why none were made).

    Only a job of bare pods gets them here: pods a controller owns (a JobSet, a PyTorchJob) are
    that controller's to add. Names are derived from the command, node and index, so a resumed
    consumer's second create is a 409 ("exists"), never a second pod. With `count_live`, a pod
    of the job still pending or running on the node in the subgroup (made before this command:
    a node that left by a resize and comes back before its pod ended) counts as one of them."""
    if not any(pods for _, _, _, pods, _ in joins):
        return [], ""
    pg = view.pod_group or {}
    owners = sorted({str(p["owner"]) for p in view.pods if p.get("owner")})
    if owners:
        return [], f"no pod created: the job's pods belong to {', '.join(owners)}, whose controller adds them"
    created: list[str] = []
    for sub, node, product, pods, gpus in joins:
        template = _template_pod(view, sub, product)
        if template is None:
            return created, "no pod created: the job has no pod on the cluster to copy"
        live = sum(1 for p in view.pods if count_live and p.get("node") == node and p.get("subgroup") == sub
                   and _live(p) and _joined_by(p) != command.id)
        for i in range(pods - live):
            digest = hashlib.sha256(f"{command.id}|{node}|{i}".encode()).hexdigest()[:10]
            name = f"{pg.get('name', '')}-{sub}-{digest}"[:253]
            namespace = str(template.get("namespace") or pg.get("namespace"))
            body = _joining_pod(template["manifest"], name=name, namespace=namespace, subgroup=sub,
                                product=product, gpus=gpus, node=node, command_id=command.id)
            out.actions.append(Action("create", "Pod", name, body,
                                      f"{command.job} grows onto {node}: pod {name} in subgroup {sub}",
                                      namespace=body["metadata"]["namespace"]))
            created.append(name)
    return created, ""


def _decide_migrate(command: Command, view: ClusterView, waiting: list[str]) -> Decision:
    early = _needs_pg(command, view, waiting)
    if early is not None:
        return early
    pg = view.pod_group
    assert pg is not None
    params = command.params
    phase = params.get("phase")
    if phase not in ("snapshot", "transfer", "restore"):
        return Decision(error=f"migrate: params.phase must be snapshot, transfer or restore, got {phase!r}")
    dest = params.get("destination") or {}
    if phase == "transfer" and dest.get("gpus"):
        return _decide_transfer(command, view)
    record = {"command": command.id, "phase": phase, "checkpoint_uri": params.get("checkpoint_uri"),
              "destination": dest}
    ann = pg.get("annotations", {})
    body: dict[str, Any] = {"metadata": {"annotations": {
        ANN_MIGRATION: json.dumps(record, sort_keys=True), ANN_COMMANDS: _with_id(ann, command.id, "done")}}}
    if phase == "restore" and dest.get("gpu_product") and dest.get("pods"):
        # The gang is re-targeted: one subgroup of the destination's product.
        name = str(dest.get("subgroup") or "migrated")
        pods = int(dest["pods"])
        body["spec"] = {"minMember": pods, "subGroups": [{"name": name, "minMember": pods}]}
        body["metadata"]["annotations"][ANN_SUBGROUPS] = json.dumps({name: {
            "product": dest["gpu_product"], "gpus_per_pod": int(dest.get("gpus_per_pod", 8)), "pods": pods}})
    out = Decision(done=True, detail=f"{command.job}: migration {phase} recorded on PodGroup {pg['name']}")
    out.actions.append(Action("patch", "PodGroup", pg["name"], body, f"migrate {command.job}: {phase}",
                              namespace=pg.get("namespace"), patch="merge"))
    out.actions.append(_cm_patch(view, command, "migration.json", record,
                                 "the envelope records the migration"))
    return out


def _gang_for(pg: Mapping[str, Any], command: Command, subs: Mapping[str, Mapping[str, Any]],
              records: Mapping[str, Any], why: str) -> Action:
    """The PodGroup re-targeted to `subs` (its gang their pods), the command recorded `applied`
    with `records` (annotation -> JSON) beside it."""
    total = sum(int(v["pods"]) for v in subs.values())
    ann = {k: json.dumps(v, sort_keys=True) for k, v in {**records, ANN_SUBGROUPS: subs}.items()}
    ann[ANN_COMMANDS] = _with_id(pg.get("annotations", {}), command.id, "applied")
    return Action("patch", "PodGroup", pg["name"], {
        "metadata": {"annotations": ann},
        "spec": {"minMember": max(1, total), "subGroups": _spec_subgroups(pg, subs, keep_others=False)}},
        f"{why}: gang {total} pod(s)", namespace=pg.get("namespace"), patch="merge")


def _spec_subgroups(pg: Mapping[str, Any], subs: Mapping[str, Mapping[str, Any]], *,
                    keep_others: bool) -> list[dict[str, Any]]:
    """The PodGroup's `spec.subGroups` for the pods in `subs`: its subgroups in their order with
    their other fields (a topology constraint) and the new counts, then the new ones; those left
    with no pod dropped (KAI's minimum is 1). `keep_others`: subgroups `subs` does not name
    stay as they are (a resize), else they go (the gang re-targeted)."""
    spec = [dict(s) for s in pg.get("spec", {}).get("subGroups", []) if keep_others or s.get("name") in subs]
    for s in spec:
        if s.get("name") in subs:
            s["minMember"] = int(subs[s["name"]]["pods"])
    named = {s.get("name") for s in spec}
    spec += [{"name": k, "minMember": int(v["pods"])} for k, v in subs.items() if k not in named]
    return [s for s in spec if int(s.get("minMember", 1)) >= 1]


def _pg_done(pg: Mapping[str, Any], command: Command) -> Action:
    """The command recorded `done` on the PodGroup (the last action: what a restart reads)."""
    return Action("patch", "PodGroup", pg["name"], {"metadata": {"annotations": {
        ANN_COMMANDS: _with_id(pg.get("annotations", {}), command.id, "done")}}}, f"{command.id} done",
        namespace=pg.get("namespace"), patch="merge")


def _retarget_pytorchjob(command: Command, view: ClusterView,
                         layout: Sequence[Join]) -> tuple[list[Action], str]:
    """The job's pods belong to a PyTorchJob, whose operator makes them from its Worker template:
    a migration or a consolidation move re-targets that template to the job's pod `layout` after
    it (GPU product and count per pod, required node affinity to its nodes, replicas = its pods),
    then evicts the pods on nodes holding more of them than the layout (all, on a node it leaves);
    the operator makes them again from the new template and KAI places them with the re-targeted
    gang. The patch is absolute and the evictions count what is on the cluster, so a resumed
    consumer applies the same patch and leaves the pods the operator made since alone.
    (actions, detail; no actions: why not)."""
    wl = view.workload
    assert wl is not None
    worker = (wl["spec"].get("pytorchReplicaSpecs") or {}).get("Worker")
    if not worker or not (worker.get("template") or {}).get("spec"):
        return [], f"no pod moved: PyTorchJob {wl['name']} has no Worker template to re-target"
    shapes = {(j[2], j[4]) for j in layout if j[3]}
    if len(shapes) != 1:
        return [], (f"no pod moved: the job's new place holds pods of {len(shapes)} GPU products or sizes, "
                    f"PyTorchJob {wl['name']}'s Worker template one")
    ((product, per_pod),) = shapes
    nodes = sorted({j[1] for j in layout if j[3]})
    replicas = sum(j[3] for j in layout)
    elastic = wl["spec"].get("elasticPolicy") or {}
    low, high = elastic.get("minReplicas"), elastic.get("maxReplicas")
    if (low is not None and replicas < int(low)) or (high is not None and replicas > int(high)):
        return [], (f"no pod moved: {replicas} Worker replicas are outside PyTorchJob {wl['name']}'s "
                    f"elasticPolicy ({low}-{high})")
    spec = _pinned_spec(worker["template"]["spec"], product, per_pod, nodes)
    parts = ("nodeSelector", "affinity", "containers", "initContainers")
    patch = {"replicas": replicas, "template": {"spec": {key: spec[key] for key in parts if key in spec}}}
    actions = [Action("patch", "PyTorchJob", wl["name"], {"spec": {"pytorchReplicaSpecs": {"Worker": patch}}},
                      f"{command.job}: {replicas} Worker replicas of {per_pod} {product} GPUs on "
                      f"{', '.join(nodes)}", namespace=wl["namespace"], patch="merge")]
    allowed = Counter({j[1]: j[3] for j in layout})
    leaving = []
    for node in sorted({str(p["node"]) for p in view.pods if p.get("node")}):
        here = sorted((p for p in view.pods if p.get("node") == node and not p.get("deleting")),
                      key=lambda p: p["name"])
        leaving += here[allowed[node]:]
    actions += [_evict(p, f"{p['name']} of {command.job} leaves: the operator makes it again from the "
                          "re-targeted template") for p in leaving]
    return actions, (f"; PyTorchJob {wl['name']}: Worker template on {', '.join(nodes)} ({replicas} "
                     f"replicas), {len(leaving)} pod(s) evicted for its operator to make again")


def _owned_by(view: ClusterView, kind: str) -> bool:
    return view.workload is not None and view.workload.get("kind") == kind


def _jobset_record(view: ClusterView, command: Command) -> dict[str, Any] | None:
    """The JobSet this command makes again, as written to the envelope ConfigMap before the
    old one was deleted (None: not written, or another command's)."""
    try:
        record = json.loads(((view.configmap or {}).get("data") or {}).get(JOBSET_KEY) or "null")
    except json.JSONDecodeError:
        return None
    ours = isinstance(record, dict) and record.get("command") == command.id
    return record.get("jobset") if ours else None


def _controlled(view: ClusterView, command: Command) -> bool:
    """The job's pods are a controller's to make: a PyTorchJob's or a JobSet's (also while this
    command has deleted the JobSet and not made it again yet)."""
    return view.workload is not None or _jobset_record(view, command) is not None


def _retarget_workload(command: Command, view: ClusterView,
                       layout: Sequence[Join]) -> tuple[list[Action], str]:
    """The controller that owns the job's pods follows its pod `layout` after a move."""
    if view.workload is None or _owned_by(view, "JobSet"):
        return _rebuild_jobset(command, view, layout)
    return _retarget_pytorchjob(command, view, layout)


def _jobset_for(command: Command, wl: Mapping[str, Any], layout: Sequence[Join]) -> dict[str, Any] | str:
    """The JobSet `wl` made again for the job's pod `layout`: one replicated job per subgroup,
    copied from the one of that name (else of that GPU product, else the first), its pods asking
    for the subgroup's GPUs and held to its nodes (`_pinned_spec`), marked as this command's.
    A string: why it cannot be made."""
    rjobs = [r for r in wl["spec"].get("replicatedJobs") or []
             if ((r.get("template") or {}).get("spec") or {}).get("template", {}).get("spec")]
    if not rjobs:
        return f"JobSet {wl['name']} has no replicated job with a pod template to copy"

    def product_of(r: Mapping[str, Any]) -> str | None:
        return r["template"]["spec"]["template"]["spec"].get("nodeSelector", {}).get(GFD_PRODUCT_LABEL)

    by_sub: dict[str, list[Join]] = {}
    for j in layout:
        if j[3]:
            by_sub.setdefault(j[0], []).append(j)
    made = []
    for sub, joins in sorted(by_sub.items()):
        product, per_pod = joins[0][2], joins[0][4]
        source = next((r for r in rjobs if r.get("name") == sub), None) or next(
            (r for r in rjobs if product_of(r) == product), rjobs[0])
        r = copy.deepcopy(dict(source))
        job_spec = r["template"]["spec"]
        pods = sum(j[3] for j in joins)
        pod = job_spec["template"]
        pod["spec"] = _pinned_spec(pod["spec"], product, per_pod, sorted({j[1] for j in joins}))
        meta = pod.setdefault("metadata", {})
        meta["labels"] = {**(meta.get("labels") or {}), KAI_SUBGROUP_LABEL: sub, "fleetwise.io/subgroup": sub}
        meta["annotations"] = {**(meta.get("annotations") or {}), ANN_JOINED_BY: command.id}
        r.update(name=sub, replicas=1)
        job_spec["parallelism"] = job_spec["completions"] = pods
        made.append(r)
    if not made:
        return "the job's new place holds no whole pod"
    spec = copy.deepcopy(dict(wl["spec"]))
    # Policies that name replicated jobs would name ones that are gone: they name the new ones.
    names = [r["name"] for r in made]
    for policy in [spec.get("successPolicy"), *((spec.get("failurePolicy") or {}).get("rules") or [])]:
        if isinstance(policy, dict) and policy.get("targetReplicatedJobs"):
            policy["targetReplicatedJobs"] = names
    return {"apiVersion": JOBSET_API, "kind": "JobSet",
            "metadata": {"name": wl["name"], "namespace": wl["namespace"],
                         "labels": dict(wl.get("labels") or {}),
                         "annotations": {**(wl.get("annotations") or {}), ANN_REBUILT_BY: command.id}},
            "spec": {**spec, "replicatedJobs": made}}


def _rebuild_jobset(command: Command, view: ClusterView,
                    layout: Sequence[Join]) -> tuple[list[Action], str]:
    """The job's pods belong to a JobSet, whose replicated jobs cannot change once made: a
    migration or a consolidation move (the job stopped at its checkpoint) deletes it and makes it
    again for the job's pod `layout` after the move (`_jobset_for`), and evicts the job's pods the
    new one did not make (the garbage collector removes the old Jobs' pods too; an eviction does
    not wait for it and honours PodDisruptionBudgets). The JobSet to make is written to the
    envelope ConfigMap before the delete, so a consumer restarted after it makes the same one;
    a JobSet this command made already is left alone. (actions, detail; no actions: why not)."""
    wl = view.workload
    stored = _jobset_record(view, command)
    before: list[Action] = []  # the record, the delete
    make: list[Action] = []  # the new JobSet, once the old pods are going: they hold GPUs it may need
    if wl is not None and (wl.get("annotations") or {}).get(ANN_REBUILT_BY) == command.id:
        name = wl["name"]
    else:
        assert stored is not None or wl is not None  # _controlled: the JobSet, or this command's record
        desired = stored if stored is not None else _jobset_for(command, wl, layout)
        if isinstance(desired, str):
            return [], f"no pod moved: {desired}"
        name, ns = desired["metadata"]["name"], desired["metadata"]["namespace"]
        subs = ", ".join(r["name"] for r in desired["spec"]["replicatedJobs"])
        if stored is None:
            before.append(_cm_patch(view, command, JOBSET_KEY, {"command": command.id, "jobset": desired},
                                    f"the JobSet {name} is made again from here (replicated jobs {subs})"))
        if wl is not None:
            before.append(Action("delete", "JobSet", name, {"propagationPolicy": "Background"},
                                 f"{command.job}: JobSet {name}'s replicated jobs cannot change; made again",
                                 namespace=ns))
        make.append(Action("create", "JobSet", name, desired,
                           f"{command.job}: JobSet {name} with replicated jobs {subs}", namespace=ns))
    leaving = sorted((p for p in view.pods if not p.get("deleting") and _joined_by(p) != command.id),
                     key=lambda p: p["name"])
    evictions = [_evict(p, f"{p['name']} of {command.job} leaves: its JobSet is made again") for p in leaving]
    actions = before + evictions + make
    return actions, (f"; JobSet {name}: made again for the new place, {len(leaving)} pod(s) evicted")


def _decide_transfer(command: Command, view: ClusterView) -> Decision:
    """A migration's transfer (after its snapshot is done): the job's gang re-targeted to the
    destination's GPUs (`destination.gpus`: [node, gpu] pairs), its pods made there, the old ones
    evicted. The new pods restore from `checkpoint_uri` (in the envelope's `migration.json`)."""
    pg = view.pod_group
    assert pg is not None
    params = command.params
    dest = params.get("destination") or {}
    ann = pg.get("annotations", {})
    resumed = command_phase(ann, command.id) == "applied"  # the gang was re-targeted already
    subs: dict[str, dict[str, Any]] = {}
    unknown: list[str] = []
    joins = _place(_per_node(dest.get("gpus")), view, subs, unknown)
    for sub, _node, _product, pods, per_pod in joins:
        subs[sub]["pods"] += pods
        subs[sub]["gpus"] = subs[sub].get("gpus", 0) + pods * per_pod
    if unknown:
        return Decision(error=f"migrate transfer: destination nodes without a known GPU product: "
                              f"{', '.join(unknown)}")
    total = sum(v["pods"] for v in subs.values())
    record = {"command": command.id, "phase": "transfer", "checkpoint_uri": params.get("checkpoint_uri"),
              "destination": dest}
    out = Decision(done=True)
    if not resumed:
        out.actions.append(_gang_for(pg, command, subs, {ANN_MIGRATION: record},
                                     f"{command.job} moves to {', '.join(sorted({j[1] for j in joins}))}"))
        out.actions.append(_cm_patch(view, command, "migration.json", record,
                                     "the new pods read the checkpoint to restore from here"))
    if _controlled(view, command):  # a controller's pods: it makes them from the moved template
        moved, why = _retarget_workload(command, view, joins)
        if not moved:
            return Decision(error=f"migrate transfer: {why}")
        out.actions += moved
        out.finish.append(_pg_done(pg, command))
        out.detail = f"PodGroup {pg['name']}: minMember {max(1, total)} on the destination{why}"
        return out
    created, skipped = _joining_pods(command, view, joins, out, count_live=False)
    old = [p for p in view.pods if not p.get("deleting") and p["name"] not in created
           and _joined_by(p) != command.id]
    if not skipped:  # the job's own pods leave only once its new ones exist
        for p in old:
            out.actions.append(_evict(p, f"{p['name']} of {command.job} leaves: the job moved"))
    out.finish.append(_pg_done(pg, command))
    out.detail = (f"PodGroup {pg['name']}: minMember {max(1, total)} on the destination"
                  + _pods_detail(created, skipped, [] if skipped else old))
    return out


def _job_gpus_per_node(view: ClusterView, subs: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The job's GPUs per node: its live pods there, each holding its subgroup's GPUs per pod."""
    out: dict[str, int] = {}
    for p in view.pods:
        if p.get("node") and _live(p) and p.get("subgroup") in subs:
            out[p["node"]] = out.get(p["node"], 0) + int(subs[p["subgroup"]].get("gpus_per_pod", 1))
    return out


def _decide_move(command: Command, view: ClusterView) -> Decision:
    """A consolidation's moves of a job's ranks (after the checkpoint it `requires`): on every
    node where the job's GPU count changes, its pods there are evicted and pods for the new
    count made (a node it leaves gets none); the gang follows. What changes is worked out once
    and kept on the PodGroup, so a restarted consumer finishes the same moves."""
    pg = view.pod_group
    assert pg is not None
    ann = pg.get("annotations", {})
    moves = command.params.get("moves") or []
    try:
        record = json.loads(ann.get(ANN_MOVES, "{}"))
    except json.JSONDecodeError:
        record = {}
    resumed = command_phase(ann, command.id) == "applied" and isinstance(record, dict) \
        and record.get("command") == command.id
    if resumed:
        after = {str(k): int(v) for k, v in record["after"].items()}
        changed = set(record["changed"])
    else:
        subs_now = _subgroups(pg)
        before = _job_gpus_per_node(view, subs_now)
        after = dict(before)
        for m in moves:
            src, dst = str(m["from"]["node"]), str(m["to"]["node"])
            after[src] = after.get(src, 0) - 1
            after[dst] = after.get(dst, 0) + 1
        if any(v < 0 for v in after.values()):
            short = sorted(n for n, v in after.items() if v < 0)
            return Decision(error=f"consolidate move: more ranks leave {', '.join(short)} than the "
                                  "job's pods there hold")
        changed = {n for n in after if after[n] != before.get(n, 0)}
        after = {n: v for n, v in sorted(after.items()) if v > 0}
        record = {"command": command.id, "moves": moves, "after": after, "changed": sorted(changed)}
    subs = {k: {**v, "pods": 0, "gpus": 0} for k, v in _subgroups(pg).items()}
    for p in view.pods:  # the nodes the moves do not touch keep their pods
        if p.get("node") not in changed and p.get("subgroup") in subs and _live(p):
            subs[p["subgroup"]]["pods"] += 1
            subs[p["subgroup"]]["gpus"] += int(subs[p["subgroup"]].get("gpus_per_pod", 1))
    unknown: list[str] = []
    joins = _place({n: c for n, c in after.items() if n in changed}, view, subs, unknown)
    if unknown:
        return Decision(error=f"consolidate move: nodes without a known GPU product: {', '.join(unknown)}")
    for sub, _node, _product, pods, per_pod in joins:
        subs[sub]["pods"] += pods
        subs[sub]["gpus"] += pods * per_pod
    total = sum(v["pods"] for v in subs.values())
    out = Decision(done=True)
    leaving = [p for p in view.pods if p.get("node") in changed and not p.get("deleting")
               and _joined_by(p) != command.id]
    controlled = _controlled(view, command)
    if controlled:  # a controller's pods: its template follows the job's new layout
        kept = Counter((p["subgroup"], p["node"]) for p in view.pods
                       if p.get("node") not in changed and p.get("subgroup") in subs and _live(p))
        layout = list(joins)
        for (sub, node), n in sorted(kept.items()):
            per_pod = int(subs[sub].get("gpus_per_pod", 1))
            layout.append((sub, node, str(subs[sub].get("product")), n, per_pod))
        moved, why = _retarget_workload(command, view, layout)
        if not moved:
            return Decision(error=f"consolidate move: {why}")
    if not resumed:
        out.actions.append(_gang_for(pg, command, subs, {ANN_MOVES: record},
                                     f"consolidation moves of {command.job}"))
    if controlled:
        out.actions += moved
        out.finish.append(_pg_done(pg, command))
        out.detail = (f"{command.job}: {len(moves)} rank(s) moved; PodGroup {pg['name']}: minMember "
                      f"{max(1, total)}{why}")
        return out
    created, skipped = _joining_pods(command, view, joins, out, count_live=False)
    if not skipped:  # the old pods go once the new ones exist
        for p in leaving:
            out.actions.append(_evict(p, f"{p['name']} of {command.job}: its ranks move (checkpoint done)"))
    out.finish.append(_pg_done(pg, command))
    out.detail = (f"{command.job}: {len(moves)} rank(s) moved; PodGroup {pg['name']}: minMember "
                  f"{max(1, total)}" + _pods_detail(created, skipped, [] if skipped else leaving))
    return out


def _decide_consolidate(command: Command, view: ClusterView, waiting: list[str]) -> Decision:
    action = command.params.get("action")
    if action == "move":
        early = _needs_pg(command, view, waiting)
        return early if early is not None else _decide_move(command, view)
    if action not in ("hibernate", "wake"):
        return Decision(error=f"consolidate: params.action must be hibernate, wake or move, got {action!r}")
    node, error = _node_or_error(command, view)
    if error:
        return Decision(error=error)
    assert node is not None and command.node is not None
    if waiting:
        return Decision(waiting=waiting, detail=f"{action} {command.node} after {', '.join(waiting)}")
    ann = node.get("annotations", {})
    labels = node.get("labels", {})
    ids = _with_id(ann, command.id, "done")
    if action == "hibernate":
        patch_ann: dict[str, str | None] = {ANN_COMMANDS: ids}
        cordon = not node.get("unschedulable")
        if cordon:
            patch_ann[ANN_CORDONED_BY] = "hibernate"
        return Decision(done=True, detail=f"{command.node} labelled for hibernation and cordoned", actions=[
            _node_patch(command.node, f"hibernate {command.node}: {command.reason}",
                        unschedulable=True if cordon else None, labels={HIBERNATE_LABEL: "true"},
                        annotations=patch_ann)])
    # wake: work returns. Uncordon only what hibernation cordoned (a drained node stays out).
    uncordon = ann.get(ANN_CORDONED_BY) == "hibernate" and node.get("unschedulable")
    patch_ann = {ANN_COMMANDS: ids}
    if uncordon:
        patch_ann[ANN_CORDONED_BY] = None
    detail = f"{command.node} woken" + (" and uncordoned" if uncordon else "")
    return Decision(done=True, detail=detail, actions=[
        _node_patch(command.node, f"wake {command.node}: {command.reason}",
                    unschedulable=False if uncordon else None,
                    labels={HIBERNATE_LABEL: None} if HIBERNATE_LABEL in labels else None,
                    annotations=patch_ann)])


def decide_return(node_name: str, gpu: int | None, view: ClusterView, why: str) -> Decision:
    """A GPU (or the whole node, `gpu=None`) back in service: it leaves the drained set; when
    none is left, the drain taint goes and the node is uncordoned if a drain cordoned it."""
    node = view.nodes.get(node_name)
    if node is None:
        return Decision(error=f"return: node {node_name!r} not found on the cluster")
    ann = node.get("annotations", {})
    drained = _drained(ann)
    left = [] if gpu is None else [g for g in drained if g not in (int(gpu), -1)]
    has_taint = any(t.get("key") == DRAIN_TAINT for t in node.get("taints") or [])
    patch_ann: dict[str, str | None] = {ANN_DRAINED_GPUS: json.dumps(left) if left else None}
    if left:
        return Decision(done=True, detail=f"{node_name}: GPUs {left} still drained; node stays cordoned",
                        actions=[_node_patch(node_name, f"{node_name}/gpu{gpu} returned",
                                             annotations=patch_ann)])
    uncordon = bool(node.get("unschedulable")) and ann.get(ANN_CORDONED_BY) == "drain"
    if uncordon:
        patch_ann[ANN_CORDONED_BY] = None
    return Decision(done=True, detail=f"{node_name} back in service" + (": uncordoned" if uncordon else ""),
                    actions=[_node_patch(node_name, f"return {node_name}: {why}",
                                         unschedulable=False if uncordon else None, annotations=patch_ann,
                                         taints=[t for t in node.get("taints") or []
                                                 if t.get("key") != DRAIN_TAINT] if has_taint else None,
                                         resource_version=node.get("resourceVersion"))])


def required_rbac() -> list[dict[str, Any]]:
    """The ClusterRole rules the consumer needs: only the verbs it uses."""
    return [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "list"]},
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch"]},
        {"apiGroups": ["scheduling.run.ai"], "resources": ["podgroups"], "verbs": ["list", "patch"]},
        {"apiGroups": ["kubeflow.org"], "resources": ["pytorchjobs"], "verbs": ["get", "patch"]},
        {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["list", "create", "delete"]},
    ]


# ---- adapters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionResult:
    """`status`: ok | exists (already there) | gone (nothing to act on) | blocked (eviction
    refused by a PodDisruptionBudget: retry) | error."""

    status: str
    detail: str = ""


class Api(Protocol):
    """What the consumer needs from a cluster."""

    def view(self, command: Command | None, namespace: str, nodes: Iterable[str] = ()) -> ClusterView:
        """Read the objects a command touches."""

    def execute(self, action: Action) -> ActionResult:
        """Carry out one action."""

    def drained_gpus(self) -> tuple[int, int]:
        """(GPUs Fleetwise drained, GPUs) over the cluster's nodes: `count_drained`."""


class DryRunApi:
    """Prints each API call instead of making it (and keeps them in `calls`). Reads from
    `reader` (a real `ClientApi`) when given; else it assumes a plausible cluster
    (`ClusterView.assumed`) and plays its own calls on it, so a dry run of a command sequence
    shows each call once, as a live run would make it."""

    def __init__(self, reader: Api | None = None, out: Callable[[str], None] | None = print) -> None:
        self.reader = reader
        self.out = out
        self.calls: list[str] = []
        self.state = ClusterView()

    def view(self, command: Command | None, namespace: str, nodes: Iterable[str] = ()) -> ClusterView:
        if self.reader is not None:
            return self.reader.view(command, namespace, nodes)
        if command is not None:
            assumed = ClusterView.assumed(command, namespace)
            for name, node in assumed.nodes.items():
                self.state.nodes.setdefault(name, node)
            known = {(p["namespace"], p["name"]) for p in self.state.pods}
            self.state.pods += [p for p in assumed.pods if (p["namespace"], p["name"]) not in known]
            names = set(assumed.nodes)
        else:
            names = set(nodes)
        job_pods = [dict(p) for p in self.state.pods if command is not None and command.job
                    and p["name"].startswith(pod_group_name(command.job) + "-")]
        return ClusterView(nodes={n: json.loads(json.dumps(self.state.nodes[n]))
                                  for n in names if n in self.state.nodes}, pods=job_pods)

    def drained_gpus(self) -> tuple[int, int]:
        if self.reader is not None:
            return self.reader.drained_gpus()
        return count_drained(self.state.nodes.values())

    def execute(self, action: Action) -> ActionResult:
        line = action.describe()
        self.calls.append(line)
        if self.out is not None:
            self.out(line)
        if self.reader is None:
            self._play(action)
        return ActionResult("ok", "dry run")

    def _play(self, action: Action) -> None:
        if action.kind == "Pod" and action.verb == "create":
            meta = action.body["metadata"]
            if all(p["name"] != action.name for p in self.state.pods):
                self.state.pods.append({
                    "name": action.name, "namespace": meta["namespace"], "node": None, "deleting": False,
                    "subgroup": meta["labels"].get(KAI_SUBGROUP_LABEL),
                    "manifest": {"metadata": {k: meta[k] for k in ("labels", "annotations")},
                                 "spec": action.body["spec"]}})
        elif action.kind == "Pod":
            for p in self.state.pods:
                if p["name"] == action.name:
                    p["deleting"] = True
        if action.kind != "Node" or action.name not in self.state.nodes:
            return
        node = self.state.nodes[action.name]
        meta = action.body.get("metadata", {})
        for key in ("labels", "annotations"):
            for k, v in meta.get(key, {}).items():
                if v is None:
                    node[key].pop(k, None)
                else:
                    node[key][k] = v
        spec = action.body.get("spec", {})
        if "unschedulable" in spec:
            node["unschedulable"] = spec["unschedulable"]
        if "taints" in spec:
            node["taints"] = [dict(t) for t in spec["taints"]]


def _gpu_capacity(node: Any) -> int:
    """A node's `nvidia.com/gpu` capacity (0: none or not reported)."""
    capacity = (node.status.capacity if node.status else None) or {}
    try:
        return int(capacity.get("nvidia.com/gpu", 0))
    except (TypeError, ValueError):
        return 0


def _workload(kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {"kind": kind, "name": meta["name"], "namespace": meta["namespace"], "spec": obj.get("spec", {}),
            "labels": dict(meta.get("labels") or {}), "annotations": dict(meta.get("annotations") or {})}


def _owner(pod: Any) -> str | None:
    """"Kind/name" of the controller that owns a pod (None: a bare pod)."""
    refs = pod.metadata.owner_references or []
    ref = next((r for r in refs if r.controller), refs[0] if refs else None)
    return f"{ref.kind}/{ref.name}" if ref is not None else None


def _api_status(exc: Exception) -> int | None:
    return getattr(exc, "status", None)


class ClientApi:
    """The official `kubernetes` client (the `kube` extra). Least privilege: `required_rbac()`."""

    def __init__(self, api_client: Any = None, kubeconfig: str | None = None) -> None:
        from kubernetes import client, config

        if api_client is None:
            if kubeconfig:
                api_client = config.new_client_from_config(config_file=kubeconfig)
            else:
                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
                api_client = client.ApiClient()
        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def _node(self, name: str) -> dict[str, Any] | None:
        try:
            n = self.core.read_node(name)
        except Exception as exc:  # noqa: BLE001 - ApiException; 404 means "no such node"
            if _api_status(exc) == 404:
                return None
            raise
        # As the API has them (timeAdded included): the patch sends the whole list back.
        taints = [self.api_client.sanitize_for_serialization(t) for t in (n.spec.taints or [])]
        return {"labels": dict(n.metadata.labels or {}), "annotations": dict(n.metadata.annotations or {}),
                "unschedulable": bool(n.spec.unschedulable), "taints": taints, "gpus": _gpu_capacity(n),
                "resourceVersion": n.metadata.resource_version}

    def drained_gpus(self) -> tuple[int, int]:
        def nodes() -> Iterator[dict[str, Any]]:
            token = None
            while True:  # pages of NODE_PAGE (limit / continue: one snapshot, as kubectl lists)
                page = self.core.list_node(limit=NODE_PAGE, _continue=token)
                for n in page.items:
                    yield {"annotations": n.metadata.annotations or {}, "gpus": _gpu_capacity(n)}
                token = page.metadata._continue
                if not token:
                    return

        return count_drained(nodes())

    def view(self, command: Command | None, namespace: str, nodes: Iterable[str] = ()) -> ClusterView:
        names = set(nodes) | (_command_nodes(command) if command is not None else set())
        view = ClusterView()
        for name in sorted(names):
            node = self._node(name)
            if node is not None:
                view.nodes[name] = node
        if command is None or not command.job:
            return view
        pg_name = pod_group_name(command.job)
        selector = f"{JOB_LABEL}={pg_name}"
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector).items
        view.pods = [{"name": p.metadata.name, "namespace": p.metadata.namespace, "node": p.spec.node_name,
                      "deleting": p.metadata.deletion_timestamp is not None,
                      "subgroup": (p.metadata.labels or {}).get(KAI_SUBGROUP_LABEL),
                      "phase": p.status.phase if p.status else None, "owner": _owner(p), "manifest": {
                          "metadata": {"labels": dict(p.metadata.labels or {}),
                                       "annotations": dict(p.metadata.annotations or {})},
                          "spec": self.api_client.sanitize_for_serialization(p.spec)}}
                     for p in pods]
        groups = self.custom.list_namespaced_custom_object(
            "scheduling.run.ai", "v2alpha2", namespace, "podgroups", label_selector=selector)["items"]
        if groups:
            g = groups[0]
            view.pod_group = {"name": g["metadata"]["name"], "namespace": g["metadata"]["namespace"],
                              "spec": g.get("spec", {}),
                              "annotations": g["metadata"].get("annotations") or {}}
        try:
            cm = self.core.read_namespaced_config_map(envelope_configmap_name(pg_name), namespace)
            view.configmap = {"name": cm.metadata.name, "namespace": cm.metadata.namespace,
                              "data": dict(cm.data or {})}
        except Exception as exc:  # noqa: BLE001 - 404: the job was deployed without our ConfigMap
            if _api_status(exc) != 404:
                raise
        owners = {p["owner"] for p in view.pods if p.get("owner")}
        in_flight = JOBSET_KEY in (view.configmap or {}).get("data", ())  # made again, maybe not yet
        if len(owners) == 1 and next(iter(owners)).startswith("PyTorchJob/"):
            name = next(iter(owners)).split("/", 1)[1]
            job = self.custom.get_namespaced_custom_object("kubeflow.org", "v1", namespace, "pytorchjobs",
                                                           name)
            view.workload = _workload("PyTorchJob", job)
        elif any(o.startswith("Job/") for o in owners) or in_flight:
            # A JobSet's pods are its Jobs'; the JobSet carries the job's label (`kube render`).
            try:
                sets = self.custom.list_namespaced_custom_object(
                    "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", label_selector=selector)["items"]
            except Exception as exc:  # noqa: BLE001 - 404: no JobSet CRD on this cluster
                if _api_status(exc) != 404:
                    raise
                sets = []
            if len(sets) == 1:
                view.workload = _workload("JobSet", sets[0])
        return view

    def execute(self, action: Action) -> ActionResult:
        try:
            if action.kind == "Node":
                self.core.patch_node(action.name, dict(action.body),
                                     _content_type="application/strategic-merge-patch+json")
            elif action.kind == "Event":
                self.core.create_namespaced_event(action.namespace, dict(action.body))
            elif action.kind == "Pod" and action.verb == "create":
                self.core.create_namespaced_pod(action.namespace, dict(action.body))
            elif action.kind == "Pod":
                self.core.create_namespaced_pod_eviction(action.name, action.namespace, dict(action.body))
            elif action.kind == "PodGroup":
                self.custom.patch_namespaced_custom_object(
                    "scheduling.run.ai", "v2alpha2", action.namespace, "podgroups", action.name,
                    dict(action.body), _content_type="application/merge-patch+json")
            elif action.kind == "ConfigMap":
                self.core.patch_namespaced_config_map(action.name, action.namespace, dict(action.body),
                                                      _content_type="application/merge-patch+json")
            elif action.kind == "PyTorchJob":
                self.custom.patch_namespaced_custom_object(
                    "kubeflow.org", "v1", action.namespace, "pytorchjobs", action.name, dict(action.body),
                    _content_type="application/merge-patch+json")
            elif action.kind == "JobSet" and action.verb == "create":
                self.custom.create_namespaced_custom_object(
                    "jobset.x-k8s.io", "v1alpha2", action.namespace, "jobsets", dict(action.body))
            elif action.kind == "JobSet":
                self.custom.delete_namespaced_custom_object(
                    "jobset.x-k8s.io", "v1alpha2", action.namespace, "jobsets", action.name,
                    body=dict(action.body))
            else:
                return ActionResult("error", f"unknown kind {action.kind}")
        except Exception as exc:  # noqa: BLE001 - ApiException: classify by HTTP status
            status = _api_status(exc)
            if status == 409 and action.verb == "patch":
                return ActionResult("conflict", "changed since read")
            if status == 409 and action.kind == "JobSet":
                return self._jobset_there(action)
            if status == 409:
                return ActionResult("exists")
            if status == 404 and (action.kind in ("Pod", "ConfigMap") or action.verb == "delete"):
                return ActionResult("gone")
            if status == 429:
                return ActionResult("blocked", _reason(exc) or "eviction refused (PodDisruptionBudget)")
            if status is None:
                raise
            return ActionResult("error", f"HTTP {status}: {_reason(exc)}")
        return ActionResult("ok")


    def _jobset_there(self, action: Action) -> ActionResult:
        """A JobSet of that name exists: the one this command made ("exists"), or the old one not
        gone yet (a finalizer still holds it: "blocked", made on a later tick)."""
        found = self.custom.list_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", action.namespace, "jobsets",
            field_selector=f"metadata.name={action.name}")["items"]
        mine = action.body["metadata"]["annotations"].get(ANN_REBUILT_BY)
        if any((js["metadata"].get("annotations") or {}).get(ANN_REBUILT_BY) == mine for js in found):
            return ActionResult("exists")
        return ActionResult("blocked", f"JobSet {action.name} is still being deleted")


def _reason(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    try:
        return str(json.loads(body).get("message", body)) if body else str(getattr(exc, "reason", ""))
    except (TypeError, ValueError):
        return str(body)


# ---- the consumer ------------------------------------------------------------------------------


@dataclass
class _Pending:
    command: Command
    acked: set[str] = field(default_factory=set)  # statuses already acked


# How long the consumer remembers a command id it finished or saw acked `done`. Commands expire
# within minutes (`expires_ts`); an older duplicate is still caught by the phase recorded on the
# cluster. Without a bound, a consumer that runs for months held every id ever seen.
RETAIN_IDS_S = 86400.0
LOG_LINES = 1000  # the API calls' log kept in memory (for tests and debugging)


class RecentIds:
    """Command ids, each with when it was first seen (the consumer's clock); `prune` drops those
    older than a horizon."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def add(self, cid: str, now: float) -> None:
        self._at.setdefault(cid, now)

    def __contains__(self, cid: object) -> bool:
        return cid in self._at

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def prune(self, before: float) -> None:
        for cid in [c for c, t in self._at.items() if t < before]:
            del self._at[cid]


class KubeConsumer:
    """Lifecycle and bookkeeping around `decide` (see the module docstring).

    In-process API: `on_command`, `on_ack`, `on_operator`, `tick` each return the acks to
    publish. `run` drives it from a transport (`fleetwise.training.transport.KafkaTransport`
    or `BusTransport`): commands from `fleetwise.commands.kube`, acks from `fleetwise.acks`,
    operator returns from `fleetwise.operator`.
    """

    def __init__(self, api: Api, keyring: Keyring | None = None, *, namespace: str = "default",
                 clock: Callable[[], float] = time.time, operator_keys: Keyring | None = None,
                 rails: Rails | None = None) -> None:
        self.api = api
        self.rails = rails or Rails()  # the fleet drain cap: the workers' policy file's rails
        self.keyring = keyring or Keyring()
        self.operator_keys = operator_keys or operator_keyring()  # verifies GPU returns
        self.namespace = namespace
        self.clock = clock
        self.done_acks = RecentIds()  # ids with a `done` ack seen (anyone's)
        self.finished = RecentIds()  # ids this consumer completed (fast duplicate path)
        self.pending: dict[str, _Pending] = {}
        self.last_seq: dict[str, int] = {}
        self.log: deque[str] = deque(maxlen=LOG_LINES)

    # -- acks ------------------------------------------------------------------------------
    def _ack(self, command: Command, status: str, detail: str = "",
             result: Mapping[str, Any] | None = None) -> Ack:
        return Ack(command_id=command.id, ts=self.clock(), job=command.job, node=command.node,
                   gpu=command.gpu, by=BY, status=status,  # type: ignore[arg-type]
                   detail=detail or None, result=dict(result or {}))

    def _target_annotations(self, command: Command, view: ClusterView) -> Mapping[str, str]:
        if command.type in ("resize", "migrate") or (command.type == "consolidate"
                                                     and command.params.get("action") == "move"):
            return (view.pod_group or {}).get("annotations", {})
        return view.nodes.get(command.node or "", {}).get("annotations", {})

    # -- inputs ----------------------------------------------------------------------------
    def on_command(self, command: Command) -> list[Ack]:
        """A command from `fleetwise.commands.kube`: duplicate? verified? then act or wait."""
        if command.id in self.finished:
            return [self._ack(command, "done", "duplicate")]
        if command.id in self.pending:
            return []  # already waiting on its requires: the same command again changes nothing
        try:
            view = self.api.view(command, self.namespace)
        except Exception as exc:  # noqa: BLE001 - the cluster did not answer: the command failed
            return [self._ack(command, "failed", f"cannot read the cluster: {exc}")]
        phase = command_phase(self._target_annotations(command, view), command.id)
        if phase == "done":
            self.finished.add(command.id, self.clock())
            return [self._ack(command, "done", "duplicate")]
        scope = command.job
        # A command the cluster records as applied passed the sequence check when it was applied
        # (its seq is now the job's last): a restarted consumer resumes it.
        last_seq = self._last_seq(scope, view) if scope and phase != "applied" else None
        verdict = verify_command(command, self.keyring, now=self.clock(), last_seq=last_seq)
        if not verdict:
            return [self._ack(command, "rejected", verdict.reason)]
        if command.type not in KUBE_TYPES:
            return [self._ack(command, "rejected", f"type {command.type!r} is not for the kube consumer")]
        if command.type == "drain":
            # The last line of the fleet drain cap: the workers each count what they have read of
            # the others' drains, this counts what the cluster holds drained, one drain at a time.
            try:
                drained, total = self.api.drained_gpus()
            except Exception as exc:  # noqa: BLE001 - the cluster did not answer: the command failed
                return [self._ack(command, "failed", f"cannot read the cluster: {exc}")]
            refusal = fleet_cap_refusal(command, view, drained, total, self.rails)
            if refusal:
                return [self._ack(command, "rejected", refusal)]
        if command.dry_run:
            decision = decide(command, view, done_ids=set(self.done_acks) | set(command.requires),
                              now=self.clock())
            return [self._ack(command, "rejected", "dry run: not applied",
                              {"actions": [a.describe() for a in decision.actions + decision.finish]})]
        if scope and command.seq is not None:
            self.last_seq[scope] = command.seq
            self._record_seq(scope, command.seq, view)
        self.pending[command.id] = _Pending(command)
        return self._advance(command.id, view)

    def on_ack(self, ack: Ack) -> list[Ack]:
        """An ack on `fleetwise.acks`: a `done` may release commands waiting on `requires`."""
        if ack.status != "done" or ack.command_id in self.done_acks:
            return []
        self.done_acks.add(ack.command_id, self.clock())
        out: list[Ack] = []
        for cid, p in list(self.pending.items()):
            if ack.command_id in p.command.requires:
                out += self._advance(cid)
        return out

    def on_job_end(self, end: JobEnd) -> None:
        """A job ended (its plan withdrawn): forget its command sequence, here and on its
        PodGroup if that is still there. The control plane forgets the job too, so a later run
        under the same name numbers its commands from 1 again, and this consumer must not
        refuse them as replays of the old run's."""
        self.last_seq.pop(end.job, None)
        forget = {"metadata": {"annotations": {ANN_LAST_SEQ: None}}}
        try:  # the PodGroup is usually gone with the job (an HTTP 404 here)
            status = self.api.execute(Action("patch", "PodGroup", pod_group_name(end.job), forget,
                                             f"job {end.job} ended: its command sequence is reset",
                                             namespace=self.namespace, patch="merge")).status
        except Exception as exc:  # noqa: BLE001 - the cluster did not answer: memory is reset anyway
            status = f"error ({exc})"
        self.log.append(f"{status}: job {end.job} ended: its command sequence is reset")

    def _last_seq(self, job: str, view: ClusterView) -> int | None:
        """The job's last applied seq: this consumer's memory, or after a restart the PodGroup's
        record of it (the higher of the two)."""
        known = [s for s in (self.last_seq.get(job), _int_or_none(
            (view.pod_group or {}).get("annotations", {}).get(ANN_LAST_SEQ))) if s is not None]
        return max(known) if known else None

    def _record_seq(self, job: str, seq: int, view: ClusterView) -> None:
        """Keep the job's last applied seq on its PodGroup (when it has one), so a restarted
        consumer still refuses an older command it has not seen applied."""
        pg = view.pod_group
        if not pg:
            return
        record = {"metadata": {"annotations": {ANN_LAST_SEQ: str(seq)}}}
        why = f"{job}: last applied command seq {seq}"
        self._execute([Action("patch", "PodGroup", pg["name"], record, why, namespace=pg.get("namespace"),
                              patch="merge")])

    def on_operator(self, op: OperatorAction) -> list[Ack]:
        """An operator's GPU return: untaint / uncordon when nothing of the node is drained."""
        if op.action != "return_gpu" or op.node is None:
            return []
        cid = f"return_gpu:{op.node}:{op.gpu}:{op.ts:.3f}"
        ref = Command(id=cid, type="drain", ts=op.ts, node=op.node, gpu=op.gpu,
                      reason=op.reason or "returned")
        if cid in self.finished:
            return [self._ack(ref, "done", "duplicate")]
        verdict = verify_operator(op, self.operator_keys)
        if not verdict:
            self.log.append(f"{cid}: refused: {verdict.reason}")
            return [self._ack(ref, "rejected", verdict.reason)]
        try:
            view = self.api.view(None, self.namespace, [op.node])
            decision = decide_return(op.node, op.gpu, view, op.reason or f"returned by {op.by}")
        except Exception as exc:  # noqa: BLE001
            return [self._ack(ref, "failed", f"cannot read the cluster: {exc}")]
        if decision.error:
            return [self._ack(ref, "failed", decision.error)]
        failed = self._execute(decision.actions + decision.finish)
        if failed:
            return [self._ack(ref, "failed", failed)]
        self.finished.add(cid, self.clock())
        calls = [a.describe() for a in decision.actions + decision.finish]
        return [self._ack(ref, "done", decision.detail, {"actions": calls})]

    def tick(self) -> list[Ack]:
        """Retry what waits on the cluster (an eviction a PodDisruptionBudget refused); forget
        ids older than `RETAIN_IDS_S`."""
        horizon = self.clock() - RETAIN_IDS_S
        self.finished.prune(horizon)
        self.done_acks.prune(horizon)
        out: list[Ack] = []
        for cid, p in list(self.pending.items()):
            if not [r for r in p.command.requires if r not in self.done_acks]:
                out += self._advance(cid)
        return out

    # -- the work --------------------------------------------------------------------------
    def _execute(self, actions: Sequence[Action]) -> str | None:
        """Run actions in order; the first error (as text) stops them. Blocked evictions: 'blocked:'."""
        blocked: list[str] = []
        for action in actions:
            result = self.api.execute(action)
            self.log.append(f"{result.status}: {action.describe()}")
            if result.status == "blocked":
                blocked.append(f"{action.name}: {result.detail}")
            elif result.status in ("error", "conflict"):
                return f"{result.status}: {action.verb} {action.kind} {action.name}: {result.detail}"
        return ("blocked: " + "; ".join(blocked)) if blocked else None

    def _advance(self, cid: str, view: ClusterView | None = None, tries: int = 3) -> list[Ack]:
        p = self.pending[cid]
        cmd = p.command
        try:
            view = view or self.api.view(cmd, self.namespace)
        except Exception as exc:  # noqa: BLE001
            return [self._ack(cmd, "failed", f"cannot read the cluster: {exc}")]
        decision = decide(cmd, view, done_ids=set(self.done_acks), now=self.clock())
        if decision.error:
            del self.pending[cid]
            return [self._ack(cmd, "failed", decision.error)]
        failed = self._execute(decision.actions)
        if not failed and decision.finish:
            failed = self._execute(decision.finish)
        out: list[Ack] = []
        actions = {"actions": [a.describe() for a in decision.actions + decision.finish]}
        if failed and failed.startswith("conflict: ") and tries > 1:
            return self._advance(cid, None, tries - 1)  # a node changed under us: read it again
        if failed and not failed.startswith("blocked: "):
            del self.pending[cid]
            return [self._ack(cmd, "failed", failed, actions)]
        if failed:  # evictions refused: applied so far, retried on tick
            if "blocked" not in p.acked:
                p.acked.add("blocked")
                out.append(self._ack(cmd, "applied", f"waiting: {failed[len('blocked: '):]}", actions))
            return out
        if decision.done:
            del self.pending[cid]
            self.finished.add(cid, self.clock())
            self.done_acks.add(cid, self.clock())  # a later command may require this one
            out.append(self._ack(cmd, "done", decision.detail, actions))
        elif "applied" not in p.acked and (
                decision.actions or command_phase(self._target_annotations(cmd, view), cid) == "applied"):
            # applied now, or found applied on the cluster by a restarted consumer
            p.acked.add("applied")
            out.append(self._ack(cmd, "applied", decision.detail, actions))
        elif "received" not in p.acked and not p.acked:
            p.acked.add("received")
            out.append(self._ack(cmd, "received", decision.detail))
        return out

    # -- the loop ----------------------------------------------------------------------------
    def run(self, transport: Any, stop: threading.Event | None = None, poll_s: float = 0.2,
            max_s: float | None = None) -> None:
        """Poll the command, ack, operator and plans topics (job ends) and publish acks until
        `stop` is set."""
        from fleetwise.schemas import topics as T

        stop = stop or threading.Event()
        deadline = None if max_s is None else time.monotonic() + max_s
        while not stop.is_set() and (deadline is None or time.monotonic() < deadline):
            out: list[Ack] = []
            for ack in transport.poll(T.ACKS.name):
                out += self.on_ack(ack)
            for cmd in transport.poll(T.COMMANDS_KUBE.name):
                out += self.on_command(cmd)
            for op in transport.poll(T.OPERATOR.name):
                out += self.on_operator(op)
            for end in transport.poll(T.PLANS.name):
                if isinstance(end, JobEnd):
                    self.on_job_end(end)
            out += self.tick()
            for ack in out:
                transport.publish(T.ACKS.name, ack.job or ack.node or "-", ack)
                if ack.status == "done":
                    self.done_acks.add(ack.command_id, self.clock())
            stop.wait(poll_s)
