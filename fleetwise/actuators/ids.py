"""Stable command ids: the same decision over the same evidence always gets the same id."""

from __future__ import annotations

import hashlib


def command_id(kind: str, *parts: object) -> str:
    """`kind-<16 hex>` from the decision's parts (a crash replay re-derives the same ids)."""
    text = "|".join(str(p) for p in (kind, *parts))
    return f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
