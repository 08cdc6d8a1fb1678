"""Validation of GPU telemetry straight from JSON into typed structs, many lines per call.

The pydantic records (`GpuSample`, `NodeBatch`) are the contract and name every problem;
this is the hot path in front of them (msgspec: JSON parsed and type-checked in C, no dict
per sample, all lines of a chunk in one call). It accepts a subset of what the records
accept and never a record they would reject for a field it reads, so callers use it first
and hand anything it refuses to the pydantic path, which accepts or dead-letters with the
exact reason. A replay's text blocks are split in C first (`_trace_text.c`: sample columns and
step records, the same values; it takes the line shapes writers use: any key order and
whitespace, optional fields in or out, escapes, nested extra keys, RFC 3339 times, metrics as
numeric strings), anything it leaves in msgspec. Differences from the records, by design:

- `ts` must be a JSON number on the msgspec paths (RFC 3339 strings take the pydantic path
  there; the C splitter reads them as the records do);
- numbers must have their JSON type (`"gpu": 3.0` takes the pydantic path, which coerces
  it; so does `"52"` as a metric, except in the C splitter, which reads a string holding a
  JSON number as the records do);
- only the metrics a decoder is built for are read and checked; other metrics are skipped
  unread (their values feed nothing downstream).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Sequence
from functools import lru_cache
from itertools import chain, compress, islice, repeat
from operator import attrgetter, is_not, not_
from typing import Annotated, Any, NamedTuple

import msgspec
import numpy as np

from fleetwise.schemas import _trace_text

TraceStep = _trace_text.TraceStep  # a step record of the C splitter (`SampleDecoder.trace_lines`)

# Finite numbers only, as `MetricValue` in the records (JSON has no NaN; +-1e999 overflow).
_FiniteFloat = Annotated[float, msgspec.Meta(ge=-1.7976931348623157e308, le=1.7976931348623157e308)]
_NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
# A metric as JSON gives it: an integer stays a Python int, so the small ones most DCGM
# readings are (temperatures, counters, 0) come from Python's cache instead of each being a new
# float to allocate and free (~0.25 us a sample). Bounded to int64, so every one accepted is
# a finite float in the metric matrix (larger ones take the pydantic path, which decides).
_MetricNumber = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)] | _FiniteFloat
_Count = Annotated[int, msgspec.Meta(ge=0)]
_StepTime = Annotated[float, msgspec.Meta(gt=0, le=1.7976931348623157e308)]
_ComputeTime = Annotated[float, msgspec.Meta(ge=0, le=1.7976931348623157e308)]


@lru_cache(maxsize=1 << 16)
def board_id(uuid: str | None) -> float:
    """A number for the board a sample's `uuid` names (the CRC-32 of its UTF-8 text; NaN when
    the sample names none): what the feature windows compare to see a new board in a slot. The
    C splitter computes the same (`_trace_text.c`, `board_field`)."""
    return float(zlib.crc32(uuid.encode())) if uuid else math.nan


class FastGpuSample(msgspec.Struct, gc=False):
    """A validated GPU sample (attribute names as `GpuSample`). `metrics` is a struct of the
    decoder's metric fields, in its order (missing = NaN); see `SampleDecoder.metric_rows`."""

    ts: _FiniteFloat
    node: _NonEmpty
    gpu: Annotated[int, msgspec.Meta(ge=0, le=1023)]  # MAX_GPU_INDEX
    model: _NonEmpty
    uuid: str | None = None
    rack: str | None = None
    site: str | None = None
    job: str | None = None
    rank: _Count | None = None


