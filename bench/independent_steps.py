"""Independent generator of training-step and GPU-sample traces with labelled stragglers.

What this is
------------
A stand-alone step-time generator for checking a straggler detector against data it
has never seen the like of. It was written from the record contracts in the design
document (the "GPU sample" and "training step" formats), the public GPU catalog
(peak BF16 TFLOPS, TDP) and public knowledge of how synchronous data-parallel
training behaves. It was deliberately written *without* reading the project's own
simulator or detector, and it imports nothing from the project: numpy and the
standard library only. Its shapes, rates and noise are its own choices.

What it models
--------------
* Jobs (default 4) of 16-64 data-parallel ranks on 8-GPU nodes; node names, GPU
  indices and UUIDs are fixed per job. Some jobs mix two GPU generations
  (A100 + H100, H100 + H200, H100 + B200); one is homogeneous.
* Per-rank compute time = micro_batch x grad_accum x work_per_sample / effective
  TFLOPS of the GPU (catalog BF16 dense peak x a per-generation efficiency), times a
  small fixed per-GPU speed offset (silicon/cooling lottery, +-2 %), times per-step
  jitter: log-normal (1.5 %) plus a rare heavy (Lomax/Pareto) tail capped at +15 %.
  Where a job mixes generations the planner gave the faster one a larger
  micro-batch (the split is rounded, so it is not exactly balanced).
* Synchronous steps: ``step_time_s`` = slowest present rank's compute + the
  communication (all-reduce + optimizer) time of that step, the same on every
  rank; ``compute_s`` is each rank's own time before it waited, so
  ``compute_s <= step_time_s`` always. ``ts`` is the end of the step, and the next
  step starts there (``ts`` advances by exactly ``step_time_s``, except across an
  eval phase).
* Checkpoints every N steps (~30-45 min): a longer step on all ranks (save time is
  added to the step, not to anyone's compute). One or two eval phases per job: a
  gap of 2-8 minutes without training steps (GPUs stay busy at lower utilisation).
* GPU samples every 60 s per GPU (each node has its own phase within the minute)
  with DCGM_FI_DEV_GPU_TEMP, _POWER_USAGE, _SM_CLOCK and _GPU_UTIL, consistent with
  what the GPU is doing: stuck-low clocks, thermal ramps (hotter, lower clock),
  power caps (lower power, lower clock), idle during a rank restart, lower
  utilisation during storage stalls, eval and checkpoints.

Injected events (written to ``labels.jsonl``)
---------------------------------------------
* ``straggler`` (~3 per job per 8 h, not overlapping within a job): one rank's
  compute is divided by a speed ``factor`` in [0.625, 0.952] (5-60 % slower) from
  ``start_ts`` to ``end_ts``. Causes: ``clock`` (abrupt: SM clock stuck low, clock
  ratio ~ factor, cooler and lower power), ``power`` (abrupt: power brake / cap,
  power drops, clock ~ factor) and ``thermal`` (speed falls linearly over ``ramp_s``
  = 5-30 min to the factor while the temperature climbs to 86-93 C). About half are
  short (~10 min after any ramp), the rest last 1-4 h (some run to the trace end).
* ``job_slowdown`` (~1-2 per job per 8 h, 5-40 min, factor 0.55-0.85): every rank
  slows together; ``factor`` = nominal step time / step time during the event
  (the extra time is fixed from the job's nominal step, so it adds to whatever
  else is going on). ``network``: communication time grows (compute_s unchanged);
  ``storage``: every rank waits for data, so every rank's compute_s grows about
  equally and GPU utilisation falls. Must not be blamed on one rank.
* ``trap`` (things that are *not* stragglers):
  - ``model_mismatch``: in the H100 + H200 job both models got the same
    micro-batch, so each H100 rank is consistently ~9 % slower than the H200 ranks
    for the whole run (one label per such rank, with ``start_ts``/``end_ts``).
  - ``hiccup``: a single rank on a single step: a data-loader stall (+0.5-4 s) or a
    host hiccup (GC / page cache, compute x1.3-2.5); about one per 15 min per job.
  - ``rank_restart``: a rank's process dies and rejoins 3-10 min later (no step
    records from it in between; the job carries on elastically); the rejoin step is
    longer on all ranks (re-sync) and the rank's first 3 steps are warm-up slow.
  - ``checkpoint`` and ``eval`` (job-wide, ``rank`` null): the longer step and the
    gap described above.

Output: ``DIR/trace.jsonl.gz`` (step records and GPU samples, one JSON object a
line, sorted by ``ts``) and ``DIR/labels.jsonl`` (sorted by start time). By default
step records carry no ``model`` (the GPU model must be learnt from the samples);
``--with-model`` adds the NVML model name to each step record. Deterministic for a
seed: everything is drawn from ``numpy.random.default_rng(seed)``; no wall clock.

Usage::

    python bench/independent_steps.py --out DIR --seed S [--jobs 4] [--hours 8]
        [--with-model | --without-model]
"""

