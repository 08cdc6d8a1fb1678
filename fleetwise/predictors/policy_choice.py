"""Choosing an alert policy for a stated false-alarm budget, from one scoring pass over a trace.

The failure model's probability of each GPU-hop does not depend on the alert policy; only the
policy's hysteresis does. So a trace is scored once (`score_hops`: probability, rule hits and
the features of the rows that could raise, per closed hop) and every candidate policy is
replayed over the stored scores (`replay_policy`, through `FailurePredictor.advance_policy`,
the policy step the stream worker runs). `choose_policy` keeps, among the policies whose false
alarms are within the budget *at the 95% upper bound* (a trace with no false alarm shows a
budget only when it is long enough), the one that calls the most failures.

The same one pass (`score_hops` over the trace's sample dicts) and replay are how
`backtest_trace` scores the model's policy, so a backtest's memory follows the hops, not the
trace's samples.

Pure functions over arrays and label dicts: no file I/O (the CLI and `bench/failure_eval.py`
read the traces and cache the scores).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fleetwise.predictors.backtest import score_failures
from fleetwise.predictors.failure import (
    AlertPolicy,
    FailurePredictor,
    policy_from_spec,
    rule_hits,
    rule_names_of,
)
from fleetwise.predictors.features import GpuFeatureWindows
from fleetwise.predictors.training import RawSamples, covered_gpu_days, hop_chunks, hop_extent, slot_key

# Rows at or above this probability keep their features (for memory-driven risk and the
# explanation of a false alarm); a policy that raises below it cannot be replayed exactly.
WATCH_FLOOR = 0.2

# The sweep of `fleetwise backtest --choose-policy`: thresholds and holds (10-min hops, 1-12 h),
# the memory tier equal to the general rule. Why holds: on a fleet unlike the training data,
# noise lifts a healthy GPU's probability for minutes to hours, a failing board's for hours to
# days (docs/predictors.md, "Alert policy").
POLICY_CHOICE_GRID: tuple[str, ...] = tuple(
    f"{hi},{k},{k}" for hi in (0.8, 0.9, 0.95, 0.97) for k in (6, 12, 18, 24, 36, 48, 72))
RULES_ONLY_SPEC = "rules-only"


@dataclass
class HopScores:
    """Every closed GPU-hop of a trace reduced to what an alert policy needs: probability,
    rule hits, and the features of rows at or above WATCH_FLOOR (memory share, signals).

    Small enough for 30-day traces of 512-1,024 GPUs, where the full feature table is not."""

    keys: list[tuple[str, int]]  # per slot
    slots: np.ndarray
    ts: np.ndarray
    prob: np.ndarray
    rules: np.ndarray  # bit r set: rule r of RULE_NAMES hit in the hop
    watch: np.ndarray  # row indices with prob >= WATCH_FLOOR
    watch_x: np.ndarray  # their FEATURE_NAMES rows (float32)
    gpu_days: float
    # Rows of the GPUs named in `keep_keys` when scored (a report's failing GPUs) and their
    # FEATURE_NAMES rows; empty otherwise.
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    kept_x: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    def first_seen(self, hop_s: float = 600.0) -> dict[tuple[str, int], float]:
        """(node, gpu) -> start of the GPU's first hop (for visible precursors)."""
        return {self.keys[sl]: first - hop_s for sl, (first, _) in hop_extent(self.slots, self.ts).items()}


