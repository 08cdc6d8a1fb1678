"""The KAI-side consumer against a real Kubernetes API server (tests/kube_server.py): drain,
resize, migrate, consolidate and return act on real objects; unsigned commands are refused;
evictions wait for the checkpoint's done ack and respect PodDisruptionBudgets; a repeat or a
restarted consumer changes nothing twice. One test drives it through a real Kafka broker."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import pytest

import fleetwise.kube.consumer as consumer_module
from fleetwise.actuators import Keyring, generate_ed25519_entries, operator_keyring, sign
from fleetwise.actuators.config import Rails
from fleetwise.kube.consumer import (
    ANN_COMMANDS,
    ANN_DRAINED_GPUS,
    ANN_JOINED_BY,
    ANN_LAST_SEQ,
    DRAIN_TAINT,
    HIBERNATE_LABEL,
    ClientApi,
    ClusterView,
    DryRunApi,
    KubeConsumer,
    count_drained,
    decide,
    fleet_cap_refusal,
    required_rbac,
)
from fleetwise.kube.render import render_plan
from fleetwise.schemas import Ack, Command, JobEnd, OperatorAction, Plan, RankPlan
from fleetwise.schemas import topics as T

KEYS = Keyring.parse("k1=test-secret-one-0123456789")
NOW = 1_800_000_000.0
PRODUCTS = {"h100-sxm": "NVIDIA-H100-80GB-HBM3", "b200": "NVIDIA-B200", "h200": "NVIDIA-H200"}


# ---- pure decisions (no cluster) --------------------------------------------------------------


def _cmd(**kw) -> Command:
    base = {"id": f"c-{uuid.uuid4().hex[:8]}", "ts": NOW, "reason": "test"}
    return Command(**{**base, **kw})


def _node(**kw) -> dict:
    return {"labels": {}, "annotations": {}, "unschedulable": False, "taints": [], **kw}


def test_decide_drain_cordons_at_once_and_evicts_only_after_requires():
    view = ClusterView(nodes={"n1": _node()}, pods=[
        {"name": "p1", "namespace": "ns", "node": "n1", "deleting": False},
        {"name": "p2", "namespace": "ns", "node": "n2", "deleting": False}])
    cmd = _cmd(type="drain", job="j", node="n1", gpu=2, requires=["ckpt"])
    d = decide(cmd, view, done_ids=[])
    assert d.waiting == ["ckpt"] and not d.done
    assert [a.verb for a in d.actions] == ["create", "patch"]  # event, then cordon + taint
    assert d.actions[1].body["spec"]["unschedulable"] is True
    assert d.actions[1].body["spec"]["taints"][0]["key"] == DRAIN_TAINT
    d = decide(cmd, view, done_ids=["ckpt"])
    evicted = [a.name for a in d.actions if a.verb == "evict"]
    assert evicted == ["p1"] and d.done  # only the job's pod on the drained node
    assert d.finish and "done" in d.finish[0].body["metadata"]["annotations"][ANN_COMMANDS]


def test_decide_refuses_what_it_cannot_do():
    assert "no node" in decide(_cmd(type="drain"), ClusterView()).error
    assert "not found" in decide(_cmd(type="drain", node="ghost"), ClusterView()).error
    assert "not a Kubernetes command" in decide(_cmd(type="rebalance", job="j"), ClusterView()).error
    assert "no PodGroup" in decide(_cmd(type="resize", job="j"), ClusterView()).error
    bad = _cmd(type="consolidate", node="n1", params={"action": "nap"})
    assert "params.action" in decide(bad, ClusterView(nodes={"n1": _node()})).error


def _grow_view(owner: str | None = None, pods: bool = True) -> ClusterView:
    """A job of one 8-GPU H100 pod on n0; free nodes n1 (H100), n2 (B200), n3 (an unknown product)."""
    products = {"n0": PRODUCTS["h100-sxm"], "n1": PRODUCTS["h100-sxm"], "n2": PRODUCTS["b200"],
                "n3": "ACME-X1"}
    labels = {"fleetwise.io/job": "j", "kai.scheduler/subgroup-name": "h100-sxm"}
    trainer = {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": "8"}}}
    manifest = {"metadata": {"labels": labels, "annotations": {"pod-group-name": "j"}},
                "spec": {"nodeName": "n0", "priority": 0, "containers": [trainer],
                         "nodeSelector": {"nvidia.com/gpu.product": products["n0"]}}}
    pod = {"name": "j-h100-sxm-0", "namespace": "ns", "node": "n0", "deleting": False, "subgroup": "h100-sxm",
           "owner": owner, "manifest": manifest}
    subs = {"h100-sxm": {"product": products["n0"], "gpus_per_pod": 8, "pods": 1}}
    return ClusterView(
        nodes={n: _node(labels={"nvidia.com/gpu.product": p}) for n, p in products.items()},
        pods=[pod] if pods else [],
        pod_group={"name": "j", "namespace": "ns",
                   "spec": {"minMember": 1, "subGroups": [{"name": "h100-sxm", "minMember": 1}]},
                   "annotations": {"fleetwise.io/subgroups": json.dumps(subs)}})


def test_decide_pytorchjob_transfer_resumed_leaves_the_operator_s_new_pods_alone():
    """A consumer resuming a PyTorchJob's transfer (the gang re-targeted, `applied`) after the
    operator made the job's pod again on the destination: the same template patch, and only the
    pod still on the node the job left is evicted."""
    view = _grow_view(owner="PyTorchJob/j")
    worker = {"replicas": 1, "template": {"metadata": {}, "spec": view.pods[0]["manifest"]["spec"]}}
    view.workload = {"kind": "PyTorchJob", "name": "j", "namespace": "ns",
                     "spec": {"pytorchReplicaSpecs": {"Worker": worker}}}
    move = _cmd(type="migrate", job="j", params={"phase": "transfer", "checkpoint_uri": "file:///c",
                                                 "destination": {"gpus": [["n2", g] for g in range(8)]}})
    first = decide(move, view)
    patch = [a for a in first.actions if a.kind == "PyTorchJob"]
    evicted = [a.name for a in first.actions if a.verb == "evict"]
    assert len(patch) == 1 and evicted == ["j-h100-sxm-0"]
    # Resumed: the gang took it; the operator has made the pod on n2, the old one is still there.
    ann = view.pod_group["annotations"]
    ann["fleetwise.io/commands"] = json.dumps({move.id: "applied"})
    remade = {**view.pods[0], "name": "j-worker-0", "node": "n2"}
    view.pods.append(remade)
    again = decide(move, view)
    assert [a.body for a in again.actions if a.kind == "PyTorchJob"] == [patch[0].body]
    assert [a.name for a in again.actions if a.verb == "evict"] == ["j-h100-sxm-0"]


def _jobset_view() -> ClusterView:
    """`_grow_view`'s job as a JobSet's: one replicated job `h100-sxm` of one pod (its Job's)."""
    view = _grow_view(owner="Job/j-h100-sxm-0")
    pod = view.pods[0]["manifest"]
    rjob = {"name": "h100-sxm", "replicas": 1, "template": {"spec": {
        "parallelism": 1, "completions": 1, "completionMode": "Indexed",
        "template": {"metadata": pod["metadata"], "spec": {**pod["spec"], "restartPolicy": "Never"}}}}}
    view.workload = {"kind": "JobSet", "name": "j", "namespace": "ns", "labels": {"fleetwise.io/job": "j"},
                     "annotations": {}, "spec": {"replicatedJobs": [rjob], "successPolicy": {
                         "operator": "All", "targetReplicatedJobs": ["h100-sxm"]}}}
    view.configmap = {"name": "j-fleetwise", "namespace": "ns", "data": {}}
    return view


def test_decide_jobset_move_records_deletes_evicts_and_makes_it_again_and_resumes():
    """A JobSet's replicated jobs cannot change: a transfer writes the JobSet it will make to the
    ConfigMap, deletes the old one, evicts the job's pods, makes the new one. A consumer that
    crashed after the delete makes the recorded one; after the create, it only evicts."""
    view = _jobset_view()
    move = _cmd(type="migrate", job="j", params={"phase": "transfer", "checkpoint_uri": "file:///c",
                                                 "destination": {"gpus": [["n2", g] for g in range(8)]}})
    first = decide(move, view)
    assert not first.error and first.done
    js = [(a.verb, a.kind) for a in first.actions if a.kind in ("JobSet", "ConfigMap") or a.verb == "evict"]
    assert js == [("patch", "ConfigMap"), ("patch", "ConfigMap"), ("delete", "JobSet"), ("evict", "Pod"),
                  ("create", "JobSet")]
    made = first.actions[-1].body
    assert made["metadata"]["annotations"]["fleetwise.io/rebuilt-by"] == move.id
    (rjob,) = made["spec"]["replicatedJobs"]
    tmpl = rjob["template"]["spec"]["template"]
    assert rjob["name"] == "b200" and rjob["template"]["spec"]["parallelism"] == 1
    # A policy naming the old replicated job names the new one (else the JobSet is refused).
    assert made["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["b200"]}
    assert tmpl["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == PRODUCTS["b200"]
    assert tmpl["metadata"]["labels"]["kai.scheduler/subgroup-name"] == "b200"
    assert tmpl["metadata"]["annotations"]["fleetwise.io/joined-by"] == move.id
    record = json.loads(next(a for a in first.actions if "jobset.json" in a.body.get("data", {}))
                        .body["data"]["jobset.json"])
    assert record == {"command": move.id, "jobset": made}
    # Crashed after the delete: no JobSet, the record in the ConfigMap, the old pod still there.
    view.pod_group["annotations"]["fleetwise.io/commands"] = json.dumps({move.id: "applied"})
    view.workload = None
    view.configmap["data"]["jobset.json"] = json.dumps(record)
    again = decide(move, view)
    assert [(a.verb, a.kind) for a in again.actions if a.kind != "ConfigMap"] == [
        ("evict", "Pod"), ("create", "JobSet")]
    assert again.actions[-1].body == made
    # Crashed after the create: the new JobSet's pod is left alone, the old one evicted.
    view.workload = {**made["metadata"], "kind": "JobSet", "spec": made["spec"]}
    view.pods.append({**view.pods[0], "name": "j-b200-0-0", "node": "n2",
                      "manifest": {"metadata": tmpl["metadata"], "spec": tmpl["spec"]}})
    last = decide(move, view)
    assert [(a.verb, a.name) for a in last.actions if a.kind in ("JobSet", "Pod")] == [
        ("evict", "j-h100-sxm-0")]
    # No JobSet found and nothing recorded: pods of a Job alone are not ours to make, and the ack says so.
    view.workload, view.configmap["data"] = None, {}
    orphan = decide(move, view)
    assert not [a for a in orphan.actions if a.verb == "create"]
    assert "belong to Job/j-h100-sxm-0" in orphan.detail


def test_decide_jobset_consolidation_move_makes_it_again_on_the_new_node():
    view = _jobset_view()
    moves = [{"from": {"node": "n0", "gpu": g}, "to": {"node": "n1", "gpu": g}} for g in range(8)]
    d = decide(_cmd(type="consolidate", job="j", params={"action": "move", "moves": moves}), view)
    assert not d.error and d.done
    assert [(a.verb, a.kind) for a in d.actions if a.kind == "JobSet" or a.verb == "evict"] == [
        ("delete", "JobSet"), ("evict", "Pod"), ("create", "JobSet")]
    (rjob,) = d.actions[-1].body["spec"]["replicatedJobs"]
    term = rjob["template"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert rjob["name"] == "h100-sxm" and {"key": "kubernetes.io/hostname", "operator": "In",
                                           "values": ["n1"]} in term["matchExpressions"]


def test_decide_growth_pods_per_product_and_pod_shape():
    join = ([["n1", g] for g in range(8)] + [["n1b", 0]] + [["n2", g] for g in range(8)]
            + [["n3", g] for g in range(2)])
    cmd = _cmd(type="resize", job="j", params={"world_size": 26, "join": join})
    d = decide(cmd, _grow_view())
    assert d.done and not d.error
    pg_patch = d.actions[0].body
    subs = json.loads(pg_patch["metadata"]["annotations"]["fleetwise.io/subgroups"])
    assert {k: (v["product"], v["gpus_per_pod"], v["pods"]) for k, v in subs.items()} == {
        "h100-sxm": (PRODUCTS["h100-sxm"], 8, 2), "b200": (PRODUCTS["b200"], 8, 1),
        "acme-x1": ("ACME-X1", 2, 1)}
    assert pg_patch["spec"]["minMember"] == 4
    created = {a.body["metadata"]["labels"]["kai.scheduler/subgroup-name"]: a.body for a in d.actions
               if a.verb == "create"}
    assert set(created) == {"h100-sxm", "b200", "acme-x1"}
    b200 = created["b200"]["spec"]
    assert "nodeName" not in b200 and "priority" not in b200
    assert b200["nodeSelector"]["nvidia.com/gpu.product"] == PRODUCTS["b200"]
    assert created["acme-x1"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "n1b" in d.detail  # a node the cluster does not have: named, nothing made for it
    assert d.finish[0].body["metadata"]["annotations"][ANN_COMMANDS].endswith(f'"{cmd.id}":"done"}}')
    # Four more H100 GPUs on a node: not a whole 8-GPU pod, so a subgroup of 4-GPU pods.
    half = decide(_cmd(type="resize", job="j", params={"join": [["n1", g] for g in range(4)]}), _grow_view())
    subs = json.loads(half.actions[0].body["metadata"]["annotations"]["fleetwise.io/subgroups"])
    assert subs["h100-sxm-x4"]["gpus_per_pod"] == 4 and subs["h100-sxm"]["pods"] == 1
    # A pod of the job still live on a joining node holds its GPUs: none made there; one that
    # ended does not.
    for phase, made in (("Running", 0), ("Succeeded", 1)):
        view = _grow_view()
        view.pods.append({**view.pods[0], "name": "j-h100-sxm-1", "node": "n1", "phase": phase})
        d = decide(_cmd(type="resize", job="j", params={"join": [["n1", g] for g in range(8)]}), view)
        assert len([a for a in d.actions if a.verb == "create"]) == made
    # A PyTorchJob that is not elastic gets no replicas; a resize that only lets GPUs go asks
    # nothing of it.
    owned = _grow_view(owner="PyTorchJob/j")
    owned.workload = {"kind": "PyTorchJob", "name": "j", "namespace": "ns",
                      "spec": {"pytorchReplicaSpecs": {"Master": {}}}}
    assert "PyTorchJob j is not elastic" in decide(cmd, owned).detail
    shrink = decide(_cmd(type="resize", job="j", params={"leave": [["n0", g] for g in range(8)]}), owned)
    assert shrink.done and "no pod" not in shrink.detail
    # Pods a controller owns are its to add; a job with no pod has nothing to copy.
    for view, why in ((_grow_view(owner="JobSet/j"), "belong to JobSet/j"),
                      (_grow_view(pods=False), "no pod")):
        d = decide(cmd, view)
        assert d.done and not [a for a in d.actions if a.verb == "create"] and why in d.detail
        assert d.actions[0].body["spec"]["minMember"] == 4  # the gang still follows the plan


def test_the_fleet_drain_cap_counts_the_cluster_s_drained_sets():
    nodes = {"a": _node(gpus=8, annotations={ANN_DRAINED_GPUS: "[1, 5]"}),
             "b": _node(gpus=8, annotations={ANN_DRAINED_GPUS: "[-1]"}),  # the whole node: 8
             "c": _node(gpus=8), "d": _node()}  # d: capacity not reported
    assert count_drained(nodes.values()) == (10, 24)
    view = ClusterView(nodes=nodes)
    rails = Rails(max_drained_gpus_fleet=11, max_drained_share_fleet=1.0)
    assert fleet_cap_refusal(_cmd(type="drain", node="c", gpu=0), view, 10, 24, rails) is None
    rails = Rails(max_drained_gpus_fleet=10, max_drained_share_fleet=1.0)
    assert fleet_cap_refusal(_cmd(type="drain", node="c", gpu=0), view, 10, 24, rails) == (
        "fleet drain cap: 10 of 24 GPUs on the cluster are drained (cap 10): drain of c/gpu0 refused")
    assert "drain of node c refused" in fleet_cap_refusal(_cmd(type="drain", node="c"), view, 10, 24, rails)
    # Not new: a GPU already drained (a resumed or repeated drain), any GPU of a drained node.
    assert fleet_cap_refusal(_cmd(type="drain", node="a", gpu=5), view, 10, 24, rails) is None
    assert fleet_cap_refusal(_cmd(type="drain", node="b", gpu=2), view, 10, 24, rails) is None
    # The share of the cluster's GPUs (5% of 24: one GPU at least) when it is the tighter cap.
    assert "(cap 1)" in fleet_cap_refusal(_cmd(type="drain", node="c", gpu=0), view, 1, 24, Rails())
    assert fleet_cap_refusal(_cmd(type="drain", node="c", gpu=0), view, 0, 24, Rails()) is None


def test_kube_consumer_cli_refuses_a_bad_policy_file_before_connecting(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fleetwise.cli import app

    monkeypatch.setenv("FLEETWISE_SIGNING_KEYS", "k1=test-secret-one-0123456789")
    bad = tmp_path / "policy.yaml"
    bad.write_text("rails:\n  max_drained_gpus_fleet: -1\n")
    result = CliRunner().invoke(app, ["kube", "consumer", "--bootstrap", "127.0.0.1:1", "--policy", str(bad)])
    assert result.exit_code == 2, result.output
    assert "rails.max_drained_gpus_fleet" in result.output and "Traceback" not in result.output


def test_required_rbac_is_least_privilege():
    verbs = {(r["apiGroups"][0], res): set(r["verbs"]) for r in required_rbac() for res in r["resources"]}
    assert verbs[("", "pods/eviction")] == {"create"}
    assert verbs[("", "pods")] == {"create", "list"}  # never delete: pods leave through the Eviction API
    # The one delete: a JobSet, made again by a move (its replicated jobs cannot change).
    assert [k for k, v in verbs.items() if "delete" in v] == [("jobset.x-k8s.io", "jobsets")]
    assert all("*" not in v for v in verbs.values())


def test_dry_run_prints_calls_and_plays_them_once():
    lines: list[str] = []
    consumer = KubeConsumer(DryRunApi(out=lines.append), KEYS, clock=lambda: NOW)
    drain = sign(_cmd(type="drain", job="llm", node="n1", gpu=0, requires=["ck"]), KEYS)
    assert [a.status for a in consumer.on_command(drain)] == ["applied"]
    assert [a.status for a in consumer.on_ack(Ack(command_id="ck", ts=NOW, by="training-plugin",
                                                  status="done"))] == ["done"]
    assert sum("PATCH /api/v1/nodes/n1" in line and "unschedulable" in line for line in lines) == 1
    assert sum("/eviction" in line for line in lines) == 1


def test_a_job_end_resets_the_job_command_sequence():
    """The control plane forgets an ended job, so a later run under the same name numbers its
    commands from 1 again: the consumer forgets the sequence at the job's end too."""
    consumer = KubeConsumer(DryRunApi(out=lambda _line: None), KEYS, clock=lambda: NOW)
    assert [a.status for a in consumer.on_command(
        sign(_cmd(type="drain", job="llm", node="n1", gpu=0, seq=5), KEYS))] == ["done"]
    replayed = sign(_cmd(type="drain", job="llm", node="n2", gpu=0, seq=1), KEYS)
    (ack,) = consumer.on_command(replayed)
    assert ack.status == "rejected" and "out of sequence" in ack.detail
    consumer.on_job_end(JobEnd(job="other"))  # another job's end changes nothing here
    assert consumer.on_command(sign(_cmd(type="drain", job="llm", node="n2", gpu=0, seq=2), KEYS))[0].status \
        == "rejected"
    consumer.on_job_end(JobEnd(job="llm"))
    new_run = sign(_cmd(type="drain", job="llm", node="n2", gpu=0, seq=1), KEYS)
    assert [a.status for a in consumer.on_command(new_run)] == ["done"]


def test_the_consumer_forgets_old_command_ids_and_keeps_a_bounded_log():
    """A consumer runs for months: the ids it finished and the `done` acks it saw are kept for
    RETAIN_IDS_S, its log for LOG_LINES lines. A duplicate older than that is caught by the
    phase recorded on the cluster (here the dry run's), not acted on again."""
    from fleetwise.kube.consumer import LOG_LINES, RETAIN_IDS_S

    now = [NOW]
    consumer = KubeConsumer(DryRunApi(out=lambda _line: None), KEYS, clock=lambda: now[0],
                            rails=Rails(max_drained_gpus_fleet=10 * LOG_LINES))  # 1,000+ drains
    old = sign(_cmd(type="drain", node="n0", gpu=0, expires_ts=NOW + 1800), KEYS)
    assert [a.status for a in consumer.on_command(old)] == ["done"]
    for i in range(LOG_LINES):  # plenty of API calls
        now[0] += 1.0
        consumer.on_command(sign(_cmd(type="drain", node=f"n{i % 50}", gpu=1, ts=now[0]), KEYS))
    assert len(consumer.log) == LOG_LINES
    assert old.id in consumer.finished and len(consumer.finished) == LOG_LINES + 1
    now[0] = NOW + RETAIN_IDS_S + 2 * LOG_LINES
    consumer.tick()
    assert len(consumer.finished) == 0 and len(consumer.done_acks) == 0
    before = list(consumer.log)
    (ack,) = consumer.on_command(old)
    assert (ack.status, ack.detail) == ("done", "duplicate") and list(consumer.log) == before


def test_the_consumer_loop_reads_job_ends_and_skips_what_is_not_a_record(tmp_path):
    from fleetwise.training.transport import LocalTransport

    bus = LocalTransport(tmp_path)
    consumer = KubeConsumer(DryRunApi(out=lambda _line: None), KEYS, clock=lambda: NOW)
    consumer.last_seq["llm"] = 7
    with bus.path(T.PLANS.name).open("w") as fh:  # a tombstone, then a value that is no plan
        fh.write('{"key": "llm", "value": null}\n{"key": "x", "value": {"job": "x"}}\n')
    consumer.run(bus, max_s=0.3, poll_s=0.05)
    assert "llm" not in consumer.last_seq


# ---- against the API server ------------------------------------------------------------------


def _plan(nodes: dict[str, str], gpus_per_node: int = 8) -> Plan:
    """One data-parallel replica per GPU over the given {node: gpu model}."""
    ranks = []
    for node, model in nodes.items():
        for g in range(gpus_per_node):
            r = len(ranks)
            ranks.append(RankPlan(rank=r, node=node, gpu=g, model=model, capability_tflops=900.0,
                                  micro_batch=2, num_micro_batches=1, stage=0, layers=(0, 31), dp_rank=r,
                                  tp_rank=0, memory_gb=40, memory_capacity_gb=80))
    return Plan(job="job", dp=len(ranks), tp=1, pp=1, zero_stage=1, global_batch=2 * len(ranks), seq_len=2048,
                predicted_step_s=1.0, tokens_per_s=1.0, mfu=0.4, ranks=ranks)


class Cluster:
    """Nodes (API objects with GFD labels and GPU capacity) and a job's rendered objects."""

    def __init__(self, kube, namespace: str) -> None:
        from kubernetes import client

        self.kube = kube
        self.ns = namespace
        self.core = client.CoreV1Api(kube.api_client())
        self.custom = client.CustomObjectsApi(kube.api_client())
        self.policy = client.PolicyV1Api(kube.api_client())
        self.batch = client.BatchV1Api(kube.api_client())
        self.prefix = f"fw{uuid.uuid4().hex[:6]}"
        self.nodes: list[str] = []

    def node_name(self, i: int) -> str:
        return f"{self.prefix}-n{i}"

    def add_nodes(self, models: list[str]) -> dict[str, str]:
        out = {}
        for i, model in enumerate(models):
            name = self.node_name(i)
            resources = {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi", "pods": "110"}
            labels = {"nvidia.com/gpu.product": PRODUCTS[model], "nvidia.com/gpu.count": "8",
                      "kubernetes.io/hostname": name}
            self.core.create_node({"metadata": {"name": name, "labels": labels},
                                   "status": {"capacity": resources, "allocatable": resources}})
            self.nodes.append(name)
            out[name] = model
        return out

    def deploy(self, job: str, nodes: dict[str, str]) -> list[dict]:
        """The job's rendered objects, each pod bound to its node as a scheduler would."""
        objects = render_plan(_plan(nodes), job, "team-a", namespace=self.ns)
        by_product = {PRODUCTS[m]: [n for n, mm in nodes.items() if mm == m] for m in set(nodes.values())}
        for o in objects:
            if o["kind"] == "Pod":
                o["spec"]["nodeName"] = by_product[o["spec"]["nodeSelector"]["nvidia.com/gpu.product"]].pop(0)
        self.kube.apply(objects)
        return objects

    def set_running(self, job: str) -> None:
        """Pods as a kubelet would report them: Running and Ready (PodDisruptionBudgets guard
        only running pods; the Eviction API deletes a Pending one regardless)."""
        for name in self.pods(job):
            self.core.patch_namespaced_pod_status(
                name, self.ns, {"status": {"phase": "Running", "conditions": [
                    {"type": "Ready", "status": "True"}]}},
                _content_type="application/strategic-merge-patch+json")

    def node(self, name: str):
        return self.core.read_node(name)

    def pods(self, job: str) -> dict[str, object]:
        return {p.metadata.name: p for p in self.core.list_namespaced_pod(
            self.ns, label_selector=f"fleetwise.io/job={job}").items}

    def jobset(self, name: str) -> dict:
        return self.custom.get_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", self.ns, "jobsets", name)

    def pod_group(self, job: str) -> dict:
        return self.custom.get_namespaced_custom_object("scheduling.run.ai", "v2alpha2", self.ns,
                                                        "podgroups", job)

    def cleanup(self) -> None:
        for n in self.nodes:
            with contextlib.suppress(Exception):  # best effort
                self.core.delete_node(n)


@pytest.fixture
def cluster(kube_api, kube_crds, kube_namespace):
    c = Cluster(kube_api, kube_namespace)
    yield c
    c.cleanup()


def _consumer(cluster: Cluster, api=None) -> KubeConsumer:
    return KubeConsumer(api or ClientApi(cluster.kube.api_client()), KEYS, namespace=cluster.ns,
                        clock=lambda: NOW)


def _statuses(acks: list[Ack]) -> list[tuple[str, str | None]]:
    return [(a.status, a.detail) for a in acks]


def _taints(node) -> dict[str, str]:
    return {t.key: t.value for t in (node.spec.taints or [])}


def _events(cluster: Cluster, node: str) -> list:
    return [e for e in cluster.core.list_namespaced_event("default").items
            if e.involved_object.name == node and e.reason == "FleetwiseDrain"]


def test_drain_waits_for_the_checkpoint_then_evicts_and_is_idempotent(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "b200"])
    cluster.deploy("llm", nodes)
    target = cluster.node_name(1)
    ckpt = "checkpoint-1"
    drain = sign(_cmd(type="drain", job="llm", node=target, gpu=3, reason="XID 79: GPU fell off the bus",
                      requires=[ckpt]), KEYS)
    consumer = _consumer(cluster)
    acks = consumer.on_command(drain)
    assert [a.status for a in acks] == ["applied"] and all(a.by == "kube-consumer" for a in acks)
    node = cluster.node(target)
    assert node.spec.unschedulable is True
    assert _taints(node)[DRAIN_TAINT].startswith("XID-79")
    assert len(_events(cluster, target)) == 1 and "XID 79" in _events(cluster, target)[0].message
    # Not evicted before the training side acked its checkpoint.
    assert all(p.metadata.deletion_timestamp is None for p in cluster.pods("llm").values())
    assert consumer.tick() == []
    other = consumer.on_ack(Ack(command_id="unrelated", ts=NOW, by="training-plugin", status="done"))
    assert other == [] and all(p.metadata.deletion_timestamp is None for p in cluster.pods("llm").values())

    acks = consumer.on_ack(Ack(command_id=ckpt, ts=NOW, by="training-plugin", status="done"))
    assert [a.status for a in acks] == ["done"]
    pods = cluster.pods("llm")
    leaving = {n for n, p in pods.items() if p.spec.node_name == target}
    assert leaving and all(pods[n].metadata.deletion_timestamp is not None for n in leaving)
    assert all(p.metadata.deletion_timestamp is None for n, p in pods.items() if n not in leaving)
    pg = cluster.pod_group("llm")
    assert pg["spec"]["minMember"] == 2  # 3 pods, one let go: KAI keeps the rest of the gang
    assert {s["name"]: s["minMember"] for s in pg["spec"]["subGroups"]} == {"h100-sxm": 1, "b200": 1}

    # The same command again: a duplicate, nothing changes (this consumer, and a restarted one).
    assert _statuses(consumer.on_command(drain)) == [("done", "duplicate")]
    assert _statuses(_consumer(cluster).on_command(drain)) == [("done", "duplicate")]
    assert len(_events(cluster, target)) == 1
    assert cluster.pod_group("llm")["spec"]["minMember"] == 2

    # An unsigned return is refused and changes nothing; a signed one untaints and uncordons.
    unsigned = OperatorAction(ts=NOW + 60, action="return_gpu", node=target, gpu=3)
    assert _statuses(consumer.on_operator(unsigned)) == [
        ("rejected", "unsigned: the operator action carries no signature")]
    assert cluster.node(target).spec.unschedulable and DRAIN_TAINT in _taints(cluster.node(target))
    acks = consumer.on_operator(sign(unsigned, operator_keyring()))
    assert [a.status for a in acks] == ["done"]
    node = cluster.node(target)
    assert not node.spec.unschedulable and DRAIN_TAINT not in _taints(node)


def test_restarted_consumer_resumes_a_drain_from_the_cluster(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm"])
    cluster.deploy("resume", nodes)
    target = cluster.node_name(0)
    drain = sign(_cmd(type="drain", job="resume", node=target, gpu=0, requires=["ck-r"]), KEYS)
    assert [a.status for a in _consumer(cluster).on_command(drain)] == ["applied"]
    # The first consumer dies. A new one reads the topics again: the command, then the ack.
    fresh = _consumer(cluster)
    acks = fresh.on_command(drain)
    assert [a.status for a in acks] == ["applied"]  # known on the node as applied, not done
    assert [a.status for a in fresh.on_ack(Ack(command_id="ck-r", ts=NOW, by="training-plugin",
                                               status="done"))] == ["done"]
    assert len(_events(cluster, target)) == 1  # not recorded twice
    assert json.loads(cluster.node(target).metadata.annotations[ANN_COMMANDS])[drain.id] == "done"


def test_unsigned_and_forged_commands_are_refused_and_change_nothing(cluster):
    (target,) = cluster.add_nodes(["b200"])
    consumer = _consumer(cluster)
    unsigned = _cmd(type="drain", node=target)
    (ack,) = consumer.on_command(unsigned)
    assert ack.status == "rejected" and "unsigned" in ack.detail
    forged = sign(_cmd(type="drain", node=target), Keyring.parse("k1=not-the-key-0123456789abcdef"))
    (ack,) = consumer.on_command(forged)
    assert ack.status == "rejected" and "bad signature" in ack.detail
    node = cluster.node(target)
    assert not node.spec.unschedulable and DRAIN_TAINT not in _taints(node)
    assert not (node.metadata.annotations or {}).get(ANN_COMMANDS)


def test_a_consumer_holding_only_a_public_key_applies_what_the_private_key_signed(cluster):
    (target,) = cluster.add_nodes(["b200"])
    private, public = generate_ed25519_entries("e1")
    consumer = KubeConsumer(ClientApi(cluster.kube.api_client()), Keyring.parse(public), namespace=cluster.ns,
                            clock=lambda: NOW)
    (ack,) = consumer.on_command(sign(_cmd(type="drain", node=target), KEYS))  # an HMAC key it lacks
    assert ack.status == "rejected" and "unknown key id 'k1'" in ack.detail
    assert not cluster.node(target).spec.unschedulable
    (ack,) = consumer.on_command(sign(_cmd(type="drain", node=target), Keyring.parse(private)))
    assert ack.status in ("applied", "done"), ack
    assert cluster.node(target).spec.unschedulable and DRAIN_TAINT in _taints(cluster.node(target))


def test_eviction_respects_a_pod_disruption_budget(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm"])
    cluster.deploy("pdb", nodes)
    cluster.set_running("pdb")
    cluster.policy.create_namespaced_pod_disruption_budget(cluster.ns, {
        "metadata": {"name": "pdb"},
        "spec": {"minAvailable": 2, "selector": {"matchLabels": {"fleetwise.io/job": "pdb"}}}})
    # The disruption controller (kube-controller-manager) fills the PDB's status; without it
    # the API server treats the budget as not yet computed and refuses evictions all the same.
    target = cluster.node_name(0)
    consumer = _consumer(cluster)
    drain = sign(_cmd(type="drain", job="pdb", node=target, gpu=0), KEYS)
    acks = consumer.on_command(drain)
    assert [a.status for a in acks] == ["applied"] and "waiting" in acks[0].detail
    assert all(p.metadata.deletion_timestamp is None for p in cluster.pods("pdb").values())
    assert consumer.tick() == []  # still refused; acked once
    cluster.policy.delete_namespaced_pod_disruption_budget("pdb", cluster.ns)
    deadline = time.monotonic() + 20
    acks = []
    while not acks and time.monotonic() < deadline:
        acks = consumer.tick()
        time.sleep(0.2)
    assert [a.status for a in acks] == ["done"]
    pods = cluster.pods("pdb")
    assert any(p.metadata.deletion_timestamp is not None for p in pods.values() if p.spec.node_name == target)


def test_resize_updates_the_gang_and_the_envelope(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "b200", "b200"])
    cluster.deploy("rs", nodes)
    gone = cluster.node_name(1)
    resize = sign(_cmd(type="resize", job="rs", node=gone, seq=1, params={
        "world_size": 24, "leave": [[gone, g] for g in range(8)], "join": [],
        "samples": {str(i): 2 for i in range(24)}}), KEYS)
    consumer = _consumer(cluster)
    assert [a.status for a in consumer.on_command(resize)] == ["done"]
    pg = cluster.pod_group("rs")
    assert pg["spec"]["minMember"] == 3
    assert {s["name"]: s["minMember"] for s in pg["spec"]["subGroups"]} == {"h100-sxm": 1, "b200": 2}
    assert pg["metadata"]["annotations"]["fleetwise.io/world-size"] == "24"
    cm = cluster.core.read_namespaced_config_map("rs-fleetwise", cluster.ns)
    assert json.loads(cm.data["resize.json"])["world_size"] == 24
    # The node comes back: the gang grows again.
    grow = sign(_cmd(type="resize", job="rs", node=gone, seq=2, params={
        "world_size": 32, "join": [[gone, g] for g in range(8)]}), KEYS)
    assert [a.status for a in consumer.on_command(grow)] == ["done"]
    assert cluster.pod_group("rs")["spec"]["minMember"] == 4
    assert len(cluster.pods("rs")) == 4  # its pod there had not ended: it holds the GPUs again
    # A replayed older command is out of sequence: for this consumer, and for a restarted one,
    # which reads the job's last applied seq from its PodGroup.
    assert cluster.pod_group("rs")["metadata"]["annotations"][ANN_LAST_SEQ] == "2"
    older = sign(_cmd(type="resize", job="rs", seq=1, params={"world_size": 8}), KEYS)
    for c in (consumer, _consumer(cluster)):
        (ack,) = c.on_command(older)
        assert ack.status == "rejected"
        assert "out of sequence: seq 1 is not after the last applied 2" in ack.detail
    assert cluster.pod_group("rs")["spec"]["minMember"] == 4
    # The job ends: its record goes, and a new run's first command (seq 1) is applied.
    restarted = _consumer(cluster)
    restarted.on_job_end(JobEnd(job="rs", ts=NOW))
    assert ANN_LAST_SEQ not in (cluster.pod_group("rs")["metadata"].get("annotations") or {})
    again = sign(_cmd(type="resize", job="rs", seq=1, params={"world_size": 24, "leave": [[gone, 0]]}), KEYS)
    assert [a.status for a in restarted.on_command(again)] == ["done"]
    # A job whose PodGroup is gone: the end is logged, memory reset, nothing raised.
    restarted.on_job_end(JobEnd(job="no-such-job", ts=NOW))
    assert "job no-such-job ended" in restarted.log[-1]


def test_growth_creates_pods_and_a_subgroup_for_a_new_gpu_product(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "h200"])
    home, same, other = cluster.node_name(0), cluster.node_name(1), cluster.node_name(2)
    cluster.deploy("gr", {home: nodes[home]})
    grow = sign(_cmd(type="resize", job="gr", seq=1, params={
        "world_size": 20, "join": [[same, g] for g in range(8)] + [[other, g] for g in range(4)]}), KEYS)
    consumer = _consumer(cluster)
    (ack,) = consumer.on_command(grow)
    assert ack.status == "done", ack.detail
    pg = cluster.pod_group("gr")
    assert pg["spec"]["minMember"] == 3
    assert {s["name"]: s["minMember"] for s in pg["spec"]["subGroups"]} == {"h100-sxm": 2, "h200": 1}
    subs = json.loads(pg["metadata"]["annotations"]["fleetwise.io/subgroups"])
    assert subs["h200"] == {"product": "NVIDIA-H200", "gpu_model": "h200", "gpus_per_pod": 4, "pods": 1,
                            "gpus": 4}
    pods = cluster.pods("gr")
    new = {n: p for n, p in pods.items() if (p.metadata.annotations or {}).get(ANN_JOINED_BY) == grow.id}
    assert len(pods) == 3 and len(new) == 2
    by_sub = {p.metadata.labels["kai.scheduler/subgroup-name"]: p for p in new.values()}
    for sub, node, product, gpus in (("h100-sxm", same, "NVIDIA-H100-80GB-HBM3", "8"),
                                     ("h200", other, "NVIDIA-H200", "4")):
        p = by_sub[sub]
        assert p.spec.scheduler_name == "kai-scheduler" and p.spec.node_name is None  # KAI places it
        assert p.spec.node_selector["nvidia.com/gpu.product"] == product
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == gpus
        required = p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
        (term,) = required.node_selector_terms
        exprs = {e.key: (e.operator, e.values) for e in term.match_expressions}
        assert exprs["kubernetes.io/hostname"] == ("In", [node])
        assert exprs["nvidia.com/gpu.product"] == ("In", [product])
        assert exprs["nvidia.com/gpu.count"] == ("Gt", [str(int(gpus) - 1)])
        assert p.metadata.annotations["pod-group-name"] == "gr"
        assert p.metadata.labels["fleetwise.io/job"] == "gr"
    # A consumer that stopped after the PodGroup took the resize, before its last pod: a
    # restarted one creates only what is missing and counts the gang once.
    lost = by_sub["h200"].metadata.name
    cluster.core.delete_namespaced_pod(lost, cluster.ns, grace_period_seconds=0)
    ids = json.loads(pg["metadata"]["annotations"][ANN_COMMANDS])
    cluster.custom.patch_namespaced_custom_object(
        "scheduling.run.ai", "v2alpha2", cluster.ns, "podgroups", "gr",
        {"metadata": {"annotations": {ANN_COMMANDS: json.dumps({**ids, grow.id: "applied"})}}})
    deadline = time.monotonic() + 10
    while lost in cluster.pods("gr") and time.monotonic() < deadline:
        time.sleep(0.1)
    (ack,) = _consumer(cluster).on_command(grow)
    assert ack.status == "done", ack.detail
    assert set(cluster.pods("gr")) == set(pods)  # the same name again, nothing else
    pg = cluster.pod_group("gr")
    assert pg["spec"]["minMember"] == 3
    assert {s["name"]: s["minMember"] for s in pg["spec"]["subGroups"]} == {"h100-sxm": 2, "h200": 1}
    # Repeated to another restarted consumer: done on the cluster, a duplicate, no new pod.
    (ack,) = _consumer(cluster).on_command(grow)
    assert (ack.status, ack.detail) == ("done", "duplicate")
    assert set(cluster.pods("gr")) == set(pods)


def test_migrate_records_phases_and_retargets_the_gang_on_restore(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm"])
    cluster.deploy("mg", nodes)
    consumer = _consumer(cluster)
    snap = sign(_cmd(type="migrate", job="mg",
                     params={"phase": "snapshot", "checkpoint_uri": "s3://c/1"}), KEYS)
    assert [a.status for a in consumer.on_command(snap)] == ["done"]
    restore = sign(_cmd(type="migrate", job="mg", requires=[snap.id], params={
        "phase": "restore", "checkpoint_uri": "s3://c/1",
        "destination": {"gpu_product": "NVIDIA-B200", "pods": 1, "gpus_per_pod": 8,
                        "subgroup": "b200"}}), KEYS)
    assert [a.status for a in consumer.on_command(restore)] == ["done"]  # its requirement is done
    pg = cluster.pod_group("mg")
    assert json.loads(pg["metadata"]["annotations"]["fleetwise.io/migration"])["phase"] == "restore"
    assert pg["spec"]["subGroups"] == [{"name": "b200", "minMember": 1}] and pg["spec"]["minMember"] == 1
    cm = cluster.core.read_namespaced_config_map("mg-fleetwise", cluster.ns)
    assert json.loads(cm.data["migration.json"])["checkpoint_uri"] == "s3://c/1"


def _transfer(cluster, job: str, there: str, status: str = "done",
              consumer: KubeConsumer | None = None) -> tuple[Command, Ack]:
    """A migration's transfer of `job` to node `there`'s 8 GPUs as the policy sends it (after the
    snapshot, its requirement, is acked done), carried out by a new consumer: (command, its ack)."""
    consumer = consumer or _consumer(cluster)
    snapshot = f"snap-{job}"
    assert consumer.on_ack(Ack(command_id=snapshot, ts=NOW, by="training-plugin", status="done")) == []
    dest = {"gpus": [[there, g] for g in range(8)], "nodes": [there], "site": "b", "gpu_type": "b200"}
    move = sign(_cmd(type="migrate", job=job, requires=[snapshot], params={
        "phase": "transfer", "checkpoint_uri": f"file:///ckpt/{job}", "destination": dest}), KEYS)
    (ack,) = consumer.on_command(move)
    assert ack.status == status, ack.detail
    return move, ack


def _operator_pod(cluster, job: dict, name: str, node: str) -> None:
    """The pod a PyTorchJob's training operator would make from its Worker template (no operator
    runs here), owned by the job and bound to `node`."""
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    cluster.core.create_namespaced_pod(cluster.ns, {
        "metadata": {**template["metadata"], "name": name, "ownerReferences": [{
            "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": job["metadata"]["name"],
            "uid": job["metadata"]["uid"], "controller": True}]},
        "spec": {**template["spec"], "nodeName": node}})


def test_an_elastic_pytorchjob_grows_by_its_worker_replicas(cluster):
    """Pods a PyTorchJob owns are its operator's to make: a growth raises its Worker replicas
    (GPUs of its one template only, up to elasticPolicy.maxReplicas), and the gang follows."""
    from pathlib import Path

    from fleetwise.schemas import JobConstraints

    cluster.kube.install_crds([Path(__file__).parent / "data" / "pytorchjob-crd.yaml"])
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "b200", "h100-sxm"])
    home, more, other, last = (cluster.node_name(i) for i in range(4))
    plan = _plan({home: nodes[home]}).model_copy(update={"constraints": JobConstraints(max_gpus=16)})
    objects = render_plan(plan, "pt", "team-a", namespace=cluster.ns, workload="pytorchjob")
    cluster.kube.apply(objects)
    job = cluster.custom.get_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", "pt")
    assert job["spec"]["elasticPolicy"]["maxReplicas"] == 2 and job["spec"]["pytorchReplicaSpecs"]["Worker"][
        "replicas"] == 1
    _operator_pod(cluster, job, "pt-worker-0", home)
    consumer = _consumer(cluster)
    grow = sign(_cmd(type="resize", job="pt", seq=1, params={
        "join": [[more, g] for g in range(8)] + [[other, g] for g in range(8)]}), KEYS)
    (ack,) = consumer.on_command(grow)
    assert ack.status == "done", ack.detail
    assert "PyTorchJob pt: Worker replicas 2" in ack.detail and f"no pod for them: {other}" in ack.detail
    job = cluster.custom.get_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", "pt")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert list(cluster.pods("pt")) == ["pt-worker-0"]  # the operator's to make, not ours
    pg = cluster.pod_group("pt")
    assert pg["spec"]["minMember"] == 2  # the B200 GPUs get no pod: not in the gang either
    # Past elasticPolicy.maxReplicas: nothing changes, the reason named.
    more_still = sign(_cmd(type="resize", job="pt", seq=2, params={"join": [[last, g] for g in range(8)]}),
                      KEYS)
    (ack,) = consumer.on_command(more_still)
    assert "would pass PyTorchJob pt's elasticPolicy.maxReplicas 2" in ack.detail
    assert cluster.custom.get_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", "pt")[
        "spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    assert cluster.pod_group("pt")["spec"]["minMember"] == 2


def test_a_migration_transfer_moves_a_pytorchjob_s_worker_template(cluster):
    """Pods a PyTorchJob owns are its operator's: a migration's transfer re-targets its Worker
    template (GPU product, node affinity to the destination, replicas) and evicts its pods, which
    the operator makes again from the new template (no operator runs here: the test checks the
    job and the evictions)."""
    from pathlib import Path

    from fleetwise.schemas import JobConstraints

    cluster.kube.install_crds([Path(__file__).parent / "data" / "pytorchjob-crd.yaml"])
    nodes = cluster.add_nodes(["h100-sxm", "b200"])
    home, there = cluster.node_name(0), cluster.node_name(1)
    plan = _plan({home: nodes[home]}).model_copy(update={"constraints": JobConstraints(max_gpus=16)})
    cluster.kube.apply(render_plan(plan, "ptm", "team-a", namespace=cluster.ns, workload="pytorchjob"))
    job = cluster.custom.get_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", "ptm")
    _operator_pod(cluster, job, "ptm-worker-0", home)
    move, ack = _transfer(cluster, "ptm", there)
    assert f"PyTorchJob ptm: Worker template on {there} (1 replicas), 1 pod(s) evicted" in ack.detail
    worker = cluster.custom.get_namespaced_custom_object(
        "kubeflow.org", "v1", cluster.ns, "pytorchjobs", "ptm")["spec"]["pytorchReplicaSpecs"]["Worker"]
    spec = worker["template"]["spec"]
    assert worker["replicas"] == 1 and spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-B200"
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": "kubernetes.io/hostname", "operator": "In", "values": [there]} in term["matchExpressions"]
    assert {c["resources"]["limits"]["nvidia.com/gpu"] for c in spec["containers"]
            if "nvidia.com/gpu" in c["resources"].get("limits", {})} == {"8"}
    pods = cluster.pods("ptm")
    assert "ptm-worker-0" not in pods or pods["ptm-worker-0"].metadata.deletion_timestamp is not None
    assert len(pods) <= 1  # none made by the consumer: the operator's to make
    pg = cluster.pod_group("ptm")
    assert pg["spec"]["subGroups"] == [{"name": "b200", "minMember": 1}] and pg["spec"]["minMember"] == 1
    # Done on the cluster: a restarted consumer changes nothing.
    (ack,) = _consumer(cluster).on_command(move)
    assert (ack.status, ack.detail) == ("done", "duplicate")


def _jobset_job(cluster, name: str, finalizers: tuple[str, ...] = ()) -> tuple[str, str, dict]:
    """A job rendered as a JobSet on an H100 node (a B200 node beside it), with the Job and pod
    its controllers would make (no JobSet controller runs here; the Job is suspended, so that the
    Job controller makes no pod of its own): (its node, the other node, the JobSet)."""
    from pathlib import Path

    cluster.kube.install_crds([Path(__file__).parent / "data" / "jobset-crd.yaml"])
    nodes = cluster.add_nodes(["h100-sxm", "b200"])
    home, there = cluster.node_name(0), cluster.node_name(1)
    objects = render_plan(_plan({home: nodes[home]}), name, "team-a", namespace=cluster.ns, workload="jobset")
    for o in objects:
        if o["kind"] == "JobSet" and finalizers:
            o["metadata"]["finalizers"] = list(finalizers)
    cluster.kube.apply(objects)
    js = cluster.jobset(name)
    (rjob,) = js["spec"]["replicatedJobs"]
    owned_by = [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": name,
                 "uid": js["metadata"]["uid"], "controller": True}]
    job = cluster.batch.create_namespaced_job(cluster.ns, {
        "metadata": {"name": f"{name}-h100-sxm-0", "ownerReferences": owned_by},
        "spec": {**rjob["template"]["spec"], "suspend": True}})
    template = rjob["template"]["spec"]["template"]
    cluster.core.create_namespaced_pod(cluster.ns, {
        "metadata": {**template["metadata"], "name": f"{name}-h100-sxm-0-0", "ownerReferences": [{
            "apiVersion": "batch/v1", "kind": "Job", "name": job.metadata.name, "uid": job.metadata.uid,
            "controller": True}]},
        "spec": {**template["spec"], "nodeName": home}})
    return home, there, js


def test_a_migration_transfer_makes_a_jobset_again_on_the_destination(cluster):
    """A JobSet's replicated jobs cannot change: a migration's transfer deletes the job's JobSet
    and makes it again for the destination (its replicated job's pods asking for the
    destination's GPU product, held to its node), evicting the old pods; the JobSet to make is
    recorded in the job's ConfigMap first. No JobSet or Job controller runs here: the test makes
    the pod a Job would, and checks the JobSet and the evictions."""
    home, there, old = _jobset_job(cluster, "jsm")
    move, ack = _transfer(cluster, "jsm", there)
    assert "JobSet jsm: made again for the new place, 1 pod(s) evicted" in ack.detail
    new = cluster.jobset("jsm")
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["annotations"]["fleetwise.io/rebuilt-by"] == move.id
    assert new["metadata"]["labels"]["fleetwise.io/job"] == "jsm"  # found again by the job's label
    (made,) = new["spec"]["replicatedJobs"]
    spec = made["template"]["spec"]["template"]["spec"]
    assert made["name"] == "b200" and made["template"]["spec"]["parallelism"] == 1
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-B200"
    (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    assert {"key": "kubernetes.io/hostname", "operator": "In", "values": [there]} in term["matchExpressions"]
    pods = cluster.pods("jsm")
    assert "jsm-h100-sxm-0-0" not in pods or pods["jsm-h100-sxm-0-0"].metadata.deletion_timestamp is not None
    cm = cluster.core.read_namespaced_config_map("jsm-fleetwise", cluster.ns)
    assert json.loads(cm.data["jobset.json"])["command"] == move.id
    pg = cluster.pod_group("jsm")
    assert pg["spec"]["subGroups"] == [{"name": "b200", "minMember": 1}] and pg["spec"]["minMember"] == 1
    # Done on the cluster: a restarted consumer changes nothing.
    (ack,) = _consumer(cluster).on_command(move)
    assert (ack.status, ack.detail) == ("done", "duplicate")
    assert cluster.jobset("jsm")["metadata"]["uid"] == new["metadata"]["uid"]


def test_a_jobset_still_being_deleted_is_made_again_on_a_later_tick(cluster):
    """The old JobSet is held by a finalizer (another controller's): the new one cannot be made
    under its name yet. The transfer is `applied` and waits, saying why; once the old one is
    gone, the next tick makes the new one and the transfer is done."""
    home, there, old = _jobset_job(cluster, "jsf", finalizers=["example.com/hold"])
    consumer = _consumer(cluster)
    move, ack = _transfer(cluster, "jsf", there, status="applied", consumer=consumer)
    assert "JobSet jsf is still being deleted" in ack.detail
    held = cluster.jobset("jsf")
    assert held["metadata"]["uid"] == old["metadata"]["uid"] and held["metadata"].get("deletionTimestamp")
    assert consumer.tick() == []  # still held: nothing new to say
    cluster.custom.patch_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", cluster.ns, "jobsets", "jsf", {"metadata": {"finalizers": None}})
    (ack,) = consumer.tick()
    assert ack.status == "done", ack.detail
    new = cluster.jobset("jsf")
    assert new["metadata"]["annotations"]["fleetwise.io/rebuilt-by"] == move.id
    assert new["spec"]["replicatedJobs"][0]["name"] == "b200"


def test_consolidation_moves_re_target_a_pytorchjob_s_worker_template(cluster):
    """A consolidation move of a job whose pods a PyTorchJob owns: the Worker template follows the
    job's new layout (the node it leaves out of its affinity, the one it moves to in), the pod on
    the node it leaves is evicted for the operator to make again, the other pod stays."""
    from pathlib import Path

    from fleetwise.schemas import JobConstraints

    cluster.kube.install_crds([Path(__file__).parent / "data" / "pytorchjob-crd.yaml"])
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "h100-sxm"])
    stay, leave, to = (cluster.node_name(i) for i in range(3))
    plan = _plan({n: nodes[n] for n in (stay, leave)}).model_copy(
        update={"constraints": JobConstraints(min_gpus=8, max_gpus=24)})
    cluster.kube.apply(render_plan(plan, "ptc", "team-a", namespace=cluster.ns, workload="pytorchjob"))
    job = cluster.custom.get_namespaced_custom_object("kubeflow.org", "v1", cluster.ns, "pytorchjobs", "ptc")
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    for i, node in enumerate((stay, leave)):
        _operator_pod(cluster, job, f"ptc-worker-{i}", node)
    consumer = _consumer(cluster)
    assert consumer.on_ack(Ack(command_id="ptc-ckpt", ts=NOW, by="training-plugin", status="done")) == []
    moves = [{"rank": 8 + g, "from": {"node": leave, "gpu": g}, "to": {"node": to, "gpu": g}}
             for g in range(8)]
    move = sign(_cmd(type="consolidate", job="ptc", node=leave, requires=["ptc-ckpt"],
                     params={"action": "move", "moves": moves, "checkpoint_first": True}), KEYS)
    (ack,) = consumer.on_command(move)
    assert ack.status == "done", ack.detail
    worker = cluster.custom.get_namespaced_custom_object(
        "kubeflow.org", "v1", cluster.ns, "pytorchjobs", "ptc")["spec"]["pytorchReplicaSpecs"]["Worker"]
    (term,) = worker["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    pinned = [e["values"] for e in term["matchExpressions"] if e["key"] == "kubernetes.io/hostname"]
    assert worker["replicas"] == 2 and pinned == [sorted([stay, to])]
    pods = cluster.pods("ptc")
    assert pods["ptc-worker-0"].metadata.deletion_timestamp is None  # its node is not touched
    assert "ptc-worker-1" not in pods or pods["ptc-worker-1"].metadata.deletion_timestamp is not None
    assert f"Worker template on {', '.join(sorted([stay, to]))} (2 replicas), 1 pod(s) evicted" in ack.detail
    (ack,) = _consumer(cluster).on_command(move)
    assert (ack.status, ack.detail) == ("done", "duplicate")


def test_a_migration_transfer_moves_the_job_s_pods_to_the_destination(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "b200"])
    home, there = cluster.node_name(0), cluster.node_name(1)
    cluster.deploy("mv", {home: nodes[home]})
    cluster.set_running("mv")
    (old,) = cluster.pods("mv")
    move, ack = _transfer(cluster, "mv", there)
    pg = cluster.pod_group("mv")
    assert pg["spec"]["subGroups"] == [{"name": "b200", "minMember": 1}] and pg["spec"]["minMember"] == 1
    subs = json.loads(pg["metadata"]["annotations"]["fleetwise.io/subgroups"])
    assert subs["b200"]["product"] == "NVIDIA-B200"
    pods = cluster.pods("mv")
    (new,) = [p for n, p in pods.items() if n != old]
    assert new.metadata.annotations[ANN_JOINED_BY] == move.id
    assert new.spec.node_selector["nvidia.com/gpu.product"] == "NVIDIA-B200"
    required = new.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    assert {"kubernetes.io/hostname": [there]}.items() <= {
        e.key: e.values for e in required.node_selector_terms[0].match_expressions}.items()
    assert old not in pods or pods[old].metadata.deletion_timestamp is not None  # evicted
    cm = cluster.core.read_namespaced_config_map("mv-fleetwise", cluster.ns)
    assert json.loads(cm.data["migration.json"]) == {
        "command": move.id, "phase": "transfer", "checkpoint_uri": "file:///ckpt/mv",
        "destination": move.params["destination"]}
    # Once done on the cluster, a restarted consumer changes nothing.
    (ack,) = _consumer(cluster).on_command(move)
    assert (ack.status, ack.detail) == ("done", "duplicate")
    assert set(cluster.pods("mv")) == set(pods)


def test_consolidation_moves_a_job_s_ranks_before_its_node_hibernates(cluster):
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "h100-sxm"])
    stay, leave, to = (cluster.node_name(i) for i in range(3))
    cluster.deploy("cm", {n: m for n, m in nodes.items() if n != to})
    cluster.set_running("cm")
    before = cluster.pods("cm")
    (kept,) = [n for n, p in before.items() if p.spec.node_name == stay]
    (gone,) = [n for n, p in before.items() if p.spec.node_name == leave]
    consumer = _consumer(cluster)
    moves = [{"rank": 8 + g, "from": {"node": leave, "gpu": g}, "to": {"node": to, "gpu": g}}
             for g in range(8)]
    move = sign(_cmd(type="consolidate", job="cm", node=leave, requires=["cm-ckpt"],
                     params={"action": "move", "moves": moves, "checkpoint_first": True}), KEYS)
    hibernate = sign(_cmd(type="consolidate", node=leave, requires=[move.id],
                          params={"action": "hibernate", "gpus": list(range(8))}), KEYS)
    assert [a.status for a in consumer.on_command(move)] == ["received"]  # the checkpoint first
    assert [a.status for a in consumer.on_command(hibernate)] == ["received"]
    assert set(cluster.pods("cm")) == set(before)
    (moved,) = consumer.on_ack(Ack(command_id="cm-ckpt", ts=NOW, by="training-plugin", status="done"))
    assert (moved.command_id, moved.status) == (move.id, "done"), moved.detail
    (slept,) = consumer.tick()  # what waits on the consumer's own commands goes on at its next tick
    assert (slept.command_id, slept.status) == (hibernate.id, "done")
    pods = cluster.pods("cm")
    (new,) = [p for n, p in pods.items() if n not in before]
    required = new.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    assert {e.key: e.values for e in required.node_selector_terms[0].match_expressions}[
        "kubernetes.io/hostname"] == [to]
    assert pods[kept].metadata.deletion_timestamp is None  # the node the job keeps: untouched
    assert gone not in pods or pods[gone].metadata.deletion_timestamp is not None
    pg = cluster.pod_group("cm")
    assert pg["spec"]["minMember"] == 2 and pg["spec"]["subGroups"] == [{"name": "h100-sxm", "minMember": 2}]
    assert cluster.node(leave).metadata.labels[HIBERNATE_LABEL] == "true"
    # A consumer that stopped after the gang changed finishes the same moves from the PodGroup's
    # record (the cluster's pods alone no longer tell what was moved).
    cluster.core.delete_namespaced_pod(new.metadata.name, cluster.ns, grace_period_seconds=0)
    ids = json.loads(pg["metadata"]["annotations"][ANN_COMMANDS])
    cluster.custom.patch_namespaced_custom_object(
        "scheduling.run.ai", "v2alpha2", cluster.ns, "podgroups", "cm",
        {"metadata": {"annotations": {ANN_COMMANDS: json.dumps({**ids, move.id: "applied"})}}})
    deadline = time.monotonic() + 10
    while new.metadata.name in cluster.pods("cm") and time.monotonic() < deadline:
        time.sleep(0.1)
    restarted = _consumer(cluster)
    restarted.on_ack(Ack(command_id="cm-ckpt", ts=NOW, by="training-plugin", status="done"))
    (ack,) = restarted.on_command(move)
    assert ack.status == "done", ack.detail
    assert set(cluster.pods("cm")) == set(pods) and cluster.pod_group("cm")["spec"]["minMember"] == 2


def test_consolidate_hibernates_after_the_moves_and_wakes_when_work_returns(cluster):
    (node,) = cluster.add_nodes(["h100-sxm"])
    consumer = _consumer(cluster)
    hibernate = sign(_cmd(type="consolidate", node=node, requires=["move-1"],
                          params={"action": "hibernate", "gpus": list(range(8))}), KEYS)
    assert [a.status for a in consumer.on_command(hibernate)] == ["received"]
    assert HIBERNATE_LABEL not in (cluster.node(node).metadata.labels or {})  # moves not done yet
    assert [a.status for a in consumer.on_ack(Ack(command_id="move-1", ts=NOW, by="training-plugin",
                                                  status="done"))] == ["done"]
    n = cluster.node(node)
    assert n.metadata.labels[HIBERNATE_LABEL] == "true" and n.spec.unschedulable is True
    wake = sign(_cmd(type="consolidate", node=node, params={"action": "wake", "for": ["job-x"]}), KEYS)
    assert [a.status for a in consumer.on_command(wake)] == ["done"]
    n = cluster.node(node)
    assert HIBERNATE_LABEL not in (n.metadata.labels or {}) and not n.spec.unschedulable


def test_wake_does_not_uncordon_a_drained_node(cluster):
    (node,) = cluster.add_nodes(["b200"])
    consumer = _consumer(cluster)
    assert [a.status for a in consumer.on_command(sign(_cmd(type="drain", node=node), KEYS))] == ["done"]
    wake = sign(_cmd(type="consolidate", node=node, params={"action": "wake"}), KEYS)
    assert [a.status for a in consumer.on_command(wake)] == ["done"]
    assert cluster.node(node).spec.unschedulable is True  # a drain's cordon stays


def test_the_consumer_holds_the_fleet_drain_cap_counted_on_the_cluster(cluster, monkeypatch):
    """Drains from several workers arrive at the one consumer: at the cap a new drain is
    rejected with the reason and changes nothing; a drain of a GPU already out is not new; a
    restarted consumer counts from the cluster; a return frees the cap. The nodes are counted
    a page at a time (one node per page here)."""
    monkeypatch.setattr(consumer_module, "NODE_PAGE", 1)
    nodes = list(cluster.add_nodes(["h100-sxm", "h100-sxm", "b200"]))
    rails = Rails(max_drained_gpus_fleet=2, max_drained_share_fleet=1.0)
    consumer = KubeConsumer(ClientApi(cluster.kube.api_client()), KEYS, namespace=cluster.ns,
                            clock=lambda: NOW, rails=rails)
    drain = [sign(_cmd(type="drain", node=nodes[i], gpu=g), KEYS) for i, g in ((0, 1), (1, 2), (2, 0))]
    assert [a.status for d in drain[:2] for a in consumer.on_command(d)] == ["done", "done"]
    (ack,) = consumer.on_command(drain[2])
    assert ack.status == "rejected" and ack.detail.startswith(
        "fleet drain cap: 2 of 24 GPUs on the cluster are drained (cap 2): drain of")
    assert not cluster.node(nodes[2]).spec.unschedulable and not _events(cluster, nodes[2])
    again = sign(_cmd(type="drain", node=nodes[0], gpu=1, reason="the same GPU, another worker"), KEYS)
    assert [a.status for a in consumer.on_command(again)] == ["done"]
    restarted = KubeConsumer(ClientApi(cluster.kube.api_client()), KEYS, namespace=cluster.ns,
                             clock=lambda: NOW, rails=rails)
    late = sign(_cmd(type="drain", node=nodes[2], gpu=4), KEYS)
    assert [a.status for a in restarted.on_command(late)] == ["rejected"]
    back = sign(OperatorAction(ts=NOW + 60, action="return_gpu", node=nodes[1], gpu=2), operator_keyring())
    assert [a.status for a in restarted.on_operator(back)] == ["done"]
    retry = sign(_cmd(type="drain", node=nodes[2], gpu=4, reason="re-decided after the return"), KEYS)
    assert [a.status for a in restarted.on_command(retry)] == ["done"]
    assert cluster.node(nodes[2]).spec.unschedulable is True


def test_least_privilege_role_suffices_for_a_drain(cluster):
    """The consumer impersonates a user bound to `required_rbac()` only."""
    from kubernetes import client

    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm", "b200"])
    spare = cluster.node_name(2)
    cluster.deploy("rbac", {n: m for n, m in nodes.items() if n != spare})
    rbac = client.RbacAuthorizationV1Api(cluster.kube.api_client())
    name = f"{cluster.prefix}-consumer"
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": required_rbac()})
    rbac.create_cluster_role_binding({"metadata": {"name": name}, "roleRef": {
        "apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "User", "name": name, "apiGroup": "rbac.authorization.k8s.io"}]})
    try:
        api_client = cluster.kube.api_client()
        api_client.set_default_header("Impersonate-User", name)
        consumer = _consumer(cluster, ClientApi(api_client))
        drain = sign(_cmd(type="drain", job="rbac", node=cluster.node_name(0), gpu=1), KEYS)
        assert [a.status for a in consumer.on_command(drain)] == ["done"]
        grow = sign(_cmd(type="resize", job="rbac", params={"join": [[spare, g] for g in range(8)]}), KEYS)
        assert [a.status for a in consumer.on_command(grow)] == ["done"]  # a pod created, a subgroup added
        assert any(p.metadata.labels.get("kai.scheduler/subgroup-name") == "b200"
                   for p in cluster.pods("rbac").values())
        # Anything else is forbidden to it.
        from kubernetes.client.rest import ApiException

        with pytest.raises(ApiException) as info:
            client.CoreV1Api(api_client).delete_namespaced_pod("rbac-h100-sxm-1", cluster.ns)
        assert info.value.status == 403
    finally:
        rbac.delete_cluster_role_binding(name)
        rbac.delete_cluster_role(name)


def test_dry_run_against_the_cluster_reads_but_does_not_write(cluster):
    (node,) = cluster.add_nodes(["b200"])
    lines: list[str] = []
    consumer = _consumer(cluster, DryRunApi(reader=ClientApi(cluster.kube.api_client()), out=lines.append))
    assert [a.status for a in consumer.on_command(sign(_cmd(type="drain", node=node), KEYS))] == ["done"]
    assert any(line.startswith(f"PATCH /api/v1/nodes/{node}") for line in lines)
    assert not cluster.node(node).spec.unschedulable


# ---- through Kafka ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_consumer_over_kafka_acks_on_the_acks_topic(cluster, kafka_bootstrap):
    from fleetwise.schemas import topics as T
    from fleetwise.training.transport import KafkaTransport
    from tests.kafka_broker import create_topic, delete_topics

    prefix = f"t{uuid.uuid4().hex[:8]}."
    names = [prefix + t.name for t in (T.COMMANDS_KUBE, T.ACKS, T.OPERATOR, T.PLANS)]
    for name in names:
        await create_topic(kafka_bootstrap, name, partitions=1)
    (node,) = cluster.add_nodes(["h100-sxm"])
    consumer_side = KafkaTransport(kafka_bootstrap, prefix=prefix, from_beginning=True)
    producer = KafkaTransport(kafka_bootstrap, prefix=prefix, from_beginning=True)
    stop = threading.Event()
    consumer = KubeConsumer(ClientApi(cluster.kube.api_client()), KEYS, namespace=cluster.ns)
    worker = threading.Thread(target=consumer.run, args=(consumer_side, stop, 0.1), daemon=True)
    worker.start()
    try:
        drain = sign(Command(id=f"kafka-{uuid.uuid4().hex[:6]}", type="drain", ts=time.time(), node=node,
                             reason="over kafka"), KEYS)
        unsigned = Command(id="kafka-unsigned", type="drain", ts=time.time(), node=node, reason="no")
        producer.publish(T.COMMANDS_KUBE.name, node, drain)
        producer.publish(T.COMMANDS_KUBE.name, node, unsigned)
        seen: dict[str, Ack] = {}
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:
            for ack in producer.poll(T.ACKS.name):
                seen[ack.command_id] = ack
            time.sleep(0.2)
        assert seen[drain.id].status == "done" and seen[drain.id].by == "kube-consumer"
        assert seen["kafka-unsigned"].status == "rejected"
        assert cluster.node(node).spec.unschedulable is True
    finally:
        stop.set()
        worker.join(10)
        consumer_side.close()
        producer.close()
        await delete_topics(kafka_bootstrap, names)
