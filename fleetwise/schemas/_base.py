"""Shared base model and field helpers for every Fleetwise record."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

# DCGM reports "no value" with sentinels at the top of each type's range (dcgm_structs.h:
# DCGM_INT32_BLANK 0x7ffffff0, DCGM_INT64_BLANK 0x7ffffffffffffff0, DCGM_FP64_BLANK 2**47,
# each followed by NOT_FOUND, NOT_SUPPORTED, NOT_PERMISSIONED, ... up to +15). JSON loses the
# field's type, so blanks are matched exactly: a large legitimate counter (energy in mJ,
# violation time in ns) is never mistaken for one.
DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0
DCGM_BLANKS: frozenset[float] = frozenset(
    [float(DCGM_INT32_BLANK + i) for i in range(16)]
    + [DCGM_FP64_BLANK + i for i in range(16)]
    + [float(DCGM_INT64_BLANK + i) for i in range(16)]  # all round to 2**63 as floats
)


def is_dcgm_blank(value: float) -> bool:
    """True when a DCGM value is one of the blank sentinels ("no value")."""
    as_float = float(value)  # an int64 blank parsed as a Python int becomes 2**63 here
    return as_float in DCGM_BLANKS or as_float >= float(DCGM_INT64_BLANK)


def _parse_ts(value: Any) -> Any:
    """Accept Unix seconds or an RFC 3339 string; always store Unix seconds (float)."""
    if isinstance(value, bool):
        raise ValueError("timestamp must be Unix seconds or an RFC 3339 string, not a boolean")
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            if not math.isfinite(number):
                raise ValueError(f"timestamp must be finite, got {value!r}")
            return number
        if text.endswith(("Z", "z")):
            text = text[:-1] + "+00:00"
        try:
            parsed = datetime.fromisoformat(text)
        except ValueError as exc:
            raise ValueError(f"not Unix seconds or an RFC 3339 timestamp: {value!r}") from exc
        if parsed.tzinfo is None:
            raise ValueError(f"RFC 3339 timestamp needs a UTC offset: {value!r}")
        return parsed.timestamp()
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ValueError(f"timestamp must be finite, got {value!r}")
        return float(value)
    return value


def parse_timestamp(value: Any) -> float:
    """A record's `ts` as Unix seconds: the rule every record's timestamp field applies.

    Raises ValueError for anything but finite Unix seconds or an RFC 3339 string with an offset.
    """
    out = _parse_ts(value)
    if not isinstance(out, float):
        raise ValueError(f"timestamp must be Unix seconds or an RFC 3339 string, not {value!r}")
    return out


Timestamp = Annotated[float, BeforeValidator(_parse_ts)]


class Record(BaseModel):
    """Base for records: strict about unknown shapes, permissive about extra keys.

    Extra keys are kept (``extra="allow"``) so a newer producer never loses data on
    an older consumer; declared fields are validated strictly.
    """

    model_config = ConfigDict(extra="allow", frozen=False, ser_json_inf_nan="constants")

    def to_json(self) -> str:
        return self.model_dump_json(exclude_none=True)

    def to_json_bytes(self) -> bytes:
        """`to_json` as UTF-8 bytes (what a Kafka message holds)."""
        return self.model_dump_json(exclude_none=True).encode()


def describe_error(exc: ValidationError) -> str:
    """One line per problem: the field path, what is wrong, and the bad value."""
    parts = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"]) or "<record>"
        bad = err.get("input")
        shown = repr(bad)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        parts.append(f"{loc}: {err['msg']} (got {shown})")
    return "; ".join(parts)
