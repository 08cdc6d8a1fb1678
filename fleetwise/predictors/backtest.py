"""Backtest: score failure (and straggler) predictions against simulator labels.

Pure functions over predictions, labels and per-hop probabilities; no file I/O.

Definitions (failure side):
- alert episode: per GPU, from the first `alert: true` prediction to the first later
  `alert: false` (or the end of the trace). Repeated alert predictions are one episode.
- an episode is true when that GPU fails in [raise, end + horizon]: an open alert is a
  standing claim that the GPU fails within the horizon. Otherwise it is a false alarm.
- a failure is caught with lead L when a true episode for it was raised at least L
  before the failure; its lead time is failure ts - earliest such raise.
- precision = true episodes / all episodes; false alarms per 1,000 GPU-days.
- precision at a realistic base rate b (failures per 1,000 GPU-days):
  b * recall / (b * recall + false alarms per 1,000 GPU-days).
- precursor buckets use the *visible* precursor when `first_seen` is given: from the later
  of the precursor start and the GPU's first sample to the failure (a failure 3 h into a
  trace cannot be called 12 h ahead, whenever its precursor began); the raw precursor
  length is kept per failure as `precursor_h_raw`.
- with `first_seen` (and `trace_end`), a labelled failure is scored only when the trace watched
  its GPU then (from its first hop to the trace's end): an operator's records cover more GPUs
  and months than one trace (`failures_outside_trace` counts the rest, which still make an
  alert raised before them true).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetwise.predictors.training import REPAIR_WINDOW_H
from fleetwise.schemas import Prediction

BASE_RATE_PER_1000_GPU_DAYS = 0.5  # REFERENCE.md: Llama 3 ~0.47, Meta RSC 0.3-0.8 per 1,000 GPU-days
LEAD_30MIN_H, LEAD_12H = 0.5, 12.0
LONG_PRECURSOR_H = 18.0


@dataclass
class Episode:
    node: str
    gpu: int
    raised_ts: float
    end_ts: float | None
    source: str


def _get(p: Prediction | Mapping[str, Any], name: str) -> Any:
    return p.get(name) if isinstance(p, Mapping) else getattr(p, name, None)


def _source(p: Prediction | Mapping[str, Any]) -> str:
    for s in _get(p, "signals") or ():
        name = s.get("name") if isinstance(s, Mapping) else s.name
        if name == "source":
            return str(s.get("value") if isinstance(s, Mapping) else s.value)
    return "model"


def alert_episodes(predictions: Iterable[Prediction | Mapping[str, Any]]) -> list[Episode]:
    """Failure alert episodes per GPU, from predictions in any order."""
    by_gpu: dict[tuple[str, int], list[tuple[float, bool, str]]] = {}
    for p in predictions:
        if _get(p, "type") != "failure" or _get(p, "gpu") is None:
            continue
        by_gpu.setdefault((_get(p, "node"), int(_get(p, "gpu"))), []).append(
            (float(_get(p, "ts")), bool(_get(p, "alert")), _source(p)))
    out: list[Episode] = []
    for (node, gpu), rows in sorted(by_gpu.items()):
        rows.sort()
        open_ep: Episode | None = None
        for ts, alert, source in rows:
            if alert and open_ep is None:
                open_ep = Episode(node, gpu, ts, None, source)
            elif not alert and open_ep is not None:
                open_ep.end_ts = ts
                out.append(open_ep)
                open_ep = None
        if open_ep is not None:
            out.append(open_ep)
    return out


def _auprc(y: np.ndarray, p: np.ndarray) -> float | None:
    if len(y) == 0 or not y.any():
        return None
    from sklearn.metrics import average_precision_score

    return float(average_precision_score(y, p))


def score_failures(
    predictions: Iterable[Prediction | Mapping[str, Any]],
    labels: Sequence[Mapping[str, Any]],
    *,
    gpu_days: float,
    horizon_h: float,
    hop_labels: np.ndarray | None = None,
    hop_probs: np.ndarray | None = None,
    base_rate: float = BASE_RATE_PER_1000_GPU_DAYS,
    first_seen: Mapping[tuple[str, int], float] | None = None,
    trace_end: float | None = None,
) -> dict[str, Any]:
    """Failure-prediction metrics (see the module docstring for definitions).

    first_seen: (node, gpu) -> ts of the GPU's first sample in the trace (visible precursors).
    With it (and `trace_end`, the end of the trace's last hop), the failures scored are those of
    GPUs in the trace while it watched them: an operator's labels file may name other GPUs and
    other months. Every labelled failure still makes an alert before it true."""
    episodes = alert_episodes(predictions)
    fails = [lab for lab in labels if lab.get("kind") == "failure"]

    def watched(f: Mapping[str, Any]) -> bool:
        if first_seen is None:
            return True
        start, tf = first_seen.get((f["node"], int(f["gpu"]))), float(f["ts"])
        return start is not None and start <= tf and (trace_end is None or tf <= trace_end)

    hz = horizon_h * 3600.0
    by_gpu: dict[tuple[str, int], list[Episode]] = {}
    for ep in episodes:
        by_gpu.setdefault((ep.node, ep.gpu), []).append(ep)

    true_eps: set[int] = set()
    failure_rows = []
    outside = 0
    for f in fails:
        tf = float(f["ts"])
        key = (f["node"], int(f["gpu"]))
        lead = None
        source = None
        for ep in by_gpu.get(key, []):
            end = ep.end_ts if ep.end_ts is not None else np.inf
            if ep.raised_ts <= tf <= end + hz:
                true_eps.add(id(ep))
                if ep.raised_ts <= tf:
                    this = (tf - ep.raised_ts) / 3600.0
                    if lead is None or this > lead:
                        lead, source = this, ep.source
        pre = f.get("precursor_start_ts")
        precursor_raw = None if (f.get("abrupt") or pre is None) else (tf - float(pre)) / 3600.0
        precursor_h = precursor_raw
        if precursor_raw is not None and first_seen is not None and key in first_seen:
            precursor_h = min(precursor_raw, max(0.0, (tf - first_seen[key]) / 3600.0))
        if not watched(f):
            outside += 1
            continue
        failure_rows.append({"class": f.get("class", "unknown"), "lead_h": lead, "precursor_h": precursor_h,
                             "precursor_h_raw": precursor_raw, "source": source, "node": f["node"],
                             "gpu": int(f["gpu"]), "ts": tf})
    # Alerts raised in a repair window (a dead GPU's aftermath) are neither true nor false.
    repair: dict[tuple[str, int], list[float]] = {}
    for f in fails:
        repair.setdefault((f["node"], int(f["gpu"])), []).append(float(f["ts"]))
    false_eps = [ep for ep in episodes if id(ep) not in true_eps and not any(
        0 <= ep.raised_ts - tf <= REPAIR_WINDOW_H * 3600 for tf in repair.get((ep.node, ep.gpu), []))]
    n_true, n_false = len(true_eps), len(false_eps)

    def recall(rows: list[dict], min_lead: float) -> dict[str, Any]:
        hit = sum(1 for r in rows if r["lead_h"] is not None and r["lead_h"] >= min_lead)
        return {"n": len(rows), "caught": hit, "recall": hit / len(rows) if rows else None}

    with_pre = [r for r in failure_rows if r["precursor_h"] is not None]
    long_pre = [r for r in with_pre if r["precursor_h"] >= LONG_PRECURSOR_H]
    abrupt = [r for r in failure_rows if r["precursor_h"] is None]
    classes = sorted({r["class"] for r in failure_rows})
    fa_rate = n_false / gpu_days * 1000.0 if gpu_days > 0 else None
    r_all = recall(failure_rows, LEAD_30MIN_H)["recall"]

    def base_precision(rec: float | None) -> float | None:
        if rec is None or fa_rate is None:
            return None
        tp = base_rate * rec
        return tp / (tp + fa_rate) if tp + fa_rate > 0 else None

    leads = sorted(r["lead_h"] for r in failure_rows if r["lead_h"] is not None)
    hot = {(lab["node"], int(lab["gpu"])) for lab in labels
           if lab.get("kind") == "trap" and lab.get("type") == "hot_healthy" and lab.get("gpu") is not None}
    false_keys = {(ep.node, ep.gpu) for ep in false_eps}
    out: dict[str, Any] = {
        "horizon_h": horizon_h,
        "gpu_days": gpu_days,
        "failures": len(failure_rows),
        "failures_outside_trace": outside,  # labelled, but not of a GPU the trace watched then
        "alert_episodes": len(episodes),
        "true_alerts": n_true,
        "false_alerts": n_false,
        "precision": n_true / (n_true + n_false) if (n_true + n_false) else None,
        "false_alarms_per_1000_gpu_days": fa_rate,
        "recall_long_precursor_12h": recall(long_pre, LEAD_12H),
        "long_precursor_not_visible": sum(
            1 for r in with_pre if r["precursor_h_raw"] >= LONG_PRECURSOR_H > r["precursor_h"]),
        "recall_with_precursor_30min": recall(with_pre, LEAD_30MIN_H),
        "recall_abrupt_30min": recall(abrupt, LEAD_30MIN_H),
        "recall_all_30min": recall(failure_rows, LEAD_30MIN_H),
        "recall_all_12h": recall(failure_rows, LEAD_12H),
        "recall_by_class_30min": {c: recall([r for r in failure_rows if r["class"] == c], LEAD_30MIN_H)
                                  for c in classes},
        "recall_by_class_12h": {c: recall([r for r in failure_rows if r["class"] == c], LEAD_12H)
                                for c in classes},
        "lead_time_h": {
            "n": len(leads),
            "p10": float(np.percentile(leads, 10)) if leads else None,
            "median": float(np.median(leads)) if leads else None,
            "p90": float(np.percentile(leads, 90)) if leads else None,
            "values": [round(v, 2) for v in leads],
        },
        "rule_only_alerts": sum(1 for ep in episodes if ep.source.startswith("rule")),
        "hot_healthy_gpus": len(hot),
        "hot_healthy_flagged_share": (len(hot & false_keys) / len(hot)) if hot else None,
        "auprc": _auprc(hop_labels, hop_probs) if hop_labels is not None and hop_probs is not None else None,
        "base_rate_per_1000_gpu_days": base_rate,
        "precision_at_base_rate": base_precision(r_all),
        "precision_at_base_rate_precursor_only": base_precision(recall(with_pre, LEAD_30MIN_H)["recall"]),
        "failure_rows": failure_rows,
        "false_alert_list": [{"node": e.node, "gpu": e.gpu, "raised_ts": e.raised_ts, "source": e.source}
                             for e in false_eps],
    }
    return out


def score_all(
    predictions: Sequence[Prediction | Mapping[str, Any]],
    labels: Sequence[Mapping[str, Any]],
    *,
    gpu_days: float,
    horizon_h: float,
    job_hours: float = 0.0,
    steps: Iterable[Mapping[str, Any]] | None = None,
    hop_labels: np.ndarray | None = None,
    hop_probs: np.ndarray | None = None,
    first_seen: Mapping[tuple[str, int], float] | None = None,
    trace_end: float | None = None,
) -> dict[str, Any]:
    """Failure metrics, plus straggler metrics from the straggler detector's own scorer."""
    from fleetwise.predictors.stragglers import score_stragglers

    out = {"failure": score_failures(predictions, labels, gpu_days=gpu_days, horizon_h=horizon_h,
                                     hop_labels=hop_labels, hop_probs=hop_probs, first_seen=first_seen,
                                     trace_end=trace_end)}
    strag_preds = [p for p in predictions if _get(p, "type") != "failure"]
    if job_hours > 0:
        out["straggler"] = score_stragglers(strag_preds, list(labels), job_hours, steps=steps)  # type: ignore[arg-type]
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def metrics_rows(metrics: Mapping[str, Any]) -> list[tuple[str, str, str]]:
    """(metric, value, target) rows of the failure metrics for a table."""
    f = metrics.get("failure", metrics)

    def rec(d: Mapping[str, Any]) -> str:
        return f"{_fmt(d['recall'])} ({d['caught']}/{d['n']})"

    rows = [
        ("failures in trace", str(f["failures"]), ""),
        ("labelled failures outside it (other GPUs or times)", str(f.get("failures_outside_trace", 0)), ""),
        ("GPU-days", f"{f['gpu_days']:.0f}", ""),
        ("recall, precursor >= 18 h, lead >= 12 h", rec(f["recall_long_precursor_12h"]), ">= 0.8"),
        ("recall, any precursor, lead >= 30 min", rec(f["recall_with_precursor_30min"]), ">= 0.75"),
        ("recall, abrupt (ceiling), lead >= 30 min", rec(f["recall_abrupt_30min"]), "report"),
        ("recall, all failures, lead >= 30 min", rec(f["recall_all_30min"]), ""),
        ("precision (alert episodes)", f"{_fmt(f['precision'])} ({f['true_alerts']}/"
         f"{f['true_alerts'] + f['false_alerts']}" + (
             f"; {neither} in repair windows)" if (neither := f["alert_episodes"] - f["true_alerts"]
                                                   - f["false_alerts"]) else ")"), ">= 0.9"),
        ("false alarms / 1,000 GPU-days", _fmt(f["false_alarms_per_1000_gpu_days"]), "<= 0.05"),
        ("hot-but-healthy GPUs flagged", f"{_fmt(f['hot_healthy_flagged_share'])} of {f['hot_healthy_gpus']}",
         "<= 0.01"),
        ("AUPRC (per GPU-hop)", _fmt(f["auprc"]), ""),
        ("precision at 0.5 failures / 1,000 GPU-days", _fmt(f["precision_at_base_rate"]), ""),
        ("lead time h (p10 / median / p90)",
         " / ".join(_fmt(f["lead_time_h"][k]) for k in ("p10", "median", "p90")), ""),
        ("rule-only alert episodes", str(f["rule_only_alerts"]), ""),
    ]
    for c, d in f["recall_by_class_30min"].items():
        rows.append((f"recall {c} (>=30 min / >=12 h)", f"{rec(d)} / {rec(f['recall_by_class_12h'][c])}", ""))
    return rows


@dataclass
class BacktestRun:
    """What `backtest_trace` computed: the metrics and what a report plots."""

    metrics: dict[str, Any]
    table: Any  # training.FeatureTable of the labelled failing GPUs' hops: keys, ts, features
    probs: np.ndarray  # failure probability of each of those hops
    predictions: list[dict[str, Any]]  # the alert policy's raises and clears (every GPU)


def job_hours(steps: Iterable[Mapping[str, Any]]) -> float:
    """Sum over jobs of the span of their step records, in hours (the straggler exposure)."""
    span: dict[str, list[float]] = {}
    for s in steps:
        _widen(span, s["job"], s["ts"])
    return _span_hours(span)


def _widen(span: dict[str, list[float]], job: str, ts: float) -> None:
    first_last = span.setdefault(job, [ts, ts])
    first_last[0], first_last[1] = min(first_last[0], ts), max(first_last[1], ts)


def _span_hours(span: Mapping[str, list[float]]) -> float:
    return sum(b - a for a, b in span.values()) / 3600.0


class StepStream:
    """A backtest's step records, fed to the straggler detector in chunks as they are read;
    of each only (job, rank, ts) is kept, for scoring. A week of one record per rank per
    minute is millions of dicts; this holds 16 bytes a record."""

    def __init__(self, chunk: int = 4096) -> None:
        from fleetwise.predictors.stragglers import StragglerDetector

        self.detector = StragglerDetector()
        self.chunk = chunk
        self.predictions: list[Prediction] = []
        self._pending: list[Mapping[str, Any]] = []
        self._jobs: dict[str, int] = {}
        self._job_of = array("i")
        self._rank = array("i")
        self._ts = array("d")
        self._span: dict[str, list[float]] = {}
        self._models: dict[tuple[Any, Any], Any] = {}

    def learn_models(self, samples: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
        """Pass GPU samples through, teaching the detector each GPU's model on the way (as the
        control plane does from telemetry): step records as DESIGN.md specifies them carry none,
        and a backtest must judge ranks as the worker would."""
        models = self._models
        for sample in samples:
            key, model = (sample.get("node"), sample.get("gpu")), sample.get("model")
            if model and models.get(key) != model:
                models[key] = model
                with suppress(TypeError, ValueError):  # a bad gpu field: the sample reader names it
                    self.detector.learn_models([(str(key[0]), int(key[1]), str(model))])
            yield sample

    def append(self, record: Mapping[str, Any]) -> None:
        from fleetwise.predictors.training import bad_field, record_where

        try:
            job, rank, ts = record["job"], int(record["rank"]), float(record["ts"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"step record {len(self._ts) + 1} ({record_where(record, ('job', 'rank'))}): "
                             f"{bad_field(exc)}") from None
        self._pending.append(record)
        self._job_of.append(self._jobs.setdefault(job, len(self._jobs)))
        self._rank.append(rank)
        self._ts.append(ts)
        _widen(self._span, job, ts)
        if len(self._pending) >= self.chunk:
            self._process()

    def _process(self) -> None:
        self.predictions += [p for p in self.detector.process(self._pending) if isinstance(p, Prediction)]
        self._pending = []

    def finish(self) -> list[Prediction]:
        """Process what is left and flush the detector; the straggler predictions."""
        self._process()
        self.predictions += [p for p in self.detector.flush() if isinstance(p, Prediction)]
        return self.predictions

    def __len__(self) -> int:
        return len(self._ts)

    def job_hours(self) -> float:
        return _span_hours(self._span)

    def records(self) -> Iterator[dict[str, Any]]:
        """(job, rank, ts) of every record, in arrival order, as the scorer reads them."""
        names = list(self._jobs)
        for j, r, t in zip(self._job_of, self._rank, self._ts, strict=True):
            yield {"job": names[j], "rank": r, "ts": t}


def backtest_trace(
    samples: Iterable[Mapping[str, Any]],
    steps: StepStream,
    labels: Sequence[Mapping[str, Any]],
    predictor: Any,
) -> BacktestRun:
    """Score the failure predictor (every GPU-hop) and the straggler detector over a trace.

    `samples` (GPU sample dicts) may be a generator that appends to `steps` as it goes (one pass
    over a file: the straggler detector runs on the step records as they come, knowing the GPU
    models of the samples read so far). The samples are scored chunk by
    chunk and dropped (`policy_choice.score_hops`), and the alert policy is replayed over
    the hops' probabilities, so memory follows the hops, not the samples; only the failing
    GPUs' hops keep their features, for the report.
    """
    from fleetwise.predictors.policy_choice import replay_policy, score_hops
    from fleetwise.predictors.training import FeatureTable, label_rows

    failing = {(str(lab["node"]), int(lab["gpu"])) for lab in labels if lab.get("kind") == "failure"}
    scores = score_hops(steps.learn_models(samples), predictor, keep_keys=failing)
    horizon = predictor.model.horizon_h
    hops = FeatureTable([scores.keys[s] for s in scores.slots.tolist()], scores.ts, np.zeros((0, 0)))
    lab = label_rows(hops, labels, horizon)
    _, predictions = replay_policy(scores, labels, predictor, predictor.policy)
    strag_preds = steps.finish()
    mask = lab.score_mask
    metrics = score_all([*predictions, *strag_preds], labels, gpu_days=scores.gpu_days, horizon_h=horizon,
                        job_hours=steps.job_hours(), steps=steps.records() if len(steps) else None,
                        hop_labels=lab.y[mask],
                        hop_probs=scores.prob[mask], first_seen=scores.first_seen(),
                        trace_end=float(scores.ts.max()))
    metrics["model"] = {k: predictor.model.metadata.get(k) for k in ("version", "training_command")}
    kept = scores.kept
    table = FeatureTable([scores.keys[s] for s in scores.slots[kept].tolist()], scores.ts[kept],
                         scores.kept_x if len(kept) else np.zeros((0, 0)))
    return BacktestRun(metrics=metrics, table=table, probs=scores.prob[kept], predictions=predictions)
