"""Straggler / job-wide slowdown detector: model-aware speed factors, hysteresis, state."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from fleetwise.catalog import lookup
from fleetwise.predictors.stragglers import (
    JOB_WIDE_NODE,
    StragglerConfig,
    StragglerDetector,
    catalog_speed,
    score_stragglers,
)
from fleetwise.schemas import FeatureVector, Prediction

T0 = 1_764_489_600.0


def make_steps(
    models: list[str],
    *,
    hours: float = 4.0,
    seed: int = 0,
    noise: float = 0.01,
    interval_s: float = 60.0,
    slow: dict[int, tuple[float, float, float]] | None = None,
    network: tuple[float, float, float] | None = None,
    input_stall: tuple[float, float, float] | None = None,
    job: str = "llm",
    proportional: bool = True,
) -> list[dict]:
    """Sampled step records of one synchronous data-parallel job.

    Shares follow catalog capability (what a planner gives); ``slow`` maps rank ->
    (start_s, end_s, speed) relative to T0; ``network``/``input_stall`` are
    (start_s, end_s, time multiplier) for the communication / every rank's compute.
    """
    rng = np.random.default_rng(seed)
    caps = [lookup(m).capability_tflops("bf16") for m in models]
    top = max(caps)
    samples = [max(1, round(32 * c / top)) if proportional else 32 for c in caps]
    sec_per_sample_tflop = 2.0 * top / 32  # fastest rank computes its share in ~2 s
    records = []
    n = int(hours * 3600 / interval_s)
    for i in range(n):
        t = i * interval_s
        comm = 0.4
        if network and network[0] <= t < network[1]:
            comm *= network[2]
        stall = input_stall[2] if input_stall and input_stall[0] <= t < input_stall[1] else 1.0
        computes = []
        for r, cap in enumerate(caps):
            speed = 1.0
            if slow and r in slow and slow[r][0] <= t < slow[r][1]:
                speed = slow[r][2]
            c = samples[r] / cap * sec_per_sample_tflop * stall / speed
            computes.append(c * float(np.exp(rng.normal(0.0, noise))))
        step_time = max(computes) + comm * float(np.exp(rng.normal(0.0, noise)))
        for r, m in enumerate(models):
            records.append({
                "ts": T0 + t + 0.001 * r, "job": job, "rank": r, "node": f"node-{r // 8:03d}",
                "gpu": r % 8, "step": 20 * i, "step_time_s": round(step_time, 6),
                "compute_s": round(computes[r], 6), "micro_batch": samples[r], "samples": samples[r],
                "model": m,
            })
    return records


def predictions(out: list) -> list[Prediction]:
    return [r for r in out if isinstance(r, Prediction)]


def rank_alerts(out: list) -> list[Prediction]:
    return [p for p in predictions(out) if p.rank is not None and p.alert]


def run(records: list[dict], detector: StragglerDetector | None = None) -> list:
    det = detector or StragglerDetector()
    return det.process(records) + det.flush()


def test_step_records_out_of_time_order_are_counted_for_the_caller_to_report():
    # A trace written rank by rank: every rank's records after the previous rank's last. The
    # detector compares a job's ranks step by step as the records come, so it cannot judge such
    # a trace; it counts the groups that began long before the job's newest record instead.
    records = make_steps(["h100-sxm"] * 4, hours=2, seed=3)
    in_order = StragglerDetector()
    run(records, in_order)
    assert in_order.groups_back_in_time == 0
    by_rank = sorted(records, key=lambda r: (r["rank"], r["ts"]))
    detector = StragglerDetector()
    run(by_rank, detector)
    # Ranks 1-3 each start over from the first step, 2 h before rank 0's last record: each of
    # their steps more than stale_s (900 s: 15 steps at 60 s) older than the newest record so
    # far is counted, every other step not.
    steps = len(records) // 4
    assert detector.groups_back_in_time == 3 * (steps - 16)


@pytest.mark.parametrize("proportional", [True, False])
def test_a100_among_h100_is_not_flagged(proportional):
    models = ["h100-sxm"] * 14 + ["a100-sxm-80gb"] * 2
    out = run(make_steps(models, hours=8, seed=1, proportional=proportional))
    assert rank_alerts(out) == []
    # Its speed factor is ~1 whether or not its share fits its speed: it is an A100, not a slow GPU.
    fvs = [f for f in out if isinstance(f, FeatureVector) and f.rank == 15]
    assert fvs and all(abs(f.values["speed_factor"] - 1.0) < 0.03 for f in fvs)
    if not proportional:
        # With an H100's share it computes ~2.7x longer than an H100: the fastest-rank score would flag it.
        h100 = [f for f in out if isinstance(f, FeatureVector) and f.rank == 0]
        assert fvs[0].values["median_compute_s"] > 2.5 * h100[0].values["median_compute_s"]


def test_h100_rank_20_percent_slow_is_flagged_with_its_factor():
    models = ["h100-sxm"] * 12 + ["a100-sxm-80gb"] * 4
    start = 3600.0
    out = run(make_steps(models, hours=4, seed=2, slow={5: (start, 3 * 3600, 0.8)}))
    alerts = rank_alerts(out)
    assert [(p.rank, p.node, p.gpu) for p in alerts] == [(5, "node-000", 5)]
    assert alerts[0].factor == pytest.approx(0.8, abs=0.03)
    assert alerts[0].ts - (T0 + start) <= 5 * 60  # within 5 step records
    clears = [p for p in predictions(out) if p.rank == 5 and not p.alert]
    assert len(clears) == 1 and clears[0].ts > T0 + 3 * 3600
    assert not [p for p in predictions(out) if p.rank is None]


def test_lone_a100_5_percent_slow_is_flagged_against_its_catalog_speed():
    # One A100 has no same-model peers: it is judged against the catalog prior.
    models = ["h100-sxm"] * 15 + ["a100-sxm-80gb"]
    out = run(make_steps(models, hours=3, seed=3, slow={15: (3600.0, 7200.0, 0.95)}))
    alerts = rank_alerts(out)
    assert [p.rank for p in alerts] == [15]
    assert alerts[0].factor == pytest.approx(0.95, abs=0.02)


@pytest.mark.parametrize(("kind", "cause"), [("network", "network"), ("input_stall", "input")])
def test_job_wide_slowdown_flags_no_rank_and_names_its_cause(kind, cause):
    models = ["h100-sxm"] * 8 + ["a100-sxm-80gb"] * 8
    window = (3600.0, 7200.0, 1.6 if kind == "network" else 1.15)
    out = run(make_steps(models, hours=3, seed=4, **{kind: window}))
    assert rank_alerts(out) == []
    jobwide = [p for p in predictions(out) if p.rank is None]
    assert [p.alert for p in jobwide] == [True, False]
    assert jobwide[0].node == JOB_WIDE_NODE and jobwide[0].reason == f"job-wide: {cause}"
    assert T0 + window[0] <= jobwide[0].ts <= T0 + window[0] + 5 * 60
    assert jobwide[1].ts >= T0 + window[1]


def test_no_flapping_on_a_borderline_straggler():
    # A rank hovering around the threshold with noise gives one raise and one clear at most.
    models = ["h100-sxm"] * 16
    out = run(make_steps(models, hours=10, seed=5, noise=0.015, slow={3: (3600.0, 8 * 3600, 0.94)}))
    mine = [p for p in predictions(out) if p.rank == 3]
    assert [p.alert for p in mine] == [True, False]
    assert [p for p in predictions(out) if p.rank not in (3, None)] == []


def test_state_restore_round_trip_gives_identical_outputs():
    models = ["h100-sxm"] * 6 + ["a100-sxm-80gb"] * 4
    records = make_steps(models, hours=3, seed=6, slow={2: (3000.0, 9000.0, 0.85)},
                         network=(5000.0, 6500.0, 1.5))
    whole = [r.model_dump() for r in run(records)]
    cut = len(records) // 2 + 3  # mid step group
    first = StragglerDetector()
    part = first.process(records[:cut])
    job_keys = first.keys()  # the processor contract's method, not a dict's
    saved = {k: json.dumps(first.state(k)) for k in job_keys}
    second = StragglerDetector()
    for key, blob in saved.items():
        second.restore(key, json.loads(blob))
    rest = second.process(records[cut:]) + second.flush()
    assert [r.model_dump() for r in part + rest] == whole


def test_without_features_the_same_predictions_and_state():
    # features=False (replay without --features) builds no FeatureVector but must judge alike
    # and save the same state, so a worker that publishes them can take over from it.
    records = make_steps(["h100-sxm"] * 6 + ["a100-sxm-80gb"] * 4, hours=3, seed=6,
                         slow={2: (3000.0, 9000.0, 0.85)}, network=(5000.0, 6500.0, 1.5))
    for r in records[len(records) // 3:]:
        if r["rank"] == 4:
            r["node"] = "node-009"  # the rank moves: its open window is closed out
    cut = len(records) // 2 + 3
    full, bare = StragglerDetector(), StragglerDetector(features=False)
    whole = run(records, StragglerDetector())
    first = full.process(records[:cut])
    bare_first = bare.process(records[:cut])
    assert bare_first == predictions(first) and any(isinstance(r, FeatureVector) for r in first)
    assert {k: bare.state(k) for k in bare.keys()} == {k: full.state(k) for k in full.keys()}
    resumed = StragglerDetector()
    for key in bare.keys():
        resumed.restore(key, bare.state(key))
    rest = resumed.process(records[cut:]) + resumed.flush()
    assert [r.model_dump() for r in first + rest] == [r.model_dump() for r in whole]
    bare_rest = bare.process(records[cut:]) + bare.flush()
    assert [r.model_dump() for r in bare_first + bare_rest] == [r.model_dump() for r in predictions(whole)]
    assert rank_alerts(whole)
    assert {k: bare.state(k) for k in bare.keys()} == {k: resumed.state(k) for k in resumed.keys()}


def test_deterministic():
    records = make_steps(["h100-sxm"] * 8 + ["b200"] * 8, hours=2, seed=7, slow={9: (1200.0, 5000.0, 0.9)})
    a = [r.to_json() for r in run(records)]
    b = [r.to_json() for r in run(records)]
    assert a == b and any('"straggler"' in line for line in a)


def test_rank_features_per_window():
    models = ["h100-sxm"] * 8
    out = run(make_steps(models, hours=1, seed=8, slow={1: (0.0, 3600.0, 0.8)}))
    fvs = [f for f in out if isinstance(f, FeatureVector)]
    assert {f.scope for f in fvs} == {"rank"}
    assert {f.rank for f in fvs} == set(range(8))
    slow = [f for f in fvs if f.rank == 1 and f.values["speed_factor"] is not None]
    assert all(f.values["speed_factor"] == pytest.approx(0.8, abs=0.02) for f in slow)
    fast = [f for f in fvs if f.rank == 0]
    # The healthy ranks wait for the straggler; the straggler hardly waits.
    assert fast[0].values["wait_share"] > slow[0].values["wait_share"] + 0.1
    assert all(f.window_s == 300 and f.ts % 300 == 0 for f in fvs)


def test_unknown_model_gets_features_but_no_factor():
    records = make_steps(["h100-sxm"] * 6, hours=0.5, seed=9)
    for r in records:
        if r["rank"] == 0:
            r["model"] = "no-such-gpu"
    out = run(records)
    fvs = [f for f in out if isinstance(f, FeatureVector) and f.rank == 0]
    assert fvs and all(f.values["speed_factor"] is None for f in fvs)
    assert rank_alerts(out) == []


def test_custom_expected_speed_is_used():
    # If the caller says the A100 is as fast as an H100, its ~2.7x compute makes it a straggler.
    models = ["h100-sxm"] * 7 + ["a100-sxm-80gb"]
    det = StragglerDetector(expected_speed=lambda m: catalog_speed("h100-sxm"))
    out = run(make_steps(models, hours=0.5, seed=10), det)
    assert [p.rank for p in rank_alerts(out)] == [7]
    assert rank_alerts(out)[0].factor == pytest.approx(162.24 / 445.23, rel=0.1)


def _pred(ts: float, rank: int | None, alert: bool, job: str = "j", reason: str | None = None) -> Prediction:
    node = "n" if rank is not None else JOB_WIDE_NODE
    return Prediction(id=f"p{ts}{rank}{alert}", type="straggler", ts=ts, node=node, gpu=rank, job=job,
                      rank=rank, probability=1.0 if alert else 0.0, horizon_h=0,
                      alert=alert, factor=0.8, reason=reason)


def test_one_record_per_step_finds_5_percent_within_60_s_and_does_not_flap_on_3_percent():
    # A plugin sends a record per step: here every 2 s, for 2 hours. Rank 2 runs 3% slow the
    # whole time (a hot GPU's clocks: under the 5% bar), rank 5 drops to 0.94 at 1 h. With the
    # slack floor of one record a minute, rank 2 was raised and cleared 40 times.
    records = make_steps(["h100-sxm"] * 8, hours=2.0, seed=38, noise=0.015, interval_s=2.0,
                         slow={2: (0.0, 7200.0, 0.97), 5: (3600.0, 7200.0, 0.94)})
    alerts = rank_alerts(run(records))
    assert len([p for p in alerts if p.rank == 2]) <= 1
    (found,) = [p for p in alerts if p.rank == 5]
    assert found.ts - (T0 + 3600.0) <= 60.0
    # The slack floor follows the record rate: at one record a minute it is the configured one.
    det = StragglerDetector()
    run(make_steps(["h100-sxm"] * 8, hours=0.5, seed=38, interval_s=60.0), det)
    assert det.state("llm")["interval"] == pytest.approx(60.0)


def test_score_stragglers_counts_detections_delays_and_false_flags():
    labels = [
        {"kind": "straggler", "job": "j", "rank": 1, "node": "n", "gpu": 1, "start_ts": 1000, "end_ts": 5000,
         "factor": 0.8, "cause": "compute"},
        {"kind": "straggler", "job": "j", "rank": 2, "node": "n", "gpu": 2, "start_ts": 1000, "end_ts": 5000,
         "factor": 1.1, "cause": "thermal"},  # time multiplier 1.1 = speed 0.909: counts
        {"kind": "straggler", "job": "j", "rank": 3, "node": "n", "gpu": 3, "start_ts": 1000, "end_ts": 5000,
         "factor": 0.98, "cause": "thermal"},  # 2%: below the 5% bar, not counted
        {"kind": "job_slowdown", "job": "j", "start_ts": 8000, "end_ts": 9000, "factor": 1.3,
         "cause": "network"},
    ]
    preds = [
        _pred(1180, 1, True), _pred(5100, 1, False),  # found 180 s late
        _pred(1400, 3, True),  # the 2% one, found: not false
        _pred(8100, 4, True),  # a rank flag during the job-wide slowdown: false
        _pred(20000, 5, True),  # false
        _pred(8120, None, True, reason="job-wide: network"),
    ]
    labels.append({"kind": "straggler", "job": "j", "rank": 6, "node": "n", "gpu": 6, "start_ts": 1000,
                   "end_ts": 1200, "factor": 0.7, "cause": "thermal"})  # 3 step records: too short to score
    steps = [{"job": "j", "rank": r, "ts": 1000 + 60 * i} for i in range(100) for r in (1, 2, 6)]
    s = score_stragglers(preds, labels, job_hours=500.0, steps=steps)
    assert s["too_short"] == 1
    assert s["injected"] == 2 and s["detected"] == 1 and s["detection_rate"] == 0.5
    assert s["delay_s"]["max"] == 180.0 and s["delay_steps"]["max"] == 3.0  # records at 1060,1120,1180
    assert s["detected_on_time"] == 1
    assert s["false_flags"] == 2 and s["false_flags_during_job_slowdowns"] == 1
    assert s["false_flags_per_1000_job_hours"] == 4.0
    assert s["job_slowdowns_found"] == 1 and s["job_slowdown_cause_right"] == 1
    assert [m["rank"] for m in s["missed"]] == [2]


def test_score_stragglers_times_a_ramp_from_when_its_slowdown_reaches_the_bar():
    # 0.8 reached linearly over 1200 s: 5% slower (of 20%) at start + 300 s.
    labels = [{"kind": "straggler", "job": "j", "rank": 1, "node": "n", "gpu": 1, "start_ts": 1000,
               "end_ts": 5000, "factor": 0.8, "ramp_s": 1200.0},
              {"kind": "straggler", "job": "j", "rank": 2, "node": "n", "gpu": 2, "start_ts": 1000,
               "end_ts": 5000, "factor": 0.8, "ramp_s": 1200.0}]
    steps = [{"job": "j", "rank": r, "ts": 1000 + 30 * i} for i in range(100) for r in (1, 2)]
    preds = [_pred(1450, 1, True),  # 5 records after 1300: on time from the 5% point
             _pred(1480, 2, True)]  # 6 records and 180 s after it: late either way
    s = score_stragglers(preds, labels, job_hours=10.0, steps=steps)
    assert s["detected"] == 2 and s["detected_on_time"] == 0
    assert s["detected_on_time_reached"] == 1 and s["detection_rate_on_time_reached"] == 0.5
    assert s["delay_reached_s"]["median"] == pytest.approx(165.0)
    # Without ramp_s the same alerts are timed from the start only.
    for lab in labels:
        del lab["ramp_s"]
    s = score_stragglers(preds, labels, job_hours=10.0, steps=steps)
    assert s["detected_on_time_reached"] == s["detected_on_time"] == 0


def test_state_is_plain_json_with_pending_rows():
    records = make_steps(["h100-sxm"] * 4, hours=0.2, seed=11)
    det = StragglerDetector()
    det.process(records[:6])  # one full step group of 4 ranks, then 2 records of the next
    state = det.state("llm")
    assert json.loads(json.dumps(state)) == state
    rows = state["pending"]["records"]
    assert sorted(rows) == ["0", "1"] and rows["1"]["work"] == float(records[5]["samples"])
    assert set(rows["1"]) == {"ts", "rank", "node", "gpu", "step_time_s", "compute_s", "work", "model"}
    again = StragglerDetector()
    again.restore("llm", state)
    assert again.state("llm") == state
    assert [r.model_dump() for r in again.process(records[6:]) + again.flush()] == [
        r.model_dump() for r in det.process(records[6:]) + det.flush()]


def test_median_wait_share_is_the_median_of_clamped_shares():
    # Computed from sorted compute/step ratios; must equal the direct definition bit for bit.
    from fleetwise.predictors.stragglers import _median, _median_wait_share

    rng = np.random.default_rng(12)
    for n in [1, 2, 3, 4, 5, 6, 9]:
        for _ in range(200):
            step = [float(x) for x in rng.uniform(0.5, 3.0, n)]
            # computes around and beyond the step time (clamped shares), with ties
            compute = [float(s * rng.choice([0.6, 0.9, 1.0, 1.2, rng.uniform(0.3, 1.4)])) for s in step]
            direct = _median([max(0.0, 1.0 - c / s) for c, s in zip(compute, step, strict=True)])
            assert _median_wait_share(compute, step) == direct
            assert str(_median_wait_share(compute, step)) == str(direct)  # same sign of zero too
    with pytest.raises(ValueError):
        _median_wait_share([1.0], [1.0, 2.0])


def test_rank_order_of_a_restored_state_does_not_change_outputs():
    # JSON need not keep the ranks in rank order; the detector's results must not depend on it.
    models = ["h100-sxm"] * 5 + ["a100-sxm-80gb"] * 4 + ["b200"] * 2
    records = make_steps(models, hours=2, seed=13, slow={3: (1800.0, 5400.0, 0.85)})
    cut = len(records) // 5 + 5  # before the slowdown (at 1,800 s of 7,200), mid step group
    first = StragglerDetector()
    first.process(records[:cut])
    state = first.state("llm")
    state["ranks"] = dict(reversed(list(state["ranks"].items())))
    shuffled = StragglerDetector()
    shuffled.restore("llm", state)
    rest = [r.model_dump() for r in shuffled.process(records[cut:]) + shuffled.flush()]
    assert rest == [r.model_dump() for r in first.process(records[cut:]) + first.flush()]
    assert any(r.get("alert") and r.get("rank") == 3 for r in rest)


def test_a_silent_rank_leaves_the_group_after_stale_s():
    det = StragglerDetector()
    records = make_steps(["h100-sxm"] * 6, hours=1.0, seed=14)
    silent_from = T0 + 600.0
    det.process([r for r in records if r["rank"] != 2 or r["ts"] < silent_from])
    # A record of every other rank came after the silent one's last + stale_s: it is out.
    assert det.state("llm")["expected"] == [0, 1, 3, 4, 5]
    early = StragglerDetector()
    early.process([r for r in records if r["ts"] < silent_from + det.config.stale_s - 120.0])
    assert 2 in early.state("llm")["expected"]


def _restarted(records: list[dict], rank: int, gone: float, back: float,
               warm_up: tuple[float, ...]) -> list[dict]:
    """`rank`'s process restarts: silent in [gone, back) while the job goes on, its first steps
    back slower by `warm_up` (each group's step time follows its slowest rank)."""
    kept = [dict(r) for r in records if r["rank"] != rank or not gone <= r["ts"] < back]
    steps = sorted({r["step"] for r in kept if r["rank"] == rank and r["ts"] >= back})[:len(warm_up)]
    for step, slow in zip(steps, warm_up, strict=True):
        group = [r for r in kept if r["step"] == step]
        mine = next(r for r in group if r["rank"] == rank)
        mine["compute_s"] *= slow
        for r in group:
            r["step_time_s"] = max(r["step_time_s"], mine["compute_s"] + 0.4)
    return kept


def test_a_rank_back_from_a_restart_warms_up_before_it_is_judged():
    # One record per step every 10 s; rank 3 restarts for five minutes and its first five steps
    # back are 15-40% slow (CUDA and NCCL set-up, a cold data loader): not a straggler.
    records = make_steps(["h100-sxm"] * 8, hours=1.0, seed=21, interval_s=10.0)
    gone, back = T0 + 1200.0, T0 + 1500.0
    warm = _restarted(records, 3, gone, back, (1.4, 1.3, 1.3, 1.3, 1.15))
    assert rank_alerts(run(warm)) == []
    # A checkpoint that pauses every rank alike is no restart: a rank slow right after it is found.
    paused = [dict(r, ts=r["ts"] + (300.0 if r["ts"] >= back else 0.0)) for r in records]
    slow_after = _restarted(paused, 3, back, back, (1.3,) * 40)  # nothing removed: 40 slow steps
    found = rank_alerts(run(slow_after))
    assert [p.rank for p in found] == [3] and found[0].ts - (back + 300.0) <= 60.0
    # A rank that comes back slow for good is found once its warm-up is over.
    stays_slow = _restarted(records, 3, gone, back, (1.3,) * 40)
    found = rank_alerts(run(stays_slow))
    cfg = StragglerConfig()
    assert [p.rank for p in found] == [3]
    assert found[0].ts - back <= (cfg.rejoin_records + cfg.find_within_records + 1) * 10.0
    # Saved and restored mid-warm-up, the detector gives what it gives in one go.
    cut = next(i for i, r in enumerate(warm) if r["ts"] >= back and r["rank"] == 3) + 6  # its group closed
    first = StragglerDetector()
    part = first.process(warm[:cut])
    second = StragglerDetector()
    second.restore("llm", json.loads(json.dumps(first.state("llm"))))
    rest = second.process(warm[cut:]) + second.flush()
    assert [r.model_dump() for r in part + rest] == [r.model_dump() for r in run(warm)]


def test_a_job_silent_for_retire_s_is_retired_and_starts_over():
    retire_s = StragglerConfig().retire_s
    first = make_steps(["h100-sxm"] * 6, hours=1.0, seed=15, job="a", slow={2: (600.0, 3600.0, 0.85)})
    later = T0 + 3600.0 + 1.5 * retire_s  # silent for longer than retire_s (and the sweep's period)
    again = [dict(r, ts=r["ts"] + later - T0, step=r["step"] + 10_000)
             for r in make_steps(["h100-sxm"] * 6, hours=1.0, seed=16, job="a")]
    expected = [r.model_dump() for r in run(first) + run(again)]  # "a" twice, by two detectors
    assert any(p["alert"] for p in expected if p.get("type") == "straggler")  # one left open

    # By its own record: the second run's first record finds the job silent.
    alone = StragglerDetector()
    out = alone.process(first)
    assert alone.keys() == ["a"]
    out += alone.process(again) + alone.flush()
    assert [r.model_dump() for r in out] == expected

    # By the sweep: another job's records move event time on; "a" is dropped before it returns.
    other = make_steps(["b200"] * 4, hours=(later - T0) / 3600 + 1.0, seed=17, job="b", interval_s=120.0)
    merged = sorted(first + other + again, key=lambda r: r["ts"])
    det, out, dropped_at = StragglerDetector(), [], None
    for i in range(0, len(merged), 50):
        out += det.process(merged[i:i + 50])
        if dropped_at is None and det.keys() == ["b"]:
            dropped_at = merged[i + 49]["ts"]
    out += det.flush()
    assert dropped_at is not None and first[-1]["ts"] + retire_s < dropped_at < later
    assert [r.model_dump() for r in out if r.job == "a"] == expected


@pytest.mark.parametrize("features", [True, False])
def test_step_groups_judged_together_give_what_judging_each_as_it_closes_gives(features, monkeypatch):
    # One call with many complete step groups judges a job's groups together (numpy over its
    # ranks); one record per call judges each group as it closes. Same outputs in the same
    # order and the same state, to the bit: alerts raised and cleared, a job-wide slowdown,
    # a rank that moves to another GPU (its groups go one by one), two interleaved jobs.
    a = make_steps(["h100-sxm"] * 6 + ["a100-sxm-80gb"] * 5, hours=3, seed=21, job="a",
                   slow={2: (3000.0, 7000.0, 0.85), 8: (1000.0, 1600.0, 0.9)}, network=(5000.0, 6500.0, 1.5))
    for r in a:
        if r["rank"] == 4 and r["ts"] > T0 + 4000.0:
            r["node"] = "node-009"
    b = make_steps(["b200"] * 4 + ["h100-sxm"] * 3, hours=3, seed=22, job="b", interval_s=45.0,
                   input_stall=(2000.0, 3000.0, 1.4), slow={5: (6000.0, 9000.0, 0.8)})
    records = sorted(a + b, key=lambda r: r["ts"])
    judged_together = []
    together_path = StragglerDetector._close_groups_together

    def counted(self, *args):
        judged_together.append(together_path(self, *args))
        return judged_together[-1]

    monkeypatch.setattr(StragglerDetector, "_close_groups_together", counted)
    together, alone = StragglerDetector(features=features), StragglerDetector(features=features)
    out, expected = [], []
    rng = np.random.default_rng(23)
    start = 0
    while start < len(records):  # calls of 40-400 records: runs of groups of every length
        end = start + int(rng.integers(40, 400))
        out += together.process(records[start:end])
        together_count = sum(judged_together)
        for r in records[start:end]:
            expected += alone.process([r])
        assert sum(judged_together) == together_count  # one record a call: each group alone
        assert [x.model_dump() for x in out] == [x.model_dump() for x in expected]
        assert {k: together.state(k) for k in together.keys()} == {k: alone.state(k) for k in alone.keys()}
        start = end
    assert sum(judged_together) > 0.8 * len(records) / 9  # most groups went together
    out += together.flush()
    expected += alone.flush()
    assert [x.model_dump() for x in out] == [x.model_dump() for x in expected]
    raised = {(p.job, p.rank) for p in rank_alerts(out)}
    assert {("a", 2), ("b", 5)} <= raised and any(p.rank is None and p.alert for p in predictions(out))
    assert any(p.reason == "recovered" for p in predictions(out))


@pytest.mark.parametrize("per_call", [1, 200])
def test_an_alerting_rank_keeps_the_run_it_was_raised_on(per_call):
    # While a rank alerts its CUSUM and its run of records beyond the slack stand still: the
    # saved run is the one the raise reported, whether the records come one by one or judged
    # together.
    records = make_steps(["h100-sxm"] * 8, hours=2, seed=24, slow={3: (1200.0, 7200.0, 0.85)})
    det = StragglerDetector()
    runs = []
    for start in range(0, len(records), per_call):
        raised = [p for p in rank_alerts(det.process(records[start:start + per_call])) if p.rank == 3]
        rank = det.state("llm")["ranks"].get("3")  # (JSON: rank keys as strings)
        if rank is None:
            continue
        if raised:
            assert rank["alert"]
            assert raised[0].factor == pytest.approx(statistics.median(rank["run"][-5:]), abs=1e-4)
        if rank["alert"]:
            runs.append(rank["run"])
    assert len(runs) > 3 and all(run == runs[0] for run in runs)


# ---- step records without `model` (DESIGN.md's step record) ----
def without_model(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "model"} for r in records]


