"""Writing simulator output: trace files (JSON lines, optionally gzip) and label files."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
from collections import Counter
from pathlib import Path
from typing import IO

from fleetwise.sim.simulator import FleetSimulator

_dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def write_trace(sim: FleetSimulator, path: Path) -> dict:
    """Write every tick as JSON lines (.jsonl or .jsonl.gz by suffix); return record counts.

    Within a tick, step records (ts <= the tick's ts) come first, then the GPU samples, so the
    file is in non-decreasing ts order.
    """
    path = Path(path)
    counts = {"ticks": 0, "samples": 0, "steps": 0}
    with contextlib.ExitStack() as stack:
        raw: IO[bytes] = stack.enter_context(open(path, "wb"))
        if path.name.endswith(".gz"):
            # mtime=0 and no file name in the header: same seed, same bytes.
            raw = stack.enter_context(
                gzip.GzipFile(filename="", mode="wb", compresslevel=3, fileobj=raw, mtime=0)
            )
        out = stack.enter_context(io.TextIOWrapper(raw, encoding="utf-8", newline="\n"))
        for tick in sim.ticks():
            counts["ticks"] += 1
            counts["steps"] += len(tick.steps)
            counts["samples"] += len(tick.samples)
            lines = [_dumps(r) for r in tick.steps]
            lines += [_dumps(r) for r in tick.samples]
            if lines:
                out.write("\n".join(lines))
                out.write("\n")
    return counts


def write_labels(sim: FleetSimulator, path: Path) -> int:
    """Write the ground-truth labels as JSON lines; return how many."""
    labels = sim.labels()
    with open(Path(path), "w", encoding="utf-8", newline="\n") as out:
        for rec in labels:
            out.write(_dumps(rec) + "\n")
    return len(labels)


def summarize_labels(labels: list[dict]) -> dict:
    """Counts by kind, failure class and trap type (for the CLI summary)."""
    return {
        "failures": dict(Counter(r["class"] for r in labels if r["kind"] == "failure")),
        "failures_warned": sum(1 for r in labels if r["kind"] == "failure" and not r["abrupt"]),
        "stragglers": dict(Counter(r["cause"] for r in labels if r["kind"] == "straggler")),
        "job_slowdowns": dict(Counter(r["cause"] for r in labels if r["kind"] == "job_slowdown")),
        "traps": dict(Counter(r["type"] for r in labels if r["kind"] == "trap")),
        "lemons": sum(1 for r in labels if r["kind"] == "lemon"),
    }
