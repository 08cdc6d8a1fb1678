"""Soak and load: the simulated fleet at the telemetry target rate through the real broker,
first with one worker, then with three workers sharing the partitions.

Each configuration runs on fresh topics (a prefix) and a fresh consumer group: a warm-up
(`--warmup-s`), a steady phase, a 2x burst (`--burst-s`, default 60 s), and a recovery phase
at the base rate (`--after-s`). The whole configuration lasts `--minutes` (default 10). Every
`--sample-s` seconds it records each process's RSS (workers, broker, the load generator, the
output reader), the messages sent, processed and behind (sent and acknowledged by the broker
minus the workers' `fleetwise_messages_in_total`), and the group's committed lag (end offsets
minus committed offsets, as `kafka-consumer-groups` reports it). Produce-to-decision latency:
every feature and prediction record read back from the broker (by a reader process of its
own), its create time minus the earliest send time of the input batch that produced it.

Prints a table (one row per configuration and phase), writes a PNG of RSS, lag and
throughput over time (`--plot`), and `--json` writes everything measured.

    python bench/soak.py [--bootstrap HOST:PORT] [--rate 25000] [--minutes 10] [--workers 1,3]
        [--plot docs/soak.png] [--json out.json]

Without `--bootstrap` it starts its own broker with `deploy/kafka/kafka.sh` (and stops it).
This is a benchmark, not a test: it asserts nothing. "Memory flat" is read from the RSS slope
after warm-up (MB/min, least squares); "lag back to zero" from the time after the burst until
every message sent before the burst ended was processed, and the lag at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import kafka_throughput as kt  # noqa: E402  (the throughput bench's load generator and probes)

from fleetwise.schemas import topics as T  # noqa: E402
from fleetwise.streams.app import INPUT_PRODUCED_AT_HEADER  # noqa: E402
from fleetwise.streams.kafka_io import (  # noqa: E402
    PRODUCED_AT_HEADER,
    client_security_from_env,
    ensure_topics,
    start_producer,
    topic_name,
)

KAFKA_SH = REPO / "deploy" / "kafka" / "kafka.sh"
GPUS = kt.GPUS_PER_NODE
IN_KEY = f'fleetwise_messages_in_total{{component="worker",topic="{T.TELEMETRY_GPU.name}"}}'



@dataclass
class Series:
    """What one configuration recorded over time (t: seconds since its warm-up began)."""

    t: list[float] = field(default_factory=list)
    rss: dict[str, list[float]] = field(default_factory=dict)
    sent: list[int] = field(default_factory=list)
    processed: list[float] = field(default_factory=list)
    behind: list[float] = field(default_factory=list)
    committed_lag: list[float] = field(default_factory=list)  # NaN where not sampled


def rss_mb(pid: int) -> float:
    try:
        return kt.rss_mb(pid)
    except OSError:
        return float("nan")


async def committed_lag(admin, consumer, group: str, topic: str) -> float:
    """End offsets minus the group's committed offsets over the telemetry topic's partitions."""
    from aiokafka import TopicPartition

    committed = await admin.list_consumer_group_offsets(group)
    tps = [TopicPartition(topic, p) for p in range(T.TELEMETRY_GPU.partitions)]
    ends = await consumer.end_offsets(tps)
    total = 0
    for tp in tps:
        meta = committed.get(tp)
        total += ends[tp] - (meta.offset if meta is not None and meta.offset >= 0 else 0)
    return float(total)


def segment_latency(outputs: list[tuple[float, float]], start: float, end: float) -> tuple[float, float, int]:
    lat = np.array([out - sent for sent, out in outputs if start <= sent < end])
    if lat.size == 0:
        return float("nan"), float("nan"), 0
    return float(np.quantile(lat, 0.5)), float(np.quantile(lat, 0.99)), int(lat.size)


def slope_mb_per_min(t: list[float], v: list[float], after: float, before: float = float("inf")) -> float:
    pts = [(x, y) for x, y in zip(t, v, strict=True) if after <= x <= before and y == y]
    if len(pts) < 3:
        return float("nan")
    x, y = np.array(pts).T
    return float(np.polyfit(x / 60.0, y, 1)[0])


async def run_config(args, n_workers: int, payloads, broker_pid: int | None, workdir: Path) -> dict:
    """One configuration: fresh topics and group, `n_workers` workers, the phases, the series."""
    from aiokafka import AIOKafkaConsumer
    from aiokafka.admin import AIOKafkaAdminClient

    prefix = f"soak{uuid.uuid4().hex[:6]}."
    app_id = f"soak-{prefix}"
    group = app_id
    await ensure_topics(args.bootstrap, prefix=prefix)
    topic = topic_name(T.TELEMETRY_GPU, prefix)
    workers, logs, ports = [], [], []
    for i in range(n_workers):
        port = kt_free_port()
        log = open(workdir / f"worker{n_workers}-{i}.log", "wb")  # noqa: SIM115 - closed below
        workers.append(subprocess.Popen(
            [sys.executable, "-c", kt.WORKER_SCRIPT, args.bootstrap, app_id, prefix, str(port),
             str(args.take_max), str(args.checkpoint_interval), "1", "", "1"],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)))
        logs.append(log)
        ports.append(port)
    outputs_path = workdir / f"outputs{n_workers}.txt"
    reader = subprocess.Popen(
        [sys.executable, "-c", kt.COLLECTOR_SCRIPT, args.bootstrap, INPUT_PRODUCED_AT_HEADER,
         str(outputs_path), topic_name(T.FEATURES, prefix), topic_name(T.PREDICTIONS, prefix)], cwd=REPO)
    producer = await start_producer(args.bootstrap, idempotent=True, linger_ms=10)
    security = client_security_from_env()
    admin = AIOKafkaAdminClient(bootstrap_servers=args.bootstrap, **security)
    probe = AIOKafkaConsumer(bootstrap_servers=args.bootstrap, group_id=None, **security)
    await admin.start()
    await probe.start()
    series = Series()
    procs = {f"worker {i + 1}": w.pid for i, w in enumerate(workers)}
    procs["load generator"] = os.getpid()
    procs["reader"] = reader.pid
    if broker_pid:
        procs["broker"] = broker_pid
    for name in procs:
        series.rss[name] = []
    total_s = args.minutes * 60.0
    burst_s = min(args.burst_s, max(0.0, total_s - args.warmup_s - 2 * args.sample_s))
    after_s = min(args.after_s, max(0.0, total_s - args.warmup_s - burst_s))
    steady_s = max(0.0, total_s - args.warmup_s - burst_s - after_s)
    # (name, start s, end s, rate)
    plan = [("warm-up", 0.0, args.warmup_s, args.rate),
            ("steady", args.warmup_s, args.warmup_s + steady_s, args.rate),
            ("2x burst", args.warmup_s + steady_s, args.warmup_s + steady_s + burst_s, 2 * args.rate),
            ("after burst", args.warmup_s + steady_s + burst_s, total_s, args.rate)]
    try:
        for _ in range(600):  # every worker's /metrics is up
            try:
                for port in ports:
                    kt.scrape(port)
                break
            except OSError:
                await asyncio.sleep(0.2)
        wall0 = time.time()
        start = time.monotonic()
        sent = 0  # messages acknowledged or in flight
        acked = [0]
        tick = 0
        futures: list = []
        next_sample = start
        next_lag = start
        cpu0 = {name: safe_cpu(pid) for name, pid in procs.items()}

        def done(_fut) -> None:
            acked[0] += 1

        for _name, p_start, p_end, rate in plan:
            if p_end <= p_start:
                continue
            msgs_per_s = rate / GPUS
            seg_start = start + p_start
            seg_sent0 = sent
            while time.monotonic() - start < p_end:
                ts = repr(kt.START_TS + tick * kt.SAMPLE_INTERVAL_S).encode()
                for node, template in payloads[tick % len(payloads)]:
                    fut = await producer.send(topic, template.replace(kt.TS_MARK, ts), key=node,
                                              headers=[(PRODUCED_AT_HEADER, repr(time.time()).encode())])
                    fut.add_done_callback(done)
                    futures.append(fut)
                    sent += 1
                    if len(futures) > 5000:
                        await asyncio.gather(*futures)
                        futures.clear()
                    now = time.monotonic()
                    if now >= next_sample:
                        next_sample = now + args.sample_s
                        sample_lag = now >= next_lag
                        if sample_lag:
                            next_lag = now + args.lag_every_s
                        await record(series, now - start, procs, ports, acked[0], admin, probe, group, topic,
                                     sample_lag)
                    ahead = (sent - seg_sent0) / msgs_per_s - (now - seg_start)
                    if ahead > 0.02:
                        await asyncio.sleep(ahead)
                tick += 1
        await asyncio.gather(*futures)
        produce_end = time.monotonic()
        # drain: until every worker processed all that was sent (or 120 s)
        deadline = produce_end + 120
        while time.monotonic() < deadline:
            now = time.monotonic()
            with_lag = now >= next_lag
            if with_lag:
                next_lag = now + args.lag_every_s
            await record(series, now - start, procs, ports, acked[0], admin, probe, group, topic, with_lag)
            if series.behind[-1] <= 0:
                break
            await asyncio.sleep(args.sample_s)
        cpu = {name: safe_cpu(pid) - cpu0[name] for name, pid in procs.items()}
        # offsets are committed after the checkpoint that saves their effect: give the last
        # checkpoint round and commit time, then read the group's lag once more
        await asyncio.sleep(args.checkpoint_interval + 5.0)
        final_lag = float("nan")
        with contextlib.suppress(Exception):
            final_lag = await committed_lag(admin, probe, group, topic)
        outputs = kt.read_outputs(outputs_path)
    finally:
        reader.terminate()
        for w in workers:
            w.terminate()
        for w in workers:
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
        reader.wait(timeout=30)
        for log in logs:
            log.close()
        await producer.stop()
        await probe.stop()
        await admin.close()

    rows = []
    t = np.array(series.t)
    processed = np.array(series.processed)
    acked = np.array(series.sent)
    for name, p_start, p_end, rate in plan:
        if p_end <= p_start:
            continue
        p50, p99, n = segment_latency(outputs, wall0 + p_start, wall0 + p_end)
        mask = (t >= p_start) & (t <= p_end)
        idx = np.flatnonzero(mask)
        thr = offered = float("nan")
        if idx.size >= 2:
            a, b = idx[0], idx[-1]
            thr = GPUS * (processed[b] - processed[a]) / max(1e-9, t[b] - t[a])
            offered = GPUS * (acked[b] - acked[a]) / max(1e-9, t[b] - t[a])
        rows.append({"phase": name, "rate": rate, "seconds": p_end - p_start, "offered_samples_s": offered,
                     "processed_samples_s": thr,
                     "p50_ms": 1000 * p50, "p99_ms": 1000 * p99, "decisions": n,
                     "max_behind": float(np.max(np.array(series.behind)[mask])) if idx.size
                     else float("nan")})
    burst_end = plan[2][2]
    sent_at_burst_end = next((s for x, s in zip(series.t, series.sent, strict=True) if x >= burst_end), None)
    cleared_s = float("nan")
    if sent_at_burst_end is not None and burst_s > 0:
        for x, p in zip(series.t, series.processed, strict=True):
            if x >= burst_end and p >= sent_at_burst_end:
                cleared_s = x - burst_end
                break
    warm = args.warmup_s
    # Whether memory levels off: the slope over the first and the last `--slope-window-min`
    # minutes of the steady phase (before the burst), besides the one over the whole run.
    win = 60.0 * args.slope_window_min
    steady_end = plan[1][2]
    first = (warm, min(steady_end, warm + win))
    last = (max(warm, steady_end - win), steady_end)
    return {
        "rss_slope_windows_s": [first, last],
        "rss_slope_first_mb_per_min": {name: slope_mb_per_min(series.t, v, *first)
                                       for name, v in series.rss.items()},
        "rss_slope_last_mb_per_min": {name: slope_mb_per_min(series.t, v, *last)
                                      for name, v in series.rss.items()},
        "rss_at_steady_end_mb": {name: next((y for x, y in zip(series.t, v, strict=True)
                                             if x >= steady_end), None) for name, v in series.rss.items()},
        "workers": n_workers, "rows": rows, "series": series.__dict__,
        "rss_slope_mb_per_min": {name: slope_mb_per_min(series.t, v, warm) for name, v in series.rss.items()},
        "rss_after_warmup_mb": {name: next((y for x, y in zip(series.t, v, strict=True) if x >= warm), None)
                                for name, v in series.rss.items()},
        "rss_end_mb": {name: v[-1] if v else None for name, v in series.rss.items()},
        "rss_max_mb": {name: float(np.nanmax(v)) if v else None for name, v in series.rss.items()},
        "cpu_s": cpu, "backlog_cleared_after_burst_s": cleared_s,
        "behind_at_end": series.behind[-1] if series.behind else None,
        "committed_lag_at_end": final_lag,
        "plan": plan, "messages_sent": sent, "load_avg_end": os.getloadavg(),
    }


def safe_cpu(pid: int) -> float:
    try:
        return kt.cpu_s(pid)
    except OSError:
        return float("nan")


async def record(series: Series, t: float, procs: dict[str, int], ports: list[int], acked: int,
                 admin, probe, group: str, topic: str, with_lag: bool) -> None:
    processed = 0.0
    for port in ports:
        with contextlib.suppress(OSError):
            processed += kt.scrape(port).get(IN_KEY, 0.0)
    series.t.append(t)
    series.sent.append(acked)
    series.processed.append(processed)
    series.behind.append(max(0.0, acked - processed))
    lag = float("nan")
    if with_lag:
        with contextlib.suppress(Exception):  # a missed sample, not a failed bench
            lag = await committed_lag(admin, probe, group, topic)
    series.committed_lag.append(lag)
    for name, pid in procs.items():
        series.rss[name].append(rss_mb(pid))


def kt_free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def plot(results: list[dict], path: Path, rate: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(results), figsize=(6.5 * len(results), 9), squeeze=False, sharex="col")
    for col, res in enumerate(results):
        s = res["series"]
        t = np.array(s["t"]) / 60.0
        burst = res["plan"][2]
        ax = axes[0][col]
        for name, v in s["rss"].items():
            ax.plot(t, v, label=name)
        ax.set_title(f"{res['workers']} worker(s), {rate:,.0f} samples/s, 2x burst shaded")
        ax.set_ylabel("RSS (MB)")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[1][col]
        ax.plot(t, s["behind"], label="sent - processed (messages)")
        lag = np.array(s["committed_lag"], dtype=float)
        ok = ~np.isnan(lag)
        ax.plot(t[ok], lag[ok], ".-", label="group committed lag (messages)")
        ax.set_ylabel("lag (messages)")
        ax.legend(fontsize=7, loc="upper left")
        ax = axes[2][col]
        proc = np.array(s["processed"])
        if len(t) > 1:
            dt = np.diff(t * 60.0)
            ax.plot(t[1:], GPUS * np.diff(proc) / np.maximum(dt, 1e-9), label="processed samples/s")
        ax.set_ylabel("samples/s")
        ax.set_xlabel("minutes")
        ax.legend(fontsize=7, loc="upper left")
        for row in axes:
            row[col].axvspan(burst[1] / 60.0, burst[2] / 60.0, color="orange", alpha=0.15)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def print_table(results: list[dict], args, broker: str) -> None:
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs (shared), python "
          f"{platform.python_version()}; broker {broker}; {args.nodes} nodes x {GPUS} GPUs; base rate "
          f"{args.rate:,.0f} samples/s, burst {2 * args.rate:,.0f} for {args.burst_s:.0f} s; "
          f"{args.minutes:g} min per configuration")
    print("| workers | phase | target samples/s | s | offered samples/s | processed samples/s | "
          "decision p50 / p99 ms (n) | max behind (messages) |")
    print("|---|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {res['workers']} | {r['phase']} | {r['rate']:,.0f} | {r['seconds']:.0f} | "
                  f"{r['offered_samples_s']:,.0f} | {r['processed_samples_s']:,.0f} | "
                  f"{r['p50_ms']:.0f} / {r['p99_ms']:.0f} "
                  f"({r['decisions']:,}) | "
                  f"{r['max_behind']:,.0f} |")
    print()
    print("| workers | process | RSS after warm-up -> end (max) MB | slope after warm-up MB/min | CPU s |")
    print("|---|---|---|---|---|")
    for res in results:
        for name in res["rss_end_mb"]:
            print(f"| {res['workers']} | {name} | {res['rss_after_warmup_mb'][name] or float('nan'):.0f} -> "
                  f"{res['rss_end_mb'][name] or float('nan'):.0f} "
                  f"({res['rss_max_mb'][name] or float('nan'):.0f}) | "
                  f"{res['rss_slope_mb_per_min'][name]:+.2f} | {res['cpu_s'][name]:.0f} |")
    print()
    w = f"{args.slope_window_min:g} min"
    print(f"| workers | process | RSS after warm-up -> end of steady MB | slope first {w} "
          f"of steady MB/min | slope last {w} of steady MB/min |")
    print("|---|---|---|---|---|")
    for res in results:
        for name in res["rss_end_mb"]:
            print(f"| {res['workers']} | {name} | {res['rss_after_warmup_mb'][name] or float('nan'):.0f} -> "
                  f"{res['rss_at_steady_end_mb'][name] or float('nan'):.0f} | "
                  f"{res['rss_slope_first_mb_per_min'][name]:+.2f} | "
                  f"{res['rss_slope_last_mb_per_min'][name]:+.2f} |")
    print()
    for res in results:
        print(f"{res['workers']} worker(s): backlog of the burst cleared "
              f"{res['backlog_cleared_after_burst_s']:.0f} s "
              f"after it ended; behind at end {res['behind_at_end']:,.0f} messages; group committed lag "
              f"{args.checkpoint_interval + 5:.0f} s after the drain {res['committed_lag_at_end']:,.0f}; "
              f"load average at end "
              f"{res['load_avg_end'][0]:.1f}")


def container_sizes(root: object, name: str, depth: int = 0, seen: set | None = None,
                    out: dict[str, int] | None = None) -> dict[str, int]:
    """Entries of every dict, list and set reachable from `root` through fleetwise objects'
    attributes (a few levels deep; containers of more than 64 entries are not entered)."""
    seen = set() if seen is None else seen
    out = {} if out is None else out
    if id(root) in seen or depth > 4:
        return out
    seen.add(id(root))
    if isinstance(root, dict | list | set):
        out[name] = len(root)
        if isinstance(root, dict) and len(root) <= 64:
            for k, v in root.items():
                container_sizes(v, f"{name}[{k!r}]", depth + 1, seen, out)
        return out
    attrs = getattr(root, "__dict__", None)
    if attrs and type(root).__module__.startswith("fleetwise"):
        for k, v in attrs.items():
            container_sizes(v, f"{name}.{k}", depth + 1, seen, out)
    return out


async def in_process(args, payloads) -> None:
    """`--in-process-hours`: the worker's logic without the broker (`StreamProcessor` over a
    stand-in table and producer, a checkpoint every `--checkpoint-interval` s of input at
    `--rate`), fed the same node batches for that many hours of event time, plus step records
    of one 8-rank job at a time, a new one every `--job-hours` (job churn; 0: none). Prints
    the process's RSS and the sizes of every container that changed, every `--report-every-h`."""
    import gc
    from types import SimpleNamespace

    from aiokafka.partitioner import murmur2

    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    control = ControlPlane(ControlPlaneConfig())
    proc = kt.in_memory_processor(control)
    parts = T.TELEMETRY_GPU.partitions
    offsets: dict[tuple[str, int], int] = {}

    def message(topic: str, key: bytes, value: bytes) -> SimpleNamespace:
        p = (murmur2(key) & 0x7FFFFFFF) % parts
        o = offsets.get((topic, p), 0)
        offsets[topic, p] = o + 1
        return SimpleNamespace(topic=topic, partition=p, offset=o, key=key, value=value, headers=[],
                               timestamp=0)

    per_checkpoint = max(1, round(args.rate / GPUS * args.checkpoint_interval / args.nodes))  # ticks
    ticks = int(args.in_process_hours * 3600 / kt.SAMPLE_INTERVAL_S)
    per_report = max(1, int(args.report_every_h * 3600 / kt.SAMPLE_INTERVAL_S))
    history: list[tuple[float, float, float, dict[str, int]]] = []
    cpu0 = time.process_time()
    for tick in range(ticks + 1):
        ts = kt.START_TS + tick * kt.SAMPLE_INTERVAL_S
        mark = repr(ts).encode()
        msgs = [message("telemetry", node, template.replace(kt.TS_MARK, mark))
                for node, template in payloads[tick % len(payloads)]]
        for i in range(0, len(msgs), args.take_max):
            await proc.process_messages(T.TELEMETRY_GPU.name, msgs[i:i + args.take_max])
        if args.job_hours > 0 and tick % 6 == 0:  # a step record per rank every minute
            job = f"job-{int(tick * kt.SAMPLE_INTERVAL_S // (args.job_hours * 3600)):05d}"
            steps = [message("steps", job.encode(), json.dumps({
                "ts": ts, "job": job, "rank": r, "node": f"node-{r:04d}", "gpu": 0, "step": tick,
                "step_time_s": 1.0 + 0.01 * r, "compute_s": 0.8}).encode()) for r in range(8)]
            await proc.process_messages(T.TELEMETRY_STEPS.name, steps)
        if tick % per_checkpoint == 0:
            await proc.checkpoint()
        if tick % per_report == 0:
            gc.collect()
            sizes = container_sizes(proc, "worker")
            hour = tick * kt.SAMPLE_INTERVAL_S / 3600
            history.append((hour, kt.rss_mb(os.getpid()), time.process_time() - cpu0, sizes))
            hour, rss, cpu, _ = history[-1]
            print(f"# event hour {hour:g}: RSS {rss:.1f} MB, CPU {cpu:.0f} s", flush=True)
    print(f"in-process: {args.nodes} nodes x {GPUS} GPUs, {args.in_process_hours:g} event hours, "
          f"job churn every {args.job_hours:g} h; load average {os.getloadavg()[0]:.1f}")
    print("| event hour | RSS MB |")
    print("|---|---|")
    for hour, rss, _cpu, _sizes in history:
        print(f"| {hour:g} | {rss:.1f} |")
    names = sorted({n for *_, sizes in history for n in sizes})
    changed = [n for n in names if len({sizes.get(n) for *_, sizes in history[1:]}) > 1]
    print("\ncontainers whose size changed after the first report (entries at each report):")
    for n in changed:
        print(f"  {n}: " + " ".join(str(sizes.get(n, "-")) for *_, sizes in history))