def ramped(records: list[dict], rank: int, start_s: float, ramp_s: float, speed: float) -> list[dict]:
    """``rank`` slows linearly from full speed at ``start_s`` to ``speed`` at ``start_s + ramp_s``
    and stays there (a thermal ramp); the others as made."""
    out = []
    for r in records:
        r = dict(r)
        t = r["ts"] - T0
        if r["rank"] == rank and t >= start_s:
            reached = 1.0 - (1.0 - speed) * min(1.0, (t - start_s) / ramp_s)
            r["compute_s"] = round(r["compute_s"] / reached, 6)
            r["step_time_s"] = max(r["step_time_s"], r["compute_s"])
        out.append(r)
    return out


@pytest.fixture(scope="module")
def simulated_day():
    from fleetwise.sim import FleetSimulator, SimConfig

    sim = FleetSimulator(SimConfig(gpus="h100-sxm:32,a100-sxm-80gb:32,b200:16", days=1.0, seed=41,
                                   straggler_rate_per_1000_gpu_days=400.0,
                                   job_slowdown_rate_per_1000_job_hours=60.0))
    return sim, [s for tick in sim.ticks() for s in tick.steps]


def test_simulated_stragglers_are_found_without_model_in_the_step_records(simulated_day):
    sim, steps = simulated_day
    hours = sum(max(s["ts"] for s in steps if s["job"] == j) - min(s["ts"] for s in steps if s["job"] == j)
                for j in {s["job"] for s in steps}) / 3600.0
    det = StragglerDetector()
    out = det.process(without_model(steps)) + det.flush()
    assert all(rs["model"] is None for job in det.keys() for rs in det.state(job)["ranks"].values())
    score = score_stragglers(predictions(out), sim.labels(), hours, steps=steps)
    assert score["injected"] >= 10
    assert score["detected_on_time"] >= 0.9 * score["injected"]
    assert score["false_flags"] <= hours / 16.0  # <= 1 false episode per 16 job-hours
    assert any(p.reason == "slower than its own history and its alike ranks (GPU model unknown)"
               for p in rank_alerts(out))


