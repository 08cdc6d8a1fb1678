"""Replayed decisions follow the command lifecycle: every drain follows an alert on that GPU and
its checkpoint's ack, ids are stable across replays, no GPU is drained twice."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fleetwise.schemas import Ack, Command, NodeInventory
from fleetwise.schemas import topics as T
from fleetwise.sim import FleetSimulator, write_trace
from fleetwise.sim.bundled import demo_config
from fleetwise.streams.embedded import replay


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("demo")
    sim = FleetSimulator(demo_config())
    write_trace(sim, d / "trace.jsonl.gz")
    inv = [NodeInventory.model_validate(x) for x in sim.inventory()]
    (d / "inventory.jsonl").write_text("".join(i.to_json() + "\n" for i in inv))
    return d / "trace.jsonl.gz", d / "inventory.jsonl"


def test_every_drain_follows_an_alert_and_its_checkpoint_ack_and_no_gpu_is_drained_twice(demo_trace):
    trace, inventory = demo_trace
    first = replay([trace], inventory=inventory)
    second = replay([trace], inventory=inventory)
    decisions = first.decisions()
    commands = [d for d in decisions if isinstance(d, Command)]
    drains = [c for c in commands if c.type == "drain"]
    assert drains, "the demo trace has failures that must be acted on"
    # Stable ids: a second replay decides exactly the same commands.
    assert [c.id for c in commands] == [c.id for c in second.decisions() if isinstance(c, Command)]
    alerts = {p.id: p for p in decisions if p.kind == "prediction" and p.alert}
    acks = [a for a in first.bus.records(T.ACKS.name) if isinstance(a, Ack)]
    done = {a.command_id: a.ts for a in acks if a.status == "done"}
    by_id = {c.id: c for c in commands}
    for drain in drains:
        evidence = [alerts[e] for e in drain.evidence if e in alerts]
        assert evidence and all((p.node, p.gpu) == (drain.node, drain.gpu) and p.ts <= drain.ts
                                for p in evidence), drain.id
        for req in drain.requires:  # a job's drain waits for its checkpoint's done ack
            assert by_id[req].type == "checkpoint" and done[req] <= drain.ts
        if drain.job:
            assert drain.requires
    gpus = [(d.node, d.gpu) for d in drains]
    assert len(gpus) == len(set(gpus))  # no GPU drained twice
    # Each drain of a job's GPU is followed by that job's resize.
    resized = {(c.node, c.gpu) for c in commands if c.type == "resize"}
    assert {(d.node, d.gpu) for d in drains if d.job} <= resized


def test_without_consumers_commands_expire_and_are_reported_not_retried(demo_trace):
    trace, inventory = demo_trace
    runtime = replay([trace], inventory=inventory, simulate_acks=False)
    commands = [d for d in runtime.decisions() if isinstance(d, Command)]
    assert not [c for c in commands if c.type == "drain" and c.job]  # no checkpoint ack, no drain
    expired = [e for e in runtime.audit_events() if e.event == "expired"]
    assert expired and {e.command_id for e in expired} <= {c.id for c in commands}
    # Re-decided, not retried: a later command for the same GPU has a new id.
    checkpoints = [c for c in commands if c.type == "checkpoint"]
    assert len({c.id for c in checkpoints}) == len(checkpoints)


def test_each_command_goes_to_the_consumers_that_carry_it_out():
    from fleetwise.streams.pipeline import command_topics

    def cmd(kind: str, job: str | None = "llm", **params) -> Command:
        return Command(id=f"{kind}-1", type=kind, ts=0.0, job=job, reason="r", params=params)

    train, kube = T.COMMANDS_TRAINING.name, T.COMMANDS_KUBE.name
    assert command_topics(cmd("rebalance")) == [train]
    assert command_topics(cmd("checkpoint")) == [train]
    assert command_topics(cmd("drain")) == [train, kube]  # the rank leaves; the node is cordoned
    assert command_topics(cmd("drain", job=None)) == [kube]
    assert command_topics(cmd("resize")) == [train, kube]  # process group and PodGroup gang
    assert [command_topics(cmd("migrate", phase=p)) for p in ("snapshot", "transfer", "restore")] == [
        [train], [kube], [train]]
    assert command_topics(cmd("consolidate", job=None, action="hibernate")) == [kube]


def test_a_replayed_pipeline_is_re_split_once_and_the_detector_follows_the_new_layers():
    # A 4-stage pipeline (plan: 3 layers each) whose stage 3 runs at half speed from step 60:
    # one rebalance with new stage boundaries, acked by the simulated plugin with its layers;
    # from then on the step records' compute follows the new layers, and with the detector
    # taught them by that ack nothing else is flagged (untaught, stage 0's extra layers would
    # read as a 25% slow rank).
    from fleetwise.actuators.config import PolicyConfig
    from fleetwise.schemas import Plan, Prediction, RankPlan, TrainingStep
    from fleetwise.streams.embedded import EmbeddedRuntime, SimulatedConsumers
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    plan = Plan(job="pp", dp=1, tp=1, pp=4, zero_stage=0, global_batch=32, seq_len=1, predicted_step_s=1.0,
                tokens_per_s=0.0, mfu=0.0,
                ranks=[RankPlan(rank=r, node=f"n{r}", gpu=0, model="h100-sxm", capability_tflops=1.0,
                                micro_batch=32, stage=r, layers=(3 * r, 3 * r + 2), dp_rank=0, memory_gb=10.0,
                                memory_capacity_gb=80.0) for r in range(4)])
    runtime = EmbeddedRuntime(ControlPlane(ControlPlaneConfig(policy=PolicyConfig(), failure_predictor=False,
                                                              publish_features=False)),
                              consumers=SimulatedConsumers())
    runtime.feed(T.PLANS.name, [plan])
    layers = [3, 3, 3, 3]
    rng = np.random.default_rng(0)
    for i in range(300):
        speed = [1, 1, 1, 0.5 if i >= 60 else 1]
        computes = [n * 0.1 / v * float(np.exp(rng.normal(0, 0.01)))
                    for n, v in zip(layers, speed, strict=True)]
        steps = [TrainingStep(ts=1_764_489_600.0 + 10.0 * i + 0.001 * r, job="pp", rank=r, node=f"n{r}",
                              gpu=0, step=i, step_time_s=max(computes) + 0.05, compute_s=c, samples=32,
                              model="h100-sxm")
                 for r, c in enumerate(computes)]
        runtime.feed(T.TELEMETRY_STEPS.name, steps)
        acked = [a for _k, a in runtime.bus.logs.get(T.ACKS.name, []) if a.result.get("layers")]
        if acked:  # the job runs the new boundaries from the next step on
            layers = [b - a + 1 for a, b in (acked[-1].result["layers"][str(s)] for s in range(4))]
    moves = [c for _k, c in runtime.bus.logs[T.COMMANDS_TRAINING.name] if c.type == "rebalance"]
    assert len(moves) == 1 and moves[0].params["stage_speed_factors"] == {"3": pytest.approx(0.5, abs=0.03)}
    assert sum(layers) == 12 and layers[3] < 3
    alerts = [p for _k, p in runtime.bus.logs[T.PREDICTIONS.name] if isinstance(p, Prediction) and p.alert]
    assert [(p.rank, round(p.factor, 1)) for p in alerts] == [(3, 0.5)]
