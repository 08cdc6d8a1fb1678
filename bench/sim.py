"""Fleet simulator throughput: GPU samples (and step records) generated per second on one core.

    .venv/bin/python bench/sim.py [--days 0.25] [--write]

Prints a table. CPU time (process_time) is reported next to wall time because the development
machine is shared; samples/s uses CPU time.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from pathlib import Path

from fleetwise.sim import FleetSimulator, SimConfig, write_trace

FLEETS = (
    ("64 GPUs, 3 gens", "h100-sxm:24,a100-sxm-80gb:16,b200:16,v100-sxm2-32gb:8"),
    ("512 GPUs, 3 gens", "h100-sxm:256,a100-sxm-80gb:128,b200:128"),
    ("2048 GPUs, 3 gens", "h100-sxm:1024,a100-sxm-80gb:512,b200:512"),
)


def run(spec: str, days: float, write: bool) -> dict:
    sim = FleetSimulator(SimConfig(gpus=spec, days=days, seed=1, failure_rate_per_1000_gpu_days=20.0))
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    samples = steps = 0
    for tick in sim.ticks():
        samples += len(tick.samples)
        steps += len(tick.steps)
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - wall
    row = {"gpus": sim.n_gpus, "samples": samples, "steps": steps, "cpu_s": cpu, "wall_s": wall}
    if write:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.process_time()
            write_trace(sim, Path(tmp) / "t.jsonl.gz")
            row["write_cpu_s"] = time.process_time() - t0
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--days", type=float, default=0.25)
    ap.add_argument("--write", action="store_true", help="also time write_trace to .jsonl.gz")
    args = ap.parse_args()
    print(
        f"python {sys.version.split()[0]} on {platform.machine()} ({platform.processor() or 'cpu'}), "
        f"{args.days:g} days at 60 s"
    )
    head = f"{'fleet':<20}{'samples':>10}{'steps':>10}{'cpu s':>8}{'wall s':>8}"
    head += f"{'samples/s':>12}{'records/s':>12}"
    if args.write:
        head += f"{'gz write samples/s':>20}"
    print(head)
    for name, spec in FLEETS:
        r = run(spec, args.days, args.write)
        line = (
            f"{name:<20}{r['samples']:>10,}{r['steps']:>10,}{r['cpu_s']:>8.2f}{r['wall_s']:>8.2f}"
            f"{r['samples'] / r['cpu_s']:>12,.0f}{(r['samples'] + r['steps']) / r['cpu_s']:>12,.0f}"
        )
        if args.write:
            line += f"{r['samples'] / r['write_cpu_s']:>20,.0f}"
        print(line)


if __name__ == "__main__":
    main()