def test_the_rejoin_warm_up_changes_nothing_where_no_rank_restarts(simulated_day):
    # The simulator's jobs keep every rank from start to end (checkpoint pauses included): the
    # warm-up must not engage, so the outputs equal a detector's without it, record for record.
    _, steps = simulated_day
    outputs = []
    for cfg in (StragglerConfig(), StragglerConfig(rejoin_records=0)):
        det = StragglerDetector(config=cfg)
        outputs.append([json.loads(o.to_json_bytes()) for o in det.process(steps) + det.flush()])
    assert len(outputs[0]) > 1000
    assert sum(1 for o in outputs[0] if o.get("alert") and o.get("rank") is not None) >= 20  # found
    assert outputs[0] == outputs[1]


def test_a_job_whose_ranks_are_all_unknown_still_finds_its_straggler():
    records = without_model(make_steps(["h100-sxm"] * 8, hours=4, seed=31, slow={6: (5400.0, 9000.0, 0.85)}))
    out = run(records)
    alerts = rank_alerts(out)
    assert [p.rank for p in alerts] == [6]
    assert alerts[0].factor == pytest.approx(0.85, abs=0.03)
    assert T0 + 5400.0 <= alerts[0].ts <= T0 + 5400.0 + 5 * 60
    assert alerts[0].signals[1].value is None and alerts[0].signals[2].value is None  # model, TFLOP/s
    clears = [p for p in predictions(out) if p.rank == 6 and not p.alert]
    assert len(clears) == 1 and clears[0].ts > T0 + 9000.0


