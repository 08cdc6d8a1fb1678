"""Straggler and job-wide slowdown detection from training step records.

Each rank's *speed factor* is its measured speed over the speed its GPU model should
give for its share of work (1.0 = as fast as its GPU model should be):

    cost_i   = compute_s_i * capability_i / samples_i   (seconds x TFLOP/s per sample)
    factor_i = reference cost / cost_i

The reference is the median cost of the rank's same-model peers in the job (when there
are at least ``min_group`` of them), else the median over all ranks of the job, which is
the catalog prior: an A100 doing an A100's share at an A100's speed scores 1.0 next to
H100s, so "slow for an H100" is told apart from "it is an A100". NVIDIA Resiliency
Extension scores a rank against the best rank (relative) and its own best (individual)
with a fixed threshold (~0.75); it cannot know what a GPU model should do.

Step records need not carry ``model`` (DESIGN.md's step record has none). A rank's GPU model
comes from the record when it has one, else from what the caller taught the detector about
the GPU it runs on (`learn_models`: (node, gpu) -> model from GPU samples and node inventories;
one dict lookup per record). A rank whose model is still unknown (or not in the catalog) is
judged without a catalog speed, on its cost per sample ``compute_s / samples``, against its
*own history*: that cost over its own baseline (the median of its first ``base_records``
records, then following it slowly while it is healthy), divided by the median of that ratio
over the job's unknown ranks (the job's drift), so a job-wide slowdown (every rank slower
together) changes no rank's factor and an older generation is not "slow" for being older.
When the rank has at least ``min_group`` *alike* ranks (the job's unknown ranks whose
baseline cost per sample lies within ``alike_tolerance`` of its own, single linkage over the
sorted costs, so each generation forms its own group), their median cost is a second
reference and both must call it slow (the factor is the less slow of the two): a rank of a
slightly slower model among alike ones is not flagged, nor noise that only one sees.

In a pipeline a rank's work per sample is its stage's layers: ``learn_layers`` (from the job's
plan, and from the acks of rebalances that moved stage boundaries) makes the cost per sample and
layer, so a stage holding more layers is not slow for it, and a re-split changes no factor.

Without its model, only a change is attributable: a rank slow from its first record cannot be
told from a rank of a slower model, and the first ``base_records`` records of a rank judge
nothing. The join (model by (node, gpu)) exists for that.

A rank is flagged by a one-sided CUSUM over its log speed deficit, with slack and limit
scaled to the job's measured noise, and cleared after a few healthy records in a row
(hysteresis: one prediction on raise, one on clear). A job-wide slowdown (every rank
slower together) changes no rank's factor; it is recognised from the job's own history,
split into "network" (step time rises beyond the slowest rank's compute) and "input"
(every rank's compute rises), and reported once per job with ``rank`` unset.

Processor contract: ``process`` / ``flush`` / ``keys`` / ``state`` / ``restore``; state is
per job (key = job name), plain JSON, so a restarted worker resumes with identical output.
A job silent for ``retire_s`` of event time (default 6 h) is retired: its open step group is
judged, its open feature windows closed, its state dropped (a job that reports again starts
over), so the state a long-running worker holds stays that of its recent jobs.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import attrgetter, itemgetter, truediv
from typing import Any

import numpy as np

from fleetwise.catalog import UnknownGpuError, lookup
from fleetwise.schemas import FeatureVector, Prediction, Record, Signal, TrainingStep
from fleetwise.schemas.fast import FastTrainingStep, TraceLine, TraceStep

__all__ = [
    "JOB_WIDE_NODE",
    "StragglerConfig",
    "StragglerDetector",
    "catalog_speed",
    "score_stragglers",
]

# node value of a job-wide prediction: it concerns every node of the job, not one GPU.
JOB_WIDE_NODE = "*"

# Mean |x_t - x_{t-1}| of i.i.d. normal noise is sigma * 2/sqrt(pi); this converts back.
_ABS_DIFF_TO_SIGMA = math.sqrt(math.pi) / 2.0


@lru_cache(maxsize=256)
def catalog_speed(model: str, dtype: str = "bf16") -> float:
    """Expected achieved TFLOP/s of a GPU model (catalog peak x family efficiency).

    GPUs without ``dtype`` in hardware (e.g. V100 and bf16) fall back to fp16, then fp32,
    which is what a mixed-precision job runs on them.
    """
    spec = lookup(model)
    for candidate in (dtype, "fp16", "fp32"):
        if spec.supports(candidate):
            return spec.capability_tflops(candidate)
    raise ValueError(f"GPU {spec.id!r} has no usable training dtype in the catalog")


@lru_cache(maxsize=4096)
def _model_id(model: str) -> str:
    """Catalog id of a reported GPU model name; the name itself when the catalog lacks it."""
    try:
        return lookup(model).id
    except UnknownGpuError:
        return model


@dataclass(frozen=True)
class StragglerConfig:
    """Detector settings. Deficits are natural-log units: 0.0513 = 5% slower."""

    # CUSUM slack per record (floor): a bit under half the smallest slowdown we must find
    # (5% -> ln(1/0.95) = 0.051), so a 5% straggler accumulates evidence and noise around
    # 1.0 does not.
    cusum_slack: float = 0.02
    # CUSUM limit (floor): on quiet jobs a 5% straggler crosses it in 2-3 records.
    cusum_limit: float = 0.05
    # On noisy jobs slack and limit scale with the job's noise sigma (per record, ln units).
    # Chosen on tuning seeds (bench/stragglers.py TUNING_SEEDS) for <= 1 false flag per
    # 1,000 job-hours at 1.5% step jitter while a 5% slowdown still crosses in ~4 records.
    noise_slack_z: float = 1.3
    noise_limit_z: float = 6.0
    noise_floor: float = 0.004  # sigma floor (ln units): timers are not better than ~0.4%
    noise_alpha: float = 0.05  # EWMA weight of one record in the noise estimate
    min_consecutive: int = 2  # records in a row beyond the slack before a raise
    clear_records: int = 4  # records whose mean deficit is under slack/2 before a clear
    # The target: a 5% slowdown found within `find_within_records` of the rank's records or
    # `find_within_s` seconds, whichever is more. A job recording more often than that needs
    # (one record per step: every 1-10 s) gets its slack floor raised, in proportion, toward the
    # deficit of a `fast_slack_slowdown` (4%: ln 1/0.96 = 0.041, under the 5% bar): evidence for
    # 5% still crosses the limit within the 60 s, while a rank 3-4% slow for minutes (a hot
    # GPU's clock trimming) no longer does, which at one record every 2 s it did several times
    # an hour. 4% was chosen on tuning seeds at 2 s records (bench/stragglers.py seeds 1-2 and
    # 11-12; docs/benchmarks.md): 5% itself found 20-minute ramps late.
    fast_slack_slowdown: float = 0.04
    find_within_records: int = 5
    find_within_s: float = 60.0
    interval_alpha: float = 0.1  # EWMA weight of one step-group spacing in the job's interval
    min_ranks: int = 3  # fewer fresh ranks than this: no cross-rank reference
    min_group: int = 4  # same-model peers needed to use them as the reference
    stale_s: float = 900.0  # a rank silent this long leaves the reference pool
    # A job silent this long (event time) is retired: its state is dropped, so a worker that
    # runs for months keeps the jobs of the last hours, not every job it ever saw.
    retire_s: float = 6 * 3600.0
    window_s: float = 300.0  # per-rank feature window
    jobwide_threshold: float = 0.05  # job-wide slowdown: >= 5% of the step time
    jobwide_records: int = 3  # step groups in a row to raise / clear a job-wide slowdown
    # Ranks of unknown GPU model: "alike" when their baseline costs per sample are within this
    # (ln units: 0.06 = 6%) of the next one's (single linkage). Catalog models that differ in
    # speed differ by 7% or more (L40 -> A40 7%, L40S -> A100 11%, H100 PCIe -> H100 NVL 10%,
    # H100 PCIe -> H200 31%), so a wider tolerance puts two models in one group, whose median is
    # neither's: a slowed rank of the faster one then looks normal. The baselines of one model's
    # ranks lie within a few percent, well inside. Chosen on the catalog; checked on tuning
    # families with close models (bench/stragglers.py, docs/benchmarks.md).
    alike_tolerance: float = 0.06
    base_records: int = 5  # records whose median is an unknown-model rank's own baseline
    # A rank that (re)joins a running job (its process restarted, or it moved to another GPU)
    # computes slowly for its first steps (CUDA and NCCL set-up, cold caches and data loader):
    # its first `rejoin_records` records back are measured, not judged. It rejoined when the job
    # judged step groups without it for more than `rejoin_groups` of its step intervals (a
    # checkpoint or an evaluation pauses every rank alike: that is no rejoin). Chosen a priori
    # (a few steps of warm-up); checked on an independent step generator's rank restarts
    # (docs/benchmarks.md, "Generators written apart from the simulator").
    rejoin_records: int = 5
    rejoin_groups: float = 3.0
    base_alpha: float = 0.005  # per healthy record, how far the own baseline follows the rank
    baseline_groups: int = 30  # healthy step groups in the job's rolling baseline
    min_baseline: int = 5  # groups needed before job-wide judgements
    dtype: str = "bf16"


def _rejoined(cfg: StragglerConfig, job: _JobState, rs: _RankState) -> bool:
    """The job judged step groups without this rank for more than `rejoin_groups` of its step
    intervals: the rank restarted (a pause of every rank is no rejoin)."""
    return bool(job.interval) and job.group_ts - rs.ts > cfg.rejoin_groups * job.interval


def _slack_floor(cfg: StragglerConfig, interval: float | None) -> float:
    """The CUSUM slack floor for a job whose step groups come every ``interval`` seconds."""
    if interval is None:
        return cfg.cusum_slack
    share = cfg.find_within_records * interval / cfg.find_within_s
    if share >= 1.0:
        return cfg.cusum_slack
    delta = -math.log(1.0 - cfg.fast_slack_slowdown)
    return delta - (delta - cfg.cusum_slack) * share


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        raise ValueError("median of no values")
    mid = n // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _median_of_sorted(ordered: Sequence[float]) -> float:
    """Middle value, or the mean of the two middle values (``ordered`` is sorted)."""
    n = len(ordered)
    if not n:
        raise ValueError("median of no values")
    mid = n // 2
    return float(ordered[mid]) if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def _step_record(record: Record | FastTrainingStep | Mapping[str, Any]) -> TrainingStep | FastTrainingStep:
    if isinstance(record, TrainingStep | FastTrainingStep):  # both validated, same attributes
        return record
    if isinstance(record, Mapping):
        return TrainingStep.model_validate(record)
    return TrainingStep.model_validate(record.model_dump())


class StragglerDetector:
    """Per-rank speed factors, straggler alerts and job-wide slowdowns from TrainingStep records.

    ``expected_speed(model) -> TFLOP/s`` gives each GPU model's expected speed (default: the
    catalog's capability); it is asked once per model. Records of one job are grouped by step;
    a group is judged when every fresh rank of the job has reported it, or when a record of
    another step arrives. ``features=False``: no per-rank FeatureVector records (for a caller
    that publishes none); predictions and state are the same either way.
    """

    def __init__(
        self,
        expected_speed: Callable[[str], float] | None = None,
        config: StragglerConfig | None = None,
        *,
        features: bool = True,
    ) -> None:
        self.config = config or StragglerConfig()
        self.features = features
        self._speed = expected_speed or (lambda model: catalog_speed(model, self.config.dtype))
        self._jobs: dict[str, _JobState] = {}
        self._keep_recent = max(5, self.config.clear_records)
        self._capabilities: dict[str | None, float | None] = {}
        # (node, gpu) -> GPU model (catalog id where the catalog knows it), from `learn_models`
        self._gpu_models: dict[tuple[str, int], str] = {}
        self._layers: dict[str, dict[int, int]] = {}  # job -> rank -> layers it holds (pipelines)
        self._next_sweep = -math.inf  # event time of the next look for silent jobs (not state)
        # Step groups that began more than stale_s before their job's newest record: the records
        # are not in event-time order (e.g. a trace written rank by rank), and ranks compared
        # step by step are then not compared at the same time. Counted for the caller to report.
        self.groups_back_in_time = 0

    # ---- GPU models of the ranks ----
    def learn_models(self, gpus: Iterable[tuple[str, int, str]]) -> int:
        """Teach the GPU model of each (node, gpu, model): a rank whose step records carry no
        ``model`` takes its GPU's (the record's own ``model`` wins when it has one). Callers feed
        it from GPU samples and node inventories (`ControlPlane` does). Names are resolved to
        catalog ids (an unknown name is kept as given: its ranks are judged alike by it).
        Not part of the saved state: it is rebuilt from telemetry and inventory, and a rank
        keeps the model it learned in its own state. Returns how many GPUs changed model."""
        known = self._gpu_models
        changed = 0
        for node, gpu, model in gpus:
            if not model:
                continue
            model_id = _model_id(model)
            if known.get((node, gpu)) != model_id:
                known[node, gpu] = model_id
                changed += 1
        return changed

    def learn_layers(self, job: str, layers: Mapping[int, int]) -> None:
        """Teach how many layers each rank of a pipeline job holds (its work per sample scales
        with them); an empty mapping forgets them. Not saved: callers rebuild it from the job's
        plan and its rebalances' acks, as `ControlPlane` does."""
        if layers:
            self._layers[job] = {int(r): max(int(n), 1) for r, n in layers.items()}
        else:
            self._layers.pop(job, None)

    def model_of(self, node: str, gpu: int) -> str | None:
        """The GPU model learned for (node, gpu) (None: not taught)."""
        return self._gpu_models.get((node, gpu))

    # ---- processor contract ----
    def process(self, records: Sequence[Record | FastTrainingStep | Mapping[str, Any]]) -> list[Record]:
        """Consume step records (event-time order); return FeatureVectors and Predictions.

        The records of a job's open step group are kept as given (not copied) until it closes.
        A complete group that leaves the job's ranks as they were (every rank reported, none
        goes stale) is judged later in the call, together with the job's next such groups
        (`_close_groups_together`: numpy over the groups' ranks); the outputs come in the order
        judging each group as it closes gives."""
        jobs = self._jobs
        if not isinstance(records, list | tuple):
            records = list(records)  # read twice below
        if not all(map(_is_step_type, set(map(type, records)))):  # else each a validated step record
            records = [_step_record(raw) for raw in records]
        retire_s, stale_s = self.config.retire_s, self.config.stale_s
        # Outputs keyed by (step group's place in this call, part, rank): see _close_groups_together.
        held: list[tuple[tuple[int, int, int], list[Record]]] = []
        deferring: dict[str, _JobState] = {}
        seq = 0
        name = job = None
        for rec in records:
            if rec.job != name:  # runs of one job's records are common: no lookup for those
                name = rec.job
                job = jobs.get(name)
                if job is None:
                    job = jobs[name] = _JobState()
            reported = job.pending
            if reported is not None and job.pending_step != rec.step:
                seq += 1
                self._close_now(name, job, seq, held)
                reported = None
            if reported is None:  # a new step group
                last = job.last_ts
                if last is not None and rec.ts < last - stale_s:
                    self.groups_back_in_time += 1
                if last is not None and rec.ts - last > retire_s:
                    # Silent past retire_s: start over, as if the sweep below had retired it.
                    seq += 1
                    self._run_deferred(name, job, held)
                    held.append(((seq, 0, -1), self._retire(name, job)))
                    job = jobs[name] = _JobState()
                    last = None
                if last is None or rec.ts > last:
                    job.last_ts = rec.ts
                reported = job.pending = {}
                job.pending_step = rec.step
            # A rank reporting twice for one step: keep the latest.
            reported[rec.rank] = rec
            # The group is complete when every rank the job expects has reported (on the first
            # step of a job the world size is unknown until the next step).
            expected = job.expected
            if expected and len(reported) >= len(expected) and all(map(reported.__contains__, expected)):
                seq += 1
                if len(reported) == len(expected) == len(job.ranks):
                    # Every rank reported: none goes stale unless the group spans stale_s.
                    times = list(map(_TS, reported.values()))
                    newest = max(times)
                    if min(times) >= newest - stale_s:
                        job.pending = None
                        job.deferred.append((seq, reported))
                        deferring[name] = job
                        if newest > job.last_ts:
                            job.last_ts = newest
                        continue
                self._close_now(name, job, seq, held)
        for name, job in deferring.items():
            self._run_deferred(name, job, held)
        if records and records[-1].ts >= self._next_sweep:
            swept: list[Record] = []
            self._sweep(records[-1].ts, swept)
            held.append(((seq + 1, 0, -1), swept))
        if len(held) > 1:
            held.sort(key=_KEY)
        return [r for _, out in held for r in out]

    def _close_now(self, name: str, job: _JobState, seq: int, held: list) -> None:
        """Judge the job's open step group now (after its deferred ones)."""
        self._run_deferred(name, job, held)
        out = self._close_group(name, job)
        if out:
            held.append(((seq, 0, -1), out))

    def _run_deferred(self, name: str, job: _JobState, held: list) -> None:
        """Judge the job's deferred step groups: runs of them together where they allow it,
        the others one by one (a job's first groups, before every rank has a noise estimate;
        a group where a rank moved)."""
        groups = job.deferred
        if not groups:
            return
        job.deferred = []
        pending = job.pending
        refused = 0  # groups in a row that could not start a run judged together
        while groups:
            done = 0
            if len(groups) >= _MIN_TOGETHER and refused < _MAX_REFUSED:
                done = self._close_groups_together(name, job, groups, held)
            if done:
                groups, refused = groups[done:], 0
                continue
            refused += 1
            seq, job.pending = groups.pop(0)
            out = self._close_group(name, job)
            if out:
                held.append(((seq, 0, -1), out))
        job.pending = pending

    def flush(self) -> list[Record]:
        """End of a replay: judge open step groups and close every open feature window."""
        out: list[Record] = []
        for name in sorted(self._jobs):
            out.extend(self._close_job(name, self._jobs[name]))
        return out

    def keys(self) -> list[str]:
        return sorted(self._jobs)

    def state(self, key: str) -> dict:
        """JSON-serialisable state of one job (a deep copy)."""
        return json.loads(json.dumps(self._jobs[key].to_state()))

    def restore(self, key: str, state: dict) -> None:
        self._jobs[key] = _JobState.from_state(json.loads(json.dumps(state)), self._keep_recent)

    def forget(self, key: str) -> None:
        self._jobs.pop(key, None)

    # ---- retiring silent jobs ----
    def _close_job(self, name: str, job: _JobState) -> list[Record]:
        """Judge the job's open step group and close its ranks' open feature windows."""
        out = self._close_group(name, job)
        for rank in sorted(job.ranks):
            rs = job.ranks[rank]
            if self._end_window(name, rank, rs, out):
                rs.close_window()
        return out

    def _retire(self, name: str, job: _JobState) -> list[Record]:
        """Close a silent job (`_close_job`) and drop its state. Open alerts are not cleared:
        the job is gone, there is nothing left to rebalance."""
        out = self._close_job(name, job)
        self._jobs.pop(name, None)
        return out

    def end_job(self, name: str) -> list[Record]:
        """The job is over (its plan withdrawn): retire it now, as a silent job is retired."""
        self._layers.pop(name, None)
        job = self._jobs.get(name)
        return [] if job is None else self._retire(name, job)

    def _sweep(self, now: float, out: list[Record]) -> None:
        """Retire the jobs silent for more than ``retire_s`` before ``now`` (the newest record's
        event time), in name order; look again a tenth of ``retire_s`` later. A job that
        reports again after that starts over, as it does when its own record finds it silent."""
        retire_s = self.config.retire_s
        self._next_sweep = now + retire_s / 10
        for name in sorted(name for name, job in self._jobs.items()
                           if job.last_ts is not None and now - job.last_ts > retire_s):
            out.extend(self._retire(name, self._jobs[name]))

    # ---- step groups ----
    def _close_group(self, name: str, job: _JobState) -> list[Record]:
        reported = job.pending
        job.pending = None
        if not reported:
            return []
        cfg = self.config
        ranks = job.ranks
        ranks_reported = sorted(reported)
        rows = list(map(reported.__getitem__, ranks_reported))
        ts = max([row.ts for row in rows])
        if job.last_ts is None or ts > job.last_ts:
            job.last_ts = ts
        out: list[Record] = []
        preds: list[Record] = []

        capabilities = self._capabilities
        gpu_models = self._gpu_models
        stage_layers = self._layers.get(name)  # a pipeline's layers per rank (work per sample)
        unknown = False  # a row of a rank whose GPU model gives no speed
        row_states: list[_RankState] = []  # each row's rank state, in row order
        for rank, row in zip(ranks_reported, rows):  # noqa: B905 (same length)
            rs = ranks.get(rank)
            if rs is not None and (rs.node != row.node or rs.gpu != row.gpu):
                # The rank moved to another GPU (restart, migration): close out the old one.
                self._end_window(name, rank, rs, out)
                if rs.alert:
                    preds.append(self._rank_prediction(
                        name, rank, rs, ts, raise_=False, reason="rank moved to another GPU",
                        factors=list(rs.recent)[-cfg.clear_records:]))
                rs = None
            if rs is None:
                rs = ranks[rank] = _RankState.new(row, self._keep_recent)
                if job.group_ts is not None:  # a rank joining a running job warms up
                    rs.warm = cfg.rejoin_records
            elif _rejoined(cfg, job, rs):
                # The job went on without this rank: it restarted. Its evidence from before
                # the gap (CUSUM, last deficit) says nothing about the process now running.
                rs.warm, rs.cusum, rs.deficit = cfg.rejoin_records, 0.0, None
                rs.run.clear()
            model = row.model or (gpu_models.get((row.node, row.gpu)) if gpu_models else None) or rs.model
            rs.model = model
            cap = rs.cap = capabilities[model] if model in capabilities else self._capability(model)
            rs.ts = row.ts
            work = row.samples or row.micro_batch or 1  # int or float: x / n == x / float(n)
            if stage_layers:
                work *= stage_layers.get(rank, 1)
            if cap:
                rs.cost = row.compute_s * cap / work if work > 0 else None
            else:
                # No catalog speed: cost per sample, judged against alike ranks / its own history.
                rs.cost = None
                rs.ucost = row.compute_s / work if work > 0 and row.compute_s > 0 else None
                unknown = True
            row_states.append(rs)

        # One pass over the job's ranks: the fresh ones (the next group waits for them), their
        # costs per GPU model (the reference pool) and every rank's noise (the job's sigma).
        cutoff = ts - cfg.stale_s
        fresh: list[int] = []
        pool: list[float] = []
        pool_costs: dict[str, list[float]] = {}
        noises: list[float] = []
        unknown_pool: list[tuple[int, _RankState]] = []  # fresh ranks without a catalog speed
        for rank, rs in ranks.items():
            if rs.ts >= cutoff:
                fresh.append(rank)
                cost = rs.cost
                if unknown and not rs.cap and rs.ucost:
                    unknown_pool.append((rank, rs))
                if cost:
                    pool.append(cost)
                    model_costs = pool_costs.get(rs.model or "")
                    if model_costs is None:
                        pool_costs[rs.model or ""] = [cost]
                    else:
                        model_costs.append(cost)
            if rs.noise is not None:
                noises.append(rs.noise)
        if fresh != sorted(fresh):
            # Ranks that joined out of rank order: take the pool in rank order all the same, so
            # its medians see the costs in one order whatever the job's history.
            fresh.sort()
            pool = [ranks[rank].cost for rank in fresh if ranks[rank].cost]
            pool_costs = {}
            for rank in fresh:
                rs = ranks[rank]
                if rs.cost:
                    pool_costs.setdefault(rs.model or "", []).append(rs.cost)
        job.expected = fresh
        references = self._references(pool_costs, pool) if len(pool) >= cfg.min_ranks else {}
        sigma = max(cfg.noise_floor, _median(noises) * _ABS_DIFF_TO_SIGMA if noises else 0.0)
        # An unknown-model rank's own baseline follows records within the job's noise, not within
        # the raised slack of a fast-recording job (which would let a slow ramp into it).
        base_slack = max(cfg.cusum_slack, cfg.noise_slack_z * sigma)
        slack = max(_slack_floor(cfg, job.next_group(ts, cfg.interval_alpha)), base_slack)
        limit = max(cfg.cusum_limit, cfg.noise_limit_z * sigma)
        alike: dict[int, tuple[float, str]] = {}
        own: tuple[float, str] | None = None
        if unknown_pool:
            unknown_pool.sort(key=_KEY)
            alike, own = self._unknown_references(unknown_pool)

        window_s = cfg.window_s
        keep_alpha = 1 - cfg.noise_alpha
        alpha = cfg.noise_alpha
        max_increment = limit / cfg.min_consecutive
        floor, log = math.floor, math.log
        start_ts = start = None
        # (zip without strict=: its keyword parse costs more than the loop body of a small group;
        # row_states has one entry per row by construction)
        for rank, row, rs in zip(ranks_reported, rows, row_states):  # noqa: B905
            cost = rs.cost
            ref = references.get(rs.model) if cost else None  # a cost implies a model
            factor = ref[0] / cost if ref else None
            if rs.cap is None and rs.ucost:  # model unknown: its own history (and alike ranks)
                cost = rs.ucost
                if own is not None and rs.base:
                    ref, factor = own, own[0] * rs.base / cost
                    peers = alike.get(rank)
                    if peers is not None:
                        # Both must call it slow: the less slow of the two factors.
                        ref = (own[0], f"{own[1]}; {peers[1]}")
                        factor = max(factor, peers[0] / cost)

            # Per-rank feature window: a record of a new window closes the previous one.
            if row.ts != start_ts:  # a group's records mostly share one timestamp
                start_ts = row.ts
                start = floor(start_ts / window_s) * window_s
            if rs.win_start != start:
                if rs.win_start is not None:
                    self._end_window(name, rank, rs, out)
                rs.open_window(start)
            rs.win_step.append(row.step_time_s)
            rs.win_compute.append(row.compute_s)
            if rs.warm:  # warming up after (re)joining: measured, not judged, not in its baseline
                rs.warm -= 1
                if factor is not None:
                    rs.win_factor.append(factor)
                if cost:
                    rs.win_cost.append(cost)
                continue
            if factor is None:
                if cost:
                    rs.win_cost.append(cost)
                    if rs.cap is None:
                        self._follow_baseline(rs, own, None, base_slack)
                continue
            rs.win_factor.append(factor)
            rs.win_cost.append(cost)  # a factor implies a cost

            deficit = -log(factor)
            previous = rs.deficit
            if previous is not None:
                jump = abs(deficit - previous)
                noise = rs.noise
                rs.noise = jump if noise is None else keep_alpha * noise + alpha * jump
            rs.deficit = deficit
            rs.ref = ref[1]  # type: ignore[index]
            if rs.cap is None:
                self._follow_baseline(rs, own, deficit, base_slack)

            # Alert state: a one-sided CUSUM over the deficit raises, a healthy run clears. With
            # no alert, the CUSUM at 0 and the deficit within the slack there is nothing to judge
            # (as `_judge` skips such a record): the run beyond the slack is broken.
            if not rs.alert and rs.cusum == 0.0 and not deficit > slack:
                rs.recent.append(factor)
                if rs.run:
                    rs.run.clear()
                continue
            judged = self._judge(name, rank, rs, [factor], [deficit], [0] if deficit > slack else [],
                                 [slack], [limit], [max_increment], [ts])
            if judged:
                preds.append(judged[0][1])

        jw = self._job_wide(name, job, rows, row_states, ts, own)
        if jw is not None:
            preds.append(jw)
        return out + preds if preds else out

    def _capability(self, model: str | None) -> float | None:
        """Expected TFLOP/s of a GPU model (None: unknown), asked of ``expected_speed`` once."""
        if model in self._capabilities:
            return self._capabilities[model]
        cap = None
        if model:
            try:
                cap = float(self._speed(model))
            except (KeyError, ValueError):
                cap = None  # unknown model: this rank gets features but no speed factor
        self._capabilities[model] = cap
        return cap

    def _unknown_references(self, pool: list[tuple[int, _RankState]]
                            ) -> tuple[dict[int, tuple[float, str]], tuple[float, str] | None]:
        """References of the job's fresh ranks without a catalog speed (``pool``, rank order):
        rank -> (median cost per sample of its alike group, label) for groups of at least
        ``min_group``; and (median of cost / own baseline over the ranks that have one, label)
        when at least ``min_ranks`` do (None otherwise), the job's drift their own history is
        divided by. Ranks with an uncatalogued model name are alike by that name; the others by
        their baseline cost per sample (their current one before they have a baseline)."""
        cfg = self.config
        groups: dict[Any, list[tuple[int, _RankState]]] = {}
        unnamed: list[tuple[float, int, _RankState]] = []
        for rank, rs in pool:
            if rs.model:
                groups.setdefault(rs.model, []).append((rank, rs))
            else:
                unnamed.append((math.log(rs.base or rs.ucost), rank, rs))
        unnamed.sort(key=_FIRST_TWO)
        group, previous = 0, None
        for value, rank, rs in unnamed:
            if previous is not None and value - previous > cfg.alike_tolerance:
                group += 1
            groups.setdefault(group, []).append((rank, rs))
            previous = value
        alike: dict[int, tuple[float, str]] = {}
        for members in groups.values():
            if len(members) >= cfg.min_group:
                ref = (_median([rs.ucost for _, rs in members]), f"{len(members)} alike ranks, model unknown")
                for rank, _ in members:
                    alike[rank] = ref
        based = [rs.ucost / rs.base for _, rs in pool if rs.base]
        own = None
        if len(based) >= cfg.min_ranks:
            own = (_median(based), f"own history, drift of {len(based)} ranks")
        return alike, own

    def _follow_baseline(self, rs: _RankState, own: tuple[float, str] | None, deficit: float | None,
                         slack: float) -> None:
        """An unknown-model rank's own baseline (cost per sample): the median of its first
        ``base_records`` records that no reference calls slow, then, on healthy records
        (within the slack of its reference and of its own history, no alert), moved by
        ``base_alpha`` of the log gap toward its cost over the job's drift."""
        cfg = self.config
        if rs.alert or (deficit is not None and deficit > slack):
            return
        cost = rs.ucost
        if rs.base is None:
            rs.base_acc.append(cost)
            if len(rs.base_acc) >= cfg.base_records:
                rs.base = _median(rs.base_acc)
                rs.base_acc = []
            return
        if own is None:
            return
        gap = math.log(cost / (rs.base * own[0]))
        if abs(gap) < slack and (deficit is None or abs(deficit) < slack):
            rs.base *= math.exp(cfg.base_alpha * gap)

    def _references(self, pool_costs: dict[str, list[float]], pool: list[float]
                    ) -> dict[str, tuple[float, str]]:
        """Reference cost per GPU model: same-model peers when enough, else the job median."""
        refs: dict[str, tuple[float, str]] = {}
        prior: tuple[float, str] | None = None  # the job median, computed when a model needs it
        for model, costs in pool_costs.items():
            if len(costs) >= self.config.min_group:
                refs[model] = (_median(costs), f"{len(costs)} same-model peers")
                continue
            if prior is None:
                prior = (_median(pool), f"catalog prior over {len(pool)} ranks")
            refs[model] = prior
        return refs

    def _close_groups_together(self, name: str, job: _JobState, groups: list[tuple[int, dict]],
                               held: list) -> int:
        """Judge the leading run of a job's deferred step groups at once, each rank's records as a
        column of numpy arrays; returns how many groups it judged: those before the first where
        a rank is not on the GPU or model it had or has no speed factor, or 0 (nothing changed)
        when fewer than `_MIN_TOGETHER` or a rank has no noise estimate yet. Gives what
        `_close_group` gives group by group, to the bit: the same float operations in the same
        order (costs, medians, logs, the noise EWMA), the per-rank CUSUM and alerts by `_judge`.
        Outputs go to ``held`` keyed (group, part, rank), the parts in `_close_group`'s order:
        closed feature windows, rank predictions, the job-wide one."""
        cfg = self.config
        ranks = job.expected  # sorted; every deferred group has exactly these ranks
        states = [job.ranks[rank] for rank in ranks]
        n_ranks = len(ranks)
        caps = [self._capability(rs.model) for rs in states]
        if (n_ranks < cfg.min_ranks or not all(caps) or job.jobwide.get("basis", "cap") != "cap"
                or any(rs.noise is None or rs.deficit is None or rs.warm for rs in states)):
            return 0
        if any(_rejoined(cfg, job, rs) for rs in states):
            return 0  # a rank rejoins: one by one starts its warm-up
        gpu_models = self._gpu_models
        if gpu_models and any(gpu_models.get((rs.node, rs.gpu), rs.model) != rs.model for rs in states):
            return 0  # a rank's GPU model was learned anew: one by one takes it up
        # The leading groups whose ranks stay on their GPUs with their models (else one by one).
        rows = [group[rank] for _, group in groups for rank in ranks]  # group-major
        usable = len(groups)
        for attribute, get in (("node", _NODE), ("gpu", _GPU), ("model", _MODEL)):
            mine = [getattr(rs, attribute) for rs in states] * usable
            got = list(map(get, rows[:usable * n_ranks]))
            if attribute == "model" and None in got:  # a record without one: its rank's (learned)
                got = [theirs if m is None else m for m, theirs in zip(got, mine, strict=True)]
            if got != mine:
                usable = next(i for i, (a, b) in enumerate(zip(got, mine, strict=True)) if a != b) // n_ranks
        if usable < _MIN_TOGETHER:
            return 0
        groups, rows = groups[:usable], rows[:usable * n_ranks]
        n_groups = usable
        shape, n = (n_groups, n_ranks), n_groups * n_ranks
        times = np.fromiter(map(_TS, rows), np.float64, n).reshape(shape)
        step = np.fromiter(map(_STEP_TIME, rows), np.float64, n).reshape(shape)
        compute = np.fromiter(map(_COMPUTE, rows), np.float64, n).reshape(shape)
        stage_layers = self._layers.get(name, {})
        work = np.array([(row.samples or row.micro_batch or 1) * stage_layers.get(row.rank, 1)
                         for row in rows], np.float64).reshape(shape)
        costs = compute * np.array(caps) / work  # as (compute_s * cap) / work per record
        costed = (costs > 0.0).all(axis=1)  # a record without a cost has no factor: one by one
        if not costed.all():
            n_groups = int(np.argmin(costed))
            if n_groups < _MIN_TOGETHER:
                return 0
            groups, shape = groups[:n_groups], (n_groups, n_ranks)
            times, step = times[:n_groups], step[:n_groups]
            compute, costs = compute[:n_groups], costs[:n_groups]
            n = n_groups * n_ranks

        # Each group's reference cost per rank (its model's peers, or the job's median).
        group_ts = times.max(axis=1)
        models: dict[str, list[int]] = {}
        for col, rs in enumerate(states):
            models.setdefault(rs.model, []).append(col)  # type: ignore[arg-type]
        refs = np.empty(shape)
        labels: list[str] = [""] * n_ranks
        prior = None
        for cols in models.values():
            if len(cols) >= cfg.min_group:
                refs[:, cols] = _row_medians(costs[:, cols])[:, None]
                label = f"{len(cols)} same-model peers"
            else:
                if prior is None:
                    prior = _row_medians(costs)
                refs[:, cols] = prior[:, None]
                label = f"catalog prior over {n_ranks} ranks"
            for col in cols:
                labels[col] = label
        factors = refs / costs
        deficits = -np.fromiter(map(math.log, factors.ravel().tolist()), np.float64, n).reshape(shape)

        # The noise EWMA (each group's sigma is the median noise before it), slack and limit.
        previous = np.vstack([[rs.deficit for rs in states], deficits[:-1]])
        jumps = np.abs(deficits - previous)
        noise = np.array([rs.noise for rs in states], np.float64)
        noise_before = np.empty(shape)
        keep_alpha, alpha = 1 - cfg.noise_alpha, cfg.noise_alpha
        for g in range(n_groups):
            noise_before[g] = noise
            noise = keep_alpha * noise + alpha * jumps[g]
        sigma = np.maximum(cfg.noise_floor, _row_medians(noise_before) * _ABS_DIFF_TO_SIGMA)
        floors = [_slack_floor(cfg, job.next_group(t, cfg.interval_alpha)) for t in group_ts.tolist()]
        slack = np.maximum(np.array(floors), cfg.noise_slack_z * sigma)
        limit = np.maximum(cfg.cusum_limit, cfg.noise_limit_z * sigma)
        max_increment = limit / cfg.min_consecutive
        above = deficits > slack[:, None]

        seqs = [seq for seq, _ in groups]
        slacks, limits, max_increments, ts_list = (
            slack.tolist(), limit.tolist(), max_increment.tolist(), group_ts.tolist())
        window_s = cfg.window_s
        starts = np.floor(times / window_s) * window_s  # as floor(ts / window_s) * window_s
        shared_bounds = None
        if (starts == starts[:, :1]).all():  # the usual case: one window start per group
            shared_bounds = _segments(starts[:, 0])
        f_cols, c_cols, d_cols = factors.T.tolist(), costs.T.tolist(), deficits.T.tolist()
        step_cols, compute_cols = step.T.tolist(), compute.T.tolist()
        which, where = np.nonzero(above.T)  # each rank's records beyond the slack, rank by rank
        above_ends, above_all = np.cumsum(np.bincount(which, minlength=n_ranks)).tolist(), where.tolist()
        last_times, noises = times[-1].tolist(), noise.tolist()
        for col, (rank, rs) in enumerate(zip(ranks, states, strict=True)):
            f_col, c_col = f_cols[col], c_cols[col]
            segments = shared_bounds or _segments(starts[:, col])
            if self.features:
                self._extend_windows(name, rank, rs, segments, step_cols[col], compute_cols[col], f_col,
                                     c_col, seqs, held)
            else:
                _extend_windows_quietly(rs, segments, step_cols[col], compute_cols[col], f_col, c_col)
            rs.cap, rs.ref = caps[col], labels[col]
            judged = self._judge(name, rank, rs, f_col, d_cols[col],
                                 above_all[above_ends[col - 1] if col else 0:above_ends[col]],
                                 slacks, limits, max_increments, ts_list)
            for g, pred in judged:
                held.append(((seqs[g], 1, rank), [pred]))
            rs.ts, rs.cost, rs.deficit, rs.noise = last_times[col], c_col[-1], d_cols[col][-1], noises[col]

        # Job-wide: each group's median cost, median step time and unhidden communication.
        step_med = _row_medians(step).tolist()
        comm = np.maximum(0.0, _row_medians(step) - compute.max(axis=1)).tolist()
        cost_med = _row_medians(costs).tolist()
        for g in range(n_groups):
            pred = self._job_wide_step(name, job, cost_med[g], step_med[g], comm[g], ts_list[g])
            if pred is not None:
                held.append(((seqs[g], 2, 0), [pred]))
        return n_groups

    def _extend_windows(self, name: str, rank: int, rs: _RankState, segments: list[tuple[int, int, float]],
                        step: list[float], compute: list[float], factors: list[float], costs: list[float],
                        seqs: list[int], held: list) -> None:
        """A rank's records into its feature windows, a run of records of one window at a time:
        a record of a new window closes the previous one (its FeatureVector keyed to that group)."""
        for first, end, start in segments:
            if rs.win_start != start:
                if rs.win_start is not None:
                    closed: list[Record] = []
                    self._end_window(name, rank, rs, closed)
                    if closed:
                        held.append(((seqs[first], 0, rank), closed))
                rs.open_window(start)
            rs.win_step.extend(step[first:end])
            rs.win_compute.extend(compute[first:end])
            rs.win_factor.extend(factors[first:end])
            rs.win_cost.extend(costs[first:end])

    # ---- per-rank alerts ----
    def _judge(self, name: str, rank: int, rs: _RankState, factors: list[float], deficits: list[float],
               above: list[int], slacks: list[float], limits: list[float], max_increments: list[float],
               times: list[float]) -> list[tuple[int, Prediction]]:
        """A rank's alert state over its next records, in order: a one-sided CUSUM over the
        deficit raises (each increment capped, so one outlier record cannot raise on its own,
        and ``min_consecutive`` records beyond the slack in a row), the mean deficit of the last
        ``clear_records`` records under half the slack clears (hysteresis: a rank hovering near
        the slack does not clear and re-raise). Each record comes with its step group's slack,
        limit, increment cap and time; ``above``: the indices of the records whose deficit
        exceeds the slack, in order. Returns (record index, prediction) pairs and leaves the
        rank's state as after the last record.

        Records where nothing can change (no alert, the CUSUM at 0, the deficit within the
        slack: the CUSUM stays 0 and the run of records beyond the slack is broken) are skipped,
        so a healthy rank costs a few steps per record beyond its slack."""
        cfg = self.config
        min_consecutive, clear_records = cfg.min_consecutive, cfg.clear_records
        recent0, run0 = rs.recent, rs.run  # as they were before these records (updated at the end)
        cusum, alert, clear_run = rs.cusum, rs.alert, rs.clear_run
        run = len(run0)  # the length of the run deque: records beyond the slack in a row, <= _RUN_KEEP
        run_end = -1  # the run's last record (-1: before these; an alert freezes the run)
        judged: list[tuple[int, Prediction]] = []
        n, n_above, k, i = len(factors), len(above), 0, 0
        while i < n:
            if not alert and cusum == 0.0:
                while k < n_above and above[k] < i:
                    k += 1
                if k == n_above:  # no record beyond the slack from i on
                    run = 0
                    break
                if above[k] > i:
                    run = 0
                i = above[k]
            if alert:
                clear_run = min(clear_run + 1, clear_records)
                if clear_run >= clear_records:
                    tail = [-math.log(f) for f in _last(recent0, factors, i, clear_records)]
                    if sum(tail) / len(tail) < slacks[i] / 2:
                        judged.append((i, self._rank_prediction(
                            name, rank, rs, times[i], raise_=False, reason="recovered",
                            factors=_last(recent0, factors, i, clear_records),
                            slack=slacks[i], limit=limits[i])))
                        alert, cusum, clear_run, run = False, 0.0, 0, 0
                i += 1
                continue
            deficit, slack = deficits[i], slacks[i]
            increment = deficit - slack
            if max_increments[i] < increment:
                increment = max_increments[i]
            cusum += increment
            if not cusum > 0.0:
                cusum = 0.0
            run, run_end = (min(run + 1, _RUN_KEEP) if deficit > slack else 0), i
            if cusum >= limits[i] and run >= min_consecutive:
                alert, clear_run = True, 0
                judged.append((i, self._rank_prediction(
                    name, rank, rs, times[i], raise_=True, reason=_raise_reason(rs),
                    factors=_last(run0, factors, i, min(run, 5)), cusum=cusum,
                    slack=slack, limit=limits[i])))
            i += 1
        rs.cusum, rs.alert, rs.clear_run = cusum, alert, clear_run
        if not run:
            run0.clear()
        elif run_end >= 0:  # (else the run is as before: an alert froze it)
            run_now = _last(run0, factors, run_end, run)
            run0.clear()
            run0.extend(run_now)
        recent0.extend(factors)  # (a deque of the last few)
        return judged

    def _rank_prediction(self, name: str, rank: int, rs: _RankState, ts: float, *, raise_: bool,
                         reason: str, factors: list[float], cusum: float = 0.0,
                         slack: float | None = None, limit: float | None = None) -> Prediction:
        """``factors``: the records the reported factor is the median of (a raise: the run beyond
        the slack, at most 5; a clear: the last few)."""
        factor = round(_median(factors), 4) if factors else None
        probability = min(1.0, cusum / limit) if raise_ and limit else 0.0
        signals = [
            Signal(name="speed_factor", value=factor, weight=1.0),
            Signal(name="model", value=rs.model),
            Signal(name="expected_tflops", value=rs.cap),
            Signal(name="reference", value=rs.ref),
        ]
        if slack is not None:
            signals.append(Signal(name="noise_slack", value=round(slack, 5)))
        return Prediction(
            id=f"straggler:{rs.node}/{rs.gpu}:{int(ts)}", type="straggler", ts=ts,
            node=rs.node, gpu=rs.gpu, job=name, rank=rank, probability=round(probability, 4),
            horizon_h=0.0, alert=raise_, signals=signals, factor=factor, reason=reason,
        )

    # ---- job-wide slowdowns ----
    def _job_wide(self, name: str, job: _JobState, rows: list[Any], row_states: list[_RankState],
                  ts: float, own: tuple[float, str] | None = None) -> Prediction | None:
        cfg = self.config
        costs = [rs.cost for rs in row_states]
        if len(costs) < cfg.min_ranks:
            return None
        basis = "cap"
        if None in costs:
            # A rank without a catalog speed: the job's drift instead (the median over its unknown
            # ranks of cost per sample over own baseline: which generations report does not move
            # it). The rolling baseline starts over when the basis changes (e.g. once the ranks'
            # models are learned).
            if own is None:
                return None
            basis = "own"
            costs = [own[0]]
        jw = job.jobwide
        if jw.get("basis", "cap") != basis:
            jw["basis"] = basis
            jw["base"] = []
            jw["run"] = 0
        step = _median([row.step_time_s for row in rows])
        # Communication the slowest rank could not hide: a straggler raises step time and
        # the slowest compute together (unchanged), a slow network raises only this.
        comm = max(0.0, step - max([row.compute_s for row in rows]))
        return self._job_wide_step(name, job, _median(costs), step, comm, ts)

    def _job_wide_step(self, name: str, job: _JobState, cost: float, step: float, comm: float,
                       ts: float) -> Prediction | None:
        """One step group's median cost, median step time and communication time against the
        job's rolling baseline: a raise after ``jobwide_records`` slow groups, a clear after as
        many healthy ones."""
        cfg = self.config
        jw = job.jobwide
        base = jw["base"]
        baseline = job.baseline
        if baseline is None or baseline.rows is not base:
            baseline = job.baseline = _SortedBaseline(base)
        state_now = None
        if len(base) >= cfg.min_baseline:
            base_cost, base_step, base_comm = baseline.medians()
            input_excess = cost / base_cost - 1.0
            network_excess = (comm - base_comm) / base_step
            slow = max(input_excess, network_excess) > cfg.jobwide_threshold
            cause = "input" if input_excess >= network_excess else "network"
            state_now = (slow, cause, base_step / step, input_excess, network_excess)
        if state_now is None or not state_now[0]:
            jw["run"] = 0
            if not jw["alert"]:
                baseline.append([cost, step, comm], cfg.baseline_groups)
                return None
            jw["clear"] += 1
            if jw["clear"] < cfg.jobwide_records:
                return None
            jw.update(alert=False, clear=0)
            return self._job_prediction(name, ts, False, jw["cause"], state_now, "recovered")
        jw["clear"] = 0
        if jw["alert"]:
            return None
        jw["run"] += 1
        if jw["run"] < cfg.jobwide_records:
            return None
        jw.update(alert=True, run=0, cause=state_now[1])
        return self._job_prediction(name, ts, True, state_now[1], state_now, f"job-wide: {state_now[1]}")

    def _job_prediction(self, name: str, ts: float, alert: bool, cause: str | None,
                        now: tuple | None, reason: str) -> Prediction:
        factor = round(now[2], 4) if now else None
        signals = [Signal(name="cause", value=cause), Signal(name="step_speed_factor", value=factor)]
        if now:
            signals += [Signal(name="compute_excess", value=round(now[3], 4)),
                        Signal(name="communication_excess", value=round(now[4], 4))]
        return Prediction(
            id=f"straggler:{name}/{JOB_WIDE_NODE}:{int(ts)}", type="straggler", ts=ts,
            node=JOB_WIDE_NODE, job=name, probability=1.0 if alert else 0.0, horizon_h=0.0,
            alert=alert, signals=signals, factor=factor,
            reason=reason if alert else f"job-wide {cause}: {reason}",
        )

    # ---- per-rank feature windows ----
    def _end_window(self, name: str, rank: int, rs: _RankState, out: list[Record]) -> bool:
        """End a rank's open feature window: False when none is open or it holds no record;
        else its FeatureVector goes to ``out`` (when ``features``). The window's median cost
        is kept either way (the next window's trend): state does not depend on ``features``."""
        step, compute = rs.win_step, rs.win_compute
        if rs.win_start is None or not step:
            return False
        cost = _window_cost(rs.win_cost)
        trend = cost / rs.prev_cost - 1.0 if cost and rs.prev_cost else None
        rs.prev_cost = cost
        if not self.features:
            return True
        window_s = self.config.window_s
        values = {
            "median_step_s": _median(step),
            "median_compute_s": _median(compute),
            "compute_trend": trend,
            "speed_factor": _median(rs.win_factor) if rs.win_factor else None,
            "wait_share": _median_wait_share(compute, step),
        }
        out.append(FeatureVector.trusted(scope="rank", ts=float(rs.win_start + window_s), window_s=window_s,
                                         node=rs.node, gpu=rs.gpu, model=rs.model, job=name, rank=rank,
                                         values=values))
        return True


