"""A bounded FIFO that drops its oldest items when full: the agent's buffer during broker outages.

Fresh telemetry is worth more than old telemetry (the predictors look at recent windows), so
when the broker has been away long enough to fill the buffer the oldest batch goes, and a
counter says how many went. Pure data structure: no I/O, no asyncio.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class DropOldestBuffer(Generic[T]):
    """FIFO of at most `max_items`; `push` never blocks and never fails."""

    def __init__(self, max_items: int, on_drop: Callable[[T], None] | None = None) -> None:
        if max_items < 1:
            raise ValueError(f"buffer size must be >= 1, got {max_items}")
        self.max_items = max_items
        self._items: deque[T] = deque()
        self._on_drop = on_drop
        self.pushed = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._items)

    def _drop_oldest(self) -> T:
        item = self._items.popleft()
        self.dropped += 1
        if self._on_drop is not None:
            self._on_drop(item)
        return item

    def push(self, item: T) -> T | None:
        """Append; when full, drop and return the oldest item (None when nothing was dropped)."""
        dropped = self._drop_oldest() if len(self._items) >= self.max_items else None
        self._items.append(item)
        self.pushed += 1
        return dropped

    def take(self, n: int) -> list[T]:
        """Remove and return up to `n` of the oldest items, oldest first."""
        out = []
        while self._items and len(out) < n:
            out.append(self._items.popleft())
        return out

    def requeue(self, items: list[T]) -> int:
        """Put items that could not be sent back at the front (they are the oldest), keeping
        their order; then drop the oldest beyond the bound. Returns how many were dropped."""
        self._items.extendleft(reversed(items))
        dropped = 0
        while len(self._items) > self.max_items:
            self._drop_oldest()
            dropped += 1
        return dropped

    def peek_all(self) -> list[T]:
        """A copy of the queued items, oldest first (for tests and diagnostics)."""
        return list(self._items)
