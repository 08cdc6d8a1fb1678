"""Windowed feature vectors: what the stream processors hand to the predictors."""

from __future__ import annotations

from typing import Literal

import msgspec
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

    def to_json_bytes(self) -> bytes:
        """The same bytes as pydantic's serializer gives (tested), ~4x faster for the ~150
        values of a GPU's vector: a worker writes one per GPU per hop, thousands at once."""
        if self.__pydantic_extra__:
            return super().to_json_bytes()
        return _encode_json({k: v for k, v in self.__dict__.items() if v is not None})

    @classmethod
    def trusted(
        cls, *, scope: Literal["gpu", "rank"], ts: float, window_s: float, node: str, gpu: int,
        values: dict[str, float | None], model: str | None = None, job: str | None = None,
        rank: int | None = None, rack: str | None = None, site: str | None = None,
    ) -> FeatureVector:
        """A FeatureVector from a processor's own, already-consistent output, not validated:
        what `model_construct` gives with the fields that are not None, without its per-field
        default lookups (~1 us instead of ~20; a worker emits one per GPU per hop, thousands at
        once)."""
        fv = cls.__new__(cls)
        fields = {  # in field order, as model_construct fills it
            "kind": "features", "scope": scope, "ts": ts, "window_s": window_s, "node": node, "gpu": gpu,
            "model": model, "job": job, "rank": rank, "rack": rack, "site": site, "values": values,
        }
        _set(fv, "__dict__", fields)
        # Set = given a value: as model_construct given only the fields that are not None.
        _set(fv, "__pydantic_fields_set__", {k for k in _TRUSTED_FIELDS if fields[k] is not None})
        _set(fv, "__pydantic_extra__", {})
        _set(fv, "__pydantic_private__", None)
        return fv


_set = object.__setattr__
_encode_json = msgspec.json.Encoder().encode
_TRUSTED_FIELDS = ("scope", "ts", "window_s", "node", "gpu", "model", "job", "rank", "rack", "site", "values")
