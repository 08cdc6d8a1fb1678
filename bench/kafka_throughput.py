"""Kafka throughput: GPU samples/s through the real broker and one `fleetwise worker`.

A producer publishes node batches (8 GPUs per message, as agents do) at a target rate for a
duration; one worker (subprocess, memory store) consumes them through the ControlPlane. The
script prints, per phase: samples/s offered and processed, the worker's RSS at start and
end, p50/p99 latency from the producer's send to the worker's acknowledged outputs (the
worker's `fleetwise_processing_latency_seconds` histogram), the worker's CPU seconds per
sample (so what one dedicated core would sustain: 1 / that) and the machine's load average.

    python bench/kafka_throughput.py --bootstrap HOST:PORT [--rate 50000] [--seconds 300]
        [--half-rate-seconds 60] [--no-failure-predictor] [--profile-worker FILE]
        [--producer-only] [--stages]

`--producer-only` measures the load generator alone (no worker): whether it can offer the
rate at all on this machine. `--stages` measures the worker's parts one by one, in CPU time
per sample (no worker process): a plain aiokafka consumer (`getmany`) reading the bench's
messages back from the broker, and the worker's `StreamProcessor.process_messages` on the
same bytes in-process (stand-in table and producer, a checkpoint every 5 s of input at the
target rate). The worker's CPU per sample minus both is what faust and the output producer
cost. `--no-failure-predictor` runs the worker without the packaged
failure model (validation, feature windows, stragglers and policy only).

faust's own claim, for comparison: "tens of thousands of events per second per core"
(faust-streaming README). One node batch is one faust event here, so samples/s is 8x events/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fleetwise.schemas import topics as T  # noqa: E402
from fleetwise.streams.app import INPUT_PRODUCED_AT_HEADER  # noqa: E402
from fleetwise.streams.kafka_io import (  # noqa: E402
    PRODUCED_AT_HEADER,
    ensure_topics,
    start_producer,
    topic_name,
)

GPUS_PER_NODE = 8
START_TS = 1_764_489_600.0
SAMPLE_INTERVAL_S = 10.0  # event time between a node's batches


# The worker as `fleetwise worker` runs it (run_worker), with two bench-only switches: the
# failure predictor can be left out, and the process can be profiled (cProfile, written at exit).
WORKER_SCRIPT = """
import sys
from fleetwise.streams.app import run_worker
from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig
boot, app_id, prefix, port, take_max, interval, failure, profile, stagger = sys.argv[1:10]
def main():
    control = ControlPlane(ControlPlaneConfig(failure_predictor=failure == "1", stagger_hops=stagger == "1"))
    run_worker(boot, app_id=app_id, topic_prefix=prefix, metrics_port=int(port), control=control,
               take_max=int(take_max), checkpoint_interval_s=float(interval))
if profile:
    import cProfile
    prof = cProfile.Profile()
    try:
        prof.runcall(main)
    finally:
        prof.dump_stats(profile)
else:
    main()
"""

TS_MARK = b"1111111111.5"  # placeholder replaced by each message's event time


class _MemoryTable:
    """Stand-in for the worker's faust table (a plain dict)."""

    def __init__(self) -> None:
        self.data: dict = {}


async def _sent(topic: str, key: bytes, value: bytes, headers: list) -> asyncio.Future:
    done = asyncio.get_running_loop().create_future()
    done.set_result(None)
    return done


def in_memory_processor(control: Any) -> Any:
    """The worker's StreamProcessor over `control` with an in-memory table and a producer and
    changelog that complete at once: the worker's own CPU, without the broker's share."""
    from fleetwise.streams.app import StreamProcessor

    return StreamProcessor(control, _MemoryTable(), _sent, changelog=lambda partition, key, value: None)


