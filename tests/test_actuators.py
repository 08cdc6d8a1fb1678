"""Action policy: fleet state from acks, checkpoint -> drain -> resize, rails, ids, policy files."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetwise.actuators import (
    ActionPolicy,
    Keyring,
    KeyringError,
    PolicyConfig,
    PolicyFileError,
    generate_ed25519_entries,
    operator_keyring,
    parse_policy,
    policy_yaml,
    sign,
    verify,
    verify_command,
    verify_operator,
)
from fleetwise.schemas import (
    Ack,
    AuditEvent,
    Command,
    GpuInventory,
    JobEnd,
    NodeInventory,
    OperatorAction,
    Prediction,
    Signal,
)

T0 = 1764547200.0


def failure(node: str, gpu: int, ts: float = T0, job: str | None = "llm", rank: int | None = None,
            alert: bool = True, horizon_h: float = 48) -> Prediction:
    return Prediction(id=f"failure:{node}/{gpu}:{int(ts)}", type="failure", ts=ts, node=node, gpu=gpu,
                      job=job, rank=rank, probability=0.95, horizon_h=horizon_h, alert=alert,
                      signals=[Signal(name="source", value="model"), Signal(name="sbe_rate_6h", value=40.0)])


def operator(**fields) -> OperatorAction:
    """An operator action as `fleetwise approve` / `gpu return` send it: signed (dev operator key)."""
    return sign(OperatorAction(**fields), operator_keyring())


def straggler(rank: int, factor: float, ts: float, alert: bool = True, job: str = "llm") -> Prediction:
    return Prediction(id=f"straggler:{job}/{rank}:{int(ts)}", type="straggler", ts=ts, node="n1", gpu=rank,
                      job=job, rank=rank, probability=1.0, horizon_h=0, alert=alert, factor=factor)


def ack(cmd: Command, status: str = "done", ts: float | None = None, **kw) -> Ack:
    return Ack(command_id=cmd.id, ts=cmd.ts if ts is None else ts, job=cmd.job, node=cmd.node, gpu=cmd.gpu,
               by="training-plugin" if cmd.job else "kube-consumer", status=status, **kw)


def commands(out) -> list[Command]:
    return [r for r in out if isinstance(r, Command)]


def audits(out) -> list[AuditEvent]:
    return [r for r in out if isinstance(r, AuditEvent)]


def with_ranks(policy: ActionPolicy, n: int, job: str = "llm") -> None:
    """Tell the policy the job's ranks (what straggler predictions reveal)."""
    policy.process([straggler(r, 1.0, T0 - 1, alert=False, job=job) for r in range(n)])


def test_failure_alert_checkpoints_then_drains_on_the_checkpoint_ack_then_resizes():
    policy = ActionPolicy()
    with_ranks(policy, 8)
    first = commands(policy.process([failure("n1", 3, rank=3)]))
    assert [c.type for c in first] == ["checkpoint"]  # the drain waits for the checkpoint's ack
    checkpoint = first[0]
    assert checkpoint.evidence == ["failure:n1/3:1764547200"] and "sbe_rate_6h=40.0" in checkpoint.reason
    assert checkpoint.params["signals"]["probability"] == 0.95
    assert checkpoint.seq == 1 and checkpoint.expires_ts == T0 + 1800 and verify(checkpoint)
    assert commands(policy.process([ack(checkpoint, "received", ts=T0 + 1)])) == []
    drain = commands(policy.process([ack(checkpoint, "done", ts=T0 + 30, result={"step": 9})]))
    assert [c.type for c in drain] == ["drain"]
    assert drain[0].requires == [checkpoint.id] and drain[0].seq == 2 and drain[0].ts == T0 + 30
    assert policy.fleet.status(("n1", 3)) == "in_service"  # asked, not yet done
    policy.process([ack(drain[0], "applied", ts=T0 + 40)])
    assert policy.fleet.status(("n1", 3)) == "draining"
    resize = commands(policy.process([ack(drain[0], "done", ts=T0 + 60)]))
    assert [c.type for c in resize] == ["resize"]
    assert resize[0].params["leave"] == [["n1", 3]] and resize[0].params["world_size"] == 7
    assert policy.fleet.status(("n1", 3)) == "drained"
    # The GPU is out: a later alert on it (a repeated XID, a flapping model) makes nothing.
    assert commands(policy.process([failure("n1", 3, ts=T0 + 600, rank=3)])) == []


def test_a_gpu_is_never_drained_twice_across_jobs_and_comes_back_by_inventory_or_operator():
    policy = ActionPolicy()
    out = commands(policy.process([failure("n1", 5, job=None)]))
    assert [c.type for c in out] == ["drain"] and out[0].requires == []  # no job: nothing to save
    # The same GPU alerted for other jobs while the drain is on its way: no second drain.
    assert commands(policy.process([failure("n1", 5, ts=T0 + 300, job="a"),
                                    failure("n1", 5, ts=T0 + 600, job="b")])) == []
    policy.process([ack(out[0], "done", ts=T0 + 700)])
    assert commands(policy.process([failure("n1", 5, ts=T0 + 900, job="c")])) == []
    # An inventory older than the drain does not return it; a newer one does.
    inv = NodeInventory(ts=T0, node="n1", gpus=[GpuInventory(index=5, model="H100")])
    assert audits(policy.process([inv])) == [] and policy.fleet.status(("n1", 5)) == "drained"
    back = policy.process([inv.model_copy(update={"ts": T0 + 5000})])
    assert [a.event for a in audits(back)] == ["gpu_returned"]
    assert policy.fleet.status(("n1", 5)) == "in_service"
    again = commands(policy.process([failure("n1", 5, ts=T0 + 6000, job=None)]))
    policy.process([ack(again[0], "done", ts=T0 + 6100)])
    policy.process([operator(ts=T0 + 7000, action="return_gpu", node="n1", gpu=5, reason="RMA done")])
    assert policy.fleet.status(("n1", 5)) == "in_service"


def test_rejected_and_expired_commands_are_reported_and_re_decided():
    policy = ActionPolicy()
    cp = commands(policy.process([failure("n1", 1)]))[0]
    out = policy.process([ack(cp, "rejected", ts=T0 + 5, detail="expired at ...")])
    assert [a.event for a in audits(out)] == ["ack_rejected"]
    # Nobody acks the next one: at its expiry it is reported, not silently retried ...
    cp2 = commands(policy.process([failure("n1", 1, ts=T0 + 60)]))[0]
    assert cp2.id != cp.id
    late = policy.process([failure("n2", 7, ts=cp2.expires_ts + 1, job=None)])
    expired = [a for a in audits(late) if a.event == "expired"]
    assert [a.command_id for a in expired] == [cp2.id] and policy.expired == 1
    # ... and the next alert on that GPU decides again.
    assert [c.type for c in commands(policy.process([failure("n1", 1, ts=cp2.expires_ts + 60)]))] == [
        "checkpoint"]


def test_drain_caps_per_job_fleet_and_the_circuit_breaker():
    cfg = PolicyConfig.model_validate({"rails": {
        "max_drain_share_per_job": 0.25, "max_drained_gpus_fleet": 100,
        "max_disruptive_per_job_per_hour": 100}})
    policy = ActionPolicy(cfg)
    with_ranks(policy, 8)  # 8 ranks: at most 2 may be out (25%)
    started = [c for i in range(5) for c in commands(policy.process([failure("n1", i, rank=i, ts=T0 + i)]))]
    # checkpoints count as drains in progress: the third is held back by the job cap
    for c in started:
        policy.process([ack(c, "done", ts=T0 + 10)])
    assert len(started) == 2 and policy.suppressed["job_drain_cap"] == 3
    fleet = ActionPolicy(PolicyConfig.model_validate({"rails": {"max_drained_gpus_fleet": 1}}))
    fleet.process([failure("a", 0, job=None)])
    out = fleet.process([failure("b", 0, job=None)])
    assert commands(out) == [] and audits(out)[0].event == "fleet_drain_cap"
    storm = ActionPolicy(PolicyConfig.model_validate({"rails": {"breaker_drains": 3,
                                                                "max_drained_gpus_fleet": 99}}))
    outs = [storm.process([failure(f"n{i}", 0, job=None, ts=T0 + i)]) for i in range(6)]
    assert [len(commands(o)) for o in outs] == [1, 1, 1, 0, 0, 0]
    assert audits(outs[3])[0].event == "breaker_open" and "circuit breaker open" in audits(outs[3])[0].reason


