"""Failure-predictor evaluation on held-out simulator traces: recall/precision and false alarms.

Two kinds of traces, none used in training (training: seeds 101-1xx on the mixes in
`fleetwise predictor train`; see the model metadata):
- "val": validation traces (raised failure rate) used to choose the alert policy;
- "test": held-out traces (raised failure rate, seeds and fleet mixes never used in training
  or tuning, GPU models absent from training, other sample intervals) for recall/precision;
- "fa": a large trace at the published failure rate (0.5 per 1,000 GPU-days) and 300 s
  sampling to measure false alarms per 1,000 GPU-days with enough exposure.

    .venv/bin/python bench/failure_eval.py --sets val,test [--cache /tmp/fleetwise-eval] [--explain]
    .venv/bin/python bench/failure_eval.py --sets fa

Traces are generated in memory and cached (raw sample arrays + labels) under --cache, so a
re-run after a model change only recomputes features and predictions. Prints tables; copy
them into docs/benchmarks.md ("Predictors").
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fleetwise.predictors.backtest import LEAD_12H, LEAD_30MIN_H, score_failures
from fleetwise.predictors.failure import MODEL_FEATURES, FailurePredictor
from fleetwise.predictors.training import (
    FeatureTable,
    RawSamples,
    compute_features_raw,
    label_rows,
    raw_samples,
)


@dataclass(frozen=True)
class TraceSpec:
    name: str
    mix: str
    days: float
    seed: int
    failure_rate: float
    interval_s: float

    def key(self) -> str:
        mix = self.mix.replace(":", "x").replace(",", "_")
        return f"{mix}-d{self.days:g}-s{self.seed}-r{self.failure_rate:g}-i{self.interval_s:g}"


SETS: dict[str, list[TraceSpec]] = {
    "val": [
        TraceSpec("val-201", "b200:64,h100-sxm:32,v100-sxm2-32gb:32", 7, 201, 40, 60),
        TraceSpec("val-203", "h200:64,a100-sxm-80gb:32,b300:32", 7, 203, 40, 120),
    ],
    "test": [
        # the previous engineer's held-out trace, kept for comparison
        TraceSpec("test-202", "b200:64,h100-sxm:32,v100-sxm2-32gb:32", 7, 202, 40, 60),
        # mixes with GPU models absent from training, other sample intervals
        TraceSpec("test-302", "b300:64,h20:32,a100-sxm-40gb:32", 7, 302, 40, 120),
        TraceSpec("test-303", "h200:32,b200:64,v100-sxm2-32gb:32", 7, 303, 40, 300),
        TraceSpec("test-304", "h100-sxm:64,b100:64", 7, 304, 40, 60),
    ],
    "fa": [
        TraceSpec("fa-401", "h100-sxm:384,a100-sxm-80gb:256,b200:256,v100-sxm2-32gb:128", 30, 401, 0.5, 300),
        TraceSpec("fa-402", "h200:384,b300:256,a100-sxm-40gb:256,h20:128", 30, 402, 0.5, 300),
    ],
}


def load_raw(spec: TraceSpec, cache: Path) -> tuple[RawSamples, list[dict[str, Any]]]:
    """Raw sample arrays and labels of a simulator trace (generated once, then cached)."""
    base = cache / spec.key()
    npz, lab = base.with_suffix(".npz"), base.with_suffix(".labels.json")
    if npz.exists() and lab.exists():
        d = np.load(npz)
        meta = json.loads(str(d["meta"]))
        return RawSamples(meta, d["slots"], d["ts"], d["rows"]), json.loads(lab.read_text())
    from fleetwise.sim import FleetSimulator, SimConfig

    sim = FleetSimulator(SimConfig(gpus=spec.mix, days=spec.days, seed=spec.seed,
                                   sample_interval_s=spec.interval_s,
                                   failure_rate_per_1000_gpu_days=spec.failure_rate))
    raw = raw_samples(s for tick in sim.ticks() for s in tick.samples)
    labels = sim.labels()
    cache.mkdir(parents=True, exist_ok=True)
    np.savez(npz, meta=json.dumps(raw.meta), slots=raw.slots, ts=raw.ts, rows=raw.rows)
    lab.write_text(json.dumps(labels))
    return raw, labels


def evaluate(
    spec: TraceSpec, predictor: FailurePredictor, cache: Path
) -> tuple[dict, FeatureTable, list, np.ndarray]:
    raw, labels = load_raw(spec, cache)
    table = compute_features_raw(raw)
    lab = label_rows(table, labels, predictor.model.horizon_h)
    fresh = FailurePredictor(predictor.model, predictor.policy)  # no alert state from another trace
    preds, probs = fresh.process_arrays(table.keys, table.ts, table.features)
    m = lab.score_mask
    metrics = score_failures(preds, labels, gpu_days=table.gpu_days, horizon_h=predictor.model.horizon_h,
                             hop_labels=lab.y[m], hop_probs=probs[m], first_seen=table.first_seen())
    return metrics, table, preds, probs


def evaluate_stream(spec: TraceSpec, predictor: FailurePredictor) -> tuple[dict, None, list, None]:
    """Like `evaluate` for traces too large to hold: simulate, window and score in chunks,
    keeping only alert predictions (the feature table of 30,000 GPU-days would not fit)."""
    from fleetwise.predictors.features import GpuFeatureWindows, sample_row
    from fleetwise.sim import FleetSimulator, SimConfig

    sim = FleetSimulator(SimConfig(gpus=spec.mix, days=spec.days, seed=spec.seed,
                                   sample_interval_s=spec.interval_s,
                                   failure_rate_per_1000_gpu_days=spec.failure_rate))
    windows = GpuFeatureWindows()
    pred = FailurePredictor(predictor.model, predictor.policy)
    slot_of: dict[tuple[str, int], int] = {}
    keys: list[tuple[str, int]] = []
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    kept: list = []
    slots: list[int] = []
    ts: list[float] = []
    rows: list[list[Any]] = []

    def score(out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        cs, cts, cf = out
        if len(cs) == 0:
            return
        for sl, t in zip(cs.tolist(), cts.tolist(), strict=True):
            first.setdefault(sl, t)
            last[sl] = t
        preds, _ = pred.process_arrays([keys[i] for i in cs.tolist()], cts, cf)
        kept.extend(p for p in preds if p.alert or p.reason == "cleared")

    for tick in sim.ticks():
        for smp in tick.samples:
            key = (smp["node"], smp["gpu"])
            slot = slot_of.get(key)
            if slot is None:
                slot = slot_of[key] = windows.register(smp["node"], smp["gpu"], smp["model"])
                keys.append(key)
            slots.append(slot)
            ts.append(smp["ts"])
            rows.append(sample_row(smp["metrics"]))
        if len(ts) >= 20_000:
            score(windows.ingest(slots, ts, rows))
            slots, ts, rows = [], [], []
    score(windows.ingest(slots, ts, rows))
    score(windows.flush_arrays())
    gpu_days = sum(last[s] - first[s] + windows.hop_s for s in first) / 86400.0
    seen = {keys[sl]: t - windows.hop_s for sl, t in first.items()}
    metrics = score_failures(kept, sim.labels(), gpu_days=gpu_days, horizon_h=predictor.model.horizon_h,
                             first_seen=seen)
    return metrics, None, kept, None


def _rec(caught: int, n: int) -> str:
    return f"{caught / n:.2f} ({caught}/{n})" if n else "-"


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a proportion k/n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def poisson_upper(k: int, conf: float = 0.95) -> float:
    """Upper confidence bound of a Poisson mean given k observed events (exact, via chi2)."""
    from scipy.stats import chi2

    return float(chi2.ppf(conf, 2 * (k + 1)) / 2)


def explain(spec: TraceSpec, metrics: dict, table: FeatureTable | None, preds: list, probs: Any) -> None:
    """Print every miss (with the highest probability it reached) and every false alarm (signals)."""
    rows_by_key: dict[tuple[str, int], np.ndarray] = {}
    keys = np.array([f"{n}/{g}" for n, g in table.keys]) if table is not None else np.array([])
    for f in metrics["failure_rows"] if table is not None else ():
        pre = f["precursor_h"]
        ok = f["lead_h"] is not None and f["lead_h"] >= (LEAD_12H if (pre or 0) >= 18 else LEAD_30MIN_H)
        if ok or pre is None:
            continue
        k = f"{f['node']}/{f['gpu']}"
        idx = rows_by_key.setdefault(k, np.flatnonzero(keys == k))
        near = idx[(table.ts[idx] <= f["ts"]) & (table.ts[idx] > f["ts"] - 48 * 3600)]
        pmax = float(probs[near].max()) if len(near) else float("nan")
        # hours before the failure at which p first reached 0.5
        hit = near[probs[near] >= 0.5]
        first = (f["ts"] - table.ts[hit[0]]) / 3600 if len(hit) else None
        print(f"  MISS {spec.name} {f['class']:18s} {k:14s} precursor {pre:6.1f} h lead "
              f"{f['lead_h'] if f['lead_h'] is None else round(f['lead_h'], 1)} pmax48h {pmax:.2f} "
              f"p>=.5 first at {None if first is None else round(first, 1)} h")
    first_pred: dict[tuple[str, float], Any] = {}
    for p in preds:
        if p.alert:
            first_pred.setdefault((f"{p.node}/{p.gpu}", p.ts), p)
    for fa in metrics["false_alert_list"]:
        p = first_pred.get((f"{fa['node']}/{fa['gpu']}", fa["raised_ts"]))
        sig = ", ".join(f"{s.name}={s.value}" for s in (p.signals if p else [])[:5])
        prob = f"{p.probability:.2f}" if p else "-"
        print(f"  FALSE {spec.name} {fa['node']}/{fa['gpu']} at {fa['raised_ts']:.0f} p={prob}: {sig}")


class _CachedProbs:
    """Model stand-in that returns precomputed probabilities (policy sweeps without re-scoring)."""

    def __init__(self, model: Any, probs: np.ndarray) -> None:
        self._model, self._probs = model, probs
        self.horizon_h = model.horizon_h

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        return self._probs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def tune(specs: list[TraceSpec], predictor: FailurePredictor, cache: Path) -> None:
    """Sweep the alert policy on validation traces; print recall/false-alarm trade-offs."""
    from dataclasses import replace

    data = []
    for spec in specs:
        raw, labels = load_raw(spec, cache)
        table = compute_features_raw(raw)
        probs = predictor.model.predict_proba(table.features[:, _model_cols()])
        data.append((table, labels, probs))
    print("hi | k | k memory | lo | long@12h | precursor@30m | precision | FA/1k GPU-d")
    grid = [(hi, k, km) for hi in (0.5, 0.6, 0.7, 0.8, 0.9) for k in (1, 2, 3) for km in (2, 4, 6, 9, 12, 18)]
    for hi, k, km in grid:
            pol = replace(predictor.policy, hi=hi, lo=hi / 2, k_raise=k, k_raise_memory=km)
            tot = np.zeros(6)
            gd = 0.0
            for table, labels, probs in data:
                pred = FailurePredictor(_CachedProbs(predictor.model, probs), pol)  # type: ignore[arg-type]
                preds, _ = pred.process_arrays(table.keys, table.ts, table.features)
                m = score_failures(preds, labels, gpu_days=table.gpu_days,
                                   horizon_h=predictor.model.horizon_h, first_seen=table.first_seen())
                tot += [m["recall_long_precursor_12h"]["caught"], m["recall_long_precursor_12h"]["n"],
                        m["recall_with_precursor_30min"]["caught"], m["recall_with_precursor_30min"]["n"],
                        m["true_alerts"], m["false_alerts"]]
                gd += table.gpu_days
            print(f"{hi} | {k} | {km} | {hi / 2:.2f} | {_rec(int(tot[0]), int(tot[1]))} | "
                  f"{_rec(int(tot[2]), int(tot[3]))} | "
                  f"{_rec(int(tot[4]), int(tot[4] + tot[5]))} | {tot[5] / gd * 1000:.2f} ({int(tot[5])})")


def _model_cols() -> np.ndarray:
    from fleetwise.predictors.features import FEATURE_NAMES

    return np.array([FEATURE_NAMES.index(n) for n in MODEL_FEATURES])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", default="val,test", help="comma-separated: val, test, fa")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fleetwise-eval"))
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--explain", action="store_true", help="list every miss and false alarm")
    ap.add_argument("--policy", default=None, help="override the alert policy: 'hi,k,k_memory' (lo = hi/2)")
    ap.add_argument("--only", default=None, help="comma-separated trace names (e.g. fa-401)")
    ap.add_argument("--tune", action="store_true", help="sweep the alert policy on the val traces")
    args = ap.parse_args()
    predictor = FailurePredictor.load(args.model_dir)
    if args.policy:
        from dataclasses import replace

        hi, k, km = (float(v) for v in args.policy.split(","))
        policy = replace(predictor.policy, hi=hi, lo=hi / 2, k_raise=int(k), k_raise_memory=int(km))
        predictor = FailurePredictor(predictor.model, policy)
    if args.tune:
        tune(SETS["val"], predictor, args.cache)
        return
    meta = predictor.model.metadata
    print(f"model {meta.get('version')}: {meta.get('training_command')}")
    print(f"policy {predictor.policy}; {len(MODEL_FEATURES)} model features")
    for set_name in args.sets.split(","):
        pooled: dict[str, list[int]] = {}
        gpu_days = 0.0
        false_alerts = 0
        print(f"\n== {set_name} ==")
        header = ("trace", "GPU-days", "fail", "long>=18h @12h", "precursor @30m", "abrupt @30m",
                  "precision", "FA/1k GPU-d", "hot flagged", "AUPRC", "lead p10/med/p90 h", "cpu s")
        print(" | ".join(header))
        for spec in SETS[set_name]:
            if args.only and spec.name not in args.only.split(","):
                continue
            t0 = time.process_time()
            if set_name == "fa":
                metrics, table, preds, probs = evaluate_stream(spec, predictor)
            else:
                metrics, table, preds, probs = evaluate(spec, predictor, args.cache)
            cpu = time.process_time() - t0
            f = metrics
            for name in ("recall_long_precursor_12h", "recall_with_precursor_30min", "recall_abrupt_30min"):
                acc = pooled.setdefault(name, [0, 0])
                acc[0] += f[name]["caught"]
                acc[1] += f[name]["n"]
            for name in ("true_alerts", "false_alerts"):
                pooled.setdefault(name, [0])[0] += f[name]
            gpu_days += f["gpu_days"]
            false_alerts += f["false_alerts"]
            hot = f"{f['hot_healthy_flagged_share'] or 0:.2f} of {f['hot_healthy_gpus']}"
            lt = f["lead_time_h"]
            lead = "/".join("-" if lt[k] is None else f"{lt[k]:.1f}" for k in ("p10", "median", "p90"))
            print(" | ".join([
                spec.name, f"{f['gpu_days']:.0f}", str(f["failures"]),
                _rec(f["recall_long_precursor_12h"]["caught"], f["recall_long_precursor_12h"]["n"]),
                _rec(f["recall_with_precursor_30min"]["caught"], f["recall_with_precursor_30min"]["n"]),
                _rec(f["recall_abrupt_30min"]["caught"], f["recall_abrupt_30min"]["n"]),
                _rec(f["true_alerts"], f["true_alerts"] + f["false_alerts"]),
                f"{f['false_alarms_per_1000_gpu_days']:.2f} ({f['false_alerts']})", hot,
                "-" if f["auprc"] is None else f"{f['auprc']:.2f}", lead, f"{cpu:.0f}",
            ]))
            by_class = {c: f"{d['caught']}/{d['n']}" for c, d in f["recall_by_class_30min"].items()}
            by_class12 = {c: f"{d['caught']}" for c, d in f["recall_by_class_12h"].items()}
            print("    long precursors (>= 18 h) not visible >= 18 h in the trace: "
                  f"{f['long_precursor_not_visible']}")
            print("    by class, caught >=30 min / >=12 h of n: "
                  + ", ".join(f"{c} {by_class[c]} / {by_class12[c]}" for c in by_class))
            if args.explain:
                explain(spec, metrics, table, preds, probs)
        lp, wp, ab = (pooled[k] for k in ("recall_long_precursor_12h", "recall_with_precursor_30min",
                                          "recall_abrupt_30min"))
        ta, ae = pooled["true_alerts"][0], pooled["true_alerts"][0] + pooled["false_alerts"][0]
        fa_rate = false_alerts / gpu_days * 1000
        print(f"pooled {set_name}: {gpu_days:.0f} GPU-days; recall long>=18h @12h {_rec(*lp)} "
              f"[95% CI {wilson(*lp)[0]:.2f}-{wilson(*lp)[1]:.2f}]; precursor @30min {_rec(*wp)} "
              f"[{wilson(*wp)[0]:.2f}-{wilson(*wp)[1]:.2f}]; abrupt @30min {_rec(*ab)}; "
              f"precision {_rec(ta, ae)}; false alarms {false_alerts} = {fa_rate:.3f} per 1,000 GPU-days "
              f"(95% upper bound {poisson_upper(false_alerts) / gpu_days * 1000:.3f})")


if __name__ == "__main__":
    main()