def _median_wait_share(compute: list[float], step: list[float]) -> float:
    """Median over records of max(0, 1 - compute / step time), the share of a step spent waiting.

    Computed from the sorted compute/step ratios: x -> max(0, 1 - x) reverses their order (and
    rounding keeps that exact), so the middle shares are those of the middle ratios, the same
    values as sorting every record's share.
    """
    if len(compute) != len(step):
        raise ValueError("one compute time per step time")
    ratios = sorted(map(truediv, compute, step))
    n = len(ratios)
    if not n:
        raise ValueError("median of no values")
    mid = n // 2
    if n % 2:
        return float(max(0.0, 1.0 - ratios[mid]))
    # the shares' middle pair, lower one first: the ratios' middle pair reversed
    return (max(0.0, 1.0 - ratios[mid]) + max(0.0, 1.0 - ratios[mid - 1])) / 2.0


class _RankState:
    """One rank's detector state. ``to_state`` gives the saved dict: these names in this order,
    with the open feature window as ``"win": {"start", "step", "compute", "factor", "cost"}``
    (None: no open window). The window's lists are reused from one window to the next."""

    __slots__ = ("node", "gpu", "model", "cap", "ts", "cost", "deficit", "noise", "cusum", "run", "recent",
                 "alert", "clear_run", "ref", "win_start", "win_step", "win_compute", "win_factor",
                 "win_cost", "prev_cost", "ucost", "base", "base_acc", "warm")

    @classmethod
    def new(cls, row: Any, keep_recent: int) -> _RankState:
        rs = cls()
        rs.node, rs.gpu, rs.model, rs.cap, rs.ts = row.node, row.gpu, row.model, None, row.ts
        rs.cost = rs.deficit = rs.noise = None
        rs.cusum = 0.0
        # factors of the current run of records beyond the slack; of the last few records
        rs.run, rs.recent = deque(maxlen=_RUN_KEEP), deque(maxlen=keep_recent)
        rs.alert, rs.clear_run = False, 0
        rs.ref = rs.prev_cost = None
        rs.win_start = None  # event time the open feature window starts at (None: none open)
        rs.win_step, rs.win_compute, rs.win_factor, rs.win_cost = [], [], [], []
        # GPU model unknown: cost per sample, own baseline, the records it is the median of
        rs.ucost = rs.base = None
        rs.base_acc = []
        rs.warm = 0  # records left of its warm-up after (re)joining a running job
        return rs

    def open_window(self, start: float) -> None:
        self.win_start = start
        self.win_step.clear()
        self.win_compute.clear()
        self.win_factor.clear()
        self.win_cost.clear()

    def close_window(self) -> None:
        self.open_window(0.0)
        self.win_start = None

    def to_state(self) -> dict[str, Any]:
        win = None if self.win_start is None else {
            "start": self.win_start, "step": self.win_step, "compute": self.win_compute,
            "factor": self.win_factor, "cost": self.win_cost}
        return {"node": self.node, "gpu": self.gpu, "model": self.model, "cap": self.cap, "ts": self.ts,
                "cost": self.cost, "deficit": self.deficit, "noise": self.noise, "cusum": self.cusum,
                "run": list(self.run), "recent": list(self.recent), "alert": self.alert,
                "clear_run": self.clear_run, "ref": self.ref, "win": win, "prev_cost": self.prev_cost,
                "ucost": self.ucost, "base": self.base, "base_acc": list(self.base_acc), "warm": self.warm}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], keep_recent: int) -> _RankState:
        rs = cls()
        rs.node, rs.gpu, rs.model, rs.cap, rs.ts = (
            state["node"], state["gpu"], state["model"], state["cap"], state["ts"])
        rs.cost, rs.deficit, rs.noise, rs.cusum = (
            state["cost"], state["deficit"], state["noise"], state["cusum"])
        rs.run, rs.recent = deque(state["run"], maxlen=_RUN_KEEP), deque(state["recent"], maxlen=keep_recent)
        rs.alert, rs.clear_run = state["alert"], state["clear_run"]
        rs.ref, rs.prev_cost = state["ref"], state["prev_cost"]
        win = state["win"]
        rs.win_start = None if win is None else win["start"]
        rs.win_step, rs.win_compute, rs.win_factor, rs.win_cost = (
            ([], [], [], []) if win is None else (win["step"], win["compute"], win["factor"], win["cost"]))
        # (a state saved before ranks of unknown model were judged has none of these)
        rs.ucost, rs.base = state.get("ucost"), state.get("base")
        rs.base_acc = list(state.get("base_acc", []))
        rs.warm = state.get("warm", 0)
        return rs