def two_workers(**rails) -> tuple[ActionPolicy, ActionPolicy]:
    """Two workers' policies over disjoint nodes, each reading the other's commands and every
    ack, as the context topics give them."""
    cfg = PolicyConfig.model_validate({"rails": {"max_disruptive_per_job_per_hour": 100, **rails}})
    return ActionPolicy(cfg), ActionPolicy(cfg)


def test_the_fleet_drain_cap_holds_across_workers_that_read_each_others_commands():
    a, b = two_workers(max_drained_gpus_fleet=2)
    first = commands(a.process([failure("a1", 0, job=None)]))
    second = commands(b.process([failure("b1", 0, job=None, ts=T0 + 1)]))
    assert [c.type for c in first + second] == ["drain", "drain"]
    for worker in (a, b):  # each reads both command topics: its own commands change nothing
        worker.process(first + second)
    # a third GPU on either worker: the cap (2) counts the other worker's drain too
    held = b.process([failure("b2", 0, job=None, ts=T0 + 2)])
    assert commands(held) == [] and audits(held)[0].event == "fleet_drain_cap"
    assert "2 GPUs out or leaving (cap 2)" in audits(held)[0].reason
    # refused by its consumer: the GPU stays in service, and the cap has room again
    for worker in (a, b):
        worker.process([ack(first[0], "rejected", ts=T0 + 3, detail="node not found")])
    assert [c.type for c in commands(b.process([failure("b2", 0, job=None, ts=T0 + 4)]))] == ["drain"]
    # without the other worker's commands (the change's point) the cap would not hold
    alone = two_workers(max_drained_gpus_fleet=1)
    alone[0].process([failure("a1", 0, job=None)])
    assert len(commands(alone[1].process([failure("b1", 0, job=None, ts=T0 + 1)]))) == 1


def test_another_workers_drain_counts_until_its_gpu_returns_and_an_early_ack_is_kept():
    a, b = two_workers(max_drained_gpus_fleet=1)
    with_ranks(a, 8)
    checkpoint = commands(a.process([failure("a1", 3, rank=3)]))[0]  # the drain's first step
    b.process([checkpoint])
    assert b.peers.out() == {("a1", 3)}
    assert commands(b.process([failure("b1", 0, job=None, ts=T0 + 1)])) == []  # cap 1: held back
    done = ack(checkpoint, "done", ts=T0 + 30)
    drain = commands(a.process([done]))[0]
    # the drain's ack is read before the drain itself (another topic): kept until it comes
    b.process([done, ack(drain, "done", ts=T0 + 60)])
    assert b.peers.out() == set()
    b.process([drain])
    assert b.peers.out() == {("a1", 3)} and b.fleet.status(("a1", 3)) == "in_service"  # not b's
    assert commands(b.process([failure("b1", 0, job=None, ts=T0 + 120)])) == []
    # an operator returns the GPU: every worker reads it; only the owner reports it
    back = operator(ts=T0 + 900, action="return_gpu", node="a1", gpu=3, reason="reseated")
    a.process([ack(drain, "done", ts=T0 + 60)])
    assert [e.event for e in audits(a.process([back]))] == ["gpu_returned"]
    assert audits(b.process([back])) == [] and b.peers.out() == set()
    # a drain read after the return that ended it (topics in no fixed order) stays ended
    b.process([drain])
    assert b.peers.out() == set()
    assert [c.type for c in commands(b.process([failure("b1", 0, job=None, ts=T0 + 1000)]))] == ["drain"]


def test_another_workers_unanswered_drain_expires_silently_and_forged_commands_are_ignored():
    a, b = two_workers(max_drained_gpus_fleet=1)
    drain = commands(a.process([failure("a1", 0, job=None)]))[0]
    forged = drain.model_copy(update={"id": "drain-forged", "node": "a2"})  # signature no longer matches
    b.process([drain, forged])
    assert b.peers.out() == {("a1", 0)} and b.suppressed["peer_command_refused"] == 1
    later = b.process([failure("b1", 0, job=None, ts=drain.expires_ts + 1)])
    # a's drain expired unanswered: a reports it, b only stops counting it
    assert [c.type for c in commands(later)] == ["drain"] and audits(later) == []


def test_the_breaker_counts_other_workers_drain_decisions():
    a, b = two_workers(breaker_drains=3, max_drained_gpus_fleet=99)
    for i in range(3):
        b.process(commands(a.process([failure(f"a{i}", 0, job=None, ts=T0 + i)])))
    out = b.process([failure("b1", 0, job=None, ts=T0 + 10)])
    assert commands(out) == [] and audits(out)[0].event == "breaker_open"
    assert "4 drain decisions" in audits(out)[0].reason


def test_a_restored_command_is_this_workers_own_even_if_read_back_first():
    a, _ = two_workers()
    drain = commands(a.process([failure("a1", 0, job=None)]))[0]
    fresh = ActionPolicy(a.config)
    fresh.process([drain])  # the context task reads it before the partition's state is back
    assert fresh.peers.out() == {("a1", 0)}
    for key in a.keys():
        fresh.restore(key, a.state(key))
    assert fresh.peers.out() == set() and [p.id for p in fresh.fleet.open_commands()] == [drain.id]


def test_stale_evidence_and_far_horizons_make_no_command():
    policy = ActionPolicy()
    policy.process([failure("n9", 0, ts=T0 + 7200, job=None)])
    out = policy.process([failure("n1", 0, ts=T0, job=None)])
    assert commands(out) == [] and audits(out)[0].event == "stale"
    out = policy.process([failure("n2", 0, ts=T0 + 7200, job=None, horizon_h=200)])
    assert commands(out) == [] and audits(out)[0].event == "horizon"


def test_rebalance_on_straggler_with_gain_hysteresis_and_cooldown():
    cfg = PolicyConfig.model_validate({"straggler": {"cooldown_s": 600, "min_gain": 0.05}})
    policy = ActionPolicy(cfg)
    with_ranks(policy, 8)
    slow = commands(policy.process([straggler(5, 0.8, T0)]))
    assert [c.type for c in slow] == ["rebalance"] and slow[0].params["speed_factors"] == {"5": 0.8}
    assert slow[0].params["predicted_gain"] > 0.05
    # A second rank slows a minute later: within the cooldown, audited, no command storm.
    out = policy.process([straggler(6, 0.7, T0 + 60)])
    assert commands(out) == [] and audits(out)[0].event == "cooldown"
    # Small slowdowns do not pay for a rebalance.
    tiny = ActionPolicy(PolicyConfig.model_validate({"straggler": {"min_gain": 0.1}}))
    with_ranks(tiny, 8)
    assert commands(tiny.process([straggler(2, 0.96, T0)])) == []  # above slow_below: not slow
    # 1 - 8 x 0.94 / 7.94 = 5.3% (5.2% in integer shares)
    small = audits(tiny.process([straggler(2, 0.94, T0 + 1)]))
    assert small[0].event == "small_gain" and "5.2%" in small[0].reason
    # Hysteresis: between slow_below and recover_above the rank stays slow.
    assert commands(policy.process([straggler(5, 0.97, T0 + 3600)])) == []
    back = commands(policy.process([straggler(5, 1.0, T0 + 7200, alert=False)]))
    assert back[0].params["speed_factors"] == {"6": 0.7}  # rank 5 restored; rank 6 still slow


