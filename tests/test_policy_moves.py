"""The policy's consolidation and migration triggers: sustained low utilisation -> consolidate
(hibernate on its ack), a much cheaper placement -> migrate in three acked phases."""

from __future__ import annotations

import numpy as np

from fleetwise.actuators import ActionPolicy, PolicyConfig
from fleetwise.schemas import Ack, AuditEvent, Command, GpuInventory, NodeInventory

T0 = 1764547200.0
H100 = "NVIDIA H100 80GB HBM3"


def inventory(nodes: int, model: str = H100, rack_budget: float | None = None, site: str = "s0") -> list:
    return [NodeInventory(ts=T0 - 10, node=f"n{i}", rack=f"r{i // 2}", site=site,
                          rack_power_budget_w=rack_budget,
                          gpus=[GpuInventory(index=g, model=model) for g in range(8)],
                          nvlink_groups=[list(range(8))]) for i in range(nodes)]


def feed_util(policy: ActionPolicy, hops: int, util_of, jobs_of, start: float = T0, hop_s: float = 300.0):
    """One closed hop per GPU every hop_s: utilisation and (job, rank) per GPU."""
    out = []
    keys = [(f"n{i}", g) for i in range(4) for g in range(8)]
    for h in range(hops):
        ts = np.full(len(keys), start + h * hop_s)
        util = np.array([util_of(k) for k in keys], dtype=float)
        jobs = [jobs_of(k)[0] for k in keys]
        ranks = [jobs_of(k)[1] for k in keys]
        out += policy.observe_utilisation(keys, ts, util, jobs, ranks)
    return out


def job_layout(key):
    node, gpu = key
    # a on n0 (8 GPUs), b on n1 gpus 0-3, c on n2 gpus 0-1; n3 idle
    if node == "n0":
        return ("a", gpu)
    if node == "n1" and gpu < 4:
        return ("b", gpu)
    if node == "n2" and gpu < 2:
        return ("c", gpu)
    return (None, None)


def test_sustained_low_utilisation_consolidates_and_hibernates_on_the_ack():
    policy = ActionPolicy(PolicyConfig.model_validate({"consolidate": {"mode": "auto", "sustained_s": 3600,
                                                                       "check_every_s": 3600}}))
    policy.process(inventory(4))
    out = feed_util(policy, 30, lambda k: 10.0 if job_layout(k)[0] else 0.0, job_layout)
    cmds = [r for r in out if isinstance(r, Command)]
    assert cmds and all(c.signature for c in cmds)
    hibernate = [c for c in cmds if c.type == "consolidate" and c.params["action"] == "hibernate"]
    checkpoints = [c for c in cmds if c.type == "checkpoint"]
    assert hibernate and hibernate[0].params["savings"]["watts"] > 0
    # b and c fit beside each other: at least one job moves, emptying its node. Its pods there
    # are evicted, so it checkpoints first; the move goes out on that checkpoint's done ack.
    assert checkpoints and all(c.params["before"] == "move" for c in checkpoints)
    assert all(c.type != "consolidate" or c.params["action"] != "move" for c in cmds)
    moves = []
    for cp in checkpoints:
        done = Ack(command_id=cp.id, ts=cp.ts + 10, job=cp.job, by="training-plugin", status="done")
        (move,) = [r for r in policy.process([done]) if isinstance(r, Command)]
        assert (move.type, move.params["action"], move.job, move.requires) == ("consolidate", "move", cp.job,
                                                                              [cp.id])
        moves.append(move)
    for h in hibernate:  # a hibernation waits for the moves that empty its node
        assert set(h.requires) <= {m.id for m in moves}
    # Nothing is asleep until the consumer says so; then the node's GPUs leave every plan.
    node = hibernate[0].node
    assert policy.fleet.status((node, 0)) == "in_service"
    for m in moves:
        policy.process([Ack(command_id=m.id, ts=T0 + 9000, job=m.job, by="kube-consumer", status="done")])
        # The job runs where its ranks moved.
        assert all(policy.jobs[m.job].ranks[mv["rank"]] == (mv["to"]["node"], mv["to"]["gpu"])
                   for mv in m.params["moves"])
    policy.process([Ack(command_id=hibernate[0].id, ts=T0 + 9001, node=node, by="kube-consumer",
                        status="done")])
    assert policy.fleet.status((node, 0)) == "hibernating"
    # One consolidation at a time, and none again for nodes already asleep.
    again = feed_util(policy, 3, lambda k: 10.0 if job_layout(k)[0] else 0.0, job_layout, start=T0 + 9300)
    assert all(c.params.get("action") != "hibernate" or c.node != node
               for c in again if isinstance(c, Command))


def test_busy_fleet_is_not_consolidated_and_approval_mode_holds_it():
    busy = ActionPolicy(PolicyConfig.model_validate({"consolidate": {"mode": "auto"}}))
    busy.process(inventory(4))
    assert [r for r in feed_util(busy, 30, lambda k: 90.0, job_layout) if isinstance(r, Command)] == []
    held = ActionPolicy()  # default: consolidation needs an operator's approval
    held.process(inventory(4))
    out = feed_util(held, 30, lambda k: 5.0, job_layout)
    assert not [r for r in out if isinstance(r, Command)]
    assert any(isinstance(r, AuditEvent) and r.event == "awaiting_approval" for r in out)
    off = ActionPolicy(PolicyConfig.model_validate({"consolidate": {"mode": "off"}}))
    assert not off.wants_utilisation


