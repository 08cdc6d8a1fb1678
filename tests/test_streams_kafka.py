"""Integration: node batches -> real Kafka -> `fleetwise worker` (faust, subprocess) -> features.

Every test uses its own topic prefix and app id, so tests never share topics, consumer groups
or changelogs. The expected outputs are never written down here: they come from the embedded
runtime (`EmbeddedRuntime`, no Kafka) fed the same bytes, so the tests show that the Kafka
path and the embedded path agree, including on bad input.

The first tests (no broker) drive the worker's `StreamProcessor` directly with stand-in
events and table, to check its state checkpoints: a worker restored from them, and fed the
re-delivered messages a crash leaves behind, ends in the same state with the same outputs as
one that never stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
from aiokafka import TopicPartition

from fleetwise.schemas import topics as T
from fleetwise.streams.app import (
    STATE_BUCKETS,
    BatchConsumer,
    StreamProcessor,
    decode_entry,
    state_partition,
)
from fleetwise.streams.embedded import EmbeddedRuntime
from fleetwise.streams.kafka_io import (
    Consumed,
    ConsumeTimeout,
    consume_until,
    ensure_topics,
    produce_records,
    topic_name,
)
from tests.kafka_broker import KAFKA_SH

REPO = Path(__file__).resolve().parents[1]
MODEL = "NVIDIA H100 80GB HBM3"
START_TS = 1_764_489_600.0  # 2025-11-30T08:00:00Z, a hop boundary for 600 s hops
TICK_S = 10.0


# --------------------------------------------------------------------------- inputs
def node_batches(nodes: int, gpus: int, ticks: int, *, seed: int, start_tick: int = 0) -> list[dict]:
    """Seeded node batches: temperatures, power, clocks, utilisation and slowly rising
    counters, one batch per node per tick, in tick order (as agents would publish them).
    GPU 0 of every fourth node has a degrading NVLink (errors every tick after tick 20), so
    its node peers' context is not all zeros."""
    rng = np.random.default_rng(seed)
    out = []
    sbe = np.zeros((nodes, gpus))
    nvl = np.zeros((nodes, gpus))
    for tick in range(ticks):
        ts = START_TS + (start_tick + tick) * TICK_S
        sbe += rng.poisson(0.05, size=(nodes, gpus))
        nvl += rng.poisson(0.002, size=(nodes, gpus))
        if start_tick + tick >= 20:
            nvl[::4, 0] += rng.poisson(2.0, size=len(nvl[::4, 0])) + 1
        for n in range(nodes):
            samples = []
            for g in range(gpus):
                power = float(rng.normal(550, 40))
                samples.append({
                    "ts": ts, "node": f"node-{n:03d}", "gpu": g, "uuid": f"GPU-{n:03d}-{g}",
                    "model": MODEL, "rack": f"rack-{n % 2}",
                    "metrics": {
                        "DCGM_FI_DEV_GPU_TEMP": round(45 + power / 20 + float(rng.normal(0, 1)), 1),
                        "DCGM_FI_DEV_POWER_USAGE": round(power, 1),
                        "DCGM_FI_DEV_SM_CLOCK": 1980.0,
                        "DCGM_FI_DEV_GPU_UTIL": float(rng.integers(85, 100)),
                        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": float(sbe[n, g]),
                        "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": float(nvl[n, g]),
                    },
                })
            out.append({"ts": ts, "node": f"node-{n:03d}", "samples": samples})
    return out


def encode(batch: dict) -> bytes:
    return json.dumps(batch, separators=(",", ":")).encode()


def bad_inputs(batches: list[dict]) -> list[bytes]:
    """The issue's bad records, each next to good ones: not JSON, a NaN literal, an unknown
    model, a duplicate sample and an out-of-order sample (both inside the open hop)."""
    base = batches[5]
    nan = json.loads(json.dumps(base))
    nan["samples"][1]["metrics"]["DCGM_FI_DEV_GPU_TEMP"] = math.nan  # json.dumps writes NaN
    unknown = json.loads(json.dumps(base))
    unknown["samples"][2]["model"] = "NVIDIA Imaginary X9000"
    for s in unknown["samples"]:
        s["ts"] += 1.0
    unknown["ts"] += 1.0
    return [
        b'{"ts": 1764489600, "node": "node-000", "samples": [',  # truncated: not JSON
        encode(nan),  # NaN in the second sample
        encode(unknown),
        encode(base),  # an exact duplicate of an earlier batch
        encode({**batches[3], "samples": [dict(s, ts=s["ts"] + 5.0) for s in batches[3]["samples"]]}),
    ]


def sim_messages(seed: int) -> list[tuple[str, bytes]]:
    """(registry topic, bytes) from the fleet simulator, in its event-time order: one node batch
    per node per tick on the telemetry topic, one message per rank step on the steps topic.
    Rates are raised so a few hours hold stragglers."""
    from fleetwise.sim.config import SimConfig
    from fleetwise.sim.simulator import FleetSimulator

    sim = FleetSimulator(SimConfig(gpus="h100-sxm:16,a100-sxm-80gb:8", days=0.25, seed=seed,
                                   sample_interval_s=60.0, straggler_rate_per_1000_gpu_days=400.0))
    out: list[tuple[str, bytes]] = []
    for tick in sim.ticks():
        by_node: dict[str, list[dict]] = {}
        for sample in tick.samples:
            by_node.setdefault(sample["node"], []).append(sample)
        for node, samples in by_node.items():
            out.append((T.TELEMETRY_GPU.name, encode({"ts": tick.ts, "node": node, "samples": samples})))
        out.extend((T.TELEMETRY_STEPS.name, encode(step)) for step in tick.steps)
    return out


