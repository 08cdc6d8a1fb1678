"""KAI objects rendered from a plan: what KAI and the training plugin read, checked against
KAI's CRD schemas, and accepted by a real Kubernetes API server with KAI's CRDs installed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleetwise.catalog import lookup
from fleetwise.cli import app
from fleetwise.kube.crds import validate_manifest
from fleetwise.kube.render import (
    ANN_SUBGROUPS,
    JOB_LABEL,
    NVLINK_LEVEL,
    RACK_LEVEL,
    RenderError,
    dump_yaml,
    render_plan,
    render_queues,
    render_topology,
    topology_needs,
)
from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model
from fleetwise.schemas import Plan, RankPlan
from fleetwise.training import load_microbatch_map


@pytest.fixture(scope="module")
def mixed_plan() -> Plan:
    """A planner plan over 16 H100 + 16 B200 (the issue's mixed job)."""
    request = PlanRequest(model=resolve_model("llama-7b"), global_batch=256, job="mixed-llm")
    return plan_job(request, parse_gpu_spec("h100-sxm:16,b200:16"))


def _by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objects:
        out.setdefault(o["kind"], []).append(o)
    return out


def _gpus_by_model(plan: Plan) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in plan.ranks:
        out[r.model] = out.get(r.model, 0) + 1
    return out


def test_mixed_job_objects_carry_the_gang_types_and_counts(mixed_plan):
    objs = _by_kind(render_plan(mixed_plan, "Mixed_LLM", "team-a", namespace="ml"))
    (pg,) = objs["PodGroup"]
    assert validate_manifest(pg) == []
    pods = objs["Pod"]
    assert pg["spec"]["minMember"] == len(pods)  # the gang is every pod
    assert pg["spec"]["queue"] == "team-a"
    # One subGroup per GPU type; its pods land only on that product, with the type's GPU count.
    gpus_per_product: dict[str, int] = {}
    for pod in pods:
        meta, spec = pod["metadata"], pod["spec"]
        assert spec["schedulerName"] == "kai-scheduler"
        assert meta["labels"]["kai.scheduler/queue"] == "team-a"
        assert meta["annotations"]["pod-group-name"] == pg["metadata"]["name"] == "mixed-llm"
        assert meta["labels"][JOB_LABEL] == "mixed-llm"
        (term,) = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"]
        exprs = {e["key"]: e for e in term["matchExpressions"]}
        product = exprs["nvidia.com/gpu.product"]["values"][0]
        limit = spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        assert isinstance(limit, str)  # the official client refuses int quantities
        gpus_per_product[product] = gpus_per_product.get(product, 0) + int(limit)
        count = exprs["nvidia.com/gpu.count"]
        assert count["operator"] == "Gt" and int(count["values"][0]) == int(limit) - 1
    assert {lookup(p).id: n for p, n in gpus_per_product.items()} == _gpus_by_model(mixed_plan)
    subgroups = {s["name"]: s["minMember"] for s in pg["spec"]["subGroups"]}
    assert sum(subgroups.values()) == pg["spec"]["minMember"]
    for name, n in subgroups.items():
        assert sum(1 for p in pods if p["metadata"]["labels"]["kai.scheduler/subgroup-name"] == name) == n
    recorded = json.loads(pg["metadata"]["annotations"][ANN_SUBGROUPS])
    assert set(recorded) == set(subgroups)


def test_microbatch_map_configmap_is_what_the_plugin_reads(mixed_plan):
    objs = _by_kind(render_plan(mixed_plan, "mixed-llm", "q"))
    (cm,) = objs["ConfigMap"]
    mb = load_microbatch_map(json.loads(cm["data"]["microbatch-map.json"]))
    assert sum(mb.shares) == mixed_plan.global_batch
    for pod in objs["Pod"]:
        assert pod["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]


def _tp_plan(gpus_per_node: int, tp: int) -> Plan:
    """Two data-parallel replicas of `tp` H100 each, `gpus_per_node` GPUs per node."""
    spec = lookup("h100-sxm")
    ranks = []
    for rank in range(2 * tp):
        ranks.append(RankPlan(
            rank=rank, node=f"h{rank // gpus_per_node}", gpu=rank % gpus_per_node, model=spec.id,
            capability_tflops=spec.capability_tflops("bf16"), micro_batch=4, num_micro_batches=2, stage=0,
            layers=(0, 31), dp_rank=rank // tp, tp_rank=rank % tp, memory_gb=40, memory_capacity_gb=80))
    return Plan(job="tp", dp=2, tp=tp, pp=1, zero_stage=1, global_batch=16, seq_len=2048,
                predicted_step_s=1.0, tokens_per_s=1.0, mfu=0.4, ranks=ranks)


def test_topology_constraint_where_the_plan_needs_one_domain(mixed_plan):
    # Tensor parallelism across nodes needs one NVLink domain: required, on the PodGroup.
    cross = _tp_plan(gpus_per_node=4, tp=8)
    assert topology_needs(cross) == {"h100-sxm": {"requiredTopologyLevel": NVLINK_LEVEL}}
    pg = _by_kind(render_plan(cross, "tp", "q"))["PodGroup"][0]
    assert pg["spec"]["topologyConstraint"] == {"topology": "fleetwise",
                                                "requiredTopologyLevel": NVLINK_LEVEL}
    assert validate_manifest(pg) == []
    # Tensor parallelism inside a node, the job on one node: no constraint at all.
    assert topology_needs(_tp_plan(gpus_per_node=8, tp=4)) == {}
    # A mixed job: each type's pods prefer one rack, on its own subGroup (types sit apart).
    pg = _by_kind(render_plan(mixed_plan, "m", "q"))["PodGroup"][0]
    assert "topologyConstraint" not in pg["spec"]
    for sub in pg["spec"]["subGroups"]:
        assert sub["topologyConstraint"]["preferredTopologyLevel"] == RACK_LEVEL
    pg = _by_kind(render_plan(mixed_plan, "m", "q", with_topology=False))["PodGroup"][0]
    assert all("topologyConstraint" not in s for s in pg["spec"]["subGroups"])


def test_workload_forms(mixed_plan):
    objs = _by_kind(render_plan(mixed_plan, "m", "q", workload="jobset", priority_class="train-high",
                                preemptible=False))
    (js,) = objs["JobSet"]
    pg = objs["PodGroup"][0]
    assert pg["spec"]["priorityClassName"] == "train-high"
    assert pg["spec"]["preemptibility"] == "non-preemptible"
    assert validate_manifest(pg) == []
    jobs = {j["name"]: j["template"]["spec"] for j in js["spec"]["replicatedJobs"]}
    assert {s["name"]: s["minMember"] for s in pg["spec"]["subGroups"]} == {
        n: j["parallelism"] for n, j in jobs.items()}
    for j in jobs.values():
        tmpl = j["template"]
        assert tmpl["metadata"]["annotations"]["pod-group-name"] == pg["metadata"]["name"]
        assert tmpl["spec"]["priorityClassName"] == "train-high"
    with pytest.raises(RenderError, match="pytorchjob.*2 pod shapes"):
        render_plan(mixed_plan, "m", "q", workload="pytorchjob")
    single = _by_kind(render_plan(_tp_plan(8, 2), "single", "q", workload="pytorchjob"))["PyTorchJob"][0]
    assert single["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] == 1
    assert single["spec"]["runPolicy"]["schedulingPolicy"]["queue"] == "q"
    with pytest.raises(RenderError, match="workload 'deployment'"):
        render_plan(mixed_plan, "m", "q", workload="deployment")


def test_queues_and_topology_validate_against_kai_crds():
    queues = render_queues({"team-a": 32, "team-b": 16})
    assert [validate_manifest(q) for q in queues] == [[], [], []]
    parent, *teams = queues
    assert parent["spec"]["resources"]["gpu"]["quota"] == 48
    assert {q["spec"]["parentQueue"] for q in teams} == {parent["metadata"]["name"]}
    assert validate_manifest(render_topology()) == []
    with pytest.raises(RenderError, match="team-b.*>= 0"):
        render_queues({"team-b": -1})


def test_yaml_round_trips(mixed_plan):
    objects = render_plan(mixed_plan, "m", "q")
    assert list(yaml.safe_load_all(dump_yaml(objects))) == objects


# ---- CLI ---------------------------------------------------------------------------------------


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_plan_format_kai_prints_yaml_objects():
    result = _cli("plan", "--model", "gpt-1.3b", "--gpus", "h100-sxm:4,b200:4", "--global-batch", "128",
                  "--format", "kai", "--job", "cli-job", "--queue", "research")
    assert result.exit_code == 0, result.output
    objs = _by_kind(list(yaml.safe_load_all(result.stdout)))
    assert objs["PodGroup"][0]["spec"]["queue"] == "research"
    assert {lookup(p["spec"]["nodeSelector"]["nvidia.com/gpu.product"]).id for p in objs["Pod"]} == {
        "h100-sxm", "b200"}


def test_kube_render_from_plan_and_intent(tmp_path: Path, mixed_plan):
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**mixed_plan.model_dump(mode="json"), "speedup": 1.2}))
    result = _cli("kube", "render", "--plan", str(plan_file), "--team-queue", "team-a=32",
                  "--queue", "team-a", "--workload", "jobset", "--with-topology-object")
    assert result.exit_code == 0, result.output
    kinds = [o["kind"] for o in yaml.safe_load_all(result.stdout)]
    assert kinds == ["Queue", "Queue", "Topology", "ConfigMap", "PodGroup", "JobSet"]
    intent = tmp_path / "job.yaml"
    intent.write_text("job: from-intent\nmodel: gpt-1.3b\nglobal_batch: 64\nqueue: team-b\n")
    result = _cli("kube", "render", "--intent", str(intent), "--gpus", "h100-sxm:8")
    assert result.exit_code == 0, result.output
    pg = next(o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "PodGroup")
    assert pg["spec"]["queue"] == "team-b" and pg["metadata"]["name"] == "from-intent"
    # The trainer's command; every pod knows its node (commands name nodes, not pods).
    launch = "torchrun --nnodes=1:4 --rdzv-backend c10d --rdzv-endpoint 'trainer:29400' train.py --lr 3e-4"
    result = _cli("kube", "render", "--intent", str(intent), "--gpus", "h100-sxm:8", "--command", launch)
    assert result.exit_code == 0, result.output
    (pod,) = [o for o in yaml.safe_load_all(result.stdout) if o["kind"] == "Pod"]
    (trainer,) = pod["spec"]["containers"]
    assert trainer["command"] == ["torchrun", "--nnodes=1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                                  "trainer:29400", "train.py", "--lr", "3e-4"]
    node_name = {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert {"name": "FLEETWISE_NODE", "valueFrom": node_name} in trainer["env"]
    for args, message in (
        ((), "exactly one of --plan"),
        (("--intent", str(intent)), "--intent needs --gpus"),
        (("--plan", str(tmp_path / "missing.json")), "does not exist"),
        (("--plan", str(plan_file), "--team-queue", "oops"), "TEAM=GPUS"),
        (("--plan", str(plan_file), "--workload", "pytorchjob"), "use --workload jobset or pods"),
        (("--plan", str(plan_file), "--command", "  "), "--command is empty"),
        (("--plan", str(plan_file), "--command", "train.py 'unclosed"), "--command: No closing quotation"),
    ):
        result = _cli("kube", "render", *args)
        assert result.exit_code == 2, result.output
        assert message in " ".join(result.stderr.split())


# ---- the real API server -----------------------------------------------------------------------


def test_rendered_mixed_job_is_accepted_by_the_api_server(kube_api, kube_crds, kube_namespace, mixed_plan):
    """Built-in kinds are validated by Kubernetes itself, the PodGroup by KAI's CRD schema."""
    objects = render_plan(mixed_plan, "mixed-llm", "team-a", namespace=kube_namespace)
    created = kube_api.apply(objects)
    assert [c.kind for c in created] == [o["kind"] for o in objects]
    from kubernetes import client

    custom = client.CustomObjectsApi(kube_api.api_client())
    pg = custom.get_namespaced_custom_object("scheduling.run.ai", "v2alpha2", kube_namespace, "podgroups",
                                             "mixed-llm")
    assert pg["spec"]["minMember"] == sum(1 for o in objects if o["kind"] == "Pod")
    assert {s["name"] for s in pg["spec"]["subGroups"]} == {"h100-sxm", "b200"}
    # Queues and the Topology are accepted (server-side dry run: cluster-scoped, shared).
    kube_api.apply([*render_queues({"team-a": 32}), render_topology("fw-test-topology")], dry_run=True)


def test_api_server_refuses_a_bad_podgroup_naming_the_field(kube_api, kube_crds, kube_namespace, mixed_plan):
    from kubernetes.client.rest import ApiException

    objects = render_plan(mixed_plan, "bad", "q", namespace=kube_namespace)
    pg = next(o for o in objects if o["kind"] == "PodGroup")
    pg["spec"]["minMember"] = 0
    with pytest.raises(ApiException) as info:
        kube_api.apply([pg], dry_run=True)
    assert info.value.status == 422
    assert "spec.minMember" in info.value.body


def test_the_control_plane_collects_garbage(kube_api, kube_namespace):
    """kube-controller-manager runs (here: the garbage collector): a dependent goes with its owner."""
    from kubernetes import client

    core = client.CoreV1Api(kube_api.api_client())
    owner = core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(kube_namespace, {"metadata": {"name": "dependent", "ownerReferences": [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}]}})
    core.delete_namespaced_config_map("owner", kube_namespace, propagation_policy="Background")
    deadline = time.monotonic() + 60
    names = {"dependent"}
    while names and time.monotonic() < deadline:
        items = core.list_namespaced_config_map(kube_namespace).items
        names = {c.metadata.name for c in items} & {"dependent"}
        time.sleep(0.5)
    assert not names, "the garbage collector did not delete the dependent ConfigMap"
