"""Thermal headroom and utilisation trends per GPU, rack and site (fleetwise.predictors.trends)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import REGISTRY

from fleetwise.predictors.features import F_POWER, F_SMCLK, F_TEMP, F_UTIL, FEATURE_NAMES
from fleetwise.predictors.trends import (
    FleetTrends,
    ThermalHeadroom,
    TrendConfig,
    hop_headroom,
)
from fleetwise.streams import metrics as M
from fleetwise.streams.embedded import replay
from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

T0 = 1764547200.0
COL = {n: FEATURE_NAMES.index(n) for n in FEATURE_NAMES}


def feats(rows: list[dict[str, float]]) -> np.ndarray:
    f = np.full((len(rows), len(FEATURE_NAMES)), np.nan)
    for i, row in enumerate(rows):
        for name, value in row.items():
            f[i, COL[name]] = value
    return f


def test_headroom_drift_and_chance_of_running_out() -> None:
    f = feats([
        {"temp_max": 80.0, "temp_at_tdp_c": 85.0, "temp_at_tdp_drift_c_per_h": 0.075, "util_mean": 90.0},
        {"temp_max": 60.0, "temp_at_tdp_c": 70.0, "temp_at_tdp_drift_c_per_h": 0.0, "util_mean": 10.0},
        {"temp_max": 60.0, "temp_at_tdp_c": 70.0, "temp_at_tdp_drift_c_per_h": -0.1, "util_mean": 10.0},
        {"temp_max": 60.0},  # no fit yet
        {"temp_max": 88.0, "temp_at_tdp_c": 80.0},  # throttled at its limit: the fit reads low
    ])
    h = hop_headroom(f, TrendConfig(limit_c=87.0, horizon_h=24.0, sigma_c=2.0))
    assert h.headroom_c[:3].tolist() == [7.0, 27.0, 27.0]
    assert h.headroom_at_tdp_c[:3].tolist() == [2.0, 17.0, 17.0]
    assert h.drift_c_per_day[0] == pytest.approx(1.8)
    assert h.drift_c_per_day[1] == 0.0 and h.drift_c_per_day[2] < 0  # cooling down
    # Row 0: 85 C + 1.8 C over the next day = 86.8 C against 87: about even odds.
    ahead = 87.0 - (85.0 + 1.8)
    assert h.probability[0] == pytest.approx(0.5 * math.erfc(ahead / 2.0 / math.sqrt(2)), rel=1e-9)
    assert 0.4 < h.probability[0] < 0.5
    assert h.probability[1] < 1e-12 and h.probability[2] < h.probability[1]
    assert np.isnan(h.headroom_at_tdp_c[3]) and h.probability[3] < 1e-12
    # Already past its limit: no headroom within the horizon either, whatever the fit says.
    assert h.headroom_c[4] == -1.0
    assert h.probability[4] == pytest.approx(0.5 * math.erfc(-0.5 / math.sqrt(2)))


def test_thermal_predictions_said_when_their_band_changes() -> None:
    def row(at_tdp: float) -> dict[str, float]:
        return {"temp_max": 80.0, "temp_at_tdp_c": at_tdp, "temp_at_tdp_drift_c_per_h": 0.0}

    cool = row(70.0)  # p ~ 0
    mid = row(85.0)  # p = 0.16: under the first band (0.2), over half of it (0.1)
    watch = row(86.0)  # p = 0.31: the first band
    likely = row(87.5)  # p = 0.60: the second
    th = ThermalHeadroom(TrendConfig(bands=(0.2, 0.5, 0.9), lower_hops=3, heartbeat_s=86400.0))
    seq = [watch] * 4 + [likely] * 2 + [mid] * 2 + [likely] + [mid] * 3 + [cool] * 3
    keys = [("n1", 0), ("n1", 1)] * len(seq)
    ts = np.repeat(T0 + 600.0 * np.arange(len(seq)), 2)
    rows = [r for x in seq for r in (x, cool)]
    preds, _ = th.process_arrays(keys, ts, feats(rows), [("job-a", 3), (None, None)] * len(seq))
    said = [((p.ts - T0) / 600, round(p.probability, 2)) for p in preds]
    # Raised at hop 0 (watch), up at hop 4 (likely), not down for a 2-hop dip; down after 3 hops
    # under 0.25 at hop 11 (to the first band: 0.16 is over its half, 0.1); cleared (under 0.1)
    # after 3 hops at hop 14. At 0.31 after 0.6 it would have stayed "likely" (over 0.25).
    assert said == [(0, 0.31), (4, 0.6), (11, 0.16), (14, 0.0)], said
    assert all(p.node == "n1" and p.gpu == 0 for p in preds)  # n1/1 stayed cool: nothing said
    p = preds[0]
    assert p.type == "thermal" and p.alert is False and p.job == "job-a" and p.rank == 3
    assert p.probability == pytest.approx(0.5 * math.erfc(1.0 / 2.0 / math.sqrt(2)), abs=1e-4)
    assert {s.name: s.value for s in p.signals}["headroom_at_tdp_c"] == 1.0
    assert "would run at 86.0 C at full power" in p.reason and "peaked at 80 C" in p.reason
    # A day on the same band: one heartbeat.
    th2 = ThermalHeadroom()
    day = np.arange(0, 86400.0 + 600.0, 600.0)
    beats, _ = th2.process_arrays([("n2", 0)] * len(day), T0 + day, feats([watch] * len(day)))
    assert [p.ts - T0 for p in beats] == [0.0, 86400.0]
    # What was said survives a restore: a restarted worker does not say it again.
    again = ThermalHeadroom()
    for key in th2.keys():
        again.restore(key, th2.state(key))
    assert again.keys() == ["n2/0"]
    assert again.process_arrays([("n2", 0)], np.array([T0 + 87000.0]), feats([watch]))[0] == []
    fresh = ThermalHeadroom().process_arrays([("n2", 0)], np.array([T0 + 87000.0]), feats([watch]))[0]
    assert len(fresh) == 1


def test_rollups_per_rack_and_site_close_by_event_time() -> None:
    trends = FleetTrends(TrendConfig(trend_hours=6, close_after_s=900.0))
    keys = [("n1", 0), ("n1", 1), ("n2", 0)]
    places = [("r1", "s1"), ("r1", "s1"), ("r2", "s1")]
    closed = []
    for hour in range(5):
        for hop in range(6):
            ts = np.full(3, T0 + hour * 3600.0 + hop * 600.0 + 300.0)
            # n1/0 warms 1 C per hour at full power; utilisation falls 10 points per hour.
            rows = [{"temp_max": 70.0 + hour, "temp_at_tdp_c": 75.0 + hour, "util_mean": 90.0 - 10 * hour},
                    {"temp_max": 60.0, "temp_at_tdp_c": 65.0, "util_mean": 90.0 - 10 * hour},
                    {"temp_max": 50.0, "temp_at_tdp_c": 55.0, "util_mean": 40.0}]
            closed += trends.observe(keys, places, ts, hop_headroom(feats(rows)))
    # Hops end at hh:05 .. hh:55; an hour closes 15 min after it ends (watermark 04:55 now).
    assert sorted({r.hour_ts for r in closed}) == [T0 + h * 3600.0 for h in range(4)]
    closed += trends.flush()
    r1 = [r for r in closed if r.scope == "rack" and r.name == "r1"]
    s1 = [r for r in closed if r.scope == "site"]
    assert len(r1) == 5 and len(s1) == 5  # hour 4 closed by the flush
    first = r1[0]
    assert first.gpus == 2 and first.site == "s1" and first.hottest == "n1/0"
    assert first.headroom_min_c == 87.0 - 70.0 and first.headroom_mean_c == (17.0 + 27.0) / 2
    assert first.headroom_at_tdp_min_c == 12.0 and first.headroom_at_tdp_mean_c == 17.0
    assert first.headroom_trend_c_per_h is None  # under 3 hours
    hour3 = r1[3]
    assert hour3.headroom_at_tdp_min_c == pytest.approx(87.0 - 78.0)
    assert hour3.headroom_trend_c_per_h == pytest.approx(-0.5, abs=1e-9)  # the mean of 2 GPUs
    assert hour3.util_trend_pct_per_h == pytest.approx(-10.0, abs=1e-9)
    assert s1[3].gpus == 3 and s1[3].util_mean_pct == pytest.approx((60 + 60 + 40) / 3, abs=0.01)


def _trace(path: Path) -> None:
    """72 h at 5-minute samples: n1/0's cooling degrades (temperature per watt 40 -> 62 C at
    TDP, 25 C inlet), n1/1 and n2/0 stay as they were; load alternates every 2 h. n2's samples
    name no rack or site: its inventory (first line) does."""
    with open(path, "w") as fh:
        fh.write(json.dumps({"ts": T0, "node": "n2", "rack": "r2", "site": "s1", "gpus": [
            {"index": 0, "uuid": "GPU-n2-0", "model": "NVIDIA H100 80GB HBM3", "memory_gb": 80.0}]}) + "\n")
        for i in range(72 * 12):
            t = T0 + 300.0 * i
            load = 0.9 if (i // 24) % 2 == 0 else 0.3
            for node, gpu, rack in (("n1", 0, "r1"), ("n1", 1, "r1"), ("n2", 0, "r2")):
                rise = 40.0 + (22.0 * i / (72 * 12) if (node, gpu) == ("n1", 0) else 0.0)
                metrics = {F_TEMP: round(25.0 + rise * load, 1), F_POWER: 700.0 * load, F_UTIL: 95.0 * load,
                           F_SMCLK: 1980.0}
                where = {"rack": rack, "site": "s1"} if node == "n1" else {}
                fh.write(json.dumps({"ts": t, "node": node, "gpu": gpu, "model": "NVIDIA H100 80GB HBM3",
                                     **where, "metrics": metrics}) + "\n")


def test_control_plane_warns_of_a_gpu_losing_its_headroom(tmp_path: Path) -> None:
    _trace(tmp_path / "t.jsonl")
    control = ControlPlane(ControlPlaneConfig(publish_features=False, fleet_trends=True))
    control.hop_observers.append(M.observe_gpu_headroom)  # as the stream worker does
    runtime = replay([tmp_path / "t.jsonl"], None, control=control)
    thermal = [d for d in runtime.decisions() if d.kind == "prediction" and d.type == "thermal"]
    assert {(p.node, p.gpu) for p in thermal} == {("n1", 0)}
    # Its full-power temperature reaches 87 C at 72 h (25 + 62 x 1.0); the first warning comes
    # about a day ahead of that (the 0.31 C/h drift carried forward), not in the first day.
    first_h = (thermal[0].ts - T0) / 3600
    assert 36 < first_h < 72 - 18, first_h
    drifts = [next(s.value for s in p.signals if s.name == "drift_c_per_day") for p in thermal]
    assert all(22.0 * 24 / 72 * 0.9 < d < 22.0 * 24 / 72 * 1.1 for d in drifts), drifts
    # Said as the chance rose through the bands: 0.2, 0.5, 0.9.
    probs = [p.probability for p in thermal]
    assert len(thermal) == 3 and 0.2 <= probs[0] < 0.5 <= probs[1] < 0.9 <= probs[2]
    assert all(not p.alert for p in thermal)
    rows = control.trend_rows
    assert {(r.scope, r.name) for r in rows} == {("rack", "r1"), ("rack", "r2"), ("site", "s1")}
    late = [r for r in rows if r.scope == "rack" and r.name == "r1" and r.hour_ts >= T0 + 48 * 3600]
    assert late and all(r.hottest == "n1/0" for r in late)
    assert all(r.drift_mean_c_per_day is not None and r.drift_mean_c_per_day > 2.0 for r in late)
    steady = [r for r in rows if r.scope == "rack" and r.name == "r2" and r.hour_ts >= T0 + 48 * 3600]
    assert all(abs(r.drift_mean_c_per_day) < 0.5 for r in steady)

    # The worker's per-GPU gauges, as of each GPU's last hop (the roll-ups are Prometheus's there).
    def gauge(name: str, node: str, rack: str, **extra: str) -> float | None:
        labels = {"node": node, "gpu": "0", "rack": rack, "site": "s1", **extra}
        return REGISTRY.get_sample_value(name, labels)

    hot = gauge("fleetwise_gpu_thermal_headroom_celsius", "n1", "r1", at="full_power")
    cool = gauge("fleetwise_gpu_thermal_headroom_celsius", "n2", "r2", at="full_power")
    assert hot is not None and 0.0 < hot < 2.0 and cool == pytest.approx(87.0 - 65.0, abs=1.0)
    # Now: the last hop ran at 30% of TDP (25 + 40 x 0.3 = 37 C).
    assert gauge("fleetwise_gpu_thermal_headroom_celsius", "n2", "r2", at="now") == 87.0 - 37.0
    assert gauge("fleetwise_gpu_temp_drift_celsius_per_day", "n1", "r1") == pytest.approx(22.0 / 3, rel=0.1)
    assert gauge("fleetwise_gpu_utilisation_percent", "n2", "r2") == pytest.approx(95.0 * 0.3)
    last = gauge("fleetwise_gpu_last_hop_timestamp_seconds", "n2", "r2")
    assert last is not None and T0 + 71 * 3600 < last <= T0 + 72 * 3600 + 600
    # A GPU whose state the worker evicts loses its series (its last values would linger).
    M.forget_gpus(["n2/0"])
    assert gauge("fleetwise_gpu_thermal_headroom_celsius", "n2", "r2", at="full_power") is None
    assert gauge("fleetwise_gpu_last_hop_timestamp_seconds", "n2", "r2") is None
    assert gauge("fleetwise_gpu_thermal_headroom_celsius", "n1", "r1", at="full_power") == hot
    # A GPU without a hop for an hour of the worker's event time (stopped reporting, or its
    # partition moved to another worker) loses its series; one hop later than its last, not yet.
    from types import SimpleNamespace

    def hop(ts: float) -> None:
        values = SimpleNamespace(headroom_c=[40.0], headroom_at_tdp_c=[20.0], drift_c_per_day=[0.0],
                                 util_pct=[90.0])
        M.observe_gpu_headroom([("n3", 0)], [("r3", "s1")], [ts], values)

    hop(last + 600)
    assert gauge("fleetwise_gpu_last_hop_timestamp_seconds", "n1", "r1") is not None
    hop(last + 3 * 3600)
    assert gauge("fleetwise_gpu_last_hop_timestamp_seconds", "n1", "r1") is None
    assert gauge("fleetwise_gpu_thermal_headroom_celsius", "n1", "r1", at="full_power") is None
    assert gauge("fleetwise_gpu_thermal_headroom_celsius", "n3", "r3", at="now") == 40.0


def test_replay_cli_writes_trends_and_draws_them_in_the_report(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from fleetwise.cli import app
    from fleetwise.sim import FleetSimulator, SimConfig, write_trace

    sim = FleetSimulator(SimConfig(gpus="h100-sxm:16,a100-sxm-80gb:16", days=0.5, seed=5))
    trace = tmp_path / "t.jsonl.gz"
    write_trace(sim, trace)
    inventory = tmp_path / "inv.jsonl"
    inventory.write_text("".join(json.dumps(inv) + "\n" for inv in sim.inventory()))
    racks = {inv["rack"] for inv in sim.inventory()}
    sites = {inv["site"] for inv in sim.inventory()}
    out = CliRunner().invoke(app, ["replay", str(trace), "--inventory", str(inventory), "--out",
                                   str(tmp_path / "d.jsonl"), "--trends", str(tmp_path / "tr.jsonl"),
                                   "--report", str(tmp_path / "r.html"), "--json"])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in (tmp_path / "tr.jsonl").read_text().splitlines()]
    assert {r["name"] for r in rows if r["scope"] == "rack"} == racks
    assert {r["name"] for r in rows if r["scope"] == "site"} == sites
    hours = sorted({r["hour_ts"] for r in rows})
    assert len(hours) in (12, 13) and all(b - a == 3600.0 for a, b in zip(hours, hours[1:], strict=False))
    assert sum(r["gpus"] for r in rows if r["scope"] == "site" and r["hour_ts"] == hours[3]) == 32
    html = (tmp_path / "r.html").read_text()
    assert "Thermal headroom and utilisation per site and rack" in html
    assert all(f"<td>{rack}</td>" in html for rack in racks)
