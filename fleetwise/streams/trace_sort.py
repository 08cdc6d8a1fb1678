"""Put replay traces in event-time order: `fleetwise trace sort`, `fleetwise replay --sort`.

A replay reads its lines in the order given, as the workers read a topic: the straggler
detector compares a job's ranks step by step as the records come, and the fleet-wide rails
count in that order too. Recordings are not always in that order: per-node files replayed one
after another, a generator that writes rank by rank. This merges any number of trace files
into one, ordered by `ts` (Unix seconds or RFC 3339, as the records read it); lines with the
same `ts` keep their input order (file by file, line by line), so a file already in order comes
out byte for byte (but for blank lines, which are dropped, and a newline after the last line).
Each line keeps its origin (file and line number) through the sort, so a replay of the merged
lines names a bad line where it is in its own file (`MergedLineNames`).

Memory is bounded: runs of `run_lines` lines are sorted in memory and written to temporary
files, then merged (an external merge sort). A line whose `ts` cannot be read (not JSON, no
`ts`) keeps its place after the line before it in its file, so the replay still reports it as
a bad line where it was.
"""

from __future__ import annotations

import heapq
import math
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import IO

import msgspec
from isal import igzip

from fleetwise.schemas import parse_timestamp
from fleetwise.streams.embedded import READ_BYTES, SORTED_SOURCE, read_text_blocks

RUN_LINES = 500_000  # lines sorted in memory at a time (~0.8 GB of 1.3 KB sample lines at most)
# A line's origin is one integer, (input file index) << _LINE_BITS | (its line number there):
# ordered as the input is, so it also breaks ties between equal timestamps.
_LINE_BITS = 40
_LINE_MASK = (1 << _LINE_BITS) - 1
UNREADABLE_NAMED = 5  # lines without a readable ts named in the summary (all are counted)


class _Stamp(msgspec.Struct):
    ts: float | str


_STAMP = msgspec.json.Decoder(_Stamp)


def line_ts(line: bytes) -> float | None:
    """The event time of a trace line (None when the line has no readable `ts`)."""
    try:
        return parse_timestamp(_STAMP.decode(line).ts)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError, OverflowError):
        return None


@dataclass
class SortSummary:
    lines: int = 0
    files: int = 0
    runs: int = 0  # sorted runs written to temporary files (0: sorted in memory)
    out_of_order: int = 0  # lines older than a line before them in the input order
    unreadable_ts: int = 0  # lines kept in place after the line before them in their file
    unreadable_first: list[str] = field(default_factory=list)  # "file:line" of the first few


def _open_out(path: Path) -> IO[bytes]:
    return igzip.open(path, "wb") if path.suffix == ".gz" else open(path, "wb")