@pytest.mark.parametrize("proportional", [True, False])
@pytest.mark.parametrize("older", [2, 8])
def test_mixed_generation_without_model_flags_the_straggler_not_the_older_generation(proportional, older):
    # A100s compute each sample ~2.7x slower than H100s: an older generation, not stragglers,
    # whether they are too few to be a group of their own (2) or many (8).
    models = ["h100-sxm"] * 8 + ["a100-sxm-80gb"] * older
    out = run(without_model(make_steps(models, hours=6, seed=32, proportional=proportional,
                                       slow={3: (7200.0, 14400.0, 0.85)})))
    assert [p.rank for p in rank_alerts(out)] == [3]
    fvs = [f for f in out if isinstance(f, FeatureVector) and f.rank >= 8 and f.values["speed_factor"]]
    assert fvs and all(abs(f.values["speed_factor"] - 1.0) < 0.03 for f in fvs)


def test_a_few_ranks_of_a_slightly_slower_generation_are_not_flagged_without_model():
    # An L40S computes ~11% slower than an A100 (catalog): two of them are too few for an alike
    # group of their own, and their own history says they have always been so; a real
    # straggler among the A100s is still found.
    models = ["a100-sxm-80gb"] * 6 + ["l40s"] * 2
    out = run(without_model(make_steps(models, hours=5, seed=33, proportional=False,
                                       slow={1: (7200.0, 12000.0, 0.85)})))
    assert [p.rank for p in rank_alerts(out)] == [1]