class _JobState:
    """One job's detector state; ``to_state`` gives the saved JSON layout:
    ``{"ranks": {rank: ...}, "pending": {"step", "records": {rank: row}} | None, "expected": [rank],
    "jobwide": {"base", "alert", "cause", "run", "clear"}, "last_ts": ts, "group_ts": ts,
    "interval": s}`` (rank keys as strings in JSON)."""

    __slots__ = ("ranks", "pending", "pending_step", "expected", "jobwide", "baseline", "last_ts", "deferred",
                 "group_ts", "interval")

    def __init__(self) -> None:
        self.ranks: dict[int, _RankState] = {}
        # the open step group: rank -> its step record (None: no open group)
        self.pending: dict[int, Any] | None = None
        self.pending_step: int | None = None
        self.expected: list[int] = []  # the ranks the open step group waits for
        self.jobwide: dict[str, Any] = {"base": [], "alert": False, "cause": None, "run": 0, "clear": 0}
        self.baseline: _SortedBaseline | None = None  # derived from jobwide["base"]; not saved
        self.last_ts: float | None = None  # newest event time of the job's records (retiring)
        # complete step groups judged later in the same `process` call: (place, rank -> record)
        self.deferred: list[tuple[int, dict[int, Any]]] = []
        self.group_ts: float | None = None  # the newest judged step group's time
        self.interval: float | None = None  # EWMA of the spacing of its step groups, seconds

    def next_group(self, ts: float, alpha: float) -> float | None:
        """A step group at ``ts`` is judged: the job's group spacing (EWMA) with it."""
        if self.group_ts is None or ts > self.group_ts:
            if self.group_ts is not None:
                gap = ts - self.group_ts
                if self.interval is None:
                    self.interval = gap
                else:
                    self.interval += alpha * (gap - self.interval)
            self.group_ts = ts
        return self.interval

    def to_state(self) -> dict[str, Any]:
        pending = None
        if self.pending is not None:
            pending = {"step": self.pending_step,
                       "records": {rank: _row_state(rec) for rank, rec in self.pending.items()}}
        return {"ranks": {rank: rs.to_state() for rank, rs in self.ranks.items()}, "pending": pending,
                "expected": self.expected, "jobwide": self.jobwide, "last_ts": self.last_ts,
                "group_ts": self.group_ts, "interval": self.interval}

    @classmethod
    def from_state(cls, state: Mapping[str, Any], keep_recent: int) -> _JobState:
        job = cls()
        job.ranks = {int(rank): _RankState.from_state(rs, keep_recent) for rank, rs in state["ranks"].items()}
        pending = state["pending"]
        if pending is not None:
            job.pending = {int(rank): _RestoredRow(row) for rank, row in pending["records"].items()}
            job.pending_step = pending["step"]
        job.expected = state["expected"]
        job.jobwide = state["jobwide"]
        # (a state saved before jobs were retired has no last_ts: its ranks' newest record)
        job.last_ts = state.get("last_ts", max((rs.ts for rs in job.ranks.values()), default=None))
        job.group_ts, job.interval = state.get("group_ts"), state.get("interval")  # (not saved before)
        return job


