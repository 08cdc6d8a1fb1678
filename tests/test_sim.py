"""Fleet simulator: determinism, record contracts, and the physics/statistics the predictors rely on."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fleetwise.schemas import GpuSample, NodeInventory, TrainingStep
from fleetwise.sim import FleetSimulator, SimConfig, SimConfigError, write_labels, write_trace
from fleetwise.sim.bundled import demo_config
from fleetwise.sim.fleet import SW_THERMAL_C

P = "DCGM_FI_DEV_"
HOUR = 3600.0
COUNTERS = (
    "TOTAL_ENERGY_CONSUMPTION",
    "POWER_VIOLATION",
    "THERMAL_VIOLATION",
    "PCIE_REPLAY_COUNTER",
    "ECC_SBE_VOL_TOTAL",
    "ECC_DBE_VOL_TOTAL",
    "ECC_SBE_AGG_TOTAL",
    "ECC_DBE_AGG_TOTAL",
    "CORRECTABLE_REMAPPED_ROWS",
    "UNCORRECTABLE_REMAPPED_ROWS",
    "RETIRED_SBE",
    "RETIRED_DBE",
    "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)


class Trace:
    """One simulator run held in memory, indexed for the checks below."""

    def __init__(self, config: SimConfig) -> None:
        self.sim = FleetSimulator(config)
        self.labels = self.sim.labels()
        self.samples: dict[tuple[str, int], list[dict]] = defaultdict(list)
        self.steps: dict[str, list[dict]] = defaultdict(list)
        self.tick_ts: list[float] = []
        for tick in self.sim.ticks():
            self.tick_ts.append(tick.ts)
            for s in tick.samples:
                self.samples[(s["node"], s["gpu"])].append(s)
            for r in tick.steps:
                self.steps[r["job"]].append(r)

    def of(self, kind: str, **match: object) -> list[dict]:
        return [r for r in self.labels if r["kind"] == kind and all(r.get(k) == v for k, v in match.items())]

    def series(self, node: str, gpu: int, key: str, t0: float = -np.inf, t1: float = np.inf) -> np.ndarray:
        return np.array(
            [
                s["metrics"][key]
                for s in self.samples[(node, gpu)]
                if t0 <= s["ts"] < t1 and s["metrics"].get(key) is not None
            ],
            dtype=float,
        )


def increase(values: np.ndarray) -> float:
    """Growth of a cumulative counter across resets (like Prometheus increase())."""
    if len(values) < 2:
        return 0.0
    d = np.diff(values)
    return float(np.where(d >= 0, d, values[1:]).sum())


def small(**kw: object) -> SimConfig:
    base = {"gpus": "h100-sxm:16,a100-sxm-80gb:16", "days": 1.0, "seed": 11}
    base.update(kw)
    return SimConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mixed() -> Trace:
    """Two days of a mixed fleet with a raised failure rate: every class shows up."""
    return Trace(
        SimConfig(
            gpus="h100-sxm:24,a100-sxm-80gb:16,v100-sxm2-32gb:8",
            days=2.0,
            seed=5,
            failure_rate_per_1000_gpu_days=250.0,
            straggler_rate_per_1000_gpu_days=80.0,
        )
    )


@pytest.fixture(scope="module")
def slowdowns() -> Trace:
    """A day with many stragglers and job-wide slowdowns and no failures."""
    return Trace(
        SimConfig(
            gpus="h100-sxm:16,a100-sxm-80gb:16",
            days=1.0,
            seed=9,
            failure_rate_per_1000_gpu_days=0.0,
            straggler_rate_per_1000_gpu_days=300.0,
            job_slowdown_rate_per_1000_job_hours=300.0,
        )
    )


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- determinism and contracts -------------------------------------------------------------------
def test_same_seed_same_bytes_and_different_seed_differs(tmp_path: Path) -> None:
    cfg = dict(gpus="h100-sxm:8,b200:8", days=0.1, failure_rate_per_1000_gpu_days=50.0)
    paths = []
    for i, seed in enumerate((3, 3, 4)):
        path = tmp_path / f"t{i}.jsonl.gz"
        counts = write_trace(FleetSimulator(SimConfig(seed=seed, **cfg)), path)
        assert counts["samples"] > 0 and counts["steps"] > 0
        paths.append(path)
    assert _sha(paths[0]) == _sha(paths[1])
    assert _sha(paths[0]) != _sha(paths[2])
    lab = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for path in lab:
        write_labels(FleetSimulator(SimConfig(seed=3, **cfg)), path)
    assert _sha(lab[0]) == _sha(lab[1])


def test_iterating_twice_gives_the_same_records() -> None:
    sim = FleetSimulator(small(days=0.3, failure_rate_per_1000_gpu_days=300.0, class_mix={"hbm_ecc": 1.0}))
    first = [(t.ts, t.samples, t.steps) for t in sim.ticks()]
    again = [(t.ts, t.samples, t.steps) for t in sim.ticks()]
    assert first == again
    assert (
        sim.labels()
        == FleetSimulator(
            small(days=0.3, failure_rate_per_1000_gpu_days=300.0, class_mix={"hbm_ecc": 1.0})
        ).labels()
    )


def test_trace_file_is_json_lines_in_ts_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    counts = write_trace(FleetSimulator(small(days=0.05)), path)
    lines = path.read_text().splitlines()
    assert len(lines) == counts["samples"] + counts["steps"]
    ts = [json.loads(line)["ts"] for line in lines]
    assert ts == sorted(ts)
    gz = tmp_path / "t.jsonl.gz"
    write_trace(FleetSimulator(small(days=0.05)), gz)
    assert gzip.decompress(gz.read_bytes()).decode().splitlines() == lines


def test_records_validate_against_schemas(mixed: Trace) -> None:
    n = 0
    for series in mixed.samples.values():
        for s in series[::7]:
            GpuSample.model_validate(s)
            n += 1
    for steps in mixed.steps.values():
        for r in steps[::7]:
            TrainingStep.model_validate(r)
    for inv in mixed.sim.inventory():
        NodeInventory.model_validate(inv)
    assert n > 1000
    assert sum(len(inv["gpus"]) for inv in mixed.sim.inventory()) == mixed.sim.n_gpus == 48


def test_sample_fields_follow_dcgm_and_the_generation(mixed: Trace) -> None:
    by_model = {}
    for series in mixed.samples.values():
        by_model.setdefault(series[0]["model"], series[0])
    assert set(by_model) == {"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla V100-SXM2-32GB"}
    # Ampere+ remap rows; Volta retires pages instead (REFERENCE.md telemetry table).
    assert P + "ROW_REMAP_PENDING" in by_model["NVIDIA H100 80GB HBM3"]["metrics"]
    assert P + "RETIRED_PENDING" in by_model["Tesla V100-SXM2-32GB"]["metrics"]
    assert P + "ROW_REMAP_PENDING" not in by_model["Tesla V100-SXM2-32GB"]["metrics"]
    for s in by_model.values():
        assert all(k.startswith(("DCGM_FI_DEV_", "DCGM_FI_PROF_")) for k in s["metrics"])
        assert s["uuid"].startswith("GPU-") and s["rack"] and s["site"]


def test_scrape_gaps_and_missing_keys_exist(mixed: Trace) -> None:
    n_ticks = len(mixed.tick_ts)
    gaps = sum(1 for series in mixed.samples.values() if len(series) < n_ticks)
    assert gaps > 0
    full = max(len(s["metrics"]) for series in mixed.samples.values() for s in series[:1])
    lacking = sum(
        1 for series in mixed.samples.values() for s in series if len(s["metrics"]) < full - 8
    ) + sum(
        1
        for series in mixed.samples.values()
        for s in series
        if s["metrics"].get(P + "MEMORY_TEMP", 0) > 1e18
    )
    assert lacking > 0


@pytest.mark.parametrize(
    "config",
    [
        SimConfig(gpus="h100-sxm:1", days=0.03),
        SimConfig(gpus="l40s:4,t4:4,h100-pcie:2", days=0.05, gpus_per_node=4, sites=1, nodes_per_rack=1),
        SimConfig(gpus="h100-sxm:8", days=0.01, sample_interval_s=10, step_record_interval_s=5),
        SimConfig(gpus="b200:8,h200:8", days=0.05, step_record_interval_s=300),
        SimConfig(gpus="gb200:8,rubin:8", days=0.02),
    ],
    ids=["one-gpu", "pcie-cards", "sub-tick-steps", "sparse-steps", "unreleased"],
)
def test_odd_fleets_and_intervals_give_valid_ordered_records(config: SimConfig) -> None:
    from fleetwise.catalog import lookup

    sim = FleetSimulator(config)
    last_step: dict[tuple[str, int], int] = {}
    n_samples = 0
    prev_ts = -np.inf
    for tick in sim.ticks():
        assert tick.ts > prev_ts
        for r in tick.steps:
            TrainingStep.model_validate(r)
            assert prev_ts < r["ts"] <= tick.ts
            key = (r["job"], r["rank"])
            assert r["step"] >= last_step.get(key, 0)
            last_step[key] = r["step"]
        for s in tick.samples:
            GpuSample.model_validate(s)
            lookup(s["model"])  # the NVML model name resolves through the catalog
        n_samples += len(tick.samples)
        prev_ts = tick.ts
    assert n_samples > 0 and last_step


def test_bad_config_is_rejected() -> None:
    with pytest.raises(SimConfigError, match="unknown GPU"):
        FleetSimulator(SimConfig(gpus="h900:8"))
    with pytest.raises(SimConfigError, match="NVIDIA only"):
        FleetSimulator(SimConfig(gpus="mi300x:8"))
    with pytest.raises(SimConfigError, match="days"):
        FleetSimulator(SimConfig(days=0))
    with pytest.raises(SimConfigError, match="count"):
        FleetSimulator(SimConfig(gpus="h100-sxm:0"))


# --- counters ----------------------------------------------------------------------------------------
def test_counters_monotone_except_at_labelled_resets(mixed: Trace) -> None:
    resets = defaultdict(list)
    for r in mixed.of("trap", type="counter_reset"):
        resets[r["node"]].append(r["ts"])
    drops = explained = 0
    for (node, _gpu), series in mixed.samples.items():
        for prev, cur in zip(series, series[1:], strict=False):
            for key in COUNTERS:
                a, b = prev["metrics"].get(P + key), cur["metrics"].get(P + key)
                if a is None or b is None or b >= a:
                    continue
                drops += 1
                rebooted = any(prev["ts"] < t <= cur["ts"] for t in resets[node])
                replaced = prev["uuid"] != cur["uuid"]
                assert rebooted or replaced, f"{node} {key} fell {a}->{b} at {cur['ts']} without a reset"
                explained += 1
    assert drops == explained and drops > 0  # resets happen and every one is labelled


def test_persistent_counters_survive_reboot_but_not_replacement(mixed: Trace) -> None:
    for (node, _gpu), series in mixed.samples.items():
        for prev, cur in zip(series, series[1:], strict=False):
            if prev["uuid"] != cur["uuid"]:
                assert cur["metrics"][P + "ECC_SBE_AGG_TOTAL"] == 0
                continue
            for key in ("ECC_SBE_AGG_TOTAL", "ECC_DBE_AGG_TOTAL"):
                assert cur["metrics"][P + key] >= prev["metrics"][P + key], (node, key)


# --- physics --------------------------------------------------------------------------------------------
def test_temperature_responds_to_power(mixed: Trace) -> None:
    corrs = []
    for series in mixed.samples.values():
        power = np.array([s["metrics"][P + "POWER_USAGE"] for s in series])
        temp = np.array([s["metrics"][P + "GPU_TEMP"] for s in series])
        if power.std() > 20:
            corrs.append(np.corrcoef(power, temp)[0, 1])
    assert len(corrs) > 20
    assert np.median(corrs) > 0.85


def test_power_capped_at_tdp_with_swpowercap_bit(mixed: Trace) -> None:
    tdp = {"NVIDIA H100 80GB HBM3": 700.0, "NVIDIA A100-SXM4-80GB": 400.0, "Tesla V100-SXM2-32GB": 300.0}
    capped = 0
    for series in mixed.samples.values():
        for s in series:
            m = s["metrics"]
            assert m[P + "POWER_USAGE"] <= tdp[s["model"]] * 1.05
            if m[P + "CLOCKS_EVENT_REASONS"] & 0x4 and not m[P + "CLOCKS_EVENT_REASONS"] & 0x60:
                capped += 1
                assert m[P + "POWER_USAGE"] > 0.9 * tdp[s["model"]]
    assert capped > 0


def test_hot_healthy_gpus_are_hot_and_do_not_fail(mixed: Trace) -> None:
    hot = mixed.of("trap", type="hot_healthy")
    assert hot
    failed = {(r["node"], r["gpu"]) for r in mixed.of("failure")}
    for r in hot:
        key = (r["node"], r["gpu"])
        assert key not in failed
        series = mixed.samples[key]
        peers = [v for (n, g), v in mixed.samples.items() if n == r["node"] and g != r["gpu"]]

        def busy_temp(ss: list[dict]) -> float:
            vals = [s["metrics"][P + "GPU_TEMP"] for s in ss if s["metrics"][P + "GPU_UTIL"] > 80]
            return float(np.mean(vals)) if vals else float("nan")

        mine = busy_temp(series)
        theirs = np.nanmedian([busy_temp(p) for p in peers])
        assert mine - theirs > 4.0, (r, mine, theirs)
        # Hot but below the thermal target: never throttles for heat.
        assert max(s["metrics"][P + "GPU_TEMP"] for s in series) < SW_THERMAL_C
        assert not any(s["metrics"][P + "CLOCKS_EVENT_REASONS"] & 0x60 for s in series)


def test_thermal_throttling_outside_labelled_windows_is_rare(mixed: Trace) -> None:
    windows = defaultdict(list)
    for r in mixed.of("straggler", cause="thermal"):
        windows[(r["node"], r["gpu"])].append((r["start_ts"], r["end_ts"]))
    for r in mixed.of("failure", **{"class": "thermal_interface"}):
        windows[(r["node"], r["gpu"])].append((r["precursor_start_ts"], r["ts"] + 1))
    busy = throttled = 0
    for key, series in mixed.samples.items():
        for s in series:
            if s["metrics"][P + "GPU_UTIL"] < 50:
                continue
            if any(a <= s["ts"] <= b + 120 for a, b in windows[key]):
                continue
            busy += 1
            throttled += bool(s["metrics"][P + "CLOCKS_EVENT_REASONS"] & 0x20)
    assert busy > 10000
    assert throttled / busy < 0.005


# --- failures and their precursors -----------------------------------------------------------------
def _class_trace(cls: str, seed: int = 2, days: float = 3.0) -> Trace:
    return Trace(
        SimConfig(
            gpus="h100-sxm:16,a100-sxm-80gb:16",
            days=days,
            seed=seed,
            failure_rate_per_1000_gpu_days=400.0,
            class_mix={cls: 1.0},
        )
    )


def _visible_warned(trace: Trace, start: float) -> list[dict]:
    return [r for r in trace.of("failure") if not r["abrupt"] and r["precursor_start_ts"] >= start + 6 * HOUR]


def test_failed_gpu_goes_silent_until_replaced_with_a_new_uuid(mixed: Trace) -> None:
    checked = 0
    for r in mixed.of("failure"):
        series = mixed.samples[(r["node"], r["gpu"])]
        after = [s for s in series if r["ts"] <= s["ts"]]
        dead = [s for s in after if s["ts"] < r["repair_ts"]]
        # At most the terminal sample (with its final XID) after the failure, before the repair.
        assert len(dead) <= 1
        if dead and r["final_xid"]:
            assert dead[0]["metrics"][P + "XID_ERRORS"] == r["final_xid"]
        back = [s for s in after if s["ts"] >= r["repair_ts"]]
        if back:
            assert back[0]["uuid"] != r["uuid"]
            assert back[0]["metrics"][P + "ECC_SBE_AGG_TOTAL"] == 0
        checked += 1
    assert checked >= 5


def test_all_failure_classes_and_abrupt_ones_occur(mixed: Trace) -> None:
    classes = {r["class"] for r in mixed.of("failure")}
    assert {"hbm_ecc", "off_bus"} <= classes
    assert any(r["abrupt"] for r in mixed.of("failure"))
    assert any(not r["abrupt"] for r in mixed.of("failure"))


def test_hbm_failures_are_preceded_by_rising_single_bit_rate() -> None:
    trace = _class_trace("hbm_ecc")
    start = trace.tick_ts[0]
    warned = _visible_warned(trace, start)
    assert len(warned) >= 3
    for r in warned:
        lead = r["ts"] - r["precursor_start_ts"]
        sbe = trace.series(r["node"], r["gpu"], P + "ECC_SBE_AGG_TOTAL")
        early = trace.series(
            r["node"],
            r["gpu"],
            P + "ECC_SBE_AGG_TOTAL",
            r["precursor_start_ts"],
            r["precursor_start_ts"] + 0.25 * lead,
        )
        late = trace.series(r["node"], r["gpu"], P + "ECC_SBE_AGG_TOTAL", r["ts"] - 0.25 * lead, r["ts"])
        assert len(sbe) and len(late) and len(early)
        assert increase(late) > 5 * max(1.0, increase(early)), r
        xids = set(trace.series(r["node"], r["gpu"], P + "XID_ERRORS", r["precursor_start_ts"], r["ts"]))
        assert xids & {63, 64, 92}, (r, xids)
    # Abrupt HBM failures: nothing climbs before them.
    for r in trace.of("failure", abrupt=True):
        before = trace.series(r["node"], r["gpu"], P + "ECC_SBE_AGG_TOTAL", r["ts"] - 12 * HOUR, r["ts"])
        if len(before) > 100:
            assert increase(before) <= 3


def test_nvlink_failures_show_crc_climb_and_sympathetic_xid74_on_peers() -> None:
    trace = _class_trace("nvlink", seed=4)
    warned = _visible_warned(trace, trace.tick_ts[0] - 5 * HOUR)
    assert warned
    for r in warned:
        crc = trace.series(
            r["node"], r["gpu"], P + "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", r["precursor_start_ts"], r["ts"]
        )
        assert increase(crc) >= 10
    sym = [s for s in trace.of("trap", type="sympathetic_xid74") if s["origin_failure"]]
    assert sym
    for s in sym:
        xids = trace.series(s["node"], s["gpu"], P + "XID_ERRORS", s["ts"], s["ts"] + 61)
        assert 74 in set(xids) or not len(xids)


def test_off_bus_is_mostly_abrupt_and_pcie_first_shows_replays() -> None:
    trace = _class_trace("off_bus", seed=6)
    fails = trace.of("failure")
    assert len(fails) >= 8
    assert sum(r["abrupt"] for r in fails) > len(fails) / 2
    for r in fails:
        assert r["final_xid"] == 79
        if not r["abrupt"] and r["precursor_start_ts"] > trace.tick_ts[0]:
            rep = trace.series(
                r["node"], r["gpu"], P + "PCIE_REPLAY_COUNTER", r["precursor_start_ts"], r["ts"]
            )
            assert increase(rep) >= 3, r


def test_thermal_interface_creeps_then_throttles_as_a_straggler() -> None:
    trace = Trace(
        SimConfig(
            gpus="h100-sxm:64",
            days=4.0,
            seed=8,
            failure_rate_per_1000_gpu_days=60.0,
            class_mix={"thermal_interface": 1.0},
        )
    )
    fails = [r for r in trace.of("failure") if r["precursor_start_ts"] > trace.tick_ts[0]]
    assert fails
    crept = throttled = 0
    for r in fails:
        series = [s for s in trace.samples[(r["node"], r["gpu"])] if s["ts"] < r["ts"]]
        busy = [s for s in series if s["metrics"][P + "GPU_UTIL"] > 80 and s["ts"] >= r["precursor_start_ts"]]
        lead = r["throttle_start_ts"] - r["precursor_start_ts"]

        # Temperature rise per watt (what a predictor can estimate) creeps up over the days.
        def rth(ss: list[dict]) -> float:
            return float(
                np.median([s["metrics"][P + "GPU_TEMP"] / s["metrics"][P + "POWER_USAGE"] for s in ss])
            )

        early = [s for s in busy if s["ts"] < r["precursor_start_ts"] + 0.3 * lead]
        late = [s for s in busy if r["throttle_start_ts"] - 0.3 * lead <= s["ts"] < r["throttle_start_ts"]]
        if len(early) > 30 and len(late) > 30:
            assert rth(late) > 1.1 * rth(early), r
            crept += 1
        hot = [s for s in busy if s["ts"] >= r["throttle_start_ts"] + 120]
        for s in hot:
            assert s["metrics"][P + "CLOCKS_EVENT_REASONS"] & 0x20, s
        if hot:  # held at the thermal target (first-order lag: the first busy minute is cooler)
            assert np.median([s["metrics"][P + "GPU_TEMP"] for s in hot]) >= SW_THERMAL_C - 1
        throttled += bool(hot)
    assert crept >= 1 and throttled >= 1
    assert trace.of("straggler", cause="thermal")


# --- traps -------------------------------------------------------------------------------------------------
def test_application_xids_outnumber_hardware_failures(mixed: Trace) -> None:
    app = mixed.of("trap", type="app_xid")
    assert len(app) > 2 * len(mixed.of("failure"))
    seen = 0
    for r in app[:50]:
        xids = mixed.series(r["node"], r["gpu"], P + "XID_ERRORS", r["ts"], r["ts"] + 61)
        seen += r["xid"] in set(xids)
    assert seen >= 0.8 * min(50, len(app))


@pytest.mark.parametrize("mode", ["last", "interval"])
def test_xid_field_is_last_seen_or_per_interval(mode: str) -> None:
    trace = Trace(small(days=0.5, app_xid_rate_per_1000_gpu_days=3000.0, xid_field=mode))
    resets = defaultdict(list)
    for r in trace.of("trap", type="counter_reset"):
        resets[r["node"]].append(r["ts"])
    checked = 0
    for r in trace.of("trap", type="app_xid")[:40]:
        series = [s for s in trace.samples[(r["node"], r["gpu"])] if s["ts"] >= r["ts"]][:3]
        if len(series) < 3 or series[0]["metrics"][P + "XID_ERRORS"] != r["xid"]:
            continue
        later = series[2]["metrics"][P + "XID_ERRORS"]
        if mode == "interval":
            assert later in (0, 45) or later in {
                x["xid"] for x in trace.of("trap", node=r["node"], gpu=r["gpu"])
            }
        elif not any(series[0]["ts"] < t <= series[2]["ts"] for t in resets[r["node"]]):
            assert later != 0  # sticky until the next XID or a reboot
        checked += 1
    assert checked >= 10


def test_benign_sbe_bursts_end_in_one_remap_and_no_failure(mixed: Trace) -> None:
    bursts = mixed.of("trap", type="benign_sbe_burst")
    assert bursts
    failed = {(r["node"], r["gpu"]) for r in mixed.of("failure")}
    for b in bursts:
        assert (b["node"], b["gpu"]) not in failed
        series = mixed.samples[(b["node"], b["gpu"])]
        before = [s for s in series if s["ts"] < b["ts"]]
        after = [s for s in series if s["ts"] > b["end_ts"] + 120]
        if not before or not after or after[0]["uuid"] != before[-1]["uuid"]:
            continue
        m0, m1 = before[-1]["metrics"], after[0]["metrics"]
        remap = P + ("CORRECTABLE_REMAPPED_ROWS" if P + "CORRECTABLE_REMAPPED_ROWS" in m0 else "RETIRED_SBE")
        assert m1[remap] - m0[remap] == 1
        assert m1[P + "ECC_SBE_AGG_TOTAL"] > m0[P + "ECC_SBE_AGG_TOTAL"]


def test_lemons_are_labelled_and_carry_failure_share() -> None:
    trace_cfg = SimConfig(gpus="h100-sxm:400", days=20.0, failure_rate_per_1000_gpu_days=20.0, seed=1)
    sim = FleetSimulator(trace_cfg)  # schedule only: no ticks needed
    labels = sim.labels()
    lemons = [r for r in labels if r["kind"] == "lemon"]
    fails = [r for r in labels if r["kind"] == "failure"]
    assert len(lemons) == 12 and len(fails) > 80
    lemon_share = sum(r["lemon"] for r in fails) / len(fails)
    assert lemon_share > 0.2  # 3% of GPUs carry a large share of failures (Titan)


def test_hotter_locations_fail_more() -> None:
    sim = FleetSimulator(
        SimConfig(gpus="h100-sxm:1024", days=30.0, failure_rate_per_1000_gpu_days=20.0, seed=4)
    )
    fleet = sim.fleet
    hot = np.isin(fleet.gpu_rack, fleet.hot_racks) & ~fleet.lemon
    cool = ~np.isin(fleet.gpu_rack, fleet.hot_racks) & ~fleet.lemon & ~fleet.hot_healthy
    index = {(n.name, i): g for n in fleet.nodes for i, g in enumerate(n.gpus)}
    failed = np.zeros(fleet.n_gpus)
    for r in sim.labels():
        if r["kind"] == "failure":
            failed[index[(r["node"], r["gpu"])]] += 1
    assert hot.sum() >= 32 and failed.sum() > 400
    # Hot-spot racks run 3-6 C warmer at the inlet: x2 per 10 C -> ~1.2-1.5x the failure rate.
    assert failed[hot].mean() > 1.1 * failed[cool].mean()


def test_precursor_lead_times_follow_the_documented_mix() -> None:
    sim = FleetSimulator(
        SimConfig(gpus="h100-sxm:1024", days=30.0, failure_rate_per_1000_gpu_days=30.0, seed=6)
    )
    fails = [r for r in sim.labels() if r["kind"] == "failure"]
    lead_h = {
        cls: np.array(
            [
                (r["ts"] - r["precursor_start_ts"]) / HOUR
                for r in fails
                if r["class"] == cls and not r["abrupt"]
            ]
        )
        for cls in ("hbm_ecc", "thermal_interface", "nvlink", "off_bus", "gsp")
    }
    assert (lead_h["hbm_ecc"] >= 18).mean() > 0.65
    assert (lead_h["thermal_interface"] >= 18).all()
    assert np.median(lead_h["nvlink"]) < 6 and np.median(lead_h["off_bus"]) < 6
    assert (lead_h["gsp"] <= 0.5).all()
    abrupt = {
        c: np.mean([r["abrupt"] for r in fails if r["class"] == c]) for c in ("off_bus", "silent", "hbm_ecc")
    }
    assert abrupt["off_bus"] > 0.6 and abrupt["silent"] == 1.0 and abrupt["hbm_ecc"] < 0.3


# --- steps and stragglers ---------------------------------------------------------------------------------
def _ratio_in_window(trace: Trace, r: dict) -> tuple[float, float]:
    """Straggler rank's compute_s over the median of ranks of the same model, inside / outside its window."""
    inside, outside = [], []
    by_ts = defaultdict(list)
    for rec in trace.steps[r["job"]]:
        by_ts[rec["ts"]].append(rec)
    for ts, recs in by_ts.items():
        mine = [x for x in recs if x["rank"] == r["rank"]]
        peers = [
            x["compute_s"] / x["samples"] for x in recs if x["model"] == r["model"] and x["rank"] != r["rank"]
        ]
        if not mine or not peers:
            continue
        ratio = mine[0]["compute_s"] / mine[0]["samples"] / float(np.median(peers))
        if r["start_ts"] + 60 < ts < r["end_ts"]:
            inside.append(ratio)
        elif not r["start_ts"] - 60 <= ts <= r["end_ts"] + 60:
            outside.append(ratio)
    return (
        float(np.median(inside)) if inside else float("nan"),
        float(np.median(outside)) if len(outside) >= 5 else 1.0,
    )