class _HopScorer:
    """Scores closed hops as the windows give them out; keeps what HopScores holds."""

    def __init__(self, predictor: FailurePredictor) -> None:
        self.predictor = predictor
        self.parts: list[tuple[np.ndarray, ...]] = []
        self.n_rows = 0
        self.keep_slots: list[int] = []  # slots whose every row keeps its features
        self.kept: list[tuple[np.ndarray, np.ndarray]] = []

    def add(self, out: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        cs, cts, cf = out
        if len(cs) == 0:
            return
        model = self.predictor.model
        prob = model.predict_proba(cf[:, model.cols])
        w = np.flatnonzero(prob >= WATCH_FLOOR)
        self.parts.append((cs.astype(np.int32), cts, prob, rule_hits(cf), w + self.n_rows,
                           cf[w].astype(np.float32)))
        if self.keep_slots:
            k = np.flatnonzero(np.isin(cs, self.keep_slots))
            self.kept.append((k + self.n_rows, cf[k]))
        self.n_rows += len(cs)

    def scores(self, keys: list[tuple[str, int]], hop_s: float) -> HopScores:
        if not self.parts:
            raise ValueError("the trace has no GPU samples")
        cols = [np.concatenate([p[i] for p in self.parts]) for i in range(5)]
        gpu_days = covered_gpu_days(hop_extent(cols[0], cols[1]), hop_s)
        scores = HopScores(keys, cols[0], cols[1], cols[2], cols[3], cols[4],
                           np.vstack([p[5] for p in self.parts]), gpu_days)
        if self.kept:
            scores.kept = np.concatenate([k for k, _ in self.kept])
            scores.kept_x = np.vstack([x for _, x in self.kept])
        return scores


def score_hops(source: RawSamples | Iterable[Mapping[str, Any]], predictor: FailurePredictor, *,
               stagger: bool = False, chunk: int = 20_000,
               keep_keys: Collection[tuple[str, int]] = ()) -> HopScores:
    """HopScores of a trace: cached RawSamples, or GPU-sample dicts in event-time order (a
    trace file read line by line: no sample outlives its chunk, so memory follows the hops
    kept, not the samples). Every hop of the GPUs in `keep_keys` keeps its features (`kept`,
    `kept_x`: a report's failing GPUs)."""
    windows = GpuFeatureWindows(stagger=stagger)
    scorer = _HopScorer(predictor)
    keep = set(keep_keys)
    keys: list[tuple[str, int]] = []
    for out in hop_chunks(source, windows, chunk):
        for slot in range(len(keys), len(windows.keys())):  # GPUs registered in this chunk
            keys.append(slot_key(windows, slot))
            if keys[-1] in keep:
                scorer.keep_slots.append(slot)
        scorer.add(out)
    return scorer.scores(keys, windows.hop_s)


def replay_policy(scores: HopScores, labels: Sequence[Mapping[str, Any]], predictor: FailurePredictor,
                  policy: AlertPolicy) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Backtest metrics (`score_failures`) of `policy` over stored hop scores; returns the
    metrics and the raise / clear predictions (each with the `row` of its hop)."""
    if policy.model_alerts and min(policy.hi, policy.hi_memory) < WATCH_FLOOR:
        raise ValueError(f"a policy replayed over hop scores needs hi >= {WATCH_FLOOR} (got {policy.hi:g})")
    replayer = FailurePredictor(predictor.model, policy)
    memory = np.zeros(len(scores.prob), dtype=bool)
    shared = np.zeros(len(scores.prob), dtype=np.int8)
    driven = np.zeros(len(scores.prob), dtype=np.int8)
    if len(scores.watch):
        memory[scores.watch], shared[scores.watch], driven[scores.watch] = replayer.risk_drivers(
            scores.watch_x, scores.prob[scores.watch])
    # GPUs that never reach hi (or hi_memory) and hit no rule never alert: skip them (same result).
    can = np.zeros(len(scores.keys), dtype=bool)
    can[scores.slots[(scores.prob >= min(policy.hi, policy.hi_memory)) | (scores.rules > 0)]] = True
    rows = np.flatnonzero(can[scores.slots])
    rows = rows[np.lexsort((scores.ts[rows], scores.slots[rows]))]
    keys = [scores.keys[s] for s in scores.slots[rows].tolist()]
    hits = [rule_names_of(b) for b in scores.rules[rows].tolist()]
    emit, states = replayer.advance_policy(
        keys, scores.ts[rows], scores.prob[rows], memory[rows], hits, shared[rows], driven[rows])
    preds = []
    for j, (alert, source, was) in zip(emit, states, strict=True):
        if alert != was:  # raises and clears are all an episode needs
            node, gpu = keys[j]
            preds.append({"type": "failure", "node": node, "gpu": gpu, "ts": float(scores.ts[rows[j]]),
                          "alert": alert, "signals": [{"name": "source", "value": source}],
                          "row": int(rows[j])})
    metrics = score_failures(preds, labels, gpu_days=scores.gpu_days, horizon_h=predictor.model.horizon_h,
                             first_seen=scores.first_seen(), trace_end=float(scores.ts.max()))
    return metrics, preds


def poisson_upper(k: int, conf: float = 0.95) -> float:
    """One-sided upper confidence bound of a Poisson mean after k events (exact, via chi2)."""
    from scipy.stats import chi2

    return float(chi2.ppf(conf, 2 * (k + 1)) / 2)


@dataclass
class PolicyTrial:
    """One candidate policy's result on the scored trace."""

    spec: str  # 'hi,k,k_memory,hi_memory' as `--policy` takes it, or 'rules-only'
    policy: AlertPolicy
    false_alarms: int
    false_alarms_per_1000_gpu_days: float
    upper95_per_1000_gpu_days: float  # the exact Poisson 95% upper bound of that rate
    within_budget: bool  # upper bound <= budget
    caught: dict[str, tuple[int, int]]  # recall bucket -> (caught, failures)
    precision: float | None


@dataclass
class PolicyChoice:
    budget_per_1000_gpu_days: float
    gpu_days: float
    trials: list[PolicyTrial]
    chosen: PolicyTrial | None  # None: no model policy is shown within the budget
    reason: str


# Recall buckets in the order a choice ranks them (the issue-16 targets first; an operator's
# labels without precursor times fall through to the last two).
RANK_BUCKETS = ("recall_long_precursor_12h", "recall_with_precursor_30min", "recall_all_12h",
                "recall_all_30min")


def min_gpu_days_for(budget_per_1000_gpu_days: float) -> float:
    """GPU-days a trace needs to show the budget with no false alarm at all (95% upper bound)."""
    return poisson_upper(0) / budget_per_1000_gpu_days * 1000.0


def choose_policy(scores: HopScores, labels: Sequence[Mapping[str, Any]], predictor: FailurePredictor,
                  budget_per_1000_gpu_days: float, specs: Sequence[str] = POLICY_CHOICE_GRID) -> PolicyChoice:
    """Replay each policy of `specs` (and the rules alone) over `scores`; choose, among the
    model policies whose false alarms' 95% upper bound is within the budget, the one that
    catches the most failures (RANK_BUCKETS in order), then the fewest false alarms."""
    if budget_per_1000_gpu_days <= 0:
        raise ValueError("the false-alarm budget must be > 0 per 1,000 GPU-days, "
                         f"got {budget_per_1000_gpu_days:g}")
    if scores.gpu_days <= 0:
        raise ValueError("the trace covers no GPU-days")
    candidates = [(RULES_ONLY_SPEC, replace(predictor.policy, model_alerts=False))]
    candidates += [(s, policy_from_spec(s, predictor.policy)) for s in specs]
    trials = []
    for spec, pol in candidates:
        m, _ = replay_policy(scores, labels, predictor, pol)
        n_false = int(m["false_alerts"])
        upper = poisson_upper(n_false) / scores.gpu_days * 1000.0
        trials.append(PolicyTrial(
            spec=spec, policy=pol, false_alarms=n_false,
            false_alarms_per_1000_gpu_days=n_false / scores.gpu_days * 1000.0,
            upper95_per_1000_gpu_days=upper, within_budget=upper <= budget_per_1000_gpu_days,
            caught={b: (int(m[b]["caught"]), int(m[b]["n"])) for b in RANK_BUCKETS},
            precision=m["precision"]))
    fit = [t for t in trials if t.within_budget and t.spec != RULES_ONLY_SPEC]
    if fit:
        chosen = max(fit, key=lambda t: (*(t.caught[b][0] for b in RANK_BUCKETS), -t.false_alarms))
        reason = (f"{chosen.spec}: the most failures caught among the {len(fit)} of {len(trials) - 1} "
                  f"model policies within {budget_per_1000_gpu_days:g} false alarms per 1,000 GPU-days "
                  "at the 95% upper bound")
        return PolicyChoice(budget_per_1000_gpu_days, scores.gpu_days, trials, chosen, reason)
    need = min_gpu_days_for(budget_per_1000_gpu_days)
    fewest = min(trials[1:], key=lambda t: t.false_alarms) if len(trials) > 1 else trials[0]
    if scores.gpu_days < need and fewest.false_alarms == 0:
        reason = (f"no model policy is shown within {budget_per_1000_gpu_days:g} per 1,000 GPU-days: with no "
                  f"false alarm that takes {need:,.0f} GPU-days, the trace has {scores.gpu_days:,.0f}; "
                  "score a longer trace, or run the rules alone (--rules-only)")
    else:
        reason = (f"no model policy is within {budget_per_1000_gpu_days:g} per 1,000 GPU-days at the 95% "
                  f"upper bound (the fewest false alarms: {fewest.false_alarms}, {fewest.spec}); "
                  "run the rules alone (--rules-only)")
    return PolicyChoice(budget_per_1000_gpu_days, scores.gpu_days, trials, None, reason)