# --------------------------------------------------------------------------- worker process
class Worker:
    """`python -m fleetwise.cli worker` in a subprocess, with its own metrics port."""

    def __init__(self, bootstrap: str, prefix: str, app_id: str, log: Path,
                 args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> None:
        self.bootstrap, self.prefix, self.app_id, self.log_path = bootstrap, prefix, app_id, log
        self.args, self.env = list(args), dict(env or {})  # more worker options, environment
        self.metrics_port = _free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Worker:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.env)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwise.cli", "worker", "--bootstrap", self.bootstrap,
             "--app-id", self.app_id, "--topic-prefix", self.prefix,
             "--metrics-port", str(self.metrics_port), "--checkpoint-interval", "1",
             "--loglevel", os.environ.get("FLEETWISE_TEST_LOGLEVEL", "info"), *self.args],
            cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )
        return self

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples matching `labels` from the worker's /metrics."""
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        total = 0.0
        for line in text.decode().splitlines():
            if not line.startswith(name) or line.startswith("#"):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()) and head.split("{")[0] == name:
                total += float(value)
        return total

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        self.proc = None

    def check_alive(self) -> bool:
        """True while running; a worker that died fails the test at once, with its log."""
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
        return True

    def log_tail(self) -> str:
        """The worker's log lines that tell a failure's story (warnings, errors, group
        generations, assignments, recoveries, seeks), without faust's tables, last 6,000 chars."""
        keep: list[str] = []
        # A warning repeated every few seconds (a stalled recovery's) would fill the tail and
        # push out the lines that tell how it began: kept once, with a count at the end.
        repeats: Counter[str] = Counter()
        for line in self.log_path.read_text(errors="replace").splitlines():
            if not (_ASSIGNMENT_ROW.match(line) or line.startswith("[") and (
                    "[WARNING]" in line or "[ERROR]" in line or "Traceback" in line
                    or any(w in line for w in _TELLING_INFO))):
                continue
            if "[WARNING]" in line:
                text = _REPEAT_NOISE.sub("", line)
                repeats[text] += 1
                if repeats[text] > 1:
                    continue
            keep.append(line)
        keep += [f"(repeated {n - 1} more times) {text}" for text, n in repeats.items() if n > 1]
        return f"--- {self.log_path.name}\n" + "\n".join(keep)[-6000:]

    def report(self) -> str:
        """The worker's own view for a failure message: partitions held, messages read and lag
        per partition, re-deliveries skipped (its /metrics, or why they could not be read)."""
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read()
        except OSError as exc:
            return f"--- {self.log_path.name}: no /metrics ({exc})"
        names = ("fleetwise_assigned_partitions", "fleetwise_messages_in_total",
                 "fleetwise_consumer_lag_messages", "fleetwise_redelivered_skipped_total")
        lines = [line for line in text.decode().splitlines() if line.startswith(names)]
        return f"--- {self.log_path.name} metrics\n" + "\n".join(lines)


_TELLING_INFO = ("generation", "assigned partitions", "Revoking", "Recovery", "restored partition",
                 "seeking back", "Seek", "Resuming", "Pausing")
# a log line's time stamp and the age in a recurring "(started N seconds / minute ago)"
_REPEAT_NOISE = re.compile(r"^\[[^]]*\] \[\d+\] |\(started [\d.]+ \w+ ago\)")
_ASSIGNMENT_ROW = re.compile(r"^\| \S+\.fleetwise\.telemetry\.gpu +\| \{")  # faust's assignment table


def explain_missing(got: list[Consumed], expected: set[str], workers: list[Worker]) -> str:
    """Which expected feature records never came, by node and by the telemetry partition the
    node's batches went to, and each worker's metrics and telling log lines."""
    have = ids(got)
    missing = [json.loads(t) for t in expected if record_id(json.loads(t)) not in have]
    by_node: dict[str, list[float]] = defaultdict(list)
    for d in missing:
        by_node[d["node"]].append(d["ts"])
    where = [f"{node} (partition {state_partition(node, T.TELEMETRY_GPU.partitions)}): "
             f"{len(ts)} missing, window ends {min(ts)}..{max(ts)}" for node, ts in sorted(by_node.items())]
    return "\n".join([f"{len(missing)} of {len(expected)} expected feature records missing", *where,
                      *(w.report() for w in workers), *(w.log_tail() for w in workers)])


async def assert_features_like_embedded(bootstrap: str, prefix: str, expected: set[str],
                                        workers: list[Worker], timeout_s: float) -> None:
    """Read the features topic until it holds every expected record (failing with what is
    missing and why, see `explain_missing`), a little longer for late duplicates, and compare."""
    features_topic = topic_name(T.FEATURES, prefix)
    try:
        got = await consume_until(bootstrap, [features_topic], timeout_s=timeout_s,
                                  until=lambda ms: all(w.check_alive() for w in workers)
                                  and len(ids(ms)) >= len(expected))
    except ConsumeTimeout as exc:
        pytest.fail(f"{exc}\n{explain_missing(exc.messages, expected, workers)}")
    got += await consume_until(bootstrap, [features_topic], timeout_s=2, from_beginning=False)
    assert not differences(as_set(got), expected), differences(as_set(got), expected)