class _SortedBaseline:
    """A job's rolling job-wide baseline (its state's ``[[cost, step, comm], ...]`` list, oldest
    first) kept together with each column sorted, so its medians cost no sort per step group."""

    __slots__ = ("rows", "columns")

    def __init__(self, rows: list[list[float]]) -> None:
        self.rows = rows
        self.columns = [sorted(row[i] for row in rows) for i in range(3)]

    def medians(self) -> tuple[float, float, float]:
        cost, step, comm = self.columns
        return _median_of_sorted(cost), _median_of_sorted(step), _median_of_sorted(comm)

    def append(self, row: list[float], keep: int) -> None:
        """Add the newest group's row, drop the oldest beyond ``keep``."""
        self.rows.append(row)
        for i, column in enumerate(self.columns):
            bisect.insort(column, row[i])
        while len(self.rows) > keep:
            oldest = self.rows.pop(0)
            for i, column in enumerate(self.columns):
                del column[bisect.bisect_left(column, oldest[i])]


class _RestoredRow:
    """A pending step record restored from a saved state row (``_row_state``'s inverse):
    the attributes ``_close_group`` reads, with the row's ``work`` as ``samples``."""

    __slots__ = ("ts", "rank", "node", "gpu", "step_time_s", "compute_s", "samples", "micro_batch", "model")

    def __init__(self, row: Mapping[str, Any]) -> None:
        self.ts, self.rank, self.node, self.gpu = row["ts"], row["rank"], row["node"], row["gpu"]
        self.step_time_s, self.compute_s, self.model = row["step_time_s"], row["compute_s"], row["model"]
        self.samples, self.micro_batch = row["work"], None


