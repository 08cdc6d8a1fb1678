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
