"""GpuFeatureWindows: hop semantics, counters with resets, XID changes, duplicates, late data."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import numpy as np
import pytest

from fleetwise.predictors.features import (
    F_POWER,
    F_REASONS,
    F_SMCLK,
    F_TEMP,
    F_UTIL,
    F_XID,
    FEATURE_NAMES,
    HEAT_PEER_RESIDUAL_C,
    SAMPLE_DECODER,
    WARM_RESIDUAL_C,
    GpuFeatureWindows,
)
from fleetwise.schemas import GpuSample, NodeBatch

T0 = 1764547200.0  # a multiple of 600 s: hop boundaries fall on T0 + k * 600
SBE = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
TDP = {"h100": ("h100-sxm", 700.0), "a100": ("a100-sxm-80gb", 400.0)}


def windows(hop_s: float = 600.0) -> GpuFeatureWindows:
    return GpuFeatureWindows(hop_s=hop_s, tdp_lookup=lambda m: TDP[m])


def sample(i: int, gpu: int = 0, model: str = "h100", dt: float = 60.0, **metrics: float) -> dict:
    base = {F_TEMP: 60.0, F_POWER: 350.0, F_UTIL: 90.0, F_SMCLK: 1980.0}
    base.update({k.replace("__", "_"): v for k, v in metrics.items()})
    return {"ts": T0 + dt * i, "node": "n1", "gpu": gpu, "model": model, "metrics": base}


def hop_values(out: list) -> list[dict]:
    return [o.values for o in out]


def test_hop_closes_on_next_hop_sample_and_flush() -> None:
    fw = windows()
    out = fw.process_dicts([sample(i) for i in range(10)])
    assert out == []  # hop 0 still open: no sample of a later hop yet
    out = fw.process_dicts([sample(10)])
    assert len(out) == 1 and out[0].ts == T0 + 600 and out[0].values["samples"] == 10
    assert out[0].values["power_frac_tdp"] == pytest.approx(0.5)
    assert fw.flush()[0].values["samples"] == 1


def test_counter_deltas_never_negative_and_reset_counted() -> None:
    fw = windows()
    # SBE climbs 0..4, resets to 1 (reboot), climbs to 3: true increments 4 + 2 = 6
    sbe = [0, 1, 2, 3, 4, 1, 2, 3]
    out = fw.process_dicts([sample(i, **{SBE: v}) for i, v in enumerate(sbe)]) + fw.flush()
    v = out[0].values
    assert v["sbe_vol_hop"] == 6
    assert v["resets_1h"] == 1


def test_missing_counter_values_carry_the_base() -> None:
    fw = windows()
    rows = [sample(0, **{SBE: 5}), sample(1), sample(2, **{SBE: 7})]  # sample 1 lacks the key
    out = fw.process_dicts(rows) + fw.flush()
    assert out[0].values["sbe_vol_hop"] == 2


@pytest.mark.parametrize("xid, silence_min, restarts", [
    (119, 120, True),  # a GSP hang, two hours out of service: its history is spent
    (79, 80, True),  # off the bus, back after 80 minutes
    (119, 40, False),  # a gap shorter than an hour: a reset in place or a scrape gap
    (13, 120, False),  # an application XID is no failure, however long the GPU was away
])
def test_a_gpu_back_from_a_failure_starts_without_its_history(xid: int, silence_min: int,
                                                              restarts: bool) -> None:
    # six hours with a single-bit error every hop, then the XID, one more minute, the silence
    before = [sample(i, **{SBE: i // 10, F_XID: 0}) for i in range(360)]
    failed = [sample(i, **{SBE: 35, F_XID: xid}) for i in (360, 361)]
    back = [sample(i, **{SBE: 0, F_XID: 0}) for i in range(362 + silence_min, 382 + silence_min)]
    fw = windows()
    out = fw.process_dicts(before + failed + back) + fw.flush()
    last = out[-1].values
    cls = {119: "gsp", 79: "bus", 13: "app"}[xid]
    if restarts:
        assert last[f"xid_{cls}_7d"] == 0 and last["sbe_vol_24h"] == 0 and last["sbe_active_6h"] == 0
    else:
        assert last[f"xid_{cls}_7d"] > 0.9 and last["sbe_vol_24h"] > 25


def test_xid_counts_changes_by_class_not_repeats() -> None:
    fw = windows()
    xids = [0, 13, 13, 13, 79, 79, 0, 48]  # app, then off-bus, then DBE: three events
    out = fw.process_dicts([sample(i, **{F_XID: x}) for i, x in enumerate(xids)]) + fw.flush()
    v = out[0].values
    assert (v["xid_app_hop"], v["xid_bus_hop"], v["xid_mem_fatal_hop"]) == (1, 1, 1)


def test_duplicates_and_late_samples_dropped_and_counted() -> None:
    fw = windows()
    rows = [sample(i) for i in range(12)]
    fw.process_dicts(rows)  # closes hop 0; hop 1 open
    fw.process_dicts([sample(11)])  # exact duplicate of the last sample
    fw.process_dicts([sample(3)])  # belongs to the closed hop 0: late
    fw.process_dicts([sample(10)])  # redelivered, inside the open hop
    assert fw.dropped_duplicate == 2
    assert fw.dropped_late == 1
    assert fw.flush()[0].values["samples"] == 2


def test_out_of_order_inside_hop_does_not_corrupt_counters() -> None:
    fw = windows()
    rows = [sample(0, **{SBE: 0}), sample(2, **{SBE: 5}), sample(1, **{SBE: 2})]
    fw.process_dicts(rows[:2])
    fw.process_dicts(rows[2:])  # older reading arrives after a newer one, same hop
    v = fw.flush()[0].values
    assert v["sbe_vol_hop"] == 5 and v["samples"] == 3


def test_throttle_duty_and_clock_drop() -> None:
    fw = windows()
    # a day at full clock, then a hop where half the samples are thermally throttled at 70 % clock
    rows = [sample(i) for i in range(24 * 60)]
    rows += [sample(24 * 60 + i, **{F_REASONS: 0x40 if i % 2 else 0, F_SMCLK: 1386.0 if i % 2 else 1980.0})
             for i in range(10)]
    out = fw.process_dicts(rows) + fw.flush()
    last = out[-1].values
    assert last["thr_hw_thermal"] == pytest.approx(0.5)
    assert last["clock_ratio"] == pytest.approx(0.85, abs=0.01)
    assert out[-2].values["clock_ratio"] == pytest.approx(1.0)


def test_thermal_residual_rises_for_degrading_interface_not_for_hot_inlet() -> None:
    """Temperature = inlet + R * power: a hot inlet shifts the intercept; a degrading
    thermal interface raises R, so the residual against the GPU's own fit grows."""
    rng = np.random.default_rng(7)
    fw = windows()
    rows = []
    n = 4 * 24 * 60
    for i in range(n):
        power = 700 * (0.3 + 0.6 * ((i // 90) % 2))  # jobs on/off every 90 min
        degrade = 1.0 + 0.5 * max(0.0, (i - 3 * 24 * 60) / (24 * 60))  # R rises 50% on day 4
        noise = rng.normal(0, 0.5)
        rows.append(sample(i, gpu=0, **{F_POWER: power, F_TEMP: 25 + 0.06 * power * degrade + noise}))
        rows.append(sample(i, gpu=1, **{F_POWER: power, F_TEMP: 35 + 0.06 * power + noise}))  # hot inlet
    out = fw.process_dicts(rows) + fw.flush()
    res = {g: [o.values["temp_residual_6h"] for o in out if o.gpu == g] for g in (0, 1)}
    assert res[0][-1] > 4.0  # degraded: several degrees above its own baseline
    assert abs(res[1][-1]) < 1.0  # hot but healthy: on its own baseline
    assert [o.values["inlet_est_c"] for o in out if o.gpu == 1][-1] == pytest.approx(35.0, abs=1.5)


def test_models_normalised_by_tdp() -> None:
    fw = windows()
    rows = [sample(i, gpu=0, model="h100", **{F_POWER: 560.0}) for i in range(11)]
    rows += [sample(i, gpu=1, model="a100", **{F_POWER: 320.0}) for i in range(11)]
    out = fw.process_dicts(sorted(rows, key=lambda r: r["ts"]))
    fracs = {o.gpu: o.values["power_frac_tdp"] for o in out}
    assert fracs[0] == pytest.approx(0.8) and fracs[1] == pytest.approx(0.8)
    assert {o.model for o in out} == {"h100-sxm", "a100-sxm-80gb"}


def test_records_and_dicts_give_the_same_features() -> None:
    rows = [sample(i, gpu=g, **{SBE: i // 3}) for i in range(30) for g in range(2)]
    a = windows().process_dicts(rows)
    batches = [
        NodeBatch(ts=rows[i]["ts"], node="n1", samples=[GpuSample(**rows[i]), GpuSample(**rows[i + 1])])
        for i in range(0, len(rows), 2)
    ]
    b = windows().process(batches)
    assert [x.values for x in a] == [x.values for x in b]


def test_batching_does_not_change_features() -> None:
    rng = np.random.default_rng(3)
    rows = [sample(i, gpu=g, **{F_TEMP: 50 + rng.normal(), SBE: float(i // 7)})
            for i in range(300) for g in range(3)]
    whole = windows().process_dicts(rows)
    fw = windows()
    pieces = []
    for k in range(0, len(rows), 37):
        pieces += fw.process_dicts(rows[k:k + 37])
    assert len(whole) == len(pieces)
    for x, y in zip(whole, pieces, strict=True):
        for name in FEATURE_NAMES:
            a, b = x.values[name], y.values[name]
            assert (a is None and b is None) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9), name


def test_late_and_out_of_order_samples_count_the_same_in_one_call_or_one_by_one() -> None:
    # Arrival order decides: a sample of a hop the GPU has already left is late even when
    # the sample that moved it on came in the same call; an older reading inside the open
    # hop does not drive the counters. So replay chunks and Kafka fetches agree.
    arrivals = []
    for g in range(2):
        arrivals += [sample(i, gpu=g, **{SBE: float(i)}) for i in range(12)]  # hop 0, then hop 1 opens
        arrivals.append(dict(sample(4, gpu=g, **{SBE: 99.0}), ts=T0 + 270.0))  # late: hop 0 has closed
        arrivals.append(sample(11, gpu=g, **{SBE: 11.0}))  # duplicate
        arrivals.append(sample(14, gpu=g, **{SBE: 14.0}))
        arrivals.append(sample(13, gpu=g, **{SBE: 50.0}))  # out of order inside hop 1
        arrivals.append(sample(15, gpu=g, **{SBE: 15.0}))
    results = []
    for size in (len(arrivals), 1, 3, 7):
        fw = windows()
        out = []
        for k in range(0, len(arrivals), size):
            out += fw.process_dicts(arrivals[k:k + size])
        out += fw.flush()
        hops = [(o.node, o.gpu, o.ts, o.values) for o in out]
        results.append((hops, fw.dropped_late, fw.dropped_duplicate))
    assert all(r == results[0] for r in results[1:])
    hops, late, duplicate = results[0]
    assert late == 2 and duplicate == 2
    hop1 = [v for node, gpu, ts, v in hops if ts == T0 + 1200]
    # hop 1: samples 10, 11, 14, 13, 15; the counter moves 9 -> 10, 11, 14, 15 (not 50)
    assert len(hop1) == 2 and all(v["samples"] == 5 and v["sbe_vol_hop"] == 6 for v in hop1)


def test_a_redelivered_sample_is_a_duplicate_however_the_samples_were_batched() -> None:
    # A resend of a reading 40 samples back inside the open hop (an agent's buffer replayed
    # after a broker fault): dropped as a duplicate whatever the calls' sizes. Found by the
    # worker fuzz test: a Kafka fetch of ~30 messages, then small ones, lost ring entries
    # that a replay kept, so the worker counted the resend and the replay did not.
    arrivals = [sample(i, dt=10.0, **{SBE: float(i)}) for i in range(45)]
    arrivals.append(sample(5, dt=10.0, **{SBE: 5.0}))  # the resend
    arrivals += [sample(i, dt=10.0, **{SBE: float(i)}) for i in range(45, 70)]
    n = len(arrivals)
    splits = {"one by one": [1] * n, "a fetch of 30, then one by one": [30] + [1] * (n - 30),
              "in sevens": [7] * (n // 7 + 1), "whole": [n]}
    results = {}
    for name, sizes in splits.items():
        fw = windows()
        out, k = [], 0
        for size in sizes:
            out += fw.process_dicts(arrivals[k:k + size])
            k += size
        results[name] = ([o.values["samples"] for o in out], fw.dropped_duplicate)
    assert all(r == ([60], 1) for r in results.values()), results


def test_state_round_trip_resumes_identically() -> None:
    rows = [sample(i, gpu=g, **{SBE: float(i // 5), F_XID: 13 if i == 50 else 0})
            for i in range(200) for g in range(2)]
    ref = windows()
    expected = ref.process_dicts(rows)
    fw = windows()
    got = fw.process_dicts(rows[:205])
    saved = {k: json.loads(json.dumps(fw.state(k), allow_nan=False)) for k in fw.keys()}  # noqa: SIM118
    restarted = windows()
    for k, st in saved.items():
        restarted.restore(k, st)
    got += restarted.process_dicts(rows[205:])
    assert [o.values for o in got] == [o.values for o in expected]


def test_a_forgotten_gpu_continues_like_one_never_seen() -> None:
    # A worker that restores a partition from older saved state starts over the GPUs that
    # state lacks, then gets their samples again.
    rows = [sample(i, gpu=g, **{SBE: float(i // 5), F_XID: 13 if i == 50 else 0})
            for i in range(200) for g in range(2)]
    later = [r for r in rows if r["ts"] >= T0 + 60.0 * 120]
    fresh = windows()
    fresh.process_dicts([r for r in rows if r["gpu"] == 1])  # GPU 1 only: GPU 0 never seen
    expected = fresh.process_dicts(later)
    fw = windows()
    fw.process_dicts(rows)  # GPU 0 is past every later sample
    fw.forget("n1/0")
    assert fw.state("n1/0")["open_hop"] == -1.0
    got = fw.process_dicts(later)
    assert [o.values for o in got] == [o.values for o in expected]
    assert fw.state("n1/0") == fresh.state("n1/0")


def test_dcgm_blank_sentinel_is_a_missing_reading() -> None:
    fw = windows()
    mem = "DCGM_FI_DEV_MEMORY_TEMP"
    rows = [sample(0, **{mem: 70.0}), sample(1, **{mem: 9223372036854775794}), sample(2, **{mem: 72.0})]
    v = (fw.process_dicts(rows) + fw.flush())[0].values
    assert v["mem_temp_mean"] == pytest.approx(71.0)  # the blank is skipped, not averaged in


def _sbe_series(pattern: list[int], hops: int) -> list[dict]:
    """One sample a minute for `hops` hops; pattern[h] new SBEs in hop h (spread over the hop)."""
    out, total = [], 0
    for i in range(hops * 10):
        h = i // 10
        if i % 10 == 0:
            total += pattern[h] if h < len(pattern) else 0
        out.append(sample(i, **{SBE: total}))
    return out


def test_persistent_errors_read_as_streak_and_activity_a_burst_does_not() -> None:
    hops = 36  # 6 h
    persistent = [1] * hops  # a new SBE every hop: a degrading part
    burst = [0] * 30 + [40] + [0] * 5  # 40 SBEs in one hop, then quiet (a benign burst)
    fp, fb = windows(), windows()
    vp = (fp.process_dicts(_sbe_series(persistent, hops)) + fp.flush())[-1].values
    vb = (fb.process_dicts(_sbe_series(burst, hops)) + fb.flush())[-1].values
    # every hop but the first (whose first reading is the base) had new errors
    assert vp["sbe_streak_h"] == pytest.approx(35 * 600 / 3600)
    assert vb["sbe_streak_h"] == 0.0
    assert vp["sbe_active_1h"] > 0.9 and vb["sbe_active_1h"] < 0.1
    # the burst has more errors in total, yet less persistence
    assert vb["sbe_vol_6h"] > vp["sbe_vol_6h"]
    assert vp["sbe_active_6h"] > 3 * vb["sbe_active_6h"]


def test_acceleration_is_relative_to_the_gpus_own_week() -> None:
    # steady 1 SBE per hop for two days vs quiet for two days then 1 per hop for the last 6 h
    hops = 288
    steady = [1] * hops
    rising = [0] * (hops - 36) + [1] * 36
    fs, fr = windows(), windows()
    vs = (fs.process_dicts(_sbe_series(steady, hops)) + fs.flush())[-1].values
    vr = (fr.process_dicts(_sbe_series(rising, hops)) + fr.flush())[-1].values
    assert vr["sbe_accel"] > vs["sbe_accel"] + 0.5


def test_job_and_rank_of_the_latest_sample_go_into_the_features() -> None:
    fw = windows()
    rows = [dict(sample(i), job="job-7", rank=3) for i in range(10)] + [sample(10)]
    out = fw.process_dicts(rows)
    assert (out[0].job, out[0].rank) == ("job-7", 3)  # hop 0 closed; the GPU was still on job-7
    rows = [dict(sample(i), job="job-8", rank=0) for i in range(11, 21)]
    out = fw.process_dicts(rows)
    assert (out[0].job, out[0].rank) == ("job-8", 0)
    slot = fw.register("n1", 0, "h100")
    assert fw.job_ranks([slot]) == [("job-8", 0)]
    state = json.loads(json.dumps(fw.state("n1/0")))
    fresh = windows()
    fresh.restore("n1/0", state)
    assert fresh.job_ranks([0]) == [("job-8", 0)]


def test_ingest_arrays_take_job_ranks() -> None:
    fw = windows()
    slot = fw.register("n1", 0, "h100")
    from fleetwise.predictors.features import sample_row

    rows = [sample_row(sample(i)) for i in range(11)]
    _, _, feats = fw.ingest([slot] * 11, [T0 + 60.0 * i for i in range(11)], rows,
                            job_ranks=[("job-1", 5)] * 11)
    assert len(feats) == 1 and fw.job_ranks([slot]) == [("job-1", 5)]


def test_a_replaced_board_starts_without_the_old_boards_history() -> None:
    agg = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
    # old board: 10 SBEs per hop for 6 hops; then a new board (aggregate counter back to 0)
    old = [sample(i, **{SBE: 10 * (i // 10), agg: 500 + 10 * (i // 10)}) for i in range(60)]
    new = [sample(i, **{SBE: 0, agg: 0}) for i in range(60, 80)]
    fw, ref = windows(), windows()
    out = fw.process_dicts(old + new) + fw.flush()
    last = out[-1].values
    assert last["sbe_vol_24h"] == 0 and last["sbe_active_6h"] == 0
    # whereas a plain reboot (volatile counter reset, aggregate kept) keeps the history
    reboot = [sample(i, **{SBE: 0, agg: 550}) for i in range(60, 80)]
    kept = (ref.process_dicts(old + reboot) + ref.flush())[-1].values
    assert kept["sbe_vol_24h"] > 40


def test_a_board_named_by_another_uuid_starts_without_the_old_boards_history() -> None:
    # A board swapped in without a silence or a counter going down (the new board's counters
    # read higher): its uuid says it is another board. Its history restarts and its counters
    # are its own bases, on every ingest path (dicts, records, the C splitter's columns).
    agg = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"

    def trace(uuids: list[str | None]) -> list[dict]:
        rows = [sample(i, **{SBE: 10 * (i // 10), agg: 500 + 10 * (i // 10)}) for i in range(60)]
        rows += [sample(i, **{SBE: 80, agg: 900}) for i in range(60, 80)]
        for i, row in enumerate(rows):
            if uuids[i // 30] is not None:
                row["uuid"] = uuids[i // 30]
        return rows

    def last(rows: list[dict], path: str = "dicts") -> dict:
        fw = windows()
        if path == "dicts":
            out = fw.process_dicts(rows)
        elif path == "records":
            out = fw.process([GpuSample.model_validate(r) for r in rows])
        else:
            text = "\n".join(json.dumps(r) for r in rows).encode()
            out = fw.to_records(*fw.ingest_samples(SAMPLE_DECODER.trace_lines(text).samples))
        return (out + fw.flush())[-1].values

    swapped = last(trace(["GPU-a", "GPU-a", "GPU-b"]))
    assert swapped["sbe_vol_24h"] == 0 and swapped["sbe_vol_hop"] == 0 and swapped["sbe_active_6h"] == 0
    assert swapped["hours_reporting"] == pytest.approx(1 / 6)  # one hop since the new board's first
    assert last(trace(["GPU-a", "GPU-a", "GPU-b"]), "records") == swapped
    assert last(trace(["GPU-a", "GPU-a", "GPU-b"]), "columns") == swapped
    # the same board throughout, or samples that name none between, keep the history
    for uuids in (["GPU-a"] * 3, ["GPU-a", None, "GPU-a"], [None] * 3, [None, None, "GPU-b"]):
        kept = last(trace(uuids))
        assert kept["sbe_vol_24h"] > 40 and kept["hours_reporting"] > 1, uuids


def test_hours_reporting_count_since_the_last_silence_of_an_hour() -> None:
    def hours(rows: list[dict]) -> list[float]:
        fw = windows()
        return [round(o.values["hours_reporting"], 4) for o in fw.process_dicts(rows) + fw.flush()]

    # 60 s samples; each hop adds the time since the GPU's previous hop
    assert hours([sample(i) for i in range(40)]) == [0.0, 0.1667, 0.3333, 0.5]
    # 50 minutes without a sample (a reboot, a scrape gap): still counting, the gap included
    assert hours([sample(i) for i in range(60) if not 10 <= i < 60 - 10]) == [0.0, 0.8333]
    # an hour or more (a repair, a replacement): back to 0
    assert hours([sample(i) for i in range(90) if not 10 <= i < 80]) == [0.0, 0.0]
    # a new board (a persistent counter down) starts at 0 without any silence
    agg = "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL"
    new_board = [sample(i, **{agg: 500 if i < 30 else 0}) for i in range(50)]
    assert hours(new_board) == [0.0, 0.1667, 0.3333, 0.0, 0.1667]


def _pcie_series(per_hop: list[int]) -> list[dict]:
    out, total = [], 0
    for i in range(len(per_hop) * 10):
        if i % 10 == 0:
            total += per_hop[i // 10]
        out.append(sample(i, **{"DCGM_FI_DEV_PCIE_REPLAY_COUNTER": total}))
    return out


def _last(per_hop: list[int]) -> dict:
    fw = windows()
    return (fw.process_dicts(_pcie_series(per_hop)) + fw.flush())[-1].values


def test_surprise_is_against_the_gpus_own_observed_baseline() -> None:
    day = 144  # hops
    quiet_then_burst = _last([0] * (2 * day) + [6])
    noisy_then_one = _last([1 if h % 6 == 0 else 0 for h in range(2 * day)] + [1])  # ~1 per hour
    new_gpu_burst = _last([0, 0, 6])  # seen for 30 min: no baseline to be surprised by
    assert quiet_then_burst["pcie_surprise"] > 5
    assert noisy_then_one["pcie_surprise"] < 1
    assert new_gpu_burst["pcie_surprise"] < quiet_then_burst["pcie_surprise"] / 3
    assert quiet_then_burst["pcie_accel"] > noisy_then_one["pcie_accel"]


def test_bulk_state_export_import_continues_like_the_original():
    # Two windows fed the same first half; one's state moves to a fresh instance in bulk; both
    # then get the second half and must give identical features.
    rng = np.random.default_rng(3)
    samples = []
    for k in range(240):
        for g in range(4):
            samples.append({"ts": T0 + 30.0 * k, "node": "n1", "gpu": g, "model": "NVIDIA H100 80GB HBM3",
                            "job": "j", "rank": g, "metrics": {
                                "DCGM_FI_DEV_GPU_TEMP": 60 + rng.normal(), "DCGM_FI_DEV_POWER_USAGE": 500.0,
                                "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": float(k // 50)}})
    half = len(samples) // 2
    a = GpuFeatureWindows()
    a.process_dicts(samples[:half])
    keys = a.keys()
    metas, job_ranks, arrays = a.export_state(keys)
    b = GpuFeatureWindows()
    b.import_state(keys, metas, job_ranks, {k: v.copy() for k, v in arrays.items()})
    assert b.keys() == keys and [b.state(k) for k in keys] == [a.state(k) for k in keys]
    fa, fb = a.process_dicts(samples[half:]) + a.flush(), b.process_dicts(samples[half:]) + b.flush()
    assert fa and [v.model_dump() for v in fa] == [v.model_dump() for v in fb]
    with pytest.raises(ValueError, match="differ from this code"):
        GpuFeatureWindows().import_state(keys, metas, job_ranks, {"acc": arrays["acc"]})


def test_staggered_hops_are_aligned_hops_shifted_by_each_gpus_phase():
    rng = np.random.default_rng(5)
    gpus = [("n1", g) for g in range(8)]
    staggered = GpuFeatureWindows(stagger=True)
    phases = {f"{n}/{g}": staggered.hop_phase(f"{n}/{g}") for n, g in gpus}
    assert len(set(phases.values())) > 3 and all(0 <= p < 600 and p % 10 == 0 for p in phases.values())
    assert GpuFeatureWindows().hop_phase("n1/0") == 0.0

    def sample(ts: float, node: str, gpu: int) -> dict:
        return {"ts": ts, "node": node, "gpu": gpu, "model": "NVIDIA H100 80GB HBM3", "metrics": {
            "DCGM_FI_DEV_GPU_TEMP": 60 + rng.normal(), "DCGM_FI_DEV_POWER_USAGE": 400 + 50 * rng.random()}}

    samples = [sample(T0 + 30.0 * k, n, g) for k in range(200) for n, g in gpus]
    got = staggered.process_dicts(samples) + staggered.flush()
    # Reference: aligned windows over each GPU's samples moved back by its phase.
    aligned = GpuFeatureWindows()
    shifted = [{**s, "ts": s["ts"] - phases[f"{s['node']}/{s['gpu']}"]} for s in samples]
    shifted.sort(key=lambda s: s["ts"])
    want = aligned.process_dicts(shifted) + aligned.flush()

    def by_key(vectors: list, shift: bool) -> dict:
        return {(v.node, v.gpu, v.ts + (phases[f"{v.node}/{v.gpu}"] if shift else 0.0)): v.values
                for v in vectors}

    assert by_key(got, shift=False) == by_key(want, shift=True)
    # Hop ends differ between GPUs: the closes spread over the hop.
    assert len({v.ts % 600 for v in got}) == len(set(phases.values()))


def test_decoded_samples_give_each_hops_job_and_rank_as_dicts_do() -> None:
    # Two GPUs, job and rank changing from sample to sample, some samples out of order inside
    # their hop: each closed hop carries the (job, rank) of its GPU's latest sample, whether the
    # samples come as decoded structs in one call or as dicts.
    from fleetwise.predictors.features import SAMPLE_DECODER

    rows = [dict(sample(i, gpu=g), job=f"job-{(i + g) // 7}", rank=(i * 3 + g) % 5)
            for i in range(40) for g in (0, 1)]
    rows[5], rows[9] = rows[9], rows[5]  # out of order inside hop 0
    rows[30], rows[28] = rows[28], rows[30]
    structs = SAMPLE_DECODER.samples([json.dumps(r).encode() for r in rows])
    assert structs is not None
    fast, slow = windows(), windows()
    got = fast.to_records(*fast.ingest_samples(structs)) + fast.flush()
    want = slow.process_dicts(rows) + slow.flush()
    latest = {}  # (hop end, gpu) -> (job, rank) of the GPU's latest sample in that hop
    for r in sorted(rows, key=lambda r: r["ts"]):
        latest[(T0 + 600.0 * ((r["ts"] - T0) // 600 + 1), r["gpu"])] = (r["job"], r["rank"])
    assert [(v.ts, v.gpu, v.job, v.rank) for v in got] == [(v.ts, v.gpu, v.job, v.rank) for v in want]
    assert {(v.ts, v.gpu): (v.job, v.rank) for v in got} == latest
    assert len(set(latest.values())) > 3


# ---- node-peer context ----------------------------------------------------------------------
NVL = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"


def link_trace(seed: int, gaps: bool = True) -> list[dict]:
    """Two nodes of four GPUs, 60 s samples for 8 h, arriving GPU by GPU each tick: n1/0's
    link degrades from hour 2 (errors every sample), n1/1 and n1/2 log a few sympathetic
    errors, n2/3 has a lemon's sporadic errors; with `gaps`, n1/2 and n2/1 go silent for a
    while and n1/3's samples of some ticks arrive before the others'."""
    rng = np.random.default_rng(seed)
    nvl = {(n, g): 0.0 for n in ("n1", "n2") for g in range(4)}
    out = []
    for i in range(480):
        tick = []
        for node in ("n1", "n2"):
            for g in range(4):
                gap = {("n1", 2): (150, 190), ("n2", 1): (300, 330)}.get((node, g), (0, 0))
                if gaps and gap[0] <= i < gap[1]:
                    continue
                if (node, g) == ("n1", 0) and i >= 120:
                    nvl[node, g] += rng.poisson(3.0) + 1
                elif node == "n1" and g in (1, 2) and i >= 200 and rng.random() < 0.05:
                    nvl[node, g] += rng.integers(1, 20)
                elif (node, g) == ("n2", 3) and rng.random() < 0.02:
                    nvl[node, g] += 1
                s = sample(i, gpu=g, **{NVL: nvl[node, g]})
                s["node"] = node
                tick.append(s)
        if gaps and i % 37 == 5:  # n1/3 first in this tick
            tick.sort(key=lambda s: (s["node"], s["gpu"]) != ("n1", 3))
        out += tick
    return out


def peer_values(out: list) -> dict:
    return {(o.node, o.gpu, o.ts): {k: v for k, v in o.values.items() if k.startswith("node_")} for o in out}


def test_node_peers_count_a_peers_recent_link_errors_and_streaks_on_its_node_only() -> None:
    fw = windows()
    out = fw.process_dicts(link_trace(1, gaps=False)) + fw.flush()
    got = peer_values(out)
    end = T0 + 6 * 3600.0  # n1/0 has erred in every hop since hour 2
    assert got["n1", 0, end]["node_nvl_peers_1h"] <= 2  # only the sympathetic ones, if any
    for g in (1, 2, 3):
        assert got["n1", g, end]["node_nvl_peers_1h"] >= 1
        assert got["n1", g, end]["node_nvl_streak_peers_1h"] == 1  # n1/0's run of erring hops
    # before the degradation no GPU of n1 streaked; n2's lemon never streaks and stays on n2
    assert all(v["node_nvl_streak_peers_1h"] == 0
               for (n, _g, ts), v in got.items() if n == "n1" and ts <= T0 + 7200)
    assert all(v["node_nvl_streak_peers_1h"] == 0 for (n, _g, _ts), v in got.items() if n == "n2")
    assert all(v["node_pcie_peers_1h"] == 0 for v in got.values())
    # When n1/0 goes quiet (here: stops reporting at hour 3), its peers count it for an hour
    # after its last erring hop, then no more.
    fw2 = windows()
    quiet = [s for s in link_trace(1, gaps=False)
             if not (s["node"] == "n1" and s["gpu"] == 0 and s["ts"] >= T0 + 3 * 3600)]
    got2 = peer_values(fw2.process_dicts(quiet) + fw2.flush())
    assert got2["n1", 3, T0 + 3 * 3600 + 600]["node_nvl_streak_peers_1h"] == 1
    assert got2["n1", 3, T0 + 4 * 3600 + 1200]["node_nvl_streak_peers_1h"] == 0


def test_node_peer_context_does_not_depend_on_how_the_samples_were_split() -> None:
    # A peer with a gap keeps its hop open past its peers' next hops: whether that hop counts
    # for them depends only on whether the sample that closed it arrived before the one that
    # closed theirs, so any split of the same arrivals into calls gives the same features.
    arrivals = link_trace(2)
    results = []
    for size in (len(arrivals), 1, 3, 8, 101):
        fw = windows()
        out = []
        for k in range(0, len(arrivals), size):
            out += fw.process_dicts(arrivals[k:k + size])
        out += fw.flush()
        # (records come out per call in (ts, node, gpu) order: a hop held open by a gap comes
        # out with a later call's, so compare by key)
        results.append({(o.node, o.gpu, o.ts): o.values for o in out})
    assert all(r == results[0] for r in results[1:])
    assert any(v["node_nvl_streak_peers_1h"] for v in results[0].values())


def test_node_peer_context_survives_a_state_round_trip() -> None:
    arrivals = link_trace(3)
    ref = windows()
    expected = ref.process_dicts(arrivals) + ref.flush()
    cut = len(arrivals) // 2 + 5  # mid-degradation, n1/0 streaking
    fw = windows()
    got = fw.process_dicts(arrivals[:cut])
    saved = {k: json.loads(json.dumps(fw.state(k), allow_nan=False)) for k in fw.keys()}  # noqa: SIM118
    restarted = windows()
    for k in sorted(saved, reverse=True):  # another slot order than the original's
        restarted.restore(k, saved[k])
    got += restarted.process_dicts(arrivals[cut:]) + restarted.flush()
    assert peer_values(got) == peer_values(expected)
    assert [o.values for o in got] == [o.values for o in expected]


def test_dropping_other_nodes_slots_keeps_a_nodes_peer_context() -> None:
    # The worker's state bound compacts the slot arrays (`keep_slots`): the kept GPUs' node
    # peers must still be found under their new slot numbers.
    arrivals = [s for s in link_trace(4) if s["node"] == "n1" or s["ts"] < T0 + 3 * 3600]
    only_n1 = [s for s in arrivals if s["node"] == "n1"]
    ref = windows()
    expected = ref.process_dicts(only_n1) + ref.flush()
    fw = windows()
    for g in range(4):  # n2's GPUs get the lower slots, so n1's are renumbered
        fw.register("n2", g, "h100")
    cut = len([s for s in arrivals if s["ts"] < T0 + 3 * 3600])
    got = fw.process_dicts(arrivals[:cut])
    keys = fw.slot_keys()
    fw.keep_slots(np.array([i for i, k in enumerate(keys) if k.startswith("n1/")]))
    assert fw.slot_keys() == [k for k in keys if k.startswith("n1/")]
    got = [o for o in got if o.node == "n1"] + fw.process_dicts(arrivals[cut:]) + fw.flush()
    assert peer_values(got) == peer_values(expected)
    assert any(v["node_nvl_streak_peers_1h"] for v in peer_values(got).values())


def heat_trace(seed: int, warmer_c: float = 8.0) -> list[dict]:
    """Two nodes of four GPUs, 60 s samples for 12 h, load varying: from hour 4 every GPU of n1
    runs `warmer_c` warmer at the same power (heat its row shares), and n2/0 alone does (its own
    cooling); n2/2's samples of some ticks arrive first."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(720):
        tick = []
        for node in ("n1", "n2"):
            for g in range(4):
                power = 350.0 + 150.0 * math.sin(i / 37.0 + g) + rng.normal(0, 10)
                warm = warmer_c if i >= 240 and (node == "n1" or g == 0) else 0.0
                temp = 30.0 + 45.0 * power / 700.0 + warm + rng.normal(0, 0.5)
                s = sample(i, gpu=g, **{F_TEMP: temp, F_POWER: power})
                s["node"] = node
                tick.append(s)
        if i % 29 == 3:
            tick.sort(key=lambda s: (s["node"], s["gpu"]) != ("n2", 2))
        out += tick
    return out


def two_node_trace(minutes: int, metrics: Callable[[int, str, int], dict]) -> list[dict]:
    """Two nodes of four GPUs, 60 s samples with `metrics(minute, node, gpu)`; the ticks of some
    minutes arrive in reverse."""
    out = []
    for i in range(minutes):
        tick = []
        for node in ("n1", "n2"):
            for g in range(4):
                s = sample(i, gpu=g, **metrics(i, node, g))
                s["node"] = node
                tick.append(s)
        if i % 31 == 2:
            tick.reverse()
        out += tick
    return out


def sbe_trace() -> list[dict]:
    """16 h of two nodes: GPUs 1-3 of n1 (a cause the node shares) and n2/0 alone log a
    single-bit error at minutes 200, 320 and 440 (+10 per GPU index)."""
    sbe = {(n, g): 0.0 for n in ("n1", "n2") for g in range(4)}

    def metrics(i: int, node: str, g: int) -> dict:
        erring = (node == "n1" and g > 0) or (node, g) == ("n2", 0)
        if erring and i - 10 * g in (200, 320, 440):
            sbe[node, g] += 1
        return {SBE: sbe[node, g]}

    return two_node_trace(960, metrics)


BRAKE = 0x80  # HW power brake, a bit of the clock event reasons


def brake_trace() -> list[dict]:
    """10 h of two nodes: every GPU of n1 brakes at minutes 100-102, 300-302 and 500-502 (a power
    shelf's events), n2/0 alone at minutes 200 and 400."""

    def metrics(i: int, node: str, g: int) -> dict:
        shelf = node == "n1" and i % 200 in (100, 101, 102)
        return {F_REASONS: BRAKE if shelf or ((node, g) == ("n2", 0) and i in (200, 400)) else 0}

    return two_node_trace(600, metrics)


def test_node_brake_peers_count_the_other_gpus_of_the_node_braked_within_the_hour() -> None:
    fw = windows()
    got = {(o.node, o.gpu, o.ts): o.values for o in fw.process_dicts(brake_trace()) + fw.flush()}
    h = 3600.0
    # n2/0's braked hop (ends 3.5 h) is seen by its peers' hops for an hour, not after
    assert [got["n2", g, T0 + 4 * h]["node_brake_peers_1h"] for g in range(4)] == [0, 1, 1, 1]
    assert all(got["n2", g, T0 + 4.5 * h + 600]["node_brake_peers_1h"] == 0 for g in range(4))
    # read one hop later, every braked hop's sharing is known: n2/0's two alone, each of the
    # shelf's twelve on n1 beside its three peers (in its own hop the GPU whose hop closes first
    # in the node's arrival order sees none yet)
    after = {(n, g): [v["node_brake_peers_1h"] for (n2, g2, _ts), v in got.items()
                      if (n2, g2) == (n, g) and v["thr_power_brake_prev"] > 0]
             for n in ("n1", "n2") for g in range(4)}
    assert after["n2", 0] == [0, 0] and all(after["n2", g] == [] for g in (1, 2, 3))
    assert all(after["n1", g] == [3, 3, 3] for g in range(4))
    braked = [v["thr_power_brake"] for (n, g, _ts), v in sorted(got.items()) if (n, g) == ("n2", 0)]
    prev = [v["thr_power_brake_prev"] for (n, g, _ts), v in sorted(got.items()) if (n, g) == ("n2", 0)]
    assert prev == [0.0, *braked[:-1]]
    # after a gap in the GPU's samples its last braked hop is not "the previous hop"
    fw = windows()
    rows = [sample(i, **{F_REASONS: BRAKE if i == 5 else 0}) for i in range(60) if not 10 <= i < 40]
    out = fw.process_dicts(rows) + fw.flush()
    assert [o.values["thr_power_brake"] for o in out] == [0.1, 0.0, 0.0]
    assert [o.values["thr_power_brake_prev"] for o in out] == [0.0, 0.0, 0.0]


def test_brake_hops_count_a_gpus_braked_hops_and_the_most_of_its_node_peers() -> None:
    fw = windows()
    got = {(o.node, o.gpu, o.ts): o.values for o in fw.process_dicts(brake_trace()) + fw.flush()}
    h = 3600.0
    own = {k: v["brake_hops_6h"] for k, v in got.items()}
    peak = {k: v["node_brake_hops_max_6h"] for k, v in got.items()}
    # one braked hop counts 1 in its own hop (n2/0's at minute 200, hop ending 3.5 h) and decays
    # over 6 h; its peers braked none, and GPUs that braked none read no peer maximum
    assert own["n2", 0, T0 + 3.5 * h] == pytest.approx(1.0)
    assert own["n2", 0, T0 + 3.5 * h + 6 * 600] == pytest.approx(np.exp(-1 / 6))
    assert peak["n2", 0, T0 + 3.5 * h] == 0.0
    assert all(peak["n2", g, ts] == 0.0 for (n, g, ts) in got if n == "n2" and g > 0)
    # the shelf's GPUs brake alike: each reads its peers' most about as high as its own (a peer
    # whose hop closed before this one's, or its previous hop's count decayed to this end)
    late = T0 + 9 * h
    assert all(own["n1", g, late] > 1.5 for g in range(4))
    assert all(0.9 * own["n1", g, late] <= peak["n1", g, late] <= 1.1 * own["n1", g, late] for g in range(4))
    # the hops without a braked one in the last hours read the peer maximum as 0 (not asked)
    quiet = [k for k in got if own[k] < 1.0]
    assert quiet and all(peak[k] == 0.0 for k in quiet)


def test_a_silent_peers_brake_count_decays_to_the_close_that_reads_it() -> None:
    # n1/1 brakes in every minute of its first two hours, then stops reporting; n1/0 brakes once
    # at hour 5 and reads n1/1's last count as it has decayed since n1/1's last closed hop ended.
    rows = []
    for i in range(6 * 60):
        for g in (0, 1):
            if g == 1 and i >= 120:
                continue
            s = sample(i, gpu=g, **{F_REASONS: BRAKE if (g == 1 or i == 300) else 0})
            s["node"] = "n1"
            rows.append(s)
    fw = windows()
    got = {(o.gpu, o.ts): o.values for o in fw.process_dicts(rows) + fw.flush()}
    last_end = T0 + 2 * 3600.0 - 600  # (its hop ending at 2 h stays open until the flush)
    stale = got[1, last_end]["brake_hops_6h"]
    assert stale > 5.0
    end = T0 + 5 * 3600.0 + 600
    read = got[0, end]
    assert read["brake_hops_6h"] == pytest.approx(1.0)
    assert read["node_brake_hops_max_6h"] == pytest.approx(stale * np.exp(-(end - last_end) / (6 * 3600.0)))


def test_node_heat_peers_count_peers_warm_at_rule_19s_level_that_warm_peers_leave_out() -> None:
    """A row's heat that warms every GPU of n1 by ~2.8 C for its power: under WARM_RESIDUAL_C, so
    no GPU reads a warm peer, but each reads its three peers at HEAT_PEER_RESIDUAL_C; n2/0 warms
    alone (its peers see it, it sees none)."""
    fw = windows()
    got = {(o.node, o.gpu, o.ts): o.values for o in fw.process_dicts(heat_trace(1, 6.5)) + fw.flush()}
    before, late = T0 + 4 * 3600.0, T0 + 11 * 3600.0
    assert all(v["node_heat_peers_1h"] == 0 for (_n, _g, ts), v in got.items() if ts <= before)
    residual = [got["n1", g, late]["temp_residual_6h"] for g in range(4)]
    assert all(HEAT_PEER_RESIDUAL_C <= r < WARM_RESIDUAL_C for r in residual)
    assert [got["n1", g, late]["node_warm_peers_1h"] for g in range(4)] == [0, 0, 0, 0]
    assert [got["n1", g, late]["node_heat_peers_1h"] for g in range(4)] == [3, 3, 3, 3]
    assert [got["n2", g, late]["node_heat_peers_1h"] for g in range(4)] == [0, 1, 1, 1]


def test_node_warm_peers_count_the_other_gpus_of_the_node_running_warm_for_their_power() -> None:
    fw = windows()
    got = {(o.node, o.gpu, o.ts): o.values for o in fw.process_dicts(heat_trace(1)) + fw.flush()}
    before, late = T0 + 4 * 3600.0, T0 + 11 * 3600.0
    assert all(v["node_warm_peers_1h"] == 0 for (_n, _g, ts), v in got.items() if ts <= before)
    # the row's heat: each GPU of n1 sees its three peers warm, as does n2's healthy GPUs n2/0
    assert [got["n1", g, late]["node_warm_peers_1h"] for g in range(4)] == [3, 3, 3, 3]
    assert [got["n2", g, late]["node_warm_peers_1h"] for g in range(4)] == [0, 1, 1, 1]
    assert all(got[n, g, late]["temp_residual_6h"] >= WARM_RESIDUAL_C for n, g in (("n1", 1), ("n2", 0)))
    assert got["n2", 1, late]["temp_residual_6h"] < 1.0


@pytest.mark.parametrize("trace, column", [(lambda: heat_trace(2), "node_warm_peers_1h"),
                                           (sbe_trace, "node_sbe_peers_6h"),
                                           (brake_trace, "node_brake_peers_1h"),
                                           (brake_trace, "node_brake_hops_max_6h")])
def test_node_warm_and_sbe_peers_do_not_depend_on_how_the_samples_were_split(trace, column) -> None:
    arrivals = trace()
    results = []
    for size in (len(arrivals), 1, 7, 250):
        fw = windows()
        out = []
        for k in range(0, len(arrivals), size):
            out += fw.process_dicts(arrivals[k:k + size])
        out += fw.flush()
        results.append(peer_values(out))  # (the gauges' float sums differ in the last bits)
    assert all(r == results[0] for r in results[1:])
    assert any(v[column] for v in results[0].values())


def test_node_sbe_peers_count_the_other_gpus_of_the_node_with_single_bit_errors_in_6_hours() -> None:
    fw = windows()
    got = peer_values(fw.process_dicts(sbe_trace()) + fw.flush())
    h = 3600.0
    # before the first error (its hop ends at 3.5 h) no GPU has an erring peer
    assert all(v["node_sbe_peers_6h"] == 0 for (_n, _g, ts), v in got.items() if ts <= T0 + 12000)
    for ts in (T0 + 9 * h, T0 + 13 * h):  # the last errors' hops end at 7.67, 7.83 and 8 h
        assert [got["n1", g, ts]["node_sbe_peers_6h"] for g in range(4)] == [3, 2, 2, 2]
        assert [got["n2", g, ts]["node_sbe_peers_6h"] for g in range(4)] == [0, 1, 1, 1]
    # 6 h after each peer's last erring hop it no longer counts
    assert got["n1", 0, T0 + 13 * h + 3000]["node_sbe_peers_6h"] == 2  # n1/1's ended at 7.67 h
    assert all(v["node_sbe_peers_6h"] == 0 for (_n, _g, ts), v in got.items() if ts > T0 + 14 * h)


def test_state_saved_before_the_warm_and_sbe_peer_columns_restores_as_never_marked() -> None:
    arrivals = [{**a, "uuid": f"GPU-{a['node']}-{a['gpu']}"} for a in heat_trace(3)]
    cut = 8 * 240  # hour 4, a hop boundary: nothing warm yet
    ref = windows()
    expected = ref.process_dicts(arrivals) + ref.flush()
    fw = windows()
    got = fw.process_dicts(arrivals[:cut])
    saved = {k: json.loads(json.dumps(fw.state(k), allow_nan=False)) for k in fw.keys()}  # noqa: SIM118
    for state in saved.values():  # as the code before the warm and single-bit columns saved it
        state["peer_end"] = state["peer_end"][:4]
        state["ew"] = state["ew"][:-3]  # ... and before the last hop's power-brake duty and hours reported
        state["base"] = state["base"][:-1]  # ... and before the board column (a uuid then is no new board)
        del state["peer_brake_hops"], state["peer_brake_end"]  # ... and before the brake counts
    restarted = windows()
    for k, state in saved.items():
        restarted.restore(k, state)
    after = restarted.process_dicts(arrivals[cut:]) + restarted.flush()

    def without_hours(outs: list) -> list:
        return [{k: v for k, v in o.values.items() if k != "hours_reporting"} for o in outs]

    assert without_hours(got + after) == without_hours(expected)
    # the hours reported restart at the restore (as after a silence): a settled rule waits a day
    restored = [o.values["hours_reporting"] for o in after if o.gpu == 0]
    kept = [o.values["hours_reporting"] for o in expected[len(got):] if o.gpu == 0]
    assert restored[0] == pytest.approx(1 / 6) and kept[0] > 3.5  # one hop since the restore
    assert np.allclose(np.diff(restored), np.diff(kept))
    # the worker's binary checkpoints (export_state / import_state) the same
    keys = fw.keys()
    metas, job_ranks, arrays = fw.export_state(keys)
    arrays["peer_end"] = arrays["peer_end"][:, :4]
    arrays["ew"] = arrays["ew"][:, :-3]
    arrays["base"] = arrays["base"][:, :-1]
    del arrays["peer_brake_hops"], arrays["peer_brake_end"]
    imported = windows()
    imported.import_state(keys, metas, job_ranks, arrays)
    assert [o.values for o in imported.process_dicts(arrivals[cut:]) + imported.flush()] == [
        o.values for o in after]


def test_state_saved_before_the_brake_counts_restores_them_fresh_over_a_slot_in_use() -> None:
    # A checkpoint from before `peer_brake_hops` / `peer_brake_end` restored into windows that
    # already hold those GPUs (a worker taking its partitions back): the two arrays start fresh,
    # as they do in new windows, not as the slots' stale values.
    arrivals = brake_trace()
    cut = 8 * 330  # minute 330, after the shelf's second brake
    fw = windows()
    fw.process_dicts(arrivals[:cut])
    saved = {k: json.loads(json.dumps(fw.state(k), allow_nan=False)) for k in fw.keys()}  # noqa: SIM118
    for state in saved.values():
        del state["peer_brake_hops"], state["peer_brake_end"]
    keys = fw.keys()
    metas, job_ranks, arrays = fw.export_state(keys)  # the worker's binary checkpoint, the same
    del arrays["peer_brake_hops"], arrays["peer_brake_end"]
    used = windows()
    used.process_dicts(arrivals[:cut])
    results = []
    for target in (windows(), fw):  # fresh windows; the same windows, their slots in use
        for k, state in saved.items():
            target.restore(k, state)
        results.append([o.values for o in target.process_dicts(arrivals[cut:]) + target.flush()])
    for target in (windows(), used):
        target.import_state(keys, metas, job_ranks, arrays)
        results.append([o.values for o in target.process_dicts(arrivals[cut:]) + target.flush()])
    assert all(r == results[0] for r in results[1:])
    assert any(v["node_brake_hops_max_6h"] > 0 for v in results[0])


def test_hops_closed_together_at_a_flush_do_not_count_each_other() -> None:
    # The flush closes every open hop at once, with no arrival order among them (closed_by
    # inf): none sees the others' errors, whatever order the code takes them in. A hop closed
    # earlier, by a sample, is seen by the flushed hops of its node.
    def run(errs: dict[int, range]) -> dict:
        rows, nvl = [], dict.fromkeys(range(3), 0.0)
        for i in range(25):  # 60 s samples: hops end at 10, 20 and 30 min; the last stays open
            for g in range(3):
                nvl[g] += 5.0 if i in errs.get(g, ()) else 0.0
                s = sample(i, gpu=g, **{NVL: nvl[g]})
                rows.append(s)
        fw = windows()
        return peer_values(fw.process_dicts(rows) + fw.flush())

    last = T0 + 1800.0  # the flushed hops
    both = run({0: range(20, 25), 1: range(20, 25)})
    assert [both["n1", g, last]["node_nvl_peers_1h"] for g in range(3)] == [0, 0, 0]
    # n1/1 errs in the hop before instead, which its sample at 20 min closes: seen by the
    # flushed hops of n1/0 and n1/2; n1/1's flushed hop does not see n1/0's
    earlier = run({0: range(20, 25), 1: range(15, 18)})
    assert [earlier["n1", g, last]["node_nvl_peers_1h"] for g in range(3)] == [1, 0, 1]