def test_straggler_rank_compute_slower_by_its_factor(slowdowns: Trace) -> None:
    checked = 0
    for r in slowdowns.of("straggler"):
        inside, outside = _ratio_in_window(slowdowns, r)
        if np.isnan(inside):
            continue
        assert inside == pytest.approx(1.0 / r["factor"], rel=0.04), r
        assert outside == pytest.approx(1.0, abs=0.03)
        checked += 1
    assert checked >= 3


def test_step_records_between_ticks_are_slowed_exactly_inside_the_label() -> None:
    # Step records every 20 s, telemetry ticks every 60 s: a record taken between two ticks is
    # on one side of a straggler's start or end, and must be slowed only on the inside (a record
    # slowed before its label starts reads as a false alarm to any scorer).
    trace = Trace(small(days=0.5, seed=9, failure_rate_per_1000_gpu_days=0.0,
                        straggler_rate_per_1000_gpu_days=600.0, step_record_interval_s=20.0))
    before = at_start = 0
    for r in trace.of("straggler"):
        if r["factor"] > 0.9:
            continue
        for step_ts, rows in _groups(trace.steps.get(r["job"], [])).items():
            mine = [x for x in rows if x["rank"] == r["rank"]]
            peers = [x["compute_s"] / x["samples"] for x in rows
                     if x["rank"] != r["rank"] and x["model"] == (mine[0]["model"] if mine else None)]
            if not mine or len(peers) < 2:
                continue
            slowed = mine[0]["compute_s"] / mine[0]["samples"] / float(np.median(peers)) > 1.05
            if r["start_ts"] - 60 <= step_ts < r["start_ts"] or r["end_ts"] <= step_ts < r["end_ts"] + 60:
                before += slowed
            elif r["start_ts"] <= step_ts < r["start_ts"] + 60 or r["end_ts"] - 60 <= step_ts < r["end_ts"]:
                at_start += 1
                assert slowed, (r, step_ts)
    assert before == 0 and at_start >= 20