def make_payloads(nodes: int, ticks: int, seed: int) -> list[list[tuple[bytes, bytes]]]:
    """Pre-encoded (key, node batch) templates per tick; the event time is filled in at send
    time (bytes.replace), so time moves forward without paying JSON encoding per message."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(ticks):
        ts = float(TS_MARK)
        tick = []
        for n in range(nodes):
            samples = [{
                "ts": ts, "node": f"node-{n:04d}", "gpu": g, "model": "NVIDIA H100 80GB HBM3",
                "metrics": {"DCGM_FI_DEV_GPU_TEMP": float(rng.integers(55, 80)),
                            "DCGM_FI_DEV_POWER_USAGE": float(rng.integers(300, 700)),
                            "DCGM_FI_DEV_SM_CLOCK": 1980.0, "DCGM_FI_DEV_GPU_UTIL": 95.0,
                            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": float(t // 50)},
            } for g in range(GPUS_PER_NODE)]
            raw = json.dumps({"ts": ts, "node": f"node-{n:04d}", "samples": samples}).encode()
            tick.append((f"node-{n:04d}".encode(), raw))
        out.append(tick)
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("fleetwise_") and " " in line:
            head, _, value = line.rpartition(" ")
            out[head] = out.get(head, 0.0) + float(value)
    return out


def histogram_quantile(metrics: dict[str, float], name: str, q: float, before: dict[str, float]) -> float:
    """Quantile from Prometheus cumulative buckets (difference of two scrapes = one phase)."""
    buckets = []
    for head, value in metrics.items():
        if head.startswith(name + "_bucket"):
            le = head.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), value - before.get(head, 0.0)))
    buckets.sort()
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return float("nan")
    for le, count in buckets:
        if count >= q * total:
            return le
    return float("inf")


# Reads decision topics (features; the soak adds predictions) in a process of its own, with the
# client security from the environment (parsing thousands of records at a hop
# close inside the producer's event loop would hold back the producer's own sends, whose
# send-time headers are already stamped, and inflate the very latency it measures). Writes
# "input_sent output_created" per record, seconds, one line each.
COLLECTOR_SCRIPT = """
import asyncio, sys
from aiokafka import AIOKafkaConsumer
from fleetwise.streams.kafka_io import client_security_from_env
boot, header, path, *topics = sys.argv[1:]
async def main():
    consumer = AIOKafkaConsumer(*topics, bootstrap_servers=boot, group_id=None,
                                auto_offset_reset="latest", enable_auto_commit=False,
                                **client_security_from_env())
    await consumer.start()
    with open(path, "w") as out:
        while True:
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                for r in batch:
                    sent = dict(r.headers).get(header)
                    if sent is not None:
                        out.write(f"{float(sent)!r} {r.timestamp / 1000.0!r}\\n")
            out.flush()
asyncio.run(main())
"""


def read_outputs(path: Path) -> list[tuple[float, float]]:
    """(earliest input send time, output create time) of every feature record collected so
    far: a check of the worker's latency histogram from outside the worker (produce ->
    output sent, per feature record; the input time is the earliest send time of the batch
    that produced it, so this errs long)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 2:
            out.append((float(parts[0]), float(parts[1])))
    return out


def output_latency(sink: list[tuple[float, float]], start: float, end: float, q: float) -> float:
    """Quantile of output create time - input send time over inputs sent in [start, end]."""
    lat = [out - sent for sent, out in sink if start <= sent <= end]
    return float(np.quantile(lat, q)) if lat else float("nan")


