"""Failure predictor: alert hysteresis, rules layer, schema check on load, fitting, packaged model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fleetwise.predictors.failure import (
    ALERT_RULES,
    MODEL_FEATURES,
    RULE_BY_NAME,
    AlertPolicy,
    FailureModel,
    FailurePredictor,
    FeatureSchemaError,
    rule_hits,
    rule_names_of,
    rule_values,
)
from fleetwise.predictors.features import FEATURE_NAMES, GpuFeatureWindows
from fleetwise.predictors.training import fit_failure_model

RISK = "temp_residual_6h"


class _ColumnClassifier:
    """Stand-in classifier: p = the sum of the `risk` columns (RISK unless given) clipped to
    [0, 1] (to drive the policy exactly)."""

    def __init__(self, risk: tuple[str, ...] = (RISK,)) -> None:
        self.cols = [MODEL_FEATURES.index(name) for name in risk]

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        p = np.clip(np.nan_to_num(x[:, self.cols]).sum(axis=1), 0, 1)
        return np.stack([1 - p, p], axis=1)


class _Identity:
    def predict(self, p: np.ndarray) -> np.ndarray:
        return p


def stub_model(policy: AlertPolicy | None = None, risk: tuple[str, ...] = (RISK,)) -> FailureModel:
    n = len(MODEL_FEATURES)
    return FailureModel(
        classifier=_ColumnClassifier(risk), calibrator=_Identity(), lead_regressor=None,
        feature_names=list(MODEL_FEATURES), baseline_median=np.zeros(n), baseline_scale=np.ones(n),
        importance=np.ones(n) / n, horizon_h=48.0,
        policy=policy or AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=2, m_clear=3,
                                     model_alerts=True),
    )


def run(pred: FailurePredictor, probs: list[float], extra: dict[str, list[float]] | None = None) -> list:
    f = np.zeros((len(probs), len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index(RISK)] = probs
    f[:, FEATURE_NAMES.index("hours_reporting")] = 1000.0  # a GPU reporting for weeks (unless given)
    for name, values in (extra or {}).items():
        f[:, FEATURE_NAMES.index(name)] = values
    ts = 1764547200.0 + 600.0 * np.arange(1, len(probs) + 1)
    out, _ = pred.process_arrays([("n1", 0)] * len(probs), ts, f)
    return out


def alert_series(out: list, n: int) -> list[bool]:
    by_ts = {p.ts: p.alert for p in out}
    ts = 1764547200.0 + 600.0 * np.arange(1, n + 1)
    return [by_ts.get(t, False) for t in ts]


def test_raises_after_k_hops_and_does_not_flap() -> None:
    probs = [0.1, 0.7, 0.1, 0.7, 0.7, 0.5, 0.2, 0.5, 0.2, 0.2, 0.2, 0.1]
    alerts = alert_series(run(FailurePredictor(stub_model()), probs), len(probs))
    # one isolated hop above hi does not raise; two in a row do; dips between lo and hi and a
    # single dip below lo keep it; three consecutive hops below lo clear it
    assert alerts == [False, False, False, False, True, True, True, True, True, True, False, False]


def test_rule_raises_at_once_and_is_marked_as_rule() -> None:
    probs = [0.0] * 5
    out = run(FailurePredictor(stub_model()), probs, {"xid_bus_hop": [0, 0, 1, 0, 0]})
    first = next(p for p in out if p.alert)
    assert first.ts == 1764547200.0 + 600.0 * 3
    sources = {s.name: s.value for s in first.signals}
    assert sources["source"] == "rule:xid79_off_bus" and "rule:xid79_off_bus" in sources


# Every rule on (those off by default too, rules 25 and 26, so that each rule's own mechanics are
# tested), the model's alerts off.
RULES_ONLY = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=2, m_clear=3,
                         model_alerts=False, pcie_streak_hops=1, dbe_hops=1)
assert all(getattr(RULES_ONLY, rule.hold) > 0 for rule in ALERT_RULES)
NVL_LEVEL = RULE_BY_NAME["nvlink_error_surge"].level


def test_error_surge_raises_after_its_hold_not_on_shorter_bursts() -> None:
    hold = RULES_ONLY.surge_hold_hops
    # two bursts one hop short of the hold, a quiet hop between them: never raised
    bursts = [NVL_LEVEL + 1] * (hold - 1) + [0.0] + [NVL_LEVEL + 1] * (hold - 1) + [0.0]
    out = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(bursts), {"nvl_accel": bursts})
    assert not any(p.alert for p in out)
    sustained = [0.0] + [NVL_LEVEL + 1] * hold + [0.0]
    # another GPU of the node erring too: this surge raises all the same (the unshared one not)
    extra = {"nvl_accel": sustained, "node_nvl_peers_1h": [1.0] * len(sustained)}
    out = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(sustained), extra)
    assert alert_series(out, len(sustained)).index(True) == hold  # the hold-th hop above raises
    first = next(p for p in out if p.alert)
    signals = {s.name: s.value for s in first.signals}
    assert signals["source"] == "rule:nvlink_error_surge" and "surge:nvlink_error_surge" in signals
    off = FailurePredictor(stub_model(replace(RULES_ONLY, surge_hold_hops=0)))
    assert not any(p.alert for p in run(off, [0.0] * len(sustained), {"nvl_accel": sustained}))
    # alone, its link erring hop after hop, both surges of the hop raise together
    alone = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(sustained),
                {"nvl_accel": sustained, "nvl_active_1h": [1.0] * len(sustained)})
    first = next(p for p in alone if p.alert)
    source = {s.name: s.value for s in first.signals}["source"]
    assert source == "rule:nvlink_error_surge,nvlink_surge_unshared"


OWN_HOLDS = [r for r in ALERT_RULES if r.hold != "surge_hold_hops" and not r.within_h]


@pytest.mark.parametrize("rule", OWN_HOLDS, ids=lambda r: r.name)
def test_sustained_surge_raises_after_its_own_hold(rule) -> None:
    hold = getattr(RULES_ONLY, rule.hold)
    under_a_surge = any(r.feature == rule.feature and r.hold == "surge_hold_hops" for r in ALERT_RULES)
    if under_a_surge and not rule.streak:  # (a streak is a hold of its own)
        assert hold > RULES_ONLY.surge_hold_hops  # a rise under a 2 h surge of its feature: held longer
    above = rule.level + 0.05  # under every 2 h surge level: only the sustained tier can raise
    # one hop at the level (not above) breaks the streak: two bursts one hop short never raise
    bursts = [above] * (hold - 1) + [rule.level] + [above] * (hold - 1) + [0.0]
    out = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(bursts),
              {rule.feature: bursts, **erring_as_asked(rule, len(bursts)),
               **shared_for_others(rule, len(bursts))})
    assert not any(p.alert for p in out)
    sustained = [0.0] + [above] * hold + [0.0]
    extra = {rule.feature: sustained, **erring_as_asked(rule, len(sustained)),
             **shared_for_others(rule, len(sustained))}
    out = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(sustained), extra)
    assert alert_series(out, len(sustained)).index(True) == hold
    first = next(p for p in out if p.alert)
    signals = {s.name: s.value for s in first.signals}
    # a hop toward a hold of several is surge evidence; one that raises on its own, a rule's
    evidence = "surge" if hold > 1 else "rule"
    assert signals["source"] == f"rule:{rule.name}" and f"{evidence}:{rule.name}" in signals
    off = FailurePredictor(stub_model(replace(RULES_ONLY, **{rule.hold: 0})))
    out = run(off, [0.3] * len(sustained), extra)  # on the watch list (p >= emit_floor), not raised
    assert out and not any(p.alert for p in out)
    assert not any(s.name.endswith(f":{rule.name}") for p in out for s in p.signals)  # off: no evidence


def erring_as_asked(rule, n: int) -> dict[str, list[float]]:
    """n hops meeting `rule`'s error streak and its share of erring hops (none when it asks for
    none)."""
    return {**({rule.streak: [rule.streak_h] * n} if rule.streak else {}),
            **({rule.active: [rule.active_level] * n} if rule.active else {})}


def peers_beyond(rule) -> float:
    """A node-peer count one above what `rule` allows: its `unshared` hops stop counting."""
    return rule.peers_allowed + 1.0


def shared_for_others(rule, n: int) -> dict[str, list[float]]:
    """n hops in which a node peer shares the errors of every other rule on `rule`'s feature that
    counts only unshared hops (rule 27 under rule 13), so that only `rule` can raise."""
    return {r.unshared: [peers_beyond(r)] * n for r in ALERT_RULES
            if r.feature == rule.feature and r.unshared and r.unshared != rule.unshared}


def rows_meeting(rule, n: int) -> np.ndarray:
    """n FEATURE_NAMES rows that meet every condition of `rule`: above its level, settled, no node
    peer sharing, streaking as long as it asks, its link still erring."""
    f = np.zeros((n, len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index(rule.feature)] = rule.level + 0.01
    f[:, FEATURE_NAMES.index("hours_reporting")] = rule.settled_h
    for name, values in erring_as_asked(rule, n).items():
        f[:, FEATURE_NAMES.index(name)] = values
    return f


ACTIVE = [r for r in ALERT_RULES if r.active]


@pytest.mark.parametrize("rule", ACTIVE, ids=lambda r: r.name)
def test_an_active_rule_counts_only_hops_whose_link_still_errs(rule) -> None:
    f = rows_meeting(rule, 4)
    f[:, FEATURE_NAMES.index(rule.active)] = [rule.active_level, 1.0, rule.active_level - 0.01, np.nan]
    assert hits_of(rule, f) == [True, True, False, False]


def hits_of(rule, f: np.ndarray) -> list[bool]:
    return [rule.name in rule_names_of(b) for b in rule_hits(f).tolist()]


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: r.name)
def test_surge_levels_count_only_above_and_not_when_missing(rule) -> None:
    f = rows_meeting(rule, 3)
    f[:, FEATURE_NAMES.index(rule.feature)] = [rule.level, rule.level + 0.01, np.nan]
    assert hits_of(rule, f) == [False, True, False]


UNSHARED = [r for r in ALERT_RULES if r.unshared]


@pytest.mark.parametrize("rule", UNSHARED, ids=lambda r: r.name)
def test_unshared_surge_counts_only_hops_no_more_node_peers_share_than_it_allows(rule) -> None:
    f = rows_meeting(rule, 5)
    allowed = rule.peers_allowed
    f[:, FEATURE_NAMES.index(rule.unshared)] = [0.0, allowed, peers_beyond(rule), allowed + 3, np.nan]
    assert hits_of(rule, f) == [True, True, False, False, False]


@pytest.mark.parametrize("rule", UNSHARED, ids=lambda r: r.name)
def test_unshared_surge_raises_alone_not_beside_more_erring_peers_than_it_allows(rule) -> None:
    hold = getattr(RULES_ONLY, rule.hold)
    # above the unshared level, under every other surge level of the feature held this long
    others = [r.level for r in ALERT_RULES if r.feature == rule.feature and r.level > rule.level]
    above = (rule.level + min(others)) / 2 if others else rule.level + 0.1
    sustained = [0.0] + [above] * hold + [0.0]
    alone = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(sustained),
                {rule.feature: sustained, **erring_as_asked(rule, len(sustained))})
    assert alert_series(alone, len(sustained)).index(True) == hold
    first = next(p for p in alone if p.alert)
    assert {s.name: s.value for s in first.signals}["source"] == f"rule:{rule.name}"
    # the same surge while one more GPU of the node than the rule allows errs on that link in its
    # last hop: never raised
    peer = [0.0] * hold + [peers_beyond(rule)] + [0.0]
    shared = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(sustained),
                 {rule.feature: sustained, rule.unshared: peer, **erring_as_asked(rule, len(sustained))})
    assert not any(p.alert for p in shared)


SETTLED = [r for r in ALERT_RULES if r.settled_h]


@pytest.mark.parametrize("rule", SETTLED, ids=lambda r: r.name)
def test_settled_surge_counts_only_after_its_hours_of_reporting(rule) -> None:
    f = rows_meeting(rule, 4)
    f[:, FEATURE_NAMES.index("hours_reporting")] = [0.0, rule.settled_h - 0.5, rule.settled_h, np.nan]
    assert hits_of(rule, f) == [False, False, True, False]


STREAKING = [r for r in ALERT_RULES if r.streak]


@pytest.mark.parametrize("rule", STREAKING, ids=lambda r: r.name)
def test_streaking_surge_counts_only_hops_ending_a_long_enough_error_streak(rule) -> None:
    f = rows_meeting(rule, 5)
    # a streak one hop short, just long enough (six 10-minute hops), longer, none, missing
    f[:, FEATURE_NAMES.index(rule.streak)] = [rule.streak_h - 1 / 6, 6 * 600 / 3600, rule.streak_h + 1.0,
                                             0.0, np.nan]
    assert hits_of(rule, f) == [False, True, True, False, False]


def test_thermal_residual_rule_counts_a_settled_gpu_whose_node_runs_cool() -> None:
    rule = RULE_BY_NAME["heat_residual_unshared"]
    f = np.zeros((5, len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index("temp_residual_cool_24h")] = rule.level + 0.5
    # alone and a day back; a node peer as warm; a missing peer count; 12 h back; the level not reached
    f[:, FEATURE_NAMES.index("node_heat_peers_1h")] = [0.0, 1.0, np.nan, 0.0, 0.0]
    f[:, FEATURE_NAMES.index("hours_reporting")] = [48.0, 48.0, 48.0, 12.0, 48.0]
    f[4, FEATURE_NAMES.index("temp_residual_cool_24h")] = rule.level
    assert hits_of(rule, f) == [True, False, False, False, False]


def test_power_brake_rule_counts_a_gpu_braking_beyond_every_node_peer() -> None:
    rule = RULE_BY_NAME["power_brake_beyond_peers"]
    f = np.zeros((6, len(FEATURE_NAMES)))
    # alone; a peer braking nearly as often (ratio just under, just over); a missing peer
    # maximum; at the level, not above it; no peer braking but under the level
    f[:, FEATURE_NAMES.index("brake_hops_6h")] = [5.0, 5.0, 5.0, 5.0, rule.level, 3.0]
    peak = 5.0 / rule.peer_ratio
    f[:, FEATURE_NAMES.index("node_brake_hops_max_6h")] = [0.0, peak + 0.05, peak - 0.05, np.nan, 0.0, 0.0]
    assert hits_of(rule, f) == [True, False, True, False, False, False]


def steady_sample(ts: float, node: str, gpu: int, metrics: dict[str, float]) -> dict:
    """An h100 sample at a steady 60 C and 350 W with `metrics` beside them."""
    return {"ts": ts, "node": node, "gpu": gpu, "model": "h100",
            "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60.0, "DCGM_FI_DEV_POWER_USAGE": 350.0, **metrics}}


def window_rows(samples: list[dict]) -> tuple[list, np.ndarray]:
    """The closed hops of `samples` through the feature windows (10-minute hops) and their
    FEATURE_NAMES rows."""
    fw = GpuFeatureWindows(hop_s=600.0, tdp_lookup=lambda m: ("h100-sxm", 700.0))
    out = fw.process_dicts(samples) + fw.flush()
    return out, np.array([[o.values[n] for n in FEATURE_NAMES] for o in out], dtype=float)


def rule_hops(samples: list[dict], name: str) -> list[tuple[str, int, float]]:
    """(node, gpu, hop end) of each hop in which rule `name` hits, read through the feature windows."""
    out, f = window_rows(samples)
    return [(o.node, o.gpu, o.ts) for o, bits in zip(out, rule_hits(f).tolist(), strict=True)
            if name in rule_names_of(bits)]


def test_nvlink_surge_unshared_counts_a_link_still_erring_not_one_bursts_tail() -> None:
    """Rule 14's NVLink gate read from the feature windows: after three quiet weeks, one hop's burst
    of 500 CRC errors keeps `nvl_accel` above the level for the 2 h hold by itself (the decaying
    1 h count), but no hop of it counts; a link erring hop after hop does count."""
    t0, dt, h = 1764547200.0, 600.0, 3600.0
    crc = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
    erring = {"n1": lambda at: 500 if at >= 504 * h else 0,  # one burst, nothing after
              "n2": lambda at: int(max(0.0, at - 504 * h) / 600) * 30}  # 30 more every hop
    samples = [steady_sample(t0 + dt * i, node, 0, {crc: erring[node](i * dt)})
               for i in range(int(508 * h / dt)) for node in erring]
    out, f = window_rows(samples)
    burst = np.array([o.node == "n1" for o in out])
    rule = RULE_BY_NAME["nvlink_surge_unshared"]
    gated = rule_values(f, rule) > rule.level
    ungated = rule_values(f, replace(rule, active="")) > rule.level
    assert ungated[burst].sum() >= RULES_ONLY.surge_hold_hops  # the tail alone would hold it 2 h
    assert not gated[burst].any()
    assert gated[~burst].any()


def test_double_bit_error_rule_raises_in_the_hop_the_counter_rises_not_on_a_blank() -> None:
    """Rule 26 read from the feature windows: the volatile DBE counter stepping 0 -> 1 raises in
    that hop (no XID seen); a DCGM blank between two equal readings, and a GPU whose counter
    never moves, do not."""
    t0, dt = 1764547200.0, 60.0
    blank = 9223372036854775794  # DCGM's int64 blank sentinel
    dbe = {0: lambda i: 0 if i < 25 else 1, 1: lambda i: blank if i == 25 else 0, 2: lambda i: 0}
    samples = [steady_sample(t0 + dt * i, "n1", g, {"DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": dbe[g](i)})
               for i in range(50) for g in dbe]
    assert rule_hops(samples, "double_bit_error") == [("n1", 0, t0 + 1800.0)]  # the hop [1200, 1800)


def test_single_bit_rise_unshared_holds_for_a_gpu_erring_alone_not_beside_a_peer_or_for_a_burst() -> None:
    """Rule 27 read from the feature windows: a GPU quiet for a day whose single-bit rate then
    climbs 8% an hour for four days counts hop after hop for longer than the rule's hold (18 h)
    while its node peer is quiet; the same climb beside a peer that logs an error every 2 h never
    counts; an hour's benign burst of 60 errors counts for less than the hold."""
    t0, dt, h = 1764547200.0, 600.0, 3600.0

    def climbing(at: float) -> int:  # 2/h from hour 24, 8% more each hour (the rate's integral)
        x = max(0.0, at / h - 24.0)
        return int(2.0 * (1.08 ** x - 1.0) / math.log(1.08))

    sbe = {("n1", 0): climbing, ("n1", 1): lambda at: 0,
           ("n2", 0): climbing, ("n2", 1): lambda at: int(at // (2 * h)),
           ("n3", 0): lambda at: int(min(max(0.0, at / h - 30.0), 1.0) * 60)}
    samples = [steady_sample(t0 + dt * i, node, gpu, {"DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": count(i * dt)})
               for i in range(int(120 * h / dt)) for (node, gpu), count in sbe.items()]
    hits = rule_hops(samples, "single_bit_error_rise_unshared")

    def longest_run(node: str, gpu: int) -> int:  # consecutive hops hit
        best = run = 0
        prev = None
        for end in sorted(ts for n, g, ts in hits if (n, g) == (node, gpu)):
            run = run + 1 if prev is not None and end - prev == dt else 1
            best, prev = max(best, run), end
        return best

    hold = AlertPolicy().sbe_rise_unshared_hops
    assert longest_run("n1", 0) > hold
    assert longest_run("n2", 0) == 0
    assert 0 < longest_run("n3", 0) < hold
    assert longest_run("n1", 1) == longest_run("n2", 1) == 0


def test_memory_repairs_rule_raises_a_settled_gpu_repairing_rows_alone() -> None:
    """Rule 20 read from the feature windows: four row remaps within 1.5 h raise a GPU that has
    reported for a day while no node peer, or one, logs single-bit errors; the same beside two
    erring peers, a lemon's two at once, or four in the first day do not."""
    t0, dt, h = 1764547200.0, 300.0, 3600.0
    wearing = (26.0, 26.5, 27.0, 27.5)
    repairs = {("n2", 0): wearing, ("n1", 0): wearing, ("n3", 0): wearing,
               ("n2", 1): (26.0, 26.0), ("n2", 2): (2.0, 2.5, 3.0, 3.5)}
    # node peers' single-bit errors within 6 h of the repairs: two beside n1/0, one beside n3/0
    sbe_at = {("n1", 1): 25.5, ("n1", 2): 25.5, ("n3", 1): 25.5}
    samples = []
    for i in range(int(30 * h / dt)):
        for node in ("n1", "n2", "n3"):
            for g in range(4):
                at_h = i * dt / h
                metrics = {"DCGM_FI_DEV_GPU_UTIL": 90.0, "DCGM_FI_DEV_SM_CLOCK": 1980.0,
                           "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": sum(
                               r <= at_h for r in repairs.get((node, g), ())),
                           "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": float(at_h >= sbe_at.get((node, g), 1e9))}
                samples.append(steady_sample(t0 + i * dt, node, g, metrics))
    hops = rule_hops(samples, "memory_repairs_unshared")
    first_hit: dict[tuple[str, int], float] = {}
    for node, gpu, ts in sorted(hops, key=lambda hop: hop[2]):
        first_hit.setdefault((node, gpu), ts)
    fourth_repair_hop = t0 + 27.5 * h + 600.0
    assert first_hit == {("n2", 0): fourth_repair_hop, ("n3", 0): fourth_repair_hop}


def test_power_brake_rule_raises_the_gpu_that_brakes_beyond_its_node_not_a_shelfs_gpus() -> None:
    """Rule 24 read from the feature windows over 14 h of 60 s samples: every GPU of n1 brakes
    for a minute every 30 min (its shelf), n1/0 also alone every 10 min from hour 8 (its supply
    failing); every GPU of n2 brakes every 20 min (a facility cap: each brakes more often than
    n1's peers, as often as its own peers)."""
    t0, dt, h = 1764547200.0, 60.0, 3600.0

    def braked(m: int, node: str, g: int) -> bool:
        if node == "n2":
            return m % 20 == 7
        return m % 30 == 3 or (g == 0 and m >= 8 * 60 and m % 10 == 5)

    samples = [steady_sample(t0 + m * dt, node, g,
                             {"DCGM_FI_DEV_CLOCKS_EVENT_REASONS": 0x80 if braked(m, node, g) else 0})
               for m in range(14 * 60) for node in ("n1", "n2") for g in range(4)]
    hops = rule_hops(samples, "power_brake_beyond_peers")
    assert {(node, gpu) for node, gpu, _ in hops} == {("n1", 0)}
    assert t0 + 8 * h < hops[0][2] < t0 + 10 * h  # within two hours of braking beyond its peers


@pytest.mark.parametrize(("name", "first", "second", "benign"), [
    ("xid_gsp_error", 119, 120, 45),  # rule 21: GSP timeout / error; 45 follows another error
    ("xid_memory_warning", 92, 94, 63),  # rule 23: high single-bit rate / contained; 63 a row remap
])
def test_xid_rule_raises_on_a_change_to_its_xids_not_on_a_repeat_or_another_xid(
        name: str, first: int, second: int, benign: int) -> None:
    """An XID rule read from the feature windows: GPU 0 logs `first` at 1 h and still reads it
    when it reports again after a 2 h silence; GPU 1 logs the `benign` XID; GPU 2 `second`."""
    t0, dt = 1764547200.0, 60.0
    xids = {0: lambda m: first if m >= 60 else 0, 1: lambda m: benign if m >= 60 else 0,
            2: lambda m: second if m >= 200 else 0}
    samples = [steady_sample(t0 + m * dt, "n1", g, {"DCGM_FI_DEV_XID_ERRORS": xids[g](m)})
               for m in range(400) for g in range(3) if not (g == 0 and 100 <= m < 220)]
    # the hops of the changes, once each
    assert rule_hops(samples, name) == [("n1", 0, t0 + 4200.0), ("n1", 2, t0 + 12600.0)]


@pytest.mark.parametrize(("name", "counter"), [
    ("nvlink_errors_streaking", "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"),  # rule 22
    ("pcie_replays_streaking", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"),  # rule 25
])
def test_link_streak_rule_raises_a_link_erring_faster_every_hop_not_a_burst_or_a_lemon(
        name: str, counter: str) -> None:
    """Rules 22 and 25 read from the feature windows over four days of 60 s samples: GPU 0's link
    errs in every sample of its last 80 minutes, faster and faster; GPU 1 logs one burst of 400
    errors; GPU 2 (a lemon) errs every minute at a steady rate throughout. (The rate is against
    the GPU's observed week: four days let the last hour's share of it pass the level.)"""
    t0, dt, n = 1764547200.0, 60.0, 4 * 24 * 60
    start = n - 80  # GPU 0's errors begin 80 minutes before the end

    def crc(g: int, m: int) -> float:
        if g == 0:
            k = max(0, m - start)
            return float(k * (k + 1) // 2)  # 1, 2, 3, ... new errors a minute
        if g == 1:
            return 400.0 if m >= 1500 else 0.0
        return float(m)

    samples = [steady_sample(t0 + m * dt, "n1", g, {counter: crc(g, m)})
               for m in range(n) for g in range(3)]
    hops = rule_hops(samples, name)
    assert {gpu for _, gpu, _ in hops} == {0}
    assert hops[0][2] == t0 + (start // 10 + 6) * 600.0  # at the end of the sixth hop with errors


@pytest.mark.parametrize("rule", SETTLED, ids=lambda r: r.name)
def test_settled_surge_raises_a_day_after_a_return_not_on_the_board_before(rule) -> None:
    hold = getattr(RULES_ONLY, rule.hold)
    settle_hops = int(rule.settled_h * 6)  # 10-minute hops
    # back from a silence with the old board's residual still in its history: the level is held
    # from the first hop, but the hold starts only once the GPU has reported for settled_h
    n = settle_hops + hold + 2
    reporting = [i / 6 for i in range(n)]
    out = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * n,
              {rule.feature: [rule.level + 0.05] * n, "hours_reporting": reporting})
    assert alert_series(out, n).index(True) == settle_hops + hold - 1
    # the residual gone within the day (the history moved on): never raised
    fading = [rule.level + 0.05] * (settle_hops - 1) + [rule.level - 0.1] * (hold + 3)
    out = run(FailurePredictor(stub_model(RULES_ONLY)), [0.0] * len(fading),
              {rule.feature: fading, "hours_reporting": reporting[:len(fading)]})
    assert not any(p.alert for p in out)


@pytest.mark.parametrize("saved", ["current", "before the sustained tier"])
def test_surge_streak_survives_a_restore(saved: str) -> None:
    hold = RULES_ONLY.surge_hold_hops
    a = FailurePredictor(stub_model(RULES_ONLY))
    assert not any(p.alert for p in run(a, [0.0] * (hold - 1), {"nvl_accel": [NVL_LEVEL + 1] * (hold - 1)}))
    b = FailurePredictor(stub_model(RULES_ONLY))
    for key in a.keys():  # noqa: SIM118 - the processor contract's keys()
        state = json.loads(json.dumps(a.state(key)))
        if saved != "current":  # such checkpoints held the 2 h surge's streak as one number
            state["surge"] = state["surge"][0]
        b.restore(key, state)
    f = np.zeros((1, len(FEATURE_NAMES)))
    f[0, FEATURE_NAMES.index("nvl_accel")] = NVL_LEVEL + 1
    out, _ = b.process_arrays([("n1", 0)], np.array([1764547200.0 + 600.0 * hold]), f)
    assert out and out[0].alert


RECURRING = [r for r in ALERT_RULES if r.within_h]


def _hops_at(rule, hours: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Event times (hourly hops) and features with `rule`'s feature above its level at `hours`."""
    n = int(max(hours)) + 2
    ts = 1764547200.0 + 3600.0 * np.arange(n)
    f = np.zeros((n, len(FEATURE_NAMES)))
    f[[int(h) for h in hours], FEATURE_NAMES.index(rule.feature)] = rule.level + 0.05
    return ts, f


@pytest.mark.parametrize("rule", RECURRING, ids=lambda r: r.name)
def test_recurring_rule_raises_when_its_count_falls_within_the_window(rule) -> None:
    count = getattr(RULES_ONLY, rule.hold)
    assert count >= 2
    # `count` hops above the level, apart (not consecutive), inside the window: raised at the last
    inside = [i * (rule.within_h - 2) / (count - 1) for i in range(count)]
    ts, f = _hops_at(rule, inside)
    out, _ = FailurePredictor(stub_model(RULES_ONLY)).process_arrays([("n1", 0)] * len(ts), ts, f)
    first = next(p for p in out if p.alert)
    assert first.ts == ts[int(inside[-1])]
    assert {s.name: s.value for s in first.signals}["source"] == f"rule:{rule.name}"
    # as many, each more than the window after the one `count` - 1 before it: never raised
    spread = [i * (rule.within_h + 2) / (count - 1) for i in range(2 * count)]
    ts, f = _hops_at(rule, spread)
    out, _ = FailurePredictor(stub_model(RULES_ONLY)).process_arrays([("n1", 0)] * len(ts), ts, f)
    assert not any(p.alert for p in out)
    # off
    off = FailurePredictor(stub_model(replace(RULES_ONLY, **{rule.hold: 0})))
    ts, f = _hops_at(rule, inside)
    assert not any(p.alert for p in off.process_arrays([("n1", 0)] * len(ts), ts, f)[0])
    # a checkpoint between the hops keeps them: the restored GPU raises at the same hop
    a = FailurePredictor(stub_model(RULES_ONLY))
    a.process_arrays([("n1", 0)] * int(inside[-1]), ts[:int(inside[-1])], f[:int(inside[-1])])
    b = FailurePredictor(stub_model(RULES_ONLY))
    for key in a.keys():  # noqa: SIM118 - the processor contract's keys()
        b.restore(key, json.loads(json.dumps(a.state(key))))
    rest = slice(int(inside[-1]), None)
    out, _ = b.process_arrays([("n1", 0)] * len(ts[rest]), ts[rest], f[rest])
    assert next(p for p in out if p.alert).ts == ts[int(inside[-1])]


def test_model_alert_source_and_stable_ids() -> None:
    out = run(FailurePredictor(stub_model()), [0.9, 0.9, 0.9])
    alert = [p for p in out if p.alert][0]
    assert {s.name: s.value for s in alert.signals}["source"] == "model"
    assert alert.id == f"failure:n1/0:{int(alert.ts)}"
    again = run(FailurePredictor(stub_model()), [0.9, 0.9, 0.9])
    assert [p.model_dump() for p in out] == [p.model_dump() for p in again]


def test_state_round_trip() -> None:
    a = FailurePredictor(stub_model())
    run(a, [0.9])  # one hop high: not raised yet
    b = FailurePredictor(stub_model())
    for key in a.keys():  # noqa: SIM118 - the processor contract's keys()
        b.restore(key, json.loads(json.dumps(a.state(key))))
    f = np.zeros((1, len(FEATURE_NAMES)))
    f[0, FEATURE_NAMES.index(RISK)] = 0.9
    out, _ = b.process_arrays([("n1", 0)], np.array([1764547200.0 + 1200]), f)
    assert out[0].alert  # the second consecutive high hop raises after the restore


def _synthetic(rng: np.random.Generator, n: int, pos_share: float) -> tuple[np.ndarray, np.ndarray]:
    x = rng.normal(0, 1, (n, len(MODEL_FEATURES)))
    y = rng.random(n) < pos_share
    x[y, MODEL_FEATURES.index("sbe_vol_24h")] += 4.0  # failing GPUs: single-bit errors climb
    return x, y


def test_fit_learns_signal_and_save_load_checks_schema(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = _synthetic(rng, 2500, 0.08)
    hours = np.where(y, rng.uniform(1, 48, len(y)), np.nan)
    groups = np.arange(len(y)) // 10
    model = fit_failure_model(x, y, hours, groups, seed=1)
    xt, yt = _synthetic(np.random.default_rng(1), 2000, 0.05)
    p = model.predict_proba(xt)
    assert p[yt].mean() > 0.5 > p[~yt].mean()
    # the top contribution of a failing row is the signal that was planted
    c = model.contributions(xt[yt][:1])
    assert MODEL_FEATURES[int(np.argmax(c[0]))] == "sbe_vol_24h"
    model.save(tmp_path)
    loaded = FailureModel.load(tmp_path)
    assert np.allclose(loaded.predict_proba(xt), p)
    meta = json.loads((tmp_path / "failure_model.json").read_text())
    meta["feature_names"] = meta["feature_names"][:-1]
    meta["feature_schema_hash"] = "0" * 16
    (tmp_path / "failure_model.json").write_text(json.dumps(meta))
    with pytest.raises(FeatureSchemaError, match="retrain"):
        FailureModel.load(tmp_path)


def test_missing_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="predictor train"):
        FailureModel.load(tmp_path)


def test_predictions_carry_the_gpus_job_and_rank() -> None:
    f = np.zeros((3, len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index(RISK)] = 0.9
    ts = 1764547200.0 + 600.0 * np.arange(1, 4)
    out, _ = FailurePredictor(stub_model()).process_arrays(
        [("n1", 0)] * 3, ts, f, job_ranks=[("job-1", 2), ("job-1", 2), (None, None)])
    by_ts = {p.ts: p for p in out}
    assert (by_ts[ts[1]].job, by_ts[ts[1]].rank) == ("job-1", 2) and by_ts[ts[1]].alert
    assert by_ts[ts[2]].job is None  # the GPU left its job: the prediction says so
    # the record path takes job/rank from the FeatureVector
    from fleetwise.schemas import FeatureVector

    vecs = [FeatureVector(scope="gpu", ts=float(t), window_s=600, node="n1", gpu=0, job="job-9", rank=1,
                          values={RISK: 0.9}) for t in ts]
    recs = FailurePredictor(stub_model()).process(vecs)
    assert recs and all((p.job, p.rank) == ("job-9", 1) for p in recs)


def test_memory_driven_risk_raises_on_a_lower_probability_that_persists() -> None:
    from fleetwise.predictors.failure import MEMORY_PREFIXES

    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.8, lo=0.3, k_raise=2, hi_memory=0.5,
                      k_raise_memory=4, m_clear=3, model_alerts=True)
    model = stub_model(pol)
    mem_col = MODEL_FEATURES.index("sbe_vol_1h")
    assert MODEL_FEATURES[mem_col].startswith(MEMORY_PREFIXES)
    link_col = MODEL_FEATURES.index("nvl_crc_flit_1h")
    model.importance = np.zeros(len(MODEL_FEATURES))
    model.importance[[mem_col, link_col]] = 0.5

    def alerts(probs: list[float], driver: str) -> list[bool]:
        return alert_series(run(FailurePredictor(model), probs, {driver: [50.0] * len(probs)}), len(probs))

    # Moderate risk (between hi_memory and hi) raises after k_raise_memory hops when single-bit
    # errors drive it, never when NVLink CRC errors do.
    moderate = [0.6] * 6
    assert alerts(moderate, "sbe_vol_1h") == [False, False, False, True, True, True]
    assert alerts(moderate, "nvl_crc_flit_1h") == [False] * 6
    # The streak must be unbroken: a hop below hi_memory starts it over.
    assert alerts([0.6, 0.6, 0.6, 0.4, 0.6, 0.6, 0.6, 0.6], "sbe_vol_1h") == [False] * 7 + [True]
    # High risk raises after k_raise hops whatever drives it.
    high = [0.9] * 4
    assert alerts(high, "sbe_vol_1h") == alerts(high, "nvl_crc_flit_1h") == [False, True, True, True]


def test_policy_replay_with_memory_driven_rows_matches_the_stream() -> None:
    """The memory tier in a replay of stored probabilities (memory flags from
    `FailureModel.memory_share`, as bench/failure_eval.py computes them) raises where
    process_arrays does."""
    rng = np.random.default_rng(11)
    n = 600
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.9, lo=0.3, k_raise=2, hi_memory=0.5,
                      k_raise_memory=4, m_clear=3, model_alerts=True)
    model = stub_model(pol)
    model.importance = np.zeros(len(MODEL_FEATURES))
    model.importance[[MODEL_FEATURES.index("sbe_vol_1h"), MODEL_FEATURES.index("nvl_crc_flit_1h")]] = 0.5
    keys = [("n1", i % 3) for i in range(n)]
    ts = 1764547200.0 + 600.0 * (np.arange(n) // 3 + 1)
    f = np.zeros((n, len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index(RISK)] = np.clip(np.cumsum(rng.normal(0, 0.12, n)) % 1.1, 0, 1)
    # memory-driven stretches and link-driven stretches
    driver = np.where((np.arange(n) // 45) % 2 == 0, "sbe_vol_1h", "nvl_crc_flit_1h")
    for i, name in enumerate(driver):
        f[i, FEATURE_NAMES.index(name)] = 50.0
    stream, prob = FailurePredictor(model).process_arrays(keys, ts, f)
    memory = model.memory_share(f[:, model.cols]) >= 0.5
    rows, states = FailurePredictor(model).advance_policy(keys, ts, prob, memory, [[] for _ in range(n)])
    replayed = [(keys[i], ts[i], alert) for i, (alert, _, _) in zip(rows, states, strict=True)]
    assert [((p.node, p.gpu), p.ts, p.alert) for p in stream] == replayed
    # the tier did something: some raise came at a probability below hi
    raises = [i for i, (alert, _, was) in zip(rows, states, strict=True) if alert and not was]
    assert raises and any(prob[i] < pol.hi for i in raises)


def test_thermal_risk_does_not_raise_while_the_nodes_other_gpus_run_warm_too() -> None:
    """Heat the node shares (>= shared_heat_peers other GPUs warm) holds back a thermal-driven
    raise and says why; the GPU's own heat, memory-driven risk and a policy with the check off
    raise as before."""
    from fleetwise.predictors.failure import THERMAL_PREFIXES

    assert RISK.startswith(THERMAL_PREFIXES)  # the stub's probability column is a thermal signal
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=2, m_clear=3,
                      model_alerts=True)  # shared_heat_peers 2
    high = [0.9] * 6

    def alerts(peers: list[float], policy: AlertPolicy = pol, extra: dict | None = None) -> list[bool]:
        out = run(FailurePredictor(stub_model(policy)), high, {"node_warm_peers_1h": peers, **(extra or {})})
        return alert_series(out, len(high))

    assert alerts([0] * 6) == alerts([1] * 6) == [False, True, True, True, True, True]
    assert alerts([3] * 6) == [False] * 6
    # the peers cool at hop 3: the GPU's own heat raises after k_raise hops of it
    assert alerts([3, 3, 3, 0, 0, 0]) == [False] * 4 + [True, True]
    assert alerts([3] * 6, replace(pol, shared_heat_peers=0)) == [False, True, True, True, True, True]
    held = run(FailurePredictor(stub_model(pol)), high, {"node_warm_peers_1h": [3] * 6})
    assert held and all(p.reason.endswith("heat shared with >= 2 GPUs of the node") for p in held)
    # memory-driven risk is not thermal: raised with warm peers around it
    model = stub_model(pol, risk=("sbe_vol_1h",))
    model.importance = np.zeros(len(MODEL_FEATURES))
    model.importance[MODEL_FEATURES.index("sbe_vol_1h")] = 1.0
    out = run(FailurePredictor(model), high, {"node_warm_peers_1h": [3] * 6, "sbe_vol_1h": [0.9] * 6})
    assert alert_series(out, 6) == [False, True, True, True, True, True]


def test_a_risk_that_falls_below_hi_without_the_heat_the_node_shares_does_not_raise() -> None:
    """shared_heat_by_removal: a hop whose probability without its thermal features (at the healthy
    baseline) falls below hi rests on heat though other features carry most of its signal, so
    the node's warm peers hold it back; one that stays at risk without the heat raises."""
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=2, m_clear=3,
                      model_alerts=True)  # shared_heat_peers 2
    model = stub_model(pol, risk=(RISK, "pcie_replay_1h"))  # p = heat + PCIe replays
    model.importance = np.zeros(len(MODEL_FEATURES))
    model.importance[MODEL_FEATURES.index("pcie_replay_1h")] = 1.0  # the signal's share: all PCIe

    def alerts(heat: float, pcie: float, peers: float, policy: AlertPolicy = pol) -> list[bool]:
        model.policy = policy
        extra = {"pcie_replay_1h": [pcie] * 6, "node_warm_peers_1h": [peers] * 6}
        out = run(FailurePredictor(model), [heat] * 6, extra)
        return alert_series(out, 6)

    raised = [False, True, True, True, True, True]
    assert alerts(0.5, 0.4, peers=0) == raised
    assert alerts(0.5, 0.4, peers=3) == [False] * 6  # 0.4 without the heat the node shares
    assert alerts(0.2, 0.7, peers=3) == raised  # 0.7 without it: the GPU's own PCIe risk
    assert alerts(0.5, 0.4, peers=3, policy=replace(pol, shared_heat_by_removal=False)) == raised


def test_a_risk_that_rests_on_trends_over_a_near_empty_week_does_not_raise() -> None:
    """sparse_trend_by_removal: a hop whose probability without the trend columns (at the healthy
    baseline) falls below hi, on a GPU whose week holds a handful of errors, does not count; the
    same trend over a week of errors, or a risk that stays without the trend, raises."""
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=2, m_clear=3,
                      model_alerts=True)
    model = stub_model(pol, risk=(RISK, "sbe_trend"))  # p = heat + the single-bit trend

    def alerts(heat: float, trend: float, week: dict[str, float], policy: AlertPolicy = pol) -> list[bool]:
        model.policy = policy
        extra = {"sbe_trend": [trend] * 6, **{name: [v] * 6 for name, v in week.items()}}
        return alert_series(run(FailurePredictor(model), [heat] * 6, extra), 6)

    raised = [False, True, True, True, True, True]
    one_error = {"sbe_vol_7d": 1.0, "pcie_replay_7d": 12.0, "nvl_crc_flit_7d": np.nan}  # no NVLink
    assert alerts(0.2, 0.5, one_error) == [False] * 6  # 0.2 without the trend: one error's "trend"
    assert alerts(0.2, 0.5, {**one_error, "sbe_vol_7d": 3.0}) == raised  # three errors: not sparse
    assert alerts(0.2, 0.5, {**one_error, "pcie_replay_7d": 30.0}) == raised  # replays every hour
    assert alerts(0.2, 0.5, {**one_error, "nvl_crc_flit_7d": 40.0}) == raised
    assert alerts(0.65, 0.1, one_error) == raised  # at risk without the trend
    assert alerts(0.2, 0.5, one_error, policy=replace(pol, sparse_trend_by_removal=False)) == raised
    model.policy = pol
    out = run(FailurePredictor(model), [0.2] * 3, {"sbe_trend": [0.5] * 3, "sbe_vol_7d": [1.0] * 3})
    assert "rests on trends over a near-empty week" in out[-1].reason


def test_single_bit_risk_does_not_raise_while_the_nodes_other_gpus_log_them_too() -> None:
    """shared_sbe_peers: risk driven by single-bit errors, with that many other GPUs of the node
    logging them in 6 h, holds back both tiers."""
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.8, lo=0.3, k_raise=2, hi_memory=0.5,
                      k_raise_memory=2, m_clear=3, model_alerts=True, shared_sbe_peers=2)
    model = stub_model(pol)
    model.importance = np.zeros(len(MODEL_FEATURES))
    model.importance[MODEL_FEATURES.index("sbe_active_6h")] = 1.0

    def alerts(probs: list[float], peers: list[float], policy: AlertPolicy = pol) -> list[bool]:
        model.policy = policy
        extra = {"node_sbe_peers_6h": peers, "sbe_active_6h": [0.5] * len(probs)}
        out = run(FailurePredictor(model), probs, extra)
        return alert_series(out, len(probs))

    for probs in ([0.9] * 5, [0.6] * 5):  # the general tier and the memory tier
        assert alerts(probs, [1] * 5) == [False, True, True, True, True]
        assert alerts(probs, [2] * 5) == [False] * 5
        assert alerts(probs, [2, 2, 0, 0, 0]) == [False, False, False, True, True]
        assert alerts(probs, [2] * 5, replace(pol, shared_sbe_peers=0)) == [False, True, True, True, True]
    model.policy = pol
    held = run(FailurePredictor(model), [0.9] * 3, {"node_sbe_peers_6h": [3] * 3, "sbe_active_6h": [0.5] * 3})
    assert held and all(p.reason.endswith("single-bit errors shared with >= 2 GPUs of the node")
                        for p in held)


def test_policy_replay_with_shared_heat_matches_the_stream() -> None:
    """Stored scores (the rows at or above the watch floor, as float32, like HopScores) replayed
    with `risk_drivers` raise where process_arrays does, warm node peers included."""
    from fleetwise.predictors.policy_choice import WATCH_FLOOR

    rng = np.random.default_rng(12)
    n = 900
    keys = [("n1", i % 3) for i in range(n)]
    ts = 1764547200.0 + 600.0 * (np.arange(n) // 3 + 1)
    f = np.zeros((n, len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index(RISK)] = np.clip(np.cumsum(rng.normal(0, 0.12, n)) % 1.1, 0, 1)
    f[:, FEATURE_NAMES.index("node_warm_peers_1h")] = np.where((np.arange(n) // 60) % 3 == 0, 2.0, 0.0)
    # the heat hold (6 hops against k_raise 3) is replayed too; a link-driven stretch has none
    f[:, FEATURE_NAMES.index("nvl_crc_flit_1h")] = np.where((np.arange(n) // 150) % 2 == 1, 50.0, 0.0)
    pol = AlertPolicy(k_raise_thermal=6, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=3, m_clear=3,
                      model_alerts=True)
    stream, prob = FailurePredictor(stub_model(pol)).process_arrays(keys, ts, f)
    replayer = FailurePredictor(stub_model(pol))
    watch = np.flatnonzero(prob >= WATCH_FLOOR)
    memory, shared, driven = np.zeros(n, bool), np.zeros(n, np.int8), np.zeros(n, np.int8)
    memory[watch], shared[watch], driven[watch] = replayer.risk_drivers(f[watch].astype(np.float32),
                                                                        prob[watch])
    rows, states = replayer.advance_policy(keys, ts, prob, memory, [[] for _ in range(n)], shared, driven)
    replayed = [(keys[i], ts[i], alert) for i, (alert, _, _) in zip(rows, states, strict=True)]
    assert [((p.node, p.gpu), p.ts, p.alert) for p in stream] == replayed
    assert shared.any() and driven.any() and not driven.all() and any(a for *_, a in replayed)
    # and the shared heat and the heat hold each changed something: without either the stream
    # raises elsewhere
    for off in ({"shared_heat_peers": 0}, {"k_raise_thermal": 0}):
        unchecked, _ = FailurePredictor(stub_model(replace(pol, **off))).process_arrays(keys, ts, f)
        assert [p.alert for p in unchecked] != [p.alert for p in stream], off


def test_a_model_stored_before_the_memory_threshold_keeps_its_meaning(tmp_path) -> None:
    """k_raise_memory in older metadata meant hops at hi: loading it sets hi_memory = hi."""
    model = stub_model(AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.9, k_raise=3, k_raise_memory=12))
    model.classifier = model.calibrator = model.lead_regressor = None  # joblib-able
    model.save(tmp_path)
    meta = json.loads((tmp_path / "failure_model.json").read_text())
    del meta["policy"]["hi_memory"]
    (tmp_path / "failure_model.json").write_text(json.dumps(meta))
    loaded = FailureModel.load(tmp_path).policy
    assert (loaded.hi_memory, loaded.k_raise_memory, loaded.hi) == (0.9, 12, 0.9)


def test_packaged_policy_is_the_code_default() -> None:
    """The shipped model's metadata carries the tuned policy; `fleetwise predictor train`
    writes AlertPolicy() into it, so a retrain must reproduce the same policy."""
    from dataclasses import asdict

    assert asdict(FailureModel.load().policy) == asdict(AlertPolicy())


def test_policy_replay_from_stored_probabilities_matches_the_stream() -> None:
    """advance_policy over stored probabilities (how bench/failure_eval.py sweeps policies on
    30-day traces) raises and clears exactly where process_arrays does."""
    rng = np.random.default_rng(7)
    n = 400
    probs = np.clip(np.cumsum(rng.normal(0, 0.15, n)) % 1.2, 0, 1)
    keys = [("n1", i % 3) for i in range(n)]
    ts = 1764547200.0 + 600.0 * (np.arange(n) // 3 + 1)
    f = np.zeros((n, len(FEATURE_NAMES)))
    f[:, FEATURE_NAMES.index(RISK)] = probs
    f[rng.random(n) < 0.01, FEATURE_NAMES.index("xid_bus_hop")] = 1.0
    stream, prob = FailurePredictor(stub_model()).process_arrays(keys, ts, f)
    rules = [["xid79_off_bus"] if f[i, FEATURE_NAMES.index("xid_bus_hop")] > 0 else [] for i in range(n)]
    rows, states = FailurePredictor(stub_model()).advance_policy(keys, ts, prob, np.zeros(n, bool), rules)
    replayed = [(keys[i], ts[i], alert) for i, (alert, _, _) in zip(rows, states, strict=True)]
    assert [((p.node, p.gpu), p.ts, p.alert) for p in stream] == replayed
    assert any(a for *_, a in replayed) and not all(a for *_, a in replayed)


def test_same_evidence_does_not_raise_the_gpu_again() -> None:
    """After a model alert clears, the same GPU is raised again within `rearm_hops` only on
    stronger evidence (p above the cleared episode's peak + margin); after that, as usual."""
    pol = AlertPolicy(k_raise_thermal=0, k_raise_sbe=0, hi=0.6, lo=0.3, k_raise=2, m_clear=3, rearm_hops=10,
                      rearm_margin=0.05, model_alerts=True)
    first = [0.7, 0.7, 0.7, 0.1, 0.1, 0.1]  # raise at hop 2, clear at hop 6 (peak 0.7)
    same = [0.7, 0.7, 0.72, 0.1, 0.1, 0.1]  # the decaying burst comes back: no new alert
    stronger = [0.9, 0.9]  # new, stronger evidence inside the window: raised
    probs = first + same + stronger
    alerts = alert_series(run(FailurePredictor(stub_model(pol)), probs), len(probs))
    assert alerts[:6] == [False, True, True, True, True, False]
    assert not any(alerts[6:12])
    assert alerts[12:] == [False, True]
    # Outside the window the same evidence raises again.
    late = first + [0.1] * 10 + [0.7, 0.7]
    alerts = alert_series(run(FailurePredictor(stub_model(pol)), late), len(late))
    assert alerts[-1] is True
    # Rules are never held back.
    out = run(FailurePredictor(stub_model(pol)), first + [0.1], {"xid_bus_hop": [0] * 6 + [1]})
    assert alert_series(out, 7)[-1] is True


def model_repairs(n: int) -> dict[str, list[float]]:
    """n hops whose risk memory repairs drive, beside more node peers' single-bit errors than
    rule 20 allows (so that it, memory repairs the node does not share, leaves them to the model)."""
    rule = RULE_BY_NAME["memory_repairs_unshared"]
    return {"mem_repairs_24h": [50.0] * n, rule.unshared: [peers_beyond(rule)] * n}


def test_default_policy_raises_on_hours_of_risk_not_on_a_burst() -> None:
    """The packaged hold: the model raises only after 6 h (36 hops) at p >= hi; an episode of
    high risk that ends sooner (a benign burst, a lemon's noisy hours) raises nothing. The stub's
    risk column is thermal, so a link feature carries these hops' signal."""
    pol = AlertPolicy()
    assert pol.model_alerts and pol.k_raise == pol.k_raise_memory == 36
    link = {"nvl_crc_flit_1h": [50.0] * 45}
    burst = [0.99] * 35 + [0.1] * 10
    assert not any(alert_series(run(FailurePredictor(stub_model(pol)), burst, link), len(burst)))
    sustained = [0.1] * 5 + [0.99] * 40
    alerts = alert_series(run(FailurePredictor(stub_model(pol)), sustained, link), len(sustained))
    assert alerts.index(True) == 5 + 35  # the 36th hop at risk
    # Memory-driven risk waits as long (no lower tier): the same burst of memory repairs.
    repairs = model_repairs(len(burst))
    assert not any(alert_series(run(FailurePredictor(stub_model(pol)), burst, repairs), len(burst)))


def raised_at(pol: AlertPolicy, n: int, extra: dict[str, list[float]] | None = None) -> int | None:
    """The hop (0-based) where n hops at p = 0.99 first raise, or None."""
    alerts = alert_series(run(FailurePredictor(stub_model(pol)), [0.99] * n, extra), n)
    return alerts.index(True) if True in alerts else None


def test_heat_and_single_bit_driven_risk_is_held_longer() -> None:
    """A streak with a thermal-driven hop among its last 36 raises after the heat hold (72 hops,
    12 h, by default since judge39; 108 here), one with a single-bit-driven hop after 72 (12 h),
    in either tier; other causes after 36."""
    default, n = AlertPolicy(), 130
    assert (default.k_raise_thermal, default.k_raise_sbe) == (72, 72)
    assert raised_at(default, n) == 71  # the stub's risk column is thermal
    pol = replace(default, k_raise_thermal=108)  # a heat hold longer than the single-bit one
    assert raised_at(pol, n) == 107
    assert raised_at(pol, 107) is None
    assert raised_at(pol, n, {"sbe_active_6h": [50.0] * n}) == 71  # memory tier (36) held too
    assert raised_at(pol, n, model_repairs(n)) == 35
    # One thermal-driven hop (the 21st) in a link-driven streak: it raises once that hop is 36
    # hops back, not at the 36th.
    link = [50.0] * n
    link[20] = 0.0
    assert raised_at(pol, n, {"nvl_crc_flit_1h": link}) == 20 + 36
    # Off (0): the general hold.
    assert raised_at(replace(pol, k_raise_thermal=0), n) == 35
    assert raised_at(replace(pol, k_raise_sbe=0), n, {"sbe_active_6h": [50.0] * n}) == 35
    # While held, a watch prediction says which hold it waits for; without one, plain "watch".
    out = run(FailurePredictor(stub_model(pol)), [0.99] * 60)
    assert {p.reason for p in out} == {"watch: heat-driven, raises after 108 hops at risk"}
    out = run(FailurePredictor(stub_model(pol)), [0.99] * 60, {"sbe_active_6h": [50.0] * 60})
    assert {p.reason for p in out} == {"watch: single-bit-driven, raises after 72 hops at risk"}
    out = run(FailurePredictor(stub_model(pol)), [0.99] * 30, model_repairs(30))
    assert {p.reason for p in out} == {"watch"}
    out = run(FailurePredictor(stub_model(replace(pol, model_alerts=False))), [0.99] * 60)
    assert {p.reason for p in out} == {"watch"}  # the rules alone: the model raises nothing


def test_policy_spec_sets_the_thresholds_over_a_base_and_names_a_bad_one() -> None:
    from fleetwise.predictors.failure import policy_from_spec

    base = AlertPolicy(m_clear=9, model_alerts=False)
    pol = policy_from_spec("0.9,3,12,0.6", base)
    assert (pol.hi, pol.lo, pol.k_raise, pol.k_raise_memory, pol.hi_memory) == (0.9, 0.45, 3, 12, 0.6)
    assert pol.m_clear == 9 and pol.model_alerts  # the rest from the base; a threshold is the model's
    assert policy_from_spec("0.8,2,6").hi_memory == 0.8
    for bad in ("0.9,3", "0.9,x,12", "1.5,3,12", "0.9,0,12", "0.9,3,12,0"):
        with pytest.raises(ValueError, match="policy"):
            policy_from_spec(bad)
