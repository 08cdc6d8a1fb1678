"""Integration: node batches -> real Kafka -> `fleetwise worker` (faust, subprocess) -> features.

Every test uses its own topic prefix and app id, so tests never share topics, consumer groups
or changelogs. The expected outputs are never written down here: they come from the embedded
runtime (`EmbeddedRuntime`, no Kafka) fed the same bytes, so the tests show that the Kafka
path and the embedded path agree, including on bad input.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from fleetwise.schemas import topics as T
from fleetwise.streams.embedded import EmbeddedRuntime
from fleetwise.streams.kafka_io import (
    Consumed,
    consume_until,
    ensure_topics,
    produce_records,
    topic_name,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
MODEL = "NVIDIA H100 80GB HBM3"
START_TS = 1_764_489_600.0  # 2025-11-30T08:00:00Z, a hop boundary for 600 s hops
TICK_S = 10.0


# --------------------------------------------------------------------------- inputs
def node_batches(nodes: int, gpus: int, ticks: int, *, seed: int, start_tick: int = 0) -> list[dict]:
    """Seeded node batches: temperatures, power, clocks, utilisation and slowly rising
    counters, one batch per node per tick, in tick order (as agents would publish them)."""
    rng = np.random.default_rng(seed)
    out = []
    sbe = np.zeros((nodes, gpus))
    for tick in range(ticks):
        ts = START_TS + (start_tick + tick) * TICK_S
        sbe += rng.poisson(0.05, size=(nodes, gpus))
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


# --------------------------------------------------------------------------- worker process
class Worker:
    """`python -m fleetwise.cli worker` in a subprocess, with its own metrics port."""

    def __init__(self, bootstrap: str, prefix: str, app_id: str, log: Path) -> None:
        self.bootstrap, self.prefix, self.app_id, self.log_path = bootstrap, prefix, app_id, log
        self.metrics_port = _free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> Worker:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleetwise.cli", "worker", "--bootstrap", self.bootstrap,
             "--app-id", self.app_id, "--topic-prefix", self.prefix,
             "--metrics-port", str(self.metrics_port), "--loglevel", "warning"],
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
        return self.log_path.read_text(errors="replace")[-4000:]


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

    def new_worker() -> Worker:
        w = Worker(kafka_bootstrap, prefix, f"fw-test-{tag}", tmp_path / f"worker{len(workers)}.log")
        workers.append(w)
        return w

    yield prefix, new_worker
    for w in workers:
        w.stop(signal.SIGKILL)


# --------------------------------------------------------------------------- helpers
def embedded_outputs(messages: Iterable[bytes]) -> dict[str, set[str]]:
    """What the embedded runtime routes for the same message bytes (no flush: a live worker
    never closes a window without a later sample)."""
    runtime = EmbeddedRuntime()
    for i, raw in enumerate(messages):
        runtime.feed(T.TELEMETRY_GPU.name,
                     runtime.control.decode(T.TELEMETRY_GPU.name, raw, source=f"msg:{i}"))
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


def differences(got: set[str], want: set[str], limit: int = 5) -> str:
    """Which (node, gpu, ts) feature vectors differ, and in which values (failure messages)."""
    def index(items: set[str]) -> dict:
        return {(d["node"], d["gpu"], d["ts"]): d for d in map(json.loads, items)}

    g, w = index(got), index(want)
    lines = [f"{len(got)} distinct on Kafka for {len(g)} keys; {len(want)} embedded for {len(w)} keys",
             f"only on Kafka: {sorted(set(g) - set(w))[:limit]}",
             f"only embedded: {sorted(set(w) - set(g))[:limit]}"]
    for k in sorted(set(g) & set(w)):
        diff = {name: (g[k]["values"].get(name), v) for name, v in w[k]["values"].items()
                if g[k]["values"].get(name) != v}
        if diff or g[k] != w[k]:
            lines.append(f"{k}: {diff or 'non-value fields differ'}")

        if len(lines) > limit + 2:
            break
    return "\n".join(lines)


async def produce(bootstrap: str, prefix: str, messages: list[bytes]) -> None:
    def key(raw: bytes) -> str:
        try:
            return json.loads(raw).get("node", "bad")
        except ValueError:
            return "bad"

    await produce_records(bootstrap, topic_name(T.TELEMETRY_GPU, prefix), messages, key=key)


def on(topic: T.Topic, prefix: str, messages: list[Consumed]) -> list[Consumed]:
    return [m for m in messages if m.topic == topic_name(topic, prefix)]


# --------------------------------------------------------------------------- tests
async def test_node_batches_through_kafka_match_embedded_and_bad_input_is_dead_lettered(
    kafka_bootstrap: str, namespace
) -> None:
    prefix, new_worker = namespace
    batches = node_batches(nodes=4, gpus=8, ticks=130, seed=7)  # 130 ticks of 10 s: two closed hops
    good = [encode(b) for b in batches]
    messages = good[:40] + bad_inputs(batches) + good[40:]
    expected = embedded_outputs(messages)
    n_features = len(expected[T.FEATURES.name])
    assert n_features == 4 * 8 * 2, "the reference run closes two hops for each of 32 GPUs"
    assert len(expected[T.DEADLETTER.name]) == 3

    worker = new_worker().start()
    await produce(kafka_bootstrap, prefix, messages)
    topics = [topic_name(t, prefix) for t in (T.FEATURES, T.PREDICTIONS, T.DEADLETTER)]
    try:
        got = await consume_until(
            kafka_bootstrap, topics, timeout_s=90,
            until=lambda ms: worker.check_alive() and len(on(T.FEATURES, prefix, ms)) >= n_features
            and len(on(T.DEADLETTER, prefix, ms)) >= 3,
        )
    except TimeoutError as exc:
        pytest.fail(f"{exc}\nworker log:\n{worker.log_tail()}")
    # a little longer, to catch anything extra the worker would wrongly emit
    got += await consume_until(kafka_bootstrap, topics, timeout_s=2, from_beginning=False)

    features = on(T.FEATURES, prefix, got)
    assert as_set(features) == expected[T.FEATURES.name], differences(as_set(features),
                                                                      expected[T.FEATURES.name])
    assert as_set(on(T.PREDICTIONS, prefix, got)) == expected.get(T.PREDICTIONS.name, set())
    assert {m.key for m in features} == {f"node-{n:03d}/{g}" for n in range(4) for g in range(8)}

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
    time.sleep(2.5)
    first.stop(signal.SIGKILL)

    second = new_worker().start()
    await produce(kafka_bootstrap, prefix, part_b)
    try:
        got = await consume_until(kafka_bootstrap, [features_topic], timeout_s=90,
                                  until=lambda ms: second.check_alive() and len(as_set(ms)) >= len(expected))
    except TimeoutError as exc:
        pytest.fail(f"{exc}\nworker log:\n{second.log_tail()}")
    got += await consume_until(kafka_bootstrap, [features_topic], timeout_s=2, from_beginning=False)
    # Same features as one uninterrupted run: the second hop mixes samples seen before the
    # kill (restored from the changelog) with samples after it.
    assert as_set(got) == expected, differences(as_set(got), expected)
    # ... and the restarted worker resumed from the committed offsets, not from the start.
    consumed_again = second.metric("fleetwise_messages_in_total", topic=T.TELEMETRY_GPU.name)
    assert len(part_b) <= consumed_again < len(messages), consumed_again