def test_rebalance_with_a_plan_sends_the_replanned_samples():
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    plan = plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job="llm",
                                strategy=(1, 1, 4)), parse_gpu_spec("h100-sxm:4"))
    policy = ActionPolicy()
    policy.process([plan])
    cmd = commands(policy.process([straggler(0, 0.5, T0)]))[0]
    samples = {int(k): v for k, v in cmd.params["samples"].items()}
    assert sum(samples.values()) == 64 == cmd.params["global_samples"]
    assert [r.samples for r in plan.ranks] == [16, 16, 16, 16]
    assert samples == {0: 9, 1: 19, 2: 18, 3: 18}  # 64 x (0.5 : 1 : 1 : 1), largest remainder


def test_a_slow_stage_of_a_pure_pipeline_gets_new_stage_boundaries_not_shares():
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    plan = plan_job(PlanRequest(model=resolve_model("gpt-1.3b"), global_batch=64, job="pp",
                                strategy=(1, 2, 1)), parse_gpu_spec("h100-sxm:2"))
    assert [r.layers for r in plan.ranks] == [(0, 12), (13, 23)]  # embeddings and head weigh too
    policy = ActionPolicy()
    policy.process([plan])
    slow = straggler(1, 0.6, T0, job="pp")  # stage 1 runs at 0.6 of its expected speed
    cmd = commands(policy.process([slow]))[0]
    # stage 1 at 0.6: a planned layer there now takes 1 / (11 x 0.6) of the planned step, one
    # of stage 0 1 / 13; 16 : 8 makes the slower of the two fastest (16/13 vs 8/6.6)
    assert cmd.params["layers"] == {"0": [0, 15], "1": [16, 23]}
    assert cmd.params["stage_speed_factors"] == {"1": 0.6} and "samples" not in cmd.params
    assert cmd.params["predicted_gain"] == pytest.approx(1 - (16 / 13) / (11 / 6.6), abs=1e-4)
    # back to its speed after the cooldown: the plan's split again
    back = commands(policy.process([straggler(1, 1.0, T0 + 1000, job="pp")]))[0]
    assert back.params["layers"] == {"0": [0, 12], "1": [13, 23]}
    # a stage whose memory holds no more layers: nothing to move, reported as a small gain
    tight = plan.model_copy(update={"job": "tight", "ranks": [
        r.model_copy(update={"memory_gb": r.memory_capacity_gb * 0.99}) for r in plan.ranks]})
    policy.process([tight])
    out = policy.process([straggler(1, 0.6, T0 + 1000, job="tight")])
    assert commands(out) == [] and audits(out)[0].event == "small_gain"


def test_resize_after_drain_carries_the_planners_diff_when_the_plan_and_inventory_are_known():
    from fleetwise.planner import PlanRequest, cluster_from_inventory, plan_job, resolve_model

    invs = [NodeInventory(ts=T0, node=f"n{i}", gpus=[GpuInventory(index=g, model="NVIDIA H100 80GB HBM3")
                                                     for g in range(4)]) for i in range(2)]
    plan = plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job="llm",
                                strategy=(1, 1, 8)), cluster_from_inventory(invs))
    policy = ActionPolicy()
    policy.process([*invs, plan])
    cp = commands(policy.process([failure("n1", 2, rank=6)]))[0]
    drain = commands(policy.process([ack(cp, ts=T0 + 10)]))[0]
    resize = commands(policy.process([ack(drain, ts=T0 + 20)]))[0]
    p = resize.params
    assert p["world_size"] == 7 and sum(p["samples"].values()) == 64
    assert any(d["node"] == "n1" and d["gpu"] == 2 and d["after"] is None for d in p["plan_diff"])
    policy.process([ack(resize, ts=T0 + 30)])
    assert len(policy.jobs["llm"].plan["ranks"]) == 7  # the job's plan follows the resize's ack