def test_close_generations_form_separate_alike_groups_without_model():
    # H100 PCIe computes 31% slower than H200 (catalog). Grouped together, the group's median
    # lies between the two models and an H200 slowed to 0.85 still looks normal against it;
    # grouped apart, it is found against its own group and its own history.
    models = ["h200"] * 6 + ["h100-pcie"] * 6
    out = run(without_model(make_steps(models, hours=5, seed=37, proportional=True,
                                       slow={2: (7200.0, 12000.0, 0.85)})))
    alerts = rank_alerts(out)
    assert [p.rank for p in alerts] == [2]
    assert any(s.name == "reference" and "6 alike ranks" in str(s.value) for s in alerts[0].signals)


@pytest.mark.parametrize(("kind", "cause"), [("network", "network"), ("input_stall", "input")])
def test_job_wide_slowdown_without_model_flags_no_rank(kind, cause):
    models = ["h100-sxm"] * 8 + ["a100-sxm-80gb"] * 8
    window = (3600.0, 7200.0, 1.6 if kind == "network" else 1.15)
    out = run(without_model(make_steps(models, hours=3, seed=34, **{kind: window})))
    assert rank_alerts(out) == []
    jobwide = [p for p in predictions(out) if p.rank is None]
    assert [p.alert for p in jobwide] == [True, False] and jobwide[0].reason == f"job-wide: {cause}"
    assert T0 + window[0] <= jobwide[0].ts <= T0 + window[0] + 5 * 60