def _row_state(rec: Any) -> dict[str, Any]:
    """A pending step record as a row of the saved state."""
    return {
        "ts": rec.ts, "rank": rec.rank, "node": rec.node, "gpu": rec.gpu,
        "step_time_s": rec.step_time_s, "compute_s": rec.compute_s,
        "work": float(rec.samples or rec.micro_batch or 1), "model": rec.model,
    }


_MIN_TOGETHER = 4  # deferred step groups of a job from which judging them together pays off
_MAX_REFUSED = 3  # groups one by one in a row after which the rest of a call's go one by one
_KEY = itemgetter(0)
_FIRST_TWO = itemgetter(0, 1)
_TS, _NODE, _GPU, _MODEL = attrgetter("ts"), attrgetter("node"), attrgetter("gpu"), attrgetter("model")
_STEP_TIME, _COMPUTE = attrgetter("step_time_s"), attrgetter("compute_s")


def _window_cost(costs: list[float]) -> float | None:
    """A closed window's median cost (the next window's trend is against it)."""
    return _median(costs) if costs else None


def _extend_windows_quietly(rs: _RankState, segments: list[tuple[int, int, float]], step: list[float],
                            compute: list[float], factors: list[float], costs: list[float]) -> None:
    """`StragglerDetector._extend_windows` without FeatureVectors: the same state, reached
    without the windows that open and close within these records, of which only the last
    closed one's median cost stays (as ``prev_cost``)."""
    carried = rs.win_start == segments[0][2]  # the first records continue the open window
    if not carried and rs.win_start is not None and rs.win_step:
        rs.prev_cost = _window_cost(rs.win_cost)
    if len(segments) > 1:
        first, end, _ = segments[-2]
        last_closed = costs[first:end]
        in_window = rs.win_cost + last_closed if carried and len(segments) == 2 else last_closed
        rs.prev_cost = _window_cost(in_window)
        carried = False
    first, end, start = segments[-1]
    if not carried:
        rs.open_window(start)
    rs.win_step.extend(step[first:end])
    rs.win_compute.extend(compute[first:end])
    rs.win_factor.extend(factors[first:end])
    rs.win_cost.extend(costs[first:end])


