"""Straggler detection scorecard on simulator traces (issue 5 targets).

For each seed: simulate a mixed fleet (step records + labels), run StragglerDetector over
the step records in event-time order, score it with ``score_stragglers`` and print a table.
A baseline row scores NVIDIA Resiliency Extension's relative score (fastest-rank median
compute / rank compute < 0.75) on the same records, to show what knowing each GPU model's
speed buys.

    .venv/bin/python bench/stragglers.py --seeds 101 102 103 --days 7

``--model-field``: what the step records say about the GPU model. ``keep``: the simulator's
``model`` field; ``strip``: none (DESIGN.md's step record) and nothing else to learn it from,
so every rank is judged on its alike ranks and its own history; ``join``: none, the detector
learns each (node, gpu)'s model from the fleet's node inventories (`learn_models`), as the
control plane does from GPU samples and inventories. ``--ramp-s``: each injected straggler
reaches its slowdown over this many seconds instead of at once (a thermal ramp).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from fleetwise.predictors.stragglers import StragglerConfig, StragglerDetector, score_stragglers
from fleetwise.schemas import Prediction
from fleetwise.sim.config import SimConfig
from fleetwise.sim.simulator import FleetSimulator

# Seeds used while choosing the detector's settings; the scorecard uses others.
TUNING_SEEDS = (1, 2, 3)
DEFAULT_SEEDS = (101, 102, 103)


def simulate(seed: int, days: float, gpus: str, straggler_rate: float, slowdown_rate: float,
             step_interval_s: float = 60.0) -> tuple[list[dict], list[dict], list[dict]]:
    """Step records, labels and node inventories of one simulated fleet."""
    cfg = SimConfig(gpus=gpus, days=days, seed=seed, straggler_rate_per_1000_gpu_days=straggler_rate,
                    job_slowdown_rate_per_1000_job_hours=slowdown_rate,
                    step_record_interval_s=step_interval_s)
    sim = FleetSimulator(cfg)
    steps: list[dict] = []
    for tick in sim.ticks():
        steps.extend(tick.steps)
    return steps, sim.labels(), sim.inventory()


def ramp_stragglers(steps: list[dict], labels: list[dict], ramp_s: float) -> None:
    """Make each injected straggler reach its slowdown over ``ramp_s`` seconds (linear in speed)
    instead of at once: a record ``t`` into the straggle computes faster by the part of the
    slowdown not reached yet, and its step group's step time shrinks by what its slowest
    compute lost. Changes ``steps`` in place; each straggler label gets ``ramp_s``, so the
    scorer also times detection from when the slowdown reached 5%."""
    spans: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    for lab in labels:
        if lab.get("kind") == "straggler":
            lab["ramp_s"] = ramp_s
            speed = float(lab["factor"]) if float(lab["factor"]) <= 1.0 else 1.0 / float(lab["factor"])
            spans[lab["job"], lab["rank"]].append((float(lab["start_ts"]), speed))
    groups: dict[tuple[str, int, float], list[dict]] = defaultdict(list)
    for s in steps:
        groups[s["job"], s["step"], s["ts"]].append(s)
    for rows in groups.values():
        before = max(r["compute_s"] for r in rows)
        changed = False
        for s in rows:
            for start, speed in spans.get((s["job"], s["rank"]), ()):
                into = s["ts"] - start
                if 0.0 <= into < ramp_s:
                    reached = speed + (1.0 - speed) * (1.0 - into / ramp_s)  # 1.0 at start -> speed
                    s["compute_s"] = round(s["compute_s"] * speed / reached, 4)
                    changed = True
        if changed:
            step_time = round(rows[0]["step_time_s"] - (before - max(r["compute_s"] for r in rows)), 4)
            for s in rows:
                s["step_time_s"] = step_time


def job_hours(steps: list[dict]) -> float:
    span: dict[str, list[float]] = {}
    for s in steps:
        lo_hi = span.setdefault(s["job"], [s["ts"], s["ts"]])
        lo_hi[1] = s["ts"]
    return sum(hi - lo for lo, hi in span.values()) / 3600.0


def nvrx_relative(steps: list[dict], threshold: float = 0.75) -> list[Prediction]:
    """NVRx-style relative score: fastest rank's compute / this rank's compute (no model knowledge)."""
    groups: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for s in steps:
        groups[(s["job"], s["step"])].append(s)
    flagged: dict[tuple[str, int], bool] = {}
    out: list[Prediction] = []
    for (job, _step), rows in sorted(groups.items(), key=lambda kv: kv[1][0]["ts"]):
        best = min(r["compute_s"] for r in rows)
        for r in rows:
            slow = best / r["compute_s"] < threshold if r["compute_s"] > 0 else False
            if slow != flagged.get((job, r["rank"]), False):
                flagged[(job, r["rank"])] = slow
                out.append(Prediction(id=f"nvrx:{job}:{r['rank']}:{r['ts']}", type="straggler", ts=r["ts"],
                                      node=r["node"], gpu=r["gpu"], job=job, rank=r["rank"],
                                      probability=1.0 if slow else 0.0, horizon_h=0, alert=slow))
    return out


def _fmt(value: float | None, pattern: str = "{:.0f}") -> str:
    return "-" if value is None else pattern.format(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(DEFAULT_SEEDS))
    ap.add_argument("--days", type=float, default=7.0)
    ap.add_argument("--gpus", default="h100-sxm:64,a100-sxm-80gb:64,b200:32")
    # Raised above the fleet default (20) so each trace has enough slowdowns to score.
    ap.add_argument("--straggler-rate", type=float, default=150.0, help="per 1,000 GPU-days")
    ap.add_argument("--slowdown-rate", type=float, default=60.0, help="job-wide, per 1,000 job-hours")
    ap.add_argument("--step-interval", type=float, default=60.0, help="s between a rank's step records")
    ap.add_argument("--model-field", choices=["keep", "strip", "join"], nargs="+", default=["keep"],
                    help="step records with the model, without it, or without it and the model learned "
                         "from node inventories (several: one row each, on the same trace)")
    ap.add_argument("--ramp-s", type=float, default=0.0, help="stragglers ramp in over this many s")
    ap.add_argument("--baseline", action="store_true", help="also score the NVRx-style relative score")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a StragglerConfig setting for this run (e.g. alike_tolerance=0.26; repeatable)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    settings = dict(item.split("=", 1) for item in args.set if "=" in item)
    unknown = sorted(set(settings) - set(StragglerConfig.__dataclass_fields__)) or [
        item for item in args.set if "=" not in item]
    if unknown:
        ap.error(f"--set: not FIELD=VALUE of StragglerConfig: {', '.join(unknown)}")
    config = StragglerConfig(**{k: type(getattr(StragglerConfig, k))(v) for k, v in settings.items()})

    rows = []
    for seed in args.seeds:
        t0 = time.perf_counter()
        steps, labels, inventory = simulate(seed, args.days, args.gpus, args.straggler_rate,
                                            args.slowdown_rate, args.step_interval)
        sim_s = time.perf_counter() - t0
        if args.ramp_s > 0:
            ramp_stragglers(steps, labels, args.ramp_s)
        hours = job_hours(steps)
        without = [{k: v for k, v in s.items() if k != "model"} for s in steps]
        for field in args.model_field:
            det = StragglerDetector(config=config)
            if field == "join":
                det.learn_models((inv["node"], g["index"], g["model"])
                                 for inv in inventory for g in inv["gpus"])
            records = steps if field == "keep" else without
            t0 = time.perf_counter()
            out = det.process(records) + det.flush()
            det_s = time.perf_counter() - t0
            preds = [p for p in out if isinstance(p, Prediction)]
            score = score_stragglers(preds, labels, hours, steps=steps)
            rows.append({"seed": seed, "method": f"fleetwise/{field}", "records": len(steps), "sim_s": sim_s,
                         "records_per_s": len(steps) / det_s, **score})
        if args.baseline:
            base = score_stragglers(nvrx_relative(steps), labels, hours, steps=steps)
            rows.append({"seed": seed, "method": "nvrx-relative-0.75", "records": len(steps), **base})
        print(f"seed {seed}: {len(steps)} step records simulated in {sim_s:.0f} s", flush=True)

    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return
    head = (f"{'seed':>5} {'method':<19} {'job-h':>7} {'inj':>4} {'short':>5} {'found':>5} {'on-time':>8} "
            f"{'@5%':>6} {'delay steps med/p95/max':>24} {'delay s med/p95':>16} {'|dF|':>6} {'false':>5} "
            f"{'/1kjh':>6} {'jobwide found/all cause false':>30} {'rec/s':>8}")
    print(head)
    print("-" * len(head))
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for r in rows:
        ds, dt = r["delay_steps"], r["delay_s"]
        delays_steps = f"{_fmt(ds['median'])}/{_fmt(ds['p95'])}/{_fmt(ds['max'])}"
        delays_s = f"{_fmt(dt['median'])}/{_fmt(dt['p95'])}"
        jobwide = (f"{r['job_slowdowns_found']}/{r['job_slowdowns']} {r['job_slowdown_cause_right']} "
                   f"{r['job_wide_false_alerts']}")
        print(f"{r['seed']:>5} {r['method']:<19} {r['job_hours']:>7.0f} {r['injected']:>4} "
              f"{r['too_short']:>5} {r['detected']:>5} {_fmt(r['detection_rate_on_time'], '{:.1%}'):>8} "
              f"{_fmt(r['detection_rate_on_time_reached'], '{:.1%}'):>6} "
              f"{delays_steps:>24} {delays_s:>16} {_fmt(r['factor_abs_error_median'], '{:.3f}'):>6} "
              f"{r['false_flags']:>5} {_fmt(r['false_flags_per_1000_job_hours'], '{:.2f}'):>6} "
              f"{jobwide:>30} {_fmt(r.get('records_per_s')):>8}")
        if r["method"].startswith("fleetwise"):
            tot = totals[r["method"]]
            for k in ("job_hours", "injected", "detected", "detected_on_time", "detected_on_time_reached",
                      "false_flags",
                      "job_slowdowns", "job_slowdowns_found", "job_slowdown_cause_right"):
                tot[k] += r[k]
    for method, tot in totals.items():
        if not tot["injected"]:
            continue
        print(f"\nall seeds ({method}): {tot['detected_on_time']:.0f}/{tot['injected']:.0f} on time "
              f"({tot['detected_on_time'] / tot['injected']:.2%}; from the slowdown reaching 5%: "
              f"{tot['detected_on_time_reached']:.0f}, "
              f"{tot['detected_on_time_reached'] / tot['injected']:.2%}), "
              f"found {tot['detected']:.0f}, "
              f"{tot['false_flags']:.0f} false flags in {tot['job_hours']:.0f} job-hours "
              f"({1000 * tot['false_flags'] / tot['job_hours']:.2f} per 1,000 job-hours, "
              f"{16 * tot['false_flags'] / tot['job_hours']:.3f} per 16 job-hours); job-wide slowdowns "
              f"found {tot['job_slowdowns_found']:.0f}/{tot['job_slowdowns']:.0f}, cause right "
              f"{tot['job_slowdown_cause_right']:.0f}")
    missed = [(r["method"], m) for r in rows if r["method"].startswith("fleetwise") for m in r["missed"]]
    if missed:
        print("missed:", json.dumps(missed[:10], default=str))


if __name__ == "__main__":
    main()
