"""Decision records: predictions and commands (DESIGN.md "Decision output"), dead letters."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fleetwise.schemas._base import Record, Timestamp

PredictionType = Literal["failure", "straggler", "imbalance", "thermal", "utilisation"]
CommandType = Literal["drain", "rebalance", "migrate", "consolidate", "resize", "checkpoint", "envelope"]


class Signal(Record):
    """One contributing signal: a feature's name, its value and its weight in the decision."""

    name: str
    value: float | str | None = None
    weight: float | None = None


class Prediction(Record):
    kind: Literal["prediction"] = "prediction"
    id: str
    type: PredictionType
    ts: Timestamp
    node: str
    gpu: int | None = None
    job: str | None = None
    rank: int | None = None
    probability: float = Field(ge=0, le=1)
    horizon_h: float = Field(ge=0)
    alert: bool
    signals: list[Signal] = Field(default_factory=list)
    lead_time_h: float | None = None
    factor: float | None = None  # straggler: measured speed / expected speed
    reason: str | None = None


class Command(Record):
    kind: Literal["command"] = "command"
    id: str
    type: CommandType
    ts: Timestamp
    job: str | None = None
    node: str | None = None
    gpu: int | None = None
    reason: str
    evidence: list[str] = Field(default_factory=list)
    params: dict[str, Any] = Field(default_factory=dict)
    dry_run: bool = False
    # Command lifecycle (DESIGN.md): order per job, a deadline, the signing key's id, and the
    # commands whose `done` ack must be seen before this one may act (a drain's checkpoint).
    seq: int | None = Field(default=None, ge=0)
    expires_ts: Timestamp | None = None
    key_id: str | None = None
    requires: list[str] = Field(default_factory=list)
    signature: str = ""


AckStatus = Literal["received", "applied", "done", "rejected", "failed"]


class Ack(Record):
    """A consumer's answer to a command (`fleetwise.acks`): the fleet state follows these."""

    kind: Literal["ack"] = "ack"
    command_id: str = Field(min_length=1)
    ts: Timestamp
    job: str | None = None
    node: str | None = None
    gpu: int | None = None
    rank: int | None = None
    by: str = Field(min_length=1)  # "training-plugin" | "kube-consumer" | "operator"
    status: AckStatus
    step: int | None = None  # training step at which it took effect
    detail: str | None = None  # why, for rejected / failed (and "duplicate")
    result: dict[str, Any] = Field(default_factory=dict)


class DeadLetter(Record):
    """A record that could not be processed, kept with the reason and its original bytes."""

    kind: Literal["deadletter"] = "deadletter"
    ts: Timestamp  # when it was rejected (event time of the stream position, else wall)
    source: str  # topic name or "file:line"
    reason: str
    original: str  # original payload, decoded as UTF-8 with replacement (or base64 when binary)
    encoding: Literal["utf-8", "base64"] = "utf-8"


class AuditEvent(Record):
    """What the control plane decided not to do, or noticed, with the reason (`fleetwise.audit`).

    Commands go to the audit topic as they are; these record the rest: a rail that held a
    command back, a circuit breaker opening or closing, a command that expired without an ack,
    a command waiting for an operator's approval, a GPU returned to service."""

    kind: Literal["audit"] = "audit"
    ts: Timestamp
    event: str  # e.g. "suppressed", "breaker_open", "expired", "awaiting_approval", "gpu_returned"
    reason: str
    command_id: str | None = None
    job: str | None = None
    node: str | None = None
    gpu: int | None = None
    evidence: list[str] = Field(default_factory=list)


class OperatorAction(Record):
    """An operator's word to the control plane (`fleetwise approve`, `fleetwise gpu return`)."""

    kind: Literal["operator"] = "operator"
    ts: Timestamp
    action: Literal["approve", "deny", "return_gpu"]
    command_id: str | None = None  # approve / deny
    node: str | None = None  # return_gpu
    gpu: int | None = None
    by: str = "operator"
    reason: str = ""
    # Signed like a command, under the operators' own keys (`fleetwise.actuators.signing`):
    # the workers and the kube consumer act only on an action that verifies.
    key_id: str | None = None
    signature: str = ""

    @model_validator(mode="after")
    def _target(self) -> OperatorAction:
        if self.action in ("approve", "deny") and not self.command_id:
            raise ValueError(f"command_id: required for action {self.action!r}")
        if self.action == "return_gpu" and (self.node is None or self.gpu is None):
            raise ValueError("node, gpu: both required for action 'return_gpu'")
        return self