def _row_medians(values: np.ndarray) -> np.ndarray:
    """Each row's median as `_median` gives it: the middle value, or (lower + upper) / 2."""
    ordered = np.sort(values, axis=1)
    mid = ordered.shape[1] // 2
    return ordered[:, mid] if ordered.shape[1] % 2 else (ordered[:, mid - 1] + ordered[:, mid]) / 2.0


def _segments(starts: np.ndarray) -> list[tuple[int, int, float]]:
    """(first, end, value) of each run of equal values."""
    cuts = [0, *(np.flatnonzero(starts[1:] != starts[:-1]) + 1).tolist(), len(starts)]
    values = starts.tolist()
    return [(a, b, values[a]) for a, b in zip(cuts, cuts[1:], strict=False)]


_RUN_KEEP = 8  # factors kept of a rank's current run beyond the slack (a raise reports the last 5)


def _last(head: Iterable[float], values: list[float], i: int, k: int) -> list[float]:
    """The last ``k`` of ``head`` followed by ``values[:i + 1]`` (all of them when fewer),
    without reading ``head`` when ``values`` has enough."""
    if k <= i + 1:
        return values[i + 1 - k:i + 1]
    return (list(head) + values[:i + 1])[-k:]


def _raise_reason(rs: _RankState) -> str:
    """Why a rank is raised: against its GPU model's speed, or (model unknown) its references."""
    if rs.cap:
        return "slower than its GPU model should be"
    if rs.ref and "alike" in rs.ref:
        return "slower than its own history and its alike ranks (GPU model unknown)"
    return "slower than its own history (GPU model unknown)"