def test_a_pure_pipeline_is_re_planned_as_one_with_its_stage_boundaries():
    from fleetwise.planner import PlanRequest, cluster_from_inventory, plan_job, resolve_model

    invs = [NodeInventory(ts=T0, node="n0", gpus=[GpuInventory(index=g, model="NVIDIA H100 80GB HBM3")
                                                  for g in range(4)])]
    plan = plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job="pp",
                                strategy=(1, 4, 1)), cluster_from_inventory(invs))
    policy = ActionPolicy()
    policy.process([*invs, plan])
    policy.jobs["pp"].layers = {0: (0, 9), 1: (10, 17), 2: (18, 25), 3: (26, 31)}  # a rebalance's
    cp = commands(policy.process([failure("n0", 2, job="pp", rank=2)]))[0]
    drain = commands(policy.process([ack(cp, ts=T0 + 10)]))[0]
    resize = commands(policy.process([ack(drain, ts=T0 + 20)]))[0]
    p = resize.params
    # Not the planner's free choice (data parallelism over 3 GPUs, faster): the training script
    # runs a stage per rank, so the re-plan stays a pipeline, with its boundaries in the command.
    assert p["strategy"] == {"dp": 1, "tp": 1, "pp": 3} and p["world_size"] == 3
    spans = [p["layers"][str(s)] for s in range(3)]
    assert spans[0][0] == 0 and spans[-1][1] == 31
    assert all(a[1] + 1 == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert p["samples"] == {"0": 64}
    policy.process([ack(resize, ts=T0 + 30)])
    assert policy.jobs["pp"].layers == {}  # the new plan's split is in force, not the old rebalance's


def test_approval_mode_holds_commands_until_an_operator_approves():
    cfg = PolicyConfig.model_validate({"failure": {"mode": "approve"}})
    policy = ActionPolicy(cfg)
    out = policy.process([failure("n1", 3, job=None)])
    held = audits(out)[0]
    assert commands(out) == [] and held.event == "awaiting_approval" and held.command_id in held.reason
    approve = operator(ts=T0 + 100, action="approve", command_id=held.command_id)
    sent = commands(policy.process([approve]))
    assert [c.id for c in sent] == [held.command_id] and sent[0].ts == T0 + 100 and verify(sent[0])
    off = ActionPolicy(PolicyConfig.model_validate({"failure": {"mode": "off"}}))
    assert commands(off.process([failure("n1", 3, job=None)])) == []
    unknown = policy.process([operator(ts=T0 + 200, action="approve", command_id="drain-nope")])
    assert unknown == [] and policy.suppressed["operator_unknown_command"] == 1


def test_operator_actions_act_only_when_signed_under_the_operators_keys():
    cfg = PolicyConfig.model_validate({"failure": {"mode": "approve"}})
    policy = ActionPolicy(cfg)
    held = audits(policy.process([failure("n1", 3, job=None)]))[0]
    approve = OperatorAction(ts=T0 + 100, action="approve", command_id=held.command_id, by="mallory")
    forged = operator(ts=T0 + 100, action="approve", command_id="drain-other").model_copy(
        update={"command_id": held.command_id})
    refused = [
        (approve, "unsigned: the operator action carries no signature"),
        (sign(approve, Keyring()), "unknown key id 'dev'"),  # the command key is not an operator's
        (forged, "bad signature under key 'dev-operator': forged or altered"),
    ]
    for action, reason in refused:
        out = policy.process([action])
        assert commands(out) == [], reason
        [event] = audits(out)
        assert event.event == "operator_rejected" and reason in event.reason
        assert event.command_id == held.command_id
        assert policy.fleet.commands[held.command_id].status == "held"
    # A worker that does not hold the command stays quiet (another worker reports it).
    other = ActionPolicy(cfg)
    assert other.process([approve]) == [] and other.suppressed["operator_rejected"] == 1
    # Rotation: a keyring holding the old and the new operator key verifies both.
    ring = Keyring.parse("op-new=new-operator-secret-0123,"
                         "dev-operator=fleetwise-dev-operator-key-not-for-production")
    assert verify_operator(operator(ts=T0, action="deny", command_id="x"), ring)
    rotated = ActionPolicy(cfg, operator_keys=ring)
    held2 = audits(rotated.process([failure("n2", 1, job=None)]))[0]
    sent = commands(rotated.process([sign(OperatorAction(ts=T0 + 50, action="approve",
                                                         command_id=held2.command_id), ring)]))
    assert [c.id for c in sent] == [held2.command_id]
    # An unsigned return of a drained GPU leaves it out of service.
    drained = ActionPolicy()
    drain = commands(drained.process([failure("n1", 5, job=None)]))[0]
    drained.process([ack(drain, "done", ts=T0 + 10)])
    [event] = audits(drained.process([OperatorAction(ts=T0 + 20, action="return_gpu", node="n1", gpu=5)]))
    assert event.event == "operator_rejected" and (event.node, event.gpu) == ("n1", 5)
    assert drained.fleet.status(("n1", 5)) == "drained"
    drained.process([operator(ts=T0 + 30, action="return_gpu", node="n1", gpu=5)])
    assert drained.fleet.status(("n1", 5)) == "in_service"


def test_dry_run_signing_keys_and_state_round_trip():
    ring = Keyring.parse("k2=second-secret-0123456789,k1=first-secret-0123456789")
    policy = ActionPolicy(PolicyConfig(dry_run=True), keyring=ring)
    with_ranks(policy, 8)
    cp = commands(policy.process([failure("n1", 3)]))[0]
    assert cp.dry_run and cp.key_id == "k2" and verify_command(cp, ring, now=T0)
    restored = ActionPolicy(PolicyConfig(dry_run=True), keyring=ring)
    for key in policy.keys():
        restored.restore(key, policy.state(key))
    assert commands(restored.process([failure("n1", 3, ts=T0 + 5)])) == []  # remembers the checkpoint
    drain = commands(restored.process([ack(cp, ts=T0 + 6)]))
    assert [c.type for c in drain] == ["drain"] and drain[0].seq == 2  # seq continues after restore


def test_a_worker_restored_from_its_job_keys_alone_still_has_the_drained_gpu_out():
    # The GPUs' statuses sit in the fleet-wide key, saved only by the worker holding its
    # partition; a worker restored from the job's key alone gets them back from the drain.
    policy = ActionPolicy()
    with_ranks(policy, 8)
    cp = commands(policy.process([failure("n1", 3, rank=3)]))[0]
    drain = commands(policy.process([ack(cp, ts=T0 + 30)]))[0]
    policy.process([ack(drain, "done", ts=T0 + 60)])
    restored = ActionPolicy()
    restored.restore("llm", policy.state("llm"))
    assert restored.fleet.status(("n1", 3)) == "drained"
    assert commands(restored.process([failure("n1", 3, ts=T0 + 600, rank=3)])) == []
    # returned after the drain (the operator topic read first): the return stands
    returned = ActionPolicy()
    returned.process([operator(ts=T0 + 900, action="return_gpu", node="n1", gpu=3, reason="reseated")])
    returned.restore("llm", policy.state("llm"))
    assert returned.fleet.status(("n1", 3)) == "in_service"


def test_restoring_another_workers_fleet_part_merges_instead_of_rolling_this_one_back():
    # After a rebalance the fleet-wide key's new holder restores the previous holder's saved
    # part: its own newer GPU statuses and its own drain decisions must survive.
    old = ActionPolicy(PolicyConfig.model_validate({"rails": {"breaker_drains": 2}}))
    old.fleet.known(("n1", 0))  # in service as far as the old holder knew
    old.process([failure("b1", 0, job=None, ts=T0 + 5)])
    holder = ActionPolicy(PolicyConfig.model_validate({"rails": {"breaker_drains": 2}}))
    drain = commands(holder.process([failure("n1", 0, job=None, ts=T0 + 10)]))[0]
    holder.process([ack(drain, "done", ts=T0 + 20)])
    holder.restore("~fleet", old.state("~fleet"))
    assert holder.fleet.status(("n1", 0)) == "drained" and holder.fleet.status(("b1", 0)) == "in_service"
    assert holder.breaker_attempts == [T0 + 5, T0 + 10]  # both workers' decisions
    out = holder.process([failure("n2", 0, job=None, ts=T0 + 30)])  # a third within the window
    assert audits(out)[0].event == "breaker_open"


def test_signature_detects_tampering():
    cmd = sign(Command(id="drain-1", type="drain", ts=T0, reason="r", params={"x": 1}))
    assert verify(cmd)
    assert not verify(cmd.model_copy(update={"params": {"x": 2}}))
    assert not verify(cmd, key=b"another key that is long")


def test_ed25519_keys_let_verifiers_hold_no_secret_that_signs():
    private, public = generate_ed25519_entries("e1", seed=bytes(range(32)))
    signer = Keyring.parse(private)
    verifier = Keyring.parse(public)  # what the training plugin and the kube consumer hold
    assert signer.active == "e1" and verifier.active == "" and verifier.public == signer.public
    cmd = sign(Command(id="drain-1", type="drain", ts=T0, job="llm", seq=1, reason="r"), signer)
    assert cmd.key_id == "e1" and cmd.signature.startswith("ed25519:")
    assert verify_command(cmd, verifier, now=T0, job="llm")
    assert verify_command(cmd, signer, now=T0)
    with pytest.raises(KeyringError, match="only verifies"):
        sign(cmd, verifier)
    altered = cmd.model_copy(update={"node": "n9"})
    assert verify_command(altered, verifier, now=T0).reason == \
        "bad signature under key 'e1': forged or altered"
    # An HMAC signature under a key id that names an Ed25519 key is no signature of that key.
    hmac_named_e1 = sign(cmd.model_copy(update={"signature": ""}), b"a-shared-secret-of-16+b")
    assert not verify_command(hmac_named_e1, verifier, now=T0)
    other = Keyring.parse(generate_ed25519_entries("e1")[1])  # same id, another key pair
    assert not verify_command(cmd, other, now=T0)
    # Rotation across schemes: a verifier with the new public key and the old HMAC secret.
    mixed = Keyring.parse(f"{public},k1=first-secret-0123456789")
    assert mixed.active == "k1"  # the only entry that can sign
    assert verify_command(cmd, mixed, now=T0)
    assert verify_command(sign(cmd, Keyring.parse("k1=first-secret-0123456789")), mixed, now=T0)
    # The policy signs with an Ed25519 key like with a secret.
    drain = commands(ActionPolicy(keyring=signer).process([failure("n1", 3, job=None)]))[0]
    assert verify_command(drain, verifier, now=T0)
    # Operator actions too.
    ops_private, ops_public = generate_ed25519_entries("ops")
    action = sign(OperatorAction(ts=T0, action="return_gpu", node="n1", gpu=3), Keyring.parse(ops_private))
    assert verify_operator(action, Keyring.parse(ops_public))
    for bad, message in (("e1=ed25519:abc", "not base64"),
                         ("e1=ed25519-pub:" + "QUJD" * 4, "32 bytes, got 12")):
        with pytest.raises(KeyringError, match=message):
            Keyring.parse(bad)


def test_keys_generate_prints_a_pair_that_verifies(tmp_path):
    from typer.testing import CliRunner

    from fleetwise.cli import app

    out = CliRunner().invoke(app, ["keys", "generate", "k2026"])
    assert out.exit_code == 0, out.output
    private, public = out.output.strip().splitlines()
    assert private.startswith("k2026=ed25519:") and public.startswith("k2026=ed25519-pub:")
    cmd = sign(Command(id="c", type="drain", ts=T0, reason="r"), Keyring.parse(private))
    assert verify_command(cmd, Keyring.parse(public), now=T0)
    assert CliRunner().invoke(app, ["keys", "generate", "a=b"]).exit_code != 0
    # A signer given only the public entry is told so at once, not at its first command.
    refused = CliRunner().invoke(app, ["gpu", "return", "n1/3"], env={"FLEETWISE_OPERATOR_KEYS": public})
    assert refused.exit_code == 2 and "hold only public keys" in refused.output and "k2026" in refused.output
    (tmp_path / "t.jsonl").write_text("")
    replay = ["replay", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o.jsonl")]
    refused = CliRunner().invoke(app, replay, env={"FLEETWISE_SIGNING_KEYS": public})
    assert refused.exit_code == 2 and "hold only public keys" in refused.output


def test_rule_alert_reason_names_the_rule_not_the_probability():
    p = failure("n2", 1, job=None).model_copy(update={
        "probability": 0.04, "signals": [Signal(name="source", value="rule:xid_fatal_memory")]})
    drain = commands(ActionPolicy().process([p]))[0]
    assert "rule:xid_fatal_memory" in drain.reason and "p=0.04" not in drain.reason


def test_policy_files_are_validated_with_the_field_named():
    assert parse_policy("") == PolicyConfig()
    cfg = parse_policy("dry_run: true\nrails:\n  max_drain_share_per_job: 0.5\nfailure: {mode: approve}\n")
    assert cfg.dry_run and cfg.rails.max_drain_share_per_job == 0.5 and cfg.failure.mode == "approve"
    assert parse_policy(policy_yaml(cfg)) == cfg  # the full file round-trips
    with pytest.raises(PolicyFileError, match=r"rails\.max_drain_share_per_job: .*less than or equal to 1"):
        parse_policy("rails:\n  max_drain_share_per_job: 3\n")
    with pytest.raises(PolicyFileError, match=r"failure\.mode: .*'auto', 'approve' or 'off'"):
        parse_policy("failure: {mode: sometimes}\n")
    with pytest.raises(PolicyFileError, match=r"rails\.max_drains_total: Extra inputs are not permitted"):
        parse_policy("rails: {max_drains_total: 3}\n")
    with pytest.raises(PolicyFileError, match="recover_above"):
        parse_policy("straggler: {slow_below: 0.9, recover_above: 0.8}\n")
    with pytest.raises(PolicyFileError, match="signing_key: keys never go in a policy file"):
        parse_policy("signing_key: abc\n")
    with pytest.raises(PolicyFileError, match="not valid YAML"):
        parse_policy("rails: [\n")


# -- properties over random prediction / ack streams ------------------------------------------

GPUS = [(f"n{n}", g) for n in range(2) for g in range(3)]
event = st.one_of(
    st.tuples(st.just("fail"), st.sampled_from(GPUS), st.sampled_from(["a", "b", None]), st.booleans()),
    # acks: mostly to one of the latest commands (negative index), sometimes to any
    st.tuples(st.just("ack"), st.sampled_from([-1, -1, -1, -2, -3]) | st.integers(0, 40),
              st.sampled_from(["received", "applied", "done", "done", "done", "rejected", "failed"]),
              st.none()),
    st.tuples(st.just("slow"), st.integers(0, 7), st.floats(0.3, 1.1), st.booleans()),
    st.tuples(st.just("return"), st.sampled_from(GPUS), st.none(), st.none()),
)


def _run(events: list, policy: ActionPolicy, fleet_cap: int = 3) -> list:
    """Feed an event stream (acks refer to commands emitted so far, by index) and check, as it
    goes, that no GPU is drained while an earlier drain of it is open or done and not returned,
    and that the fleet's out-of-service count never passes its cap. Returns all outputs."""
    out: list = []
    sent: list[Command] = []
    drain_of: dict[tuple, str] = {}  # GPU -> id of its last drain
    done_acked: set[str] = set()

    def check(cmd: Command) -> None:
        assert set(cmd.requires) <= done_acked  # no drain before its checkpoint's done ack
        if cmd.type == "drain":
            key = (cmd.node, cmd.gpu)
            previous = drain_of.get(key)
            if previous is not None:  # only after that drain ended without taking the GPU out
                assert policy.fleet.commands[previous].status in ("rejected", "failed", "expired"), key
            drain_of[key] = cmd.id
    for i, (kind, a, b, c) in enumerate(events):
        ts = T0 + 60 * i
        if kind == "fail":
            rank = GPUS.index(a) % 8
            recs = [failure(a[0], a[1], ts=ts, job=b, rank=rank if b else None)]
        elif kind == "ack":
            if not sent:
                continue
            cmd = sent[a % len(sent)]
            recs = [Ack(command_id=cmd.id, ts=ts, job=cmd.job, by="test", status=b)]
            if b == "done" and policy.fleet.commands[cmd.id].status not in ("rejected", "failed", "expired"):
                done_acked.add(cmd.id)
        elif kind == "slow":
            recs = [straggler(a, b, ts, alert=c)]
        else:
            recs = [operator(ts=ts, action="return_gpu", node=a[0], gpu=a[1])]
            drain_of.pop(a, None)  # back in service: it may be drained again
        produced = policy.process(recs)
        if kind == "fail" and c:  # a consumer that answers at once: ack each command done, in turn
            out += produced
            todo = commands(produced)
            while todo:
                cmd = todo.pop(0)
                check(cmd)
                sent.append(cmd)
                done_acked.add(cmd.id)
                more = policy.process([Ack(command_id=cmd.id, ts=ts, job=cmd.job, by="test", status="done")])
                todo += commands(more)
                out += more
            assert len(policy.fleet.out_of_service()) <= fleet_cap
            continue
        for cmd in commands(produced):
            check(cmd)
        assert len(policy.fleet.out_of_service()) <= fleet_cap
        sent += commands(produced)
        out += produced
    return out


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(event, max_size=80))
def test_properties_over_random_prediction_and_ack_streams(events):
    cfg = PolicyConfig.model_validate({"rails": {"max_drain_share_per_job": 0.5, "max_drained_gpus_fleet": 3,
                                                 "breaker_drains": 4, "max_disruptive_per_job_per_hour": 3}})
    policy = ActionPolicy(cfg)
    cmds = commands(_run(events, policy))
    # Crash replay: the same input processed again from scratch gives the same commands.
    again = commands(_run(events, ActionPolicy(cfg)))
    assert [c.model_dump() for c in cmds] == [c.model_dump() for c in again]
    assert len({c.id for c in cmds}) == len(cmds)  # zero duplicate commands
    by_id = {c.id: c for c in cmds}
    for c in cmds:
        assert verify(c)
        # No drain before its checkpoint's done ack: the drain is sent at that ack's time, and
        # the checkpoint it requires was acked done.
        for req in c.requires:
            assert req in by_id and by_id[req].ts <= c.ts
            assert policy.fleet.commands[req].status == "done"
    # seq strictly increasing per job, in emission order.
    seqs: dict[str, int] = {}
    for c in cmds:
        if c.job:
            assert c.seq > seqs.get(c.job, 0)
            seqs[c.job] = c.seq


def test_a_job_that_lost_a_gpu_grows_back_onto_a_joining_gpu_of_the_same_model():
    inv = [NodeInventory(ts=T0 - 10, node=n, gpus=[GpuInventory(index=g, model="H100") for g in range(4)])
           for n in ("n1", "n2")]
    policy = ActionPolicy()
    policy.process(inv)
    with_ranks(policy, 8)
    cp = commands(policy.process([failure("n1", 3, rank=3)]))[0]
    drain = commands(policy.process([ack(cp, ts=T0 + 10)]))[0]
    policy.process([ack(drain, ts=T0 + 20)])  # -> resize down, n1/3 left the job
    other = NodeInventory(ts=T0 + 100, node="n9", gpus=[GpuInventory(index=0, model="A100")])
    assert commands(policy.process([other])) == []  # another model: no growth
    new = NodeInventory(ts=T0 + 200, node="n8", gpus=[GpuInventory(index=0, model="H100"),
                                                      GpuInventory(index=1, model="H100")])
    grow = commands(policy.process([new]))
    assert [c.type for c in grow] == ["resize"]  # one GPU was lost: the job grows by one, not two
    assert grow[0].params["join"] == [["n8", 0]] and grow[0].params["replaces"] == [["n1", 3]]
    assert grow[0].params["world_size"] == 8


def _planned(job: str = "llm"):
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    return plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job=job,
                                strategy=(1, 1, 4)), parse_gpu_spec("h100-sxm:4"))