def test_a_thermal_ramp_is_found_without_model():
    # The rank slows over 30 minutes: its own baseline follows only healthy records, so the
    # ramp is not absorbed into it.
    records = ramped(make_steps(["h100-sxm"] * 8, hours=5, seed=35), 2, 7200.0, 1800.0, 0.8)
    alerts = rank_alerts(run(without_model(records)))
    assert [p.rank for p in alerts] == [2]
    assert alerts[0].ts <= T0 + 7200.0 + 1800.0


def test_a_thermal_ramp_at_one_record_per_step_is_found_without_model():
    # Records every 2 s: the slack is raised (few percent slow ranks must not accumulate), but
    # the rank's own baseline follows only records within the job's noise, so the ramp's first
    # minutes (under the raised slack) do not leak into it. To 0.9 over 20 minutes: 5% is
    # reached at 7200 + 600 s.
    records = ramped(make_steps(["h100-sxm"] * 8, hours=3, seed=39, noise=0.015, interval_s=2.0),
                     2, 7200.0, 1200.0, 0.9)
    alerts = rank_alerts(run(without_model(records)))
    assert [p.rank for p in alerts] == [2]
    assert alerts[0].ts <= T0 + 7200.0 + 600.0 + 60.0


def test_models_learned_by_gpu_judge_as_models_in_the_records():
    # The join: (node, gpu) -> model from telemetry / inventory. Records without `model` then
    # give exactly what records with it give (NVML names resolve to the same catalog ids).
    records = make_steps(["h100-sxm"] * 10 + ["a100-sxm-80gb"] * 6, hours=3, seed=36,
                         slow={4: (3000.0, 8000.0, 0.85), 12: (5000.0, 9000.0, 0.9)},
                         network=(6000.0, 7000.0, 1.5))
    det = StragglerDetector()
    names = {"h100-sxm": "NVIDIA H100 80GB HBM3", "a100-sxm-80gb": "NVIDIA A100-SXM4-80GB"}
    gpus = {(r["node"], r["gpu"]): names[r["model"]] for r in records}
    assert det.learn_models((node, gpu, model) for (node, gpu), model in gpus.items()) == len(gpus)
    assert det.model_of("node-001", 4) == "a100-sxm-80gb" and det.model_of("node-009", 0) is None
    joined = run(without_model(records), det)
    assert [r.model_dump() for r in joined] == [r.model_dump() for r in run(records)]
    assert {p.rank for p in rank_alerts(joined)} == {4, 12}


