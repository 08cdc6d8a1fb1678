"""Candidate rule conditions: how many GPUs that never failed, and how many failures with a
precursor, a conjunction of feature conditions held for a number of hops would raise.

A condition is `name:feature>level,feature<level,...` (all must hold in a hop); per trace and
hold, a GPU counts when the conjunction held for `hold` consecutive hops (healthy: anywhere; a
precursor: ending 48 h to 30 min before its failure, as `bench/surge_levels.py` reads them). A
development look, never a judgement: the looks behind rule 14 (docs/benchmarks.md, "A link surge
the node does not share"):

    .venv/bin/python bench/rule_conditions.py --cache /tmp/fw16/cache \\
        --sim val-dr-100 val-dr-101 val-dr-102 fa-val-dr-110 shifted-57 far-48 \\
        --fleet-seeds 42 43 --blind-seeds 32 --liquid-seeds 46 --cloud-seeds 36 37 --holds 1 3 \\
        --cond "A:mem_repairs_24h>1.5" "M3:mem_repairs_24h>1.5,mem_repairs_7d<3,node_sbe_peers_6h<0.5"
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from fleetwise.predictors.features import FEATURE_NAMES
from fleetwise.predictors.training import compute_features_raw

sys.path.insert(0, str(Path(__file__).resolve().parent))
from independent_eval import add_site_gpus  # noqa: E402
from surge_levels import add_trace_arguments, failure_times, held_levels, traces  # noqa: E402

_TERM = re.compile(r"^([a-z0-9_]+)([<>])(-?[0-9.]+)$")


def parse_condition(text: str) -> tuple[str, list[tuple[int, str, float]]]:
    """'name:f>1,g<2' -> (name, [(column, op, level), ...]); SystemExit saying what is wrong."""
    name, _, spec = text.partition(":")
    terms = []
    for term in spec.split(","):
        m = _TERM.match(term.strip())
        if not name or not m or m.group(1) not in FEATURE_NAMES:
            raise SystemExit(f"--cond: expected name:feature>level[,feature<level...] with known features, "
                             f"got {text!r}")
        terms.append((FEATURE_NAMES.index(m.group(1)), m.group(2), float(m.group(3))))
    return name, terms


def margin(features: np.ndarray, terms: list[tuple[int, str, float]]) -> np.ndarray:
    """Per row, by how much the weakest term holds (> 0: all hold; a missing value holds none)."""
    parts = [(features[:, c] - level) if op == ">" else (level - features[:, c]) for c, op, level in terms]
    return np.nan_to_num(np.min(np.stack(parts), axis=0), nan=-np.inf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_arguments(ap)
    ap.add_argument("--holds", type=int, nargs="*", default=[1, 3], help="hops (10 min each)")
    ap.add_argument("--cond", nargs="+", required=True, help="name:feature>level[,feature<level...]")
    args = ap.parse_args()
    conditions = [parse_condition(c) for c in args.cond]
    add_site_gpus()  # the generators' GPUs the packaged catalog lacks
    pooled: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for set_name, raw, labels in traces(args):
        table = compute_features_raw(raw)
        keys = [f"{node}/{gpu}" for node, gpu in table.keys]
        with_precursor, failed = failure_times(labels)
        for name, terms in conditions:
            x = margin(table.features, terms)
            for hold in args.holds:
                healthy, pre = held_levels(keys, table.ts, x, hold, with_precursor, failed)
                counts = [sum(v > 0 for v in healthy), len(healthy), sum(v > 0 for v in pre), len(pre)]
                pooled[name, hold] = [a + b for a, b in zip(pooled[name, hold], counts, strict=True)]
                print(row(set_name, name, hold, counts), flush=True)
    for (name, hold), counts in pooled.items():
        print(row("pooled", name, hold, counts))


def row(set_name: str, name: str, hold: int, counts: list[int]) -> str:
    return (f"{set_name:18s} {name:8s} held {hold:3d} hops: healthy GPUs raised {counts[0]}/{counts[1]}, "
            f"precursors {counts[2]}/{counts[3]}")


if __name__ == "__main__":
    main()
