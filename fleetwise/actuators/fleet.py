"""Fleet state: what the consumers report as done, not what the control plane asked for.

Built from inventory (which GPUs exist), plans (which job runs where) and acks (what consumers
did). A GPU is out of service only once a consumer acknowledged its drain; commands still
waiting for an ack are kept apart (`PendingCommand`) so the same decision is never asked twice
while its answer is on the way, and a command nobody answered expires and is re-decided.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from fleetwise.schemas import Ack, Command

GpuKey = tuple[str, int]
GpuStatus = Literal["in_service", "draining", "drained", "hibernating"]
# Where a command is in its life. "held": decided, waiting for an operator's approval.
CommandStatus = Literal["held", "issued", "received", "applied", "done", "rejected", "failed", "expired"]
FINISHED: frozenset[str] = frozenset({"done", "rejected", "failed", "expired"})
_ACK_ORDER = {"issued": 0, "received": 1, "applied": 2, "done": 3}


@dataclass
class GpuState:
    status: GpuStatus = "in_service"
    since_ts: float = 0.0
    reason: str = ""
    command_id: str | None = None


@dataclass
class PendingCommand:
    """A command and what its consumers said about it so far."""

    command: dict[str, Any]  # the signed command as JSON (kept as sent)
    status: CommandStatus = "issued"
    updated_ts: float = 0.0
    detail: str = ""
    result: dict[str, Any] = field(default_factory=dict)
    # What to do once it is done ({"then": "drain", ...}): the next step of a multi-step action.
    follow_up: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return str(self.command["id"])

    @property
    def type(self) -> str:
        return str(self.command["type"])

    @property
    def target(self) -> GpuKey | None:
        node, gpu = self.command.get("node"), self.command.get("gpu")
        return None if node is None or gpu is None else (str(node), int(gpu))


@dataclass
class FleetState:
    """GPUs by status, and every command still open, with what its acks said."""

    gpus: dict[GpuKey, GpuState] = field(default_factory=dict)
    commands: dict[str, PendingCommand] = field(default_factory=dict)

    # -- GPUs ------------------------------------------------------------------------------------
    def status(self, key: GpuKey) -> GpuStatus:
        state = self.gpus.get(key)
        return "in_service" if state is None else state.status

    def known(self, key: GpuKey) -> None:
        self.gpus.setdefault(key, GpuState())

    def set_status(self, key: GpuKey, status: GpuStatus, ts: float, reason: str,
                   command_id: str | None = None) -> None:
        self.gpus[key] = GpuState(status=status, since_ts=ts, reason=reason, command_id=command_id)

    def merge_gpus(self, other: dict[GpuKey, GpuState]) -> None:
        """Take another saved view of the GPUs: per GPU the newer status wins (a restore after a
        rebalance brings another worker's view, which must not roll this one's back)."""
        for key, state in other.items():
            mine = self.gpus.get(key)
            if mine is None or state.since_ts > mine.since_ts:
                self.gpus[key] = state

    def out_of_service(self) -> set[GpuKey]:
        return {k for k, g in self.gpus.items() if g.status != "in_service"}

    # -- commands --------------------------------------------------------------------------------
    def open_commands(self, kind: str | None = None, target: GpuKey | None = None) -> list[PendingCommand]:
        return [p for p in self.commands.values()
                if p.status not in FINISHED and (kind is None or p.type == kind)
                and (target is None or p.target == target)]

    def track(self, command: Command, status: CommandStatus, ts: float,
              follow_up: dict[str, Any] | None = None) -> PendingCommand:
        pending = PendingCommand(command=command.model_dump(mode="json", exclude_none=True),
                                 status=status, updated_ts=ts, follow_up=dict(follow_up or {}))
        self.commands[command.id] = pending
        return pending

    def apply_ack(self, ack: Ack) -> tuple[PendingCommand | None, bool]:
        """Record an ack; returns the command and whether its status moved (False for a late,
        repeated or unknown ack: acks from several ranks, or after a restart, change nothing)."""
        pending = self.commands.get(ack.command_id)
        if pending is None:
            return None, False
        status = ack.status
        if pending.status in FINISHED:
            return pending, False
        if status in _ACK_ORDER and _ACK_ORDER[status] <= _ACK_ORDER.get(pending.status, -1):
            return pending, False
        pending.status = status
        pending.updated_ts = ack.ts
        pending.detail = ack.detail or ""
        if ack.result:
            pending.result = dict(ack.result)
        return pending, True

    def expire(self, now: float) -> list[PendingCommand]:
        """Commands that got no ack at all before their expiry (reported, then re-decided)."""
        out = []
        for p in self.commands.values():
            expires = p.command.get("expires_ts")
            if p.status == "issued" and expires is not None and now > float(expires):
                p.status = "expired"
                p.updated_ts = now
                p.detail = "no ack before expiry"
                out.append(p)
        return out

    def is_done(self, command_id: str) -> bool:
        p = self.commands.get(command_id)
        return p is not None and p.status == "done"

    # -- persistence (plain JSON for changelogged state) -----------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": [[k[0], k[1], asdict(g)] for k, g in sorted(self.gpus.items())],
            "commands": {cid: asdict(p) for cid, p in self.commands.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FleetState:
        return cls(
            gpus={(n, int(g)): GpuState(**s) for n, g, s in data.get("gpus", [])},
            commands={cid: PendingCommand(**p) for cid, p in data.get("commands", {}).items()},
        )


def _takes_gpu_out(command: Command) -> bool:
    """A drain, or the checkpoint whose next step is one (`params.before == "drain"`)."""
    before = command.params.get("before")
    return command.type == "drain" or (command.type == "checkpoint" and before == "drain")


def _holds_gpu(p: PendingCommand) -> bool:
    """Whether a command keeps its GPU out: open, or a drain done (until the GPU returns)."""
    return p.status not in FINISHED or (p.type == "drain" and p.status == "done")


@dataclass
class PeerDrains:
    """GPUs that other workers' policies are taking out of service, as every worker sees them:
    their drain commands (the command topics) and those commands' acks, both read whole.

    Counted by the fleet-wide rails and kept out of placement; never acted on, never saved (a
    restarted worker reads the topics again). Topics read together arrive in no fixed order,
    so an ack may come before its command (kept a while), and a GPU's return before the drain
    it ends (a drain sent before the GPU's latest return is ignored).
    """

    sent: FleetState = field(default_factory=FleetState)  # their commands, with their acks
    early_acks: dict[str, Ack] = field(default_factory=dict)
    returned: dict[GpuKey, float] = field(default_factory=dict)
    # (event time, target) of every drain or drain checkpoint seen: the breaker's fleet-wide count
    decided: list[tuple[float, GpuKey]] = field(default_factory=list)

    def observe(self, command: Command) -> None:
        """Another worker's command (the caller skips its own): tracked if it takes a GPU out."""
        target = None if command.node is None or command.gpu is None else (command.node, int(command.gpu))
        if target is None or not _takes_gpu_out(command) or command.id in self.sent.commands:
            return
        self.decided.append((float(command.ts), target))
        if self.returned.get(target, float("-inf")) >= command.ts:
            return
        self.sent.track(command, "issued", float(command.ts))
        early = self.early_acks.pop(command.id, None)
        if early is not None:
            self.sent.apply_ack(early)

    def apply_ack(self, ack: Ack) -> None:
        """An ack for a command this worker did not send (kept until its command is seen)."""
        pending, _ = self.sent.apply_ack(ack)
        if pending is None:
            known = self.early_acks.get(ack.command_id)
            if known is None or _ACK_ORDER.get(ack.status, 9) >= _ACK_ORDER.get(known.status, 9):
                self.early_acks[ack.command_id] = ack

    def gpu_returned(self, key: GpuKey, ts: float) -> None:
        self.returned[key] = max(ts, self.returned.get(key, float("-inf")))
        self.sent.commands = {cid: p for cid, p in self.sent.commands.items()
                                  if p.target != key or float(p.command["ts"]) > ts}

    def forget(self, command_id: str) -> None:
        """This worker holds the command itself (restored from its saved state)."""
        self.sent.commands.pop(command_id, None)

    def out(self) -> set[GpuKey]:
        """GPUs out or leaving: a drain not refused or expired (done: out until returned), or
        a drain checkpoint still open."""
        return {p.target for p in self.sent.commands.values() if p.target is not None and _holds_gpu(p)}

    def decided_since(self, since: float) -> int:
        """GPUs another worker decided to take out at or after `since` (event time)."""
        return len({target for ts, target in self.decided if ts >= since})

    def expire(self, now: float, keep_s: float) -> None:
        """Silently expire unanswered commands (their sender reports it) and drop what no rail
        needs any more: finished commands other than done drains, acks and decisions older
        than `keep_s`."""
        self.sent.expire(now)
        self.sent.commands = {cid: p for cid, p in self.sent.commands.items() if _holds_gpu(p)}
        self.early_acks = {cid: a for cid, a in self.early_acks.items() if a.ts >= now - keep_s}
        self.decided = [(ts, t) for ts, t in self.decided if ts >= now - keep_s]