def wait_for_metric(worker: Worker, name: str, at_least: float, timeout_s: float = 90, **labels: str) -> None:
    """Until the worker's metric reaches `at_least` (its /metrics may not be up yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if worker.metric(name, **labels) >= at_least:
                return
        except OSError:
            pass
        assert worker.check_alive() and time.monotonic() < deadline, \
            f"{name} < {at_least}\n{worker.log_tail()}"
        time.sleep(0.2)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def namespace(kafka_bootstrap: str, tmp_path: Path):
    """A fresh topic prefix (all registry topics created) and app id for one test."""
    tag = uuid.uuid4().hex[:8]
    prefix = f"t{tag}."
    import asyncio

    asyncio.run(ensure_topics(kafka_bootstrap, prefix=prefix))
    workers: list[Worker] = []

    def new_worker(*args: str, env: Mapping[str, str] | None = None) -> Worker:
        w = Worker(kafka_bootstrap, prefix, f"fw-test-{tag}", tmp_path / f"worker{len(workers)}.log",
                   args, env)
        workers.append(w)
        return w

    yield prefix, new_worker
    for w in workers:
        w.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- helpers
def embedded_outputs(messages: Iterable[bytes | tuple[str, bytes]]) -> dict[str, set[str]]:
    """What the embedded runtime routes for the same message bytes (no flush: a live worker
    never closes a window without a later sample). Plain bytes are telemetry messages."""
    runtime = EmbeddedRuntime()
    for i, item in enumerate(messages):
        topic, raw = item if isinstance(item, tuple) else (T.TELEMETRY_GPU.name, item)
        runtime.feed(topic, runtime.control.decode(topic, raw, source=f"msg:{i}"))
    return {topic: {canonical_text(r.to_json()) for _key, r in runtime.bus.logs[topic]}
            for topic in runtime.bus.logs}


# Floating-point sums depend on how samples are grouped into batches (the worker's
# stream.take batches are not the embedded runtime's chunks), so records are compared with
# floats rounded to 10 significant digits: far below any feature's meaningful precision, far
# above the last-ulp differences of a different summation order.
SIGNIFICANT_DIGITS = 10


def canonical(value: object) -> object:
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, dict):
        return {k: canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [canonical(v) for v in value]
    return value


def canonical_text(text: str | bytes) -> str:
    return json.dumps(canonical(json.loads(text)), sort_keys=True)


def as_set(messages: list[Consumed]) -> set[str]:
    """Kafka values as canonical JSON text (see `canonical`)."""
    return {canonical_text(m.value) for m in messages}


def record_id(d: dict) -> tuple:
    """What identifies one output record (one per key and window end / prediction id)."""
    return (d.get("kind"), d.get("scope"), d.get("type"), d.get("id") or "", d.get("node") or "",
            d.get("gpu", -1), d.get("job") or "", d.get("rank", -1), d.get("ts"))


def close(a: object, b: object) -> bool:
    """Equal, with floats compared to 1e-6 relative (1e-9 absolute): sums and differences
    of floats depend on batch grouping in their last bits (see SIGNIFICANT_DIGITS)."""
    if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def differences(got: set[str], want: set[str], limit: int = 5) -> str:
    """'' when both hold the same records (floats within `close`; a record re-emitted after a
    restart counts once if it matches), else what differs."""
    g: dict[tuple, list[dict]] = {}
    for d in map(json.loads, got):
        g.setdefault(record_id(d), []).append(d)
    w = {record_id(d): d for d in map(json.loads, want)}
    lines = []
    if len(w) != len(want):
        lines.append(f"the reference has {len(want)} records for {len(w)} ids")
    if set(g) != set(w):
        lines.append(f"only on Kafka: {sorted(set(g) - set(w), key=str)[:limit]}")
        lines.append(f"only embedded: {sorted(set(w) - set(g), key=str)[:limit]}")
    for k in sorted(set(g) & set(w), key=str):
        for d in g[k]:
            if not close(d, w[k]):
                gv, wv = d.get("values", d), w[k].get("values", w[k])
                bad = {n: (gv.get(n), v) for n, v in wv.items() if not close(gv.get(n), v)}
                lines.append(f"{k}: {bad}")
        if len(lines) > limit + 3:
            break
    return "\n".join(lines)


def ids(messages: list[Consumed]) -> set[tuple]:
    return {record_id(m.json()) for m in messages}


async def produce(bootstrap: str, prefix: str, messages: list[bytes],
                  topic: T.Topic = T.TELEMETRY_GPU) -> None:
    """Send raw messages keyed as the registry says (node for batches, job for steps)."""
    field = "job" if topic is T.TELEMETRY_STEPS else "node"

    def key(raw: bytes) -> str:
        try:
            return json.loads(raw).get(field, "bad")
        except ValueError:
            return "bad"

    await produce_records(bootstrap, topic_name(topic, prefix), messages, key=key)


def on(topic: T.Topic, prefix: str, messages: list[Consumed]) -> list[Consumed]:
    return [m for m in messages if m.topic == topic_name(topic, prefix)]


# --------------------------------------------------------------------------- checkpoints (no broker)
class StandInTable:
    """What the StreamProcessor uses of a faust Table: `.data` and `send_changelog`."""

    def __init__(self, data: dict | None = None) -> None:
        self.data: dict = dict(data or {})
        self.changelog: list[tuple[int, str, bytes]] = []

    def send_changelog(self, partition: int, key: str, value: bytes) -> None:
        self.changelog.append((partition, key, value))


class StandInMessage:
    def __init__(self, partition: int, offset: int, value: bytes, topic: str = T.TELEMETRY_GPU.name) -> None:
        self.topic, self.partition, self.offset, self.value = topic, partition, offset, value
        self.headers, self.timestamp = None, 0.0


class StandInEvent:
    def __init__(self, message: StandInMessage) -> None:
        self.message, self.value = message, message.value


def partitioned_events(keyed: Iterable[tuple[str, bytes]], topic: T.Topic) -> list[StandInEvent]:
    """One event per (key, value), partitioned as the default partitioner would (murmur2 of
    the key: node or job), with consecutive offsets per partition."""
    next_offset: dict[int, int] = {}
    out = []
    for key, value in keyed:
        p = state_partition(key, topic.partitions)
        out.append(StandInEvent(StandInMessage(p, next_offset.get(p, 0), value, topic=topic.name)))
        next_offset[p] = next_offset.get(p, 0) + 1
    return out


def step_events(jobs: dict[str, int], minutes: int, ranks: int = 8) -> list[StandInEvent]:
    """One steps-topic event per rank step of each job (name -> first minute), a step a
    minute, in time order."""
    keyed = []
    for minute in range(minutes):
        for name, first in jobs.items():
            if minute < first:
                continue
            step = minute - first
            for rank in range(ranks):
                compute = 2.0 * (1.3 if rank == 3 else 1.0) * (1 + 0.01 * ((step * 7 + rank) % 5))
                record = {"ts": START_TS + 60 * minute + 0.001 * rank, "job": name, "rank": rank,
                          "node": f"{name}-node", "gpu": rank, "step": step, "model": "h100-sxm",
                          "step_time_s": 2.9, "compute_s": round(compute, 6), "samples": 32}
                keyed.append((name, json.dumps(record).encode()))
    return partitioned_events(keyed, T.TELEMETRY_STEPS)


def telemetry_events(batches: list[dict]) -> list[StandInEvent]:
    """One telemetry event per node batch."""
    return partitioned_events(((batch["node"], encode(batch)) for batch in batches), T.TELEMETRY_GPU)


class Recorder:
    """A StreamProcessor over a stand-in table; keeps what it sends, as canonical JSON."""

    def __init__(self, table: StandInTable) -> None:
        import asyncio

        from fleetwise.streams.pipeline import ControlPlane

        self.sent: list[tuple[str, bytes]] = []

        async def send(topic: str, key: bytes, value: bytes, headers: list) -> asyncio.Future:
            self.sent.append((topic, value))
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

        self.processor = StreamProcessor(ControlPlane(), table, send)

    async def feed(self, events: list[StandInEvent], batch: int = 37) -> None:
        for i in range(0, len(events), batch):
            await self.processor.process_events(events[i].message.topic, events[i:i + batch])

    def features(self) -> set[str]:
        return {canonical_text(v) for t, v in self.sent if t == T.FEATURES.name}

    def states(self) -> dict[str, object]:
        control = self.processor.control
        return {k: json.loads(json.dumps(control.state(k))) for k in control.keys()}  # noqa: SIM118


def same_states(a: dict[str, object], b: dict[str, object]) -> str:
    """'' when both hold the same keys with equal state (floats within `close`)."""
    if a.keys() != b.keys():
        return f"keys differ: {sorted(set(a) ^ set(b))[:5]}"
    bad = [k for k in a if not close(a[k], b[k])]
    return f"{len(bad)} keys differ, e.g. {bad[:3]}" if bad else ""


async def straight_run(events: list[StandInEvent], cuts: tuple[int, ...]) -> Recorder:
    """The uninterrupted reference, fed in the same pieces as the run it is compared with
    (the feature windows' dedup ring depends on batch boundaries, not the features)."""
    straight = Recorder(StandInTable())
    for a, b in zip((0, *cuts), (*cuts, len(events)), strict=True):
        await straight.feed(events[a:b])
    return straight


def assert_resumed_like(straight: Recorder, first: Recorder, second: Recorder) -> None:
    """The restarted worker ends in the reference's state, and both runs' features together
    are the reference's."""
    assert not same_states(second.states(), straight.states()), \
        same_states(second.states(), straight.states())
    got, want = first.features() | second.features(), straight.features()
    assert not differences(got, want), differences(got, want)


async def test_restored_worker_skips_redelivered_messages_and_matches_an_uninterrupted_one() -> None:
    events = telemetry_events(node_batches(nodes=6, gpus=8, ticks=130, seed=5))
    cut = 6 * 70  # mid-way through the second hop
    # Batches start at the same messages in every run: the feature windows' dedup ring keeps
    # different (equally valid) recent timestamps for different batchings.
    straight = await straight_run(events, (cut,))

    first_table = StandInTable()
    first = Recorder(first_table)
    await first.feed(events[:cut])
    written = await first.processor.checkpoint()
    partitions = {e.message.partition for e in events[:cut]}
    assert written == len(partitions) * STATE_BUCKETS
    assert {p for p, _, _ in first_table.changelog} == partitions
    header, _ = decode_entry(next(iter(first_table.data.values())))
    assert set(header["offsets"]) <= {f"{T.TELEMETRY_GPU.name}:{p}" for p in partitions}

    # A crash after the checkpoint but before the commit: the restarted worker gets the last
    # 60 messages before the cut again; its restored state already holds them.
    second = Recorder(StandInTable(first_table.data))
    await second.feed(events[cut - 60:cut])
    await second.feed(events[cut:])
    assert_resumed_like(straight, first, second)
    assert second.features(), "the restarted worker closed hops after the cut"


async def test_crash_in_the_middle_of_a_checkpoint_applies_each_message_once_per_bucket() -> None:
    events = telemetry_events(node_batches(nodes=6, gpus=8, ticks=100, seed=9))
    early, late = 6 * 50, 6 * 80
    straight = await straight_run(events, (early, late))

    table = StandInTable()
    first = Recorder(table)
    await first.feed(events[:early])
    await first.processor.checkpoint()
    at_early = dict(table.data)
    await first.feed(events[early:late])
    await first.processor.checkpoint()
    # Only the even buckets of the second checkpoint reached the changelog.
    mixed = {k: (v if int(k.split(".")[1]) % 2 == 0 else at_early[k]) for k, v in table.data.items()}
    assert mixed != at_early and mixed != table.data

    second = Recorder(StandInTable(mixed))
    await second.feed(events[early:late])  # redelivered from the commit of the first checkpoint
    await second.feed(events[late:])
    assert_resumed_like(straight, first, second)


async def test_rolling_checkpoint_saves_one_partition_and_a_restart_resumes_each_from_its_own() -> None:
    # The worker saves one partition per checkpoint step: after a crash, partitions saved at
    # different times resume from different offsets, and every message is applied once.
    events = telemetry_events(node_batches(nodes=8, gpus=8, ticks=100, seed=11))
    early, late = 8 * 50, 8 * 80
    straight = await straight_run(events, (early, late))

    table = StandInTable()
    first = Recorder(table)
    await first.feed(events[:early])
    partitions = first.processor.begin_round()
    assert len(partitions) > 1 and partitions == sorted({e.message.partition for e in events[:early]})
    saved_early = partitions[0]
    assert await first.processor.write(first.processor.snapshot([saved_early])) == STATE_BUCKETS
    assert {p for p, _, _ in table.changelog} == {saved_early}
    await first.feed(events[early:late])
    # The rest of the round: the partitions not saved yet, at the later offsets.
    await first.processor.write(first.processor.snapshot(partitions[1:]))
    assert {p for p, _, _ in table.changelog} == set(partitions)
    headers = {k: decode_entry(v)[0]["offsets"] for k, v in table.data.items()}
    early_offset = max(e.message.offset for e in events[:early] if e.message.partition == saved_early)
    saved_first = {tuple(h.values()) for k, h in headers.items() if k.startswith(f"{saved_early}.")}
    assert saved_first == {(early_offset,)}

    second = Recorder(StandInTable(table.data))
    # From the oldest commit (the first partition's), in the reference run's batches.
    await second.feed(events[early:late])
    await second.feed(events[late:])
    assert_resumed_like(straight, first, second)


async def test_messages_this_worker_already_applied_are_skipped_when_delivered_again() -> None:
    # After a rebalance that leaves a partition with this worker, faust seeks back to the
    # committed offset: what comes again is already in the state in memory.
    events = telemetry_events(node_batches(nodes=4, gpus=8, ticks=80, seed=13))
    once = Recorder(StandInTable())
    await once.feed(events[:200])
    await once.feed(events[200:])  # same batch boundaries as below (see the first test)

    twice = Recorder(StandInTable())
    await twice.feed(events[:200])
    skipped_before = _counter_value("fleetwise_redelivered_skipped_total")
    await twice.feed(events[150:200])  # 50 messages again
    await twice.feed(events[200:])
    assert _counter_value("fleetwise_redelivered_skipped_total") - skipped_before == 50
    assert not same_states(twice.states(), once.states()), same_states(twice.states(), once.states())
    assert twice.features() == once.features()


async def test_this_workers_own_older_entries_read_back_at_a_rebalance_do_not_roll_its_state_back() -> None:
    # faust's recovery after a rebalance re-reads a kept partition's changelog into the
    # table (the memory store keeps no offsets), up to the high-water mark it saw when it
    # began: a checkpoint of this worker still in flight then is not in it, and the table
    # shows this worker's previous entries. They are not another worker's: the state in
    # memory is newer and stays, and the input goes on where it was (restoring the older
    # entries lost the messages between the two checkpoints once the newer one's offsets
    # were committed).
    events = telemetry_events(node_batches(nodes=4, gpus=8, ticks=130, seed=21))
    cuts = (150, 300)
    straight = await straight_run(events, cuts)

    table = StandInTable()
    worker = Recorder(table)
    await worker.feed(events[:cuts[0]])
    await worker.processor.checkpoint()
    older = dict(table.data)
    await worker.feed(events[cuts[0]:cuts[1]])
    await worker.processor.checkpoint()
    assert table.data != older
    table.data.update(older)  # what the recovery read back
    restored_before = _counter_value("fleetwise_redelivered_skipped_total")
    await worker.feed(events[cuts[1]:])
    assert _counter_value("fleetwise_redelivered_skipped_total") == restored_before
    assert not same_states(worker.states(), straight.states()), \
        same_states(worker.states(), straight.states())
    assert not differences(worker.features(), straight.features()), \
        differences(worker.features(), straight.features())


async def test_another_workers_entries_still_replace_the_state_in_memory() -> None:
    # The other side of the test above: entries written by another worker that held the
    # partition meanwhile are the truth, and this worker restores them.
    events = telemetry_events(node_batches(nodes=4, gpus=8, ticks=130, seed=21))
    cut = 200
    straight = await straight_run(events, (cut,))
    mine = Recorder(StandInTable())
    await mine.feed(events[:100])  # held the partitions early on, then lost them
    other_table = StandInTable()
    other = Recorder(other_table)
    await other.feed(events[:cut])
    await other.processor.checkpoint()
    mine.processor.table.data.update(other_table.data)  # the partitions come back
    await mine.feed(events[cut:])
    assert not same_states(mine.states(), straight.states()), same_states(mine.states(), straight.states())


def _late_job_name(first: str) -> str:
    """A job name whose steps share `first`'s partition (so the partition's saved entries
    exist and lack it)."""
    partitions = T.TELEMETRY_STEPS.partitions
    want = state_partition(first, partitions)
    return next(name for i in range(100) if state_partition(name := f"late-{i}", partitions) == want)


@pytest.mark.parametrize("case", ["same-nodes", "node-first-seen-after-b-saved",
                                  "job-first-seen-after-b-saved"])
async def test_a_partition_back_from_a_worker_that_saved_it_resumes_from_that_save(case: str) -> None:
    # A saves, applies more, and loses the partitions at a rebalance; B restores A's save,
    # applies less than A had and saves; the partitions come back to A at the next rebalance.
    # A must take B's state and offsets (not keep its own applied offsets, which are ahead of
    # B's save): the messages after B's commit come again and are applied once. A node or job
    # first seen between B's save and what A had applied is not in B's entries: A starts it
    # over (a job's steps have no duplicate check: kept, they would count twice).
    if case == "job-first-seen-after-b-saved":
        # 8 rank steps a minute; the late job's first is the 329th event
        events = step_events({"job-a": 0, _late_job_name("job-a"): 40}, minutes=60)
        saved_a, first_late = 8 * 30, 8 * 40 + 8
    else:
        batches = node_batches(nodes=7, gpus=8, ticks=100, seed=23)
        # node-006 joins at tick 65 (its first message is the 397th), or not at all
        batches = [b for b in batches if b["node"] != "node-006"
                   or (case != "same-nodes" and b["ts"] >= START_TS + 65 * TICK_S)]
        events = telemetry_events(batches)
        saved_a, first_late = 6 * 50, 6 * 65 + 6
    saved_b, applied_a = saved_a + 2 * 37, saved_a + 4 * 37  # 37: Recorder's batch
    assert case == "same-nodes" or saved_b < first_late < applied_a
    straight = await straight_run(events, (saved_a, saved_b, applied_a))

    table_a = StandInTable()
    a = Recorder(table_a)
    await a.feed(events[:saved_a])
    await a.processor.checkpoint()
    await a.feed(events[saved_a:applied_a])
    b = Recorder(StandInTable(table_a.data))
    await b.feed(events[saved_a:saved_b])  # from A's commit
    await b.processor.checkpoint()
    table_a.data.update(b.processor.table.data)  # A's table recovers B's entries
    await a.feed(events[saved_b:])  # from B's commit
    assert not same_states(a.states(), straight.states()), same_states(a.states(), straight.states())
    got, want = a.features() | b.features(), straight.features()
    assert not differences(got, want), differences(got, want)


async def test_a_partition_not_assigned_at_a_checkpoint_is_neither_saved_nor_acked_until_it_is_back() -> None:
    # A checkpoint during a rebalance (the idle timer fires while the assignment is empty)
    # must not write a revoked partition's state, nor let its offsets be acked: faust would
    # commit past what the changelog holds, and the next owner would skip those messages.
    events = telemetry_events(node_batches(nodes=6, gpus=8, ticks=20, seed=29))
    recorder = Recorder(StandInTable())
    processor = recorder.processor
    await recorder.feed(events)
    partitions = sorted({e.message.partition for e in events})
    gone = partitions[0]
    tp = f"{T.TELEMETRY_GPU.name}:{gone}"
    last = max(e.message.offset for e in events if e.message.partition == gone)
    processor.owns = lambda partition: partition != gone
    assert gone not in processor.begin_round()
    snapshot = processor.snapshot()
    assert {p for p, _, _ in snapshot.entries} == set(partitions) - {gone}
    assert snapshot.ackable(tp, [0, last]) == ([], [0, last])
    kept = f"{T.TELEMETRY_GPU.name}:{partitions[1]}"
    assert snapshot.ackable(kept, [0, 1]) == ([0, 1], [])

    processor.owns = lambda partition: True  # the partition came back (nobody else saved it)
    assert processor.begin_round() == [gone]
    snapshot = processor.snapshot()
    assert {p for p, _, _ in snapshot.entries} == {gone}
    assert snapshot.ackable(tp, [0, last, last + 1]) == ([0, last], [last + 1])


async def test_a_fetch_that_starts_past_the_read_offset_is_dropped_and_the_partition_sought_back() -> None:
    # Records fetched before faust's post-rebalance seek can arrive after it, and records of
    # a partition paused for recovery are dropped while its position moves on: a batch that
    # starts past the next offset to read would skip messages for good.
    tp, gone = TopicPartition("t", 0), TopicPartition("t", 1)

    class StandInConsumer:
        log = logging.getLogger("test")

        def __init__(self) -> None:
            self._read_offset: dict = defaultdict(lambda: None)
            self._reseek_at: dict = {}
            self.sought: list[tuple] = []

        def assignment(self) -> set:
            return {tp}

        async def seek(self, partition: TopicPartition, offset: int) -> None:
            self.sought.append((partition, offset))
            self._read_offset[partition] = offset

    consumer = StandInConsumer()
    skipped_ahead = BatchConsumer._skipped_ahead
    assert not await skipped_ahead(consumer, tp, 500)  # nothing read yet: no expectation
    consumer._read_offset[tp] = 269
    assert not await skipped_ahead(consumer, tp, 269)  # faust's seek: read offset = next
    assert not await skipped_ahead(consumer, tp, 270)  # the next one after the last read
    assert await skipped_ahead(consumer, tp, 382)
    assert consumer.sought == [(tp, 269)]
    # The same gap again from the same read offset: the records are gone (retention), go on.
    assert not await skipped_ahead(consumer, tp, 382)
    consumer._read_offset[tp] = 400
    assert await skipped_ahead(consumer, tp, 450)
    assert consumer.sought == [(tp, 269), (tp, 400)]
    consumer._read_offset[gone] = 10  # revoked meanwhile: dropped, no seek on it
    assert await skipped_ahead(consumer, gone, 20)
    assert consumer.sought == [(tp, 269), (tp, 400)]


async def test_records_fetched_for_a_paused_partition_are_sought_back_to() -> None:
    # A partition paused for table recovery between the fetch request and its records'
    # hand-over: they are dropped, so the partition goes back to the first of them (a
    # partition without a committed offset lost its first messages at a takeover before).
    tp, gone = TopicPartition("t", 0), TopicPartition("t", 1)

    class StandInConsumer:
        log = logging.getLogger("test")

        def __init__(self) -> None:
            self.sought: list[tuple] = []

        def assignment(self) -> set:
            return {tp, changelog}

        def _is_changelog_tp(self, partition: TopicPartition) -> bool:
            return partition.topic.endswith("-changelog")

        async def seek(self, partition: TopicPartition, offset: int) -> None:
            self.sought.append((partition, offset))

    changelog = TopicPartition("app-fleetwise-state-changelog", 0)
    consumer = StandInConsumer()
    await BatchConsumer._put_back(consumer, tp, 0)
    await BatchConsumer._put_back(consumer, gone, 7)  # revoked meanwhile: its new owner reads it
    # dropped after faust's recovery sought it back, recovery would wait for these for ever
    await BatchConsumer._put_back(consumer, changelog, 3)
    assert consumer.sought == [(tp, 0), (changelog, 3)]


def test_state_entries_are_compressed_and_uncompressed_ones_still_read() -> None:
    import struct

    from fleetwise.streams.app import ENTRY_MAGIC, encode_entry

    header = {"offsets": {"fleetwise.telemetry.gpu:3": 41}, "features": None, "other": {}}
    blob = bytes(8 * 4096)  # zero rows, as most of the windows' state arrays are
    entry = encode_entry(header, blob)
    assert len(entry) < len(blob) / 10
    got_header, got_blob = decode_entry(entry)
    assert got_header == header and bytes(got_blob) == blob
    text = json.dumps(header).encode()
    plain = ENTRY_MAGIC + struct.pack("<I", len(text)) + text + blob  # written before compression
    assert decode_entry(plain)[0] == header and bytes(decode_entry(plain)[1]) == blob
    with pytest.raises(ValueError, match="corrupt"):
        decode_entry(entry[:-10])


@contextlib.asynccontextmanager
async def _worker_consumer(app_id: str):
    """The aiokafka consumer the worker's consumer thread creates, with the worker's settings
    (no broker needed: it is not started)."""
    from fleetwise.streams.app import BatchConsumerThread, make_app

    app = make_app("127.0.0.1:1", app_id=app_id)
    thread = app.consumer._thread
    assert isinstance(thread, BatchConsumerThread)
    consumer = thread._create_worker_consumer(app.transport)
    try:
        yield consumer
    finally:
        await consumer.stop()


async def test_worker_consumer_long_polls_briefly_so_busy_partitions_do_not_wait_behind_idle_ones() -> None:
    # aiokafka leaves partitions with buffered records out of the next fetch; when only idle
    # partitions are in it, the broker holds it for fetch_max_wait_ms (faust: 1,500 ms) and
    # the telemetry waits. Pinned here because the setting is a private aiokafka attribute.
    from fleetwise.streams.app import FETCH_MAX_WAIT_MS

    async with _worker_consumer("fetch-wait-test") as consumer:
        assert consumer._fetch_max_wait_ms == FETCH_MAX_WAIT_MS
        assert FETCH_MAX_WAIT_MS <= 100


async def test_worker_consumer_refreshes_its_metadata_every_few_seconds() -> None:
    # A group leader that joined as a restarted broker came back assigned from metadata without
    # the topics: every member got nothing (a CI run of test_broker_faults' join scenario, 2
    # workers idle for the test's 120 s). aiokafka rejoins when a metadata refresh shows the
    # topics; faust's default age, 5 min, left the group idle that long.
    from fleetwise.streams.app import CONSUMER_METADATA_MAX_AGE_S

    async with _worker_consumer("metadata-age-test") as consumer:
        assert consumer._client._metadata_max_age_ms == CONSUMER_METADATA_MAX_AGE_S * 1000
        assert CONSUMER_METADATA_MAX_AGE_S <= 10


async def test_worker_consumer_hands_its_fetch_a_never_empty_view_of_the_active_partitions() -> None:
    # What the broker test below pins for aiokafka: the worker's consumer must hand the fetch
    # the view, not faust's set itself, or a rebalance that pauses everything empties it.
    from fleetwise.streams.app import make_app

    app = make_app("127.0.0.1:1", app_id="active-view-test")
    handed: list = []

    class StandInThread:
        async def getmany(self, active_partitions: object, timeout: float) -> dict:
            handed.append(active_partitions)
            return {}

    tp = TopicPartition("t", 0)
    live = {tp}
    app.consumer._thread = StandInThread()
    assert await app.consumer._getmany(live, 0.1) == {}
    view = handed[0]
    assert tp in view
    live.clear()  # the rebalance pauses every partition while the fetch waits
    assert tp not in view and bool(view)


def _counter_value(name: str) -> float:
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)