async def main_async(args) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix="fleetwise-soak-"))
    payloads = kt.make_payloads(args.nodes, ticks=args.ticks, seed=args.seed)
    results = []
    for n in [int(x) for x in args.workers.split(",")]:
        res = await run_config(args, n, payloads, args.broker_pid, workdir)
        results.append(res)
        print(f"# {n} worker(s) done: {json.dumps(res['rows'])}", flush=True)
    print(f"# logs in {workdir}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bootstrap", default=None, help="an existing broker (default: start one)")
    parser.add_argument("--rate", type=float, default=25_000,
                        help="base GPU samples/s (the streaming path's latency target rate)")
    parser.add_argument("--minutes", type=float, default=10.0, help="per configuration")
    parser.add_argument("--workers", default="1,3", help="worker counts, one configuration each")
    parser.add_argument("--warmup-s", type=float, default=60.0)
    parser.add_argument("--burst-s", type=float, default=60.0)
    parser.add_argument("--after-s", type=float, default=120.0)
    parser.add_argument("--sample-s", type=float, default=2.0)
    parser.add_argument("--lag-every-s", type=float, default=10.0, help="committed-lag sampling")
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--take-max", type=int, default=500)
    parser.add_argument("--checkpoint-interval", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process-hours", type=float, default=0.0,
                        help="instead: the worker's logic in this process, no broker, this many event hours")
    parser.add_argument("--report-every-h", type=float, default=1.0, help="--in-process-hours: report every")
    parser.add_argument("--job-hours", type=float, default=2.0, help="--in-process-hours: a new job every")
    parser.add_argument("--slope-window-min", type=float, default=10.0,
                        help="RSS slope also over the first and last this many minutes of the steady phase")
    parser.add_argument("--plot", default=str(REPO / "docs" / "soak.png"))
    parser.add_argument("--json", default=None, help="write all results here")
    args = parser.parse_args()
    if args.in_process_hours:
        asyncio.run(in_process(args, kt.make_payloads(args.nodes, ticks=args.ticks, seed=args.seed)))
        return
    args.broker_pid = None
    state = None
    if args.bootstrap is None:
        state = Path(tempfile.mkdtemp(prefix="fleetwise-soak-kafka-"))
        env = dict(os.environ, KAFKA_WATCH_PID=str(os.getpid()))
        out = subprocess.run(["bash", str(KAFKA_SH), "start", str(state)], env=env, capture_output=True,
                             text=True, check=True)
        args.bootstrap = out.stdout.strip().splitlines()[-1]
        args.broker_pid = int((state / "kafka.pid").read_text())
    try:
        results = asyncio.run(main_async(args))
    finally:
        if state is not None:
            subprocess.run(["bash", str(KAFKA_SH), "stop", str(state)], check=False)
    print_table(results, args, args.bootstrap)
    if args.plot:
        plot(results, Path(args.plot), args.rate)
        print(f"plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, default=float))


if __name__ == "__main__":
    main()