def test_a_model_learned_mid_job_takes_over_from_the_own_history():
    records = without_model(make_steps(["h100-sxm"] * 8, hours=3, seed=37, slow={5: (7200.0, 10800.0, 0.8)}))
    det = StragglerDetector()
    cut = len(records) // 3
    first = det.process(records[:cut])
    det.learn_models((f"node-{r // 8:03d}", r % 8, "h100-sxm") for r in range(8))
    rest = det.process(records[cut:]) + det.flush()
    assert [p.rank for p in rank_alerts(first + rest)] == [5]
    assert rank_alerts(rest)[0].reason == "slower than its GPU model should be"
    assert det.state("llm")["ranks"]["5"]["model"] == "h100-sxm"


def test_state_restore_without_model_gives_identical_outputs():
    records = without_model(make_steps(["h100-sxm"] * 6 + ["b200"] * 4, hours=3, seed=38,
                                       slow={2: (4000.0, 9000.0, 0.85)}, input_stall=(6000.0, 7000.0, 1.3)))
    whole = [r.model_dump() for r in run(records)]
    cut = len(records) // 2 + 3
    first = StragglerDetector()
    part = first.process(records[:cut])
    saved = {k: json.dumps(first.state(k)) for k in first.keys()}
    assert json.loads(saved["llm"])["ranks"]["2"]["base"] > 0
    second = StragglerDetector()
    for key, blob in saved.items():
        second.restore(key, json.loads(blob))
    rest = second.process(records[cut:]) + second.flush()
    assert [r.model_dump() for r in part + rest] == whole
    assert [p.rank for p in rank_alerts(part + rest)] == [2]