# --------------------------------------------------------------------------- tests (broker)
@pytest.mark.kafka
async def test_a_fetch_waiting_while_a_rebalance_pauses_every_partition_returns_no_records(
    kafka_bootstrap: str, namespace
) -> None:
    # aiokafka's fetched_records returns every partition's records for an empty partition
    # set, and faust hands it its live set of active partitions, which a rebalance empties
    # while the fetch waits: a worker got its changelog partitions' records with its flow
    # stopped, dropped them, and table recovery waited for them for ever.
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    from fleetwise.streams.app import ActivePartitions

    prefix, _ = namespace
    topic = topic_name(T.TELEMETRY_GPU, prefix)
    resumed, paused = TopicPartition(topic, 0), TopicPartition(topic, 1)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
    await producer.start()
    try:
        for tp in (resumed, paused):
            for i in range(3):
                await producer.send_and_wait(topic, b"%d" % i, partition=tp.partition)
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await consumer.start()
    try:
        consumer.assign([resumed, paused])
        fetcher = consumer._fetcher
        active = {resumed}
        got = await fetcher.fetched_records(ActivePartitions(active), timeout=10)
        assert set(got) == {resumed} and len(got[resumed]) == 3
        active.clear()  # the rebalance: faust pauses every partition
        assert await fetcher.fetched_records(ActivePartitions(active), timeout=1.0) == {}
        # `paused`'s records were there all along: the live set itself, empty, returns them
        got = await fetcher.fetched_records(active, timeout=10)
        assert set(got) == {paused} and len(got[paused]) == 3
    finally:
        await consumer.stop()