class TraceLine(msgspec.Struct, gc=False):
    """A replay line that is a GPU sample or a training step, decoded with one struct (see
    `SampleDecoder.trace_lines`): the fields of both, each with its type's rules; the rules that
    differ between the two (required fields, `gpu` <= 1023) are checked after decoding. A
    sample's `metrics` is set (the decoder's metrics struct, as `FastGpuSample`); a step's is
    `UNSET`. Attribute names as `GpuSample` and `TrainingStep`."""

    ts: _FiniteFloat
    node: _NonEmpty
    gpu: _Count
    job: str | None = None
    rank: _Count | None = None
    model: str | None = None
    uuid: str | None = None
    rack: str | None = None
    site: str | None = None
    step: _Count | None = None
    step_time_s: _StepTime | msgspec.UnsetType = msgspec.UNSET
    compute_s: _ComputeTime | msgspec.UnsetType = msgspec.UNSET
    micro_batch: _Count | None = None
    samples: _Count | None = None


class SampleDecoder:
    """Decoders for GPU sample lines and node batches that read `metric_fields` (DCGM names)."""

    def __init__(self, metric_fields: Sequence[str]) -> None:
        self.metric_fields = tuple(metric_fields)
        metrics_type = msgspec.defstruct(
            "Metrics",
            # Missing -> NaN, as in the feature matrix.
            [(f"m{i}", _MetricNumber | None, msgspec.field(default=math.nan, name=name))
             for i, name in enumerate(self.metric_fields)],
            gc=False,
        )
        self._empty_metrics = metrics_type()
        sample_type = msgspec.defstruct(
            "Sample",
            [("metrics", metrics_type, msgspec.field(default_factory=metrics_type))],
            bases=(FastGpuSample,),
            gc=False,
        )
        batch_type = msgspec.defstruct(
            "Batch", [("ts", _FiniteFloat), ("node", _NonEmpty), ("samples", list[sample_type])]
        )
        trace_type = msgspec.defstruct(
            "TraceLine",
            [("metrics", metrics_type | msgspec.UnsetType, msgspec.UNSET)],
            bases=(TraceLine,),
            gc=False,
        )
        self._trace = msgspec.json.Decoder(trace_type)
        self._line = msgspec.json.Decoder(sample_type)
        self._lines = msgspec.json.Decoder(list[sample_type])
        self._batch = msgspec.json.Decoder(batch_type)
        self._batches = msgspec.json.Decoder(list[batch_type])
        self._strings: dict[str | None, str | None] = {}  # see `columns`

    def sample(self, line: bytes) -> FastGpuSample | None:
        """One sample line, or None when the fast path refuses it."""
        try:
            return self._line.decode(line)
        except msgspec.MsgspecError:
            return None

    def samples(self, lines: Sequence[bytes]) -> list[FastGpuSample] | None:
        """All sample lines in one call, or None when any line is refused (then go line by line)."""
        try:
            found = self._lines.decode(_json_list(lines))
        except msgspec.MsgspecError:
            return None
        return found if len(found) == len(lines) else None

    def batch(self, raw: bytes) -> list[FastGpuSample] | None:
        """The samples of one node batch, or None when refused (a sample of another node too)."""
        try:
            found = self._batch.decode(raw)
        except msgspec.MsgspecError:
            return None
        return found.samples if _one_node(found) else None

    def batches(self, raws: Sequence[bytes]) -> list[list[FastGpuSample]] | None:
        """The samples of each node batch, all in one call; None when any batch is refused."""
        try:
            found = self._batches.decode(_json_list(raws))
        except msgspec.MsgspecError:
            return None
        if len(found) != len(raws) or not all(map(_one_node, found)):
            return None
        return [b.samples for b in found]

    def trace_lines(self, text: bytes) -> TraceBlock | None:
        """Newline-delimited GPU sample and step lines, all in one call, without splitting the
        text into lines: the samples as `SampleColumns` (their structs freed here, while they
        are still in cache), the steps as records, and which line is which.

        None when the fast path refuses the text: a line that does not start with "{" or end
        with "}", one that is neither a sample (has "metrics") nor a step (has "step_time_s"),
        or one the sample or step fast path (`samples`, `training_steps`) would refuse, but
        for RFC 3339 times and numeric-string metrics, which the C splitter reads as the
        records do. So what it accepts it decodes to the same values as those paths (or the
        records), one record per line."""
        if not text:
            return TraceBlock(self.columns([]), [], [])
        return self._plain_trace_lines(text) or self._any_trace_lines(text)

    def _plain_trace_lines(self, text: bytes) -> TraceBlock | None:
        """`trace_lines` for text in the line shapes writers use, split in C (`_trace_text.split`:
        its rules there): ~3x faster than decoding every line with msgspec, the same values (the
        steps as `TraceStep` records). None for anything else."""
        strings = self._strings
        if len(strings) > _MAX_INTERNED:
            strings.clear()
        found = _trace_text.split(text, self.metric_fields, strings)
        if found is None:
            return None
        ts, board, metrics, node, gpu, model, rack, site, job, rank, is_sample, steps = found
        samples = SampleColumns(
            node=node, gpu=gpu, model=model, rack=rack, site=site, job=job, rank=rank,
            ts=np.frombuffer(ts, np.float64), board=np.frombuffer(board, np.float64),
            metrics=np.frombuffer(metrics, np.float64).reshape(len(node), len(self.metric_fields)))
        return TraceBlock(samples, steps, is_sample)

    def _any_trace_lines(self, text: bytes) -> TraceBlock | None:
        """`trace_lines` for any text: every line decoded by msgspec."""
        # Exactly one value per line: every line starts with "{" and ends with "}" (a "\r"
        # before the newline aside), so no value runs on into the next line (after a "}" an
        # open value needs "," or a closing bracket, never "{"), and there are as many values
        # as lines. (numpy checks this ~3x faster than bytes.count.)
        chars = np.frombuffer(text, np.uint8)
        newlines = np.flatnonzero(chars == _NEWLINE)
        last = len(chars) - 1
        if chars[last] != _NEWLINE:  # a last line without its newline ends the text
            newlines = np.append(newlines, last + 1)
        ends = chars[newlines - 1]
        crlf = ends == _CR
        if crlf.any():
            ends[crlf] = chars[newlines[crlf] - 2]  # (a copy: fancy indexing)
        if chars[0] != _BRACE or not (chars[newlines[:-1] + 1] == _BRACE).all() or not (ends == _CLOSE).all():
            return None
        try:
            records = self._trace.decode_lines(text)
        except msgspec.MsgspecError:
            return None
        if len(records) != len(newlines):
            return None
        is_sample = list(map(is_not, map(_METRICS, records), repeat(msgspec.UNSET)))
        samples = self.columns(list(compress(records, is_sample)), intern=True)
        if len(samples):
            models = set(samples.model)
            if None in models or "" in models or max(samples.gpu) > MAX_GPU_INDEX:
                return None
        steps = list(compress(records, map(not_, is_sample))) if len(samples) < len(records) else []
        if steps and not _trace_steps_ok(steps):
            return None
        return TraceBlock(samples, steps, is_sample)

    def columns(self, samples: Sequence[Any], intern: bool = False) -> SampleColumns:
        """`SampleColumns` of samples (`FastGpuSample`s of this decoder or pydantic `GpuSample`s).

        With `intern`, every column is a list and its strings are shared ones (bounded cache):
        the samples can be freed at once, their own strings with them. Without, the columns
        other than `ts` and `metrics` stay views of the samples, read when asked for (the
        feature windows read node and gpu once, the others for a few rows only)."""
        ts = np.fromiter(map(_TS, samples), np.float64, len(samples))
        board = np.fromiter(map(board_id, map(_UUID, samples)), np.float64, len(samples))
        if not intern:
            node, gpu, model, rack, site, job, rank = (_Attribute(samples, get) for get in _COLUMN_FIELDS)
            return SampleColumns(node=node, gpu=gpu, model=model, rack=rack, site=site, job=job, rank=rank,
                                 ts=ts, board=board, metrics=self.metric_rows(samples))
        gpu = list(map(_GPU, samples))
        strings = self._strings
        if len(strings) > _MAX_INTERNED:
            strings.clear()
        node, model, rack, site, job = (list(map(strings.setdefault, column, column))
                                        for column in (list(map(get, samples)) for get in _STRING_FIELDS))
        return SampleColumns(node=node, gpu=gpu, model=model, rack=rack, site=site, job=job,
                             rank=list(map(_RANK, samples)), ts=ts, board=board,
                             metrics=self.metric_rows(samples))

    def metric_rows(self, samples: Sequence[Any]) -> np.ndarray:
        """Float matrix (samples x metric_fields), NaN where missing. Takes `FastGpuSample`s
        from this decoder and pydantic `GpuSample`s (metrics as a dict) alike."""
        fields, metrics_type = self.metric_fields, type(self._empty_metrics)
        metrics = list(map(_METRICS, samples))
        if set(map(type, metrics)) <= {metrics_type}:  # (a C-level pass; none at all is fine)
            # Every value an int, a float or None (numpy reads None as NaN, converts a 64-bit
            # int exactly rounded, as parsing its digits as a float would), one pass over all.
            rows = map(msgspec.structs.astuple, metrics)
            flat = np.fromiter(chain.from_iterable(rows), np.float64, len(metrics) * len(fields))
            return flat.reshape(len(metrics), len(fields))
        rows = [msgspec.structs.astuple(m) if type(m) is metrics_type else tuple(map(m.get, fields))
                for m in metrics]
        if not rows:
            return np.empty((0, len(fields)))
        return np.array(rows, dtype=np.float64)  # None -> NaN


