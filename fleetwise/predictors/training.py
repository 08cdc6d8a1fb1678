"""Dataset building and fitting for the failure predictor: pure functions over records.

The CLI (`fleetwise predictor train`) does the I/O: it generates or reads traces and
labels, and hands plain dicts to these functions.

Labels: a GPU-hop (a closed feature window ending at t) is positive when that GPU fails
in (t, t + horizon]. For training only, positive hops from before the failure's precursor
began (and every hop before an abrupt failure) are left out: by construction nothing in
the data distinguishes them from healthy hops, so they only teach noise. Hops in the
repair window after a failure are left out of training and scoring.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fleetwise.catalog import UnknownGpuError
from fleetwise.predictors.failure import MODEL_FEATURES, AlertPolicy, FailureModel
from fleetwise.predictors.features import FEATURE_NAMES, N_ROW, GpuFeatureWindows, sample_row
from fleetwise.schemas import parse_timestamp

HORIZON_H = 48.0  # predict failures within 2 days: long enough for the 12 h lead target
REPAIR_WINDOW_H = 24.0  # after a failure the GPU is out (or replaced); its hops are not scored


@dataclass
class FeatureTable:
    """Closed GPU-hops of one trace: keys (node, gpu), hop-end ts, FEATURE_NAMES matrix."""

    keys: list[tuple[str, int]]
    ts: np.ndarray
    features: np.ndarray
    models: list[str] = field(default_factory=list)
    gpu_days: float = 0.0
    dropped_late: int = 0
    dropped_duplicate: int = 0
    samples: int = 0

    def __len__(self) -> int:
        return len(self.ts)

    def first_seen(self, hop_s: float = 600.0) -> dict[tuple[str, int], float]:
        """(node, gpu) -> start of the GPU's first hop in the table (for visible precursors)."""
        out: dict[tuple[str, int], float] = {}
        for key, t in zip(self.keys, self.ts.tolist(), strict=True):
            if key not in out or t - hop_s < out[key]:
                out[key] = t - hop_s
        return out


@dataclass
class RawSamples:
    """GPU samples as arrays: slot per sample (index into `meta`), ts, rows (`sample_row`: INPUT_FIELDS,
    then the board id; rows saved before the board column have N_INPUT columns, read as naming none).

    The form the feature windows ingest; lets an evaluation keep a trace in memory (or on
    disk) and recompute features without re-parsing dicts."""

    meta: list[dict[str, Any]]  # per slot: node, gpu, model, rack, site (first-seen order)
    slots: np.ndarray
    ts: np.ndarray
    rows: np.ndarray

    def __len__(self) -> int:
        return len(self.ts)


def raw_samples(samples: Iterable[dict[str, Any]], block: int = 200_000) -> RawSamples:
    """Collect GPU-sample dicts (event-time order) into RawSamples."""
    slot_of: dict[tuple[str, int], int] = {}
    meta: list[dict[str, Any]] = []
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    slots: list[int] = []
    ts: list[float] = []
    rows: list[list[Any]] = []

    def close_block() -> None:
        if ts:
            parts.append((np.array(slots, dtype=np.int64), np.array(ts, dtype=np.float64),
                          np.array(rows, dtype=np.float64)))
            slots.clear()
            ts.clear()
            rows.clear()

    for s in samples:
        key = (s["node"], s["gpu"])
        slot = slot_of.get(key)
        if slot is None:
            slot = slot_of[key] = len(meta)
            meta.append({"node": s["node"], "gpu": int(s["gpu"]), "model": s["model"],
                         "rack": s.get("rack"), "site": s.get("site")})
        slots.append(slot)
        ts.append(s["ts"])
        rows.append(sample_row(s))
        if len(ts) >= block:
            close_block()
    close_block()
    if not parts:
        return RawSamples(meta, np.empty(0, np.int64), np.empty(0), np.empty((0, N_ROW)))
    return RawSamples(meta, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                      np.vstack([p[2] for p in parts]))


