"""The model's alerts on one event stream read every 60, 120 and 300 s, over simulator seeds.

`tests/test_interval_invariance.py` pins the seeds where it holds; this counts it over a range
of seeds with the same helpers (a seed holds when the model raises the same GPUs at every read,
each within one read plus half the 6 h hold of the 60 s read, however many GPUs it raises):

    .venv/bin/python bench/interval_invariance.py --seeds 7 8 9 10 11 12 13 14
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from test_interval_invariance import (  # noqa: E402
    _raises,
    _read_every,
    _samples_every_60s,
    alert_shift_allowed,
)

from fleetwise.predictors.failure import FailurePredictor  # noqa: E402

READS = (60, 120, 300)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=list(range(7, 15)))
    ap.add_argument("--days", type=float, default=3.0)
    ap.add_argument("--model-dir", type=Path, default=None)
    args = ap.parse_args()
    packaged = FailurePredictor.load(args.model_dir)
    predictor = FailurePredictor(packaged.model, replace(packaged.policy, model_alerts=True))
    held = 0
    for seed in args.seeds:
        samples = _samples_every_60s(seed=seed, days=args.days)
        by_read = {every: {k: ts for k, (ts, src) in _raises(_read_every(samples, every), predictor).items()
                           if src == "model"} for every in READS}
        base = by_read[READS[0]]
        same = all(r.keys() == base.keys() for r in by_read.values())
        gap = max((abs(ts - base[k]) for r in by_read.values() for k, ts in r.items() if k in base),
                  default=0.0)
        ok = same and all(abs(ts - base[k]) <= alert_shift_allowed(every)
                          for every, r in by_read.items() for k, ts in r.items())
        held += ok
        print(f"seed {seed}: {'holds' if ok else 'differs'}; model alerts at {'/'.join(map(str, READS))} s: "
              f"{[len(r) for r in by_read.values()]}; largest gap {gap / 3600:.1f} h", flush=True)
    print(f"holds on {held} of {len(args.seeds)} seeds")


if __name__ == "__main__":
    main()