from __future__ import annotations

import argparse
import calendar
import gzip
import heapq
import io
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

START_TS = float(calendar.timegm((2026, 3, 2, 0, 0, 0)))  # 2026-03-02T00:00:00Z
SAMPLE_PERIOD_S = 60.0


@dataclass(frozen=True)
class GpuType:
    """One GPU model: catalog facts plus the behaviour assumed here."""

    key: str
    catalog_name: str  # row name in gpu_catalog_reference.csv
    nvml_name: str  # what NVML / dcgm-exporter report as the model name
    bf16_tflops: float  # dense BF16 from the catalog
    tdp_w: float  # from the catalog
    efficiency: float  # achieved fraction of peak (MFU) assumed for this generation
    max_sm_clock: int  # MHz, boost clock under load
    idle_sm_clock: int  # MHz
    load_temp: float  # typical GPU temperature under training load, C
    idle_power_w: float

    @property
    def effective_tflops(self) -> float:
        return self.bf16_tflops * self.efficiency


GPU_TYPES: dict[str, GpuType] = {
    "a100": GpuType("a100", "NVIDIA A100 80GB SXM4", "NVIDIA A100-SXM4-80GB", 312.0, 400.0, 0.50,
                    1410, 210, 62.0, 60.0),
    "h100": GpuType("h100", "NVIDIA H100 SXM", "NVIDIA H100 80GB HBM3", 989.4, 700.0, 0.42,
                    1980, 345, 64.0, 72.0),
    # Same peak as H100 SXM; the larger, faster HBM3e buys a higher achieved fraction.
    "h200": GpuType("h200", "NVIDIA H200 SXM", "NVIDIA H200", 989.4, 700.0, 0.46,
                    1980, 345, 63.0, 75.0),
    "b200": GpuType("b200", "NVIDIA B200 (HGX)", "NVIDIA B200", 2250.0, 1000.0, 0.38,
                    1965, 390, 60.0, 130.0),
}


@dataclass(frozen=True)
class JobTemplate:
    """A job's shape: (gpu type, number of 8-GPU nodes, micro-batch) groups and timings."""

    groups: tuple[tuple[str, int, int], ...]
    grad_accum: int
    compute_s: float  # target compute time of the slowest (critical) group
    comm_s: float  # all-reduce + optimizer per step
    mismatch: bool = False  # same micro-batch on two generations on purpose (trap)


TEMPLATES: tuple[JobTemplate, ...] = (
    # A100 + H100, H100 given 2.5x the micro-batch (speed ratio ~2.66): ~3.0 s steps.
    JobTemplate((("a100", 2, 2), ("h100", 2, 5)), 8, 2.6, 0.40),
    # H100 + H200 with the same micro-batch: H100 ranks ~9 % slower (plan mismatch trap).
    JobTemplate((("h100", 1, 4), ("h200", 2, 4)), 4, 1.5, 0.30, mismatch=True),
    # H100 + B200, B200 given 2x (speed ratio ~2.06): ~1.2 s steps.
    JobTemplate((("h100", 3, 2), ("b200", 3, 4)), 4, 0.95, 0.25),
    # Homogeneous H100, big model, long steps: ~5 s.
    JobTemplate((("h100", 8, 8),), 2, 4.2, 0.80),
)


