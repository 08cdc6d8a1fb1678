"""Windowed feature vectors: what the stream processors hand to the predictors."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleetwise.schemas._base import Record, Timestamp


class FeatureVector(Record):
    """Features of one GPU (scope "gpu", keyed node/gpu) or one job rank (scope "rank", keyed job)
    over a window ending at `ts` (event time)."""

    kind: Literal["features"] = "features"
    scope: Literal["gpu", "rank"]
    ts: Timestamp
    window_s: float = Field(gt=0)
    node: str
    gpu: int = Field(ge=0)
    model: str | None = None  # catalog id
    job: str | None = None
    rank: int | None = None
    rack: str | None = None
    site: str | None = None
    values: dict[str, float | None]
