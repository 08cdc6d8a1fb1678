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

A rank is flagged by a one-sided CUSUM over its log speed deficit, with slack and limit
scaled to the job's measured noise, and cleared after a few healthy records in a row
(hysteresis: one prediction on raise, one on clear). A job-wide slowdown (every rank
slower together) changes no rank's factor; it is recognised from the job's own history,
split into "network" (step time rises beyond the slowest rank's compute) and "input"
(every rank's compute rises), and reported once per job with ``rank`` unset.

Processor contract: ``process`` / ``flush`` / ``keys`` / ``state`` / ``restore``; state is
per job (key = job name), plain JSON, so a restarted worker resumes with identical output.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fleetwise.catalog import lookup
from fleetwise.schemas import FeatureVector, Prediction, Record, Signal, TrainingStep
from fleetwise.schemas.fast import FastTrainingStep

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
    min_ranks: int = 3  # fewer fresh ranks than this: no cross-rank reference
    min_group: int = 4  # same-model peers needed to use them as the reference
    stale_s: float = 900.0  # a rank silent this long leaves the reference pool
    window_s: float = 300.0  # per-rank feature window
    jobwide_threshold: float = 0.05  # job-wide slowdown: >= 5% of the step time
    jobwide_records: int = 3  # step groups in a row to raise / clear a job-wide slowdown
    baseline_groups: int = 30  # healthy step groups in the job's rolling baseline
    min_baseline: int = 5  # groups needed before job-wide judgements
    dtype: str = "bf16"


def _median(values: Iterable[float]) -> float:
    ordered = sorted(values)
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
    catalog's capability). Records of one job are grouped by step; a group is judged when
    every fresh rank of the job has reported it, or when a record of another step arrives.
    """

    def __init__(
        self,
        expected_speed: Callable[[str], float] | None = None,
        config: StragglerConfig | None = None,
    ) -> None:
        self.config = config or StragglerConfig()
        self._speed = expected_speed or (lambda model: catalog_speed(model, self.config.dtype))
        self._jobs: dict[str, dict[str, Any]] = {}
        self._keep_recent = max(5, self.config.clear_records)

    # ---- processor contract ----
    def process(self, records: Sequence[Record | FastTrainingStep | Mapping[str, Any]]) -> list[Record]:
        """Consume step records (event-time order); return FeatureVectors and Predictions."""
        out: list[Record] = []
        for raw in records:
            rec = _step_record(raw)
            job = self._jobs.setdefault(rec.job, _new_job())
            pending = job["pending"]
            if pending is not None and pending["step"] != rec.step:
                out.extend(self._close_group(rec.job, job))
                pending = None
            if pending is None:
                pending = job["pending"] = {"step": rec.step, "records": {}}
            row = {
                "ts": rec.ts, "rank": rec.rank, "node": rec.node, "gpu": rec.gpu,
                "step_time_s": rec.step_time_s, "compute_s": rec.compute_s,
                "work": float(rec.samples or rec.micro_batch or 1), "model": rec.model,
            }
            # A rank reporting twice for one step: keep the latest.
            pending["records"][str(rec.rank)] = row
            if self._group_complete(job, rec.ts):
                out.extend(self._close_group(rec.job, job))
        return out

    def flush(self) -> list[Record]:
        """End of a replay: judge open step groups and close every open feature window."""
        out: list[Record] = []
        for name in sorted(self._jobs):
            job = self._jobs[name]
            out.extend(self._close_group(name, job))
            for rank_key in sorted(job["ranks"], key=int):
                rs = job["ranks"][rank_key]
                fv = self._window_features(name, int(rank_key), rs)
                if fv is not None:
                    out.append(fv)
                    rs["win"] = None
        return out

    def keys(self) -> list[str]:
        return sorted(self._jobs)

    def state(self, key: str) -> dict:
        """JSON-serialisable state of one job (a deep copy)."""
        return json.loads(json.dumps(self._jobs[key]))

    def restore(self, key: str, state: dict) -> None:
        self._jobs[key] = json.loads(json.dumps(state))

    # ---- step groups ----
    def _group_complete(self, job: dict[str, Any], ts: float) -> bool:
        expected = job["expected"]
        reported = job["pending"]["records"]
        if not expected or len(reported) < len(expected):
            return False  # first step of a job: world size unknown until the next step
        return all(str(rank) in reported for rank in expected)

    def _close_group(self, name: str, job: dict[str, Any]) -> list[Record]:
        pending = job["pending"]
        job["pending"] = None
        if not pending or not pending["records"]:
            return []
        cfg = self.config
        rows = sorted(pending["records"].values(), key=lambda r: r["rank"])
        ts = max(r["ts"] for r in rows)
        out: list[Record] = []
        preds: list[Record] = []

        for row in rows:
            key = str(row["rank"])
            rs = job["ranks"].get(key)
            if rs is not None and (rs["node"] != row["node"] or rs["gpu"] != row["gpu"]):
                # The rank moved to another GPU (restart, migration): close out the old one.
                fv = self._window_features(name, row["rank"], rs)
                if fv is not None:
                    out.append(fv)
                if rs["alert"]:
                    preds.append(self._rank_prediction(name, row["rank"], rs, ts, raise_=False,
                                                       reason="rank moved to another GPU"))
                rs = None
            if rs is None:
                rs = job["ranks"][key] = _new_rank(row)
            model = row["model"] or rs["model"]
            rs["model"] = model
            cap = self._capability(model)
            rs["cap"] = cap
            rs["ts"] = row["ts"]
            rs["cost"] = row["compute_s"] * cap / row["work"] if cap and row["work"] > 0 else None

        fresh = sorted(int(k) for k, rs in job["ranks"].items() if rs["ts"] >= ts - cfg.stale_s)
        job["expected"] = fresh  # the ranks the next step group waits for
        pool = [job["ranks"][str(k)] for k in fresh if job["ranks"][str(k)]["cost"]]
        references = self._references(pool) if len(pool) >= cfg.min_ranks else {}
        sigma = self._job_sigma(job)
        slack = max(cfg.cusum_slack, cfg.noise_slack_z * sigma)
        limit = max(cfg.cusum_limit, cfg.noise_limit_z * sigma)

        for row in rows:
            rank = row["rank"]
            rs = job["ranks"][str(rank)]
            ref = references.get(rs["model"] or "")
            factor = ref[0] / rs["cost"] if ref and rs["cost"] else None
            self._add_to_window(name, rank, rs, row, factor, out)
            if factor is None:
                continue
            deficit = -math.log(factor)
            if rs["deficit"] is not None:
                jump = abs(deficit - rs["deficit"])
                rs["noise"] = jump if rs["noise"] is None else (
                    (1 - cfg.noise_alpha) * rs["noise"] + cfg.noise_alpha * jump)
            rs["deficit"] = deficit
            rs["ref"] = ref[1]
            pred = self._update_alert(name, rank, rs, deficit, factor, slack, limit, ts)
            if pred is not None:
                preds.append(pred)

        jw = self._job_wide(name, job, rows, pool, ts)
        if jw is not None:
            preds.append(jw)
        return out + preds

    def _capability(self, model: str | None) -> float | None:
        if not model:
            return None
        try:
            return float(self._speed(model))
        except (KeyError, ValueError):
            return None  # unknown model: this rank gets features but no speed factor

    def _references(self, pool: list[dict[str, Any]]) -> dict[str, tuple[float, str]]:
        """Reference cost per GPU model: same-model peers when enough, else the job median."""
        by_model: dict[str, list[float]] = {}
        for rs in pool:
            by_model.setdefault(rs["model"] or "", []).append(rs["cost"])
        prior = _median(rs["cost"] for rs in pool)
        refs: dict[str, tuple[float, str]] = {}
        for model, costs in by_model.items():
            if len(costs) >= self.config.min_group:
                refs[model] = (_median(costs), f"{len(costs)} same-model peers")
            else:
                refs[model] = (prior, f"catalog prior over {len(pool)} ranks")
        return refs

    def _job_sigma(self, job: dict[str, Any]) -> float:
        noises = [rs["noise"] for rs in job["ranks"].values() if rs["noise"] is not None]
        sigma = _median(noises) * _ABS_DIFF_TO_SIGMA if noises else 0.0
        return max(self.config.noise_floor, sigma)

    # ---- per-rank alerts ----
    def _update_alert(self, name: str, rank: int, rs: dict[str, Any], deficit: float,
                      factor: float, slack: float, limit: float, ts: float) -> Prediction | None:
        cfg = self.config
        recent = rs["recent"]
        recent.append(factor)
        if len(recent) > self._keep_recent:
            del recent[0]
        if rs["alert"]:
            # Clear on the mean of the last few records against half the slack: a rank hovering
            # near the slack does not clear and re-raise (hysteresis).
            rs["clear_run"] = min(rs["clear_run"] + 1, cfg.clear_records)
            tail = [-math.log(f) for f in rs["recent"][-cfg.clear_records:]]
            if rs["clear_run"] >= cfg.clear_records and sum(tail) / len(tail) < slack / 2:
                pred = self._rank_prediction(name, rank, rs, ts, raise_=False, reason="recovered",
                                             slack=slack, limit=limit)
                rs.update(alert=False, cusum=0.0, run=[], clear_run=0)
                return pred
            return None
        # Cap each increment so one outlier record cannot raise on its own.
        increment = min(deficit - slack, limit / cfg.min_consecutive)
        rs["cusum"] = max(0.0, rs["cusum"] + increment)
        rs["run"] = (rs["run"] + [factor])[-8:] if deficit > slack else []
        if rs["cusum"] >= limit and len(rs["run"]) >= cfg.min_consecutive:
            rs["alert"] = True
            rs["clear_run"] = 0
            return self._rank_prediction(name, rank, rs, ts, raise_=True,
                                         reason="slower than its GPU model should be",
                                         slack=slack, limit=limit)
        return None

    def _rank_prediction(self, name: str, rank: int, rs: dict[str, Any], ts: float, *, raise_: bool,
                         reason: str, slack: float | None = None, limit: float | None = None
                         ) -> Prediction:
        recent = rs["run"][-5:] if raise_ and rs["run"] else rs["recent"][-self.config.clear_records:]
        factor = round(_median(recent), 4) if recent else None
        probability = min(1.0, rs["cusum"] / limit) if raise_ and limit else 0.0
        signals = [
            Signal(name="speed_factor", value=factor, weight=1.0),
            Signal(name="model", value=rs["model"]),
            Signal(name="expected_tflops", value=rs["cap"]),
            Signal(name="reference", value=rs.get("ref")),
        ]
        if slack is not None:
            signals.append(Signal(name="noise_slack", value=round(slack, 5)))
        return Prediction(
            id=f"straggler:{rs['node']}/{rs['gpu']}:{int(ts)}", type="straggler", ts=ts,
            node=rs["node"], gpu=rs["gpu"], job=name, rank=rank, probability=round(probability, 4),
            horizon_h=0.0, alert=raise_, signals=signals, factor=factor, reason=reason,
        )

    # ---- job-wide slowdowns ----
    def _job_wide(self, name: str, job: dict[str, Any], rows: list[dict[str, Any]],
                  pool: list[dict[str, Any]], ts: float) -> Prediction | None:
        cfg = self.config
        costs = [job["ranks"][str(r["rank"])]["cost"] for r in rows]
        if len(rows) < cfg.min_ranks or any(c is None for c in costs):
            return None
        step = _median(r["step_time_s"] for r in rows)
        # Communication the slowest rank could not hide: a straggler raises step time and
        # the slowest compute together (unchanged), a slow network raises only this.
        comm = max(0.0, step - max(r["compute_s"] for r in rows))
        cost = _median(costs)
        jw = job["jobwide"]
        base = jw["base"]
        state_now = None
        if len(base) >= cfg.min_baseline:
            base_cost = _median(b[0] for b in base)
            base_step = _median(b[1] for b in base)
            base_comm = _median(b[2] for b in base)
            input_excess = cost / base_cost - 1.0
            network_excess = (comm - base_comm) / base_step
            slow = max(input_excess, network_excess) > cfg.jobwide_threshold
            cause = "input" if input_excess >= network_excess else "network"
            state_now = (slow, cause, base_step / step, input_excess, network_excess)
        if state_now is None or not state_now[0]:
            jw["run"] = 0
            if not jw["alert"]:
                jw["base"] = (base + [[cost, step, comm]])[-cfg.baseline_groups:]
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
    def _add_to_window(self, name: str, rank: int, rs: dict[str, Any], row: dict[str, Any],
                       factor: float | None, out: list[Record]) -> None:
        start = math.floor(row["ts"] / self.config.window_s) * self.config.window_s
        win = rs["win"]
        if win is not None and win["start"] != start:
            fv = self._window_features(name, rank, rs)
            if fv is not None:
                out.append(fv)
            win = None
        if win is None:
            win = rs["win"] = {"start": start, "step": [], "compute": [], "factor": [], "cost": []}
        win["step"].append(row["step_time_s"])
        win["compute"].append(row["compute_s"])
        if factor is not None:
            win["factor"].append(factor)
        if rs["cost"]:
            win["cost"].append(rs["cost"])

    def _window_features(self, name: str, rank: int, rs: dict[str, Any]) -> FeatureVector | None:
        win = rs["win"]
        if not win or not win["step"]:
            return None
        cost = _median(win["cost"]) if win["cost"] else None
        trend = cost / rs["prev_cost"] - 1.0 if cost and rs["prev_cost"] else None
        rs["prev_cost"] = cost
        waits = [max(0.0, 1.0 - c / s) for c, s in zip(win["compute"], win["step"], strict=True)]
        # model_construct: our own, already-consistent output; skips re-validation per window
        return FeatureVector.model_construct(
            scope="rank", ts=float(win["start"] + self.config.window_s), window_s=self.config.window_s,
            node=rs["node"], gpu=rs["gpu"], model=rs["model"], job=name, rank=rank,
            values={
                "median_step_s": _median(win["step"]),
                "median_compute_s": _median(win["compute"]),
                "compute_trend": trend,
                "speed_factor": _median(win["factor"]) if win["factor"] else None,
                "wait_share": _median(waits),
            },
        )


def _new_job() -> dict[str, Any]:
    return {"ranks": {}, "pending": None, "expected": [],
            "jobwide": {"base": [], "alert": False, "cause": None, "run": 0, "clear": 0}}


def _new_rank(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"node": row["node"], "gpu": row["gpu"], "model": row["model"], "cap": None, "ts": row["ts"],
            "cost": None, "deficit": None, "noise": None, "cusum": 0.0, "run": [], "recent": [],
            "alert": False, "clear_run": 0, "ref": None, "win": None, "prev_cost": None}


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
    max_delay_steps: int = 5,
    max_delay_s: float = 60.0,
    grace_s: float = 600.0,
) -> dict[str, Any]:
    """Score straggler predictions against injected labels.

    - detection: an injected rank slowdown of at least ``min_slowdown`` (and, when ``steps`` are
      given, with at least ``max_delay_steps`` step records of its rank; shorter ones are
      counted as ``too_short``, not scored) counts when an alert on
      that job/rank is active at some point of [start_ts, end_ts + grace_s]; it is *on time*
      when raised within ``max_delay_steps`` step records of that rank (needs ``steps``) or
      ``max_delay_s`` seconds of the start.
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
    injected = detected = on_time = 0
    delays_s: list[float] = []
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
        "delay_s": _summary(delays_s),
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