def _is_step_type(kind: type) -> bool:
    """Records of this type are validated steps, with the attributes the detector reads (a
    `TraceLine` here is a step: the replay hands over only those as steps)."""
    return issubclass(kind, FastTrainingStep | TrainingStep | TraceLine | TraceStep)



# ---- scoring ----
def _label_speed(factor: float) -> float:
    """Labels may give the slowdown as a speed ratio (0.8) or a time multiplier (1.25)."""
    return factor if factor <= 1.0 else 1.0 / factor


def _alert_intervals(predictions: Iterable[Prediction], rank_level: bool) -> dict[tuple, list[list[float]]]:
    """(job, rank) -> [[raise_ts, clear_ts or inf], ...] of straggler alerts."""
    intervals: dict[tuple, list[list[float]]] = {}
    for p in sorted(predictions, key=lambda p: p.ts):
        if p.type != "straggler" or (p.rank is not None) != rank_level:
            continue
        key = (p.job, p.rank)
        spans = intervals.setdefault(key, [])
        if p.alert:
            if not spans or spans[-1][1] != math.inf:
                spans.append([p.ts, math.inf])
        elif spans and spans[-1][1] == math.inf:
            spans[-1][1] = p.ts
    return intervals


def _summary(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"median": None, "p95": None, "max": None}
    ordered = sorted(values)
    return {"median": _median(ordered), "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
            "max": ordered[-1]}


