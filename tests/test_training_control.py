"""The training plugin's command consumer, step telemetry and transports.

Pure parts (the gate, share arithmetic, the bounded telemetry buffer, the file transport) are
tested in-process; the refusal of forged, expired, replayed and foreign commands is tested in a
real gloo group of separate processes, and once through a real Kafka broker.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import statistics
import threading
import time
import uuid
from pathlib import Path

import pytest

from fleetwise.actuators import Keyring, sign
from fleetwise.schemas import Ack, Command, TrainingStep
from fleetwise.schemas import topics as T
from fleetwise.training.control import CommandGate, scaled_shares
from fleetwise.training.telemetry import StepReporter
from fleetwise.training.transport import LocalTransport

KEY_SPEC = "ctl=control-test-secret-0123456789"
KEYS = Keyring.parse(KEY_SPEC)
NOW = 1_000.0


def _cmd(cid: str, type_: str = "rebalance", seq: int | None = 1, **kw) -> Command:
    base = dict(id=cid, type=type_, ts=NOW - 10, job="llm", reason="test", seq=seq, expires_ts=NOW + 600,
                params={"samples": {"0": 40, "1": 24}})
    base.update(kw)
    return Command(**base)


# ---- the gate --------------------------------------------------------------------------------
def test_read_logs_leaves_a_line_still_being_written_for_the_next_read(tmp_path) -> None:
    from fleetwise.training.example import read_logs

    log = tmp_path / "rank-node-0.jsonl"
    log.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "ids": [1, 2')  # rank 0 mid-write
    (tmp_path / "rank-node-1.jsonl").write_text('{"step": 0}\n')
    assert [r["step"] for r in read_logs(tmp_path)] == [0, 1, 0]
    log.write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "ids": [1, 2]}\n')
    assert [r["step"] for r in read_logs(tmp_path)] == [0, 1, 2, 0]


def test_gate_accepts_once_then_acks_duplicates_done_without_acting_again() -> None:
    gate = CommandGate("llm", KEYS)
    cmd = sign(_cmd("rb-1"), KEYS)
    assert gate.offer(cmd, NOW).status == "received"
    ready, _ = gate.due(NOW)
    assert [c.id for c in ready] == ["rb-1"]
    again = gate.offer(cmd, NOW)
    assert (again.status, again.detail, again.by) == ("done", "duplicate", "training-plugin")
    assert gate.due(NOW) == ([], [])


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: _cmd("u-1"), "unsigned"),
        (lambda: sign(_cmd("f-1"), KEYS).model_copy(update={"params": {"samples": {"0": 64, "1": 0}}}),
         "bad signature"),
        (lambda: sign(_cmd("f-2"), Keyring.parse("ctl=an-attackers-secret-000000")), "bad signature"),
        (lambda: sign(_cmd("e-1", expires_ts=NOW - 1), KEYS), "expired"),
        (lambda: sign(_cmd("o-1", job="other"), KEYS), "not 'llm'"),
        (lambda: sign(_cmd("c-1", type_="consolidate"), KEYS), "not the training plugin's"),
    ],
)
def test_gate_rejects_each_bad_command_naming_why_and_keeps_nothing(make, why: str) -> None:
    gate = CommandGate("llm", KEYS)
    ack = gate.offer(make(), NOW)
    assert ack.status == "rejected" and why in ack.detail
    assert gate.pending == [] and gate.accepted == {}


def test_gate_refuses_a_replayed_older_sequence_and_a_forgery_cannot_squat_an_id() -> None:
    gate = CommandGate("llm", KEYS)
    forged = sign(_cmd("rb-2", seq=2), KEYS).model_copy(update={"params": {"samples": {"0": 1, "1": 63}}})
    assert gate.offer(forged, NOW).status == "rejected"
    # The real command with that id is not taken for a duplicate of the forgery.
    assert gate.offer(sign(_cmd("rb-2", seq=2), KEYS), NOW).status == "received"
    replay = gate.offer(sign(_cmd("rb-old", seq=1), KEYS), NOW)
    assert replay.status == "rejected" and "out of sequence" in replay.detail


def test_gate_holds_a_drain_until_its_checkpoint_is_done_and_drops_it_when_it_expires() -> None:
    gate = CommandGate("llm", KEYS)
    drain = sign(_cmd("dr-1", "drain", seq=2, node="n1", gpu=0, params={}, requires=["ck-1"]), KEYS)
    assert gate.offer(drain, NOW).status == "received"
    assert gate.waiting and gate.due(NOW) == ([], [])
    gate.note_done(["ck-1"])  # e.g. a done ack seen on fleetwise.acks
    assert [c.id for c in gate.due(NOW)[0]] == ["dr-1"]
    late = sign(_cmd("dr-2", "drain", seq=3, node="n1", gpu=1, params={"requires_checkpoint": "ck-2"},
                     expires_ts=NOW + 5), KEYS)
    gate.offer(late, NOW)
    ready, acks = gate.due(NOW + 6)
    assert ready == [] and acks[0].status == "rejected" and "while waiting for ck-2" in acks[0].detail


def test_gate_state_round_trips_and_in_flight_commands_come_back_pending() -> None:
    gate = CommandGate("llm", KEYS)
    gate.offer(sign(_cmd("rb-1", seq=4), KEYS), NOW)
    gate.due(NOW)  # announced, not applied yet
    restored = CommandGate("llm", KEYS)
    restored.restore(json.loads(json.dumps(gate.state())))
    assert [c.id for c in restored.pending] == ["rb-1"] and restored.last_seq == 4
    assert restored.offer(sign(_cmd("rb-1", seq=4), KEYS), NOW).detail == "duplicate"


def test_speed_factors_rescale_plan_shares_and_keep_the_global_batch() -> None:
    assert scaled_shares([16, 16, 16, 16], {"3": 0.5}) == [19, 18, 18, 9]
    assert scaled_shares([16, 16, 16, 16], {"2": 0.5, "3": 0.5}) == [21, 21, 11, 11]
    assert scaled_shares([16, 16, 16, 16], {}) == [16, 16, 16, 16]
    assert sum(scaled_shares([30, 20, 14], {"0": 0.37, "2": 1.4})) == 64
    with pytest.raises(ValueError, match="ranks \\[7\\]"):
        scaled_shares([16, 16], {"7": 0.5})


# ---- telemetry ---------------------------------------------------------------------------------
def test_a_blocked_sink_never_slows_a_step_and_the_oldest_records_are_dropped_and_counted() -> None:
    release = threading.Event()
    got: list[TrainingStep] = []

    def sink(topic: str, key: str, record: TrainingStep) -> None:
        assert (topic, key) == (T.TELEMETRY_STEPS.name, "llm")
        release.wait(30)  # a broker that does not answer
        got.append(record)

    rep = StepReporter(sink, job="llm", rank=0, node="n0", model="NVIDIA H100 80GB HBM3", capacity=8)
    rep.outbox.interval_s = 0.001
    rep.record(0, 0.1, 0.08, samples=16)
    time.sleep(0.05)  # the thread has taken record 0 and is stuck in the sink
    t0 = time.perf_counter()
    for step in range(1, 201):
        rep.record(step, 0.1, 0.08, samples=16)
    per_record = (time.perf_counter() - t0) / 200
    assert per_record < 0.002, f"record() took {per_record * 1e3:.3f} ms with the sink blocked"
    assert rep.dropped == 200 - 8
    release.set()
    assert rep.close(10)
    assert [r.step for r in got] == [0, *range(193, 201)]  # the newest 8 survived
    assert got[-1].model == "NVIDIA H100 80GB HBM3" and got[-1].samples == 16


def test_a_failing_sink_is_counted_and_telemetry_goes_on() -> None:
    calls = []

    def sink(topic: str, key: str, record: TrainingStep) -> None:
        calls.append(record.step)
        if record.step == 1:
            raise ConnectionError("broker down")

    rep = StepReporter(sink, job="llm", rank=2, node="n2")
    for step in range(3):
        rep.record(step, 0.1, 0.05, samples=8)
    assert rep.close(5)
    assert calls == [0, 1, 2] and rep.outbox.errors == 1 and "broker down" in rep.outbox.last_error


# ---- the file transport -------------------------------------------------------------------------
def test_local_transport_filters_by_key_resumes_from_a_position_and_skips_half_lines(tmp_path: Path) -> None:
    bus = LocalTransport(tmp_path)
    a, b = sign(_cmd("a", seq=1), KEYS), sign(_cmd("b", seq=2, job="other"), KEYS)
    bus.publish(T.COMMANDS_TRAINING.name, "llm", a)
    bus.publish(T.COMMANDS_TRAINING.name, "other", b)
    assert [c.id for c in bus.poll(T.COMMANDS_TRAINING.name, "llm")] == ["a"]
    saved = bus.position(T.COMMANDS_TRAINING.name)
    with open(bus.path(T.COMMANDS_TRAINING.name), "a") as fh:
        fh.write('{"key":"llm","value":{"kind":"comm')  # a writer mid-line
    assert bus.poll(T.COMMANDS_TRAINING.name) == []
    later = LocalTransport(tmp_path)  # a restarted worker, from its checkpoint's position
    later.seek(T.COMMANDS_TRAINING.name, saved)
    assert later.poll(T.COMMANDS_TRAINING.name) == []
    with pytest.raises(KeyError, match="unknown topic"):
        bus.publish("fleetwise.nope", "x", a)


# ---- in a real gloo group -----------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_group(tmp: Path, args: list[str], send, *, job: str, world: int = 2, timeout: float = 150):
    """Start `world` ranks of the example; `send(bus, rows)` publishes commands as the run goes."""
    pytest.importorskip("torch")
    from fleetwise.training.example import launch, read_logs

    log_dir = tmp / "logs"
    procs = launch(world, ["--job", job, "--log-dir", str(log_dir), *args], port=_port(),
                   env={"FLEETWISE_SIGNING_KEYS": KEY_SPEC})
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the group did not finish in time"
            send(read_logs(log_dir) if log_dir.exists() else [])
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * world
    return read_logs(log_dir)


@pytest.mark.timeout(200)
def test_forged_expired_replayed_and_foreign_commands_change_nothing_in_a_gloo_group(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from fleetwise.training.example import reference_losses, trajectory

    steps, bus = 24, LocalTransport(tmp_path / "bus")
    now = time.time()

    def signed(cid: str, seq: int, **kw) -> Command:
        base = dict(id=cid, type="rebalance", ts=now, job="llm", reason="t", seq=seq, expires_ts=now + 600,
                    params={"samples": {"0": 36, "1": 12}, "global_samples": 48})
        base.update(kw)
        return sign(Command(**base), KEYS)

    good = signed("rb-good", 5)
    bad = [
        signed("rb-forged", 6).model_copy(update={"params": {"samples": {"0": 1, "1": 47}}}),
        signed("rb-expired", 7, expires_ts=now - 60),
        signed("ck-forged", 8, type="checkpoint", params={"checkpoint_uri": str(tmp_path / "stolen")})
        .model_copy(update={"signature": "hmac-sha256:" + "0" * 64}),
        signed("rb-foreign", 9, job="another-job"),
        Command(id="rb-unsigned", type="rebalance", ts=now, job="llm", reason="t", seq=10,
                params={"samples": {"0": 2, "1": 46}}),
    ]
    late = [good, signed("rb-replayed", 4, params={"samples": {"0": 6, "1": 42}, "global_samples": 48})]
    sent: set[str] = set()

    def send(rows: list[dict]) -> None:
        done = max((r["step"] for r in rows), default=-1)
        if done >= 2 and "bad" not in sent:
            sent.add("bad")
            for c in bad:
                bus.publish(T.COMMANDS_TRAINING.name, "llm", c)
        if done >= 8 and "good" not in sent:
            sent.add("good")
            bus.publish(T.COMMANDS_TRAINING.name, "llm", good)
        if done >= 14 and "late" not in sent:
            sent.add("late")
            for c in late:
                bus.publish(T.COMMANDS_TRAINING.name, "llm", c)

    rows = _run_group(tmp_path, ["--steps", str(steps), "--shares", "24,24", "--bus-dir",
                                 str(tmp_path / "bus"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                                 "--step-delay", "0.1", "--num-samples", "2048"], send, job="llm")
    acks: list[Ack] = bus.poll(T.ACKS.name, "llm")
    status = {(a.command_id, a.status): a for a in acks}
    reasons = ["bad signature", "expired", "bad signature", "not 'llm'", "unsigned"]
    for c, why in zip(bad, reasons, strict=True):
        assert why in status[c.id, "rejected"].detail, (c.id, status.get((c.id, "rejected")))
        assert not [a for a in acks if a.command_id == c.id and a.status != "rejected"]
    assert "out of sequence" in status["rb-replayed", "rejected"].detail
    good_acks = [(a.status, a.detail) for a in acks if a.command_id == "rb-good"]
    assert good_acks == [("received", None), ("done", None), ("done", "duplicate")]  # resent: no effect
    applied = [a for a in acks if a.command_id == "rb-good" and a.status == "done" and a.detail is None]
    assert applied[0].result["samples"] == {"0": 36, "1": 12}
    assert all(a.by == "training-plugin" for a in acks)
    # Shares: 24/24 until the good command's step, 36/12 from it on; nothing else ever.
    at = applied[0].step
    shares = {r["step"]: r["shares"] for r in rows}
    assert all(shares[s] == [24, 24] for s in range(at))
    assert all(shares[s] == [36, 12] for s in range(at, steps))
    assert not (tmp_path / "stolen").exists() and not (tmp_path / "ckpt").exists()
    losses, _ = trajectory(rows)
    expected = reference_losses(steps, 2048, 48)
    assert all(abs(g - w) <= 1e-9 * abs(w) for g, w in zip(losses, expected, strict=True))


@pytest.mark.timeout(300)
def test_a_rebalance_moves_pipeline_stage_boundaries_in_the_running_job_and_a_restart_keeps_them(
        tmp_path: Path) -> None:
    # Two pipeline stages of a 4-layer model (0-1 | 2-3). A rebalance with a gap in its layers
    # fails and changes nothing; the good one moves layer 1 to the second stage at a step
    # boundary, in the running processes (checkpoint, rebuild, resharded load). The loss
    # trajectory is the whole model's on one process, before, after, and across a restart
    # from the last checkpoint (which builds the stages as the re-split left them).
    pytest.importorskip("torch")
    from fleetwise.training.example import reference_losses, trajectory

    bus, now = LocalTransport(tmp_path / "bus"), time.time()

    def rebalance(cid: str, seq: int, layers: dict) -> Command:
        return sign(Command(id=cid, type="rebalance", ts=now, job="pp", reason="t", seq=seq,
                            expires_ts=now + 600, params={"layers": layers}), KEYS)

    gap = rebalance("rb-gap", 1, {"0": [0, 0], "1": [2, 3]})
    split = rebalance("rb-split", 2, {"0": [0, 0], "1": [1, 3]})
    sent: set[str] = set()

    def send(rows: list[dict]) -> None:
        done = max((r["step"] for r in rows), default=-1)
        for at, c in ((2, gap), (5, split)):
            if done >= at and c.id not in sent:
                sent.add(c.id)
                bus.publish(T.COMMANDS_TRAINING.name, "pp", c)

    args = ["--pipeline-layers", "4", "--shares", "24,24", "--bus-dir", str(tmp_path / "bus"),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "4", "--step-delay", "0.05",
            "--num-samples", "2048"]
    first = _run_group(tmp_path, ["--steps", "12", *args], send, job="pp")
    acks = {(a.command_id, a.status): a for a in bus.poll(T.ACKS.name, "pp")}
    assert "stage 1 holds layers 2-3" in acks["rb-gap", "failed"].detail
    done = acks["rb-split", "done"]
    assert done.result["layers"] == {"0": [0, 0], "1": [1, 3]}
    assert done.result["checkpoint_uri"].startswith("file:")
    at = done.step
    assert 5 <= at < 12
    spans = {(r["step"], r["rank"]): r["layers"] for r in first}
    assert all(spans[s, 0] == [0, 1] and spans[s, 1] == [2, 3] for s in range(at))
    assert all(spans[s, 0] == [0, 0] and spans[s, 1] == [1, 3] for s in range(at, 12))
    # a new group (the same command line: an even split) resumes from the step-12 checkpoint
    rows = first + _run_group(tmp_path, ["--steps", "16", *args], lambda rows: None, job="pp")
    assert {tuple(r["layers"]) for r in rows if r["step"] >= 12 and r["rank"] == 0} == {(0, 0)}
    losses, ids = trajectory(rows)
    expected = reference_losses(16, 2048, 48, pipeline_layers=4)
    assert len(losses) == 16 and all(len(ids[s]) == 48 for s in range(16))
    assert all(abs(g - w) <= 1e-9 * abs(w) for g, w in zip(losses, expected, strict=True))


@pytest.mark.timeout(300)
def test_the_control_plane_re_splits_a_pipeline_whose_stage_slowed_down(tmp_path: Path) -> None:
    # Closed loop: four stages of a 12-layer pipeline (3 layers each), the embedded control
    # plane on their step records with the job's plan. Stage 3 runs at half speed from step 10: the
    # detector flags it, the policy moves layers to stage 0, the plugin re-splits the running
    # job, and the step gets faster; the detector, taught the new layers by the ack, sees the
    # same speeds, so nothing is moved again.
    pytest.importorskip("torch")
    from fleetwise.training.example import read_logs, reference_losses, run_job, trajectory

    got = run_job(tmp_path, "pp", [4, 4, 4, 4], 70, 0.001, ["node-3:2.0@10"], control=True,
                  pipeline_layers=12)
    moves = [c for c in got["commands"] if c.type == "rebalance"]
    assert len(moves) == 1 and set(moves[0].params) >= {"layers", "stage_speed_factors", "predicted_gain"}
    layers = moves[0].params["layers"]
    spans = [layers[str(s)] for s in range(4)]
    assert spans[0][0] == 0 and spans[3][1] == 11
    assert all(spans[i][1] + 1 == spans[i + 1][0] for i in range(3))  # contiguous
    assert spans[3][1] - spans[3][0] + 1 < 3  # the slow stage gave layers away
    assert moves[0].params["stage_speed_factors"] == {"3": pytest.approx(0.5, abs=0.05)}
    done = [a for a in got["acks"] if a.command_id == moves[0].id and a.status == "done"]
    assert len(done) == 1 and done[0].result["layers"] == layers
    at, st = done[0].step, got["step_time"]
    slowed, after = statistics.median(st[10:at]), statistics.median(st[at + 2:])  # slow from step 10
    assert after < 0.9 * slowed, (slowed, after)
    losses, _ = trajectory(read_logs(tmp_path / "pp" / "logs"))
    expected = reference_losses(70, 65536, 16, pipeline_layers=12)
    assert all(abs(g - w) <= 1e-9 * abs(w) for g, w in zip(losses, expected, strict=True))


# ---- through a real broker ----------------------------------------------------------------------
@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_signed_command_on_kafka_reaches_the_plugin_and_its_acks_come_back(kafka_bootstrap: str,
                                                                            tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from fleetwise.streams.kafka_io import consume_until, produce_records
    from tests.kafka_broker import create_topic, delete_topics

    prefix = f"t{os.getpid()}-{uuid.uuid4().hex[:8]}."
    names = [prefix + t.name for t in (T.COMMANDS_TRAINING, T.ACKS, T.TELEMETRY_STEPS)]

    async def setup() -> None:
        for name in names:
            await create_topic(kafka_bootstrap, name, partitions=2)

    asyncio.run(setup())
    now = time.time()
    cmd = sign(Command(id="rb-kafka", type="rebalance", ts=now, job="kjob", reason="t", seq=1,
                       expires_ts=now + 600, params={"speed_factors": {"1": 0.5}}), KEYS)
    sent: list[bool] = []

    def send(rows: list[dict]) -> None:
        if not sent and max((r["step"] for r in rows), default=-1) >= 2:
            sent.append(True)
            topic = prefix + T.COMMANDS_TRAINING.name
            asyncio.run(produce_records(kafka_bootstrap, topic, [cmd], key="kjob"))

    try:
        args = ["--steps", "20", "--shares", "16,16", "--kafka", kafka_bootstrap, "--kafka-prefix", prefix,
                "--step-delay", "0.15", "--model-name", "H100"]
        rows = _run_group(tmp_path, args, send, job="kjob", timeout=240)

        def acked(msgs) -> bool:
            return any(m.json()["command_id"] == "rb-kafka" and m.json()["status"] == "done" for m in msgs)

        acks = asyncio.run(consume_until(kafka_bootstrap, [prefix + T.ACKS.name], until=acked, timeout_s=30))
        steps = asyncio.run(consume_until(kafka_bootstrap, [prefix + T.TELEMETRY_STEPS.name],
                                          until=lambda m: len(m) >= 40, timeout_s=30))
    finally:
        asyncio.run(delete_topics(kafka_bootstrap, names))
    got = [Ack.model_validate(m.json()) for m in acks]
    assert [a.status for a in got if a.command_id == "rb-kafka"] == ["received", "done"]
    done = next(a for a in got if a.status == "done")
    assert done.result["samples"] == {"0": 21, "1": 11} and {m.key for m in acks} == {"kjob"}
    assert {r["step"]: r["shares"] for r in rows}[19] == [21, 11]
    records = [TrainingStep.model_validate(m.json()) for m in steps]
    assert {(r.rank, r.step) for r in records} == {(r, s) for r in (0, 1) for s in range(20)}
    assert all(r.model == "H100" and r.samples in (16, 21, 11) and r.compute_s > 0 for r in records)


# ---- one process, world size 1: the plugin's handlers --------------------------------------------
@pytest.fixture()
def solo_group(tmp_path: Path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield torch
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_plugin_handlers_in_a_one_rank_group(solo_group, tmp_path: Path) -> None:
    from fleetwise.training.control import TrainingPlugin
    from fleetwise.training.example import make_model
    from fleetwise.training.sampler import ShareSampler

    torch = solo_group
    bus = LocalTransport(tmp_path / "bus")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = ShareSampler(1000, [10], 0)
    plugin = TrainingPlugin(job="solo", model=model, optimizer=opt, sampler=sampler, transport=bus,
                            checkpoint_dir=tmp_path / "ckpt", keys=KEYS, node="n0", model_name="H100")

    def run(*commands: Command, steps: int = 2) -> list[Ack]:
        for c in commands:
            bus.publish(T.COMMANDS_TRAINING.name, "solo", sign(c, KEYS))
        for _ in range(steps):
            next(iter(sampler))
            plugin.end_step(samples=10)
        plugin.acks.flush()
        return [a for a in bus.poll(T.ACKS.name, "solo") if a.status != "received"]

    now = time.time()
    base = dict(ts=now, job="solo", reason="t", expires_ts=now + 600)
    acks = run(Command(id="rb-bad", type="rebalance", seq=1, params={"speed_factors": {"3": 0.5}}, **base))
    assert acks[0].status == "failed" and "ranks [3]" in acks[0].detail and plugin.shares == [10]
    acks = run(Command(id="ck", type="checkpoint", seq=2, params={"before": "drain"}, **base))
    assert acks[0].status == "done" and acks[0].result["step"] == acks[0].step
    assert (Path(acks[0].result["checkpoint_uri"][len("file://"):]) / "fleetwise.json").is_file()
    # A resize to the same members (a re-plan after a drain the job already did): new shares only.
    acks = run(Command(id="rs", type="resize", seq=3, params={"world_size": 1, "samples": {"0": 12}}, **base))
    assert acks[0].detail == "same members: new shares applied" and plugin.shares == [12]
    assert acks[0].step is not None and sampler.shares_at(acks[0].step) == [12]
    # A re-plan counting GPUs of a tensor-parallel replica: refused, the reason named.
    acks = run(Command(id="rs-tp", type="resize", seq=4, params={
        "world_size": 2, "strategy": {"dp": 1, "tp": 2, "pp": 1}, "samples": {"0": 12}}, **base))
    assert acks[0].status == "failed" and "tp 2 x pp 1 per data-parallel replica" in acks[0].detail
    assert plugin.shares == [12]
    with pytest.raises(SystemExit) as stop:
        run(Command(id="mg", type="migrate", seq=5,
                    params={"phase": "snapshot", "checkpoint_uri": str(tmp_path / "moved")}, **base))
    assert stop.value.code == 0 and (tmp_path / "moved" / "fleetwise.json").is_file()
    records = bus.poll(T.TELEMETRY_STEPS.name, "solo")
    assert [r.step for r in records] == list(range(len(records))) and all(r.model == "H100" for r in records)


@pytest.mark.timeout(60)
def test_a_migration_snapshot_in_the_job_s_store_is_where_the_moved_job_resumes(
        solo_group, tmp_path: Path) -> None:
    # The policy names a migration's checkpoint in the job's own store (it cannot know where each
    # job keeps its checkpoints); the moved job's new pods find it as their newest checkpoint, and
    # the migration's restore phase then loads nothing twice.
    from fleetwise.training import elastic
    from fleetwise.training.control import TrainingPlugin
    from fleetwise.training.example import make_model
    from fleetwise.training.sampler import ShareSampler

    torch = solo_group
    bus = LocalTransport(tmp_path / "bus")

    def plugin(ckpt: Path) -> TrainingPlugin:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return TrainingPlugin(job="mv", model=model, optimizer=opt, sampler=ShareSampler(1000, [10], 0),
                              transport=bus, checkpoint_dir=ckpt, keys=KEYS, node="n0", model_name="H100")

    old = plugin(tmp_path / "ckpt")
    for _ in range(3):
        old.end_step(samples=10)
    old.checkpoint()  # a periodic one at step 3
    old.end_step(samples=10)
    where = old.checkpoint("fleetwise://checkpoints/mv/migrate-1700000000")
    assert where == (tmp_path / "ckpt" / "migrate-1700000000").resolve().as_uri()
    assert elastic.latest_checkpoint(tmp_path / "ckpt").name == "migrate-1700000000"  # step 4 > 3
    for uri, message in (("fleetwise://checkpoints/other/migrate-1", "job 'other''s store, not 'mv''s"),
                         ("fleetwise://checkpoints/mv/../x", "expected fleetwise://checkpoints/<job>/<name>"),
                         ("s3://bucket/x", "only file:// URIs and paths")):
        with pytest.raises(ValueError, match=re.escape(message)):
            elastic.resolve_checkpoint_uri(uri, job="mv", root=tmp_path / "ckpt")
    now = time.time()
    snapshot = "fleetwise://checkpoints/mv/migrate-1700000000"
    restore = Command(id="mv-restore", type="migrate", seq=1, ts=now, job="mv", reason="t",
                      expires_ts=now + 600, params={"phase": "restore", "checkpoint_uri": snapshot})
    # The new pods' group starts from its newest checkpoint: the snapshot.
    moved = plugin(tmp_path / "ckpt")
    assert moved.restore() == 4 and moved.resumed_step == 4
    bus.publish(T.COMMANDS_TRAINING.name, "mv", sign(restore, KEYS))
    for _ in range(3):
        moved.end_step(samples=10)
    moved.acks.flush()
    (ack,) = [a for a in bus.poll(T.ACKS.name, "mv") if a.command_id == "mv-restore" and a.status == "done"]
    assert "already resumed from step 4" in ack.detail and moved.step == 7  # nothing rolled back
    # A group that did not start from it (another store, where the name finds nothing) fails
    # the command with the reason; given the snapshot's own URI, it loads it.
    fresh = plugin(tmp_path / "elsewhere")
    assert fresh.restore() == 0 and fresh.resumed_step is None
    fresh._apply(restore.model_copy(update={"id": "mv-restore-2"}))
    fresh.acks.flush()
    (ack,) = [a for a in bus.poll(T.ACKS.name, "mv") if a.command_id == "mv-restore-2"]
    assert ack.status == "failed" and "no complete checkpoint at" in ack.detail and fresh.step == 0
    fresh._apply(restore.model_copy(update={"id": "mv-restore-3", "params": {
        "phase": "restore", "checkpoint_uri": where}}))
    assert fresh.step == 4 and fresh.resumed_step == 4


@pytest.mark.timeout(60)
def test_checkpoints_written_before_the_per_name_optimizer_state_still_load(
        solo_group, tmp_path: Path) -> None:
    # Optimizer state is saved flattened per parameter name since pipeline re-splits; a
    # checkpoint of the older layout (param groups as a list) is recognised and loads as before.
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fleetwise.training import elastic
    from fleetwise.training.example import make_model

    torch = solo_group
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    old, new = tmp_path / "old", tmp_path / "new"
    model_sd, optim_sd = get_state_dict(model, opt)  # the older layout
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(old))
    (old / elastic.META_FILE).write_text('{"step": 1}')
    elastic.save_checkpoint(new, model, opt, {"step": 1})
    for path in (old, new):
        again = make_model(seed=5)
        opt2 = torch.optim.SGD(again.parameters(), lr=0.5, momentum=0.9)
        assert elastic.load_checkpoint(path, again, opt2) == {"step": 1}
        assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))
        assert (opt2.param_groups[0]["lr"], opt2.param_groups[0]["momentum"]) == (0.1, 0.9)
        buffers = [opt2.state[p]["momentum_buffer"] for p in again.parameters()]
        assert all(torch.equal(a, opt.state[b]["momentum_buffer"])
                   for a, b in zip(buffers, model.parameters(), strict=True))


@pytest.mark.timeout(60)
def test_a_pipeline_restore_under_other_boundaries_without_rebuild_names_the_problem(
        solo_group, tmp_path: Path) -> None:
    from fleetwise.training.control import TrainingPlugin
    from fleetwise.training.example import make_stage
    from fleetwise.training.sampler import ShareSampler

    torch = solo_group
    stage = make_stage(0, 3, 4)
    opt = torch.optim.SGD(stage.parameters(), lr=0.1)

    def plugin(layers: tuple[int, int], rebuild=None) -> TrainingPlugin:
        return TrainingPlugin(job="pp", model=stage, optimizer=opt, sampler=ShareSampler(100, [10], 0),
                              transport=LocalTransport(tmp_path / "bus"), checkpoint_dir=tmp_path / "ckpt",
                              keys=KEYS, node="n0", model_name="H100", stage=0, layers=layers,
                              rebuild=rebuild)

    plugin((0, 3)).checkpoint()
    with pytest.raises(ValueError, match=r"saved with stage layers \{'0': \[0, 3\]\}.*no rebuild callback"):
        plugin((0, 2)).restore()
    built = []
    restored = plugin((0, 2), rebuild=lambda span, layout: built.append((span, layout)) or (stage, opt))
    assert restored.restore() == 0 and built == [((0, 3), {0: (0, 3)})] and restored.layers == (0, 3)
