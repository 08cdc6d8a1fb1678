"""Pipeline stage layouts: {stage: (first, last)}, inclusive, as a plan's ranks and a
rebalance's `layers` give them. One check for every reader (the exports, the training plugin,
DeepSpeed's PipelineModule boundaries)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["layout_json", "stage_spans"]


def stage_spans(layout: Mapping[Any, Sequence[int]], *, first: int = 0,
                last: int | None = None) -> dict[int, tuple[int, int]]:
    """`layout` with integer stages and spans, checked: stages 0..n-1 hold contiguous, non-empty
    runs of layers from `first` (to `last`, when given) in stage order.

    Raises ValueError naming the first thing wrong."""
    try:
        spans = {int(k): (int(v[0]), int(v[1])) for k, v in layout.items() if len(v) == 2}
    except (TypeError, ValueError, KeyError, IndexError):
        raise ValueError(f"expected {{stage: [first, last]}} integers, got {dict(layout)!r}") from None
    if len(spans) != len(layout):
        raise ValueError(f"expected {{stage: [first, last]}} integers, got {dict(layout)!r}")
    if not spans or sorted(spans) != list(range(len(spans))):
        raise ValueError(f"stages {sorted(spans)} do not cover 0..{len(spans) - 1}")
    at = first
    for stage in sorted(spans):
        a, b = spans[stage]
        if a != at or b < a:
            until = f" to {last}" if last is not None else ""
            raise ValueError(f"stage {stage} holds layers {a}-{b}; stages must hold contiguous, "
                             f"non-empty runs of layers from {first}{until} in stage order")
        at = b + 1
    if last is not None and at != last + 1:
        raise ValueError(f"the stages end at layer {at - 1}, the model's last is {last}")
    return spans


def layout_json(layout: Mapping[int, Sequence[int]]) -> dict[str, list[int]]:
    """A layout as commands, acks and checkpoints carry it: {"stage": [first, last]}, in stage
    order (`stage_spans` reads it back)."""
    return {str(stage): [int(span[0]), int(span[1])] for stage, span in sorted(layout.items())}