@dataclass
class Rank:
    rank: int
    node: str
    gpu: int
    uuid: str
    gpu_type: GpuType
    micro_batch: int
    base_compute_s: float  # nominal compute for this rank, before jitter and events
    persistent: float  # fixed per-GPU speed offset (multiplies compute)
    load_temp: float
    load_power: float
    sample_phase: float  # seconds into each minute at which this node samples


@dataclass
class Straggler:
    rank: int
    start: float
    end: float
    factor: float
    ramp_s: float
    cause: str
    hot_temp: float = 0.0  # temperature reached at full effect (thermal)

    def speed(self, t: float) -> float:
        if t < self.start or t >= self.end:
            return 1.0
        return 1.0 - (1.0 - self.factor) * self.progress(t)

    def progress(self, t: float) -> float:
        if t < self.start or t >= self.end:
            return 0.0
        if self.ramp_s <= 0:
            return 1.0
        return min(1.0, (t - self.start) / self.ramp_s)


@dataclass
class Slowdown:
    start: float
    end: float
    factor: float
    cause: str

    def active(self, t: float) -> bool:
        return self.start <= t < self.end


@dataclass
class Restart:
    rank: int
    down: float
    up: float
    rejoin_ts: float = math.nan  # end of the first step it is back in
    warm_end_ts: float = math.nan


@dataclass
class Job:
    name: str
    template: JobTemplate
    ranks: list[Rank]
    start: float
    end: float
    first_step: int
    ckpt_every: int
    ckpt_s: float
    base_step_s: float
    stragglers: list[Straggler] = field(default_factory=list)
    slowdowns: list[Slowdown] = field(default_factory=list)
    restart: Restart | None = None
    eval_at: list[tuple[float, float]] = field(default_factory=list)  # (when, duration) planned
    # Filled in by the step simulation:
    evals: list[tuple[float, float]] = field(default_factory=list)  # (start, end)
    checkpoints: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, step)
    hiccups: list[dict] = field(default_factory=list)
    n_steps: int = 0
    step_times: list[float] = field(default_factory=list)


