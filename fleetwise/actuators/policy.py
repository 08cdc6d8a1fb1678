"""Action policy: alerting predictions + fleet state -> commands, within safety rails.

Modelled on a Kubernetes controller: each alert is compared against what was already asked
for (desired vs observed), every command has a stable id (re-processing the same prediction
yields the same id, so consumers can dedupe) and a reason with its evidence, and rails bound
what the system may do on its own (a cap on drained GPUs per job and per fleet, a minimum
interval between commands of one kind for one job). Everything runs in event time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleetwise.actuators.signing import DEV_SIGNING_KEY, sign
from fleetwise.schemas import Command, Prediction, Record


@dataclass(frozen=True)
class PolicyConfig:
    dry_run: bool = False
    # NVSentinel's lesson (REFERENCE.md): cap quarantine with a circuit breaker.
    max_drain_share_per_job: float = 0.25
    max_drained_gpus_fleet: int = 16
    min_interval_s: float = 900.0  # per (job, command type): no command storms
    rebalance_below_factor: float = 0.95  # straggler factor below which shares are resized
    signing_key: bytes = DEV_SIGNING_KEY


@dataclass
class _JobState:
    ranks: dict[int, tuple[str, int]] = field(default_factory=dict)  # rank -> (node, gpu)
    drained: set[tuple[str, int]] = field(default_factory=set)
    last_command_ts: dict[str, float] = field(default_factory=dict)
    slow_factors: dict[int, float] = field(default_factory=dict)


def command_id(kind: str, *parts: object) -> str:
    """A stable id: the same decision over the same evidence always gets the same id."""
    text = "|".join(str(p) for p in (kind, *parts))
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


class ActionPolicy:
    """Processor: Prediction records in, Command records out (processor contract)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config or PolicyConfig()
        self._jobs: dict[str, _JobState] = {}
        self._drained_fleet: set[tuple[str, int]] = set()
        self._issued: set[str] = set()
        self.suppressed: dict[str, int] = {}

    # -- processor contract ------------------------------------------------------------------
    def process(self, records: Sequence[Record]) -> list[Record]:
        out: list[Record] = []
        for record in records:
            if isinstance(record, Prediction):
                out.extend(self._on_prediction(record))
        return out

    def flush(self) -> list[Record]:
        return []

    def keys(self) -> list[str]:
        return sorted(self._jobs)

    def state(self, key: str) -> dict:
        job = self._jobs.get(key)
        if job is None:
            return {}
        return {
            "ranks": {str(r): list(v) for r, v in job.ranks.items()},
            "drained": sorted([list(d) for d in job.drained]),
            "last_command_ts": dict(job.last_command_ts),
            "slow_factors": {str(r): f for r, f in job.slow_factors.items()},
        }

    def restore(self, key: str, state: dict) -> None:
        job = _JobState(
            ranks={int(r): (v[0], int(v[1])) for r, v in state.get("ranks", {}).items()},
            drained={(d[0], int(d[1])) for d in state.get("drained", [])},
            last_command_ts=dict(state.get("last_command_ts", {})),
            slow_factors={int(r): float(f) for r, f in state.get("slow_factors", {}).items()},
        )
        self._jobs[key] = job
        self._drained_fleet |= job.drained

    def forget(self, key: str) -> None:
        # Its drained GPUs stay in the fleet count: those drains were issued.
        self._jobs.pop(key, None)

    # -- decisions ---------------------------------------------------------------------------
    def _suppress(self, why: str) -> list[Record]:
        self.suppressed[why] = self.suppressed.get(why, 0) + 1
        return []

    def _emit(self, command: Command) -> list[Record]:
        if command.id in self._issued:  # idempotent: same decision twice is one command
            return []
        self._issued.add(command.id)
        return [sign(command, self.config.signing_key)]

    def _on_prediction(self, p: Prediction) -> list[Record]:
        job_name = p.job or f"node:{p.node}"
        job = self._jobs.setdefault(job_name, _JobState())
        if p.rank is not None and p.gpu is not None:
            job.ranks[p.rank] = (p.node, p.gpu)
        if p.type == "failure" and p.alert and p.gpu is not None:
            return self._drain(p, job_name, job)
        if p.type == "straggler" and p.rank is not None:
            return self._rebalance(p, job_name, job)
        return []

    def _rate_limited(self, job: _JobState, kind: str, ts: float) -> bool:
        last = job.last_command_ts.get(kind)
        return last is not None and ts - last < self.config.min_interval_s

    def _drain(self, p: Prediction, job_name: str, job: _JobState) -> list[Record]:
        target = (p.node, int(p.gpu))  # type: ignore[arg-type]
        if target in job.drained:
            return self._suppress("already_drained")
        job_size = max(len(job.ranks), 1)
        if p.job and (len(job.drained) + 1) / job_size > self.config.max_drain_share_per_job and job_size > 1:
            return self._suppress("job_drain_cap")
        if len(self._drained_fleet) >= self.config.max_drained_gpus_fleet:
            return self._suppress("fleet_drain_cap")
        job.drained.add(target)
        self._drained_fleet.add(target)
        job.last_command_ts["drain"] = p.ts
        source = next((str(s.value) for s in p.signals if s.name == "source"), "model")
        evidence = ", ".join(f"{s.name}={s.value}" for s in p.signals if s.name != "source")
        # A rule alert (e.g. a fatal memory XID) stands on the rule, not on the model's probability.
        basis = source if source.startswith("rule:") else f"model p={p.probability:.2f}"
        reason = f"predicted {p.type} of {p.node}/gpu{p.gpu} within {p.horizon_h:g} h ({basis}; {evidence})"
        checkpoint = Command(
            id=command_id("checkpoint", job_name, p.node, p.gpu, p.id), type="checkpoint", ts=p.ts,
            job=p.job, node=p.node, gpu=p.gpu, reason=f"checkpoint before drain: {reason}",
            evidence=[p.id], params={"before": "drain"}, dry_run=self.config.dry_run,
        )
        drain = Command(
            id=command_id("drain", job_name, p.node, p.gpu, p.id), type="drain", ts=p.ts,
            job=p.job, node=p.node, gpu=p.gpu, reason=reason, evidence=[p.id],
            # The consumer waits for this checkpoint's acknowledgement before removing the GPU.
            params={"requires_checkpoint": checkpoint.id, "replan": bool(p.job)},
            dry_run=self.config.dry_run,
        )
        return self._emit(checkpoint) + self._emit(drain)

    def _rebalance(self, p: Prediction, job_name: str, job: _JobState) -> list[Record]:
        rank = int(p.rank)  # type: ignore[arg-type]
        factor = p.factor if p.alert and p.factor is not None else 1.0
        previous = job.slow_factors.get(rank, 1.0)
        if p.alert and factor >= self.config.rebalance_below_factor:
            return []
        if not p.alert and rank not in job.slow_factors:
            return []
        if p.alert:
            job.slow_factors[rank] = factor
        else:
            job.slow_factors.pop(rank, None)
        if abs(previous - factor) < 0.02:
            return self._suppress("no_change")
        if self._rate_limited(job, "rebalance", p.ts) and p.alert:
            return self._suppress("rate_limited")
        job.last_command_ts["rebalance"] = p.ts
        verb = "slower" if p.alert else "back to expected speed"
        reason = f"rank {rank} on {p.node}/gpu{p.gpu} runs {verb} (speed factor {factor:.2f})"
        cmd = Command(
            id=command_id("rebalance", job_name, rank, p.id), type="rebalance", ts=p.ts, job=p.job,
            node=p.node, gpu=p.gpu, reason=reason, evidence=[p.id],
            # The training plugin rescales each rank's share by its factor (plan-relative).
            params={"speed_factors": {str(r): round(f, 4) for r, f in sorted(job.slow_factors.items())}},
            dry_run=self.config.dry_run,
        )
        return self._emit(cmd)