def hop_chunks(source: RawSamples | Iterable[Mapping[str, Any]], windows: GpuFeatureWindows,
               chunk: int = 20_000) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Closed hops of a trace as the windows close them, `chunk` samples at a time: (slots,
    hop-end ts, FEATURE_NAMES rows), then the hops `flush` closes. A RawSamples registers its
    GPUs first (slot = meta index); sample dicts register on first sight (the same order), and
    none outlives its chunk, so a trace file is read in memory bounded by the chunk."""
    if isinstance(source, RawSamples):
        for m in source.meta:
            windows.register(m["node"], m["gpu"], m["model"], m.get("rack"), m.get("site"))
        for k in range(0, len(source), chunk):
            yield windows.ingest(source.slots[k:k + chunk], source.ts[k:k + chunk], source.rows[k:k + chunk])
    else:
        slot_of: dict[tuple[str, int], int] = {}
        slots: list[int] = []
        ts: list[float] = []
        rows: list[list[float]] = []
        for n, s in enumerate(source, start=1):
            try:
                key = (s["node"], int(s["gpu"]))
                slot = slot_of.get(key)
                if slot is None:
                    slot = slot_of[key] = windows.register(*key, s["model"], s.get("rack"), s.get("site"))
                t, row = float(s["ts"]), sample_row(s)
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"GPU sample {n} ({record_where(s)}): {bad_field(exc)}") from None
            slots.append(slot)
            ts.append(t)
            rows.append(row)
            if len(ts) >= chunk:
                yield windows.ingest(slots, ts, rows)
                slots, ts, rows = [], [], []
        if ts:
            yield windows.ingest(slots, ts, rows)
    yield windows.flush_arrays()


def hop_extent(slots: np.ndarray, ts: np.ndarray) -> dict[int, tuple[float, float]]:
    """Each GPU slot's first and last hop end, from closed hops (slot, hop end) in any order."""
    if len(slots) == 0:
        return {}
    order = np.lexsort((ts, slots))
    s, t = np.asarray(slots)[order], np.asarray(ts)[order]
    start = np.r_[0, np.flatnonzero(np.diff(s)) + 1]
    end = np.r_[start[1:] - 1, len(s) - 1]
    return {int(a): (float(b), float(c)) for a, b, c in zip(s[start], t[start], t[end], strict=True)}


def covered_gpu_days(extent: Mapping[int, tuple[float, float]], hop_s: float) -> float:
    """GPU-days the hops cover: per GPU, from its first hop's start to its last hop's end."""
    return sum(last - first + hop_s for first, last in extent.values()) / 86400.0


def bad_field(exc: Exception) -> str:
    """What a record lacked or got wrong, from the error reading it."""
    if isinstance(exc, UnknownGpuError):  # a KeyError too, but of a value, not of a field
        return exc.record_reason
    return f"no {exc.args[0]!r} field" if isinstance(exc, KeyError) else str(exc)


def record_where(record: Any, who: tuple[str, str] = ("node", "gpu")) -> str:
    """Whose record (`who`: node/gpu, or job/rank) and its ts, as far as it has them, for an
    error message."""
    if not isinstance(record, Mapping):
        return f"not an object: {type(record).__name__}"
    return f"{record.get(who[0], '?')}/{record.get(who[1], '?')} at ts {record.get('ts', '?')}"


def slot_key(windows: GpuFeatureWindows, slot: int) -> tuple[str, int]:
    m = windows.slot_meta(slot)
    return (m["node"], int(m["gpu"]))


def compute_features(
    samples: Iterable[dict[str, Any]], hop_s: float = 600.0, chunk: int = 20_000
) -> FeatureTable:
    """Run GpuFeatureWindows over GPU-sample dicts (event-time order) and collect every hop."""
    return compute_features_raw(raw_samples(samples), hop_s=hop_s, chunk=chunk)


def compute_features_raw(raw: RawSamples, hop_s: float = 600.0, chunk: int = 20_000,
                         stagger: bool = False) -> FeatureTable:
    """Run GpuFeatureWindows over RawSamples in chunks of `chunk` samples; collect every hop
    (`stagger`: each GPU's hop grid shifted by its phase, as the stream worker may run)."""
    windows = GpuFeatureWindows(hop_s=hop_s, stagger=stagger)
    parts = list(hop_chunks(raw, windows, chunk))
    slots = np.concatenate([p[0] for p in parts])
    ts = np.concatenate([p[1] for p in parts])
    feats = np.vstack([p[2] for p in parts])
    order = np.lexsort((slots, ts))
    slots, ts, feats = slots[order], ts[order], feats[order]
    gpu_days = covered_gpu_days(hop_extent(slots, ts), hop_s)
    meta = [windows.slot_meta(i) for i in range(len(windows.keys()))]
    keys = [(meta[s]["node"], int(meta[s]["gpu"])) for s in slots.tolist()]
    models = [meta[s]["model"] for s in slots.tolist()]
    return FeatureTable(keys, ts, feats, models, gpu_days, windows.dropped_late,
                        windows.dropped_duplicate, windows.samples_in)


