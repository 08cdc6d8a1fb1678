"""Placement benchmark: one job over 10,000 GPUs in 200 racks and 4 sites (target < 1 s).

Prints a markdown table (copied into docs/benchmarks.md, section "Placement"):

    .venv/bin/python bench/placement.py           # table
    .venv/bin/python bench/placement.py --json    # the same rows as JSON

The fleet: 1,250 HGX-style nodes of 8 GPUs (one 400 Gb/s NIC per GPU), 200 racks of 6 or 7
nodes, 50 racks per site, two GPU types per site, a 40 kW GPU power budget per rack. Live
telemetry (seeded): 30% of the nodes busy with other jobs, utilisation, temperature and power
on every GPU. Carbon per site from a config dict. Timed: indexing the inventory, reducing the
samples to the latest state per GPU, and `place_job` (DP per pool + planner on the best
pools); the total is what `fleetwise place` spends after parsing its files.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from fleetwise.planner import resolve_model
from fleetwise.planner.placement import FleetIndex, PlacementSettings, place_job, telemetry_from_samples
from fleetwise.schemas import GpuInventory, JobIntent, Nic, NodeInventory

SITE_TYPES = (
    ("h100-sxm", "a100-sxm-80gb"), ("h200", "h100-sxm"), ("b200", "h100-sxm"), ("a100-sxm-80gb", "b200"),
)
CARBON = {"site0": 420.0, "site1": 120.0, "site2": 650.0, "site3": 30.0}


def fleet(seed: int = 0) -> list[NodeInventory]:
    rng = random.Random(seed)
    invs = []
    for rack_id in range(200):
        site = rack_id // 50
        gpu = rng.choice(SITE_TYPES[site])
        rack = f"site{site}-r{rack_id:03d}"
        for k in range(7 if rack_id % 4 == 0 else 6):
            invs.append(NodeInventory(
                ts=0, node=f"{rack}-n{k}", rack=rack, site=f"site{site}",
                rack_power_budget_w=40000.0, gpus=[GpuInventory(index=i, model=gpu) for i in range(8)],
                nics=[Nic(name=f"ib{i}", speed_gbps=400.0, kind="infiniband", rdma=True) for i in range(8)],
            ))
    return invs


def samples(invs: list[NodeInventory], seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for inv in invs:
        busy = rng.random() < 0.3
        for g in inv.gpus:
            out.append({
                "ts": 1_700_000_000.0, "node": inv.node, "gpu": g.index, "model": g.model,
                "job": "other" if busy else None,
                "metrics": {
                    "DCGM_FI_DEV_GPU_UTIL": rng.uniform(85, 100) if busy else rng.uniform(0, 10),
                    "DCGM_FI_DEV_GPU_TEMP": rng.uniform(55, 80) if busy else rng.uniform(28, 45),
                    "DCGM_FI_DEV_POWER_USAGE": rng.uniform(500, 700) if busy else rng.uniform(60, 90),
                },
            })
    return out


JOBS = (("llama-70b", 1024, 512), ("llama-7b", 256, 64))


def run(repeat: int) -> list[dict]:
    invs = fleet()
    raw = samples(invs)
    rows = []
    for model, batch, gpus in JOBS:
        intent = JobIntent(job=f"{model}-{gpus}", model=resolve_model(model), global_batch=batch,
                           constraints={"max_gpus": gpus})
        times = []
        result = None
        for _ in range(repeat):
            t0 = time.perf_counter()
            index = FleetIndex(invs)
            t1 = time.perf_counter()
            tel = telemetry_from_samples(raw)
            t2 = time.perf_counter()
            result = place_job(intent, index, tel, PlacementSettings(carbon=CARBON, now_ts=1_700_000_000.0))
            t3 = time.perf_counter()
            times.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
        assert result is not None
        best = result.options[0]
        rows.append({
            "gpus_in_fleet": sum(len(i.gpus) for i in invs), "racks": 200, "sites": 4, "model": model,
            "global_batch": batch, "job_gpus": gpus, "pools": len(result.options) + len(result.rejected),
            "options": len(result.options), "planner_runs": result.planner_runs, "optimal": result.optimal,
            "best": f"{best.site}/{best.gpu_type}", "best_racks": len(best.racks),
            "best_total": round(best.total, 4), "best_step_s": round(best.step_s, 4),
            "index_s": round(min(t[0] for t in times), 4),
            "telemetry_s": round(min(t[1] for t in times), 4),
            "place_s": round(min(t[2] for t in times), 4),
            "total_s_best": round(min(t[3] for t in times), 4),
            "total_s_median": round(statistics.median(t[3] for t in times), 4),
            "first_s": round(times[0][3], 4),
            "target_s": 1.0,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--repeat", type=int, default=5, help="runs per job (best and median reported)")
    args = parser.parse_args()
    rows = run(args.repeat)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"### Placement of one job over 10,000 GPUs (one core, best / median of {args.repeat})\n")
    print("| GPUs | racks | sites | job | job GPUs | pools | planner runs | optimal | "
          "best (site/type, racks) | index s | telemetry s | place s | total s best | total s median | "
          "first run s | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['gpus_in_fleet']} | {r['racks']} | {r['sites']} | {r['model']} (batch "
              f"{r['global_batch']}) | {r['job_gpus']} | {r['pools']} | {r['planner_runs']} | "
              f"{r['optimal']} | "
              f"{r['best']}, {r['best_racks']} | {r['index_s']} | {r['telemetry_s']} | {r['place_s']} | "
              f"{r['total_s_best']} | {r['total_s_median']} | {r['first_s']} | < {r['target_s']:g} |")


if __name__ == "__main__":
    main()
