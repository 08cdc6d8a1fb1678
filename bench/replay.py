"""Embedded replay throughput: GPU samples/s through validation + windowed features (+ predictors).

Runs on one core (the embedded runtime is one Python thread). Lines are prepared in memory
first, so file reading and gzip are not timed: what is timed is what a worker does per
message: JSON decode + pydantic validation + catalog check, feature windows, and (with
--predictors) the failure predictor, the alert policy and the actuators.

    .venv/bin/python bench/replay.py --gpus 256 --hours 24 [--source sim|synthetic]

Prints a table; copy it into docs/benchmarks.md ("Replay throughput").

``--trace FILE`` times a recorded trace end to end instead, as ``fleetwise replay`` runs it
(file reading, gunzip, the text-block fast path, every processor, without writing the
decisions): CPU and wall seconds, GPU samples/s and records/s, and beside them ``json.loads``
over the trace's first ``--floor-lines`` lines in the same run, so a figure from a busy
machine can be read as a ratio (the issue's target, 30 days of 512 GPUs in 4 minutes, is
~92,000 GPU samples/s):

    .venv/bin/python bench/replay.py --trace e2e30.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time

import numpy as np

METRIC_KEYS = {
    "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_MEMORY_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_XID_ERRORS",
}


def synthetic_lines(gpus: int, hours: float, interval_s: float, seed: int) -> list[bytes]:
    """Plausible DCGM samples (gauges with noise, climbing counters) for an 8-GPU-node fleet."""
    rng = np.random.default_rng(seed)
    models = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA B200"]
    steps = int(hours * 3600 / interval_s)
    t0 = 1764547200.0
    sbe = np.zeros(gpus)
    lines = []
    for k in range(steps):
        ts = t0 + k * interval_s
        power = rng.uniform(100, 650, gpus)
        temp = 30 + 0.06 * power + rng.normal(0, 0.5, gpus)
        sbe += rng.random(gpus) < 0.001
        for g in range(gpus):
            lines.append(json.dumps({
                "ts": ts, "node": f"node-{g // 8:04d}", "gpu": g % 8, "uuid": f"GPU-{g:08x}",
                "model": models[(g // 8) % 3], "metrics": {
                    "DCGM_FI_DEV_GPU_TEMP": round(float(temp[g]), 1),
                    "DCGM_FI_DEV_MEMORY_TEMP": round(float(temp[g] + 5), 1),
                    "DCGM_FI_DEV_POWER_USAGE": round(float(power[g]), 1),
                    "DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_GPU_UTIL": 95,
                    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0, "DCGM_FI_DEV_XID_ERRORS": 0,
                    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": float(sbe[g]), "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0,
                    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": 0, "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": 0,
                    "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0, "DCGM_FI_DEV_ROW_REMAP_PENDING": 0,
                    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0, "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": 0,
                    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": 0,
                },
            }).encode() + b"\n")
    return lines


def sim_lines(gpus: int, hours: float, interval_s: float, seed: int) -> list[bytes]:
    from fleetwise.sim import FleetSimulator, SimConfig

    per = max(1, gpus // 3)
    cfg = SimConfig(gpus=f"h100-sxm:{per},a100-sxm-80gb:{per},b200:{gpus - 2 * per}", days=hours / 24,
                    seed=seed, sample_interval_s=interval_s)
    out = []
    for tick in FleetSimulator(cfg).ticks():
        out.extend(json.dumps(s).encode() + b"\n" for s in tick.samples)
    return out


def run(lines: list[bytes], predictors: bool, publish_features: bool = False) -> tuple[float, int, dict]:
    from fleetwise.streams.embedded import EmbeddedRuntime
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    control = ControlPlane(ControlPlaneConfig(failure_predictor=predictors, straggler_detector=predictors,
                                              publish_features=publish_features))
    runtime = EmbeddedRuntime(control)
    start = time.process_time()
    runtime.feed_lines(lines, "bench")
    summary = runtime.finish()
    elapsed = time.process_time() - start
    return elapsed, summary.samples, dict(summary.outputs)


def trace_main(path: str, floor_lines: int) -> None:
    """End-to-end replay of one trace file, with a json.loads floor measured in the same run."""
    from itertools import islice
    from pathlib import Path

    from fleetwise.streams.embedded import read_text_blocks, replay, replay_process
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    control = ControlPlane(ControlPlaneConfig(publish_features=False))
    with replay_process():  # as `fleetwise replay`
        wall, cpu = time.perf_counter(), time.process_time()
        summary = replay([Path(path)], None, control=control).summary
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    records = summary.samples + summary.steps
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before the floor's lines
    lines = list(islice((line for text in read_text_blocks(Path(path)) for line in text.splitlines()),
                        floor_lines))
    start = time.process_time()
    for line in lines:
        json.loads(line)
    floor = len(lines) / (time.process_time() - start)
    print(f"# {path}: {summary.samples:,} GPU samples, {summary.steps:,} step records, "
          f"{len(summary.bad_lines)} bad lines; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, one thread; start-up not included")
    print(f"# json.loads over the first {len(lines):,} lines: {floor:,.0f} lines/s")
    print(f"wall {wall:.1f} s, CPU {cpu:.1f} s; {summary.samples / cpu:,.0f} GPU samples/s and "
          f"{records / cpu:,.0f} records/s of CPU ({records / cpu / floor:.2f}x json.loads); "
          f"peak RSS {rss:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--interval", type=float, default=60.0, help="sample interval, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--source", choices=["synthetic", "sim"], default="synthetic")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row; the fastest is reported")
    ap.add_argument("--trace", help="time this trace file end to end instead (see above)")
    ap.add_argument("--floor-lines", type=int, default=200_000, help="lines for the json.loads floor")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one core: numpy/sklearn must not fan out
    if args.trace:
        trace_main(args.trace, args.floor_lines)
        return
    gen = sim_lines if args.source == "sim" else synthetic_lines
    t = time.perf_counter()
    lines = gen(args.gpus, args.hours, args.interval, args.seed)
    prep = time.perf_counter() - t
    print(f"# {len(lines):,} sample lines from {args.source} ({args.gpus} GPUs x {args.hours} h at "
          f"{args.interval:.0f} s) prepared in {prep:.1f} s; {platform.processor() or platform.machine()}, "
          f"Python {platform.python_version()}, CPU time of one thread")
    print(f"| {'pipeline':<44} | {'samples':>10} | {'CPU s':>7} | {'samples/s':>10} | target | speed |")
    print(f"|{'-' * 46}|{'-' * 12}|{'-' * 9}|{'-' * 12}|--------|-------|")
    from fleetwise.predictors.features import SAMPLE_DECODER
    from fleetwise.streams.embedded import CHUNK

    def parse_floor() -> tuple[float, int, dict]:
        # The floor every JSON pipeline pays: parsing the lines, nothing else.
        start = time.process_time()
        for line in lines:
            json.loads(line)
        return time.process_time() - start, len(lines), {}

    def decode_only() -> tuple[float, int, dict]:
        # The fast path's decode alone: sample lines validated into structs, CHUNK per call.
        start = time.process_time()
        for k in range(0, len(lines), CHUNK):
            SAMPLE_DECODER.samples(lines[k:k + CHUNK])
        return time.process_time() - start, len(lines), {}

    rows = [
        ("json.loads only (parsing floor, no validation)", parse_floor, ""),
        ("decode only (fast path, validated structs)", decode_only, ""),
        ("validation + features", lambda: run(lines, False, False), "100,000"),
        ("validation + features + predictors (replay)", lambda: run(lines, True, False), "100,000"),
        ("... + feature records (as the worker)", lambda: run(lines, True, True), ""),
    ]
    # Shared machines are noisy: every row runs --repeat times, interleaved, and the fastest
    # run of each is reported (the ratios between rows are the robust figure).
    best: dict[str, tuple[float, int, dict]] = {}
    for _ in range(args.repeat):
        for label, fn, _target in rows:
            got = fn()
            if label not in best or got[0] < best[label][0]:
                best[label] = got
    floor = best[rows[0][0]][0] / best[rows[0][0]][1]
    for label, _fn, target in rows:
        elapsed, n, outputs = best[label]
        rate = n / elapsed if elapsed else float("inf")
        print(f"| {label:<44} | {n:>10,} | {elapsed:>7.2f} | {rate:>10,.0f} | {target:>6} | "
              f"{rate * floor:.2f}x json.loads |")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"# outputs (last run): {outputs}; peak RSS {rss:.0f} MiB")


if __name__ == "__main__":
    main()