def test_an_ended_job_is_forgotten_and_the_same_name_planned_again_is_a_new_run():
    policy = ActionPolicy()
    policy.process([_planned("llm"), _planned("other")])
    rebalance = commands(policy.process([straggler(0, 0.5, T0)]))
    assert [c.type for c in rebalance] == ["rebalance"]
    policy.process([ack(rebalance[0], "done", ts=T0 + 5)])
    ended = audits(policy.process([JobEnd(job="llm", ts=T0 + 60)]))
    assert [a.event for a in ended] == ["job_ended"] and ended[0].job == "llm"
    assert ended[0].reason == "job llm ended (plan withdrawn): its state is dropped"
    assert ended[0].evidence == []
    assert "llm" not in policy.keys() and "other" in policy.keys() and policy.ended_jobs == 1
    assert policy.process([JobEnd(job="llm", ts=T0 + 61)]) == []  # a second end: nothing new
    # The same name planned again is a new run: it gets commands.
    policy.process([_planned("llm")])
    assert [c.type for c in commands(policy.process([straggler(0, 0.5, T0 + 120)]))] == ["rebalance"]


def test_an_ended_job_with_commands_in_flight_gets_no_more_and_is_dropped_once_they_are_answered():
    from fleetwise.actuators.policy import RETIRE_SWEEP_MARGIN_S

    policy = ActionPolicy()
    policy.process([_planned("llm")])
    checkpoint = commands(policy.process([failure("h100-sxm-n000", 3, rank=3)]))[0]
    assert checkpoint.type == "checkpoint"
    ended = audits(policy.process([JobEnd(job="llm", ts=T0 + 10)]))
    assert ended[0].evidence == [checkpoint.id]
    assert "once 1 command(s) in flight are answered" in ended[0].reason
    # Ended: a late straggler prediction naming it rebalances nothing; a failure alert on one of
    # its GPUs is a GPU in no job (a drain with no checkpoint: no job left to save).
    assert commands(policy.process([straggler(1, 0.5, T0 + 20)])) == []
    drain = commands(policy.process([failure("h100-sxm-n000", 2, ts=T0 + 30, rank=2)]))
    assert [(c.type, c.job) for c in drain] == [("drain", None)]
    # Its state survives a restart while it waits (the end comes back with it).
    restored = ActionPolicy()
    restored.restore("llm", policy.state("llm"))
    assert restored.jobs["llm"].ended_ts == T0 + 10
    # The checkpoint answered: the next sweep drops the job.
    policy.process([ack(checkpoint, "done", ts=T0 + 40)])
    policy.process([ack(drain[0], "done", ts=T0 + 2 * RETIRE_SWEEP_MARGIN_S)])
    assert "llm" not in policy.jobs and policy.ended_jobs == 1