@pytest.mark.kafka
@pytest.mark.slow
async def test_node_batches_through_kafka_match_embedded_and_bad_input_is_dead_lettered(
    kafka_bootstrap: str, namespace
) -> None:
    prefix, new_worker = namespace
    batches = node_batches(nodes=4, gpus=8, ticks=130, seed=7)  # 130 ticks of 10 s: two closed hops
    good = [encode(b) for b in batches]
    messages = good[:40] + bad_inputs(batches) + good[40:]
    expected = embedded_outputs(messages)
    n_features = len(expected[T.FEATURES.name])
    # 1,290 s of data: two or three hop ends per GPU, by its hop phase
    assert 4 * 8 * 2 <= n_features <= 4 * 8 * 3, "the reference run closes 2-3 hops for each of 32 GPUs"
    assert len(expected[T.DEADLETTER.name]) == 3

    n_predictions = len(expected.get(T.PREDICTIONS.name, ()))
    worker = new_worker().start()
    await produce(kafka_bootstrap, prefix, messages)
    topics = [topic_name(t, prefix) for t in (T.FEATURES, T.PREDICTIONS, T.DEADLETTER)]
    try:
        # Wait for every output kind: predictions may reach the broker a little after features.
        got = await consume_until(
            kafka_bootstrap, topics, timeout_s=90,
            until=lambda ms: worker.check_alive() and len(on(T.FEATURES, prefix, ms)) >= n_features
            and len(on(T.DEADLETTER, prefix, ms)) >= 3
            and len(on(T.PREDICTIONS, prefix, ms)) >= n_predictions,
        )
    except TimeoutError as exc:
        pytest.fail(f"{exc}\nworker log:\n{worker.log_tail()}")
    # a little longer, to catch anything extra the worker would wrongly emit
    got += await consume_until(kafka_bootstrap, topics, timeout_s=2, from_beginning=False)

    features = on(T.FEATURES, prefix, got)
    assert not differences(as_set(features), expected[T.FEATURES.name]), \
        differences(as_set(features), expected[T.FEATURES.name])
    assert not differences(as_set(on(T.PREDICTIONS, prefix, got)), expected.get(T.PREDICTIONS.name, set()))
    assert {m.key for m in features} == {f"node-{n:03d}/{g}" for n in range(4) for g in range(8)}
    # outputs go out in record batches per partition: the partition Kafka's default
    # partitioner gives the key, as a per-record send would
    from aiokafka.partitioner import murmur2

    assert all(m.partition == (murmur2(m.key.encode()) & 0x7FFFFFFF) % T.FEATURES.partitions
               for m in features)

    dead = [m.json() for m in on(T.DEADLETTER, prefix, got)]
    reasons = " | ".join(d["reason"] for d in dead)
    assert len(dead) == 3, reasons
    assert any("not valid JSON" in d["reason"] for d in dead), reasons
    assert any("finite" in d["reason"] and "DCGM_FI_DEV_GPU_TEMP" in d["reason"] for d in dead), reasons
    assert any("Imaginary X9000" in d["reason"] for d in dead), reasons
    truncated = next(d for d in dead if "not valid JSON" in d["reason"])
    assert truncated["original"].startswith('{"ts": 1764489600, "node": "node-000"')

    for category in ("not_json", "not_finite", "unknown_model"):
        assert worker.metric("fleetwise_deadletter_total", reason=category) == 1, category
    assert worker.metric("fleetwise_messages_in_total", topic=T.TELEMETRY_GPU.name) == len(messages)
    assert worker.metric("fleetwise_decisions_out_total", kind="features") == n_features


