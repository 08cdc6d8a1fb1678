"""The embedded runtime: Kafka's topics as in-process logs, driving the same ControlPlane.

No broker, one process, event time: for trying Fleetwise out, for replaying recorded
telemetry, and for tests. Topic names, keys and record types are those of the Kafka path.
"""

from __future__ import annotations

import ctypes
import gc
import json
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain, compress, islice
from operator import not_
from pathlib import Path
from typing import Protocol

from isal import igzip

from fleetwise.actuators import Keyring, verify_command
from fleetwise.schemas import Ack, AuditEvent, Command, DeadLetter, Prediction, Record
from fleetwise.schemas import topics as T
from fleetwise.schemas.fast import TraceBlock
from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig, Item, Routed

# Consecutive records of one topic are handed over in chunks: Python overhead per chunk,
# not per record (the processors vectorise inside a chunk; the failure model's scikit-learn
# call costs ~0.7 ms however few rows it scores). GPU samples are held as columns, ~0.3 KB
# each. 65,536 lines replay a 512-GPU day ~4% faster than 16,384; 131,072 is slower again.
CHUNK = 65536
# Step records are handed over once this many are held (at a CHUNK boundary): the straggler
# detector judges a job's step groups of one call together (numpy over its ranks), which
# pays off from ~30 groups a job (32,768 -> 65,536: another ~3%).
STEP_CHUNK = 65536
# Lines read at a time: they are sorted per topic with C-level slices, not one by one.
BLOCK_LINES = 8192
# Bytes of (decompressed) trace read at a time: a block of GPU sample and step lines is
# decoded in one msgspec call, never split into lines.
READ_BYTES = 1 << 20
SORTED_SOURCE = "<traces in time order>"  # a merged line's name once its origin is released


class LineNames(Protocol):
    """What the replay calls a line of its input in a dead letter's `source`."""

    def name(self, lineno: int) -> str:
        """The name of line `lineno` (1-based) of the input."""
        ...

    def release(self, below: int) -> None:
        """Lines before `below` will not be named again."""
        ...


@dataclass(frozen=True)
class FileLineNames:
    """A file's lines: "path:N"."""

    path: str

    def name(self, lineno: int) -> str:
        return f"{self.path}:{lineno}"

    def release(self, below: int) -> None:
        pass


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


