"""A pipeline whose stage slows down, closed loop, on real torch.distributed (gloo, CPU).

Four ranks of `fleetwise.training.example --pipeline-layers 12` (one stage each, 3 layers, one
micro-batch per step). A stage's compute is a sleep of `--sample-time x samples x its layers x
factor`, so step times are a pipeline's whatever this machine's cores do. Stage 3 slows by
`--factor` at `--slow-at`; the embedded control plane (step records -> StragglerDetector ->
ActionPolicy) runs in this process with the job's plan and sends its commands to the ranks,
whose plugin moves the stage boundaries in the running job. Reported: the re-split asked for,
the step at which it took effect, and median step times before the slowdown, slowed, and after
the re-split, against the ideal after (the slowest stage of the new split, plus the overhead
measured before the slowdown).

    python bench/pipeline_resplit.py [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--slow-at", type=int, default=20)
    ap.add_argument("--factor", type=float, default=2.0, help="stage 3's compute time multiplier")
    ap.add_argument("--sample-time", type=float, default=0.001, help="seconds per sample and layer")
    ap.add_argument("--json", action="store_true")
    ns = ap.parse_args(argv)
    from fleetwise.training.example import run_job

    shares, layers = [4, 4, 4, 4], 12
    with tempfile.TemporaryDirectory(prefix="fw-pp-") as tmp:
        got = run_job(Path(tmp), "pp", shares, ns.steps, ns.sample_time, [f"node-3:{ns.factor}@{ns.slow_at}"],
                      control=True, pipeline_layers=layers)
    moves = [c for c in got["commands"] if c.type == "rebalance"]
    done = [a for a in got["acks"] if moves and a.command_id == moves[0].id and a.status == "done"]
    st = got["step_time"]
    at = done[0].step if done else None
    before = statistics.median(st[2:ns.slow_at])
    slowed = statistics.median(st[ns.slow_at + 1:at]) if at else statistics.median(st[ns.slow_at + 1:])
    after = statistics.median(st[at + 1:]) if at is not None else float("nan")
    per_layer = ns.sample_time * sum(shares)
    overhead = before - per_layer * layers / 4
    ideal_after = float("nan")
    if moves:
        spans = moves[0].params["layers"]
        counts = [spans[str(s)][1] - spans[str(s)][0] + 1 for s in range(4)]
        slowest = max(n * per_layer * (ns.factor if s == 3 else 1.0) for s, n in enumerate(counts))
        ideal_after = slowest + overhead
    out = {"machine": "2 vCPU shared VM, CPU gloo, 4 ranks", "rebalances": len(moves),
           "layers": moves[0].params["layers"] if moves else None,
           "stage_speed_factors": moves[0].params["stage_speed_factors"] if moves else None,
           "predicted_gain": moves[0].params["predicted_gain"] if moves else None,
           "applied_at_step": at, "slowed_at_step": ns.slow_at,
           "step_s": {"before": round(before, 4), "slowed": round(slowed, 4), "after": round(after, 4),
                      "ideal_after": round(ideal_after, 4)},
           "measured_gain": round(1 - after / slowed, 3)}
    print(json.dumps(out, indent=None if ns.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
