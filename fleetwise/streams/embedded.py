"""The embedded runtime: Kafka's topics as in-process logs, driving the same ControlPlane.

No broker, one process, event time: for trying Fleetwise out, for replaying recorded
telemetry, and for tests. Topic names, keys and record types are those of the Kafka path.
"""

from __future__ import annotations

import gzip
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from fleetwise.schemas import Command, DeadLetter, Prediction, Record
from fleetwise.schemas import topics as T
from fleetwise.streams.pipeline import ControlPlane, Routed

# Consecutive records of one topic are handed over in chunks: Python overhead per chunk,
# not per record (the processors vectorise inside a chunk).
CHUNK = 4096


class EventBus:
    """Append-only in-memory topic logs with synchronous subscribers."""

    def __init__(self) -> None:
        self.logs: dict[str, list[tuple[str, Record]]] = defaultdict(list)
        self._subscribers: dict[str, list[Callable[[str, Record], None]]] = defaultdict(list)

    def publish(self, topic: str, key: str, record: Record) -> None:
        T.topic(topic)  # only registered topics exist, as on the broker
        self.logs[topic].append((key, record))
        for callback in self._subscribers[topic]:
            callback(key, record)

    def subscribe(self, topic: str, callback: Callable[[str, Record], None]) -> None:
        T.topic(topic)
        self._subscribers[topic].append(callback)

    def records(self, topic: str) -> list[Record]:
        return [r for _, r in self.logs.get(topic, [])]


def read_lines(path: Path) -> Iterator[bytes]:
    """Lines of a .jsonl or .jsonl.gz file, as bytes, blank lines included (for numbering)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        yield from fh


@dataclass
class ReplaySummary:
    lines: int = 0
    samples: int = 0
    steps: int = 0
    bad_lines: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)
    outputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    @property
    def decisions(self) -> int:
        return self.outputs.get(T.PREDICTIONS.name, 0) + self.outputs.get(T.AUDIT.name, 0)


class EmbeddedRuntime:
    """Feeds records through a ControlPlane and publishes what it routes onto an EventBus."""

    def __init__(self, control: ControlPlane | None = None, bus: EventBus | None = None) -> None:
        self.control = control or ControlPlane()
        self.bus = bus or EventBus()
        self.summary = ReplaySummary()

    def _publish(self, routed: Iterable[Routed]) -> None:
        for topic, key, record in routed:
            self.summary.outputs[topic] += 1
            if isinstance(record, DeadLetter):
                self.summary.bad_lines.append((record.source, record.reason))
            self.bus.publish(topic, key, record)

    def feed(self, topic: str, records: list[Record]) -> None:
        self._publish(self.control.handle(topic, records))

    def feed_lines(self, lines: Iterable[bytes], source: str) -> None:
        """Replay lines (samples, batches, steps, inventories, plans) in file order."""
        pending_topic: str | None = None
        pending: list[Record] = []
        for lineno, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            self.summary.lines += 1
            for record in self._decode_line(line, f"{source}:{lineno}"):
                topic = _topic_of(record)
                if topic != pending_topic or len(pending) >= CHUNK:
                    if pending:
                        self.feed(pending_topic, pending)  # type: ignore[arg-type]
                    pending_topic, pending = topic, []
                pending.append(record)
        if pending:
            self.feed(pending_topic, pending)  # type: ignore[arg-type]

    def _decode_line(self, line: bytes, source: str) -> list[Record]:
        if b'"metrics"' in line and b'"samples"' not in line:
            sample = self.control.fast_sample(line, source)
            if sample is not None:
                return [sample]
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return [self.control.dead_letter(source, f"not valid JSON: {exc}", line.rstrip(b"\n"))]
        if not isinstance(obj, dict):
            return [self.control.dead_letter(source, "expected a JSON object", line.rstrip(b"\n"))]
        return self.control.decode_obj(None, obj, source=source, raw=line.rstrip(b"\n"))

    def finish(self) -> ReplaySummary:
        self._publish(self.control.flush())
        self.summary.samples = self.control.counts["samples_in"]
        self.summary.steps = self.control.counts["steps_in"]
        return self.summary

    def decisions(self) -> list[Prediction | Command]:
        """Predictions and commands in emission order (the replay's decision output)."""
        out: list[Prediction | Command] = list(self.bus.records(T.PREDICTIONS.name))  # type: ignore[arg-type]
        out.extend(self.bus.records(T.AUDIT.name))  # type: ignore[arg-type]
        out.sort(key=lambda r: (r.ts, 0 if r.kind == "prediction" else 1))
        return out


def _topic_of(record: Record) -> str:
    if isinstance(record, DeadLetter):
        return T.DEADLETTER.name
    name = type(record).__name__
    return {
        "GpuSample": T.TELEMETRY_GPU.name,
        "NodeBatch": T.TELEMETRY_GPU.name,
        "TrainingStep": T.TELEMETRY_STEPS.name,
        "NodeInventory": T.INVENTORY.name,
        "Plan": T.PLANS.name,
    }[name]


def replay(
    traces: Iterable[Path],
    out: Path | None = None,
    *,
    inventory: Path | None = None,
    control: ControlPlane | None = None,
) -> EmbeddedRuntime:
    """Run the whole control plane over recorded telemetry; write decisions as JSON lines."""
    runtime = EmbeddedRuntime(control)
    if inventory is not None:
        runtime.feed_lines(read_lines(inventory), str(inventory))
    for path in traces:
        runtime.feed_lines(read_lines(path), str(path))
    runtime.finish()
    if out is not None:
        with open(out, "w") as fh:
            for record in runtime.decisions():
                fh.write(record.to_json() + "\n")
    return runtime
