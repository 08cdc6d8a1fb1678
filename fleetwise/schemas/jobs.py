"""Job intents: what a training team asks for, without naming a GPU generation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleetwise.schemas._base import Record

Dtype = Literal["bf16", "fp16", "fp8", "fp32"]


class ModelShape(Record):
    """A decoder-only transformer's shape (GPT/Llama style)."""

    name: str = Field(min_length=1)
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    heads: int = Field(ge=1)
    seq_len: int = Field(default=2048, ge=1)
    vocab: int = Field(default=32000, ge=1)
    ffn_hidden: int | None = Field(default=None, ge=1)
    kv_heads: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelShape:
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not divisible by kv_heads {self.kv_heads}")
        return self

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


class JobConstraints(Record):
    min_gpus: int | None = Field(default=None, ge=1)
    max_gpus: int | None = Field(default=None, ge=1)
    gpu_types: list[str] | None = None  # allowed catalog ids; None = any
    exclude_gpu_types: list[str] = Field(default_factory=list)
    sites: list[str] | None = None
    max_tp: int | None = Field(default=None, ge=1)
    max_pp: int | None = Field(default=None, ge=1)
    zero_stages: list[int] | None = None
    min_memory_headroom: float = Field(default=0.05, ge=0, lt=1)


class JobIntent(Record):
    """A job as submitted: the model and batch, never the GPU type."""

    job: str = Field(min_length=1)
    model: ModelShape
    global_batch: int = Field(ge=1)
    seq_len: int | None = Field(default=None, ge=1)
    dtype: Dtype = "bf16"
    queue: str = "default"
    workload: Literal["training", "batch", "inference"] = "training"
    constraints: JobConstraints = Field(default_factory=JobConstraints)

    @property
    def sequence_length(self) -> int:
        return self.seq_len or self.model.seq_len
