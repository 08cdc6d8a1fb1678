"""Pre-scheduling: failures, jobs, stragglers, slowdowns and traps, all drawn from the seed.

Everything that happens in a trace is decided here, before the first tick, so the labels are
known at construction and the tick loop only renders physics and counters around them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fleetwise.sim.config import SimConfig
from fleetwise.sim.fleet import Fleet, new_uuid

HOUR = 3600.0
DAY = 86400.0

# Application XIDs (https://docs.nvidia.com/deploy/xid-errors/): 13 graphics engine exception,
# 31 MMU fault, 43 GPU stopped processing (usually the application); 45 preemptive cleanup,
# which follows another error. Shares are our assumption.
APP_XIDS = (13, 31, 43)
APP_XID_P = (0.45, 0.35, 0.20)


@dataclass
class Job:
    name: str
    start: float
    end: float
    nodes: list[int]
    gpus: np.ndarray  # global GPU index per rank
    model_ids: list[str]  # catalog id per rank
    capability: np.ndarray  # TFLOPS per rank (catalog capability for the job dtype)
    micro_batch: np.ndarray
    samples: np.ndarray
    work_tflop_per_sample: float
    comm_s: float
    split: str  # "proportional" | "uniform"
    dtype: str
    intensity: float  # power demand at full activity, share of TDP above idle
    util: float
    mem_copy_util: float
    fb_frac: float
    tensor_ratio: float
    ckpt_period: float
    ckpt_dur: float
    ckpt_phase: float
    crashed: bool = False

    @property
    def ranks(self) -> int:
        return len(self.gpus)


@dataclass
class Failure:
    gpu: int
    ts: float
    cls: str
    precursor_start: float | None
    abrupt: bool
    repair_ts: float
    final_xid: int  # 0: none (silent or thermal shutdown without an XID)
    variant: str = ""  # e.g. "pcie_first" for off_bus, "remap_failure" for hbm_ecc
    params: dict = field(default_factory=dict)


@dataclass
class Window:
    """An effect active on [t0, t1) for GPUs or a job."""

    t0: float
    t1: float
    kind: str
    gpu: int = -1
    job: int = -1
    factor: float = 1.0
    data: dict = field(default_factory=dict)


@dataclass
class Event:
    """A point event applied in the first tick at or after ts."""

    ts: float
    kind: str
    gpu: int = -1
    node: int = -1
    code: int = 0
    data: dict = field(default_factory=dict)


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> float:
    return float(median * math.exp(sigma * rng.standard_normal()))


def _lognormal_h(rng: np.random.Generator, median_h: float, sigma: float, lo_h: float, hi_h: float) -> float:
    return float(np.clip(median_h * math.exp(sigma * rng.standard_normal()), lo_h, hi_h)) * HOUR


class Schedule:
    """All pre-scheduled content of one trace."""

    def __init__(self, config: SimConfig, fleet: Fleet, rng: np.random.Generator) -> None:
        self.config = config
        self.fleet = fleet
        self.start = config.start_ts
        self.end = config.start_ts + config.days * DAY
        self.jobs: list[Job] = []
        self.failures: list[Failure] = []
        self.windows: list[Window] = []
        self.events: list[Event] = []
        self.labels: list[dict] = []
        self._visible: tuple[list[Job], np.ndarray] | None = None
        self._busy_p: np.ndarray | None = None
        gpu_days = fleet.n_gpus * config.days
        rate = config.failure_rate_per_1000_gpu_days
        self.app_xid_rate = (
            config.app_xid_rate_per_1000_gpu_days
            if config.app_xid_rate_per_1000_gpu_days is not None
            else max(30.0, 4.0 * rate)  # application XIDs far outnumber hardware failures
        )
        self.benign_rate = (
            config.benign_sbe_burst_rate_per_1000_gpu_days
            if config.benign_sbe_burst_rate_per_1000_gpu_days is not None
            else max(10.0, 1.0 * rate)
        )
        self._schedule_failures(rng, gpu_days)
        self.failures.sort(key=lambda f: (f.ts, f.gpu))
        self._schedule_jobs(rng)
        self._schedule_stragglers(rng)
        self._schedule_job_effects(rng)
        self._schedule_traps(rng, gpu_days)
        self._schedule_reboots_and_gaps(rng)
        self.windows.sort(key=lambda w: (w.t0, w.kind, w.gpu, w.job))
        self.events.sort(key=lambda e: (e.ts, e.kind, e.gpu, e.node))
        kind_order = {"lemon": 0, "failure": 1, "straggler": 2, "job_slowdown": 3, "trap": 4, "repair": 5}
        self.labels.sort(
            key=lambda r: (
                r.get("ts", r.get("start_ts", self.start)),
                kind_order.get(r["kind"], 9),
                r.get("node") or "",
                r.get("gpu") if r.get("gpu") is not None else -1,
                r.get("job") or "",
            )
        )

    # --- failures ----------------------------------------------------------------------------
    def _schedule_failures(self, rng: np.random.Generator, gpu_days: float) -> None:
        cfg, fleet = self.config, self.fleet
        n = int(rng.poisson(cfg.failure_rate_per_1000_gpu_days * gpu_days / 1000.0))
        weights = fleet.hazard.copy()
        if n == 0 or weights.sum() <= 0:
            return
        classes = list(cfg.class_mix)
        mix = np.array([cfg.class_mix[c] for c in classes], float)
        mix /= mix.sum()
        # Drawn with replacement: a slot may fail again after its repair (the lemon hazard stays
        # with the slot - board, riser, cooling position), but two failures never overlap.
        busy: dict[int, list[tuple[float, float]]] = {}
        for _ in range(n):
            for _attempt in range(20):
                gpu = int(rng.choice(fleet.n_gpus, p=weights / weights.sum()))
                ts = float(rng.uniform(self.start, self.end))
                cls = classes[int(rng.choice(len(classes), p=mix))]
                if cls == "nvlink" and not fleet.has_nvlink[gpu]:
                    cls = "off_bus"  # no NVLink on this board: a link-level fault shows as the bus
                f = self._precursor(rng, gpu, ts, cls, fleet.spec(gpu).family)
                f.repair_ts = ts + float(rng.uniform(*cfg.repair_hours)) * HOUR
                lo = f.precursor_start if f.precursor_start is not None else ts
                if all(f.repair_ts < a or lo > b for a, b in busy.get(gpu, [])):
                    break
            else:
                continue
            busy.setdefault(gpu, []).append((lo, f.repair_ts))
            self.failures.append(f)
            spec = fleet.spec(gpu)
            node = fleet.node_of(gpu)
            self.labels.append(
                {
                    "kind": "failure",
                    "ts": ts,
                    "node": node.name,
                    "gpu": int(fleet.gpu_local[gpu]),
                    "uuid": fleet.uuids[gpu],
                    "model": spec.id,
                    "class": cls,
                    "precursor_start_ts": f.precursor_start,
                    "abrupt": f.abrupt,
                    "variant": f.variant or None,
                    "final_xid": f.final_xid or None,
                    "repair_ts": f.repair_ts,
                    "lemon": bool(fleet.lemon[gpu]),
                }
            )
            f.params["label"] = self.labels[-1]
            if cls == "thermal_interface":
                self.labels[-1]["throttle_start_ts"] = ts - f.params["throttle_s"]
                self.labels[-1]["throttle_factor"] = round(f.params["factor"], 4)
        # Each repair installs a new board; a slot's later failure is that board's.
        current = list(fleet.uuids)
        for f in sorted(self.failures, key=lambda x: (x.ts, x.gpu)):
            f.params["label"]["uuid"] = current[f.gpu]
            f.params["new_uuid"] = current[f.gpu] = new_uuid(rng)

    def _precursor(self, rng: np.random.Generator, gpu: int, ts: float, cls: str, family: str) -> Failure:
        """Draw whether a failure is warned and how long before it its precursor starts."""
        remap = self.fleet.has_remap[gpu]
        if cls == "hbm_ecc":
            # Single-bit rates climb for a day or more before most HBM failures; ~15% are a
            # double-bit error out of the blue. Final XID: 94/95 contained/uncontained (Ampere+),
            # 48 double-bit ECC on Volta.
            final = int(rng.choice([94, 95, 48], p=[0.45, 0.3, 0.25])) if remap else 48
            if rng.random() < 0.15:
                return Failure(gpu, ts, cls, None, True, 0.0, final)
            lead = _lognormal_h(rng, 30.0, 0.6, 2.0, 120.0)
            variant = "remap_failure" if rng.random() < 0.3 else ""
            # The shape varies per failure (start rate and growth), so a model must learn the
            # trend, not one curve: SBE/h = base x e^(growth x), x = share of the precursor.
            shape = {"base": _lognormal(rng, 0.2, 0.5), "growth": float(rng.uniform(5.5, 7.5))}
            return Failure(gpu, ts, cls, ts - lead, False, 0.0, final, variant, params=shape)
        if cls == "thermal_interface":
            # Degraded TIM / cold plate: resistance creeps over days; the GPU throttles (a
            # straggler) in the last hours, then shuts down.
            lead = _lognormal_h(rng, 60.0, 0.5, 18.0, 168.0)
            throttle = min(float(rng.uniform(2.0, 12.0)) * HOUR, 0.4 * lead)
            final = 79 if rng.random() < 0.4 else 0
            return Failure(
                gpu,
                ts,
                cls,
                ts - lead,
                False,
                0.0,
                final,
                params={
                    "throttle_s": throttle,
                    "factor": float(rng.uniform(0.65, 0.85)),
                    "power": float(rng.uniform(1.5, 3.0)),  # resistance creeps as x^power
                },
            )
        if cls == "nvlink":
            final = 74
            if rng.random() < 0.2:
                return Failure(gpu, ts, cls, None, True, 0.0, final)
            lead = _lognormal_h(rng, 1.5, 1.0, 1.0 / 6.0, 18.0)
            shape = {"base": _lognormal(rng, 3.0, 0.5), "growth": float(rng.uniform(4.0, 6.0))}
            return Failure(gpu, ts, cls, ts - lead, False, 0.0, final, params=shape)
        if cls == "off_bus":
            if rng.random() < 0.75:  # mostly abrupt
                return Failure(gpu, ts, cls, None, True, 0.0, 79)
            lead = _lognormal_h(rng, 1.0, 1.0, 1.0 / 6.0, 8.0)
            shape = {"base": _lognormal(rng, 2.0, 0.5), "growth": float(rng.uniform(4.0, 6.0))}
            return Failure(gpu, ts, cls, ts - lead, False, 0.0, 79, "pcie_first", params=shape)
        if cls == "gsp":
            final = int(rng.choice([119, 120], p=[0.6, 0.4]))
            if rng.random() < 0.7:
                return Failure(gpu, ts, cls, None, True, 0.0, final)
            lead = float(rng.uniform(5.0, 30.0)) * 60.0  # a GSP timeout or two, minutes before
            return Failure(gpu, ts, cls, ts - lead, False, 0.0, final)
        return Failure(gpu, ts, "silent", None, True, 0.0, 0)

    def down_windows(self, node: int) -> list[tuple[float, float]]:
        fleet = self.fleet
        return sorted((f.ts, f.repair_ts) for f in self.failures if int(fleet.gpu_node[f.gpu]) == node)

    # --- jobs ----------------------------------------------------------------------------------
    def _schedule_jobs(self, rng: np.random.Generator) -> None:
        cfg, fleet = self.config, self.fleet
        n_nodes = len(fleet.nodes)
        down = [self.down_windows(i) for i in range(n_nodes)]
        fails_on_node: list[list[tuple[float, int]]] = [[] for _ in range(n_nodes)]
        for f in self.failures:
            fails_on_node[int(fleet.gpu_node[f.gpu])].append((f.ts, f.gpu))
        # Jobs already running when the trace starts began up to a job-length earlier.
        free_at = self.start - rng.uniform(0.0, 1.0, n_nodes) * cfg.job_hours_median * HOUR
        tie = rng.random(n_nodes)
        sizes = [k for k in (1, 2, 4, 8, 16) if k <= max(1, min(cfg.job_max_nodes, n_nodes))]
        size_p = np.array([0.45, 0.3, 0.15, 0.07, 0.03][: len(sizes)])
        size_p /= size_p.sum()
        counter = 0
        while True:
            first = int(np.lexsort((tie, free_at))[0])
            if free_at[first] >= self.end:
                break
            site = fleet.nodes[first].site_index
            same_site = [i for i in range(n_nodes) if fleet.nodes[i].site_index == site]
            k = min(int(sizes[int(rng.choice(len(sizes), p=size_p))]), len(same_site))
            same_site.sort(key=lambda i: (free_at[i], tie[i]))
            chosen = sorted(same_site[:k])
            start = float(max(free_at[i] for i in chosen))
            # A node under repair is not schedulable.
            moved = True
            while moved:
                moved = False
                for i in chosen:
                    for d0, d1 in down[i]:
                        if d0 <= start < d1:
                            start, moved = d1 + 600.0, True
            if start >= self.end:
                for i in chosen:
                    free_at[i] = max(free_at[i], self.end)
                continue
            duration = _lognormal_h(rng, cfg.job_hours_median, 0.9, 0.5, 96.0)
            end = start + duration
            gpus = np.array([g for i in chosen for g in fleet.nodes[i].gpus], dtype=np.int64)
            crashed = False
            for f in sorted(f for i in chosen for f in fails_on_node[i]):
                if start < f[0] < end:
                    end, crashed = f[0], True
            job = self._make_job(rng, f"job-{counter:04d}", start, end, chosen, gpus)
            job.crashed = crashed
            counter += 1
            self.jobs.append(job)
            gap = rng.exponential(cfg.idle_gap_mean_min * 60.0, len(chosen))
            for j, i in enumerate(chosen):
                free_at[i] = end + gap[j]
                for d0, d1 in down[i]:
                    if d0 <= end < d1 or (crashed and d0 == end):
                        free_at[i] = d1 + gap[j]

    def _make_job(
        self,
        rng: np.random.Generator,
        name: str,
        start: float,
        end: float,
        nodes: list[int],
        gpus: np.ndarray,
    ) -> Job:
        fleet, cfg = self.fleet, self.config
        specs = [fleet.spec(int(g)) for g in gpus]
        dtype = "bf16" if all(s.supports("bf16") for s in specs) else "fp16"
        cap = np.array([s.capability_tflops(dtype) for s in specs])
        split = "proportional" if rng.random() < 0.5 else "uniform"
        mb_base = int(rng.choice([1, 2, 4]))
        accum = int(rng.choice([1, 2, 4, 8]))
        if split == "proportional":
            mb = np.maximum(1, np.round(mb_base * cap / cap.min())).astype(np.int64)
        else:
            mb = np.full(len(gpus), mb_base, dtype=np.int64)
        samples = mb * accum
        target_step = float(rng.uniform(1.5, 8.0))  # seconds of compute on the slowest rank
        work = target_step * float(np.min(cap / samples * 1.0))  # TFLOP per sample
        c0, c1 = cfg.checkpoint_interval_min
        d0, d1 = cfg.checkpoint_duration_min
        period = float(rng.uniform(c0, c1)) * 60.0
        return Job(
            name=name,
            start=start,
            end=end,
            nodes=nodes,
            gpus=gpus,
            model_ids=[s.id for s in specs],
            capability=cap,
            micro_batch=mb,
            samples=samples,
            work_tflop_per_sample=work,
            comm_s=target_step * float(rng.uniform(0.05, 0.25)),
            split=split,
            dtype=dtype,
            intensity=float(rng.uniform(0.80, 1.15)),  # > 1: the job would draw above TDP (capped)
            util=float(rng.uniform(94.0, 99.5)),
            mem_copy_util=float(rng.uniform(20.0, 60.0)),
            fb_frac=float(rng.uniform(0.55, 0.95)),
            tensor_ratio=float(rng.uniform(0.35, 0.7)),
            ckpt_period=period,
            ckpt_dur=float(rng.uniform(d0, d1)) * 60.0,
            ckpt_phase=float(rng.uniform(0.0, period)),
        )

    def _job_window(
        self, rng: np.random.Generator, job: Job, median_h: float, lo_h: float
    ) -> tuple[float, float]:
        lo = max(job.start, self.start)
        hi = min(job.end, self.end)
        t0 = float(rng.uniform(lo, hi))
        t1 = min(hi, t0 + _lognormal_h(rng, median_h, 0.8, lo_h, 24.0))
        return t0, t1

    def _visible_jobs(self) -> tuple[list[Job], np.ndarray]:
        """Jobs with at least 10 minutes inside the trace, and those hours (computed once)."""
        if self._visible is None:
            jobs = [j for j in self.jobs if min(j.end, self.end) - max(j.start, self.start) > 600.0]
            hours = np.array([(min(j.end, self.end) - max(j.start, self.start)) / HOUR for j in jobs])
            self._visible = (jobs, hours)
        return self._visible

    # --- stragglers --------------------------------------------------------------------------
    def _schedule_stragglers(self, rng: np.random.Generator) -> None:
        cfg, fleet = self.config, self.fleet
        jobs, hours = self._visible_jobs()
        if jobs:
            gpu_days = float(np.sum(hours * np.array([j.ranks for j in jobs]))) / 24.0
            n = int(rng.poisson(cfg.straggler_rate_per_1000_gpu_days * gpu_days / 1000.0))
            weights = hours * np.array([j.ranks for j in jobs])
            for _ in range(n):
                ji = int(rng.choice(len(jobs), p=weights / weights.sum()))
                job = jobs[ji]
                rank = int(rng.integers(job.ranks))
                t0, t1 = self._job_window(rng, job, 2.0, 1.0 / 6.0)
                if rng.random() < 0.7:
                    cause, factor = "compute_failslow", float(rng.uniform(0.70, 0.95))
                else:
                    cause, factor = "thermal", float(rng.uniform(0.65, 0.90))
                self._add_straggler(job, rank, t0, t1, factor, cause)
        # A thermal-interface failure throttles its GPU in the last hours: a straggler for
        # whichever job runs there.
        for f in self.failures:
            if f.cls != "thermal_interface":
                continue
            t_thr = f.ts - f.params["throttle_s"]
            self.windows.append(
                Window(
                    t_thr,
                    f.ts,
                    "thermal_throttle",
                    gpu=f.gpu,
                    factor=f.params["factor"],
                    data={"source": "thermal_interface"},
                )
            )
            for job in self.jobs:
                if int(fleet.gpu_node[f.gpu]) not in job.nodes or f.gpu not in job.gpus:
                    continue
                t0, t1 = max(t_thr, job.start, self.start), min(f.ts, job.end, self.end)
                if t1 - t0 > 0:
                    rank = int(np.nonzero(job.gpus == f.gpu)[0][0])
                    self._add_straggler(job, rank, t0, t1, f.params["factor"], "thermal", window=False)

    def _add_straggler(
        self, job: Job, rank: int, t0: float, t1: float, factor: float, cause: str, window: bool = True
    ) -> None:
        fleet = self.fleet
        gpu = int(job.gpus[rank])
        if window:
            kind = "failslow" if cause == "compute_failslow" else "thermal_throttle"
            self.windows.append(Window(t0, t1, kind, gpu=gpu, factor=factor, data={"source": "straggler"}))
        self.labels.append(
            {
                "kind": "straggler",
                "job": job.name,
                "rank": rank,
                "node": fleet.node_of(gpu).name,
                "gpu": int(fleet.gpu_local[gpu]),
                "model": fleet.spec(gpu).id,
                "start_ts": t0,
                "end_ts": t1,
                "factor": round(factor, 4),
                "cause": cause,
            }
        )

    # --- job-wide effects ----------------------------------------------------------------------
    def _schedule_job_effects(self, rng: np.random.Generator) -> None:
        cfg = self.config
        jobs, hours = self._visible_jobs()
        job_index = {id(j): i for i, j in enumerate(self.jobs)}
        for ji, job in enumerate(jobs):
            idx = job_index[id(job)]
            for _ in range(int(rng.poisson(cfg.job_slowdown_rate_per_1000_job_hours * hours[ji] / 1000.0))):
                t0, t1 = self._job_window(rng, job, 0.5, 1.0 / 6.0)
                cause = "network" if rng.random() < 0.6 else "input"
                factor = float(rng.uniform(0.6, 0.9))
                self.windows.append(Window(t0, t1, f"slow_{cause}", job=idx, factor=factor))
                self.labels.append(
                    {
                        "kind": "job_slowdown",
                        "job": job.name,
                        "start_ts": t0,
                        "end_ts": t1,
                        "factor": round(factor, 4),
                        "cause": cause,
                    }
                )
            for _ in range(int(rng.poisson(cfg.util_drop_rate_per_1000_job_hours * hours[ji] / 1000.0))):
                t0, t1 = self._job_window(rng, job, 0.25, 5.0 / 60.0)
                t1 = min(t1, t0 + 0.75 * HOUR)
                util = float(rng.uniform(15.0, 50.0))
                self.windows.append(Window(t0, t1, "util_drop", job=idx, factor=util / 100.0))
                self.labels.append(
                    {
                        "kind": "trap",
                        "type": "util_drop",
                        "job": job.name,
                        "ts": t0,
                        "end_ts": t1,
                        "node": None,
                        "gpu": None,
                        "util": round(util, 1),
                    }
                )

    # --- traps ----------------------------------------------------------------------------------
    def _busy_at(self, rng: np.random.Generator) -> tuple[Job, float] | None:
        jobs, hours = self._visible_jobs()
        if not jobs:
            return None
        if self._busy_p is None:
            w = hours * np.array([j.ranks for j in jobs])
            self._busy_p = w / w.sum()
        job = jobs[int(rng.choice(len(jobs), p=self._busy_p))]
        return job, float(rng.uniform(max(job.start, self.start), min(job.end, self.end)))

    def _schedule_traps(self, rng: np.random.Generator, gpu_days: float) -> None:
        fleet = self.fleet
        for g in np.nonzero(fleet.hot_healthy)[0]:
            node = fleet.node_of(int(g))
            self.labels.append(
                {
                    "kind": "trap",
                    "type": "hot_healthy",
                    "node": node.name,
                    "gpu": int(fleet.gpu_local[g]),
                    "ts": self.start,
                    "excess_c": round(float(fleet.hot_healthy_excess_c[g]), 1),
                }
            )
        for g in np.nonzero(fleet.lemon)[0]:
            node = fleet.node_of(int(g))
            self.labels.append(
                {
                    "kind": "lemon",
                    "node": node.name,
                    "gpu": int(fleet.gpu_local[g]),
                    "uuid": fleet.uuids[g],
                    "ts": self.start,
                    "hazard_mult": self.config.lemon_hazard_mult,
                }
            )
        failing = {f.gpu for f in self.failures}
        # Application XIDs on GPUs that run jobs: one GPU or a whole node of the job.
        for _ in range(int(rng.poisson(self.app_xid_rate * gpu_days / 1000.0))):
            hit = self._busy_at(rng)
            if hit is None:
                break
            job, ts = hit
            code = int(rng.choice(APP_XIDS, p=APP_XID_P))
            rank = int(rng.integers(job.ranks))
            gpu = int(job.gpus[rank])
            node = fleet.node_of(gpu)
            targets = [gpu] if rng.random() < 0.6 else [g for g in node.gpus if g in job.gpus]
            follow = rng.random() < 0.3
            for g in targets:
                self.events.append(Event(ts, "xid", gpu=g, code=code))
                self.labels.append(
                    {
                        "kind": "trap",
                        "type": "app_xid",
                        "node": node.name,
                        "gpu": int(fleet.gpu_local[g]),
                        "ts": ts,
                        "xid": code,
                        "job": job.name,
                    }
                )
                if follow:
                    t45 = ts + self.config.sample_interval_s
                    self.events.append(Event(t45, "xid", gpu=g, code=45))
                    self.labels.append(
                        {
                            "kind": "trap",
                            "type": "app_xid",
                            "node": node.name,
                            "gpu": int(fleet.gpu_local[g]),
                            "ts": t45,
                            "xid": 45,
                            "job": job.name,
                        }
                    )
        # Benign single-bit bursts that end in one successful remap (or one retired page).
        healthy = [g for g in range(fleet.n_gpus) if g not in failing]
        for _ in range(int(rng.poisson(self.benign_rate * gpu_days / 1000.0))):
            if not healthy:
                break
            g = int(healthy[int(rng.integers(len(healthy)))])
            t0 = float(rng.uniform(self.start, self.end))
            t1 = t0 + float(rng.uniform(*self.config.benign_sbe_minutes)) * 60.0
            total = int(rng.integers(*self.config.benign_sbe_total))
            self.windows.append(Window(t0, t1, "benign_sbe", gpu=g, data={"total": total}))
            node = fleet.node_of(g)
            self.labels.append(
                {
                    "kind": "trap",
                    "type": "benign_sbe_burst",
                    "node": node.name,
                    "gpu": int(fleet.gpu_local[g]),
                    "ts": t0,
                    "end_ts": t1,
                    "sbe": total,
                }
            )
        # Transient NVLink blips: XID 74 on a GPU and, sympathetically, on its peers; no failure.
        nvl = [g for g in healthy if fleet.has_nvlink[g]]
        rate74 = self.config.transient_xid74_rate_per_1000_gpu_days
        for _ in range(int(rng.poisson(rate74 * gpu_days / 1000.0))):
            if not nvl:
                break
            g = int(nvl[int(rng.integers(len(nvl)))])
            ts = float(rng.uniform(self.start, self.end))
            self._xid74_blip(rng, g, ts, origin_failure=False)
        # NVLink failures: peers log sympathetic 74s as the link degrades.
        for f in self.failures:
            if f.cls != "nvlink":
                continue
            t0 = f.precursor_start if f.precursor_start is not None else f.ts - 60.0
            n_ev = 1 if f.abrupt else int(rng.integers(2, 6))
            times = np.sort(rng.uniform(t0 + 0.5 * (f.ts - t0), f.ts, n_ev))
            times[-1] = f.ts
            for ts in times:
                self._xid74_blip(rng, f.gpu, float(ts), origin_failure=True, self_log=float(ts) < f.ts)

    def _xid74_blip(
        self, rng: np.random.Generator, gpu: int, ts: float, origin_failure: bool, self_log: bool = True
    ) -> None:
        fleet = self.fleet
        node = fleet.node_of(gpu)
        if self_log:
            self.events.append(Event(ts, "xid74", gpu=gpu, code=74, data={"crc": int(rng.integers(5, 80))}))
        peers = [p for p in fleet.nvlink_peers(gpu) if rng.random() < self.config.xid74_peer_prob]
        if not origin_failure and not peers:
            peers = fleet.nvlink_peers(gpu)[:1]
        for p in peers:
            self.events.append(Event(ts, "xid74", gpu=p, code=74, data={"crc": int(rng.integers(1, 20))}))
            self.labels.append(
                {
                    "kind": "trap",
                    "type": "sympathetic_xid74",
                    "node": node.name,
                    "gpu": int(fleet.gpu_local[p]),
                    "ts": ts,
                    "origin_gpu": int(fleet.gpu_local[gpu]),
                    "origin_failure": origin_failure,
                }
            )
        if not origin_failure and self_log:
            self.labels.append(
                {
                    "kind": "trap",
                    "type": "transient_xid74",
                    "node": node.name,
                    "gpu": int(fleet.gpu_local[gpu]),
                    "ts": ts,
                }
            )

    # --- reboots and scrape gaps -------------------------------------------------------------
    def _schedule_reboots_and_gaps(self, rng: np.random.Generator) -> None:
        cfg, fleet = self.config, self.fleet
        for node in fleet.nodes:
            busy = sorted((j.start, j.end) for j in self.jobs if node.index in j.nodes) + self.down_windows(
                node.index
            )
            busy.sort()
            gaps = []
            cursor = self.start
            for b0, b1 in busy:
                if b0 - cursor > 1200.0:
                    gaps.append((cursor, b0))
                cursor = max(cursor, b1)
            if self.end - cursor > 1200.0:
                gaps.append((cursor, self.end))
            n = int(rng.poisson(cfg.reboot_rate_per_1000_node_days * cfg.days / 1000.0))
            for _ in range(n):
                if not gaps:
                    break
                g0, g1 = gaps[int(rng.integers(len(gaps)))]
                ts = float(rng.uniform(g0, g1 - 900.0))
                self._reboot(node.index, ts, float(rng.uniform(3.0, 10.0)) * 60.0, "maintenance")
            for _ in range(int(rng.poisson(cfg.scrape_gap_rate_per_node_day * cfg.days))):
                t0 = float(rng.uniform(self.start, self.end))
                length = float(rng.uniform(1.0, 10.0)) * cfg.sample_interval_s
                self.windows.append(Window(t0, t0 + length, "scrape_gap", data={"node": node.index}))
        # A repaired GPU comes back with a new UUID in a rebooted node.
        for f in self.failures:
            node = int(fleet.gpu_node[f.gpu])
            if f.repair_ts < self.end:
                self.events.append(
                    Event(f.repair_ts, "repair", gpu=f.gpu, node=node, data={"uuid": f.params["new_uuid"]})
                )
                self._reboot(node, f.repair_ts - 300.0, 300.0, "repair")
            self.events.append(Event(f.ts, "fail", gpu=f.gpu, node=node, code=f.final_xid))

    def _reboot(self, node: int, ts: float, down_s: float, reason: str) -> None:
        if ts >= self.end:
            return
        self.windows.append(Window(ts, ts + down_s, "node_down", data={"node": node}))
        self.events.append(Event(ts + down_s, "reboot", node=node))
        self.labels.append(
            {
                "kind": "trap",
                "type": "counter_reset",
                "node": self.fleet.nodes[node].name,
                "gpu": None,
                "ts": ts + down_s,
                "down_from_ts": ts,
                "reason": reason,
            }
        )
