"""What every collector offers the agent loop: start, inventories, one collection tick, close."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Protocol

from fleetwise.schemas import GpuSample, NodeBatch, NodeInventory


class CollectorError(RuntimeError):
    """A collector cannot run (no driver, bad URL, unreachable exporter); the message says why."""


class Collector(Protocol):
    """A source of GPU samples for one node (or several, for the simulator and a shared exporter)."""

    name: str

    def start(self) -> None:
        """Open the source; raise CollectorError with a clear message when it cannot work here."""

    def inventories(self, ts: float) -> list[NodeInventory]:
        """The inventory of every node this collector reports on."""

    def collect(self, ts: float) -> list[NodeBatch]:
        """One tick: one NodeBatch per node. `ts` is the wall-clock collection time (Unix s);
        collectors with their own event time (the simulator) use theirs."""

    def close(self) -> None:
        """Release the source."""


def batches_by_node(ts: float, samples: Iterable[GpuSample]) -> list[NodeBatch]:
    """Group samples into one NodeBatch per node (nodes and GPUs in sorted order)."""
    grouped: dict[str, list[GpuSample]] = defaultdict(list)
    for s in samples:
        grouped[s.node].append(s)
    return [
        NodeBatch(ts=ts, node=node, samples=sorted(grouped[node], key=lambda s: s.gpu))
        for node in sorted(grouped)
    ]