def test_a_much_cheaper_placement_migrates_in_three_acked_phases():
    from fleetwise.planner import PlanRequest, cluster_from_inventory, plan_job, resolve_model

    old = inventory(1, model="NVIDIA A100-SXM4-80GB", site="old")
    new = [n.model_copy(update={"node": f"m{i}"}) for i, n in enumerate(inventory(1, model="NVIDIA B200",
                                                                                  site="old"))]
    request = PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job="llm", strategy=(1, 1, 8))
    plan = plan_job(request, cluster_from_inventory(old))
    policy = ActionPolicy(PolicyConfig.model_validate({
        "consolidate": {"mode": "auto", "check_every_s": 10 ** 6},
        "migrate": {"mode": "auto", "check_every_s": 600, "min_saving": 0.2}}))
    policy.process([*old, *new, plan])
    keys = [("n0", g) for g in range(8)]
    out = []
    for h in range(6):
        out += policy.observe_utilisation(keys, np.full(8, T0 + 300 * h), np.full(8, 95.0),
                                          ["llm"] * 8, list(range(8)))
    snap = [c for c in out if isinstance(c, Command) and c.type == "migrate"]
    assert [c.params["phase"] for c in snap] == ["snapshot"]
    dest = snap[0].params["destination"]
    assert {tuple(d) for d in dest["gpus"]} == {("m0", g) for g in range(8)} and dest["nodes"] == ["m0"]
    done = Ack(command_id=snap[0].id, ts=T0 + 2000, job="llm", by="training-plugin", status="done")
    transfer = [c for c in policy.process([done]) if isinstance(c, Command)]
    assert [c.params["phase"] for c in transfer] == ["transfer"] and transfer[0].requires == [snap[0].id]
    restore = [c for c in policy.process([Ack(command_id=transfer[0].id, ts=T0 + 2100, job="llm",
                                              by="kube-consumer", status="done")]) if isinstance(c, Command)]
    assert [c.params["phase"] for c in restore] == ["restore"] and restore[0].requires == [transfer[0].id]
    # Until the job runs there, the destination is not free for another job to grow onto.
    assert not {("m0", g) for g in range(8)} & set(policy._free_gpus())
    assert policy.jobs["llm"].ranks[0][0] == "n0"
    policy.process([Ack(command_id=restore[0].id, ts=T0 + 2200, job="llm", by="training-plugin",
                        status="done")])
    job = policy.jobs["llm"]
    assert set(job.ranks.values()) == {("m0", g) for g in range(8)}  # it runs on the destination
    assert {r["model"] for r in job.plan["ranks"]} == {"b200"} and job.plan["job"] == "llm"
    # Its old GPUs are free once their telemetry names no job (until then they may still be in use).
    assert not set(policy._free_gpus())
    policy.observe_utilisation(keys, np.full(8, T0 + 2300), np.zeros(8), [None] * 8, [None] * 8)
    assert set(policy._free_gpus()) == {("n0", g) for g in range(8)}


def test_a_done_move_carries_the_job_s_plan_to_the_new_gpus():
    from fleetwise.actuators.policy import JobState

    plan = {"pp": 1, "dp": 2, "ranks": [{"rank": 0, "node": "n0", "gpu": 0, "model": "h100-sxm"},
                                        {"rank": 1, "node": "n2", "gpu": 1, "model": "h100-sxm"}]}
    job = JobState(ranks={0: ("n0", 0), 1: ("n2", 1)}, plan=plan)
    ActionPolicy._moved(job, [{"rank": 1, "from": {"node": "n2", "gpu": 1}, "to": {"node": "n1", "gpu": 5}}])
    assert job.ranks == {0: ("n0", 0), 1: ("n1", 5)}
    assert [(r["node"], r["gpu"]) for r in job.plan["ranks"]] == [("n0", 0), ("n1", 5)]
    assert plan["ranks"][1]["node"] == "n2"  # a new plan object: the old one is not edited in place


def test_a_migration_goes_where_the_gpus_run_cooler_at_full_power():
    """Two alike destinations, idle: the one whose GPUs run hotter at full power (their own fits,
    read from the feature hops) loses placement's thermal term, though both read cool now."""
    from fleetwise.planner import PlanRequest, cluster_from_inventory, plan_job, resolve_model

    old = inventory(1, model="NVIDIA A100-SXM4-80GB", site="old")
    new = [n.model_copy(update={"node": f"m{i}"}) for i, n in enumerate(inventory(2, model="NVIDIA B200",
                                                                                  site="old"))]
    request = PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job="llm", strategy=(1, 1, 8))
    plan = plan_job(request, cluster_from_inventory(old))

    def destination(full_power: dict[str, float] | None) -> set[str]:
        policy = ActionPolicy(PolicyConfig.model_validate({
            "consolidate": {"mode": "auto", "check_every_s": 10 ** 6},
            "migrate": {"mode": "auto", "check_every_s": 600, "min_saving": 0.2}}))
        policy.process([*old, *new, plan])
        keys = [("n0", g) for g in range(8)] + [(m, g) for m in ("m0", "m1") for g in range(8)]
        jobs = ["llm"] * 8 + [None] * 16
        ranks = list(range(8)) + [None] * 16
        util = np.array([95.0] * 8 + [0.0] * 16)
        temps = None if full_power is None else np.array([70.0] * 8 + [full_power[k[0]] for k in keys[8:]])
        out = []
        for h in range(6):
            out += policy.observe_utilisation(keys, np.full(24, T0 + 300 * h), util, jobs, ranks, temps)
        snap = [c for c in out if isinstance(c, Command) and c.type == "migrate"]
        assert len(snap) == 1
        return {d[0] for d in snap[0].params["destination"]["gpus"]}

    assert destination({"m0": 62.0, "m1": 84.0}) == {"m0"}
    assert destination({"m0": 84.0, "m1": 62.0}) == {"m1"}