class SampleColumns:
    """GPU samples as columns, in sample order: what the feature windows read of each (the
    attributes of `GpuSample`, `uuid` as `board_id`s in `board`; `metrics`:
    `SampleDecoder.metric_rows`). A chunk of a replay holds these instead of a struct per sample:
    a sample's ~15 small objects are freed when its block is decoded, not a chunk later, when they
    are out of cache (a replayed day ~5% faster). `ARRAYS` are numpy arrays, the rest sequences."""

    __slots__ = ("node", "gpu", "model", "rack", "site", "job", "rank", "ts", "board", "metrics")
    ARRAYS = ("ts", "board", "metrics")

    def __init__(
        self, *, node: Sequence[str], gpu: Sequence[int], model: Sequence[str], rack: Sequence[str | None],
        site: Sequence[str | None], job: Sequence[str | None], rank: Sequence[int | None],
        ts: np.ndarray, board: np.ndarray, metrics: np.ndarray,
    ) -> None:
        self.node, self.gpu, self.model, self.rack, self.site = node, gpu, model, rack, site
        self.job, self.rank, self.ts, self.board, self.metrics = job, rank, ts, board, metrics

    def __len__(self) -> int:
        return len(self.ts)

    def __getitem__(self, part: slice) -> SampleColumns:
        return SampleColumns(**{name: getattr(self, name)[part] for name in self.__slots__})

    @classmethod
    def concat(cls, parts: Sequence[SampleColumns]) -> SampleColumns:
        if len(parts) == 1:
            return parts[0]
        lists = {name: list(chain.from_iterable(getattr(p, name) for p in parts))
                 for name in cls.__slots__ if name not in cls.ARRAYS}
        arrays = {name: np.concatenate([getattr(p, name) for p in parts]) for name in cls.ARRAYS}
        return cls(**lists, **arrays)


