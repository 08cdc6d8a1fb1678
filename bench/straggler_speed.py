"""StragglerDetector speed per step record, and an exact output comparison against another version.

Step records of a simulator trace (lines with "step_time_s") are decoded once with the replay's
fast path (``fleetwise.schemas.fast.training_steps``, msgspec structs) and fed to a fresh
``StragglerDetector().process`` in chunks of ``--chunk`` records, then ``.flush()``. What is
timed is the detector alone, as CPU time (``time.process_time``), best of ``--repeat`` runs;
decoding and file reading are not timed. Run it on one thread: ``OMP_NUM_THREADS=1``.

    .venv/bin/fleetwise sim --gpus h100-sxm:192,a100-sxm-80gb:128,b200:128,h200:64 --days 1 \\
        --seed 21 --out /tmp/e2e.jsonl.gz
    OMP_NUM_THREADS=1 .venv/bin/python bench/straggler_speed.py /tmp/e2e.jsonl.gz

``--drop-outputs`` drops each chunk's outputs as a streaming sink would (the default keeps them
all, which adds their memory and garbage-collector cost to the timing). ``--no-features`` times
this version as `fleetwise replay` without ``--features`` runs it: ``StragglerDetector(features=False)``,
no per-rank FeatureVector records.

``--compare FILE`` loads another version of ``stragglers.py`` (e.g. the committed one:
``git show HEAD:fleetwise/predictors/stragglers.py > /tmp/stragglers_base.py``), runs both on
the same records and checks that every output record is the same (type, ``model_dump()``
with floats compared by bit pattern, fields set) and in the same order, and that each job's
``state()`` is the same at the end, and that this version with ``features=False`` gives the same
predictions and end states without the FeatureVectors; it exits 1 on the first difference.
``--time-other`` times that version too (the versions take turns, so a burst of load from other
processes hits both alike). Timing runs before the comparison, whose large heap would slow what follows.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import math
import platform
import struct
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fleetwise.predictors.stragglers import StragglerDetector
from fleetwise.schemas.fast import training_step, training_steps


def read_steps(path: Path, limit: int | None = None) -> list[Any]:
    """The trace's training step records, decoded with the replay's fast path, in file order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        lines = [line.rstrip(b"\n") for line in fh if b'"step_time_s"' in line]
    if limit is not None:
        lines = lines[:limit]
    steps: list[Any] = []
    for start in range(0, len(lines), 16_384):
        block = lines[start:start + 16_384]
        decoded = training_steps(block)
        if decoded is None:  # some line refused by the fast path: keep the ones it accepts
            decoded = [s for s in map(training_step, block) if s is not None]
        steps.extend(decoded)
    return steps


def run_detector(factory: Callable[[], Any], steps: Sequence[Any], chunk: int, keep: bool = True
                 ) -> tuple[Any, list[Any]]:
    """A fresh detector over ``steps`` in chunks, then flush; its outputs (only their count
    when not ``keep``: each chunk's outputs are dropped as a streaming sink would)."""
    det = factory()
    out: list[Any] = []
    dropped = 0
    for start in range(0, len(steps), chunk):
        found = det.process(steps[start:start + chunk])
        if keep:
            out.extend(found)
        else:
            dropped += len(found)
    out.extend(det.flush())
    return det, out if keep else [None] * (dropped + len(out))


def cpu_seconds(factory: Callable[[], Any], steps: Sequence[Any], chunk: int, keep: bool = True
                ) -> tuple[float, int]:
    """CPU seconds of one full pass, and the number of output records."""
    gc.collect()  # start each pass from the same heap (the previous pass's outputs are gone)
    t0 = time.process_time()
    _, out = run_detector(factory, steps, chunk, keep)
    seconds = time.process_time() - t0
    return seconds, len(out)


def _exact(value: Any) -> Any:
    """A value with every float replaced by its bit pattern (so -0.0 != 0.0 and NaN == NaN)."""
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    if isinstance(value, dict):
        return {k: _exact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_exact(v) for v in value]
    return value


def record_key(record: Any) -> Any:
    return (type(record).__name__, _exact(record.model_dump()), sorted(record.model_fields_set))