def _produce_quota(bootstrap: str, client_id: str, bytes_per_s: int | None) -> None:
    """Set (None: remove) the broker's produce quota of one client id, with Kafka's own
    ConfigCommand (`kafka-configs.sh`): the broker then throttles that client's writes."""
    libs = subprocess.run(["bash", str(KAFKA_SH), "fetch"], capture_output=True, text=True,
                          check=True).stdout.strip().splitlines()[-1]
    change = (["--add-config", f"producer_byte_rate={bytes_per_s}"] if bytes_per_s is not None
              else ["--delete-config", "producer_byte_rate"])
    subprocess.run(["java", "-cp", f"{libs}/*", "kafka.admin.ConfigCommand", "--bootstrap-server", bootstrap,
                    "--alter", *change, "--entity-type", "clients", "--entity-name", client_id],
                   capture_output=True, text=True, check=True, timeout=120)


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_worker_whose_writes_are_throttled_keeps_one_checkpoint_in_flight_and_loses_nothing(
    kafka_bootstrap: str, namespace
) -> None:
    """The broker throttles the worker's produce (a quota on its client id) while input keeps
    coming: checkpoint writes take seconds, steps come due every second. A checkpoint waits
    while one is in flight (the idle timer's save of everything too), so encoded snapshots do
    not queue in the worker's memory; once the quota is lifted the outputs are the embedded
    runtime's."""
    prefix, new_worker = namespace
    client = f"fw-throttled-{uuid.uuid4().hex[:8]}"
    messages = [encode(b) for b in node_batches(nodes=8, gpus=8, ticks=300, seed=19)]
    expected = embedded_outputs(messages)[T.FEATURES.name]
    _produce_quota(kafka_bootstrap, client, 30_000)
    try:
        worker = new_worker(env={"BROKER_CLIENT_ID": client}).start()
        pending: list[float] = []
        pieces = [messages[i:i + 160] for i in range(0, len(messages), 160)]
        for piece in pieces:
            await produce(kafka_bootstrap, prefix, piece)
            for _ in range(8):
                with contextlib.suppress(OSError):  # /metrics not up yet
                    pending.append(worker.metric("fleetwise_checkpoint_writes_pending"))
                worker.check_alive()
                time.sleep(0.25)
        assert pending and max(pending) <= 1, pending
        assert pending.count(1) > len(pending) / 2, pending  # the quota made writes slow
    finally:
        _produce_quota(kafka_bootstrap, client, None)
    await assert_features_like_embedded(kafka_bootstrap, prefix, expected, [worker], timeout_s=180)