def test_operator_verbs_sign_with_the_operators_key_from_the_environment():
    from typer.testing import CliRunner

    from fleetwise.cli import app

    env = {"FLEETWISE_OPERATOR_KEYS": "ops-2026=an-operator-secret-0123456789"}
    out = CliRunner().invoke(app, ["gpu", "return", "node-3/5", "--ts", "2025-12-01T00:00:00Z",
                                   "--reason", "RMA-7"], env=env)
    assert out.exit_code == 0, out.output
    action = OperatorAction.model_validate_json(out.output.strip())
    assert (action.node, action.gpu, action.key_id) == ("node-3", 5, "ops-2026")
    assert verify_operator(action, Keyring.parse(env["FLEETWISE_OPERATOR_KEYS"]))
    assert not verify_operator(action, operator_keyring())  # a consumer without that key refuses it
    approve = CliRunner().invoke(app, ["approve", "drain-n1-3", "--ts", "2025-12-01T00:00:00Z"])
    assert verify_operator(OperatorAction.model_validate_json(approve.output.strip()), operator_keyring())
    bad = CliRunner().invoke(app, ["approve", "drain-n1-3"], env={"FLEETWISE_OPERATOR_KEYS": "short=abc"})
    assert bad.exit_code != 0 and "operator keys: key 'short'" in bad.output


# -- growth to the intent's maximum ------------------------------------------------------------
H100 = "NVIDIA H100 80GB HBM3"


def node(name: str, model: str = H100, gpus: int = 4, ts: float = T0,
         site: str | None = None) -> NodeInventory:
    return NodeInventory(ts=ts, node=name, site=site,
                         gpus=[GpuInventory(index=g, model=model) for g in range(gpus)])


def intent_plan(job: str, invs: list[NodeInventory], **constraints):
    """A plan over the nodes' GPUs, made as `fleetwise job start --intent` makes it (the intent's
    constraints carried in the plan)."""
    from fleetwise.planner import PlanRequest, cluster_from_inventory, plan_job, resolve_model
    from fleetwise.schemas import JobConstraints

    c = JobConstraints(**constraints) if constraints else None
    dp = sum(len(i.gpus) for i in invs)
    return plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job=job, constraints=c,
                                strategy=(1, 1, dp)), cluster_from_inventory(invs))


def test_a_job_grows_to_its_intents_maximum_when_gpus_join_and_no_further():
    n1 = node("n1")
    policy = ActionPolicy()
    policy.process([n1, intent_plan("llm", [n1], max_gpus=8)])
    grow = commands(policy.process([node("n2", ts=T0 + 100)]))
    assert [c.type for c in grow] == ["resize"]
    p = grow[0].params
    assert p["join"] == [["n2", g] for g in range(4)] and p["world_size"] == 8
    assert sum(p["samples"].values()) == 64
    assert p["strategy"]["dp"] * p["strategy"]["tp"] * p["strategy"]["pp"] == 8
    assert p["predicted_step_s"]["after"] < p["predicted_step_s"]["before"] / 1.05
    assert "inventory of n2: llm grows from 4 to 8 GPUs (its intent allows 8)" in grow[0].reason
    assert verify(grow[0]) and grow[0].seq == 1
    # Until its ack the job runs its old plan: a node joining meanwhile is not taken as well.
    assert commands(policy.process([node("n3", ts=T0 + 150)])) == []
    policy.process([ack(grow[0], "done", ts=T0 + 200)])
    assert len(policy.jobs["llm"].plan["ranks"]) == 8  # the plan follows the ack
    assert policy.jobs["llm"].plan["constraints"]["max_gpus"] == 8  # ... and keeps its intent
    assert commands(policy.process([node("n4", ts=T0 + 300)])) == []  # at its maximum: no further


def test_a_job_without_an_intents_maximum_keeps_its_planned_size():
    n1 = node("n1")
    for plan in (intent_plan("llm", [n1]), intent_plan("llm", [n1], max_gpus=4)):
        policy = ActionPolicy()
        policy.process([n1, plan])
        assert commands(policy.process([node("n2", ts=T0 + 100)])) == []