def load_detector(path: Path) -> type:
    spec = importlib.util.spec_from_file_location("stragglers_other", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module.StragglerDetector


def same_states(a: Any, b: Any) -> bool:
    """The same job keys, and each job's ``state()`` the same (floats bit for bit)."""
    return a.keys() == b.keys() and all(_exact(a.state(key)) == _exact(b.state(key)) for key in a.keys())


def compare(other: type, steps: Sequence[Any], chunk: int) -> bool:
    """True when this version and ``other`` give the same outputs, in order, and the same end state,
    and this version without features the same predictions and end state."""
    mine_det, mine = run_detector(StragglerDetector, steps, chunk)
    other_det, theirs = run_detector(other, steps, chunk)
    print(f"outputs: {len(mine)} (this) vs {len(theirs)} (other)")
    for i, (a, b) in enumerate(zip(mine, theirs, strict=False)):
        if record_key(a) != record_key(b):
            print(f"first difference at output {i}:\n  this:  {a!r}\n  other: {b!r}")
            return False
    if len(mine) != len(theirs):
        print("different number of outputs")
        return False
    if not same_states(mine_det, other_det):
        print("different end states")
        return False
    kinds = {}
    for r in mine:
        kinds[type(r).__name__] = kinds.get(type(r).__name__, 0) + 1
    print(f"identical: {kinds}, end state of {len(mine_det.keys())} jobs")
    bare_det, bare = run_detector(lambda: StragglerDetector(features=False), steps, chunk)
    predictions = [r for r in mine if type(r).__name__ != "FeatureVector"]
    same = list(map(record_key, bare)) == list(map(record_key, predictions))
    if not same or not same_states(bare_det, mine_det):
        print("features=False: different predictions or end states")
        return False
    print(f"features=False: the same {len(bare)} predictions and end states")
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, nargs="?", default=Path("/tmp/e2e.jsonl.gz"))
    ap.add_argument("--limit", type=int, default=None, help="first N step records only")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compare", type=Path, default=None, help="another stragglers.py to compare against")
    ap.add_argument("--time-other", action="store_true", help="with --compare: time that version too")
    ap.add_argument("--drop-outputs", action="store_true",
                    help="timed passes drop each chunk's outputs (a streaming sink) instead of keeping all")
    ap.add_argument("--no-features", action="store_true",
                    help="time this version with features=False (as replay without --features)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    steps = read_steps(args.trace, args.limit)
    print(f"{len(steps)} step records from {args.trace} decoded in {time.perf_counter() - t0:.1f} s",
          flush=True)
    other = load_detector(args.compare) if args.compare else None

    # Timed first: the comparison below leaves a large, fragmented heap behind.
    features = not args.no_features
    versions = [("this" if features else "this, features=False",
                 lambda: StragglerDetector(features=features))]
    if other is not None and args.time_other:
        versions.append((str(args.compare) if features else f"{args.compare}, features=False",
                         lambda: other(features=features)))
    best = {name: math.inf for name, _ in versions}
    n_out = {}
    for _ in range(args.repeat):  # versions take turns, so a burst of load hits both alike
        for name, factory in versions:
            seconds, n_out[name] = cpu_seconds(factory, steps, args.chunk, keep=not args.drop_outputs)
            best[name] = min(best[name], seconds)
    cpu = platform.processor() or platform.machine()
    kept = "dropped per chunk" if args.drop_outputs else "kept"
    print(f"\nCPU time, best of {args.repeat}, chunks of {args.chunk}, outputs {kept}; {cpu}")
    print(f"{'version':<40} {'steps':>8} {'outputs':>8} {'cpu s':>7} {'us/step':>8} {'steps/s':>9}")
    for name, _ in versions:
        seconds = best[name]
        us_per_step = 1e6 * seconds / len(steps)
        print(f"{name:<40} {len(steps):>8} {n_out[name]:>8} {seconds:>7.2f} {us_per_step:>8.2f} "
              f"{len(steps) / seconds:>9,.0f}", flush=True)
    if other is not None and not compare(other, steps, args.chunk):
        sys.exit(1)


if __name__ == "__main__":
    main()