def score_stragglers(
    predictions: list[Prediction],
    labels: list[dict],
    job_hours: float,
    *,
    steps: Iterable[Mapping[str, Any] | TrainingStep] | None = None,
    min_slowdown: float = 0.05,
    max_delay_steps: int = StragglerConfig.find_within_records,  # the target, stated once
    max_delay_s: float = StragglerConfig.find_within_s,
    grace_s: float = 600.0,
) -> dict[str, Any]:
    """Score straggler predictions against injected labels.

    - detection: an injected rank slowdown of at least ``min_slowdown`` (and, when ``steps`` are
      given, with at least ``max_delay_steps`` step records of its rank; shorter ones are
      counted as ``too_short``, not scored) counts when an alert on
      that job/rank is active at some point of [start_ts, end_ts + grace_s]; it is *on time*
      when raised within ``max_delay_steps`` step records of that rank (needs ``steps``) or
      ``max_delay_s`` seconds of the start. A label with ``ramp_s`` (the slowdown grows linearly
      in speed from 1.0 at ``start_ts`` to ``factor`` at ``start_ts + ramp_s``: a thermal ramp)
      is also scored from the moment its slowdown reaches ``min_slowdown``
      (``detected_on_time_reached``): no detector can see a 20-minute ramp's first minute, so
      "on time" from the start measures the ramp, this one the detector. For an abrupt slowdown
      both are the same.
    - false flag: a rank alert raised with no injected straggler on that job/rank within
      [start_ts, end_ts + grace_s] (slowdowns below ``min_slowdown`` included: finding a small
      one is not false). Rate per 1,000 job-hours.
    - job-wide: a ``job_slowdown`` label is found when a job-wide alert of that job overlaps it;
      the cause is right when the alert's reason names the label's cause.
    """
    rank_alerts = _alert_intervals(predictions, rank_level=True)
    job_alerts = _alert_intervals(predictions, rank_level=False)
    step_times: dict[tuple, list[float]] = {}
    for s in steps or ():
        job, rank, ts = (s["job"], s["rank"], float(s["ts"])) if isinstance(s, Mapping) else (
            s.job, s.rank, s.ts)
        step_times.setdefault((job, rank), []).append(ts)
    for times in step_times.values():
        times.sort()

    stragglers = [lab for lab in labels if lab.get("kind") == "straggler"]
    slowdowns = [lab for lab in labels if lab.get("kind") == "job_slowdown"]
    injected = detected = on_time = on_time_reached = 0
    delays_s: list[float] = []
    delays_reached_s: list[float] = []
    delays_steps: list[float] = []
    factor_errors: list[float] = []
    missed: list[dict] = []
    by_pred_factor = {(p.job, p.rank, p.ts): p.factor for p in predictions
                      if p.type == "straggler" and p.alert and p.rank is not None}
    too_short = 0
    for lab in stragglers:
        speed = _label_speed(float(lab.get("factor", 0.0)))
        if 1.0 - speed < min_slowdown:
            continue
        start, end = float(lab["start_ts"]), float(lab["end_ts"]) + grace_s
        if step_times:
            times = step_times.get((lab["job"], lab["rank"]), [])
            inside = bisect.bisect_right(times, float(lab["end_ts"])) - bisect.bisect_right(times, start)
            if inside < max_delay_steps:
                too_short += 1  # fewer step records than the target allows: not scorable
                continue
        injected += 1
        hit = next((span for span in rank_alerts.get((lab["job"], lab["rank"]), [])
                    if span[0] <= end and span[1] >= start), None)
        if hit is None:
            missed.append(lab)
            continue
        detected += 1
        delay = max(0.0, hit[0] - start)
        delays_s.append(delay)
        n_steps = None
        if step_times:
            times = step_times.get((lab["job"], lab["rank"]), [])
            n_steps = bisect.bisect_right(times, hit[0]) - bisect.bisect_right(times, start)
            delays_steps.append(float(n_steps))
        if delay <= max_delay_s or (n_steps is not None and n_steps <= max_delay_steps):
            on_time += 1
        # When the slowdown reached min_slowdown: speed falls linearly over ramp_s.
        reached = start + float(lab.get("ramp_s") or 0.0) * min(1.0, min_slowdown / (1.0 - speed))
        delay_reached = max(0.0, hit[0] - reached)
        delays_reached_s.append(delay_reached)
        n_reached = None
        if step_times:
            n_reached = bisect.bisect_right(times, hit[0]) - bisect.bisect_right(times, reached)
        if delay_reached <= max_delay_s or (n_reached is not None and n_reached <= max_delay_steps):
            on_time_reached += 1
        est = by_pred_factor.get((lab["job"], lab["rank"], hit[0]))
        if est is not None and hit[0] >= start:
            factor_errors.append(abs(est - speed))

    false_flags = during_job_slowdown = 0
    for (job, rank), spans in rank_alerts.items():
        mine = [lab for lab in stragglers if lab["job"] == job and lab["rank"] == rank]
        for raised, _cleared in spans:
            if any(float(lab["start_ts"]) <= raised <= float(lab["end_ts"]) + grace_s for lab in mine):
                continue
            false_flags += 1
            if any(lab["job"] == job and float(lab["start_ts"]) <= raised <= float(lab["end_ts"]) + grace_s
                   for lab in slowdowns):
                during_job_slowdown += 1

    jobwide_found = cause_right = 0
    for lab in slowdowns:
        start, end = float(lab["start_ts"]), float(lab["end_ts"]) + grace_s
        spans = [s for s in job_alerts.get((lab["job"], None), []) if s[0] <= end and s[1] >= start]
        if not spans:
            continue
        jobwide_found += 1
        reasons = [p.reason or "" for p in predictions if p.type == "straggler" and p.alert
                   and p.rank is None and p.job == lab["job"] and p.ts == spans[0][0]]
        if any(str(lab.get("cause", "")) in r for r in reasons):
            cause_right += 1
    jobwide_false = sum(
        1 for (job, _), spans in job_alerts.items() for raised, _c in spans
        if not any(lab["job"] == job and float(lab["start_ts"]) <= raised <= float(lab["end_ts"]) + grace_s
                   for lab in slowdowns))

    return {
        "injected": injected,
        "too_short": too_short,
        "detected": detected,
        "detected_on_time": on_time,
        "detection_rate": detected / injected if injected else None,
        "detection_rate_on_time": on_time / injected if injected else None,
        "detected_on_time_reached": on_time_reached,
        "detection_rate_on_time_reached": on_time_reached / injected if injected else None,
        "delay_s": _summary(delays_s),
        "delay_reached_s": _summary(delays_reached_s),
        "delay_steps": _summary(delays_steps),
        "factor_abs_error_median": _median(factor_errors) if factor_errors else None,
        "false_flags": false_flags,
        "false_flags_during_job_slowdowns": during_job_slowdown,
        "job_hours": job_hours,
        "false_flags_per_1000_job_hours": 1000.0 * false_flags / job_hours if job_hours > 0 else None,
        "job_slowdowns": len(slowdowns),
        "job_slowdowns_found": jobwide_found,
        "job_slowdown_cause_right": cause_right,
        "job_wide_false_alerts": jobwide_false,
        "missed": missed,
    }