class _Attribute(Sequence[Any]):
    """One attribute of each of `items`, read when asked for (a column of `SampleColumns`)."""

    def __init__(self, items: Sequence[Any], get: attrgetter) -> None:
        self.items, self.get = items, get

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return _Attribute(self.items[i], self.get)
        return self.get(self.items[i])

    def __iter__(self) -> Iterator[Any]:
        return map(self.get, self.items)


class TraceBlock(NamedTuple):
    """A block of GPU sample and step lines decoded in one call (`SampleDecoder.trace_lines`):
    the samples, the steps (`TraceLine`s or the C splitter's `TraceStep`s), and for each line in
    order whether it is a sample (True) or a step."""

    samples: SampleColumns
    steps: list[TraceLine] | list[TraceStep]
    is_sample: list[bool]


_METRICS = attrgetter("metrics")
_NEWLINE, _CR, _BRACE, _CLOSE = ord("\n"), ord("\r"), ord("{"), ord("}")
_GPU, _RANK, _TS, _UUID = attrgetter("gpu"), attrgetter("rank"), attrgetter("ts"), attrgetter("uuid")
_STRING_FIELDS = tuple(map(attrgetter, ("node", "model", "rack", "site", "job")))
_COLUMN_FIELDS = tuple(map(attrgetter, ("node", "gpu", "model", "rack", "site", "job", "rank")))
_MAX_INTERNED = 1 << 16  # strings kept by `SampleDecoder.columns(intern=True)` before starting over
MAX_GPU_INDEX = 1023  # as `GpuSample.gpu`