def _groups(steps: list[dict]) -> dict[float, list[dict]]:
    out: dict[float, list[dict]] = {}
    for x in steps:
        out.setdefault(x["ts"], []).append(x)
    return out


def test_step_records_follow_capability_and_split(mixed: Trace) -> None:
    for steps in list(mixed.steps.values())[:10]:
        first = [x for x in steps if x["ts"] == steps[0]["ts"]]
        assert len({x["step_time_s"] for x in first}) == 1  # synchronous: one step time
        assert all(x["compute_s"] <= x["step_time_s"] * 1.01 for x in first)
        assert sorted(x["rank"] for x in first) == list(range(len(first)))


def test_network_slowdown_raises_step_time_not_compute(slowdowns: Trace) -> None:
    checked = 0
    causes = set()
    for r in slowdowns.of("job_slowdown"):
        if any(s["job"] == r["job"] for s in slowdowns.of("straggler")):
            continue  # keep the comparison clean of a straggler raising the same job's step time
        steps = slowdowns.steps[r["job"]]
        rank0 = [x for x in steps if x["rank"] == 0]
        inside = [x for x in rank0 if r["start_ts"] + 60 < x["ts"] < r["end_ts"]]
        outside = [x for x in rank0 if not (r["start_ts"] - 60 < x["ts"] < r["end_ts"] + 60)]
        if len(inside) < 3 or len(outside) < 3:
            continue
        st = np.median([x["step_time_s"] for x in inside]) / np.median([x["step_time_s"] for x in outside])
        comp = np.median([x["compute_s"] for x in inside]) / np.median([x["compute_s"] for x in outside])
        assert st == pytest.approx(1.0 / r["factor"], rel=0.08), r
        if r["cause"] == "network":
            assert comp == pytest.approx(1.0, abs=0.05)
        else:
            assert comp == pytest.approx(1.0 / r["factor"], rel=0.08)
        checked += 1
        causes.add(r["cause"])
    assert checked >= 3 and causes == {"network", "input"}


