"""Thermal headroom predictions (fleetwise.predictors.trends) against what the traces show.

A `thermal` prediction says a GPU has no headroom to its thermal limit at full power within
24 h. What a trace can confirm:

- a *warning episode* (from a GPU's first prediction to the one that clears it) raised while
  the GPU was below its limit is a forecast; it comes true when the GPU's hottest sample reaches the
  limit within 24 h of the episode's start, or its thermal-interface failure starts throttling
  it then; precision = forecasts that come true (episodes raised at the limit are counted apart);
- a *limit episode* (a hop at or over the limit after 24 h without one) was warned when a
  prediction came 1-24 h before it (recall, and the lead). Episodes that start with one of the
  simulator's sudden thermal events (a `thermal` straggler label starting in the hour before: a
  throttle with no build-up) are counted apart: nothing in the telemetry announces them;
- thermal-interface failures (the simulator's labels carry when throttling starts): warned
  before their throttling, and how long before.

The predictor's settings (limit 87 C, forecast error 2 C, drift from 12 h of lag gap, floor 0.2)
were chosen on the plain simulator (one 512-GPU day, seed 1, and the unit tests' trace). Sets
"test" (plain simulator, other seeds and mixes) and "shifted" (fleetwise.sim.randomize's
shifted family: hotter rooms, worse cooling, more hot-but-healthy GPUs) were never used for it.

    .venv/bin/python bench/thermal_eval.py --cache /tmp/fw16/cache --sets test,shifted
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failure_eval import SETS, load_raw  # noqa: E402

from fleetwise.predictors.features import FEATURE_NAMES  # noqa: E402
from fleetwise.predictors.training import compute_features_raw  # noqa: E402
from fleetwise.predictors.trends import ThermalHeadroom, TrendConfig  # noqa: E402

HORIZON_S = 24 * 3600.0
MIN_LEAD_S = 3600.0
_TMAX = FEATURE_NAMES.index("temp_max")


def score_trace(spec: Any, cache: Path, config: TrendConfig) -> dict[str, Any]:
    raw, labels = load_raw(spec, cache)
    table = compute_features_raw(raw)
    preds, _ = ThermalHeadroom(config).process_arrays(table.keys, table.ts, table.features)
    # Per GPU: hop ends at or over the limit.
    at_limit: dict[tuple[str, int], list[float]] = defaultdict(list)
    for i in np.flatnonzero(table.features[:, _TMAX] >= config.limit_c):
        at_limit[table.keys[i]].append(float(table.ts[i]))
    throttle = {(lab["node"], int(lab["gpu"])): lab for lab in labels
                if lab.get("kind") == "failure" and lab.get("class") == "thermal_interface"}
    hot_healthy = {(lab["node"], int(lab["gpu"])) for lab in labels
                   if lab.get("kind") == "trap" and lab.get("type") == "hot_healthy"}
    sudden: dict[tuple[str, int], list[float]] = defaultdict(list)
    for lab in labels:
        if lab.get("kind") == "straggler" and lab.get("cause") == "thermal":
            sudden[(lab["node"], int(lab["gpu"]))].append(float(lab["start_ts"]))
    # Each GPU's warning episodes: from a prediction while none was open to the one that clears
    # (a chance under half the lowest band); `watched` holds the times a GPU was under watch.
    starts: dict[tuple[str, int], list[tuple[float, bool]]] = defaultdict(list)  # (start, at limit)
    watched: dict[tuple[str, int], list[tuple[float, float]]] = defaultdict(list)
    open_since: dict[tuple[str, int], float] = {}
    clear_below = config.bands[0] / 2.0
    for p in preds:
        key, t = (p.node, int(p.gpu)), float(p.ts)
        if key not in open_since:
            headroom_now = next(s.value for s in p.signals if s.name == "headroom_c")
            starts[key].append((t, headroom_now is not None and headroom_now <= 0))  # None: no temperature
            open_since[key] = t
        if p.probability < clear_below:
            watched[key].append((open_since.pop(key), t))
    for key, t in open_since.items():
        watched[key].append((t, np.inf))
    # Warning episodes and whether they came true.
    episodes = true_eps = on_hot = raised_at_limit = 0
    for key, eps in starts.items():
        for t0, at_limit_then in eps:
            on_hot += key in hot_healthy
            if at_limit_then:
                raised_at_limit += 1
                continue
            episodes += 1
            reached = any(t0 <= t <= t0 + HORIZON_S for t in at_limit.get(key, []))
            lab = throttle.get(key)
            tim = lab is not None and t0 <= lab["throttle_start_ts"] + 3600.0 and lab["ts"] >= t0
            true_eps += reached or tim
    # Limit episodes warned 1-24 h ahead.
    limit_eps = limit_warned = limit_sudden = 0
    leads: list[float] = []
    for key, times in at_limit.items():
        firsts = [t for k, t in enumerate(times) if k == 0 or t - times[k - 1] > HORIZON_S]
        for t0 in firsts:
            if t0 - table.ts.min() < HORIZON_S:
                continue  # no day of history to be warned in
            if any(t0 - 3600.0 <= t <= t0 for t in sudden.get(key, [])):
                limit_sudden += 1
                continue
            limit_eps += 1
            # Warned: under watch at some time 1-24 h before (its lead: from the latest such start).
            ahead = [a for a, b in watched.get(key, []) if a <= t0 - MIN_LEAD_S and b >= t0 - HORIZON_S]
            if ahead:
                limit_warned += 1
                leads.append(min((t0 - max(ahead)) / 3600.0, HORIZON_S / 3600.0))
    # Thermal-interface failures warned before their throttling starts.
    tim_n = tim_warned = 0
    tim_leads: list[float] = []
    for key, lab in throttle.items():
        start = lab["throttle_start_ts"]
        if start - table.ts.min() < HORIZON_S:
            continue
        tim_n += 1
        before = [a for a, b in watched.get(key, []) if a < start and b >= lab["precursor_start_ts"]]
        if before:
            tim_warned += 1
            tim_leads.append((start - max(before[-1], lab["precursor_start_ts"])) / 3600.0)
    return {"name": spec.name, "gpu_days": table.gpu_days, "predictions": len(preds),
            "gpus_warned": len(starts), "episodes": episodes, "true": true_eps,
            "raised_at_limit": raised_at_limit, "on_hot_healthy": on_hot, "hot_healthy": len(hot_healthy),
            "limit_eps": limit_eps, "limit_sudden": limit_sudden, "limit_warned": limit_warned,
            "leads": leads, "tim": tim_n, "tim_warned": tim_warned, "tim_leads": tim_leads}


def _frac(k: int, n: int) -> str:
    return f"{k / n:.2f} ({k}/{n})" if n else "- (0/0)"


def _med(values: list[float]) -> str:
    return f"{float(np.median(values)):.1f}" if values else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fleetwise-eval"))
    ap.add_argument("--sets", default="test,shifted",
                    help="sets of bench/failure_eval.py, comma-separated")
    args = ap.parse_args()
    config = TrendConfig()
    print("| set | trace | GPU-days | predictions | GPUs warned | forecasts come true (24 h) | episodes "
          "raised at the limit | episodes on hot-but-healthy GPUs | limit episodes warned 1-24 h ahead | "
          "median lead (h) | sudden limit episodes | thermal-interface failures warned before throttling | "
          "median lead (h) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for set_name in args.sets.split(","):
        rows = [score_trace(spec, args.cache, config) for spec in SETS[set_name]]
        total = {k: sum(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], int | float)}
        total["leads"] = [x for r in rows for x in r["leads"]]
        total["tim_leads"] = [x for r in rows for x in r["tim_leads"]]
        total["name"] = "all"
        for r in [*rows, total]:
            print(f"| {set_name} | {r['name']} | {r['gpu_days']:,.0f} | {r['predictions']} | "
                  f"{r['gpus_warned']} | "
                  f"{_frac(r['true'], r['episodes'])} | {r['raised_at_limit']} | "
                  f"{r['on_hot_healthy']} (of {r['hot_healthy']} such GPUs) | "
                  f"{_frac(r['limit_warned'], r['limit_eps'])} | {_med(r['leads'])} | {r['limit_sudden']} | "
                  f"{_frac(r['tim_warned'], r['tim'])} | {_med(r['tim_leads'])} |", flush=True)


if __name__ == "__main__":
    main()