@pytest.mark.kafka
@pytest.mark.slow
async def test_worker_killed_and_restarted_resumes_with_its_window_state(
    kafka_bootstrap: str, namespace
) -> None:
    prefix, new_worker = namespace
    batches = node_batches(nodes=2, gpus=8, ticks=150, seed=11)
    messages = [encode(b) for b in batches]
    # Part A ends mid-way through the second hop: its samples live only in window state.
    part_a, part_b = messages[: 2 * 95], messages[2 * 95:]
    expected = embedded_outputs(messages)[T.FEATURES.name]
    features_after_a = embedded_outputs(part_a)[T.FEATURES.name]
    features_topic = topic_name(T.FEATURES, prefix)

    first = new_worker().start()
    await produce(kafka_bootstrap, prefix, part_a)
    await consume_until(kafka_bootstrap, [features_topic], timeout_s=90,
                        until=lambda ms: first.check_alive() and len(ms) >= len(features_after_a))
    # Wait until the worker has consumed all of part A, then give it a moment to save state
    # and commit, and kill it without any chance to clean up.
    deadline = time.monotonic() + 30
    while first.metric("fleetwise_messages_in_total", topic=T.TELEMETRY_GPU.name) < len(part_a):
        assert time.monotonic() < deadline, first.log_tail()
        time.sleep(0.2)
    time.sleep(3.5)  # > checkpoint interval (1 s) + commit interval (1 s)
    first.stop(signal.SIGKILL)

    second = new_worker().start()
    await produce(kafka_bootstrap, prefix, part_b)
    # Same features as one uninterrupted run: the second hop mixes samples seen before the
    # kill (restored from the changelog) with samples after it.
    await assert_features_like_embedded(kafka_bootstrap, prefix, expected, [second], timeout_s=90)
    # ... and the restarted worker resumed from the committed offsets, not from the start.
    consumed_again = second.metric("fleetwise_messages_in_total", topic=T.TELEMETRY_GPU.name)
    assert len(part_b) <= consumed_again < len(messages), consumed_again


