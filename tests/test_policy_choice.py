"""Choosing an alert policy for a false-alarm budget over stored hop scores
(`fleetwise.predictors.policy_choice`; the CLI's `backtest --choose-policy` is tested end to end
in tests/test_operator_retrain.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from fleetwise.predictors.failure import AlertPolicy, FailurePredictor
from fleetwise.predictors.features import FEATURE_NAMES
from fleetwise.predictors.policy_choice import (
    HopScores,
    choose_policy,
    min_gpu_days_for,
    replay_policy,
)

HOP, HOUR = 600.0, 3600.0
T_FAIL = 48 * HOUR  # GPU n0/0 fails here, its precursor visible for 20 h


def _scores(gpu_days: float) -> tuple[HopScores, list[dict]]:
    """Two GPUs over 48 h: n0/0 at p 0.99 for the 20 h before its failure, n1/0 healthy but at
    p 0.99 for two hours (a benign burst); p 0.01 otherwise."""
    ts = np.arange(1, 48 * 6 + 1) * HOP
    p_fail = np.where(ts > T_FAIL - 20 * HOUR, 0.99, 0.01)
    p_burst = np.where((ts > 10 * HOUR) & (ts <= 12 * HOUR), 0.99, 0.01)
    n = len(ts)
    scores = HopScores(
        keys=[("n0", 0), ("n1", 0)], slots=np.repeat([0, 1], n).astype(np.int32),
        ts=np.concatenate([ts, ts]), prob=np.concatenate([p_fail, p_burst]),
        rules=np.zeros(2 * n, dtype=np.int64), watch=np.zeros(0, dtype=np.int64),
        watch_x=np.zeros((0, 1), dtype=np.float32), gpu_days=gpu_days)
    labels = [{"kind": "failure", "node": "n0", "gpu": 0, "ts": T_FAIL, "class": "hbm_ecc",
               "precursor_start_ts": T_FAIL - 30 * HOUR, "abrupt": False}]
    return scores, labels


@pytest.fixture(scope="module")
def predictor() -> FailurePredictor:
    return FailurePredictor.load()


def test_replay_raises_after_the_hold(predictor: FailurePredictor) -> None:
    scores, labels = _scores(gpu_days=2.0)
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.97, k_raise=6, k_raise_memory=6,
                      model_alerts=True)
    m, preds = replay_policy(scores, labels, predictor, pol)
    raises = sorted((p["node"], p["ts"]) for p in preds if p["alert"])
    # One hour at >= 0.97: the failing GPU 19 h ahead and the burst after an hour of it.
    assert raises == [("n0", T_FAIL - 19 * HOUR), ("n1", 11 * HOUR)]
    assert (m["true_alerts"], m["false_alerts"]) == (1, 1)


def test_replay_holds_back_heat_the_node_shares(predictor: FailurePredictor) -> None:
    """The burst GPU's watched rows read as thermal risk (its 6 h temperature residual far off
    the model's healthy baseline, nothing else) with two warm GPUs beside it: the replay does not
    raise it, as the stream would not; with no warm peer it raises as before."""
    scores, labels = _scores(gpu_days=2.0)
    model = predictor.model
    watch = np.flatnonzero(scores.prob >= 0.2)
    row = np.zeros(len(FEATURE_NAMES))
    row[model.cols] = model.baseline_median
    resid = FEATURE_NAMES.index("temp_residual_6h")
    row[resid] += 1000.0 * model.baseline_scale[model.feature_names.index("temp_residual_6h")]
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.97, k_raise=6, k_raise_memory=6,
                      model_alerts=True)

    def raised(warm_peers: float) -> list[tuple[str, float]]:
        x = np.tile(row, (len(watch), 1))
        x[:, FEATURE_NAMES.index("node_warm_peers_1h")] = np.where(scores.slots[watch] == 1, warm_peers, 0.0)
        stored = replace(scores, watch=watch, watch_x=x.astype(np.float32))
        _, preds = replay_policy(stored, labels, predictor, pol)
        return sorted((p["node"], p["ts"]) for p in preds if p["alert"])

    assert raised(0.0) == [("n0", T_FAIL - 19 * HOUR), ("n1", 11 * HOUR)]
    assert raised(2.0) == [("n0", T_FAIL - 19 * HOUR)]


def test_choice_keeps_the_budget_then_calls_the_most(predictor: FailurePredictor) -> None:
    # 100,000 GPU-days: no false alarm bounds the rate at 0.030 per 1,000 GPU-days, one at 0.047.
    scores, labels = _scores(gpu_days=100_000.0)
    specs = ["0.97,72,72", "0.97,18,18", "0.97,6,6"]  # the longest hold first: ranking, not order
    choice = choose_policy(scores, labels, predictor, 0.04, specs)
    by = {t.spec: t for t in choice.trials}
    assert list(by) == ["rules-only", *specs]
    assert by["0.97,6,6"].false_alarms == 1 and not by["0.97,6,6"].within_budget
    assert by["0.97,18,18"].within_budget and by["0.97,72,72"].within_budget
    # The 3 h hold skips the burst and still calls the failure 12 h ahead; the 12 h hold is late.
    assert by["0.97,18,18"].caught["recall_long_precursor_12h"] == (1, 1)
    assert by["0.97,72,72"].caught["recall_long_precursor_12h"] == (0, 1)
    assert by["0.97,72,72"].caught["recall_with_precursor_30min"] == (1, 1)
    assert choice.chosen is by["0.97,18,18"]
    # A looser budget admits the one-hour hold, which calls the failure earliest: the tie on
    # failures caught goes to the fewest false alarms.
    loose = choose_policy(scores, labels, predictor, 0.05, specs)
    assert loose.chosen is not None and loose.chosen.spec == "0.97,18,18"
    assert {t.spec for t in loose.trials if t.within_budget} >= set(specs)


def test_a_short_trace_cannot_show_the_budget(predictor: FailurePredictor) -> None:
    scores, labels = _scores(gpu_days=2.0)
    choice = choose_policy(scores, labels, predictor, 0.2, ["0.97,18,18"])
    assert choice.chosen is None
    assert f"{min_gpu_days_for(0.2):,.0f} GPU-days" in choice.reason and "--rules-only" in choice.reason
    assert round(min_gpu_days_for(0.2)) == 14979  # 3.0 / 0.2 x 1,000: the exact Poisson bound at zero


def test_bad_budget_and_policy_are_refused(predictor: FailurePredictor) -> None:
    scores, labels = _scores(gpu_days=2.0)
    with pytest.raises(ValueError, match="budget must be > 0"):
        choose_policy(scores, labels, predictor, 0.0, ["0.97,6,6"])
    with pytest.raises(ValueError, match="needs hi >= 0.2"):
        choose_policy(scores, labels, predictor, 0.2, ["0.1,6,6"])


def test_scoring_a_sample_stream_equals_scoring_its_arrays(predictor: FailurePredictor) -> None:
    """The CLI scores a trace file line by line; the bench scores cached arrays: same hops."""
    from fleetwise.predictors.policy_choice import score_hops
    from fleetwise.predictors.training import raw_samples
    from fleetwise.sim import FleetSimulator, SimConfig

    sim = FleetSimulator(SimConfig(gpus="h100-sxm:8,a100-sxm-80gb:8", days=1, seed=4,
                                   failure_rate_per_1000_gpu_days=300, sample_interval_s=120))
    samples = [s for tick in sim.ticks() for s in tick.samples]
    streamed = score_hops(iter(samples), predictor, chunk=777)  # chunks across hops and GPUs
    arrays = score_hops(raw_samples(samples), predictor)
    assert streamed.keys == arrays.keys and streamed.gpu_days == arrays.gpu_days

    def by_hop(sc: HopScores) -> tuple[np.ndarray, np.ndarray, dict]:
        # Hops closed in other calls come out in another order; a hop is (slot, ts).
        order = np.lexsort((sc.slots, sc.ts))
        cols = np.column_stack([sc.slots[order], sc.ts[order], sc.rules[order]])
        watch = {(int(sc.slots[r]), float(sc.ts[r])): sc.watch_x[i] for i, r in enumerate(sc.watch)}
        return cols, sc.prob[order], watch

    (a_cols, a_prob, a_watch), (b_cols, b_prob, b_watch) = by_hop(streamed), by_hop(arrays)
    assert np.array_equal(a_cols, b_cols) and a_watch.keys() == b_watch.keys()
    # Other chunk boundaries sum a hop's readings in another order: equal to the last bits.
    assert np.allclose(a_prob, b_prob, rtol=1e-9, atol=1e-12)
    assert all(np.allclose(a_watch[k], b_watch[k], rtol=1e-6, equal_nan=True) for k in a_watch)
    assert len(streamed.prob) > 16 * 100 and len(a_watch) > 0