# --- API and CLI ----------------------------------------------------------------------------------------
def test_node_ticks_only_that_node() -> None:
    sim = FleetSimulator(small(days=0.02))
    node = sim.inventory()[1]["node"]
    ticks = list(sim.node_ticks(node))
    assert ticks and all(s["node"] == node for t in ticks for s in t.samples + t.steps)
    assert sum(len(t.samples) for t in ticks) > 0


def test_demo_config_shows_failures_with_precursors_and_a_straggler() -> None:
    cfg = demo_config()
    sim = FleetSimulator(cfg)
    labels = sim.labels()
    assert 48 <= sim.n_gpus <= 80
    assert len({lab["model"] for lab in sim.inventory()[0]["gpus"]}) == 1
    assert len({inv["gpus"][0]["model"] for inv in sim.inventory()}) >= 3
    assert any(r["kind"] == "failure" and not r["abrupt"] for r in labels)
    assert any(r["kind"] == "straggler" for r in labels)


def test_cli_sim_writes_trace_labels_inventory(tmp_path: Path) -> None:
    from fleetwise.cli import app

    out, lab, inv = tmp_path / "t.jsonl.gz", tmp_path / "l.jsonl", tmp_path / "i.jsonl"
    res = CliRunner().invoke(
        app,
        [
            "sim",
            "--gpus",
            "h100-sxm:8",
            "--days",
            "0.05",
            "--seed",
            "2",
            "--out",
            str(out),
            "--labels",
            str(lab),
            "--inventory",
            str(inv),
            "--failure-rate",
            "5",
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["gpus"] == 8 and summary["samples"] > 0
    assert out.exists() and lab.exists() and len(inv.read_text().splitlines()) == 1
    bad = CliRunner().invoke(app, ["sim", "--gpus", "h900:8", "--out", str(out)])
    assert bad.exit_code == 2 and "unknown GPU" in bad.output
    bad = CliRunner().invoke(app, ["sim", "--out", str(tmp_path / "x.csv")])
    assert bad.exit_code == 2 and ".jsonl" in bad.output
