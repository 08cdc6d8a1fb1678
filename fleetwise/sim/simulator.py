"""FleetSimulator: renders the pre-scheduled fleet history into DCGM-style samples and step records.

The tick loop is numpy-vectorised over all GPUs; Python-level work per tick is proportional to
the number of running jobs and active effects (few), plus building one dict per record.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from fleetwise.sim.config import SimConfig, nvml_name
from fleetwise.sim.fleet import (
    DIURNAL_AMPLITUDE_C,
    HW_SLOWDOWN_C,
    IDLE_SM_CLOCK_MHZ,
    SW_THERMAL_C,
    Fleet,
)
from fleetwise.sim.schedule import DAY, HOUR, Schedule, Window

# Clock-event reason bits (DCGM_FI_DEV_CLOCKS_EVENT_REASONS / nvmlClocksEventReasons).
REASON_GPU_IDLE = 0x1
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8
REASON_SW_THERMAL = 0x20
REASON_HW_THERMAL = 0x40

DCGM_BLANK_INT64 = 9223372036854775794  # "no value" as dcgm-exporter prints it
THERMAL_TAU_S = 40.0  # first-order lag of die temperature to a power step (our calibration)
# Dynamic power ~ f * V^2 with V roughly tracking f: a clock share c costs ~c^2.5 of dynamic power
# (first-order DVFS rule; used to trade clocks for power under caps and thermal limits).
DVFS_EXPONENT = 2.5
STEP_NOISE = 0.015  # per-step compute jitter (1-2%)
BOOST_TEMP_COEF = 0.001  # clock share lost per C above 60 C
# Windows that change a job's step records: a rank's speed, or the job's input or network.
_STEP_WINDOWS = frozenset({"failslow", "thermal_throttle", "slow_input", "slow_network"})

P = "DCGM_FI_DEV_"
INT_KEYS_COMMON = (
    P + "GPU_TEMP",
    P + "MEMORY_TEMP",
    P + "SM_CLOCK",
    P + "MEM_CLOCK",
    P + "CLOCKS_EVENT_REASONS",
    P + "GPU_UTIL",
    P + "MEM_COPY_UTIL",
    P + "FB_USED",
    P + "FB_FREE",
    P + "XID_ERRORS",
    P + "TOTAL_ENERGY_CONSUMPTION",
    P + "POWER_VIOLATION",
    P + "THERMAL_VIOLATION",
    P + "PCIE_REPLAY_COUNTER",
    P + "ECC_SBE_VOL_TOTAL",
    P + "ECC_DBE_VOL_TOTAL",
    P + "ECC_SBE_AGG_TOTAL",
    P + "ECC_DBE_AGG_TOTAL",
)
INT_KEYS_REMAP = (
    P + "CORRECTABLE_REMAPPED_ROWS",
    P + "UNCORRECTABLE_REMAPPED_ROWS",
    P + "ROW_REMAP_FAILURE",
    P + "ROW_REMAP_PENDING",
)
INT_KEYS_RETIRED = (P + "RETIRED_SBE", P + "RETIRED_DBE", P + "RETIRED_PENDING")
INT_KEYS_NVLINK = (
    P + "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    P + "NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    P + "NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    P + "NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
)
FLOAT_KEYS = (
    P + "POWER_USAGE",
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
)
# Keys a scrape sometimes lacks (profiling fields and memory temperature drop out first).
DROPPABLE_KEYS = (
    P + "MEMORY_TEMP",
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    P + "MEM_COPY_UTIL",
    P + "FB_FREE",
)
# Counters that restart from zero when the node reboots (volatile / since-boot in DCGM).
VOLATILE = (
    "energy",
    "pviol",
    "tviol",
    "pcie",
    "sbe_vol",
    "dbe_vol",
    "nvl_flit",
    "nvl_data",
    "nvl_replay",
    "nvl_recovery",
)
# Persistent in the InfoROM: survive reboots, reset only when the board is replaced.
PERSISTENT = (
    "sbe_agg",
    "dbe_agg",
    "remap_corr",
    "remap_unc",
    "remap_fail",
    "remap_pending",
    "ret_sbe",
    "ret_dbe",
    "ret_pending",
)

# Background error rates per GPU-day (our calibration: most healthy GPUs log no SBE for weeks;
# lemons show chronic low-level errors, which is part of why they are lemons).
BG_PER_DAY = {
    "sbe": (0.05, 1.5),
    "pcie": (0.2, 4.0),
    "nvl_flit": (0.3, 6.0),
}


# Error counters a scrape may lack (`SimConfig.missing_counter_prob`).
COUNTER_KEYS = frozenset(
    (P + "PCIE_REPLAY_COUNTER", P + "ECC_SBE_VOL_TOTAL", P + "ECC_DBE_VOL_TOTAL", P + "ECC_SBE_AGG_TOTAL",
     P + "ECC_DBE_AGG_TOTAL", *INT_KEYS_NVLINK)
)


class Tick(NamedTuple):
    ts: float
    samples: list[dict]
    steps: list[dict]


class FleetSimulator:
    """A deterministic synthetic fleet: inventory, labels and a tick stream from one SimConfig."""

    def __init__(self, config: SimConfig) -> None:
        config.validate()
        self.config = config
        seeds = np.random.SeedSequence(config.seed).spawn(3)
        self.fleet = Fleet(config, np.random.default_rng(seeds[0]))
        self.schedule = Schedule(config, self.fleet, np.random.default_rng(seeds[1]))
        self._tick_seed = seeds[2]
        self.n_ticks = int(math.floor(config.days * DAY / config.sample_interval_s + 1e-9))
        self._add_precursor_windows()

    # --- public API --------------------------------------------------------------------------
    @property
    def n_gpus(self) -> int:
        return self.fleet.n_gpus

    def inventory(self) -> list[dict]:
        """NodeInventory dicts, one per node, as of the trace start."""
        return self.fleet.inventory(self.config.start_ts)

    def labels(self) -> list[dict]:
        """Ground truth known at construction: failures, stragglers, slowdowns, traps, lemons."""
        return [dict(r) for r in self.schedule.labels]

    def node_ticks(self, node: str) -> Iterator[Tick]:
        """Ticks restricted to one node's samples and step records."""
        if node not in {n.name for n in self.fleet.nodes}:
            raise KeyError(f"unknown node {node!r}")
        for tick in self.ticks():
            yield Tick(
                tick.ts,
                [s for s in tick.samples if s["node"] == node],
                [s for s in tick.steps if s["node"] == node],
            )

    # --- set-up ------------------------------------------------------------------------------
    def _add_precursor_windows(self) -> None:
        fleet = self.fleet
        extra: list[Window] = []
        for f in self.schedule.failures:
            if f.abrupt or f.precursor_start is None:
                continue
            data: dict = {
                "variant": f.variant,
                **{k: f.params[k] for k in ("base", "growth", "power") if k in f.params},
            }
            if f.cls == "thermal_interface":
                # Resistance creeps as r(x) = 1 + (m_end - 1) x^2; chosen so that at full load on an
                # average afternoon the die reaches the thermal target when throttling starts.
                g = f.gpu
                x_thr = 1.0 - f.params["throttle_s"] / (f.ts - f.precursor_start)
                hot_inlet = fleet.static_inlet[g] + DIURNAL_AMPLITUDE_C
                p_nom = 0.92 * fleet.tdp_w[g]
                m_thr = max(1.08, (SW_THERMAL_C - 1.0 - hot_inlet) / (p_nom * fleet.r_base[g]))
                data["m_end"] = 1.0 + (m_thr - 1.0) / max(x_thr, 0.3) ** f.params["power"]
            extra.append(Window(f.precursor_start, f.ts, "pre_" + f.cls, gpu=f.gpu, data=data))
        self.schedule.windows.extend(extra)
        self.schedule.windows.sort(key=lambda w: (w.t0, w.kind, w.gpu, w.job))

    # --- the tick loop -----------------------------------------------------------------------
    def ticks(self) -> Iterator[Tick]:  # noqa: C901 - one loop, kept together for speed
        """Yield Tick(ts, samples, steps) in event-time order; same seed, same output."""
        cfg, fleet, sched = self.config, self.fleet, self.schedule
        rng = np.random.default_rng(self._tick_seed)
        g_n = fleet.n_gpus
        dt = cfg.sample_interval_s
        alpha = 1.0 - math.exp(-dt / THERMAL_TAU_S)
        ctr = {k: np.zeros(g_n, dtype=np.int64) for k in VOLATILE + PERSISTENT}
        alive = np.ones(g_n, dtype=bool)
        uuids = list(fleet.uuids)
        temp = fleet.static_inlet + fleet.tdp_w * 0.1 * fleet.r_base
        activity = np.ones(g_n)
        bg = {k: fleet.bg_per_day[k] * dt / DAY for k in BG_PER_DAY}
        bg["nvl_flit"] = bg["nvl_flit"] * fleet.has_nvlink
        energy = self._initial_state(rng, ctr)
        last_xid = np.zeros(g_n, dtype=np.int64)
        sticky_xid = cfg.xid_field == "last"
        hbm_offset = 6.0  # HBM runs a few degrees above the die under load (our calibration)
        site_phase = fleet.site_phase_h[fleet.gpu_site]
        node_gpus = [np.array(n.gpus, dtype=np.int64) for n in fleet.nodes]
        node_names = [n.name for n in fleet.nodes]
        static = [
            (
                node_names[int(fleet.gpu_node[g])],
                int(fleet.gpu_local[g]),
                nvml_name(fleet.spec(g)),
                fleet.node_of(g).rack,
                fleet.node_of(g).site,
            )
            for g in range(g_n)
        ]
        groups = self._key_groups()
        job_names = [j.name for j in sched.jobs]
        # Per job, per rank: the fields of a step record that never change.
        rank_static = [
            [
                (
                    r,
                    int(g),
                    j.name,
                    static[int(g)][0],
                    static[int(g)][1],
                    int(j.micro_batch[r]),
                    int(j.samples[r]),
                    j.model_ids[r],
                )
                for r, g in enumerate(j.gpus)
            ]
            for j in sched.jobs
        ]
        jobs = sorted(range(len(sched.jobs)), key=lambda j: sched.jobs[j].start)
        job_ptr = 0
        active_jobs: list[int] = []
        job_steps = {}
        windows, events = sched.windows, sched.events
        w_ptr = ev_ptr = 0
        active: list[Window] = []
        step_iv = cfg.step_record_interval_s
        start = cfg.start_ts
        remap_clear_at: dict[int, float] = {}
        # One-shot effects that already happened in this iteration (windows stay immutable, so
        # iterating ticks() again gives the same records).
        fired: set[int] = set()
        # Domain randomisation draws (SimConfig knobs, off by default) come from their own
        # generator: a default config draws nothing from it, so its trace is unchanged.
        xrng = np.random.default_rng([cfg.seed, 16, 2])
        burst_p = {"pcie": cfg.pcie_burst_rate_per_gpu_day * dt / DAY,
                   "nvl_flit": cfg.nvl_burst_rate_per_gpu_day * dt / DAY * fleet.has_nvlink}
        reset_p = cfg.gpu_reset_rate_per_gpu_day * dt / DAY
        node_of_gpu = fleet.gpu_node
        node_size = np.bincount(node_of_gpu).astype(float)
        peer_load = np.zeros(g_n)  # other GPUs' mean power/TDP in the node, last tick

        prev_state: tuple[np.ndarray, dict[int, float], dict[int, float]] | None = None
        for k in range(self.n_ticks):
            ts = start + k * dt
            prev_ts = ts - dt
            xid = np.zeros(g_n, dtype=np.int64)
            dying: list[int] = []
            # ---- point events ----
            while ev_ptr < len(events) and events[ev_ptr].ts <= ts:
                ev = events[ev_ptr]
                ev_ptr += 1
                g = ev.gpu
                if ev.kind == "xid":
                    if alive[g] and xid[g] == 0:  # a hardware XID in the same interval wins
                        xid[g] = ev.code
                elif ev.kind == "xid74":
                    if alive[g]:
                        xid[g] = 74
                        ctr["nvl_flit"][g] += ev.data["crc"]
                        ctr["nvl_data"][g] += ev.data["crc"] // 4
                        ctr["nvl_replay"][g] += ev.data["crc"] // 2
                        ctr["nvl_recovery"][g] += 1
                elif ev.kind == "fail":
                    f = next(x for x in sched.failures if x.gpu == g and x.ts == ev.ts)
                    if f.cls == "silent":
                        alive[g] = False
                        continue
                    if f.cls == "hbm_ecc":
                        ctr["dbe_vol"][g] += 1
                        ctr["dbe_agg"][g] += 1
                        if fleet.has_remap[g]:
                            ctr["remap_unc"][g] += 1
                        else:
                            ctr["ret_dbe"][g] += 1
                    xid[g] = f.final_xid
                    dying.append(g)
                elif ev.kind == "repair":
                    alive[g] = True
                    uuids[g] = ev.data["uuid"]
                    for key in VOLATILE + PERSISTENT:
                        ctr[key][g] = 0
                    last_xid[g] = 0
                    energy[g] = 0.0
                    temp[g] = fleet.static_inlet[g]
                elif ev.kind == "reboot":
                    gs = node_gpus[ev.node]
                    for key in VOLATILE:
                        ctr[key][gs] = 0
                    last_xid[gs] = 0  # the exporter's field cache starts empty after a reboot
                    energy[gs] = 0.0
                    ctr["remap_pending"][gs] = 0  # a pending remap is applied at GPU reset
                    ctr["ret_pending"][gs] = 0
            # ---- windows ----
            while w_ptr < len(windows) and windows[w_ptr].t0 <= ts:
                active.append(windows[w_ptr])
                w_ptr += 1
            # Slowdown windows with an edge inside this tick: the step records taken between the
            # two ticks are on either side of that edge (below), not all on this tick's side.
            edges = [w for w in active if w.kind in _STEP_WINDOWS and (w.t0 > prev_ts or w.t1 <= ts)]
            if active:
                active = [w for w in active if w.t1 > ts]
            speed = np.ones(g_n)
            forced = np.ones(g_n)
            r_mult = np.ones(g_n)
            silent_node = np.zeros(len(fleet.nodes), dtype=bool)
            down_node = np.zeros(len(fleet.nodes), dtype=bool)
            job_net: dict[int, float] = {}
            job_input: dict[int, float] = {}
            job_drop: dict[int, float] = {}
            for w in active:
                kind, g = w.kind, w.gpu
                if kind == "failslow":
                    speed[g] *= w.factor
                elif kind == "thermal_throttle":
                    forced[g] = min(forced[g], w.factor)
                elif kind == "slow_network":
                    job_net[w.job] = min(job_net.get(w.job, 1.0), w.factor)
                elif kind == "slow_input":
                    job_input[w.job] = min(job_input.get(w.job, 1.0), w.factor)
                elif kind == "util_drop":
                    job_drop[w.job] = w.factor
                elif kind == "scrape_gap":
                    silent_node[w.data["node"]] = True
                elif kind == "node_down":
                    down_node[w.data["node"]] = True
                elif not alive[g]:
                    continue
                elif kind == "benign_sbe":
                    n = int(rng.poisson(w.data["total"] * dt / (w.t1 - w.t0)))
                    ctr["sbe_vol"][g] += n
                    ctr["sbe_agg"][g] += n
                    if ts + dt >= w.t1 and id(w) not in fired:
                        # The burst ends in one correctable remap (or one retired page) that works.
                        fired.add(id(w))
                        if fleet.has_remap[g]:
                            ctr["remap_corr"][g] += 1
                            ctr["remap_pending"][g] = 1
                        else:
                            ctr["ret_sbe"][g] += 1
                            ctr["ret_pending"][g] = 1
                        remap_clear_at[g] = ts + float(rng.uniform(0.5, 3.0)) * HOUR
                        xid[g] = max(xid[g], 63)
                elif kind.startswith("pre_"):
                    x = (ts - w.t0) / (w.t1 - w.t0)
                    self._precursor_tick(rng, w, x, dt, ctr, xid, r_mult, fired)
            for g, t_clear in list(remap_clear_at.items()):
                if ts >= t_clear:
                    ctr["remap_pending"][g] = 0  # operator reset applied the remap: it succeeded
                    ctr["ret_pending"][g] = 0
                    del remap_clear_at[g]
            # ---- jobs: load per GPU ----
            while job_ptr < len(jobs) and sched.jobs[jobs[job_ptr]].start <= ts:
                active_jobs.append(jobs[job_ptr])
                job_ptr += 1
            active_jobs = [j for j in active_jobs if sched.jobs[j].end > ts]
            util = np.zeros(g_n)
            intensity = np.zeros(g_n)
            mem_copy = np.zeros(g_n)
            fb_frac = np.zeros(g_n)
            tensor = np.zeros(g_n)
            gpu_job = np.full(g_n, -1, dtype=np.int64)
            gpu_rank = np.zeros(g_n, dtype=np.int64)
            paused: dict[int, bool] = {}
            for ji in active_jobs:
                job = sched.jobs[ji]
                gs = job.gpus
                in_ckpt = ((ts - job.start - job.ckpt_phase) % job.ckpt_period) < job.ckpt_dur
                u = job.util
                if in_ckpt:
                    u = 8.0  # writing a checkpoint: the GPUs mostly wait on storage
                elif ji in job_drop:
                    u = job.util * job_drop[ji]
                elif ji in job_input:
                    u = job.util * job_input[ji]  # starved by the input pipeline
                paused[ji] = in_ckpt or ji in job_drop
                util[gs] = u
                intensity[gs] = job.intensity
                mem_copy[gs] = job.mem_copy_util * u / 100.0
                fb_frac[gs] = job.fb_frac
                tensor[gs] = job.tensor_ratio
                gpu_job[gs] = ji
                gpu_rank[gs] = np.arange(job.ranks)
            gpu_down = down_node[fleet.gpu_node]
            util[gpu_down] = 0.0
            load = util / 100.0
            # ---- physics ----
            noise = rng.standard_normal((6, g_n))
            hour = (ts % DAY) / HOUR
            inlet = (
                fleet.static_inlet
                + DIURNAL_AMPLITUDE_C * np.cos(2.0 * np.pi * (hour - site_phase) / 24.0)
                + 0.2 * noise[0]
            )
            if cfg.neighbour_heat_c > 0:
                inlet = inlet + cfg.neighbour_heat_c * peer_load
            tdp, idle = fleet.tdp_w, fleet.idle_w
            demand = idle + (tdp - idle) * intensity * load * (0.7 + 0.3 * activity)
            capped = demand > tdp
            power = np.minimum(demand, tdp)
            clock = np.where(
                capped, ((tdp - idle) / np.maximum(demand - idle, 1e-9)) ** (1 / DVFS_EXPONENT), 1.0
            )
            r_eff = fleet.r_base * r_mult
            t_ss = inlet + power * r_eff
            over = t_ss > SW_THERMAL_C
            allowed = np.maximum((SW_THERMAL_C - inlet) / r_eff, idle)
            ratio = np.clip((allowed - idle) / np.maximum(power - idle, 1e-9), 0.3, 1.0)
            clock = np.where(over, clock * ratio ** (1 / DVFS_EXPONENT), clock)
            power = np.where(over, np.minimum(power, allowed), power)
            t_ss = np.where(over, SW_THERMAL_C + 0.3 * np.abs(noise[1]), t_ss)
            hold = (forced < 1.0) & (load > 0.5)
            if hold.any():
                # The thermal regulator holds the die at its target by shedding clocks.
                clock = np.where(hold, np.minimum(clock, forced), clock)
                power = np.where(hold, idle + (power - idle) * forced**DVFS_EXPONENT, power)
                t_ss = np.where(hold, SW_THERMAL_C + 1.2 + 0.8 * noise[1], t_ss)
            temp = temp + alpha * (t_ss - temp) + cfg.temp_noise_c * noise[2]
            # GPU Boost trims clocks as the die warms even below the thermal target: ~0.1% per C
            # above 60 C (our calibration; Llama 3 saw a 1-2% diurnal throughput swing from heat).
            clock = clock * (1.0 - BOOST_TEMP_COEF * np.clip(temp - 60.0, 0.0, None))
            thermal_limited = over | hold
            mem_temp = temp + hbm_offset * (0.3 + 0.7 * load) + 0.3 * noise[3]
            busy = load > 0.02
            sm_clock = np.where(
                busy, fleet.max_sm_clock * clock * (1.0 + 0.003 * noise[4]), IDLE_SM_CLOCK_MHZ
            )
            reasons = (
                np.where(~busy, REASON_GPU_IDLE, 0)
                | np.where(capped, REASON_SW_POWER_CAP, 0)
                | np.where(thermal_limited & busy, REASON_SW_THERMAL, 0)
                | np.where(temp > HW_SLOWDOWN_C, REASON_HW_THERMAL | REASON_HW_SLOWDOWN, 0)
            )
            power_meas = power * (1.0 + cfg.power_noise * noise[5])
            if cfg.neighbour_heat_c > 0:
                frac = power / tdp
                node_sum = np.bincount(node_of_gpu, weights=frac, minlength=len(node_size))
                peer_load = (node_sum[node_of_gpu] - frac) / np.maximum(node_size[node_of_gpu] - 1.0, 1.0)
            energy += power_meas * dt * 1000.0
            ctr["pviol"] += (capped * dt * 1e9).astype(np.int64)
            ctr["tviol"] += ((thermal_limited & busy) * dt * 1e9).astype(np.int64)
            for key in ("sbe", "pcie", "nvl_flit"):
                hits = rng.poisson(bg[key])
                if key == "sbe":
                    ctr["sbe_vol"] += hits
                    ctr["sbe_agg"] += hits
                elif key == "pcie":
                    ctr["pcie"] += hits
                else:
                    ctr["nvl_flit"] += hits
                    ctr["nvl_replay"] += hits // 2
            for key, p_burst in burst_p.items():
                if np.any(p_burst > 0):
                    hit = np.flatnonzero((xrng.random(g_n) < p_burst) & alive)
                    if len(hit):
                        n = xrng.geometric(1.0 / max(cfg.link_burst_size, 1.0), len(hit))
                        ctr["pcie" if key == "pcie" else "nvl_flit"][hit] += n
                        if key != "pcie":
                            ctr["nvl_replay"][hit] += n // 2
            if reset_p > 0:
                hit = np.flatnonzero(xrng.random(g_n) < reset_p)
                for key in VOLATILE:
                    if key != "energy":
                        ctr[key][hit] = 0
            # ---- steps ----
            steps: list[dict] = []
            m0 = math.ceil((prev_ts - start) / step_iv + 1e-9)
            m1 = math.floor((ts - start) / step_iv + 1e-9)
            record_times = [start + m * step_iv for m in range(m0, m1 + 1)] if k else [start]
            gpu_speed = clock * speed
            for ji in active_jobs:
                job = sched.jobs[ji]
                gs = job.gpus
                f_in = job_input.get(ji, 1.0)
                f_net = job_net.get(ji, 1.0)
                rank_speed = gpu_speed[gs] * f_in
                nominal = job.samples * job.work_tflop_per_sample / (job.capability * rank_speed)
                base_step = float(nominal.max()) + job.comm_s
                step_time = base_step / f_net
                activity[gs] = nominal / step_time
                if ji not in job_steps:
                    job_steps[ji] = max(0.0, (ts - job.start)) / step_time
                if paused.get(ji):
                    continue
                counter0 = job_steps[ji]
                job_steps[ji] = counter0 + dt / step_time
                for t_rec in record_times:
                    rec_nominal, rec_net = nominal, f_net
                    if edges and t_rec < ts:
                        rec_nominal, rec_net = self._before_edges(
                            edges, t_rec, ts, ji, gs, nominal, f_net, gpu_speed, f_in, prev_state)
                    comp = rec_nominal * np.exp(STEP_NOISE * rng.standard_normal(job.ranks))
                    comm = job.comm_s * (1.0 + 0.02 * abs(rng.standard_normal()))
                    st = (float(comp.max()) + comm) / rec_net
                    step_no = int(counter0 + (t_rec - prev_ts) / step_time)
                    comp_l = np.round(comp, 4).tolist()
                    st_r = round(st, 4)
                    steps.extend(
                        {
                            "ts": t_rec,
                            "job": name,
                            "rank": r,
                            "node": node,
                            "gpu": local,
                            "step": step_no,
                            "step_time_s": st_r,
                            "compute_s": comp_l[r],
                            "micro_batch": mb,
                            "samples": n_samples,
                            "model": model_id,
                        }
                        for r, g, name, node, local, mb, n_samples, model_id in rank_static[ji]
                        if alive[g]
                    )
            activity[gpu_job < 0] = 1.0
            prev_state = (gpu_speed, job_input, job_net)
            # ---- samples ----
            last_xid = np.where(xid > 0, xid, last_xid)
            report = alive & ~silent_node[fleet.gpu_node] & ~gpu_down
            cols = {
                P + "GPU_TEMP": np.rint(temp + fleet.temp_offset if cfg.temp_offset_sd_c > 0 else temp),
                P + "MEMORY_TEMP": np.rint(mem_temp),
                P + "SM_CLOCK": np.rint(sm_clock),
                P + "MEM_CLOCK": fleet.mem_clock,
                P + "CLOCKS_EVENT_REASONS": reasons,
                P + "GPU_UTIL": np.where(busy, np.clip(np.rint(util + noise[4]), 0, 100), 0),
                P + "MEM_COPY_UTIL": np.where(busy, np.clip(np.rint(mem_copy + 2.0 * noise[5]), 0, 100), 0),
                P + "FB_USED": np.rint(fb_frac * fleet.memory_mib),
                P + "FB_FREE": np.rint(fleet.memory_mib * (1.0 - fb_frac - 0.0065)),
                P + "XID_ERRORS": last_xid if sticky_xid else xid,
                P + "TOTAL_ENERGY_CONSUMPTION": energy,
                P + "POWER_VIOLATION": ctr["pviol"],
                P + "THERMAL_VIOLATION": ctr["tviol"],
                P + "PCIE_REPLAY_COUNTER": ctr["pcie"],
                P + "ECC_SBE_VOL_TOTAL": ctr["sbe_vol"],
                P + "ECC_DBE_VOL_TOTAL": ctr["dbe_vol"],
                P + "ECC_SBE_AGG_TOTAL": ctr["sbe_agg"],
                P + "ECC_DBE_AGG_TOTAL": ctr["dbe_agg"],
                P + "CORRECTABLE_REMAPPED_ROWS": ctr["remap_corr"],
                P + "UNCORRECTABLE_REMAPPED_ROWS": ctr["remap_unc"],
                P + "ROW_REMAP_FAILURE": ctr["remap_fail"],
                P + "ROW_REMAP_PENDING": ctr["remap_pending"],
                P + "RETIRED_SBE": ctr["ret_sbe"],
                P + "RETIRED_DBE": ctr["ret_dbe"],
                P + "RETIRED_PENDING": ctr["ret_pending"],
                P + "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": ctr["nvl_flit"],
                P + "NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": ctr["nvl_data"],
                P + "NVLINK_REPLAY_ERROR_COUNT_TOTAL": ctr["nvl_replay"],
                P + "NVLINK_RECOVERY_ERROR_COUNT_TOTAL": ctr["nvl_recovery"],
            }
            fcols = {
                P + "POWER_USAGE": np.round(power_meas, 3),
                "DCGM_FI_PROF_SM_ACTIVE": np.round(np.clip(load * activity * 0.92, 0, 1), 3),
                "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": np.round(
                    np.clip(load * activity * 0.92 * tensor, 0, 1), 3
                ),
                "DCGM_FI_PROF_DRAM_ACTIVE": np.round(np.clip(mem_copy / 100.0 * 0.8, 0, 1), 3),
            }
            samples: list[dict] = []
            for gidx, keys in groups:
                sel = gidx[report[gidx]]
                if not len(sel):
                    continue
                n_int = len(keys) - len(FLOAT_KEYS)
                imat = np.column_stack([cols[key][sel] for key in keys[:n_int]]).astype(np.int64).tolist()
                fmat = np.column_stack([fcols[key][sel] for key in FLOAT_KEYS]).tolist()
                sel_l = sel.tolist()
                start_i = len(samples)
                samples.extend(
                    {
                        "ts": ts,
                        "node": static[g][0],
                        "gpu": static[g][1],
                        "uuid": uuids[g],
                        "model": static[g][2],
                        "metrics": dict(zip(keys, irow + frow, strict=True)),
                        "rack": static[g][3],
                        "site": static[g][4],
                    }
                    for g, irow, frow in zip(sel_l, imat, fmat, strict=True)
                )
                on_job = np.nonzero(gpu_job[sel] >= 0)[0].tolist()
                if on_job:
                    jobs_sel = gpu_job[sel].tolist()
                    ranks_sel = gpu_rank[sel].tolist()
                    for i in on_job:
                        rec = samples[start_i + i]
                        rec["job"] = job_names[jobs_sel[i]]
                        rec["rank"] = ranks_sel[i]
            # Scrapes sometimes lack fields, or carry DCGM's blank sentinel.
            n_miss = int(rng.binomial(len(samples), cfg.missing_key_prob)) if samples else 0
            for pos in rng.choice(len(samples), size=n_miss, replace=False) if n_miss else ():
                metrics = samples[int(pos)]["metrics"]
                if rng.random() < 0.25 and P + "MEMORY_TEMP" in metrics:
                    metrics[P + "MEMORY_TEMP"] = DCGM_BLANK_INT64
                    continue
                for key in rng.choice(DROPPABLE_KEYS, size=int(rng.integers(1, 4)), replace=False):
                    metrics.pop(str(key), None)
            if samples and (cfg.dcgm_blank_prob > 0 or cfg.missing_counter_prob > 0):
                self._scrape_defects(xrng, samples)
            for g in dying:
                alive[g] = False
            yield Tick(ts, samples, steps)

    def _scrape_defects(self, xrng: np.random.Generator, samples: list[dict]) -> None:
        """Blank sentinels in any integer field, error counters missing from a scrape (knobs
        `dcgm_blank_prob`, `missing_counter_prob`)."""
        cfg = self.config
        for prob, blank in ((cfg.dcgm_blank_prob, True), (cfg.missing_counter_prob, False)):
            if prob <= 0:
                continue
            for pos in np.flatnonzero(xrng.random(len(samples)) < prob).tolist():
                metrics = samples[pos]["metrics"]
                pool = [k for k in metrics if (k not in FLOAT_KEYS) if blank or k in COUNTER_KEYS]
                if not pool:
                    continue
                for key in xrng.choice(pool, size=min(len(pool), int(xrng.integers(1, 4))), replace=False):
                    if blank:
                        metrics[str(key)] = DCGM_BLANK_INT64
                    else:
                        metrics.pop(str(key), None)

    def _initial_state(self, rng: np.random.Generator, ctr: dict[str, np.ndarray]) -> np.ndarray:
        """Counters as a fleet in service has them at the trace start; returns energy in mJ.

        Nodes have been up for days (since-boot counters are not zero) and boards in service for
        months (persistent ECC counts and the odd remapped row exist on healthy GPUs); a failure
        whose precursor began before the trace has already accumulated its errors.
        """
        fleet, cfg = self.fleet, self.config
        g_n = fleet.n_gpus
        uptime_d = rng.uniform(1.0, 60.0, len(fleet.nodes))[fleet.gpu_node]
        age_d = np.maximum(uptime_d, rng.uniform(60.0, 900.0, g_n))
        lemon = fleet.lemon
        for key in BG_PER_DAY:
            rate = fleet.bg_per_day[key]
            if key == "nvl_flit":
                rate = rate * fleet.has_nvlink
            since_boot = rng.poisson(rate * uptime_d)
            if key == "sbe":
                ctr["sbe_vol"] += since_boot
                ctr["sbe_agg"] += since_boot + rng.poisson(rate * (age_d - uptime_d))
            elif key == "pcie":
                ctr["pcie"] += since_boot
            else:
                ctr["nvl_flit"] += since_boot
                ctr["nvl_replay"] += since_boot // 2
        # Healthy boards collect a correctable remap now and then (our calibration: ~1 per 3 years,
        # lemons 10x).
        remaps = rng.poisson(np.where(lemon, 10.0, 1.0) * age_d / 1000.0)
        ctr["remap_corr"] += np.where(fleet.has_remap, remaps, 0)
        ctr["ret_sbe"] += np.where(fleet.has_remap, 0, remaps)
        # Power-capped share of past busy time, for the violation counter.
        ctr["pviol"] += (rng.uniform(0.0, 0.1, g_n) * uptime_d * DAY * 1e9).astype(np.int64)
        for f in self.schedule.failures:
            if f.precursor_start is None or f.precursor_start >= cfg.start_ts:
                continue
            g, lead_h = f.gpu, (f.ts - f.precursor_start) / HOUR
            x0 = (cfg.start_ts - f.precursor_start) / (f.ts - f.precursor_start)
            base, growth = f.params.get("base", 0.0), f.params.get("growth", 1.0)
            grown = base * lead_h * (math.exp(growth * x0) - 1.0) / growth  # integral of the rate
            if f.cls == "hbm_ecc":
                n = int(rng.poisson(grown))
                ctr["sbe_vol"][g] += n
                ctr["sbe_agg"][g] += n
                done = int(rng.poisson(0.05 * lead_h * (math.exp(4.0 * x0) - 1.0) / 4.0))
                if done:
                    ctr["remap_corr" if fleet.has_remap[g] else "ret_sbe"][g] += done
                    ctr["remap_pending" if fleet.has_remap[g] else "ret_pending"][g] = 1
            elif f.cls == "nvlink":
                n = int(rng.poisson(grown))
                ctr["nvl_flit"][g] += n
                ctr["nvl_data"][g] += int(0.3 * n)
                ctr["nvl_replay"][g] += int(0.5 * n)
            elif f.cls == "off_bus":
                ctr["pcie"][g] += int(rng.poisson(6.0 * grown))
        # Average draw since boot ~ half of TDP.
        return fleet.tdp_w * rng.uniform(0.35, 0.65, g_n) * uptime_d * DAY * 1000.0

    @staticmethod
    def _before_edges(edges: list[Window], t_rec: float, ts: float, ji: int, gs: np.ndarray,
                      nominal: np.ndarray, f_net: float, gpu_speed: np.ndarray, f_in: float,
                      prev_state: tuple[np.ndarray, dict[int, float], dict[int, float]] | None,
                      ) -> tuple[np.ndarray, float]:
        """A step record taken at ``t_rec``, after the previous tick and before this one (``ts``):
        a rank or job with a slowdown window that starts after ``t_rec`` or ends after it within
        this tick takes the previous tick's speed, since the record is on that side of the edge.
        So no record is slowed before its label's start, nor back to speed before its end.
        Returns (compute seconds per rank, network factor)."""
        if prev_state is None:
            return nominal, f_net
        prev_speed, prev_input, prev_net = prev_state
        gpus: set[int] = set()  # each at most once, however many of its windows have an edge here
        job_input = False
        for w in edges:
            if not (t_rec < w.t0 or t_rec < w.t1 <= ts):
                continue
            if w.kind in ("failslow", "thermal_throttle"):
                gpus.add(w.gpu)
            elif w.job == ji and w.kind == "slow_input":
                job_input = True
            elif w.job == ji:  # slow_network
                f_net = prev_net.get(ji, 1.0)
        out = nominal
        hit = np.isin(gs, list(gpus)) if gpus else None
        if hit is not None and hit.any():
            out = nominal.copy()
            out[hit] *= gpu_speed[gs[hit]] / prev_speed[gs[hit]]
        if job_input:
            out = out * (f_in / prev_input.get(ji, 1.0))
        return out, f_net

    def _precursor_tick(
        self,
        rng: np.random.Generator,
        w: Window,
        x: float,
        dt: float,
        ctr: dict,
        xid: np.ndarray,
        r_mult: np.ndarray,
        fired: set[int],
    ) -> None:
        """Advance one failing GPU's precursor by one tick (x = share of the precursor elapsed)."""
        g = w.gpu
        fleet = self.fleet
        cls = w.kind[4:]
        if cls == "hbm_ecc":
            # Single-bit rate climbs exponentially over the precursor (median 0.2/h -> ~130/h).
            sbe_h = w.data["base"] * math.exp(w.data["growth"] * x)
            n = int(rng.poisson(sbe_h * dt / HOUR))
            ctr["sbe_vol"][g] += n
            ctr["sbe_agg"][g] += n
            if rng.random() < 0.05 * math.exp(4.0 * x) * dt / HOUR:
                if fleet.has_remap[g]:
                    ctr["remap_corr"][g] += 1
                    ctr["remap_pending"][g] = 1
                else:
                    ctr["ret_sbe"][g] += 1
                    ctr["ret_pending"][g] = 1
                xid[g] = 63
            if sbe_h > 20.0 and rng.random() < dt / (2.0 * HOUR):
                xid[g] = 92  # "high single-bit ECC error rate"
            if w.data.get("variant") == "remap_failure" and x > 0.9 and id(w) not in fired:
                fired.add(id(w))
                if fleet.has_remap[g]:
                    ctr["remap_fail"][g] = 1
                    xid[g] = 64
        elif cls == "nvlink":
            flit_h = w.data["base"] * math.exp(w.data["growth"] * x)
            n = int(rng.poisson(flit_h * dt / HOUR))
            ctr["nvl_flit"][g] += n
            ctr["nvl_data"][g] += int(rng.poisson(0.3 * flit_h * dt / HOUR))
            ctr["nvl_replay"][g] += int(rng.poisson(0.5 * flit_h * dt / HOUR))
            ctr["nvl_recovery"][g] += int(rng.poisson(0.02 * flit_h * dt / HOUR))
        elif cls == "off_bus":
            # A degrading link retries in bursts: each event adds several replays.
            events = int(rng.poisson(w.data["base"] * math.exp(w.data["growth"] * x) * dt / HOUR))
            if events:
                ctr["pcie"][g] += int(rng.geometric(1.0 / 6.0, events).sum())
        elif cls == "gsp":
            if rng.random() < 2.0 * dt / (w.t1 - w.t0):
                xid[g] = 119  # GSP RPC timeout
        elif cls == "thermal_interface":
            r_mult[g] *= 1.0 + (w.data["m_end"] - 1.0) * x ** w.data["power"]

    def _key_groups(self) -> list[tuple[np.ndarray, tuple[str, ...]]]:
        """Runs of consecutive GPUs reporting the same DCGM fields (ints first, then FLOAT_KEYS).

        Runs keep global GPU order, so a tick's samples come out sorted by node and GPU.
        """
        fleet = self.fleet
        out: list[tuple[np.ndarray, tuple[str, ...]]] = []
        run: list[int] = []
        run_keys: tuple[str, ...] = ()
        for g in range(fleet.n_gpus):
            hbm = fleet.spec(g).memory_bw_tbs >= 0.9  # GDDR boards report no memory temperature
            keys = tuple(k for k in INT_KEYS_COMMON if hbm or k != P + "MEMORY_TEMP")
            keys += INT_KEYS_REMAP if fleet.has_remap[g] else INT_KEYS_RETIRED
            if fleet.has_nvlink[g]:
                keys += INT_KEYS_NVLINK
            keys += FLOAT_KEYS
            if keys != run_keys and run:
                out.append((np.array(run, dtype=np.int64), run_keys))
                run = []
            run.append(g)
            run_keys = keys
        if run:
            out.append((np.array(run, dtype=np.int64), run_keys))
        return out
