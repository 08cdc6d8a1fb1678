"""Telemetry records: GPU samples, node batches, training steps."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator, model_validator

from fleetwise.schemas._base import DCGM_BLANKS, Record, Timestamp, is_dcgm_blank

# Finite floats only: NaN/inf in a reading is a broken exporter, not a value.
MetricValue = Annotated[float, Field(allow_inf_nan=False)]


class GpuSample(Record):
    """One GPU's readings at one instant (DESIGN.md "GPU sample")."""

    ts: Timestamp
    node: str = Field(min_length=1)
    gpu: int = Field(ge=0, le=1023)
    uuid: str | None = None
    model: str = Field(min_length=1)
    metrics: dict[str, MetricValue | None] = Field(default_factory=dict)
    rack: str | None = None
    site: str | None = None
    job: str | None = None
    rank: int | None = Field(default=None, ge=0)

    @field_validator("metrics")
    @classmethod
    def _blank_to_missing(cls, metrics: dict[str, float | None]) -> dict[str, float | None]:
        # DCGM blanks mean "no value": store as missing, never as a huge reading. The set check
        # runs in C, so the common case (no blank) costs no Python loop per metric.
        if not DCGM_BLANKS.isdisjoint(metrics.values()):
            for key, num in metrics.items():
                if num is not None and is_dcgm_blank(num):
                    metrics[key] = None
        return metrics


class NodeBatch(Record):
    """All GPUs of one node at one collection tick: one Kafka message."""

    ts: Timestamp
    node: str = Field(min_length=1)
    samples: list[GpuSample]

    @model_validator(mode="after")
    def _same_node(self) -> NodeBatch:
        for i, sample in enumerate(self.samples):
            if sample.node != self.node:
                raise ValueError(f"samples.{i}.node is {sample.node!r}, batch node is {self.node!r}")
        return self


class TrainingStep(Record):
    """One rank's timing for one training step (DESIGN.md "Training step")."""

    ts: Timestamp
    job: str = Field(min_length=1)
    rank: int = Field(ge=0)
    node: str = Field(min_length=1)
    gpu: int = Field(ge=0)
    step: int = Field(ge=0)
    step_time_s: float = Field(gt=0, allow_inf_nan=False)
    compute_s: float = Field(ge=0, allow_inf_nan=False)
    micro_batch: int | None = Field(default=None, ge=0)
    samples: int | None = Field(default=None, ge=0)
    model: str | None = None

    @model_validator(mode="after")
    def _compute_within_step(self) -> TrainingStep:
        # compute can exceed step_time slightly from clock skew; far beyond it is garbage.
        if self.compute_s > self.step_time_s * 1.5:
            raise ValueError(
                f"compute_s {self.compute_s} exceeds 1.5x step_time_s {self.step_time_s}"
            )
        return self