@dataclass
class TrainingRows:
    """A trace's training rows: MODEL_FEATURES columns of the hops `label_rows` keeps for
    fitting, in (hop end, GPU) order, with their labels and one group id per GPU."""

    x: np.ndarray
    y: np.ndarray
    hours_to_failure: np.ndarray
    groups: np.ndarray  # 0.. per GPU, numbered in order of each GPU's first hop
    gpus: int  # GPUs with any closed hop (kept or not): the next trace's groups start here
    hops: int  # every closed hop, kept or not
    samples: int


def training_rows(source: RawSamples | Iterable[Mapping[str, Any]], labels: Sequence[Mapping[str, Any]],
                  horizon_h: float = HORIZON_H, names: Sequence[str] = MODEL_FEATURES,
                  chunk: int = 20_000) -> TrainingRows:
    """The rows a fit reads, labelled and filtered chunk by chunk: neither the trace's samples
    nor its full feature table are held. The same rows, order and groups as labelling
    `compute_features` and taking `model_matrix` of its training rows and `gpu_groups` of its
    keys."""
    windows = GpuFeatureWindows()
    cols = [FEATURE_NAMES.index(n) for n in names]
    parts: list[tuple[np.ndarray, ...]] = []
    first_ts: dict[int, float] = {}
    hops = 0
    for cs, cts, cf in hop_chunks(source, windows, chunk):
        if len(cs) == 0:
            continue
        hops += len(cs)
        for sl, t in zip(cs.tolist(), cts.tolist(), strict=True):
            if t < first_ts.get(sl, np.inf):
                first_ts[sl] = t
        keys = [slot_key(windows, sl) for sl in cs.tolist()]
        lab = label_rows(FeatureTable(keys, cts, np.zeros((len(cs), 0))), labels, horizon_h)
        m = lab.train_mask
        parts.append((cs[m], cts[m], cf[m][:, cols], lab.y[m], lab.hours_to_failure[m]))
    if not parts:
        return TrainingRows(np.zeros((0, len(cols))), np.zeros(0, bool), np.zeros(0), np.zeros(0, np.int64),
                            0, 0, windows.samples_in)
    slots, ts, x, y, hours = (np.concatenate([p[i] for p in parts]) for i in range(5))
    order = np.lexsort((slots, ts))
    # gpu_groups numbers GPUs by their first row in (ts, slot) order over every hop, kept or not.
    group_of = {sl: i for i, sl in enumerate(sorted(first_ts, key=lambda sl: (first_ts[sl], sl)))}
    groups = np.array([group_of[sl] for sl in slots[order].tolist()], dtype=np.int64)
    return TrainingRows(x[order], y[order], hours[order], groups, len(first_ts), hops, windows.samples_in)


