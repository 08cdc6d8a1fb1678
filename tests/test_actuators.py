"""Action policy: checkpoint-then-drain, rebalance, stable ids, signatures, safety rails."""

from __future__ import annotations

from fleetwise.actuators import ActionPolicy, PolicyConfig, sign, verify
from fleetwise.schemas import Command, Prediction, Signal

T0 = 1764547200.0


def failure(node: str, gpu: int, ts: float = T0, job: str | None = "llm", rank: int | None = None,
            alert: bool = True) -> Prediction:
    return Prediction(id=f"failure:{node}/{gpu}:{int(ts)}", type="failure", ts=ts, node=node, gpu=gpu,
                      job=job, rank=rank, probability=0.95, horizon_h=48, alert=alert,
                      signals=[Signal(name="source", value="model"), Signal(name="sbe_rate_6h", value=40.0)])


def straggler(rank: int, factor: float, ts: float, alert: bool = True) -> Prediction:
    return Prediction(id=f"straggler:llm/{rank}:{int(ts)}", type="straggler", ts=ts, node="n1", gpu=rank,
                      job="llm", rank=rank, probability=1.0, horizon_h=0, alert=alert, factor=factor)


def test_failure_alert_gives_checkpoint_then_drain_with_reason_and_evidence():
    out = ActionPolicy().process([failure("n1", 3)])
    assert [c.type for c in out] == ["checkpoint", "drain"]
    checkpoint, drain = out
    assert drain.params["requires_checkpoint"] == checkpoint.id
    assert drain.evidence == ["failure:n1/3:1764547200"]
    assert "n1/gpu3" in drain.reason and "sbe_rate_6h=40.0" in drain.reason
    assert all(verify(c) for c in out)


def test_same_prediction_twice_is_one_command_and_ids_are_stable():
    p = failure("n1", 3)
    first = ActionPolicy().process([p])
    again = ActionPolicy().process([p])
    assert [c.id for c in first] == [c.id for c in again]  # stable across processes
    policy = ActionPolicy()
    assert len(policy.process([p])) == 2
    assert policy.process([p]) == []  # idempotent: already drained


def test_drain_caps_per_job_and_fleet():
    policy = ActionPolicy(PolicyConfig(max_drain_share_per_job=0.25, max_drained_gpus_fleet=100))
    # The job has 8 ranks: at most 2 may be drained (25%).
    policy.process([straggler(r, 1.0, T0, alert=False) for r in range(8)])
    drained = [c for i in range(5) for c in policy.process([failure("n1", i, rank=i)]) if c.type == "drain"]
    assert len(drained) == 2 and policy.suppressed["job_drain_cap"] == 3
    fleet = ActionPolicy(PolicyConfig(max_drained_gpus_fleet=1))
    fleet.process([failure("a", 0, job=None)])
    assert fleet.process([failure("b", 0, job=None)]) == []
    assert fleet.suppressed["fleet_drain_cap"] == 1


def test_rebalance_on_straggler_and_back_with_rate_limit():
    policy = ActionPolicy(PolicyConfig(min_interval_s=600))
    slow = policy.process([straggler(5, 0.8, T0)])
    assert [c.type for c in slow] == ["rebalance"] and slow[0].params["speed_factors"] == {"5": 0.8}
    # A second rank slows 1 minute later: rate-limited, no command storm.
    assert policy.process([straggler(6, 0.7, T0 + 60)]) == []
    assert policy.suppressed["rate_limited"] == 1
    back = policy.process([straggler(5, 1.0, T0 + 3600, alert=False)])
    assert back[0].params["speed_factors"] == {"6": 0.7}  # rank 5 restored; rank 6 still slow


def test_dry_run_and_state_round_trip():
    policy = ActionPolicy(PolicyConfig(dry_run=True))
    out = policy.process([failure("n1", 3)])
    assert all(c.dry_run for c in out)
    restored = ActionPolicy(PolicyConfig(dry_run=True))
    for key in policy.keys():
        restored.restore(key, policy.state(key))
    assert restored.process([failure("n1", 3, ts=T0 + 5)]) == []  # remembers the drain


def test_signature_detects_tampering():
    cmd = sign(Command(id="drain-1", type="drain", ts=T0, reason="r", params={"x": 1}))
    assert verify(cmd)
    assert not verify(cmd.model_copy(update={"params": {"x": 2}}))
    assert not verify(cmd, key=b"another key")


def test_rule_alert_reason_names_the_rule_not_the_probability():
    p = failure("n2", 1).model_copy(update={
        "probability": 0.04, "signals": [Signal(name="source", value="rule:xid_fatal_memory")]})
    drain = [c for c in ActionPolicy().process([p]) if c.type == "drain"][0]
    assert "rule:xid_fatal_memory" in drain.reason and "p=0.04" not in drain.reason