@contextmanager
def replay_process() -> Iterator[None]:
    """This process set up for a long replay, entered once the control plane is built:

    - the objects alive on entry (modules, the failure model) are out of the garbage
      collector's view until exit (`gc.freeze`): they outlive the replay anyway, and full
      collections scan only what the replay makes (their time a replayed day 0.06 -> 0.005 s).
      On exit they are handed back, so the interpreter's own clean-up still sees them;
    - glibc's malloc serves blocks up to 32 MiB from the heap and keeps freed heap (up to
      256 MiB) for reuse (for the rest of the process). A replay allocates and frees arrays of
      megabytes every chunk; by default each is a fresh mmap whose every page costs a fault
      when first touched (~4x the page faults, 0.7 -> 0.3 s of system time a simulated 512-GPU
      day). Skipped without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
        libc.mallopt(m_trim_threshold, 256 << 20)
    except (OSError, AttributeError):
        pass
    gc.collect()  # (garbage frozen would outlive the replay)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def read_text_blocks(path: Path) -> Iterator[bytes]:
    """The text of a .jsonl or .jsonl.gz file in blocks of whole lines (READ_BYTES and the rest
    of the line it ends in; the file's last line may lack its newline)."""
    # ISA-L's inflate (and CRC) take half the CPU time of zlib's: 1.7 -> 0.8 s for a 97 MB trace.
    opener = igzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        while text := fh.read(READ_BYTES):
            if not text.endswith(b"\n"):
                text += fh.readline()
            yield text


def _blocks(lines: Iterable[bytes]) -> Iterator[list[bytes]]:
    """Consecutive lines in lists of up to BLOCK_LINES."""
    it = iter(lines)
    return iter(lambda: list(islice(it, BLOCK_LINES)), [])


@dataclass
class ReplaySummary:
    lines: int = 0
    samples: int = 0
    steps: int = 0
    bad_lines: list[tuple[str, str]] = field(default_factory=list)  # (file:line, reason)
    outputs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    # Step groups that began more than the detector's stale_s before their job's newest record:
    # the step records were not in event-time order, and the straggler findings are unreliable.
    step_groups_back_in_time: int = 0

    @property
    def decisions(self) -> int:
        return self.outputs.get(T.PREDICTIONS.name, 0) + self.outputs.get(T.AUDIT.name, 0)


class SimulatedConsumers:
    """Stand-ins for the training plugin and the KAI consumer in a replay, so a replay shows
    what the system would do if every command were carried out: each command is checked with
    the shared `verify_command` as a real consumer does, applied once (a repeat is acked `done`
    with detail "duplicate") and acked `done` at its own event time (`rejected` with the reason
    when the check refuses it; a dry-run command is not applied)."""

    def __init__(self, keyring: Keyring | None = None) -> None:
        self.keyring = keyring or Keyring()
        self.applied: set[tuple[str, str]] = set()
        self.last_seq: dict[tuple[str, str], int] = {}

    def answer(self, topic: str, cmd: Command) -> Ack:
        by = "training-plugin" if topic == T.COMMANDS_TRAINING.name else "kube-consumer"
        ack = {"command_id": cmd.id, "ts": cmd.ts, "job": cmd.job, "node": cmd.node, "gpu": cmd.gpu, "by": by}
        if (by, cmd.id) in self.applied:
            return Ack(**ack, status="done", detail="duplicate")
        scope = (by, cmd.job) if cmd.job else None
        verdict = verify_command(cmd, self.keyring, now=cmd.ts,
                                 last_seq=self.last_seq.get(scope) if scope else None)
        if not verdict:
            return Ack(**ack, status="rejected", detail=verdict.reason)
        if cmd.dry_run:
            return Ack(**ack, status="rejected", detail="dry run: not applied")
        self.applied.add((by, cmd.id))
        if scope and cmd.seq is not None:
            self.last_seq[scope] = cmd.seq
        result: dict[str, object] = {}
        if cmd.type == "checkpoint":
            result["checkpoint_uri"] = f"sim://{cmd.job}/{cmd.id}"
        if cmd.type == "rebalance" and "layers" in cmd.params:
            result["layers"] = cmd.params["layers"]  # as the plugin reports a re-split
        return Ack(**ack, status="done", detail="simulated consumer", result=result)


COMMAND_TOPICS = frozenset({T.COMMANDS_TRAINING.name, T.COMMANDS_KUBE.name})


class EmbeddedRuntime:
    """Feeds records through a ControlPlane and publishes what it routes onto an EventBus;
    with `consumers`, commands are answered by simulated consumers whose acks flow back."""

    def __init__(self, control: ControlPlane | None = None, bus: EventBus | None = None,
                 consumers: SimulatedConsumers | None = None) -> None:
        self.control = control or ControlPlane()
        self.bus = bus or EventBus()
        self.consumers = consumers
        self.summary = ReplaySummary()

    def _publish(self, routed: Iterable[Routed]) -> None:
        acks: list[Ack] = []
        for topic, key, record in routed:
            self.summary.outputs[topic] += 1
            if isinstance(record, DeadLetter):
                self.summary.bad_lines.append((record.source, record.reason))
            self.bus.publish(topic, key, record)
            if self.consumers is not None and topic in COMMAND_TOPICS:
                ack = self.consumers.answer(topic, record)  # type: ignore[arg-type]
                self.bus.publish(T.ACKS.name, key, ack)
                acks.append(ack)
        if acks:
            self._publish(self.control.handle(T.ACKS.name, acks))

    def feed(self, topic: str, records: list[Item]) -> None:
        self._publish(self.control.handle(topic, records))

    def feed_lines(self, lines: Iterable[bytes], source: str | LineNames) -> None:
        """Replay lines in file order: `feed_line_blocks`."""
        self.feed_line_blocks(_blocks(lines), source)

    def feed_text_blocks(self, blocks: Iterable[bytes], source: str | LineNames) -> None:
        """Replay a file's text, given in blocks of whole lines (`read_text_blocks`), in file order.

        A block of GPU sample and step lines only is decoded in one call, without splitting
        it into lines (`ControlPlane.decode_trace_text`); any other block is split into lines.
        Either way `feed_line_blocks` hands the same records over in the same chunks."""
        decode = self.control.decode_trace_text

        def decoded(text: bytes) -> Iterator[list[bytes] | TraceBlock]:
            found = decode(text)
            if found is not None:
                yield found
                return
            lines = text.split(b"\n")
            if not lines[-1]:
                lines.pop()  # the text ends with a newline: no line after it
            yield from _blocks(lines)

        self.feed_line_blocks(chain.from_iterable(map(decoded, blocks)), source)

    def feed_line_blocks(self, blocks: Iterable[list[bytes] | TraceBlock], source: str | LineNames) -> None:
        """Replay lines (samples, batches, steps, inventories, plans) in file order, given in
        lists of consecutive lines (with or without their newline) or decoded (`TraceBlock`).

        GPU telemetry and step lines are buffered per topic and decoded CHUNK lines at a time
        (GPU and step lines together), GPU lines first; the GPU records are handed over then,
        the step records once STEP_CHUNK of them are held: each topic's processors see their
        records in file order, in calls large enough for the fast path (one msgspec call per
        buffer), the vectorised windows and the straggler detector's step groups to pay off.
        The two topics are independent, as on Kafka, where each has its own consumer. Any
        other line first flushes both buffers (step records too), then goes alone. A block of
        GPU and step lines only is sorted into the buffers with C-level slices; one with any
        other line (or a blank one) goes line by line. `source`: a file's path (bad lines are
        named "path:N") or the lines' names (`LineNames`)."""
        names = FileLineNames(source) if isinstance(source, str) else source
        gpu_lines: list[bytes] = []  # lines not decoded yet
        step_lines: list[bytes] = []
        gpu_items: list[Item] = []  # decoded, not handed over yet
        step_items: list[Item] = []
        # What each undecoded line is (True: GPU, False: step, None: blank), for the line
        # numbers of the buffered lines, worked out only when one needs a dead letter.
        kinds: list[bool | None] = []
        first = 1  # line number of kinds[0]
        buffered = 0  # GPU and step lines since the last flush

        def decode_held() -> None:
            nonlocal kinds, first
            for topic, held, items, kind in ((T.TELEMETRY_GPU.name, gpu_lines, gpu_items, True),
                                             (T.TELEMETRY_STEPS.name, step_lines, step_items, False)):
                if held:
                    sources = LineSources(names, first, kinds, kind)
                    items.extend(self.control.decode_lines(topic, held, sources))
                    held.clear()
            first += len(kinds)
            kinds = []
            names.release(first)

        def flush(steps: bool = True) -> None:
            nonlocal buffered, gpu_items, step_items
            decode_held()
            if gpu_items:
                self.feed(T.TELEMETRY_GPU.name, gpu_items)
                gpu_items = []
            if step_items and (steps or len(step_items) >= STEP_CHUNK):
                self.feed(T.TELEMETRY_STEPS.name, step_items)
                step_items = []
            buffered = 0

        def take(block: list[bytes], is_gpu: list[bool]) -> None:
            """Consecutive GPU and step lines into the buffers, with C-level slices, flushing
            every CHUNK of them."""
            nonlocal buffered
            start, end = 0, len(block)
            while start < end:
                stop = min(end, start + CHUNK - buffered)
                part, part_is_gpu = block[start:stop], is_gpu[start:stop]
                gpu_lines.extend(compress(part, part_is_gpu))
                step_lines.extend(compress(part, map(not_, part_is_gpu)))
                kinds.extend(part_is_gpu)
                buffered += stop - start
                if buffered >= CHUNK:
                    flush(steps=False)
                start = stop

        def take_decoded(block: TraceBlock) -> None:
            """A decoded block's samples and steps into the buffers, flushing every CHUNK lines."""
            nonlocal buffered
            start, end = 0, len(block.is_sample)
            samples = steps = 0  # taken so far
            while start < end:
                stop = min(end, start + CHUNK - buffered)
                whole = start == 0 and stop == end  # (the usual case)
                n_gpu = len(block.samples) if whole else block.is_sample[start:stop].count(True)
                if n_gpu:
                    gpu_items.append(block.samples if whole else block.samples[samples:samples + n_gpu])
                step_items.extend(block.steps[steps:steps + stop - start - n_gpu])
                samples, steps = samples + n_gpu, steps + stop - start - n_gpu
                buffered += stop - start
                if buffered >= CHUNK:
                    flush(steps=False)
                start = stop

        lineno = blank = 0  # lines so far; blank ones among them
        for block in blocks:
            if isinstance(block, TraceBlock):
                decode_held()  # lines before these records
                take_decoded(block)
                lineno += len(block.is_sample)
                first = lineno + 1
                continue
            # By shape: a record with "metrics" is GPU telemetry (a sample or a node batch), one
            # with "step_time_s" a training step (as `classify_line` decides).
            block_kinds = [True if b'"metrics"' in line else False if b'"step_time_s"' in line else None
                           for line in block]
            if None not in block_kinds:
                take(block, block_kinds)  # type: ignore[arg-type]
                lineno += len(block)
                continue
            for line, kind in zip(block, block_kinds, strict=True):
                lineno += 1
                if kind is not None:
                    (gpu_lines if kind else step_lines).append(line)
                    kinds.append(kind)
                    buffered += 1
                    if buffered >= CHUNK:
                        flush(steps=False)
                    continue
                if line.isspace() or not line:
                    blank += 1
                    kinds.append(None)
                    continue
                flush()  # the lines before this one, then this one alone
                for record in self._decode_line(line.rstrip(b"\r\n"), names.name(lineno)):
                    self.feed(_topic_of(record), [record])
                first = lineno + 1
        flush()
        self.summary.lines += lineno - blank

    def _decode_line(self, line: bytes, source: str) -> list[Record]:
        try:
            obj = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return [self.control.dead_letter(source, f"not valid JSON: {exc}", line)]
        if not isinstance(obj, dict):
            return [self.control.dead_letter(source, "expected a JSON object", line)]
        return self.control.decode_obj(None, obj, source=source, raw=line)

    def finish(self) -> ReplaySummary:
        self._publish(self.control.flush())
        self.summary.samples = self.control.counts["samples_in"]
        self.summary.steps = self.control.counts["steps_in"]
        if self.control.stragglers is not None:
            self.summary.step_groups_back_in_time = self.control.stragglers.groups_back_in_time
        return self.summary

    def decisions(self) -> list[Prediction | Command]:
        """Predictions and commands in emission order (the replay's decision output)."""
        out: list[Prediction | Command] = list(self.bus.records(T.PREDICTIONS.name))  # type: ignore[arg-type]
        out.extend(r for r in self.bus.records(T.AUDIT.name) if isinstance(r, Command))
        out.sort(key=lambda r: (r.ts, 0 if r.kind == "prediction" else 1))
        return out

    def audit_events(self) -> list[AuditEvent]:
        """What the policy held back or noticed (rails, expiries, approvals), in order."""
        return [r for r in self.bus.records(T.AUDIT.name) if isinstance(r, AuditEvent)]


class LineSources(Sequence[str]):
    """The name of each buffered line of one topic, made only when one is asked for (errors):
    from the kinds of consecutive lines from line `first` on, the lines of kind `kind`."""

    def __init__(self, names: LineNames, first: int, kinds: list[bool | None], kind: bool) -> None:
        self.names, self.first, self.kinds, self.kind = names, first, kinds, kind
        self.count = kinds.count(kind)
        self._linenos: list[int] | None = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> str:  # type: ignore[override]
        if self._linenos is None:
            self._linenos = [self.first + j for j, k in enumerate(self.kinds) if k is self.kind]
        return self.names.name(self._linenos[i])


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
        "JobEnd": T.PLANS.name,
        "Ack": T.ACKS.name,
        "OperatorAction": T.OPERATOR.name,
    }[name]