async def run_phase(args, producer, prefix: str, payloads, rate: float, seconds: float, tick0: int,
                    worker_pid: int, metrics_port: int, outputs_path: Path | None = None) -> dict:
    """Produce at `rate` samples/s for `seconds`; then wait for the worker to drain."""
    topic = topic_name(T.TELEMETRY_GPU, prefix)
    wall0 = time.time()
    msgs_per_s = rate / GPUS_PER_NODE
    before = scrape(metrics_port) if metrics_port else {}
    rss0 = rss_mb(worker_pid) if worker_pid else float("nan")
    cpu0 = cpu_s(worker_pid) if worker_pid else 0.0
    own0 = time.process_time()
    start = time.monotonic()
    sent = 0
    tick = tick0
    futures = []
    rss_max = rss0
    next_rss = start
    while time.monotonic() - start < seconds:
        if worker_pid and time.monotonic() >= next_rss:
            rss_max, next_rss = max(rss_max, rss_mb(worker_pid)), time.monotonic() + 1.0
        ts = repr(START_TS + tick * SAMPLE_INTERVAL_S).encode()
        for node, template in payloads[tick % len(payloads)]:
            raw = template.replace(TS_MARK, ts)
            futures.append(await producer.send(topic, raw, key=node,
                                               headers=[(PRODUCED_AT_HEADER, repr(time.time()).encode())]))
            sent += 1
            if len(futures) > 5000:
                await asyncio.gather(*futures)
                futures.clear()
            lag = sent / msgs_per_s - (time.monotonic() - start)
            if lag > 0.02:
                await asyncio.sleep(lag)
        tick += 1
    await asyncio.gather(*futures)
    produce_s = time.monotonic() - start
    producer_cpu_s = time.process_time() - own0
    load = os.getloadavg()[0]
    if not worker_pid:
        return {"offered_samples_s": sent * GPUS_PER_NODE / produce_s, "produce_s": produce_s,
                "producer_cpu_us_per_sample": 1e6 * producer_cpu_s / max(1, sent * GPUS_PER_NODE),
                "load": load, "next_tick": tick}
    key = f'fleetwise_messages_in_total{{component="worker",topic="{T.TELEMETRY_GPU.name}"}}'
    target = before.get(key, 0.0) + sent
    deadline = time.monotonic() + 120
    while scrape(metrics_port).get(key, 0.0) < target and time.monotonic() < deadline:
        rss_max = max(rss_max, rss_mb(worker_pid))
        await asyncio.sleep(0.2)
    drained_s = time.monotonic() - start
    wall1 = wall0 + (time.monotonic() - start)
    outputs: list[tuple[float, float]] = []
    if outputs_path is not None:
        await asyncio.sleep(1.5)  # the last outputs reach the collector's file
        outputs = read_outputs(outputs_path)
    after = scrape(metrics_port)
    done = after.get(key, 0.0) - before.get(key, 0.0)
    worker_cpu = cpu_s(worker_pid) - cpu0
    lat = "fleetwise_processing_latency_seconds"
    return {
        "worker_cpu_us_per_sample": 1e6 * worker_cpu / max(1.0, done * GPUS_PER_NODE),
        "producer_cpu_us_per_sample": 1e6 * producer_cpu_s / max(1, sent * GPUS_PER_NODE),
        "load": max(load, os.getloadavg()[0]),
        "offered_samples_s": sent * GPUS_PER_NODE / produce_s,
        "processed_samples_s": done * GPUS_PER_NODE / drained_s,
        "messages": int(done), "produce_s": produce_s, "drain_s": drained_s - produce_s,
        "rss_start_mb": rss0, "rss_end_mb": rss_mb(worker_pid),
        "rss_max_mb": max(rss_max, rss_mb(worker_pid)),
        "p50_latency_s": histogram_quantile(after, lat, 0.5, before),
        "p99_latency_s": histogram_quantile(after, lat, 0.99, before),
        "out_p50_s": output_latency(outputs, wall0, wall1, 0.5),
        "out_p99_s": output_latency(outputs, wall0, wall1, 0.99),
        "outputs": sum(1 for sent, _ in outputs if wall0 <= sent <= wall1),
        "next_tick": tick,
    }