def origin_of(origin: int) -> tuple[int, int]:
    """(input file index, line number in it) of a sorted line's origin."""
    return origin >> _LINE_BITS, origin & _LINE_MASK


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line ending in a newline) of the file's non-blank lines; numbered as the
    replay numbers them (lines end at a newline; blank lines count)."""
    lineno = 0
    for block in read_text_blocks(path):  # whole lines; the last may lack its newline
        lines = block.split(b"\n")
        if not lines[-1]:
            lines.pop()
        for line in lines:
            lineno += 1
            if line.strip():
                yield lineno, line + b"\n"


_ORDER = itemgetter(0, 1)  # (ts, origin)


def _keyed(paths: Iterable[Path], summary: SortSummary) -> Iterator[tuple[float, int, bytes]]:
    """(ts, origin, line) for every line, in input order."""
    newest = -math.inf
    for index, path in enumerate(paths):
        summary.files += 1
        last = -math.inf  # an unreadable line sorts right after the line before it in its file
        for lineno, line in _lines(path):
            ts = line_ts(line)
            if ts is None:
                summary.unreadable_ts += 1
                if len(summary.unreadable_first) < UNREADABLE_NAMED:
                    summary.unreadable_first.append(f"{path}:{lineno}")
                ts = last
            elif ts < newest:
                summary.out_of_order += 1
            last = ts
            newest = max(newest, ts)
            summary.lines += 1
            yield ts, index << _LINE_BITS | lineno, line


def _write_run(run: list[tuple[float, int, bytes]], directory: str) -> Path:
    run.sort(key=_ORDER)
    # Compressed (ISA-L, level 1: ~10x smaller for ~0.5 s of CPU per 300 MB), so a month's
    # runs need a few GB of temporary space, not the traces' uncompressed size.
    fd, name = tempfile.mkstemp(dir=directory, suffix=".run.gz")
    with open(fd, "wb") as raw, igzip.open(raw, "wb", compresslevel=1) as fh:
        fh.writelines(b"%r\t%d\t%b" % item for item in run)
    return Path(name)


def _read_run(path: Path) -> Iterator[tuple[float, int, bytes]]:
    for block in read_text_blocks(path):  # a run's lines come from _lines: each ends its line
        for raw in block.splitlines(keepends=True):
            ts, seq, line = raw.split(b"\t", 2)
            yield float(ts), int(seq), line


@contextmanager
def sorted_lines(paths: Iterable[Path], *, run_lines: int | None = None, tmp_dir: Path | None = None,
                 summary: SortSummary | None = None) -> Iterator[Iterator[tuple[int, bytes]]]:
    """(origin, line) of the lines of `paths` in event-time order, while the context is open
    (the runs spilled to a temporary folder, removed on exit); `origin_of` reads an origin.
    Reads every input line before it yields."""
    run_lines = RUN_LINES if run_lines is None else run_lines
    if run_lines < 1:
        raise ValueError(f"run_lines must be at least 1, got {run_lines}")
    summary = summary if summary is not None else SortSummary()
    with tempfile.TemporaryDirectory(dir=tmp_dir, prefix="fleetwise-sort-") as directory:
        runs: list[Path] = []
        run: list[tuple[float, int, bytes]] = []
        for item in _keyed(paths, summary):
            run.append(item)
            if len(run) >= run_lines:
                runs.append(_write_run(run, directory))
                run = []
        if runs and run:
            runs.append(_write_run(run, directory))
        summary.runs = len(runs)
        ordered = heapq.merge(*map(_read_run, runs), key=_ORDER) if runs else sorted(run, key=_ORDER)
        yield ((origin, line) for _, origin, line in ordered)


def sort_traces(paths: Iterable[Path], out: Path, *, run_lines: int | None = None,
                tmp_dir: Path | None = None) -> SortSummary:
    """Write the lines of `paths` to `out` (.gz: compressed) in event-time order."""
    summary = SortSummary()
    with sorted_lines(paths, run_lines=run_lines, tmp_dir=tmp_dir, summary=summary) as lines, \
            _open_out(out) as fh:
        fh.writelines(line for _, line in lines)
    return summary


class MergedLineNames:
    """"file:line" of the lines of a merged stream (`sorted_lines`) by their place in it, as
    the replay asks for them (`fleetwise.streams.embedded.LineNames`). `text_blocks` gives the
    stream to the replay and keeps each line's origin until the replay releases it: memory for
    the lines it has not decoded yet, not for the stream."""

    def __init__(self, paths: Sequence[Path | str]) -> None:
        self.paths = [str(p) for p in paths]
        self._origins = array("q")  # origins of the lines from line number `_first` on
        self._first = 1

    def text_blocks(self, lines: Iterable[tuple[int, bytes]],
                    block_bytes: int = READ_BYTES) -> Iterator[bytes]:
        """The (origin, line) pairs' lines (each ending in a newline) joined into blocks of
        about `block_bytes`, as `read_text_blocks` gives a file's text to the replay."""
        held: list[bytes] = []
        size = 0
        origins = self._origins
        for origin, line in lines:
            held.append(line)
            origins.append(origin)
            size += len(line)
            if size >= block_bytes:
                yield b"".join(held)
                held, size = [], 0
        if held:
            yield b"".join(held)

    def name(self, lineno: int) -> str:
        i = lineno - self._first
        if 0 <= i < len(self._origins):
            index, line = origin_of(self._origins[i])
            return f"{self.paths[index]}:{line}"
        return f"{SORTED_SOURCE}:{lineno}"  # released already: only its place in the stream

    def release(self, below: int) -> None:
        """The replay will not ask for lines before `below` again."""
        drop = min(below - self._first, len(self._origins))
        if drop > 0:
            del self._origins[:drop]
            self._first += drop
