"""Feature-window throughput over arrays (no decoding), with and without link errors.

Node-peer context (docs/predictors.md) looks at the closes of nodes with recent NVLink/PCIe
errors only; its worst case is a fleet whose every GPU errs in every sample, where every
close is paired with its node's other GPUs. This times `GpuFeatureWindows.ingest` (CPU
seconds, best of `--repeat`) on a synthetic fleet of `--nodes` x 8 GPUs, samples every
`--interval` seconds (60 by default), in chunks of `--chunk` samples (20,000 by default, as
`compute_features_raw` feeds it; a replay hands over 65,536), once with no link errors and
once with NVLink CRC errors in every sample:

    .venv/bin/python bench/feature_windows.py --nodes 64 --hours 24
    .venv/bin/python bench/feature_windows.py --nodes 64 --hours 48 --interval 300 --chunk 65536

A call's samples span chunk / GPUs x interval seconds: 65,536 samples of 512 GPUs at 300 s are
~64 ten-minute hops, what a replay of a 5-minute trace gives each call.

Run it on two commits alternately to compare them (docs/benchmarks.md, "Node-peer context").
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from fleetwise.predictors.features import INPUT_FIELDS, GpuFeatureWindows


def fleet_arrays(
    nodes: int, hours: float, link_errors: bool, seed: int, interval: float = 60.0
) -> tuple[list[int], np.ndarray, np.ndarray]:
    """Slots (registered in a fresh windows), timestamps and INPUT_FIELDS rows, tick by tick."""
    rng = np.random.default_rng(seed)
    n_gpu, n_t = nodes * 8, int(hours * 3600 / interval)
    col = {f: i for i, f in enumerate(INPUT_FIELDS)}
    rows = np.full((n_gpu * n_t, len(INPUT_FIELDS)), np.nan)
    rows[:, col["DCGM_FI_DEV_GPU_TEMP"]] = 60 + rng.normal(size=len(rows))
    rows[:, col["DCGM_FI_DEV_POWER_USAGE"]] = 400.0 + 20 * rng.normal(size=len(rows))
    errors = 3.0 if link_errors else 0.0
    ticks = np.repeat(np.arange(n_t, dtype=float), n_gpu)
    rows[:, col["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"]] = ticks * errors
    ts = 1764547200.0 + np.repeat(np.arange(n_t) * interval, n_gpu)
    return list(range(n_gpu)), ts, rows


def time_ingest(nodes: int, hours: float, link_errors: bool, seed: int, interval: float = 60.0,
                chunk: int = 20_000) -> tuple[int, float]:
    slots, ts, rows = fleet_arrays(nodes, hours, link_errors, seed, interval)
    windows = GpuFeatureWindows()
    for g in range(nodes * 8):
        windows.register(f"node-{g // 8:04d}", g % 8, "NVIDIA H100 80GB HBM3")
    sl = np.tile(np.asarray(slots), len(ts) // len(slots))
    start = time.process_time()
    for k in range(0, len(sl), chunk):
        windows.ingest(sl[k:k + chunk], ts[k:k + chunk], rows[k:k + chunk])
    windows.flush_arrays()
    return len(sl), time.process_time() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--hours", type=float, default=24.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--interval", type=float, default=60.0, help="sample interval, s")
    ap.add_argument("--chunk", type=int, default=20_000, help="samples per ingest call")
    args = ap.parse_args()
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}; "
          f"{args.nodes} nodes x 8 GPUs, {args.hours:g} h at {args.interval:g} s, chunks of {args.chunk:,}")
    print("link errors        samples   CPU s (best)   samples/s")
    for link_errors in (False, True):
        runs = [time_ingest(args.nodes, args.hours, link_errors, args.seed, args.interval, args.chunk)
                for _ in range(args.repeat)]
        n, cpu = runs[0][0], min(c for _, c in runs)
        print(f"{'every sample' if link_errors else 'none':<16} {n:>9,}   {cpu:>12.2f}   {n / cpu:>9,.0f}")


if __name__ == "__main__":
    main()