def replay(
    traces: Iterable[Path],
    out: Path | None = None,
    *,
    inventory: Path | None = None,
    control: ControlPlane | None = None,
    features: Path | None = None,
    simulate_acks: bool = True,
    audit: Path | None = None,
    in_time_order: bool = False,
    trends: Path | None = None,
) -> EmbeddedRuntime:
    """Run the whole control plane over recorded telemetry; write decisions as JSON lines.

    Per-GPU feature vectors are computed either way (the predictors score them); they become
    records on the features topic, kept in memory and written to `features`, only when
    `features` is given (a month of a 512-GPU fleet is ~2 million of them).

    `simulate_acks`: consumers answer every command (`SimulatedConsumers`), so drains follow
    their checkpoints and resizes their drains; off, commands go unanswered and expire (acks
    recorded in the trace itself are read either way). `audit`: write the audit events.
    `in_time_order`: merge the traces' lines into event-time order first (`trace_sort`), for
    recordings written per node or per rank; bad lines are still named by their file and line.
    `trends`: write the hourly roll-ups per rack and site (`control.trend_rows`, JSON lines; a
    control plane given here must have `fleet_trends` on)."""
    if control is None:
        control = ControlPlane(ControlPlaneConfig(publish_features=features is not None,
                                                  fleet_trends=trends is not None))
    if trends is not None and control.fleet_trends is None:
        raise ValueError("trends asked for, but the control plane was built without fleet_trends")
    consumers = SimulatedConsumers(control.config.keyring) if simulate_acks else None
    runtime = EmbeddedRuntime(control, consumers=consumers)
    if inventory is not None:
        runtime.feed_text_blocks(read_text_blocks(inventory), str(inventory))
    if in_time_order:
        from fleetwise.streams.trace_sort import MergedLineNames, sorted_lines

        traces = list(traces)
        names = MergedLineNames(traces)
        with sorted_lines(traces) as lines:
            runtime.feed_text_blocks(names.text_blocks(lines), names)
    else:
        for path in traces:
            runtime.feed_text_blocks(read_text_blocks(path), str(path))
    runtime.finish()
    if out is not None:
        with open(out, "w") as fh:
            for record in runtime.decisions():
                fh.write(record.to_json() + "\n")
    if features is not None:
        with open(features, "w") as fh:
            for record in runtime.bus.records(T.FEATURES.name):
                fh.write(record.to_json() + "\n")
    if audit is not None:
        with open(audit, "w") as fh:
            for event in runtime.audit_events():
                fh.write(event.to_json() + "\n")
    if trends is not None:
        with open(trends, "w") as fh:
            for row in control.trend_rows:
                fh.write(json.dumps(row.to_dict()) + "\n")
    return runtime