def test_growth_takes_only_gpus_the_intent_allows_and_only_when_it_pays():
    n1 = node("n1")
    policy = ActionPolicy()
    policy.process([n1, intent_plan("llm", [n1], max_gpus=8, gpu_types=["h100-sxm"], sites=["eu"])])
    assert commands(policy.process([node("a1", model="NVIDIA A100-SXM4-80GB", site="eu", ts=T0 + 1)])) == []
    assert commands(policy.process([node("h-us", site="us", ts=T0 + 2)])) == []
    grow = commands(policy.process([node("h-eu", site="eu", ts=T0 + 3)]))
    assert [c.params["join"] for c in grow] == [[["h-eu", g] for g in range(4)]]

    excluded = ActionPolicy()
    excluded.process([n1, intent_plan("llm", [n1], max_gpus=8, exclude_gpu_types=["NVIDIA H100 80GB HBM3"])])
    assert commands(excluded.process([node("n2", ts=T0 + 1)])) == []

    stingy = ActionPolicy(PolicyConfig.model_validate({"resize": {"min_gain": 0.99}}))
    stingy.process([n1, intent_plan("llm", [n1], max_gpus=8)])
    held = stingy.process([node("n2", ts=T0 + 1)])
    assert commands(held) == []  # 2x the GPUs: 1.94x as fast
    (why,) = audits(held)
    assert why.event == "not_grown" and why.job == "llm"
    assert why.reason.startswith("inventory of n2: llm not grown: growing from 4 to 8 GPUs would gain 94.")
    assert why.reason.endswith("(< 99%; predicted step 9.725 s -> 5.005 s)")


def test_gpus_a_job_leaves_when_it_ends_go_to_a_job_that_may_grow():
    a, b = node("a"), node("b")
    policy = ActionPolicy()
    policy.process([a, b, intent_plan("first", [a]), intent_plan("second", [b], max_gpus=6)])
    grow = commands(policy.process([JobEnd(job="first", ts=T0 + 100)]))
    assert [(c.job, c.params["join"]) for c in grow] == [("second", [["a", 0], ["a", 1]])]
    assert "job first ended: second grows from 4 to 6 GPUs" in grow[0].reason


def test_gpus_the_telemetry_names_in_a_job_are_not_grown_onto_until_that_job_ends():
    # A job started outside `fleetwise job start` (no plan on the stream): the control plane
    # knows it only from the job its GPUs' samples name.
    import numpy as np

    a, b = node("a"), node("b")
    policy = ActionPolicy()
    policy.process([a, b])
    policy.process([intent_plan("grower", [a], max_gpus=8)])
    keys = [("b", g) for g in range(4)]
    policy.observe_utilisation(keys, np.full(4, T0 + 50), np.full(4, 90.0), ["outside"] * 4, list(range(4)))
    out = policy.process([node("c", gpus=2, ts=T0 + 100)])
    assert [(c.job, c.params["join"]) for c in commands(out)] == [("grower", [["c", 0], ["c", 1]])]
    policy.process([ack(commands(out)[0], ts=T0 + 110)])
    grow = commands(policy.process([JobEnd(job="outside", ts=T0 + 200)]))
    assert [(c.job, c.params["join"]) for c in grow] == [("grower", [["b", 0], ["b", 1]])]


def test_a_gpu_in_flight_to_one_job_is_not_given_to_another():
    a, b = node("a"), node("b")
    policy = ActionPolicy()
    policy.process([a, b, intent_plan("x", [a], max_gpus=6), intent_plan("y", [b], max_gpus=8)])
    grow = commands(policy.process([node("c", ts=T0 + 100)]))
    # x (first by name) takes two of c's GPUs; y the two left over.
    assert [(c.job, c.params["join"]) for c in grow] == [("x", [["c", 0], ["c", 1]]),
                                                          ("y", [["c", 2], ["c", 3]])]
    # y's growth done, x's still in flight: a node joining goes to y, and x's GPUs stay x's.
    policy.process([ack(grow[1], ts=T0 + 110)])
    later = commands(policy.process([node("d", gpus=2, ts=T0 + 120)]))
    assert [(c.job, c.params["join"]) for c in later] == [("y", [["d", 0], ["d", 1]])]
    policy.process([ack(grow[0], ts=T0 + 130), ack(later[0], ts=T0 + 130)])
    assert commands(policy.process([node("e", ts=T0 + 140)])) == []  # both at their maximum


def test_a_gpu_an_operator_returns_goes_to_a_job_that_may_grow():
    b, c = node("b"), node("c", gpus=1)
    policy = ActionPolicy()
    policy.process([b, c])
    policy.process([intent_plan("y", [b], max_gpus=5)])  # planned after c joined: no event since
    drain = commands(policy.process([failure("c", 0, job=None)]))
    assert [d.type for d in drain] == ["drain"]
    policy.process([ack(drain[0], ts=T0 + 10)])
    assert commands(policy.process([node("d", gpus=0, ts=T0 + 20)])) == []  # nothing free but c/0, drained
    back = commands(policy.process([operator(ts=T0 + 30, action="return_gpu", node="c", gpu=0, by="ops")]))
    assert [(x.job, x.params["join"]) for x in back] == [("y", [["c", 0]])]
    assert "c/gpu0 returned by ops: y grows from 4 to 5 GPUs" in back[0].reason


# -- producers' identities: messages signed under the writer's own key --------------------------
def test_each_producer_signs_as_itself_and_only_what_it_may_write():
    from fleetwise.actuators.signing import IdentityKeys, IdentityVerifier, identity_key
    from fleetwise.schemas import topics as T

    master = b"the-identity-master-key-0123456789"
    a, b = identity_key(master, "node/node-a"), identity_key(master, "node/node-b")
    assert len(a) == 32 and a != b and a != identity_key(master, "job/node-a")  # one name, two kinds
    assert a != identity_key(b"another-master-key-0123456", "node/node-a")
    with pytest.raises(KeyringError, match=">= 16 bytes"):
        identity_key(b"short", "node/node-a")
    own = IdentityKeys.parse(f"node/node-a=hex:{a.hex()}")
    assert own.signs_as(T.TELEMETRY_GPU.name, "node-a") == "node/node-a"
    with pytest.raises(KeyringError, match="signs as 'node/node-a', not 'node/node-b'"):
        own.header(b"{}", "node/node-b")
    sim = IdentityKeys(master=master)  # a simulator holding the master signs as each message's writer
    assert sim.signs_as(T.TELEMETRY_STEPS.name, "llm") == "job/llm"
    with pytest.raises(KeyringError, match="exactly one"):
        IdentityKeys.parse(f"node/node-a=hex:{a.hex()},node/node-b=hex:{b.hex()}")

    check = IdentityVerifier(master).check
    gpu, steps, acks = T.TELEMETRY_GPU.name, T.TELEMETRY_STEPS.name, T.ACKS.name
    value = b'{"node": "node-a", "ts": 1, "samples": []}'
    assert check(gpu, value, b"node-a", own.header(value, "node/node-a"))
    assert check(T.INVENTORY.name, value, b"node-a", own.header(value, "node/node-a"))
    assert not check(gpu, value + b" ", b"node-a", own.header(value, "node/node-a"))  # altered
    assert check(gpu, value, b"node-a", None).reason.startswith("unsigned: no fleetwise-signature header")
    assert "malformed" in check(gpu, value, b"node-a", b"node/node-a:deadbeef").reason
    assert check(gpu, value, b"node-b", own.header(value, "node/node-a")).reason == (
        "signed as 'node/node-a' but keyed 'node-b': only 'node/node-b' may write it")
    claimed = b"node/node-b;" + own.header(value, "node/node-a").split(b";", 1)[1]  # a's key, b's name
    assert check(gpu, value, b"node-b", claimed).reason == (
        "bad signature under 'node/node-b''s key: forged or altered")
    # A training job's plugin writes its own steps and acks; the kube consumer acks for any job.
    job = IdentityKeys.parse(f"job/llm=hex:{identity_key(master, 'job/llm').hex()}")
    assert check(steps, value, b"llm", job.header(value, "job/llm"))
    assert check(acks, value, b"llm", job.header(value, "job/llm"))
    assert "only 'job/other' or 'kube-consumer' may write it" in check(
        acks, value, b"other", job.header(value, "job/llm")).reason
    as_node = own.header(value, "node/node-a")
    assert "only 'job/llm' may write it" in check(steps, value, b"llm", as_node).reason
    kube = IdentityKeys(identity="kube-consumer", key=identity_key(master, "kube-consumer"))
    assert check(acks, value, b"node-7", kube.header(value, "kube-consumer"))
    as_kube = kube.header(value, "kube-consumer")
    assert "only 'job/llm' may write it" in check(steps, value, b"llm", as_kube).reason
    with pytest.raises(KeyringError):
        IdentityVerifier(b"short")
    # A message without a key may be written by nobody (and never reaches the key derivation).
    assert check(gpu, value, b"", b"node/;hmac-sha256:00").reason == (
        "signed as 'node/' but keyed '': no producer may write it")
    # Forgeries under made-up keys are refused without being remembered.
    verifier = IdentityVerifier(master)
    for i in range(100):
        assert not verifier.check(gpu, value, f"n{i}".encode(), f"node/n{i};hmac-sha256:00".encode())
    assert verifier._keys == {}