def _trace_steps_ok(steps: list[TraceLine]) -> bool:
    """Step lines decoded as `TraceLine`s: each has what `FastTrainingStep` requires (a step
    time, a compute time, a job, a rank, a step) and `_step_ok`'s rule, checked column by column."""
    n = len(steps)
    try:  # UNSET is no float: numpy refuses it
        step_times = np.fromiter(map(_STEP_TIME, steps), np.float64, n)
        computes = np.fromiter(map(_COMPUTE, steps), np.float64, n)
    except TypeError:
        return False
    # A job is a non-empty string (None and "" are falsy).
    if not all(map(_JOB, steps)) or None in map(_RANK, steps) or None in map(_STEP_NUMBER, steps):
        return False
    with np.errstate(over="ignore"):  # a step time near the float maximum: inf, as in Python
        return bool((computes <= step_times * 1.5).all())  # _step_ok's comparison, same doubles


_STEP_TIME, _COMPUTE = attrgetter("step_time_s"), attrgetter("compute_s")
_JOB, _STEP_NUMBER = attrgetter("job"), attrgetter("step")


def _json_list(items: Sequence[bytes]) -> bytes:
    """One JSON array of the items. A newline before each comma: a string one item leaves open
    cannot run on into the next (JSON strings hold no raw newline), and callers check that
    there are as many values as items, so no two malformed items decode as one value."""
    if len(items) < 2:
        return b"[" + b"".join(items) + b"]"
    # Brackets on the first and last item: one copy of the text (a chunk is ~20 MB), not three.
    return b"\n,".join(chain((b"[" + items[0],), islice(items, 1, len(items) - 1), (items[-1] + b"]",)))


def _one_node(batch: Any) -> bool:
    node = batch.node
    return all(s.node == node for s in batch.samples)


class FastTrainingStep(msgspec.Struct, gc=False):
    """A validated training step (attribute names and rules as `TrainingStep`)."""

    ts: _FiniteFloat
    job: _NonEmpty
    rank: _Count
    node: _NonEmpty
    gpu: _Count
    step: _Count
    step_time_s: _StepTime
    compute_s: _ComputeTime
    micro_batch: _Count | None = None
    samples: _Count | None = None
    model: str | None = None


_STEP = msgspec.json.Decoder(FastTrainingStep)
_STEPS = msgspec.json.Decoder(list[FastTrainingStep])


def _step_ok(step: FastTrainingStep) -> bool:
    # TrainingStep's cross-field rule: compute beyond 1.5x the step time is garbage.
    return step.compute_s <= step.step_time_s * 1.5


def training_step(line: bytes) -> FastTrainingStep | None:
    """One step line, or None when the fast path refuses it."""
    try:
        step = _STEP.decode(line)
    except msgspec.MsgspecError:
        return None
    return step if _step_ok(step) else None


def training_steps(lines: Sequence[bytes]) -> list[FastTrainingStep] | None:
    """All step lines in one call, or None when any is refused (then go line by line)."""
    try:
        steps = _STEPS.decode(_json_list(lines))
    except msgspec.MsgspecError:
        return None
    return steps if len(steps) == len(lines) and all(map(_step_ok, steps)) else None
