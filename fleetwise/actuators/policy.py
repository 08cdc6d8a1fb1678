"""Action policy: predictions, acks, inventory, plans and operators' actions -> commands.

Modelled on a Kubernetes controller: the fleet state it decides on is what consumers
acknowledged (`FleetState`), never its own intentions; every command has a stable id (the
same input gives the same ids, so a crash replay is deduplicated), a per-job `seq`, an
`expires_ts`, a reason and its evidence; rails bound what it may do on its own, and each time a
rail holds something back an `AuditEvent` says which and why. Everything runs in event time.

Multi-step actions follow the acks: a failure alert asks for a checkpoint; the drain is sent
once the checkpoint's `done` ack arrives (and `requires` it, so a consumer can check too); the
job's resize over its remaining GPUs is sent once the drain is `done`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fleetwise.actuators.config import PolicyConfig
from fleetwise.actuators.consolidation import ConsolidationConfig, ConsolidationError, plan_consolidation
from fleetwise.actuators.fleet import FINISHED, FleetState, GpuKey, PeerDrains, PendingCommand
from fleetwise.actuators.ids import command_id
from fleetwise.actuators.moves import (
    UtilisationWindow,
    consolidation_snapshot,
    hibernating_nodes,
    migration_for,
)
from fleetwise.actuators.signing import Keyring, operator_keyring, sign, verify_command, verify_operator
from fleetwise.catalog import GpuSpec, UnknownGpuError, lookup
from fleetwise.planner.exports import replica_samples
from fleetwise.planner.search import plan_stage_split
from fleetwise.planner.shares import proportional_shares
from fleetwise.planner.stages import layout_json
from fleetwise.schemas import (
    Ack,
    AuditEvent,
    Command,
    JobConstraints,
    JobEnd,
    NodeInventory,
    OperatorAction,
    Plan,
    Prediction,
    Record,
)

FLEET_KEY = "~fleet"  # state key of the fleet-wide part (GPUs, breaker, node-level commands)
DISRUPTIVE = frozenset({"drain", "resize", "migrate", "consolidate"})
# Re-audit the same held-back decision (rail, target) at most this often: a flapping alert
# re-raised every hop must not flood the audit topic.
AUDIT_REPEAT_S = 3600.0
KEEP_FINISHED_S = 86400.0
# A job the policy knows only from predictions (where its ranks run: no plan, no command, no
# rail's clock) and that no prediction named for this long (event time) starts over at its next
# prediction; the sweep drops such jobs once they are silent for RETIRE_JOB_S plus the margin
# (so a prediction up to the margin behind the newest one still finds what the sweep left):
# without it `jobs` grew with every job ever seen on the fleet.
RETIRE_JOB_S = 86400.0
RETIRE_SWEEP_MARGIN_S = 3600.0
# An ack read before its command (the two come from different topics) waits this long for it.
PEER_ACK_WAIT_S = 3600.0


@dataclass
class JobState:
    """What the policy knows of one job: where its ranks run, its plan, its rails' clocks."""

    ranks: dict[int, GpuKey] = field(default_factory=dict)
    plan: dict[str, Any] | None = None  # the current Plan as JSON
    shares: dict[int, int] = field(default_factory=dict)  # dp rank -> samples per step (last sent)
    # dp rank (a pure pipeline: stage) -> speed factor while slow
    slow: dict[int, float] = field(default_factory=dict)
    layers: dict[int, tuple[int, int]] = field(default_factory=dict)  # stage -> layers (last sent)
    seq: int = 0
    last_rebalance_ts: float | None = None
    disruptive_ts: list[float] = field(default_factory=list)
    left: list[GpuKey] = field(default_factory=list)  # GPUs drained out of the job (for resize up)
    last_ts: float | None = None  # newest prediction naming the job (event time)
    ended_ts: float | None = None  # when its plan was withdrawn (JobEnd): no more commands

    def ranks_only(self) -> bool:
        """Whether all it holds is where ranks ran (learned from predictions): nothing that a
        fresh state would decide differently on, apart from the job's size."""
        return (self.plan is None and not self.shares and not self.slow and not self.layers and self.seq == 0
                and self.last_rebalance_ts is None and not self.disruptive_ts and not self.left)

    def to_json(self) -> dict[str, Any]:
        return {
            "ranks": {str(r): list(k) for r, k in sorted(self.ranks.items())},
            "plan": self.plan, "shares": {str(d): s for d, s in sorted(self.shares.items())},
            "slow": {str(d): f for d, f in sorted(self.slow.items())}, "seq": self.seq,
            "layers": layout_json(self.layers),
            "last_rebalance_ts": self.last_rebalance_ts, "disruptive_ts": list(self.disruptive_ts),
            "left": [list(k) for k in self.left], "last_ts": self.last_ts, "ended_ts": self.ended_ts,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> JobState:
        return cls(
            ranks={int(r): (k[0], int(k[1])) for r, k in d.get("ranks", {}).items()},
            plan=d.get("plan"), shares={int(k): int(v) for k, v in d.get("shares", {}).items()},
            slow={int(k): float(v) for k, v in d.get("slow", {}).items()}, seq=int(d.get("seq", 0)),
            layers={int(k): (int(v[0]), int(v[1])) for k, v in d.get("layers", {}).items()},
            last_rebalance_ts=d.get("last_rebalance_ts"),
            disruptive_ts=[float(t) for t in d.get("disruptive_ts", [])],
            left=[(k[0], int(k[1])) for k in d.get("left", [])],
            last_ts=None if d.get("last_ts") is None else float(d["last_ts"]),
            ended_ts=None if d.get("ended_ts") is None else float(d["ended_ts"]),
        )

    def pipeline_only(self) -> bool:
        """A pipeline without data parallelism: a slow rank slows its stage, and new stage
        boundaries (not shares) even it out."""
        return bool(self.plan) and int(self.plan["pp"]) > 1 and int(self.plan["dp"]) == 1  # type: ignore[index]

    def stage_of(self, rank: int) -> int:
        for r in self.plan["ranks"] if self.plan else []:
            if r["rank"] == rank:
                return int(r["stage"])
        return 0

    def dp_of(self, rank: int) -> int:
        """The data-parallel rank a global rank belongs to (pure DP without a plan)."""
        if self.plan:
            for r in self.plan["ranks"]:
                if r["rank"] == rank:
                    return int(r["dp_rank"])
        return rank


class ActionPolicy:
    """Processor: predictions, acks, inventories, plans and operator actions in; commands
    and audit events out (processor contract: process / flush / keys / state / restore)."""

    def __init__(self, config: PolicyConfig | None = None, keyring: Keyring | None = None,
                 operator_keys: Keyring | None = None) -> None:
        self.config = config or PolicyConfig()
        self.keyring = keyring or Keyring()
        self.operator_keys = operator_keys or operator_keyring()  # verifies operator actions
        self.fleet = FleetState()
        # Other workers' drains (command topics and acks, read whole): the fleet-wide rails
        # count them, so several workers together keep one fleet cap (docs/actuators.md).
        self.peers = PeerDrains()
        self.inventory: dict[str, NodeInventory] = {}
        self.jobs: dict[str, JobState] = {}
        self.newest_ts = float("-inf")
        # Newest event time per prediction type: a prediction far behind its own stream (an agent
        # resending an hour of buffered telemetry after an outage) is stale evidence.
        self.newest_by_type: dict[str, float] = {}
        self.breaker_attempts: list[float] = []
        self.breaker_open_since: float | None = None
        self._audited: dict[tuple[str, str], float] = {}
        self.suppressed: dict[str, int] = {}  # rail or reason -> count (metrics)
        self.expired = 0
        self.retired_jobs = 0  # silent jobs dropped by `_retire_silent_jobs` (metrics)
        self.ended_jobs = 0  # jobs dropped after their JobEnd (metrics)
        cons = self.config.consolidate
        self.utilisation = UtilisationWindow(cons.sustained_s) if cons.mode != "off" else None
        self._next_check: dict[str, float] = {}
        self._next_retire = float("-inf")  # event time of the next sweep for silent jobs (not state)
        # Whether this worker decides a job's growth to its intent: capacity events (inventories,
        # returns, job ends) reach every worker, and one decides per job (the stream app sets the
        # holder of the job's state partition; alone, every job is this policy's).
        self.decides_for: Callable[[str], bool] = lambda job: True

    # -- processor contract ------------------------------------------------------------------
    def process(self, records: Sequence[Record]) -> list[Record]:
        out: list[Record] = []
        # Expiry is judged once per call, before it: commands sent in earlier calls had their
        # consumers' turn (a replay hands over hours of event time in one call).
        newest = max((float(r.ts) for r in records if getattr(r, "ts", None) is not None), default=None)
        if newest is not None and newest > self.newest_ts:
            self.newest_ts = newest
            out.extend(self._expire(newest))
        # Event-time order (stable): one call may hold many GPUs' windows, each in its own order.
        for record in sorted(records, key=_event_ts):
            if isinstance(record, Prediction):
                if record.ts > self.newest_by_type.get(record.type, float("-inf")):
                    self.newest_by_type[record.type] = float(record.ts)
                out.extend(self._on_prediction(record))
            elif isinstance(record, Ack):
                out.extend(self._on_ack(record))
            elif isinstance(record, Command):
                self._on_peer_command(record)
            elif isinstance(record, NodeInventory):
                out.extend(self._on_inventory(record))
            elif isinstance(record, Plan):
                self._on_plan(record)
            elif isinstance(record, JobEnd):
                out.extend(self._on_job_end(record))
            elif isinstance(record, OperatorAction):
                out.extend(self._on_operator(record))
        if self.jobs and math.isfinite(self.newest_ts) and self.newest_ts >= self._next_retire:
            self._retire_silent_jobs(self.newest_ts)
        return out

    def flush(self) -> list[Record]:
        return []

    def keys(self) -> list[str]:
        # The fleet-wide part is a key only while it holds something worth saving (a GPU out
        # of service, a node's own command, the breaker's clock): most workers never need it.
        fleet_part = (self.breaker_attempts or self.breaker_open_since is not None
                      or any(g.status != "in_service" for g in self.fleet.gpus.values())
                      or any(p.command.get("job") is None for p in self.fleet.commands.values()))
        return sorted(self.jobs) + ([FLEET_KEY] if fleet_part else [])

    def state(self, key: str) -> dict:
        def mine(p: PendingCommand) -> bool:
            return (p.command.get("job") or FLEET_KEY) == key

        commands = {cid: p for cid, p in self.fleet.commands.items() if mine(p)}
        part = FleetState(gpus=self.fleet.gpus if key == FLEET_KEY else {}, commands=commands).to_json()
        if key == FLEET_KEY:
            part.update(newest_ts=self.newest_ts, newest_by_type=dict(self.newest_by_type),
                        breaker_attempts=list(self.breaker_attempts),
                        breaker_open_since=self.breaker_open_since)
            return part
        job = self.jobs.get(key)
        return {} if job is None else {**part, "job": job.to_json()}

    def restore(self, key: str, state: dict) -> None:
        part = FleetState.from_json(state)
        self.fleet.commands.update(part.commands)
        for cid, pending in part.commands.items():
            self.peers.forget(cid)  # read on the command topics before its state came back
            self._restore_drained(pending)
        if key == FLEET_KEY:
            # Merged, not replaced: after a rebalance this is another worker's saved view, and
            # this worker's own (newer statuses, its own drain decisions) must survive it.
            self.fleet.merge_gpus(part.gpus)
            self.newest_ts = max(self.newest_ts, float(state.get("newest_ts", float("-inf"))))
            for kind, ts in state.get("newest_by_type", {}).items():
                self.newest_by_type[kind] = max(self.newest_by_type.get(kind, float("-inf")), float(ts))
            mine = set(self.breaker_attempts)
            self.breaker_attempts = sorted(self.breaker_attempts + [
                float(t) for t in state.get("breaker_attempts", []) if float(t) not in mine])
            opened = [t for t in (self.breaker_open_since, state.get("breaker_open_since")) if t is not None]
            self.breaker_open_since = max(opened) if opened else None
        elif "job" in state:
            self.jobs[key] = JobState.from_json(state["job"])

    def _restore_drained(self, drain: PendingCommand) -> None:
        """A job's acked drain, restored with the job, puts its GPU out again: the GPUs' own
        statuses live in the fleet-wide part, which only the worker holding that key's partition
        saves. A status set after the ack (the GPU returned since) is newer and stays."""
        target = drain.target
        if drain.type != "drain" or target is None or drain.status not in ("received", "applied", "done"):
            return
        if self.peers.returned.get(target, float("-inf")) >= drain.updated_ts:
            return  # the return was read first (the operator topic, at the start)
        known = self.fleet.gpus.get(target)
        if known is None or (known.status == "in_service" and known.since_ts < drain.updated_ts):
            status = "drained" if drain.status == "done" else "draining"
            self.fleet.set_status(target, status, drain.updated_ts, drain.command["reason"], drain.id)

    def forget(self, key: str) -> None:
        self.jobs.pop(key, None)
        self.fleet.commands = {cid: p for cid, p in self.fleet.commands.items()
                               if (p.command.get("job") or FLEET_KEY) != key}

    # -- helpers -----------------------------------------------------------------------------
    def _job(self, name: str) -> JobState:
        return self.jobs.setdefault(name, JobState())

    def _audit(self, event: str, reason: str, ts: float, *, target: str, command_id: str | None = None,
               job: str | None = None, node: str | None = None, gpu: int | None = None,
               evidence: Sequence[str] = (), once: bool = True) -> list[Record]:
        self.suppressed[event] = self.suppressed.get(event, 0) + 1
        if once:
            last = self._audited.get((event, target))
            if last is not None and ts - last < AUDIT_REPEAT_S:
                return []
            self._audited[(event, target)] = ts
        return [AuditEvent(ts=ts, event=event, reason=reason, command_id=command_id, job=job,
                           node=node, gpu=gpu, evidence=list(evidence))]

    def _send(self, cmd: Command, mode: str, follow_up: dict[str, Any] | None = None) -> list[Record]:
        """Track and (per the action's mode) emit a command; same id twice is one command."""
        known = self.fleet.commands.get(cmd.id)
        if known is not None and known.status != "expired":
            return []
        if mode == "off":
            return self._audit("mode_off", f"{cmd.type} decided but its mode is 'off': {cmd.reason}",
                               cmd.ts, target=cmd.id, command_id=cmd.id, job=cmd.job, node=cmd.node,
                               gpu=cmd.gpu, evidence=cmd.evidence)
        if mode == "approve":
            self.fleet.track(cmd, "held", cmd.ts, follow_up)
            return self._audit("awaiting_approval", f"`fleetwise approve {cmd.id}` to send: {cmd.reason}",
                               cmd.ts, target=cmd.id, command_id=cmd.id, job=cmd.job, node=cmd.node,
                               gpu=cmd.gpu, evidence=cmd.evidence, once=False)
        return [self._issue(cmd, cmd.ts, follow_up)]

    def _issue(self, cmd: Command, ts: float, follow_up: dict[str, Any] | None) -> Command:
        """Number, date and sign a command, and track it as waiting for acks."""
        job = self._job(cmd.job) if cmd.job else None
        seq = None  # `seq` orders one job's commands; a node's own commands have none
        if job is not None:
            job.seq += 1
            seq = job.seq
            if cmd.type in DISRUPTIVE:
                job.disruptive_ts.append(ts)
        lifetime = getattr(self.config.lifetimes, cmd.type)
        ready = cmd.model_copy(update={"seq": seq, "expires_ts": ts + lifetime,
                                       "dry_run": self.config.dry_run})
        signed = sign(ready, self.keyring)
        self.fleet.track(signed, "issued", ts, follow_up)
        return signed

    def _expire(self, now: float) -> list[Record]:
        # Finished commands are kept a day (a crash replay re-derives their ids and must find
        # them), then dropped so the changelogged state stays bounded.
        horizon = now - KEEP_FINISHED_S
        self.fleet.commands = {cid: p for cid, p in self.fleet.commands.items()
                               if p.status not in FINISHED or p.updated_ts >= horizon}
        self._audited = {k: t for k, t in self._audited.items() if t >= now - AUDIT_REPEAT_S}
        self.peers.expire(now, keep_s=max(self.config.rails.breaker_window_s, PEER_ACK_WAIT_S))
        out: list[Record] = []
        for p in self.fleet.expire(now):
            self.expired += 1
            c = p.command
            out.extend(self._audit(
                "expired", f"{p.type} {p.id} got no ack before {c.get('expires_ts')}: re-decided on the "
                "next evidence, not retried", now, target=p.id, command_id=p.id, job=c.get("job"),
                node=c.get("node"), gpu=c.get("gpu"), evidence=c.get("evidence", []), once=False))
        return out

    def _retire_silent_jobs(self, now: float) -> None:
        """Drop the jobs known only from predictions, with no command tracked, that no
        prediction named for `RETIRE_JOB_S` + `RETIRE_SWEEP_MARGIN_S` before the last point of
        a fixed event-time grid (every `RETIRE_SWEEP_MARGIN_S`) at or before `now`. Run after a
        call's records: what it keeps then depends on the event times seen, not on how the
        records were split into calls (a dropped job's next prediction would start it over)."""
        grid = math.floor(now / RETIRE_SWEEP_MARGIN_S) * RETIRE_SWEEP_MARGIN_S
        self._next_retire = grid + RETIRE_SWEEP_MARGIN_S
        horizon = grid - RETIRE_JOB_S - RETIRE_SWEEP_MARGIN_S
        with_commands = {p.command.get("job") for p in self.fleet.commands.values()}
        for name in [n for n, j in self.jobs.items() if j.last_ts is not None and j.last_ts < horizon
                     and j.ranks_only() and n not in with_commands]:
            del self.jobs[name]
            self.retired_jobs += 1
        # Ended jobs whose last commands have been answered (acked, expired or denied).
        in_flight = {p.command.get("job") for p in self.fleet.open_commands()}
        for name in [n for n, j in self.jobs.items() if j.ended_ts is not None and n not in in_flight]:
            del self.jobs[name]
            self.ended_jobs += 1

    def _stale(self, p: Prediction) -> bool:
        return self.newest_by_type.get(p.type, p.ts) - p.ts > self.config.rails.stale_after_s

    # -- failure alerts: checkpoint, then drain, then resize ----------------------------------
    def _on_prediction(self, p: Prediction) -> list[Record]:
        job_name = p.job
        ended = self.jobs.get(job_name) if job_name is not None else None
        if ended is not None and ended.ended_ts is not None:
            # Its ranks are gone: a GPU it named is acted on as a GPU in no job.
            p = p.model_copy(update={"job": None, "rank": None})
            job_name = None
        if job_name is not None:
            known = self.jobs.get(job_name)
            if (known is not None and known.last_ts is not None and known.ranks_only()
                    and p.ts - known.last_ts > RETIRE_JOB_S):
                self.jobs[job_name] = JobState()  # silent that long: starts over (see the sweep)
        if job_name is not None and p.rank is not None and p.gpu is not None:
            self._job(job_name).ranks[p.rank] = (p.node, p.gpu)
        out: list[Record] = []
        if p.type == "failure" and p.alert and p.gpu is not None:
            out = self._on_failure(p)
        elif p.type == "straggler" and p.rank is not None and job_name is not None:
            out = self._on_straggler(p, job_name)
        job = self.jobs.get(job_name) if job_name is not None else None
        if job is not None:
            job.last_ts = float(p.ts) if job.last_ts is None else max(job.last_ts, float(p.ts))
        return out

    def _job_size(self, job: JobState) -> int:
        if job.plan:
            return len(job.plan["ranks"])
        return max(len(job.ranks), 1)

    def _on_failure(self, p: Prediction) -> list[Record]:
        target: GpuKey = (p.node, int(p.gpu))  # type: ignore[arg-type]
        where = f"{p.node}/gpu{p.gpu}"
        rails, pol = self.config.rails, self.config.failure
        if self.fleet.status(target) != "in_service":
            self.suppressed["already_out"] = self.suppressed.get("already_out", 0) + 1
            return []
        if self.fleet.open_commands(target=target) or target in self.peers.out():
            self.suppressed["in_progress"] = self.suppressed.get("in_progress", 0) + 1
            return []
        audit = {"target": f"{where}", "job": p.job, "node": p.node, "gpu": p.gpu, "evidence": [p.id]}
        if self._stale(p):
            behind = self.newest_by_type[p.type] - p.ts
            return self._audit("stale", f"alert on {where} at {p.ts:.0f} is {behind:.0f} s behind its "
                               f"stream (> {rails.stale_after_s:g} s): no action", p.ts, **audit)
        if p.horizon_h > pol.max_horizon_h:
            return self._audit("horizon", f"predicted failure of {where} in {p.horizon_h:g} h is beyond "
                               f"{pol.max_horizon_h:g} h: no action yet", p.ts, **audit)
        # Circuit breaker: a flood of drain decisions (an XID storm, a bad rollout) opens it.
        window = rails.breaker_window_s
        self.breaker_attempts = [t for t in self.breaker_attempts if p.ts - t < window] + [p.ts]
        if self.breaker_open_since is not None and p.ts - self.breaker_open_since >= rails.breaker_cooldown_s:
            self.breaker_open_since = None
        # Other workers' drain decisions count too: a fleet-wide storm spreads over partitions.
        attempts = len(self.breaker_attempts) + self.peers.decided_since(p.ts - window)
        if self.breaker_open_since is None and attempts > rails.breaker_drains:
            self.breaker_open_since = p.ts
            return self._audit(
                "breaker_open", f"{attempts} drain decisions within {window:g} s (> "
                f"{rails.breaker_drains}): circuit breaker open, no drain for {rails.breaker_cooldown_s:g} s "
                "(an alert storm is more likely a fleet-wide cause than many failing GPUs)", p.ts,
                target="breaker", once=False, evidence=[p.id])
        if self.breaker_open_since is not None:
            self.breaker_open_since = p.ts  # stays open while the flood goes on
            return self._audit("breaker_held", f"circuit breaker open: drain of {where} held back", p.ts,
                               **audit)
        # Out, or on the way out: a drain asked for, or a checkpoint whose next step is a drain,
        # by this worker or another.
        out_fleet = self.fleet.out_of_service() | self.peers.out() | {
            pc.target for pc in self.fleet.open_commands()
            if pc.target and (pc.type == "drain" or pc.follow_up.get("then", {}).get("type") == "drain")}
        fleet_cap = rails.fleet_drain_cap(sum(len(inv.gpus) for inv in self.inventory.values()))
        if len(out_fleet) >= fleet_cap:
            return self._audit("fleet_drain_cap", f"{len(out_fleet)} GPUs out or leaving (cap {fleet_cap}): "
                               f"drain of {where} held back", p.ts, **audit)
        job = self._job(p.job) if p.job else None
        if job is not None:
            size = self._job_size(job)
            gone = {k for k in job.ranks.values() if k in out_fleet} | set(job.left)
            allowed = max(1, int(rails.max_drain_share_per_job * size))  # a small job may lose one
            if len(gone) + 1 > allowed:
                return self._audit("job_drain_cap", f"draining {where} would take {len(gone) + 1} of {size} "
                                   f"GPUs of {p.job} out (at most {allowed}: "
                                   f"{rails.max_drain_share_per_job:.0%})", p.ts, **audit)
            hour = [t for t in job.disruptive_ts if p.ts - t < 3600.0]
            job.disruptive_ts = hour
            if len(hour) >= rails.max_disruptive_per_job_per_hour:
                return self._audit("job_rate", f"{len(hour)} disruptive commands for {p.job} in the last "
                                   f"hour (max {rails.max_disruptive_per_job_per_hour})", p.ts, **audit)
        signals = {s.name: s.value for s in p.signals if s.name != "source"}
        source = next((str(s.value) for s in p.signals if s.name == "source"), "model")
        basis = source if source.startswith("rule:") else f"model p={p.probability:.2f}"
        evidence_text = ", ".join(f"{k}={v}" for k, v in signals.items())
        reason = f"predicted failure of {where} within {p.horizon_h:g} h ({basis}; {evidence_text})"
        crossed = {"probability": p.probability, "horizon_h": p.horizon_h, "source": source, **signals}
        drain = Command(
            id=command_id("drain", p.job or "-", p.node, p.gpu, p.id), type="drain", ts=p.ts, job=p.job,
            node=p.node, gpu=p.gpu, reason=reason, evidence=[p.id],
            params={"replan": p.job is not None, "signals": crossed},
        )
        if p.job is None:  # nothing to save: the kube consumer cordons the GPU
            return self._send(drain, pol.mode)
        checkpoint = Command(
            id=command_id("checkpoint", p.job, p.node, p.gpu, p.id), type="checkpoint", ts=p.ts, job=p.job,
            node=p.node, gpu=p.gpu, reason=f"checkpoint before drain: {reason}", evidence=[p.id],
            params={"before": "drain", "signals": crossed},
        )
        follow = {"then": drain.model_dump(mode="json", exclude_none=True)}
        return self._send(checkpoint, pol.mode, follow)

    # -- acks ----------------------------------------------------------------------------------
    def _on_ack(self, ack: Ack) -> list[Record]:
        pending, moved = self.fleet.apply_ack(ack)
        if pending is None:
            self.peers.apply_ack(ack)  # another worker's command (or one not seen yet)
            return []
        if not moved:
            return []
        c = pending.command
        target = pending.target
        out: list[Record] = []
        if ack.status in ("rejected", "failed"):
            out += self._audit(f"ack_{ack.status}", f"{pending.type} {pending.id} {ack.status} by {ack.by}: "
                               f"{ack.detail or 'no detail'}", ack.ts, target=pending.id,
                               command_id=pending.id, job=c.get("job"), node=c.get("node"), gpu=c.get("gpu"),
                               once=False)
            return out
        if pending.type == "drain" and target is not None:
            if ack.status in ("received", "applied"):
                self.fleet.set_status(target, "draining", ack.ts, c["reason"], pending.id)
            elif ack.status == "done":
                self.fleet.set_status(target, "drained", ack.ts, c["reason"], pending.id)
                out += self._after_drain(pending, ack.ts)
        new_plan = pending.follow_up.get("plan")
        if pending.type == "resize" and ack.status == "done" and new_plan and c.get("job"):
            self._runs(self._job(c["job"]), new_plan)
        migrated = pending.follow_up.get("migrated")
        if migrated and ack.status == "done" and c.get("job"):
            job = self._job(c["job"])
            if migrated.get("plan"):
                self._runs(job, migrated["plan"])
            else:  # placement only estimated the destination: the ranks there, in order
                job.plan, job.shares, job.layers = None, {}, {}
                job.ranks = {r: (str(n), int(g)) for r, (n, g) in enumerate(migrated["ranks_to"])}
        if pending.type == "consolidate" and ack.status == "done" and c.get("job") \
                and c.get("params", {}).get("action") == "move":
            self._moved(self._job(c["job"]), c["params"].get("moves") or [])
        if ack.status == "done" and pending.follow_up.get("then"):
            nxt = Command.model_validate({**pending.follow_up["then"], "ts": ack.ts,
                                          "requires": [pending.id]})
            out += [self._issue(nxt, ack.ts, pending.follow_up.get("after"))]
        hib = pending.follow_up.get("hibernate")
        if hib and ack.status == "done":  # the node sleeps: its GPUs leave every plan until woken
            for gpu in hib["gpus"]:
                self.fleet.set_status((hib["node"], int(gpu)), "hibernating", ack.ts, c["reason"], pending.id)
        wake = pending.follow_up.get("wake")
        if wake and ack.status == "done":
            for gpu in wake["gpus"]:
                self.fleet.set_status((wake["node"], int(gpu)), "in_service", ack.ts, c["reason"], pending.id)
        return out

    @staticmethod
    def _runs(job: JobState, plan: dict[str, Any]) -> None:
        """The job runs `plan` now (a resize's or a migration's done): its ranks are the plan's,
        and shares or stage boundaries sent for the old plan no longer hold."""
        job.plan, job.shares, job.layers = plan, {}, {}
        job.ranks = {int(r["rank"]): (str(r["node"]), int(r["gpu"])) for r in plan["ranks"]}

    @staticmethod
    def _moved(job: JobState, moves: Sequence[Mapping[str, Any]]) -> None:
        """A consolidation's moves are done: the job's ranks (and its plan's) run on their new GPUs."""
        to = {int(m["rank"]): (str(m["to"]["node"]), int(m["to"]["gpu"])) for m in moves}
        job.ranks.update(to)
        if job.plan:
            job.plan = {**job.plan, "ranks": [
                {**r, "node": to[r["rank"]][0], "gpu": to[r["rank"]][1]} if r["rank"] in to else r
                for r in job.plan["ranks"]]}

    def _after_drain(self, drain: PendingCommand, ts: float) -> list[Record]:
        """The job goes on over its remaining GPUs: a resize, re-planned when its plan is known."""
        c = drain.command
        name, target = c.get("job"), drain.target
        if not name or target is None or not self.config.failure.resize_after_drain:
            return []
        job = self._job(name)
        job.left.append(target)
        gone = set(job.left)
        params: dict[str, Any] = {"leave": [list(target)]}
        follow: dict[str, Any] = {}
        new_plan = self._replan(job, gone) if job.plan else None
        if new_plan is not None:
            plan, diffs = new_plan
            params.update(_replanned(job.plan["predicted_step_s"], plan, diffs))
            follow["plan"] = plan.model_dump(mode="json", exclude_none=True)
        else:
            params["world_size"] = sum(1 for k in job.ranks.values() if k not in gone)
        cmd = Command(
            id=command_id("resize", name, target[0], target[1], drain.id), type="resize", ts=ts, job=name,
            node=target[0], gpu=target[1],
            reason=f"{name} continues without {target[0]}/gpu{target[1]} (drained): "
                   f"{params['world_size']} ranks", evidence=[*c.get("evidence", []), drain.id],
            params=params,
        )
        return self._send(cmd, self.config.resize.mode, follow)

    def _replan(self, job: JobState, gone: set[GpuKey] | frozenset = frozenset(),
                joining: Sequence[GpuKey] = ()) -> tuple[Plan, list] | None:
        """The planner's re-plan of the job's plan without `gone` and with `joining` (None when
        the model or the inventory of a node is not known here, or no plan fits: a resize then
        names only who leaves)."""
        from fleetwise.planner import cluster_from_inventory, replan, request_for_plan

        plan = Plan.model_validate(job.plan)
        own = {(r.node, r.gpu) for r in plan.ranks}
        nodes = {node for node, _gpu in own} | {node for node, _gpu in joining}
        if not nodes <= set(self.inventory):
            return None
        try:
            request = request_for_plan(plan)
            cluster = cluster_from_inventory([self.inventory[n] for n in sorted(nodes)])
            wanted = set(joining)
            add = [s for s in cluster.slots if s.key in wanted]
            cluster.slots = [s for s in cluster.slots if s.key in own]
            return replan(plan, request, cluster, remove=gone & {s.key for s in cluster.slots}, add=add)
        except (ValueError, KeyError):
            return None

    # -- stragglers: rebalance with gain, hysteresis and cooldown -----------------------------
    def _on_straggler(self, p: Prediction, name: str) -> list[Record]:
        pol = self.config.straggler
        job = self._job(name)
        # What a slow rank slows: its data-parallel replica, or in a pure pipeline its stage.
        dp = (job.stage_of if job.pipeline_only() else job.dp_of)(int(p.rank))  # type: ignore[arg-type]
        factor = p.factor if p.factor is not None else 1.0
        was_slow = dp in job.slow
        if p.alert and factor < pol.slow_below:
            if was_slow and abs(job.slow[dp] - factor) < 0.02:
                return []
            job.slow[dp] = factor
        elif was_slow and (not p.alert or factor >= pol.recover_above):
            job.slow.pop(dp)
        else:
            return []  # between the two thresholds: the last state holds (hysteresis)
        if self._stale(p):
            return self._audit("stale", f"straggler evidence for {name} rank {p.rank} is stale: no action",
                               p.ts, target=f"{name}/rebalance", job=name, evidence=[p.id])
        if job.last_rebalance_ts is not None and p.ts - job.last_rebalance_ts < pol.cooldown_s:
            return self._audit("cooldown", f"{name} was rebalanced {p.ts - job.last_rebalance_ts:.0f} s ago "
                               f"(cooldown {pol.cooldown_s:g} s)", p.ts, target=f"{name}/rebalance",
                               job=name, evidence=[p.id])
        verb = "slower" if dp in job.slow else "back to expected speed"
        params: dict[str, Any]
        if job.pipeline_only():
            layout, gain = self._rebalance_layers(job)
            params = {"layers": layout_json(layout),
                      "stage_speed_factors": {str(d): round(f, 4) for d, f in sorted(job.slow.items())}}
        else:
            current, new, total = self._rebalance_shares(job)
            gain = _step_gain(current, new, job)
            params = {"speed_factors": {str(d): round(f, 4) for d, f in sorted(job.slow.items())}}
            if total is not None:
                params["samples"] = {str(d): s for d, s in sorted(new.items())}
                params["global_samples"] = total
        if gain < pol.min_gain and dp in job.slow:
            return self._audit("small_gain", f"rebalancing {name} for rank {p.rank} would gain {gain:.1%} "
                               f"(< {pol.min_gain:.0%})", p.ts, target=f"{name}/rebalance", job=name,
                               evidence=[p.id])
        job.last_rebalance_ts = p.ts
        params["predicted_gain"] = round(gain, 4)
        if job.pipeline_only():
            job.layers = dict(layout)
        else:
            job.shares = dict(new)
        cmd = Command(
            id=command_id("rebalance", name, p.rank, p.id), type="rebalance", ts=p.ts, job=name,
            node=p.node, gpu=p.gpu,
            reason=f"rank {p.rank} on {p.node}/gpu{p.gpu} runs {verb} (speed factor {factor:.2f}); "
                   f"predicted step-time gain {gain:.1%}",
            evidence=[p.id], params={**params, "signals": {"factor": factor, "probability": p.probability}},
        )
        return self._send(cmd, pol.mode)

    def _rebalance_layers(self, job: JobState) -> tuple[dict[int, tuple[int, int]], float]:
        """New stage boundaries of a pure pipeline and their predicted step-time gain. The plan
        balanced its stages, so a stage's seconds per layer is 1 / (its planned layers x its
        speed factor): slow stages give layers to the others, and with every factor back at 1
        the plan's split returns. A stage takes at most as many layers as its memory held per
        layer in the plan (a bound below the true one: the plan's memory includes what does
        not grow with layers)."""
        plan = Plan.model_validate(job.plan)
        stages = sorted({r.stage for r in plan.ranks})
        planned = {s: next(r.layers for r in plan.ranks if r.stage == s) for s in stages}
        sizes = [planned[s][1] - planned[s][0] + 1 for s in stages]
        current = [job.layers[s][1] - job.layers[s][0] + 1 for s in stages] if job.layers else sizes
        per_layer = [1.0 / (n * job.slow.get(s, 1.0)) for s, n in zip(stages, sizes, strict=True)]
        caps = [min(int(r.memory_capacity_gb * n / r.memory_gb) if r.memory_gb > 0 else sum(sizes)
                    for r in plan.ranks if r.stage == s) for s, n in zip(stages, sizes, strict=True)]
        new = plan_stage_split(per_layer, sum(sizes), caps) or current

        def step(ns: list[int]) -> float:
            return max(n * c for n, c in zip(ns, per_layer, strict=True))
        gain = max(0.0, 1.0 - step(new) / step(current))
        first = planned[stages[0]][0]
        layout = {s: (first + sum(new[:i]), first + sum(new[:i + 1]) - 1) for i, s in enumerate(stages)}
        return layout, gain

    def _rebalance_shares(self, job: JobState) -> tuple[dict[int, int], dict[int, int], int | None]:
        """(current, new) samples per dp rank and the global batch; relative units without a plan."""
        if job.plan:
            base = replica_samples(Plan.model_validate(job.plan))
            total = int(job.plan["global_batch"])
            current = job.shares or base
            order = sorted(base)
            shares = proportional_shares([base[d] * job.slow.get(d, 1.0) for d in order], total)
            return current, dict(zip(order, shares, strict=True)), total
        dps = sorted(set(job.dp_of(r) for r in job.ranks) | set(job.slow))
        unit = 1000 * max(len(dps), 1)  # relative shares; the plugin applies speed_factors
        current = job.shares or dict(zip(dps, proportional_shares([1.0] * len(dps), unit), strict=True))
        new = dict(zip(dps, proportional_shares([job.slow.get(d, 1.0) for d in dps], unit), strict=True))
        return current, new, None

    # -- consolidation and migration, checked on a period of event time ----------------------
    @property
    def wants_utilisation(self) -> bool:
        return self.utilisation is not None

    def observe_utilisation(self, keys: Sequence[GpuKey], ts: Any, util: Any,
                            jobs: Sequence[str | None] | None = None,
                            ranks: Sequence[int | None] | None = None,
                            full_power_c: Any = None) -> list[Record]:
        """Per-GPU utilisation of closed feature hops (arrays; `full_power_c`: each hop's
        temperature at full power, for placement); returns the commands and audit events of a
        consolidation or migration check that falls due."""
        if self.utilisation is None or not len(keys):
            return []
        self.utilisation.observe(keys, ts, util, jobs, ranks, full_power_c)
        now = float(max(ts))
        out: list[Record] = []
        if self._due("consolidate", now, self.config.consolidate.check_every_s):
            self.utilisation.prune(now)  # also when no consolidation can be planned (no inventory)
            out += self._consider_consolidation(now)
        if self.config.migrate.mode != "off" and self._due("migrate", now, self.config.migrate.check_every_s):
            out += self._consider_migrations(now)
        return out

    def _due(self, what: str, now: float, every: float) -> bool:
        nxt = self._next_check.get(what)
        if nxt is None:  # the first window fills before the first check
            self._next_check[what] = now + every
            return False
        if now < nxt:
            return False
        self._next_check[what] = now + every
        return True

    def _consider_consolidation(self, now: float) -> list[Record]:
        if self.utilisation is None or not self.inventory or self.fleet.open_commands("consolidate"):
            return []  # one consolidation at a time; nothing to pack without inventory
        cons = self.config.consolidate
        asleep = hibernating_nodes({k: g.status for k, g in self.fleet.gpus.items()})
        leaving = self.fleet.out_of_service() | self.peers.out()
        leaving -= {k for k in self.fleet.gpus if k[0] in asleep}
        try:
            snapshot = consolidation_snapshot(self.utilisation, list(self.inventory.values()), now,
                                              cons.utilisation_below * 100.0, leaving, asleep)
            if snapshot is None:
                return []
            plan = plan_consolidation(snapshot, ConsolidationConfig(
                low_util_threshold=cons.utilisation_below, window_s=cons.sustained_s,
                max_moves=cons.max_moves, dry_run=self.config.dry_run))
        except ConsolidationError as exc:
            return self._audit("consolidation_skipped", f"consolidation not planned: {exc}", now,
                               target="consolidate")
        out: list[Record] = []
        saved = plan.savings
        for cmd in plan.commands:
            action = cmd.params.get("action")
            follow: dict[str, Any] = {}
            if action in ("hibernate", "wake") and cmd.node:
                follow[action] = {"node": cmd.node, "gpus": cmd.params.get("gpus", [])}
            params = {**cmd.params, "savings": {"watts": round(saved.watts_saved, 1),
                                                "gco2": round(saved.gco2_saved, 1),
                                                "gpu_hours": round(saved.gpu_hours_saved, 2),
                                                "horizon_h": saved.horizon_h}}
            ready = cmd.model_copy(update={"params": params})
            if action == "move" and cmd.job:
                # The job's pods on the nodes its ranks leave are evicted: it checkpoints first
                # (the plugin), and the move (the kube consumer) waits for that checkpoint.
                checkpoint = Command(
                    id=command_id("checkpoint", cmd.job, "move", cmd.id), type="checkpoint", ts=cmd.ts,
                    job=cmd.job, node=cmd.node, reason=f"checkpoint before moving ranks: {cmd.reason}",
                    evidence=list(cmd.evidence), params={"before": "move"})
                then = {"then": ready.model_dump(mode="json", exclude_none=True)}
                out += self._send(checkpoint, cons.mode, then)
                continue
            out += self._send(ready, cons.mode, follow)
        return out

    def _consider_migrations(self, now: float) -> list[Record]:
        out: list[Record] = []
        pol = self.config.migrate
        gone = self.fleet.out_of_service() | self.peers.out()
        for name, job in self._live_jobs():
            if not job.plan or self.fleet.open_commands("migrate") and any(
                    p.command.get("job") == name for p in self.fleet.open_commands("migrate")):
                continue
            plan = Plan.model_validate(job.plan)
            if not {r.node for r in plan.ranks} <= set(self.inventory):
                continue
            move = migration_for(plan, list(self.inventory.values()), gone, pol.min_saving, pol.remaining_s,
                                 self.utilisation.full_power_c())
            if move is None:
                continue
            gpus = [list(k) for k in move.destination]
            # The destination as the KAI consumer reads it (docs/kube.md): GPUs, site and type.
            dest = {"gpus": gpus, "site": move.site, "gpu_type": move.gpu_type,
                    "nodes": sorted({node for node, _ in move.destination})}
            saving = 1 - move.best_total / move.current_total
            why = (f"placement cost {move.best_total:.3f} on {len(gpus)} {move.gpu_type} at {move.site} vs "
                   f"{move.current_total:.3f} where {name} runs ({saving:.0%} "
                   f"cheaper, >= {pol.min_saving:.0%}); transfer {move.transfer_s:.0f} s")
            base = {"job": name, "ts": now, "evidence": [], "reason": why}
            uri = f"fleetwise://checkpoints/{name}/migrate-{int(now)}"
            phases = [
                Command(id=command_id("migrate", name, "snapshot", now), type="migrate",
                        params={"phase": "snapshot", "checkpoint_uri": uri, "destination": dest}, **base),
                Command(id=command_id("migrate", name, "transfer", now), type="migrate",
                        params={"phase": "transfer", "checkpoint_uri": uri, "destination": dest}, **base),
                Command(id=command_id("migrate", name, "restore", now), type="migrate",
                        params={"phase": "restore", "checkpoint_uri": uri, "destination": dest}, **base),
            ]
            # Once the job runs there (the restore's done), its plan is the destination's.
            moved = {"plan": _plan_on(move.plan, name) if move.plan is not None else None,
                     "ranks_to": gpus}
            follow = {"then": phases[1].model_dump(mode="json", exclude_none=True),
                      "after": {"then": phases[2].model_dump(mode="json", exclude_none=True),
                                "after": {"migrated": moved}}}
            out += self._send(phases[0], pol.mode, follow)
        return out

    # -- inventory, plans, operators ----------------------------------------------------------
    def _on_inventory(self, inv: NodeInventory) -> list[Record]:
        models = {(n.node, g.index): g.model for n in self.inventory.values() for g in n.gpus}
        self.inventory[inv.node] = inv
        out: list[Record] = []
        freed = False  # a GPU joined or came back: jobs may grow (an inventory sent again frees none)
        for g in inv.gpus:
            key = (inv.node, g.index)
            joined = key not in self.fleet.gpus
            self.fleet.known(key)
            state = self.fleet.gpus[key]
            if state.status in ("drained", "hibernating") and inv.ts > state.since_ts:
                out += self._return(key, inv.ts, f"inventory of {inv.node} at {inv.ts:.0f} lists it again")
                freed = True
            elif joined:
                out += self._grow_onto(key, g.model, models, inv.ts)
                freed = True
        return out + (self._grow_to_intent(inv.ts, f"inventory of {inv.node}") if freed else [])

    def _grow_onto(self, key: GpuKey, model: str, models: dict[GpuKey, str], ts: float) -> list[Record]:
        """A GPU joined the fleet: the first job (by name) that lost a GPU of the same model to a
        drain grows back onto it. A job's intent, as far as the stream knows it, is the size it
        was planned at, so a job only grows back to that size, never beyond."""
        for name, job in self._live_jobs():
            lost = next((k for k in job.left if models.get(k) == model), None)
            if lost is None:
                continue
            job.left.remove(lost)
            cmd = Command(
                id=command_id("resize", name, "join", key[0], key[1], ts), type="resize", ts=ts, job=name,
                node=key[0], gpu=key[1],
                reason=f"{key[0]}/gpu{key[1]} ({model}) joined the fleet: {name} grows back to its planned "
                       f"size in place of {lost[0]}/gpu{lost[1]}",
                params={"join": [list(key)], "replaces": [list(lost)],
                        "world_size": self._job_size(job) - len(job.left)},
            )
            return self._send(cmd, self.config.resize.mode)
        return []

    # -- growth to the intent's maximum ----------------------------------------------------------
    def _grow_to_intent(self, ts: float, why: str) -> list[Record]:
        """GPUs may have come free (`why`): each planned job whose intent allows more GPUs than
        it runs on (`constraints.max_gpus`), in name order, grows onto free GPUs it may use when
        the planner's re-plan over them is at least `resize.min_gain` faster. A job that lost
        GPUs grows back in their place first (`_grow_onto`); one with a disruptive command in
        flight waits for it."""
        out: list[Record] = []
        free: list[GpuKey] | None = None
        for name, job in self._live_jobs():
            constraints = (job.plan or {}).get("constraints") or {}
            limit = constraints.get("max_gpus")
            if not job.plan or limit is None or limit <= self._job_size(job) or job.left:
                continue
            if not self.decides_for(name):
                continue
            if any(p.command.get("job") == name and p.type in DISRUPTIVE for p in self.fleet.open_commands()):
                continue
            if free is None:
                free = self._free_gpus()
            usable = self._allowed(free, constraints)
            if not usable:
                continue
            sent = self._grow_job(name, job, usable, int(limit), ts, why)
            taken = {(str(n), int(g)) for c in sent if isinstance(c, Command)
                     for n, g in c.params.get("join", [])}
            free = [k for k in free if k not in taken]
            out += sent
        return out

    def _free_gpus(self) -> list[GpuKey]:
        """In-service GPUs of the inventory that no live job runs on (by its plan, the ranks
        predictions named, or the job the GPU's latest telemetry names) and no open command is
        bringing into a job, in node and index order."""
        busy = {k for _, job in self._live_jobs() for k in job.ranks.values()}
        if self.utilisation is not None:  # jobs the telemetry names (started outside `job start`)
            busy |= {k for ranks in self.utilisation.placements().values() for k in ranks.values()}
        for p in self.fleet.open_commands():
            busy.update(_claimed(p.command, p.follow_up))
            if p.target is not None:
                busy.add(p.target)
        busy |= self.peers.out()
        return [(node, g.index) for node, inv in sorted(self.inventory.items())
                for g in sorted(inv.gpus, key=lambda g: g.index)
                if (node, g.index) not in busy and self.fleet.status((node, g.index)) == "in_service"]

    def _allowed(self, keys: list[GpuKey], constraints: dict[str, Any]) -> list[GpuKey]:
        """The GPUs the intent's constraints allow (catalog ids and the node's site); a model
        the catalog lacks is not a GPU to grow onto, nor are any when a constraint names one."""
        from fleetwise.planner.placement import allowed_gpu_types

        try:
            allow, exclude = allowed_gpu_types(JobConstraints.model_validate(constraints))
        except ValueError:
            return []
        sites = constraints.get("sites")
        return [k for k in keys if (sites is None or self.inventory[k[0]].site in sites)
                and (spec := self._gpu_spec(k)) is not None
                and (allow is None or spec.id in allow) and spec.id not in exclude]

    def _gpu_spec(self, key: GpuKey) -> GpuSpec | None:
        """The catalog row of an inventory GPU (None when the catalog does not resolve it)."""
        model = next((g.model for g in self.inventory[key[0]].gpus if g.index == key[1]), "")
        try:
            return lookup(model)
        except UnknownGpuError:
            return None

    def _grow_job(self, name: str, job: JobState, usable: list[GpuKey], limit: int, ts: float,
                  why: str) -> list[Record]:
        """One job's growth onto `usable` (at most up to `limit` GPUs): the re-plan over as many as
        it may take, else over whole TP x PP groups of them; a `resize` with the GPUs joining."""
        plan = Plan.model_validate(job.plan)
        size = len(plan.ranks)
        own = {(r.node, r.gpu) for r in plan.ranks}
        # Nodes the job runs on first (their GPUs talk over NVLink), then GPU models it runs on,
        # then the fastest, then the fullest free nodes.
        per_node: dict[str, int] = {}
        for node, _gpu in usable:
            per_node[node] = per_node.get(node, 0) + 1
        ours = {node for node, _gpu in own}
        kinds = {r.model for r in plan.ranks}

        def rank(k: GpuKey) -> tuple:
            spec = self._gpu_spec(k)  # resolved: `_allowed` kept only GPUs the catalog knows
            assert spec is not None
            tflops = spec.capability_tflops(plan.dtype) if spec.supports(plan.dtype) else 0.0
            return (k[0] not in ours, spec.id not in kinds, -tflops, -per_node[k[0]], k)
        ordered = sorted(usable, key=rank)
        most = min(len(ordered), limit - size)
        group = plan.tp * plan.pp
        whole = most // group * group  # whole TP x PP groups: the degrees can stay
        tries = [most] + ([whole] if whole not in (0, most) else [])
        rails, min_gain = self.config.rails, self.config.resize.min_gain
        hour = [t for t in job.disruptive_ts if ts - t < 3600.0]
        held: str | None = None  # why the first re-plan was not taken
        for count in tries:
            grown = self._replan(job, joining=ordered[:count]) if count else None
            if grown is None:
                held = held or f"no plan over {count} more GPU(s) fits"
                continue
            new, diffs = grown
            keys = {(r.node, r.gpu) for r in new.ranks}
            join = sorted(keys - own)
            if not own <= keys or not join:
                held = held or (f"the re-plan over {count} more GPU(s) uses none of them" if not join else
                                f"the re-plan over {count} more GPU(s) drops {len(own - keys)} it runs on")
                continue
            gain = plan.predicted_step_s / new.predicted_step_s - 1.0
            if gain < min_gain:
                held = held or (f"growing from {size} to {len(new.ranks)} GPUs would gain {gain:.1%} "
                                f"(< {min_gain:.0%}; predicted step {plan.predicted_step_s:.3f} s -> "
                                f"{new.predicted_step_s:.3f} s)")
                continue
            if len(hour) >= rails.max_disruptive_per_job_per_hour:
                return self._audit("job_rate", f"{len(hour)} disruptive commands for {name} in the last "
                                   f"hour (max {rails.max_disruptive_per_job_per_hour}): not grown onto "
                                   f"{len(join)} free GPU(s)", ts, target=name, job=name)
            before, after = plan.predicted_step_s, new.predicted_step_s
            cmd = Command(
                id=command_id("resize", name, "grow", *[f"{n}/{g}" for n, g in join], ts), type="resize",
                ts=ts, job=name,
                reason=f"{why}: {name} grows from {size} to {len(new.ranks)} GPUs (its intent allows "
                       f"{limit}); predicted step {before:.3f} s -> {after:.3f} s",
                params={"join": [list(k) for k in join], **_replanned(before, new, diffs)},
            )
            return self._send(cmd, self.config.resize.mode,
                              {"plan": new.model_dump(mode="json", exclude_none=True)})
        if held is None:
            return []
        return self._audit("not_grown", f"{why}: {name} not grown: {held}", ts, target=f"{name}/grow",
                           job=name)

    def _live_jobs(self) -> list[tuple[str, JobState]]:
        """The jobs that may still get commands (not ended), in name order."""
        return [(name, job) for name, job in sorted(self.jobs.items()) if job.ended_ts is None]

    def _on_job_end(self, end: JobEnd) -> list[Record]:
        """The job is over: its state is dropped now, or, while commands for it are in flight,
        once they are answered (the retire sweep); until then it gets no more commands and a GPU
        a late prediction names is acted on as a GPU in no job. A second end changes nothing."""
        job = self.jobs.get(end.job)
        # A tombstone carries no event time: the newest the policy has seen stands in for it.
        ts = end.ts if end.ts is not None else (self.newest_ts if math.isfinite(self.newest_ts) else 0.0)
        # The GPUs its telemetry named are free now (for a job known from telemetry alone too).
        labelled = self.utilisation.forget_job(end.job) if self.utilisation is not None else 0
        if job is None:
            return self._grow_to_intent(ts, f"job {end.job} ended") if labelled else []
        if job.ended_ts is not None:
            return []
        in_flight = sorted(p.id for p in self.fleet.open_commands() if p.command.get("job") == end.job)
        if in_flight:
            job.ended_ts = ts
            job.plan, job.shares, job.slow = None, {}, {}
            why = (f"job {end.job} ended (plan withdrawn): no more commands for it; its state is dropped "
                   f"once {len(in_flight)} command(s) in flight are answered")
        else:
            del self.jobs[end.job]
            self.ended_jobs += 1
            why = f"job {end.job} ended (plan withdrawn): its state is dropped"
        out = self._audit("job_ended", why, ts, target=end.job, job=end.job, evidence=in_flight, once=False)
        return out + self._grow_to_intent(ts, f"job {end.job} ended")

    def _on_plan(self, plan: Plan) -> None:
        job = self._job(plan.job)
        job.ended_ts = None  # a plan under an ended job's name: the job runs (again)
        job.plan = plan.model_dump(mode="json", exclude_none=True)
        job.ranks = {r.rank: (r.node, r.gpu) for r in plan.ranks}
        job.shares = {}

    def _on_operator(self, op: OperatorAction) -> list[Record]:
        verdict = verify_operator(op, self.operator_keys)
        if not verdict:
            # Every worker reads the operator topic: the one the action concerns (it holds the
            # command, or has the GPU out of service) reports the refusal.
            if op.action == "return_gpu":
                concerned = self.fleet.status((op.node, int(op.gpu))) != "in_service"  # type: ignore[arg-type]
                target = f"{op.node}/{op.gpu}"
            else:
                held = self.fleet.commands.get(op.command_id or "")
                concerned = held is not None and held.status == "held"
                target = op.command_id or ""
            if not concerned:
                self.suppressed["operator_rejected"] = self.suppressed.get("operator_rejected", 0) + 1
                return []
            why = f"{op.action} by {op.by} refused: {verdict.reason}"
            return self._audit("operator_rejected", why, op.ts, target=target, command_id=op.command_id,
                               node=op.node, gpu=op.gpu, once=False)
        if op.action == "return_gpu":
            out = self._return((op.node, int(op.gpu)), op.ts,  # type: ignore[arg-type]
                               f"returned by {op.by}" + (f": {op.reason}" if op.reason else ""))
            return out + self._grow_to_intent(op.ts, f"{op.node}/gpu{op.gpu} returned by {op.by}")
        pending = self.fleet.commands.get(op.command_id or "")
        if pending is None or pending.status != "held":
            # Every worker reads the operator topic; the one holding the command acts on it.
            key = "operator_unknown_command"
            self.suppressed[key] = self.suppressed.get(key, 0) + 1
            return []
        if op.action == "deny":
            pending.status = "rejected"
            pending.detail = f"denied by {op.by}"
            return self._audit("denied", f"{pending.id} denied by {op.by}: {op.reason}", op.ts,
                               target=pending.id, command_id=pending.id, once=False)
        cmd = Command.model_validate({**pending.command, "ts": op.ts})
        del self.fleet.commands[pending.id]
        return [self._issue(cmd, op.ts, pending.follow_up)]

    def _on_peer_command(self, cmd: Command) -> None:
        """A command on the command topics: this worker's own (tracked already) or another's."""
        if cmd.id in self.fleet.commands:
            return
        verdict = verify_command(cmd, self.keyring, now=cmd.ts)  # signed by a worker's key
        if not verdict:
            self.suppressed["peer_command_refused"] = self.suppressed.get("peer_command_refused", 0) + 1
            return
        self.peers.observe(cmd)

    def _return(self, key: GpuKey, ts: float, why: str) -> list[Record]:
        self.peers.gpu_returned(key, ts)
        if self.fleet.status(key) == "in_service":
            return []
        self.fleet.set_status(key, "in_service", ts, why)
        out = self._audit("gpu_returned", f"{key[0]}/gpu{key[1]} back in service: {why}", ts,
                          target=f"{key[0]}/{key[1]}", node=key[0], gpu=key[1], once=False)
        for name, job in self._live_jobs():
            if key in job.left:
                job.left.remove(key)
                cmd = Command(
                    id=command_id("resize", name, "join", key[0], key[1], ts), type="resize", ts=ts, job=name,
                    node=key[0], gpu=key[1], reason=f"{key[0]}/gpu{key[1]} is back: {name} grows again",
                    params={"join": [list(key)], "world_size": self._job_size(job) - len(job.left)},
                )
                out += self._send(cmd, self.config.resize.mode)
        return out


def _plan_on(plan: Plan, job: str) -> dict[str, Any]:
    """A destination's plan as the job's (JSON, named for the job)."""
    return plan.model_copy(update={"job": job}).model_dump(mode="json", exclude_none=True)


def _claimed(command: Mapping[str, Any], follow_up: Mapping[str, Any] | None) -> set[GpuKey]:
    """GPUs a command, or the commands that follow it, bring into a job: a growth's `join`, a
    migration's destination, a consolidation move's targets."""
    out: set[GpuKey] = set()
    chain: list[Mapping[str, Any]] = [command]
    nxt = follow_up or {}
    while nxt:
        if nxt.get("then"):
            chain.append(nxt["then"])
        nxt = nxt.get("after") or {}
    for c in chain:
        params = c.get("params", {}) or {}
        out.update((str(n), int(g)) for n, g in params.get("join", []) or [])
        out.update((str(n), int(g)) for n, g in (params.get("destination") or {}).get("gpus", []) or [])
        out.update((str(m["to"]["node"]), int(m["to"]["gpu"])) for m in params.get("moves", []) or [])
    return out


def _replanned(before_step_s: float, plan: Plan, diffs: Sequence[Any]) -> dict[str, Any]:
    """A resize's params for a re-planned job: its new size, shares, degrees, stage boundaries
    (a pipeline's, as a rebalance gives them) and per-GPU diff."""
    layers = {"layers": layout_json({r.stage: r.layers for r in plan.ranks})} if plan.pp > 1 else {}
    return {**layers,
        "world_size": len(plan.ranks),
        "samples": {str(d): n for d, n in sorted(replica_samples(plan).items())},
        "global_samples": plan.global_batch, "strategy": {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp},
        "plan_diff": [{"node": d.node, "gpu": d.gpu, "before": d.before, "after": d.after,
                       "changed": d.changed} for d in diffs],
        "predicted_step_s": {"before": before_step_s, "after": plan.predicted_step_s},
    }


def _event_ts(record: Record) -> float:
    ts = getattr(record, "ts", None)
    return float("-inf") if ts is None else float(ts)


def _step_gain(current: dict[int, int], new: dict[int, int], job: JobState) -> float:
    """Predicted step-time gain of `new` over `current` shares: a step lasts as long as its
    slowest replica, shares / speed (speed = the plan's share of an unslowed replica x factor)."""
    if not current or not new:
        return 0.0

    def step(shares: dict[int, int]) -> float:
        base = sum(current.values()) / max(len(current), 1)
        base_of = replica_samples(Plan.model_validate(job.plan)) if job.plan else {}
        return max(s / (base_of.get(d, base) * job.slow.get(d, 1.0)) for d, s in shares.items())
    before, after = step(current), step(new)
    return 0.0 if before <= 0 else max(0.0, 1.0 - after / before)