@pytest.mark.kafka
@pytest.mark.slow
async def test_simulated_fleet_gives_the_same_features_and_decisions_on_kafka_as_embedded(
    kafka_bootstrap: str, namespace
) -> None:
    prefix, new_worker = namespace
    messages = sim_messages(seed=3)
    expected = embedded_outputs(messages)
    compared = (T.FEATURES, T.PREDICTIONS)
    n_expected = sum(len(expected.get(t.name, ())) for t in compared)
    scopes = {json.loads(r)["scope"] for r in expected[T.FEATURES.name]}
    assert scopes == {"gpu", "rank"}, "the reference run has per-GPU and per-rank features"

    worker = new_worker().start()
    for topic in (T.TELEMETRY_GPU, T.TELEMETRY_STEPS):
        await produce(kafka_bootstrap, prefix, [raw for name, raw in messages if name == topic.name], topic)
    names = [topic_name(t, prefix) for t in compared]
    try:
        got = await consume_until(kafka_bootstrap, names, timeout_s=90,
                                  until=lambda ms: worker.check_alive() and len(ids(ms)) >= n_expected)
    except TimeoutError as exc:
        pytest.fail(f"{exc}\nworker log:\n{worker.log_tail()}")
    got += await consume_until(kafka_bootstrap, names, timeout_s=2, from_beginning=False)
    for t in compared:
        mine = as_set(on(t, prefix, got))
        want = expected.get(t.name, set())
        assert not differences(mine, want), (t.name, differences(mine, want))


@pytest.mark.kafka
@pytest.mark.slow
async def test_two_workers_share_the_partitions_and_give_the_same_features(
    kafka_bootstrap: str, namespace
) -> None:
    prefix, new_worker = namespace
    batches = node_batches(nodes=16, gpus=8, ticks=130, seed=17)
    messages = [encode(b) for b in batches]
    expected = embedded_outputs(messages)[T.FEATURES.name]
    assert any(json.loads(r)["values"].get("node_nvl_peers_1h") for r in expected), \
        "node-peer context is compared too"
    workers = [new_worker().start(), new_worker().start()]
    # Both in the group before any input: each holds some of the 8 telemetry partitions.
    deadline = time.monotonic() + 90
    while True:
        try:
            held = [w.metric("fleetwise_assigned_partitions", topic=T.TELEMETRY_GPU.name) for w in workers]
        except OSError:
            held = [0.0, 0.0]
        if sum(held) == T.TELEMETRY_GPU.partitions and min(held) > 0:
            break
        assert all(w.check_alive() for w in workers) and time.monotonic() < deadline, \
            f"partitions held {held}\n{workers[0].log_tail()}\n{workers[1].log_tail()}"
        time.sleep(0.5)

    await produce(kafka_bootstrap, prefix, messages)
    await assert_features_like_embedded(kafka_bootstrap, prefix, expected, workers, timeout_s=90)
    consumed = [w.metric("fleetwise_messages_in_total", topic=T.TELEMETRY_GPU.name) for w in workers]
    assert min(consumed) > 0 and sum(consumed) == len(messages), consumed


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_worker_joining_mid_stream_takes_over_partitions_with_their_state(
    kafka_bootstrap: str, namespace
) -> None:
    # The second worker's arrival rebalances the group while the first is consuming: the
    # partitions it takes over resume from their committed offsets with the state the first
    # worker saved, so the features still equal one uninterrupted embedded run.
    prefix, new_worker = namespace
    batches = node_batches(nodes=16, gpus=8, ticks=130, seed=19)
    messages = [encode(b) for b in batches]
    part_a, part_b = messages[: 16 * 90], messages[16 * 90:]  # A ends inside the second hop
    expected = embedded_outputs(messages)[T.FEATURES.name]
    assert any(json.loads(r)["values"].get("node_nvl_peers_1h") for r in expected), \
        "node-peer context carried in the saved state is compared too"
    first = new_worker().start()
    await produce(kafka_bootstrap, prefix, part_a)
    wait_for_metric(first, "fleetwise_messages_in_total", len(part_a) / 2, topic=T.TELEMETRY_GPU.name)
    second = new_worker().start()
    # the group has rebalanced: the second worker holds some partitions
    wait_for_metric(second, "fleetwise_assigned_partitions", 1, topic=T.TELEMETRY_GPU.name)
    await produce(kafka_bootstrap, prefix, part_b)
    workers = [first, second]
    await assert_features_like_embedded(kafka_bootstrap, prefix, expected, workers, timeout_s=120)
    assert second.metric("fleetwise_messages_in_total", topic=T.TELEMETRY_GPU.name) > 0


@pytest.mark.kafka
@pytest.mark.stress
async def test_a_worker_joining_and_leaving_mid_stream_loses_nothing(kafka_bootstrap: str, namespace) -> None:
    # Three rebalances while input flows: a third worker joins (partitions move to it), then
    # stops before it has settled (they move back). Partitions that stay put go through
    # faust's recovery each time, which reads their changelog back into the table while a
    # checkpoint may be in flight; this caught state rolled back to a worker's own older
    # entries (windows short of samples, or missing).
    import asyncio

    prefix, new_worker = namespace
    batches = node_batches(nodes=16, gpus=8, ticks=130, seed=31)
    messages = [encode(b) for b in batches]
    expected = embedded_outputs(messages)[T.FEATURES.name]
    assert any(json.loads(r)["values"].get("node_nvl_peers_1h") for r in expected), \
        "node-peer context is compared too"
    workers = [new_worker().start(), new_worker().start()]
    wait_for_metric(workers[1], "fleetwise_assigned_partitions", 1, topic=T.TELEMETRY_GPU.name)
    n = len(messages) // 6
    for i in range(6):
        await produce(kafka_bootstrap, prefix, messages[i * n:] if i == 5 else messages[i * n:(i + 1) * n])
        if i == 1:
            third = new_worker().start()
        if i == 3:
            third.stop(signal.SIGTERM)
        await asyncio.sleep(2)
    await assert_features_like_embedded(kafka_bootstrap, prefix, expected, workers, timeout_s=120)
