"""Parallelism plans: the planner's output (DESIGN.md `fleetwise plan --format json`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from fleetwise.schemas._base import Record, Timestamp
from fleetwise.schemas.jobs import JobConstraints


class RankPlan(Record):
    """One GPU's part in a plan."""

    rank: int = Field(ge=0)
    node: str
    gpu: int = Field(ge=0)
    model: str  # catalog id
    capability_tflops: float = Field(ge=0)
    micro_batch: int = Field(ge=0)  # samples per micro-batch on this data-parallel replica
    num_micro_batches: int = Field(default=1, ge=0)
    stage: int = Field(ge=0)
    layers: tuple[int, int]  # first and last layer (inclusive) held by this stage
    dp_rank: int = Field(default=0, ge=0)
    tp_rank: int = Field(default=0, ge=0)
    memory_gb: float = Field(ge=0)
    memory_capacity_gb: float = Field(gt=0)

    @property
    def samples(self) -> int:
        """Samples this replica processes per step."""
        return self.micro_batch * self.num_micro_batches


class Plan(Record):
    """A job's split over a set of GPUs, with what the cost model predicts for it."""

    job: str = "job"
    model: str = ""
    dtype: str = "bf16"
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    zero_stage: int = Field(ge=0, le=3)
    global_batch: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    recompute: str = "none"
    sequence_parallel: bool = False
    predicted_step_s: float = Field(gt=0)
    uniform_step_s: float | None = Field(default=None, gt=0)
    tokens_per_s: float = Field(ge=0)
    mfu: float = Field(ge=0)
    ranks: list[RankPlan]
    notes: list[str] = Field(default_factory=list)
    # The intent's constraints the job was planned under: `max_gpus` above the plan's size lets
    # the control plane grow the job when GPUs free up (docs/actuators.md, "Growing to the intent").
    constraints: JobConstraints | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if len(self.ranks) != self.dp * self.tp * self.pp:
            raise ValueError(
                f"ranks: {len(self.ranks)} ranks but dp*tp*pp = {self.dp * self.tp * self.pp}"
            )
        return self

    @property
    def speedup(self) -> float | None:
        return self.uniform_step_s / self.predicted_step_s if self.uniform_step_s else None


class JobEnd(Record):
    """A job is over: its plan is withdrawn and the control plane forgets the job.

    On Kafka it is the tombstone of the job's key on the compacted plans topic (a null value,
    which also lets compaction delete the plan); in a replay file, and as a value on the plans
    topic, this record. ``ts`` is None for a tombstone (it carries no event time)."""

    kind: Literal["job_end"] = "job_end"
    job: str = Field(min_length=1)
    ts: Timestamp | None = None


def plans_message(value: bytes | str | Mapping[str, Any] | None,
                  key: bytes | str | None = None) -> Plan | JobEnd:
    """A message of the plans topic: a `Plan`, a `JobEnd` record, or a tombstone (a null value:
    the end of the job named by `key`). Raises ValidationError / ValueError on anything else."""
    if value is None:
        job = key.decode("utf-8") if isinstance(key, bytes) else key
        if not job:
            raise ValueError("a plan tombstone (null value) needs the job as its key")
        return JobEnd(job=job)
    obj = value if isinstance(value, Mapping) else json.loads(value)
    if isinstance(obj, Mapping) and obj.get("kind") == "job_end":
        return JobEnd.model_validate(obj)
    return Plan.model_validate(obj)