async def main_async(args) -> None:
    prefix = f"bench{uuid.uuid4().hex[:6]}."
    await ensure_topics(args.bootstrap, prefix=prefix)
    nodes = max(1, int(args.nodes))
    payloads = make_payloads(nodes, ticks=args.ticks, seed=args.seed)
    port = args.metrics_port
    producer = await start_producer(args.bootstrap, idempotent=True, linger_ms=10)
    if args.stages:
        try:
            await run_stages(args, producer, prefix, payloads)
        finally:
            await producer.stop()
        return
    if args.producer_only:
        try:
            r = await run_phase(args, producer, prefix, payloads, args.rate, args.seconds, 0, 0, 0)
        finally:
            await producer.stop()
        print(f"producer only: target {args.rate:,.0f} samples/s, offered "
              f"{r['offered_samples_s']:,.0f} samples/s over {r['produce_s']:.0f} s, "
              f"{r['producer_cpu_us_per_sample']:.1f} us producer CPU per sample, load {r['load']:.1f}")
        return
    log = open(args.worker_log, "wb")  # noqa: SIM115 - lives as long as the worker
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER_SCRIPT, args.bootstrap, f"bench-{prefix}", prefix, str(port),
         str(args.take_max), str(args.checkpoint_interval), "0" if args.no_failure_predictor else "1",
         args.profile_worker or "", "0" if args.aligned_hops else "1"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
    )
    rows = []
    outputs_path = Path(args.worker_log).with_suffix(".outputs")
    collector = subprocess.Popen(
        [sys.executable, "-c", COLLECTOR_SCRIPT, args.bootstrap, INPUT_PRODUCED_AT_HEADER,
         str(outputs_path), topic_name(T.FEATURES, prefix)], cwd=REPO)
    try:
        for _ in range(300):
            try:
                scrape(port)
                break
            except OSError:
                await asyncio.sleep(0.2)
        # warm-up: joins the group, recovers, compiles caches
        r = await run_phase(args, producer, prefix, payloads, 2000, 5, 0, worker.pid, port)
        tick = r["next_tick"]
        phases = [("half rate (latency)", args.rate / 2, args.half_rate_seconds),
                  ("full rate (sustained)", args.rate, args.seconds)]
        for name, rate, seconds in phases:
            r = await run_phase(args, producer, prefix, payloads, rate, seconds, tick, worker.pid, port,
                                outputs_path)
            tick = r["next_tick"]
            rows.append((name, rate, seconds, r))
    finally:
        collector.terminate()
        collector.wait(timeout=30)
        await producer.stop()
        worker.terminate()
        worker.wait(timeout=30)
        log.close()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"python {platform.python_version()}; broker {args.bootstrap}; {nodes} nodes x "
          f"{GPUS_PER_NODE} GPUs, node batch = 1 message, take_max={args.take_max}, checkpoint every "
          f"{args.checkpoint_interval:g} s, failure predictor {'off' if args.no_failure_predictor else 'on'}"
          f"{', aligned hops' if args.aligned_hops else ', staggered hops'}")
    print("| phase | target samples/s | s | offered samples/s | processed samples/s | "
          "p50 latency ms | p99 latency ms | feature records: p50 / p99 ms (n) | "
          "worker RSS start -> end (max) MB | worker CPU us/sample "
          "(= samples/s per core) | producer CPU us/sample | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, rate, seconds, r in rows:
        per_core = 1e6 / r["worker_cpu_us_per_sample"] if r["worker_cpu_us_per_sample"] else float("nan")
        print(f"| {name} | {rate:,.0f} | {seconds:.0f} | {r['offered_samples_s']:,.0f} | "
              f"{r['processed_samples_s']:,.0f} | {1000 * r['p50_latency_s']:.0f} | "
              f"{1000 * r['p99_latency_s']:.0f} | {1000 * r['out_p50_s']:.0f} / {1000 * r['out_p99_s']:.0f} "
              f"({r['outputs']:,}) | {r['rss_start_mb']:.0f} -> {r['rss_end_mb']:.0f} "
              f"({r['rss_max_mb']:.0f}) | "
              f"{r['worker_cpu_us_per_sample']:.1f} (= {per_core:,.0f}) | "
              f"{r['producer_cpu_us_per_sample']:.1f} | {r['load']:.1f} |")
    print("latency = worker histogram bucket upper bound (producer send -> outputs acknowledged); "
          "feature records = output create time - earliest input send time of its batch, read back "
          "from the features topic; "
          "faust README: 'tens of thousands of events per second per core' "
          f"(here one event = {GPUS_PER_NODE} samples)")


async def run_stages(args, producer, prefix: str, payloads) -> None:
    """CPU per sample of the worker's stages, each alone (see the module docstring)."""
    from types import SimpleNamespace

    from aiokafka import AIOKafkaConsumer

    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    topic = topic_name(T.TELEMETRY_GPU, prefix)
    n_messages = int(args.stage_messages)
    sent = 0
    tick = 0
    futures = []
    while sent < n_messages:  # flat out: only the consumer below is measured
        ts = repr(START_TS + tick * SAMPLE_INTERVAL_S).encode()
        for node, template in payloads[tick % len(payloads)]:
            futures.append(await producer.send(topic, template.replace(TS_MARK, ts), key=node,
                                               headers=[(PRODUCED_AT_HEADER, repr(time.time()).encode())]))
            sent += 1
        tick += 1
    await asyncio.gather(*futures)

    consumer = AIOKafkaConsumer(topic, bootstrap_servers=args.bootstrap, group_id=None,
                                auto_offset_reset="earliest", enable_auto_commit=False,
                                max_poll_records=args.take_max)
    await consumer.start()
    records: list = []
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:
        while len(records) < sent and time.monotonic() - wall0 < 120:
            for batch in (await consumer.getmany(timeout_ms=1000)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    fetch_cpu = time.process_time() - cpu0
    samples = len(records) * GPUS_PER_NODE
    print(f"plain aiokafka consumer (getmany, max_poll_records={args.take_max}): {len(records):,} "
          f"messages, {1e6 * fetch_cpu / samples:.2f} us CPU per sample "
          f"({1e6 * fetch_cpu / len(records):.1f} us/message)")

    # The worker's processing on the same records, offset order per partition, take_max per call.
    records.sort(key=lambda r: (r.timestamp, r.partition, r.offset))
    messages = [SimpleNamespace(topic=r.topic, partition=r.partition, offset=r.offset, value=r.value,
                                headers=r.headers, timestamp=r.timestamp) for r in records]

    control = ControlPlane(ControlPlaneConfig(failure_predictor=not args.no_failure_predictor))
    processor = in_memory_processor(control)
    per_checkpoint = max(1, int(args.rate / GPUS_PER_NODE * args.checkpoint_interval))
    cpu0 = time.process_time()
    checkpoint_cpu = 0.0
    since = 0
    for i in range(0, len(messages), args.take_max):
        chunk = messages[i:i + args.take_max]
        await processor.process_messages(T.TELEMETRY_GPU.name, chunk)
        since += len(chunk)
        if since >= per_checkpoint:
            c0 = time.process_time()
            await processor.checkpoint()
            checkpoint_cpu += time.process_time() - c0
            since = 0
    total = time.process_time() - cpu0
    print(f"StreamProcessor.process_messages in-process ({'no ' if args.no_failure_predictor else ''}"
          f"failure predictor): {1e6 * total / samples:.2f} us CPU per sample "
          f"(= {samples / total:,.0f} samples/s per core), of which checkpoints every "
          f"{per_checkpoint:,} messages {1e6 * checkpoint_cpu / samples:.2f}")
    print(f"load average {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--rate", type=float, default=50_000, help="target GPU samples/s")
    parser.add_argument("--seconds", type=float, default=300, help="full-rate phase length")
    parser.add_argument("--half-rate-seconds", type=float, default=60)
    parser.add_argument("--nodes", type=int, default=1000, help="distinct nodes (x8 GPUs)")
    parser.add_argument("--ticks", type=int, default=30, help="distinct pre-encoded ticks")
    parser.add_argument("--take-max", type=int, default=500)
    parser.add_argument("--checkpoint-interval", type=float, default=5.0, help="worker state checkpoints (s)")
    parser.add_argument("--aligned-hops", action="store_true",
                        help="worker with one hop grid for all GPUs (fleetwise worker --aligned-hops)")
    parser.add_argument("--no-failure-predictor", action="store_true",
                        help="run the worker without the packaged failure model")
    parser.add_argument("--profile-worker", default=None, help="write a cProfile of the worker here")
    parser.add_argument("--producer-only", action="store_true",
                        help="measure the load generator alone (no worker) at --rate for --seconds")
    parser.add_argument("--stages", action="store_true",
                        help="measure consumer fetch and in-process processing per sample (no worker)")
    parser.add_argument("--stage-messages", type=int, default=62_500,
                        help="messages for --stages (62,500 = 10 s at 50,000 samples/s: two checkpoints)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--metrics-port", type=int, default=9464)
    parser.add_argument("--worker-log", default="/tmp/fleetwise-bench-worker.log")
    args = parser.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
