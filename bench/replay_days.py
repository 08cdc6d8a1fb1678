"""CPU time of a replay part by part, in one process: does a long replay slow down?

Replays a trace as `fleetwise replay` does (one thread, no feature records) and prints the
CPU seconds of every ``--part`` text blocks of 1 MB (585 is about half a simulated day of the
512-GPU fleet). ``--fresh-at K`` swaps in a new `ControlPlane` and runtime after part K (the
replay's state gone, the process the same); ``--repeat N`` instead replays the whole trace N
times in one process, each with a new `ControlPlane`.

    .venv/bin/python bench/replay_days.py e2e30.jsonl.gz --parts 8 [--fresh-at 5]
    .venv/bin/python bench/replay_days.py day5.jsonl.gz --repeat 4
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--part", type=int, default=585, help="text blocks per part")
    ap.add_argument("--parts", type=int, default=8)
    ap.add_argument("--fresh-at", type=int, default=0, help="new ControlPlane after this part")
    ap.add_argument("--repeat", type=int, default=0, help="replay the whole trace this many times")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from fleetwise.streams.embedded import replay_process

    with replay_process():  # as `fleetwise replay`
        replay_parts(args)


def replay_parts(args: argparse.Namespace) -> None:
    from fleetwise.streams.embedded import EmbeddedRuntime, read_text_blocks, replay
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    path = Path(args.trace)

    def control() -> ControlPlane:
        return ControlPlane(ControlPlaneConfig(publish_features=False))

    if args.repeat:
        for i in range(args.repeat):
            plane = control()
            start = time.process_time()
            replay([path], None, control=plane)
            print(f"replay {i + 1}: {time.process_time() - start:.2f} CPU s", flush=True)
        return

    blocks = read_text_blocks(path)
    part = 0
    while part < args.parts:
        runtime = EmbeddedRuntime(control())
        stop_at = args.fresh_at if args.fresh_at > part else args.parts

        def timed(stop_at: int) -> Iterator[bytes]:
            nonlocal part
            start = time.process_time()
            for n, block in enumerate(blocks, start=1):
                yield block
                if n % args.part == 0:
                    part += 1
                    print(f"part {part}: {time.process_time() - start:.2f} CPU s", flush=True)
                    start = time.process_time()
                    if part >= stop_at:
                        return

        runtime.feed_text_blocks(timed(stop_at), str(path))
        if part < args.parts:
            print(f"new ControlPlane after part {part}")


if __name__ == "__main__":
    main()