def _job_name(i: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return f"job-{letters[i]}" if i < 26 else f"job-{letters[i // 26 - 1]}{letters[i % 26]}"


def _uuid(rng: np.random.Generator) -> str:
    h = "".join(f"{b:02x}" for b in rng.integers(0, 256, size=16))
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _build_job(i: int, rng: np.random.Generator, node_counter: list[int], t0: float, t_end: float) -> Job:
    tpl = TEMPLATES[i % len(TEMPLATES)]
    if i >= len(TEMPLATES):  # later cycles: same shapes, slightly different timings
        tpl = JobTemplate(tpl.groups, tpl.grad_accum, tpl.compute_s * float(rng.uniform(0.8, 1.25)),
                          tpl.comm_s * float(rng.uniform(0.8, 1.25)), tpl.mismatch)
    # Work per sample such that the slowest group computes for tpl.compute_s.
    per_tflop = max(mb * tpl.grad_accum / GPU_TYPES[g].effective_tflops for g, _, mb in tpl.groups)
    work = tpl.compute_s / per_tflop
    ranks: list[Rank] = []
    for gkey, n_nodes, mb in tpl.groups:
        gt = GPU_TYPES[gkey]
        for _ in range(n_nodes):
            node_counter[0] += 1
            node = f"node-{node_counter[0]:03d}"
            phase = float(rng.uniform(0.0, SAMPLE_PERIOD_S))
            node_temp = float(rng.normal(0.0, 2.0))  # some racks run warmer
            for g in range(8):
                ranks.append(Rank(
                    rank=len(ranks), node=node, gpu=g, uuid=_uuid(rng), gpu_type=gt, micro_batch=mb,
                    base_compute_s=mb * tpl.grad_accum * work / gt.effective_tflops,
                    persistent=float(np.clip(rng.normal(1.0, 0.008), 0.98, 1.02)),
                    load_temp=gt.load_temp + node_temp + float(rng.normal(0.0, 1.5)),
                    load_power=gt.tdp_w * float(rng.uniform(0.74, 0.9)),
                    sample_phase=phase,
                ))
    start = t0 if i == 0 else t0 + float(rng.uniform(0.0, 900.0))
    base_step = max(r.base_compute_s for r in ranks) + tpl.comm_s
    ckpt_every = max(50, int(round(float(rng.uniform(1800.0, 2700.0)) / base_step / 10.0) * 10))
    return Job(name=_job_name(i), template=tpl, ranks=ranks, start=start, end=t_end,
               first_step=int(rng.integers(1, 60)) * 1000, ckpt_every=ckpt_every,
               ckpt_s=float(rng.uniform(15.0, 60.0)), base_step_s=base_step)


def _plan_events(job: Job, rng: np.random.Generator, hours: float, force_restart: bool) -> None:
    """Choose stragglers, job-wide slowdowns, a possible rank restart and eval times."""
    span = job.end - job.start
    n_ranks = len(job.ranks)
    # Rank restart (chosen first so stragglers avoid that rank).
    if (force_restart or rng.random() < 0.6) and span > 3600.0:
        rk = int(rng.integers(0, n_ranks))
        down = job.start + float(rng.uniform(0.15, 0.85)) * span
        job.restart = Restart(rk, down, min(job.end, down + float(rng.uniform(180.0, 600.0))))
    # Stragglers: one per segment of the run so that they do not overlap.
    n_str = max(1, int(round(3.0 * hours / 8.0)) + int(rng.integers(-1, 2))) if span >= 1800 else 0
    seg = span / max(n_str, 1)
    candidates = [r.rank for r in job.ranks if job.restart is None or r.rank != job.restart.rank]
    chosen = rng.choice(candidates, size=min(n_str, len(candidates)), replace=False)
    for s, rk in enumerate(chosen):
        seg_start = job.start + s * seg
        cause = str(rng.choice(["clock", "thermal", "power"], p=[0.35, 0.45, 0.2]))
        factor = round(1.0 / (1.0 + float(rng.uniform(0.05, 0.60))), 3)
        ramp = float(rng.uniform(300.0, 1800.0)) if cause == "thermal" else 0.0
        room = seg - 300.0  # keep a few minutes clear between consecutive stragglers
        if rng.random() < 0.5 or room < ramp + 3600.0:
            dur = ramp + float(rng.uniform(480.0, 720.0))  # short: ~10 min at full effect
        else:
            dur = ramp + float(rng.uniform(3600.0, 4.0 * 3600.0))
        lo = 900.0 if s == 0 else 120.0  # leave the job a quarter hour of clean baseline first
        dur = min(dur, max(room - lo - 60.0, 300.0))  # stay inside this segment
        st = seg_start + float(rng.uniform(lo, max(lo + 60.0, room - dur)))
        en = st + dur
        last = s == n_str - 1
        if last and dur > 3600.0 and rng.random() < 0.5:
            en = job.end  # lasts to the end of the trace
        job.stragglers.append(Straggler(int(rk), st, min(en, job.end), factor, round(ramp, 1), cause,
                                        float(rng.uniform(86.0, 93.0))))
    # Job-wide slowdowns (may overlap stragglers, not each other).
    n_sd = int(rng.poisson(1.5 * hours / 8.0))
    n_sd = max(n_sd, 1) if span >= 3600.0 else n_sd
    for s in range(n_sd):
        seg_sd = span / n_sd
        dur = float(rng.uniform(300.0, 2400.0))
        st = job.start + s * seg_sd + float(rng.uniform(60.0, max(120.0, seg_sd - dur - 60.0)))
        job.slowdowns.append(Slowdown(st, min(st + dur, job.end), round(float(rng.uniform(0.55, 0.85)), 3),
                                      str(rng.choice(["network", "storage"]))))
    # Eval phases: one or two.
    n_eval = (int(rng.integers(1, 3)) if span >= 2 * 3600 else 1) if span >= 1800 else 0
    for s in range(n_eval):
        when = job.start + (s + float(rng.uniform(0.3, 0.8))) * span / n_eval
        job.eval_at.append((when, float(rng.uniform(120.0, 480.0))))


@dataclass
class StepArrays:
    """The simulated steps of one job: end times, step times, per-rank compute (NaN = absent)."""

    ts: np.ndarray
    step_time: np.ndarray
    compute: np.ndarray  # (steps, ranks)
    first_step: int


def _simulate_steps(job: Job, rng: np.random.Generator) -> StepArrays:
    """Run the synchronous data-parallel step loop; records windows and hiccups on ``job``."""
    n = len(job.ranks)
    base = np.array([r.base_compute_s * r.persistent for r in job.ranks])
    evals = sorted(job.eval_at)
    restart = job.restart
    warm_left = 0
    rejoin_pending = restart is not None
    hiccup_p = job.base_step_s / 900.0  # about one single-rank hiccup per 15 min
    ts_out: list[float] = []
    st_out: list[float] = []
    comp_out: list[np.ndarray] = []
    t = job.start
    k = job.first_step
    while True:
        if evals and t >= evals[0][0]:
            _, dur = evals.pop(0)
            job.evals.append((t, min(t + dur, job.end)))
            t += dur
            continue
        present = np.ones(n, dtype=bool)
        resync = 0.0
        if restart is not None:
            if restart.down <= t < restart.up:
                present[restart.rank] = False
            elif rejoin_pending and t >= restart.up:
                rejoin_pending = False
                resync = float(rng.uniform(5.0, 20.0))
                warm_left = 3
        comp = base * rng.lognormal(0.0, 0.015, n)
        tail = rng.random(n) < 0.003
        if tail.any():
            comp[tail] *= 1.0 + np.minimum(0.15, 0.02 * rng.pareto(2.5, int(tail.sum())))
        for s in job.stragglers:
            sp = s.speed(t)
            if sp < 1.0:
                comp[s.rank] /= sp
        warm_done = False
        if warm_left > 0 and restart is not None:
            comp[restart.rank] *= 1.05 + 0.1 * warm_left  # 1.35, 1.25, 1.15
            warm_left -= 1
            warm_done = warm_left == 0
        comm = job.template.comm_s * float(rng.lognormal(0.0, 0.05))
        for sd in job.slowdowns:
            if sd.active(t):
                extra = job.base_step_s * (1.0 / sd.factor - 1.0)
                if sd.cause == "network":
                    comm += extra
                else:
                    comp += extra * rng.uniform(0.95, 1.05, n)
        hic = None
        if rng.random() < hiccup_p:
            hr = int(rng.integers(0, n))
            if present[hr]:
                if rng.random() < 0.6:
                    hic = (hr, "dataloader", float(rng.uniform(0.5, 4.0)))
                else:
                    hic = (hr, "host", float(comp[hr] * (rng.uniform(1.3, 2.5) - 1.0)))
                comp[hr] += hic[2]
        comp = np.round(comp, 4)
        k += 1
        step_time = float(comp[present].max()) + comm + resync
        ckpt_extra = job.ckpt_s * float(rng.uniform(0.9, 1.2)) if k % job.ckpt_every == 0 else 0.0
        step_time = round(step_time + ckpt_extra, 4)
        if t + step_time > job.end:
            break
        t_end = t + step_time
        if ckpt_extra > 0:
            job.checkpoints.append((t_end - ckpt_extra, t_end, k))
        if restart is not None:
            if resync > 0:
                restart.rejoin_ts = t_end
            if warm_done:
                restart.warm_end_ts = t_end
        if hic is not None:
            hr, cause, add = hic
            r = job.ranks[hr]
            job.hiccups.append({"kind": "trap", "type": "hiccup", "job": job.name, "rank": hr, "node": r.node,
                                "gpu": r.gpu, "ts": round(t_end, 3), "step": k, "cause": cause,
                                "extra_s": round(add, 3)})
        comp[~present] = np.nan
        ts_out.append(t_end)
        st_out.append(step_time)
        comp_out.append(comp)
        t = t_end
    job.n_steps = len(ts_out)
    job.step_times = st_out
    return StepArrays(np.array(ts_out), np.array(st_out),
                      np.array(comp_out).reshape(len(ts_out), n), job.first_step + 1)


def _step_blocks(job: Job, arr: StepArrays, with_model: bool) -> Iterator[tuple[float, int, str]]:
    """Yield (ts, 0, block): the newline-joined step records of one step, formatted lazily."""
    heads = [f'"job": "{job.name}", "rank": {r.rank}, "node": "{r.node}", "gpu": {r.gpu}, '
             for r in job.ranks]
    tails = []
    for r in job.ranks:
        extra = f', "model": "{r.gpu_type.nvml_name}"' if with_model else ""
        tails.append(f'"micro_batch": {r.micro_batch}, '
                     f'"samples": {r.micro_batch * job.template.grad_accum}{extra}}}')
    n = len(job.ranks)
    for j in range(len(arr.ts)):
        t_end = float(arr.ts[j])
        ts = f'{{"ts": {t_end:.3f}, '
        mid = f'"step": {arr.first_step + j}, "step_time_s": {arr.step_time[j]:.4f}, "compute_s": '
        row = arr.compute[j].tolist()
        lines = [ts + heads[i] + mid + f"{row[i]:.4f}, " + tails[i] for i in range(n) if row[i] == row[i]]
        yield (t_end, 0, "\n".join(lines))


def _gpu_samples(job: Job, rng: np.random.Generator) -> list[tuple[float, int, str]]:
    """GPU samples every 60 s for every GPU of the job, reflecting what it is doing."""
    out: list[tuple[float, int, str]] = []
    ck = job.checkpoints
    ck_starts = np.array([c[0] for c in ck]) if ck else np.zeros(0)
    for r in job.ranks:
        gt = r.gpu_type
        t = job.start + r.sample_phase
        temp = r.load_temp
        while t <= job.end:
            util = float(np.clip(rng.normal(98.0, 1.2), 90.0, 100.0))
            power = r.load_power * float(rng.normal(1.0, 0.02))
            clock = gt.max_sm_clock - abs(float(rng.normal(0.0, 12.0)))
            target_temp = r.load_temp
            rs = job.restart
            idle = rs is not None and rs.rank == r.rank and rs.down <= t < rs.up
            if any(a <= t < b for a, b in job.evals):
                util = float(rng.uniform(70.0, 88.0))
                power *= 0.75
                target_temp -= 4.0
            i = int(np.searchsorted(ck_starts, t, side="right")) - 1
            if i >= 0 and ck[i][0] <= t < ck[i][1]:
                util = float(rng.uniform(5.0, 30.0))
                power = gt.idle_power_w + 0.25 * (power - gt.idle_power_w)
            for sd in job.slowdowns:
                if sd.active(t):
                    if sd.cause == "storage":  # GPU idles while waiting for data
                        util *= sd.factor
                        power = gt.idle_power_w + (power - gt.idle_power_w) * sd.factor
                        target_temp -= 6.0 * (1.0 - sd.factor)
                    else:  # NCCL kernels spin: utilisation stays high, power drops a little
                        power = gt.idle_power_w + (power - gt.idle_power_w) * (0.5 + 0.5 * sd.factor)
            for s in job.stragglers:
                if s.rank != r.rank or not (s.start <= t < s.end):
                    continue
                sp = s.speed(t)
                pr = s.progress(t)
                if s.cause == "thermal":
                    target_temp = r.load_temp + (s.hot_temp - r.load_temp) * pr
                    clock = gt.max_sm_clock * sp - abs(float(rng.normal(0.0, 10.0)))
                    power *= 0.85 + 0.15 * sp
                elif s.cause == "clock":
                    clock = gt.max_sm_clock * sp + float(rng.normal(0.0, 5.0))
                    power *= 0.35 + 0.65 * sp
                    target_temp -= 14.0 * (1.0 - sp)
                else:  # power brake / power cap
                    power = r.load_power * (0.25 + 0.75 * sp ** 1.6) * float(rng.normal(1.0, 0.01))
                    clock = gt.max_sm_clock * sp - abs(float(rng.normal(0.0, 8.0)))
                    target_temp -= 10.0 * (1.0 - sp)
            if idle:
                util = 0.0
                power = gt.idle_power_w * float(rng.normal(1.0, 0.03))
                clock = float(gt.idle_sm_clock)
                target_temp = 34.0
                temp = target_temp + (temp - target_temp) * math.exp(-SAMPLE_PERIOD_S / 150.0)
            else:
                temp = target_temp + (temp - target_temp) * math.exp(-SAMPLE_PERIOD_S / 45.0)
            rec = {"ts": round(t, 3), "node": r.node, "gpu": r.gpu, "uuid": r.uuid, "model": gt.nvml_name,
                   "metrics": {"DCGM_FI_DEV_GPU_TEMP": int(round(temp + float(rng.normal(0.0, 0.6)))),
                               "DCGM_FI_DEV_POWER_USAGE": round(max(power, gt.idle_power_w * 0.8), 3),
                               "DCGM_FI_DEV_SM_CLOCK": int(round(clock / 15.0) * 15),
                               "DCGM_FI_DEV_GPU_UTIL": int(round(util))},
                   "job": job.name, "rank": r.rank}
            out.append((rec["ts"], 1, json.dumps(rec)))
            t += SAMPLE_PERIOD_S
    out.sort(key=lambda x: x[0])
    return out


def _labels(job: Job) -> list[dict]:
    labels: list[dict] = []
    for s in job.stragglers:
        r = job.ranks[s.rank]
        labels.append({"kind": "straggler", "job": job.name, "rank": s.rank, "node": r.node, "gpu": r.gpu,
                       "start_ts": round(s.start, 3), "end_ts": round(s.end, 3), "factor": s.factor,
                       "ramp_s": s.ramp_s, "cause": s.cause, "model": r.gpu_type.nvml_name})
    for sd in job.slowdowns:
        labels.append({"kind": "job_slowdown", "job": job.name, "start_ts": round(sd.start, 3),
                       "end_ts": round(sd.end, 3), "factor": sd.factor, "cause": sd.cause})
    if job.template.mismatch:
        eff = {g: GPU_TYPES[g].effective_tflops for g, _, _ in job.template.groups}
        fastest = max(eff.values())
        for r in job.ranks:
            if eff[r.gpu_type.key] < fastest:
                labels.append({"kind": "trap", "type": "model_mismatch", "job": job.name, "rank": r.rank,
                               "node": r.node, "gpu": r.gpu, "ts": round(job.start, 3),
                               "start_ts": round(job.start, 3), "end_ts": round(job.end, 3),
                               "model": r.gpu_type.nvml_name, "micro_batch": r.micro_batch,
                               "factor": round(eff[r.gpu_type.key] / fastest, 3)})
    rs = job.restart
    if rs is not None and not math.isnan(rs.rejoin_ts):
        r = job.ranks[rs.rank]
        end = rs.warm_end_ts if not math.isnan(rs.warm_end_ts) else rs.rejoin_ts
        labels.append({"kind": "trap", "type": "rank_restart", "job": job.name, "rank": rs.rank,
                       "node": r.node, "gpu": r.gpu, "ts": round(rs.down, 3), "up_ts": round(rs.up, 3),
                       "rejoin_ts": round(rs.rejoin_ts, 3), "end_ts": round(end, 3)})
    labels.extend(job.hiccups)
    for a, b, k in job.checkpoints:
        labels.append({"kind": "trap", "type": "checkpoint", "job": job.name, "rank": None,
                       "ts": round(b, 3), "start_ts": round(a, 3), "end_ts": round(b, 3), "step": k})
    for a, b in job.evals:
        labels.append({"kind": "trap", "type": "eval", "job": job.name, "rank": None,
                       "ts": round(a, 3), "start_ts": round(a, 3), "end_ts": round(b, 3)})
    return labels


def generate(out_dir: Path, seed: int, jobs: int = 4, hours: float = 8.0, with_model: bool = False) -> dict:
    """Write ``out_dir/trace.jsonl.gz`` and ``out_dir/labels.jsonl``; return a summary dict."""
    if jobs < 1:
        raise ValueError("jobs must be >= 1")
    if hours <= 0:
        raise ValueError("hours must be > 0")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t_end = START_TS + hours * 3600.0
    node_counter = [0]
    job_list: list[Job] = []
    job_rngs: list[np.random.Generator] = []
    restart_job = int(rng.integers(0, jobs))
    for i in range(jobs):
        jr = np.random.default_rng(rng.integers(0, 2**63))
        job = _build_job(i, jr, node_counter, START_TS, t_end)
        _plan_events(job, jr, hours, force_restart=(i == restart_job))
        job_list.append(job)
        job_rngs.append(jr)

    # GPU samples need the step-derived windows (evals, checkpoints), so the steps of each
    # job are simulated first (as arrays) and formatted lazily while merging.
    arrays = [_simulate_steps(job, jr) for job, jr in zip(job_list, job_rngs, strict=True)]
    sample_lists = [_gpu_samples(job, jr) for job, jr in zip(job_list, job_rngs, strict=True)]

    n_steps = sum(j.n_steps for j in job_list)
    n_step_records = int(sum(np.isfinite(a.compute).sum() for a in arrays))
    n_samples = sum(len(s) for s in sample_lists)
    streams = [_step_blocks(job, a, with_model) for job, a in zip(job_list, arrays, strict=True)]
    streams += [iter(s) for s in sample_lists]
    trace = out_dir / "trace.jsonl.gz"
    # mtime=0 and a fixed inner name keep the .gz bytes identical for a seed.
    with trace.open("wb") as raw, gzip.GzipFile("trace.jsonl", "wb", 4, raw, mtime=0) as gz, \
            io.TextIOWrapper(gz, encoding="utf-8") as fh:
        buf: list[str] = []
        for _, _, text in heapq.merge(*streams, key=lambda x: (x[0], x[1])):
            buf.append(text)
            if len(buf) >= 2000:
                fh.write("\n".join(buf) + "\n")
                buf.clear()
        if buf:
            fh.write("\n".join(buf) + "\n")

    labels = [lab for job in job_list for lab in _labels(job)]
    labels.sort(key=lambda d: (d.get("start_ts", d.get("ts")), d["job"], d["kind"]))
    lab_path = out_dir / "labels.jsonl"
    with lab_path.open("w", encoding="utf-8") as fh:
        for lab in labels:
            fh.write(json.dumps(lab) + "\n")

    counts: dict[str, int] = {}
    for lab in labels:
        key = lab["kind"] if lab["kind"] != "trap" else f"trap:{lab['type']}"
        counts[key] = counts.get(key, 0) + 1
    return {
        "trace": str(trace), "labels": str(lab_path), "seed": seed, "hours": hours,
        "with_model": with_model, "start_ts": START_TS, "end_ts": t_end,
        "steps": n_steps, "step_records": n_step_records, "gpu_samples": n_samples,
        "label_counts": dict(sorted(counts.items())),
        "jobs": [{
            "job": j.name, "ranks": len(j.ranks), "nodes": sorted({r.node for r in j.ranks}),
            "gpus": {gt: sum(1 for r in j.ranks if r.gpu_type.nvml_name == gt)
                     for gt in sorted({r.gpu_type.nvml_name for r in j.ranks})},
            "micro_batch": {r.gpu_type.nvml_name: r.micro_batch for r in j.ranks},
            "grad_accum": j.template.grad_accum, "steps": j.n_steps,
            "first_step": j.first_step + 1, "ckpt_every": j.ckpt_every,
            "median_step_s": round(float(np.median(j.step_times)), 3) if j.step_times else None,
        } for j in job_list],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--hours", type=float, default=8.0)
    ap.add_argument("--with-model", dest="with_model", action="store_true",
                    help="add the NVML model name to every step record")
    ap.add_argument("--without-model", dest="with_model", action="store_false",
                    help="no model in step records (default, as the design specifies)")
    ap.set_defaults(with_model=False)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    summary = generate(args.out, args.seed, args.jobs, args.hours, args.with_model)
    print(json.dumps(summary, indent=1))
    print(f"generated in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