def failures_by_gpu(labels: Iterable[dict[str, Any]]) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Failure labels grouped by (node, gpu), each list in time order."""
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for lab in labels:
        if lab.get("kind") == "failure":
            out.setdefault((lab["node"], int(lab["gpu"])), []).append(lab)
    for v in out.values():
        v.sort(key=lambda x: x["ts"])
    return out


@dataclass
class Labelled:
    y: np.ndarray  # fails within the horizon (the scoring label)
    hours_to_failure: np.ndarray  # NaN when no failure within the horizon
    train_mask: np.ndarray  # rows used for fitting
    score_mask: np.ndarray  # rows used for scoring (outside repair windows)


def label_rows(
    table: FeatureTable, labels: Sequence[dict[str, Any]], horizon_h: float = HORIZON_H
) -> Labelled:
    n = len(table)
    y = np.zeros(n, dtype=bool)
    hours = np.full(n, np.nan)
    train = np.ones(n, dtype=bool)
    score = np.ones(n, dtype=bool)
    fails = failures_by_gpu(labels)
    rows_by_key: dict[tuple[str, int], list[int]] = {}
    for i, k in enumerate(table.keys):
        rows_by_key.setdefault(k, []).append(i)
    for key, events in fails.items():
        idx = np.array(rows_by_key.get(key, []), dtype=np.int64)
        if len(idx) == 0:
            continue
        t = table.ts[idx]
        for ev in events:
            tf = float(ev["ts"])
            dt_h = (tf - t) / 3600.0
            within = (dt_h > 0) & (dt_h <= horizon_h)
            y[idx[within]] = True
            hours[idx[within]] = np.fmin(hours[idx[within]], dt_h[within])
            pre = ev.get("precursor_start_ts")
            if ev.get("precursor_unknown") and not ev.get("abrupt"):
                pass  # an operator's record: every hop of the horizon is a positive
            elif ev.get("abrupt") or pre is None:
                train[idx[within]] = False
            else:
                train[idx[within & (t < float(pre))]] = False
            after = (dt_h <= 0) & (dt_h > -REPAIR_WINDOW_H)
            train[idx[after]] = False
            score[idx[after]] = False
    return Labelled(y, hours, train, score)


def fit_failure_model(
    x: np.ndarray, y: np.ndarray, hours: np.ndarray, groups: np.ndarray, seed: int,
    horizon_h: float = HORIZON_H, max_negatives: int = 300_000, metadata: dict[str, Any] | None = None,
) -> FailureModel:
    """Fit the calibrated classifier, the lead-time regressor and the healthy baseline.

    x: MODEL_FEATURES matrix of training rows; groups: an integer per GPU (calibration
    holds out whole GPUs, so a GPU's correlated hops never straddle the split)."""
    from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
    from sklearn.isotonic import IsotonicRegression

    rng = np.random.default_rng(seed)
    y = y.astype(bool)
    # Negatives are plentiful and alike: subsample them, weight the rest up so
    # probabilities stay calibrated to the true base rate.
    neg = np.flatnonzero(~y)
    weight = np.ones(len(y))
    if len(neg) > max_negatives:
        keep_neg = rng.choice(neg, size=max_negatives, replace=False)
        weight[keep_neg] = len(neg) / max_negatives
        rows = np.sort(np.concatenate([np.flatnonzero(y), keep_neg]))
    else:
        rows = np.arange(len(y))
    x, y, hours, groups, weight = x[rows], y[rows], hours[rows], groups[rows], weight[rows]

    ugroups = np.unique(groups)
    calib_groups = rng.choice(ugroups, size=max(1, len(ugroups) // 4), replace=False)
    calib = np.isin(groups, calib_groups)
    fit_rows = ~calib
    # Small on purpose: ~80 shallow trees keep inference near 10 us per GPU-hop (replay target).
    clf = HistGradientBoostingClassifier(
        max_iter=120, learning_rate=0.1, max_leaf_nodes=15, min_samples_leaf=40,
        l2_regularization=1.0, early_stopping=False, random_state=seed,
    )
    clf.fit(x[fit_rows], y[fit_rows], sample_weight=weight[fit_rows])
    raw = clf.predict_proba(x[calib])[:, 1]
    calibrator = IsotonicRegression(out_of_bounds="clip", y_min=0.0, y_max=1.0)
    calibrator.fit(raw, y[calib].astype(float), sample_weight=weight[calib])

    pos = y & ~np.isnan(hours)
    lead = None
    if pos.sum() >= 20:
        lead = HistGradientBoostingRegressor(max_iter=150, learning_rate=0.08, random_state=seed)
        lead.fit(x[pos], np.log1p(hours[pos]))

    healthy = x[~y]
    median = np.nanmedian(healthy, axis=0)
    q75, q25 = np.nanpercentile(healthy, [75, 25], axis=0)
    scale = np.fmax((q75 - q25) / 1.349, 0.5 * np.nanstd(healthy, axis=0)) + 1e-9
    median = np.nan_to_num(median)
    scale = np.nan_to_num(scale, nan=1.0)

    # Importance for the top-signal ranking: how far failing hops sit from healthy ones, in
    # healthy-scale units (standardised median shift). Cheap, and stable across refits.
    importance = np.ones(x.shape[1]) / x.shape[1]
    if y.sum() >= 5:
        shift = np.abs(np.nan_to_num(np.nanmedian(x[y], axis=0)) - median) / scale
        mean_gap = np.nan_to_num(np.nanmean(x[y], axis=0)) - np.nan_to_num(np.nanmean(healthy, axis=0))
        shift += np.abs(mean_gap) / scale
        if np.isfinite(shift).all() and shift.sum() > 0:
            importance = shift / shift.sum()
    return FailureModel(
        classifier=clf, calibrator=calibrator, lead_regressor=lead, feature_names=list(MODEL_FEATURES),
        baseline_median=median, baseline_scale=scale, importance=importance, horizon_h=horizon_h,
        policy=AlertPolicy(), metadata=dict(metadata or {}),
    )


def model_matrix(table: FeatureTable, names: Sequence[str] = MODEL_FEATURES) -> np.ndarray:
    """The columns `names` (default: the candidate MODEL_FEATURES) of a feature table."""
    return table.features[:, [FEATURE_NAMES.index(n) for n in names]]


def gpu_groups(keys: Sequence[tuple[str, int]], prefix: str = "") -> np.ndarray:
    """An integer per distinct GPU (prefix distinguishes GPUs of different traces)."""
    ids: dict[str, int] = {}
    return np.array([ids.setdefault(f"{prefix}{n}/{g}", len(ids)) for n, g in keys], dtype=np.int64)


# Operator labels (docs/predictors.md, "Retraining on your own fleet"). XIDs that mean the GPU
# failed (REFERENCE.md "XIDs"): 48 double-bit ECC, 64 row-remap failure, 79 off the bus,
# 94/95 contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC.
FAILURE_XIDS = frozenset({48, 64, 79, 94, 95, 119, 120, 140})
LABEL_EVENTS = ("failure", "rma", "replacement", "xid")
MERGE_H = 24.0  # records of one GPU within a day of each other are one failure (XID, then RMA)


class LabelError(ValueError):
    """A labels-file record that cannot be used (the message names the record and field)."""


def labels_from_records(records: Iterable[dict[str, Any]], source: str = "labels") -> list[dict[str, Any]]:
    """Failure labels (the simulator's label shape) from an operator's records.

    A record: {"ts": Unix s or RFC 3339, "node": str, "gpu": int, "event": "failure" | "rma" |
    "replacement" | "xid", "xid": int (for "xid"), optional "class", "precursor_start_ts",
    "abrupt"}. Simulator labels ({"kind": "failure", ...}) pass through; other kinds (traps,
    stragglers) are kept for scoring. An "xid" record counts only for a failure XID
    (FAILURE_XIDS). Records of one GPU within MERGE_H hours are one failure, at the earliest.
    Without a precursor start the failure is `precursor_unknown`: training uses every hop of
    the horizon before it as positive, scoring counts it among all failures."""
    out: list[dict[str, Any]] = []
    fails: list[dict[str, Any]] = []
    for i, rec in enumerate(records, start=1):
        where = f"{source} record {i}"
        if not isinstance(rec, dict):
            raise LabelError(f"{where}: not a JSON object")
        kind = rec.get("kind")
        if kind is not None and kind != "failure":
            out.append(rec)
            continue
        event = "failure" if kind == "failure" else rec.get("event")
        if event not in LABEL_EVENTS:
            raise LabelError(f"{where}: 'event' must be one of {', '.join(LABEL_EVENTS)}, got {event!r}")
        for name in ("ts", "node", "gpu"):
            if rec.get(name) is None:
                raise LabelError(f"{where}: '{name}' is required")
        try:
            ts = parse_timestamp(rec["ts"])
        except (TypeError, ValueError) as exc:
            raise LabelError(f"{where}: 'ts' {rec['ts']!r} is not Unix seconds or RFC 3339 ({exc})") from None
        if not isinstance(rec["node"], str) or not rec["node"]:
            raise LabelError(f"{where}: 'node' must be a non-empty string")
        if isinstance(rec["gpu"], bool) or not isinstance(rec["gpu"], int) or rec["gpu"] < 0:
            raise LabelError(f"{where}: 'gpu' must be an integer >= 0, got {rec['gpu']!r}")
        xid = rec.get("xid")
        if event == "xid":
            if isinstance(xid, bool) or not isinstance(xid, int):
                raise LabelError(f"{where}: an 'xid' event needs an integer 'xid'")
            if xid not in FAILURE_XIDS:
                continue  # application and warning XIDs are not failures
        label = {**rec, "kind": "failure", "ts": ts, "node": rec["node"], "gpu": rec["gpu"],
                 "class": rec.get("class") or (f"xid{xid}" if xid else event)}
        label.pop("event", None)
        label["_merge"] = kind is None  # operator records merge; simulator labels stay as they are
        if label.get("precursor_start_ts") is not None:
            label["precursor_start_ts"] = parse_timestamp(label["precursor_start_ts"])
        elif not label.get("abrupt"):
            label["precursor_start_ts"] = None
            label["precursor_unknown"] = True
        fails.append(label)
    fails.sort(key=lambda r: (r["node"], r["gpu"], r["ts"]))
    merged: list[dict[str, Any]] = []
    for rec in fails:
        last = merged[-1] if merged else None
        if (last is not None and rec.pop("_merge") and last.get("_merge", True)
                and (last["node"], last["gpu"]) == (rec["node"], rec["gpu"])
                and rec["ts"] - last["ts"] <= MERGE_H * 3600.0):
            continue
        merged.append(rec)
    for rec in merged:
        rec.pop("_merge", None)
    return sorted(merged + out, key=lambda r: float(r.get("ts") or 0.0))