def test_control_plane_learns_models_from_gpu_samples_and_inventory():
    from fleetwise.schemas import topics as T
    from fleetwise.sim import FleetSimulator, SimConfig
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    sim = FleetSimulator(SimConfig(gpus="h100-sxm:8,a100-sxm-80gb:8", days=0.05, seed=39))
    tick = next(iter(sim.ticks()))
    control = ControlPlane(ControlPlaneConfig(failure_predictor=False, publish_features=False))
    step = {"ts": tick.ts, "job": "j", "rank": 0, "node": "node-000", "gpu": 0, "step": 1,
            "step_time_s": 2.0, "compute_s": 1.5, "samples": 8}
    control.handle(T.TELEMETRY_GPU.name, [control.decode_obj(T.TELEMETRY_GPU.name, s, source="t")[0]
                                          for s in tick.samples])
    control.handle(T.TELEMETRY_STEPS.name, control.decode_obj(T.TELEMETRY_STEPS.name, step, source="t"))
    det = control.stragglers
    assert det is not None
    for s in tick.samples:
        assert det.model_of(s["node"], s["gpu"]) == lookup(s["model"]).id
    control.flush()  # (closes the job's one step group)
    first_gpu = next(s["model"] for s in tick.samples if (s["node"], s["gpu"]) == ("node-000", 0))
    assert det.state("j")["ranks"]["0"]["model"] == lookup(first_gpu).id
    # An inventory (the node's GPUs by index) teaches GPUs no sample has shown yet.
    inv = dict(sim.inventory()[0], node="node-new")
    control.handle(T.INVENTORY.name, control.decode_obj(T.INVENTORY.name, inv, source="t"))
    assert det.model_of("node-new", 3) == lookup(inv["gpus"][3]["model"]).id


def pipeline_steps(layers: list[int], start: int, n: int, *, slow: dict[int, float] | None = None,
                   seed: int = 0) -> list[dict]:
    """Step records of a 4-stage pipeline of H100s, one micro-batch of 32 samples per step:
    a stage's compute is its layers x 0.05 s (over its speed), every stage's step time the
    slowest stage's plus 0.2 s."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(start, start + n):
        computes = [n_l * 0.05 / (slow or {}).get(r, 1.0) * float(np.exp(rng.normal(0, 0.01)))
                    for r, n_l in enumerate(layers)]
        for r, c in enumerate(computes):
            out.append({"ts": T0 + 60.0 * i + 0.001 * r, "job": "pp", "rank": r, "node": f"node-{r}",
                        "gpu": 0, "step": i, "step_time_s": round(max(computes) + 0.2, 6),
                        "compute_s": round(c, 6), "samples": 32, "model": "h100-sxm"})
    return out


def test_a_pipeline_stage_with_more_layers_is_not_slow_once_the_detector_knows_its_layers():
    uneven = [7, 5, 6, 6]
    # Not taught: the stage with 7 layers looks 15% slow next to the median, and is flagged.
    assert {p.rank for p in rank_alerts(run(pipeline_steps(uneven, 0, 240)))} == {0}
    # Taught (the plan's layers, then a re-split's, as ControlPlane teaches them): nothing.
    det = StragglerDetector()
    det.learn_layers("pp", dict(enumerate(uneven)))
    out = det.process(pipeline_steps(uneven, 0, 120))
    det.learn_layers("pp", {0: 6, 1: 6, 2: 6, 3: 6})  # the boundaries moved at step 120
    out += det.process(pipeline_steps([6, 6, 6, 6], 120, 120)) + det.flush()
    assert rank_alerts(out) == []
    # A stage that really slows down is still found, with its factor.
    det = StragglerDetector()
    det.learn_layers("pp", dict(enumerate(uneven)))
    out = det.process(pipeline_steps(uneven, 0, 60)) + det.process(
        pipeline_steps(uneven, 60, 120, slow={1: 0.7})) + det.flush()
    alerts = rank_alerts(out)
    assert [p.rank for p in alerts] == [1] and alerts[0].factor == pytest.approx(0.7, abs=0.03)
    # The same with only DESIGN.md's fields (no `model`): each rank judged on its own history
    # and alike ranks, its cost per sample and layer, across the re-split and for the slow stage.
    def bare(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "model"} for r in records]

    det = StragglerDetector()
    det.learn_layers("pp", dict(enumerate(uneven)))
    out = det.process(bare(pipeline_steps(uneven, 0, 120)))
    det.learn_layers("pp", {0: 6, 1: 6, 2: 6, 3: 6})
    out += det.process(bare(pipeline_steps([6, 6, 6, 6], 120, 120))) + det.flush()
    assert rank_alerts(out) == []
    det = StragglerDetector()
    det.learn_layers("pp", dict(enumerate(uneven)))
    out = det.process(bare(pipeline_steps(uneven, 0, 60))) + det.process(
        bare(pipeline_steps(uneven, 60, 120, slow={1: 0.7}))) + det.flush()
    alerts = rank_alerts(out)
    assert [p.rank for p in alerts] == [1] and alerts[0].factor == pytest.approx(0.7, abs=0.03)