def test_keys_identity_derives_the_key_a_producer_holds(monkeypatch):
    from typer.testing import CliRunner

    from fleetwise.actuators.signing import IdentityKeys, identity_key
    from fleetwise.cli import app

    monkeypatch.setenv("FLEETWISE_IDENTITY_MASTER_KEY", "hex:" + "ab" * 32)
    for ident in ("node/node-017", "job/llm-70b", "kube-consumer"):
        out = CliRunner().invoke(app, ["keys", "identity", ident])
        assert out.exit_code == 0, out.output
        parsed = IdentityKeys.parse(out.stdout)
        assert parsed.identity == ident and parsed.key == identity_key(bytes.fromhex("ab" * 32), ident)
    for bad in ("a;b", "node-017", "job/", "node/x=y"):
        out = CliRunner().invoke(app, ["keys", "identity", bad])
        assert out.exit_code == 2 and "identity must be node/NODE, job/JOB or kube-consumer" in " ".join(
            out.stderr.split()), bad
    monkeypatch.delenv("FLEETWISE_IDENTITY_MASTER_KEY")
    unset = CliRunner().invoke(app, ["keys", "identity", "node/node-017"])
    assert unset.exit_code == 2 and "set FLEETWISE_IDENTITY_MASTER_KEY" in " ".join(unset.stderr.split())


def test_growth_takes_the_jobs_own_gpu_models_first_and_says_why_it_holds_back():
    n1, old = node("n1"), node("old", model="Tesla V100-SXM2-32GB", gpus=8)
    policy = ActionPolicy()
    policy.process([n1, old])
    policy.process([intent_plan("llm", [n1], max_gpus=8)])  # V100s free since before: no event yet
    # An inventory sent again frees nothing: no growth is considered (no command, no audit).
    assert policy.process([node("old", model="Tesla V100-SXM2-32GB", gpus=8, ts=T0 + 50)]) == []
    grow = commands(policy.process([node("n2", ts=T0 + 100)]))
    # Four free H100s (the job's model) and eight V100s: the H100s, not the fuller V100 node.
    assert [c.params["join"] for c in grow] == [[["n2", g] for g in range(4)]]
    # Below its maximum with only GPUs a re-plan does not use: held back, with the reason.
    wide = ActionPolicy()
    wide.process([n1, old])
    wide.process([intent_plan("llm", [n1], max_gpus=12)])
    out = wide.process([node("t4", model="Tesla T4", gpus=1, ts=T0 + 100)])
    (why,) = audits(out)  # a T4 and V100s: the planner keeps the job on its four H100s
    assert commands(out) == [] and why.event == "not_grown"
    assert why.reason == "inventory of t4: llm not grown: the re-plan over 8 more GPU(s) uses none of them"


# Random capacity events for growth: a node joins (its GPUs of one model), a job ends, an
# operator returns a GPU, a consumer answers a growth (done or rejected).
_grow_event = st.one_of(
    st.tuples(st.just("join"), st.sampled_from([H100, "NVIDIA A100-SXM4-80GB"]), st.integers(1, 4)),
    st.tuples(st.just("end"), st.sampled_from(["a", "b", "c"]), st.just(0)),
    st.tuples(st.just("ack"), st.sampled_from(["done", "rejected"]), st.integers(0, 50)),
)


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_grow_event, max_size=12))
def test_growth_properties_over_random_capacity_events(events):
    """Whatever joins, ends and answers come: no GPU is in two jobs (planned, or joining in a
    growth in flight), no job grows past its intent's maximum, every growth names only free
    in-service GPUs and verifies, and the same events give the same commands."""

    def run() -> tuple[ActionPolicy, list[Command]]:
        base = [node("a0"), node("b0"), node("c0", gpus=2)]
        policy = ActionPolicy()
        policy.process(base)
        policy.process([intent_plan("a", base[:1], max_gpus=8), intent_plan("b", base[1:2], max_gpus=6),
                        intent_plan("c", base[2:], max_gpus=4)])
        sent: list[Command] = []
        for i, (kind, x, y) in enumerate(events):
            ts = T0 + 60 * (i + 1)
            if kind == "join":
                recs = [node(f"j{i}", model=x, gpus=y, ts=ts)]
            elif kind == "end":
                recs = [JobEnd(job=x, ts=ts)]
            else:
                grows = [c for c in sent if policy.fleet.commands[c.id].status == "issued"]
                if not grows:
                    continue
                recs = [ack(grows[y % len(grows)], x, ts=ts)]
            # Busy before the event: live jobs' GPUs (but the one ending now) and growths in flight.
            busy = {k for name, job in policy._live_jobs() if not (kind == "end" and name == x)
                    for k in job.ranks.values()}
            busy |= {tuple(k) for p in policy.fleet.open_commands("resize")
                     for k in p.command["params"].get("join", [])}
            new = commands(policy.process(recs))
            for c in new:
                assert c.type == "resize" and verify(c)
                joining = {(str(n), int(g)) for n, g in c.params["join"]}
                assert not joining & busy, (c.job, joining & busy)
                assert all(policy.fleet.status(k) == "in_service" and k[0] in policy.inventory
                           for k in joining)
            sent += new
            # No GPU in two jobs: live jobs' ranks plus the joins of growths in flight.
            held: list[tuple] = []
            for name, job in policy._live_jobs():
                held += list(job.ranks.values())
                limit = (job.plan or {}).get("constraints", {}).get("max_gpus")
                if limit is not None:
                    assert len(job.plan["ranks"]) <= limit, name
            for p in policy.fleet.open_commands("resize"):
                held += [tuple(k) for k in p.command["params"].get("join", [])]
            assert len(held) == len(set(held)), held
        return policy, sent

    _, first = run()
    _, again = run()
    assert [c.model_dump() for c in first] == [c.model_dump() for c in again]
    assert len({c.id for c in first}) == len(first)


def test_with_several_workers_one_decides_a_jobs_growth():
    """Capacity events reach every worker; the one the stream app says holds the job's state
    decides its growth, the others send nothing for it."""
    n1 = node("n1")
    workers = [ActionPolicy(), ActionPolicy()]
    workers[1].decides_for = lambda job: job != "llm"  # llm's state is on worker 0's partition
    sent = []
    for w in workers:
        w.process([n1, intent_plan("llm", [n1], max_gpus=8)])
        sent.append(commands(w.process([node("n2", ts=T0 + 100)])))
    assert [len(s) for s in sent] == [1, 0] and sent[0][0].job == "llm"
