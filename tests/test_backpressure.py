"""Back-pressure and limits (docs/streams.md, "Limits"): a flood from one node, implausible
units, clock skew, oversized messages, keys that disagree with the payload, a worker whose
state outgrows its bound, and an agent holding a batch the broker can never take."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleetwise.schemas import DeadLetter
from fleetwise.schemas import topics as T
from fleetwise.streams.limits import Limits
from fleetwise.streams.pipeline import ControlPlane
from tests.test_streams_kafka import (
    MODEL,
    START_TS,
    Recorder,
    StandInTable,
    _counter_value,
    canonical_text,
    differences,
    encode,
    node_batches,
)


def sample(node: str, gpu: int, ts: float, **metrics: float) -> dict:
    base = {
        "DCGM_FI_DEV_GPU_TEMP": 60.0,
        "DCGM_FI_DEV_POWER_USAGE": 500.0,
        "DCGM_FI_DEV_SM_CLOCK": 1980.0,
        "DCGM_FI_DEV_GPU_UTIL": 90.0,
    }
    return {"ts": ts, "node": node, "gpu": gpu, "model": MODEL, "metrics": {**base, **metrics}}


def run(control: ControlPlane, lines: list[dict], chunk: int) -> tuple[list[DeadLetter], set[str]]:
    """Sample lines through decode + handle in chunks of `chunk`: (dead letters, features)."""
    dead, features = [], set()
    for i in range(0, len(lines), chunk):
        part = lines[i : i + chunk]
        items = [
            it
            for j, s in enumerate(part)
            for it in control.decode(T.TELEMETRY_GPU.name, json.dumps(s).encode(), source=f"l:{i + j}")
        ]
        for topic, _key, record in control.handle(T.TELEMETRY_GPU.name, items):
            if topic == T.DEADLETTER.name:
                dead.append(record)
            elif topic == T.FEATURES.name:
                features.add(canonical_text(record.to_json()))
    return dead, features


def test_implausible_units_are_dead_lettered_naming_field_value_and_likely_unit() -> None:
    lines = [sample("n1", g, START_TS + 10 * t) for t in range(5) for g in range(4)]
    lines[4]["metrics"]["DCGM_FI_DEV_POWER_USAGE"] = 612_000.0  # mW for W
    lines[9]["metrics"]["DCGM_FI_DEV_GPU_TEMP"] = 338.15  # K for C
    lines[13]["metrics"]["DCGM_FI_DEV_SM_CLOCK"] = 1.98e9  # Hz for MHz
    lines[14]["metrics"]["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] = -4.0
    lines[15]["metrics"]["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] = float(0x7FFFFFF0)  # a DCGM blank: missing, fine
    control = ControlPlane()
    dead, _ = run(control, lines, chunk=7)
    reasons = sorted(d.reason for d in dead)
    assert len(dead) == 4, reasons
    assert any("DCGM_FI_DEV_POWER_USAGE" in r and "612000" in r and "milliwatts" in r for r in reasons)
    assert any("DCGM_FI_DEV_GPU_TEMP" in r and "Kelvin" in r for r in reasons)
    assert any("DCGM_FI_DEV_SM_CLOCK" in r and "Hz" in r for r in reasons)
    assert any("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL" in r and "-4.0" in r for r in reasons)
    assert control.features.samples_in == len(lines) - 4
    assert {d.source for d in dead} == {
        f"{T.TELEMETRY_GPU.name}#n1/{g}@{START_TS + 10 * t!r}" for t, g in ((1, 0), (2, 1), (3, 1), (3, 2))
    }


def test_clock_skew_is_judged_against_the_partitions_event_time_whatever_the_batching() -> None:
    lines = []
    for t in range(200):
        for node in ("a", "b", "c"):
            lines.append(sample(node, 0, START_TS + 10 * t))
    lines[150]["ts"] += 3 * 86_400  # a node's clock 3 days ahead
    lines[301]["ts"] -= 30 * 86_400  # a month behind
    lines[452]["ts"] = lines[452]["ts"] * 1000  # milliseconds: beyond 2100
    verdicts = []
    for chunk in (1, 13, len(lines)):
        control = ControlPlane()
        dead, features = run(control, lines, chunk)
        verdicts.append((sorted(d.reason for d in dead), features))
    assert verdicts[0][0] == verdicts[1][0] == verdicts[2][0], "the verdicts depend on the batching"
    assert not differences(verdicts[0][1], verdicts[2][1]) and not differences(verdicts[1][1], verdicts[2][1])
    reasons = verdicts[0][0]
    assert len(reasons) == 3, reasons
    assert any("ahead of the stream's event time" in r and "72.0 h" in r for r in reasons)
    assert any("30.0 days behind" in r for r in reasons)
    assert any("outside 2000-01-01..2100-01-01" in r for r in reasons)


def test_a_flooding_node_is_rate_limited_with_a_count_and_other_nodes_are_unaffected() -> None:
    calm = [sample("calm", g, START_TS + 10 * t) for t in range(200) for g in range(2)]
    flood = [sample("loud", 0, START_TS + 0.05 * k) for k in range(40_000)]  # 20 Hz for 2,000 s
    merged = sorted(calm + flood, key=lambda s: s["ts"])
    alone = ControlPlane()
    _, calm_features = run(alone, calm, chunk=500)
    limits = Limits()
    per_hop = int(limits.max_rate_hz * 600)
    counts = []
    for chunk in (997, 5000):
        control = ControlPlane()
        dead, features = run(control, merged, chunk)
        assert all(d.reason.startswith("rate: ") and "loud/0" in d.reason for d in dead)
        refused = sum(d.count for d in dead)  # one dead letter per GPU per call, with the count
        assert len(dead) < refused / 100, "a flood must not become a flood of dead letters"
        counts.append(refused)
        mine = {f for f in features if json.loads(f)["node"] == "calm"}
        assert not differences(mine, calm_features), differences(mine, calm_features)
        loud = [json.loads(f)["values"]["samples"] for f in features if json.loads(f)["node"] == "loud"]
        assert loud and max(loud) == per_hop
    assert counts[0] == counts[1] > 30_000  # the excess does not depend on the batching
    assert control.gate.rate_limited == counts[1]


async def test_oversized_messages_and_keys_that_disagree_with_the_payload_are_dead_lettered() -> None:
    from fleetwise.streams.app import DEADLETTER_ORIGINAL_BYTES

    batches = node_batches(nodes=3, gpus=2, ticks=4, seed=3)
    before = {c: _counter_value("fleetwise_deadletter_total") for c in ("x",)}

    class Msg:
        def __init__(self, offset: int, value: bytes, key: bytes | None) -> None:
            self.topic, self.partition, self.offset, self.value, self.key = (
                T.TELEMETRY_GPU.name,
                0,
                offset,
                value,
                key,
            )
            self.headers, self.timestamp = None, 0.0

    msgs = [Msg(i, encode(b), b["node"].encode()) for i, b in enumerate(batches)]
    big = dict(batches[0], pad="x" * 700_000)
    msgs[2] = Msg(2, encode(big), big["node"].encode())
    msgs[5].key = b"node-999"
    msgs[7].key = None
    recorder = Recorder(StandInTable())
    recorder.processor.max_message_bytes = 512 * 1024
    routed = await recorder.processor.process_messages(T.TELEMETRY_GPU.name, msgs)
    dead = [r for t, _k, r in routed if t == T.DEADLETTER.name]
    reasons = sorted(d.reason for d in dead)
    assert len(dead) == 3, reasons
    assert any(r.startswith("message: ") and "over the limit of 524288 bytes" in r for r in reasons)
    assert any("message key 'node-999' differs from the payload's node" in r for r in reasons)
    assert any(r.startswith("key: message has no key") for r in reasons)
    assert all(len(d.original) <= DEADLETTER_ORIGINAL_BYTES for d in dead)
    assert recorder.processor.control.features.samples_in == 2 * (len(batches) - 3)
    assert _counter_value("fleetwise_deadletter_total") - before["x"] == 3


async def test_a_worker_over_its_state_bound_evicts_the_idle_gpus_and_counts_them() -> None:
    # 12 nodes of 2 GPUs: nodes 0-7 report for 40 ticks and stop, then nodes 8-11 start.
    # Bound 20 GPUs: idle ones go (down to 90% of the bound), the 8 reporting GPUs stay, with
    # the same features as without a bound.
    batches = node_batches(nodes=12, gpus=2, ticks=140, seed=8)
    batches = [b for b in batches if (int(b["node"][-3:]) < 8) == (b["ts"] < START_TS + 400)]
    from tests.test_streams_kafka import telemetry_events

    events = telemetry_events(batches)
    free, bounded = Recorder(StandInTable()), Recorder(StandInTable())
    bounded.processor.max_state_keys = 20
    # The worker's per-GPU gauges (make_app adds this observer to the worker's control plane).
    from prometheus_client import REGISTRY

    from fleetwise.streams import metrics as M

    bounded.processor.control.hop_observers.append(M.observe_gpu_headroom)
    before = _counter_value("fleetwise_state_evicted_keys_total")
    await free.feed(events, batch=50)
    await bounded.feed(events, batch=50)
    keys = bounded.processor.control.features.keys()
    active_keys = {f"node-{n:03d}/{g}" for n in range(8, 12) for g in range(2)}
    assert len(keys) <= 20 and active_keys <= set(keys), keys
    assert _counter_value("fleetwise_state_evicted_keys_total") - before == 24 - len(keys)
    # Evicted GPUs' gauges go with their state; the kept ones' stay.
    shown = {(s.labels["node"], s.labels["gpu"]) for m in REGISTRY.collect()
             if m.name == "fleetwise_gpu_last_hop_timestamp_seconds" for s in m.samples}
    evicted = {f"node-{n:03d}/{g}" for n in range(12) for g in range(2)} - set(keys)
    assert evicted and not evicted & {f"{n}/{g}" for n, g in shown}
    assert active_keys <= {f"{n}/{g}" for n, g in shown}

    def active(features: set[str]) -> set[str]:
        return {
            f
            for f in features
            if int(json.loads(f)["node"][-3:]) >= 8 and json.loads(f)["ts"] > START_TS + 600
        }

    assert not differences(active(bounded.features()), active(free.features())) and active(free.features())
    # the saved state holds only what is left
    await bounded.processor.checkpoint()
    from fleetwise.streams.app import decode_entry

    saved = {
        k
        for v in bounded.processor.table.data.values()
        for k in (decode_entry(v)[0].get("features") or {}).get("keys", [])
    }
    assert saved == set(keys)


@pytest.mark.kafka
@pytest.mark.timeout(120)
async def test_agent_drops_a_batch_too_large_for_the_broker_and_delivers_the_rest(
    kafka_bootstrap: str,
) -> None:
    import uuid

    from fleetwise.agent import BatchPublisher
    from fleetwise.schemas import NodeBatch
    from fleetwise.streams.kafka_io import consume_until, topic_name

    prefix = f"bp-{uuid.uuid4().hex[:8]}-"
    pub = BatchPublisher(
        kafka_bootstrap, agent="bp-node", max_buffer=50, topic_prefix=prefix, request_timeout_ms=5000
    )
    batches = node_batches(nodes=1, gpus=8, ticks=6, seed=2)
    huge = dict(batches[3], samples=[dict(s, pad="x" * 200_000) for s in batches[3]["samples"]])  # ~1.6 MB
    await pub.start()
    for b in [*batches[:3], huge, *batches[4:]]:
        pub.offer(NodeBatch.model_validate(b))
    assert await pub.wait_delivered(60), "the batches behind the oversized one were never delivered"
    await pub.stop(5)
    assert pub.stats.oversized == 1 and pub.stats.batches_sent == 5 and pub.stats.dropped == 0
    got = await consume_until(
        kafka_bootstrap, [topic_name(T.TELEMETRY_GPU, prefix)], timeout_s=30, until=lambda ms: len(ms) >= 5
    )
    assert sorted(json.loads(m.value)["ts"] for m in got) == sorted(
        b["ts"] for i, b in enumerate(batches) if i != 3
    )
    await asyncio.sleep(0)
