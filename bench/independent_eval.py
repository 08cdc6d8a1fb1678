"""The predictors on traces from generators written apart from the project's simulator.

`bench/independent_fleet.py` (GPU telemetry with labelled failures and traps) and
`bench/independent_steps.py` (step records with labelled stragglers, job-wide slowdowns and
traps) were each written by someone who had read only DESIGN.md's record formats, REFERENCE.md
and the shared data, not the simulator or the predictors, so their precursor shapes, noise and
traps are their own. `bench/blind_fleet.py` is a second GPU-telemetry generator by a third
author who read neither the simulator nor `independent_fleet.py` (2-minute scrapes on each
node's own clock, two sites, other models, classes and traps); no model or threshold was ever
fitted or chosen on it. `bench/liquid_fleet.py` is a third, by a fourth author who read none
of the others (a liquid-cooled Hopper/Blackwell fleet: coolant rows, GB200 trays, rollout
waves, its own classes and traps), and `bench/cloud_fleet.py` a fourth, by a fifth (a
public-cloud region: tenants come and go, driver reloads reset counters, halls scraped at
different intervals, chiller trips), which no model was trained or tuned on (gen C's seeds 0-3
trained a candidate that was not shipped, model 1.3). This script
generates seeded traces of them and scores the shipped failure model and straggler detector on
them with `fleetwise backtest --json` (the operator's command), pooled over the seeds:

    .venv/bin/python bench/independent_eval.py --fleet-seeds 10 11 12 13 --step-seeds 10 11 12 13
    .venv/bin/python bench/independent_eval.py --blind-seeds 0 1 2 3 --fleet-seeds --step-seeds
    .venv/bin/python bench/independent_eval.py --fleet-seeds 0 1 --model-dir /tmp/candidate --rules-only
    .venv/bin/python bench/independent_eval.py --liquid-seeds 10 11 12 13 --fleet-seeds --blind-seeds \
        --step-seeds
    .venv/bin/python bench/independent_eval.py --cloud-seeds 0 1 2 3 --fleet-seeds --blind-seeds \
        --step-seeds

Seeds 0-3 of gen A (`independent_fleet.py`), gen C (`liquid_fleet.py`) and the step generator
were looked at while changing the detectors or trained on (the development seeds); seeds 10 and
up were run once per change, after it (docs/benchmarks.md, "Generators written apart from the
simulator"). The model's alerts are scored (`backtest --model-alerts`) unless `--rules-only`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
FLEETWISE = [sys.executable, "-m", "fleetwise.cli"]
BUCKETS = ("recall_long_precursor_12h", "recall_with_precursor_30min", "recall_all_30min")


SCRIPTS = {"fleet": "independent_fleet.py", "steps": "independent_steps.py", "blind": "blind_fleet.py",
           "liquid": "liquid_fleet.py", "cloud": "cloud_fleet.py"}
INTERVAL_S = {"fleet": 300, "blind": 120, "liquid": 120, "cloud": 120}  # each generator's scrape interval
# GPUs a generator's fleet has that the packaged catalog lacks: the site rows an operator adds.
SITE_GPUS = {"cloud": BENCH / "cloud_site_gpus.csv"}


def add_site_gpus() -> None:
    """Add every generator's site catalog rows to this process (for benches that read the traces
    in-process rather than through `fleetwise backtest` with FLEETWISE_CATALOG_EXTRA)."""
    from fleetwise.catalog.gpus import add_gpus

    for path in SITE_GPUS.values():
        add_gpus(path.read_text("utf-8"), str(path))


def generate(kind: str, seed: int, cache: Path, **options: Any) -> Path:
    """The seeded trace of `kind` (a key of SCRIPTS) under `cache` (generated once)."""
    out = cache / f"{kind}-{seed}" / "-".join(f"{k}{v}" for k, v in sorted(options.items()))
    if not (out / "labels.jsonl").exists():
        args = [f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}"
                for k, v in options.items() if v is not False]
        subprocess.run([sys.executable, str(BENCH / SCRIPTS[kind]), "--out", str(out),
                        "--seed", str(seed), *args], check=True, stdout=subprocess.DEVNULL)
    return out


def backtest(trace_dir: Path, extra: list[str], site_gpus: Path | None = None) -> dict[str, Any]:
    env = {**os.environ, "FLEETWISE_CATALOG_EXTRA": str(site_gpus)} if site_gpus else None
    out = subprocess.run([*FLEETWISE, "backtest", "--trace", str(trace_dir / "trace.jsonl.gz"),
                          "--labels", str(trace_dir / "labels.jsonl"), "--json", *extra],
                         check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out[out.index("{"):])


def fleet_rows(kind: str, seeds: list[int], cache: Path, extra: list[str], gpus: int, days: float,
               rate: float) -> dict[str, Any]:
    pooled: dict[str, Any] = {"gpu_days": 0.0, "failures": 0, "true": 0, "false": 0, "hot": 0,
                              "hot_flagged": 0, **{b: [0, 0] for b in BUCKETS}}
    for seed in seeds:
        d = generate(kind, seed, cache, gpus=gpus, days=days, interval=INTERVAL_S[kind],
                     failures_per_1000_gpu_days=rate)
        f = backtest(d, extra, SITE_GPUS.get(kind))["failure"]
        pooled["gpu_days"] += f["gpu_days"]
        pooled["failures"] += f["failures"]
        pooled["true"] += f["true_alerts"]
        pooled["false"] += f["false_alerts"]
        pooled["hot"] += f["hot_healthy_gpus"]
        pooled["hot_flagged"] += round((f["hot_healthy_flagged_share"] or 0.0) * f["hot_healthy_gpus"])
        for b in BUCKETS:
            pooled[b][0] += f[b]["caught"]
            pooled[b][1] += f[b]["n"]
        print(f"{kind} seed {seed}: {f['failures']} failures, {f['false_alerts']} false alarms, "
              + ", ".join(f"{b} {f[b]['caught']}/{f[b]['n']}" for b in BUCKETS), flush=True)
    return pooled


def step_rows(seeds: list[int], cache: Path, hours: float) -> dict[str, dict[str, float]]:
    pooled: dict[str, dict[str, float]] = {}
    for with_model in (False, True):
        p = pooled.setdefault("with model" if with_model else "without model",
                              {"injected": 0, "on_time": 0, "found": 0, "false": 0, "job_hours": 0.0,
                               "slowdowns": 0, "slowdowns_found": 0, "job_wide_false": 0})
        for seed in seeds:
            d = generate("steps", seed, cache, hours=hours, with_model=with_model,
                         without_model=not with_model)
            s = backtest(d, [])["straggler"]
            p["injected"] += s["injected"] - s["too_short"]
            p["found"] += s["detected"]
            p["on_time"] += s["detected_on_time_reached"]
            p["false"] += s["false_flags"]
            p["job_hours"] += s["job_hours"]
            p["slowdowns"] += s["job_slowdowns"]
            p["slowdowns_found"] += s["job_slowdowns_found"]
            p["job_wide_false"] += s["job_wide_false_alerts"]
    return pooled


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fleet-seeds", type=int, nargs="*", default=[10, 11, 12, 13])
    ap.add_argument("--step-seeds", type=int, nargs="*", default=[10, 11, 12, 13])
    ap.add_argument("--blind-seeds", type=int, nargs="*", default=[0, 1, 2, 3])
    ap.add_argument("--liquid-seeds", type=int, nargs="*", default=[])
    ap.add_argument("--cloud-seeds", type=int, nargs="*", default=[])
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--failure-rate", type=float, default=30.0, help="per 1,000 GPU-days")
    ap.add_argument("--hours", type=float, default=8.0, help="of each step trace (4 jobs)")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--policy", default=None, help="'hi,k,k_memory[,hi_memory]' (backtest --policy)")
    ap.add_argument("--rules-only", action="store_true",
                    help="the rules alone (the packaged default); otherwise the model's alerts too")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fleetwise-independent"))
    args = ap.parse_args()
    extra = (["--model-dir", str(args.model_dir)] if args.model_dir else []) + (
        ["--policy", args.policy] if args.policy else []) + (["--rules-only"] if args.rules_only else
                                                             ["--model-alerts"])
    for kind, seeds in (("fleet", args.fleet_seeds), ("blind", args.blind_seeds),
                        ("liquid", args.liquid_seeds), ("cloud", args.cloud_seeds)):
        if not seeds:
            continue
        p = fleet_rows(kind, seeds, args.cache, extra, args.gpus, args.days, args.failure_rate)
        alerts = p["true"] + p["false"]
        print(f"\nfailure model ({' '.join(extra) or 'packaged'}), {kind} seeds {seeds}: "
              f"{p['gpu_days']:,.0f} GPU-days, {p['failures']} failures")
        print(f"  false alarms {p['false']} ({1000 * p['false'] / p['gpu_days']:.2f} per 1,000 GPU-days), "
              f"precision {p['true'] / alerts if alerts else float('nan'):.2f} ({p['true']}/{alerts}), "
              f"hot-but-healthy flagged {p['hot_flagged']}/{p['hot']}")
        for b in BUCKETS:
            caught, n = p[b]
            print(f"  {b}: {caught}/{n} ({caught / n if n else float('nan'):.2f})")
    if args.step_seeds:
        for name, p in step_rows(args.step_seeds, args.cache, args.hours).items():
            print(f"\nstraggler detector, step seeds {args.step_seeds}, {name}: "
                  f"{p['on_time']}/{p['injected']} found within 60 s of reaching 5% "
                  f"({p['found']} found at all), {p['false']} false episodes in {p['job_hours']:.0f} "
                  f"job-hours ({16 * p['false'] / p['job_hours']:.2f} per 16 job-hours); job-wide "
                  f"{p['slowdowns_found']}/{p['slowdowns']} found, {p['job_wide_false']} false")


if __name__ == "__main__":
    main()
