"""Error-surge levels: how high each link-error acceleration stays for a hold, on GPUs that never
failed and before failures with a precursor (where the levels of ALERT_RULES come from).

Per trace, per GPU and per (feature, hold): the highest level the feature stayed above for
`hold` consecutive hops (a sliding minimum over the GPU's hops, then its maximum; a missing value
holds nothing). GPUs that never failed give the healthy side; each failure with a precursor
(labels: `precursor_start_ts`, not `abrupt`, as `fleetwise backtest` reads them) gives the
highest held level whose last hop falls 48 h to 30 min before it. A rule's node-peer condition
(`AlertRule.unshared`) applies to its series: a hop that a node peer shares holds nothing.
Prints per set the healthy maximum and runner-up and how many precursors held above each level
(the levels of ALERT_RULES on that feature, and any given with --levels), then the same pooled.
The development look behind the surge rules (docs/benchmarks.md, "Error surges as rules"):

    .venv/bin/python bench/surge_levels.py --cache /tmp/fw16/cache \\
        --sim val-dr-100 val-dr-101 val-dr-102 fa-val-dr-110 shifted-57 far-48 \\
        --fleet-seeds 42 43 --blind-seeds 32 --liquid-seeds 46 --cloud-seeds 36 37 --levels pcie_accel=2.8

Simulator members are named as in bench/failure_eval.py's SETS (generated once, cached under
--cache); generator traces as bench/independent_eval.py draws them (cached under
--generator-cache, the same files).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fleetwise.predictors.failure import ALERT_RULES, AlertRule, rule_values
from fleetwise.predictors.training import compute_features_raw, raw_samples

sys.path.insert(0, str(Path(__file__).resolve().parent))
from failure_eval import SETS, load_raw  # noqa: E402
from independent_eval import INTERVAL_S, add_site_gpus, generate  # noqa: E402

BEFORE_H = (48.0, 0.5)  # a precursor's hops: from 48 h to 30 min before its failure


def held_levels(keys: list[str], ts: np.ndarray, x: np.ndarray, hold: int,
                failures: dict[str, list[float]], failed: set[str]) -> tuple[list[float], list[float]]:
    """Per GPU not in `failed` its highest level held `hold` hops; per failure with a precursor
    (`failures`: its GPU's failure times) the highest held level that ended in its window."""
    order = np.lexsort((ts, np.array(keys)))
    k = np.array(keys)[order]
    t, v = ts[order], np.nan_to_num(x[order], nan=-np.inf)
    starts = np.r_[0, np.flatnonzero(k[1:] != k[:-1]) + 1]
    healthy: list[float] = []
    precursors: list[float] = []
    for a, b in zip(starts, np.r_[starts[1:], len(k)], strict=True):
        if b - a < hold:
            continue
        held = sliding_window_view(v[a:b], hold).min(axis=1)
        end = t[a + hold - 1:b]
        key = str(k[a])
        if key not in failed:
            healthy.append(float(held.max()))
        for tf in failures.get(key, ()):
            window = (end >= tf - BEFORE_H[0] * 3600) & (end <= tf - BEFORE_H[1] * 3600)
            if window.any():
                precursors.append(float(held[window].max()))
    return healthy, precursors


def failure_times(labels: Iterable[dict[str, Any]]) -> tuple[dict[str, list[float]], set[str]]:
    """Failure times of failures with a precursor per GPU, and every GPU that failed."""
    with_precursor: dict[str, list[float]] = defaultdict(list)
    failed: set[str] = set()
    for r in labels:
        if r.get("kind") != "failure":
            continue
        key = f"{r['node']}/{int(r['gpu'])}"
        failed.add(key)
        if not r.get("abrupt") and r.get("precursor_start_ts") is not None:
            with_precursor[key].append(float(r["ts"]))
    return with_precursor, failed


def traces(args: argparse.Namespace) -> Iterable[tuple[str, Any, list[dict[str, Any]]]]:
    """(set name, RawSamples, labels) of every trace asked for."""
    members = {spec.name: spec for specs in SETS.values() for spec in specs}
    for name in args.sim:
        if name not in members:
            raise SystemExit(f"--sim: no simulator member {name!r} in bench/failure_eval.py's SETS")
        raw, labels = load_raw(members[name], args.cache)
        yield f"sim {name}", raw, labels
    for kind in INTERVAL_S:
        for seed in getattr(args, f"{kind}_seeds"):
            d = generate(kind, seed, args.generator_cache, gpus=256, days=14.0, interval=INTERVAL_S[kind],
                         failures_per_1000_gpu_days=30.0)
            with gzip.open(d / "trace.jsonl.gz", "rt") as fh:
                raw = raw_samples(json.loads(line) for line in fh)
            labels = [json.loads(line) for line in (d / "labels.jsonl").read_text().splitlines() if line]
            yield f"{kind} {seed}", raw, labels


def add_trace_arguments(ap: argparse.ArgumentParser) -> None:
    """The options `traces` reads: simulator members and generator seeds, and their caches."""
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fleetwise-eval"))
    ap.add_argument("--generator-cache", type=Path, default=Path("/tmp/fleetwise-independent"))
    ap.add_argument("--sim", nargs="*", default=[], help="simulator members (names in failure_eval's SETS)")
    for kind in INTERVAL_S:
        ap.add_argument(f"--{kind}-seeds", type=int, nargs="*", default=[])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_trace_arguments(ap)
    ap.add_argument("--holds", type=int, nargs="*", default=[12, 36], help="hops (10 min each)")
    ap.add_argument("--levels", nargs="*", default=[],
                    help="more levels to count, as feature=level or feature|node_peer_count=level (unshared)")
    args = ap.parse_args()
    add_site_gpus()  # the generators' GPUs the packaged catalog lacks
    # Per (feature, node-peer count that must be 0 or ""): the levels to count.
    levels: dict[tuple[str, str], set[float]] = defaultdict(set)
    for rule in ALERT_RULES:
        if not rule.within_h:  # a count within a window (rule 15) is not a level held
            levels[rule.feature, rule.unshared].add(rule.level)
    for item in args.levels:
        feature, _, level = item.partition("=")
        feature, _, unshared = feature.partition("|")
        levels[feature, unshared].add(float(level))
    series = sorted(levels)
    pooled: dict[tuple[tuple[str, str], int], tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for name, raw, labels in traces(args):
        table = compute_features_raw(raw)
        keys = [f"{node}/{gpu}" for node, gpu in table.keys]
        with_precursor, failed = failure_times(labels)
        for feature, unshared in series:
            x = rule_values(table.features, AlertRule(feature, 0.0, "", unshared=unshared))
            for hold in args.holds:
                healthy, pre = held_levels(keys, table.ts, x, hold, with_precursor, failed)
                pooled[(feature, unshared), hold][0].extend(healthy)
                pooled[(feature, unshared), hold][1].extend(pre)
                print(row(name, feature, unshared, hold, healthy, pre, levels[feature, unshared]), flush=True)
    for ((feature, unshared), hold), (healthy, pre) in sorted(pooled.items()):
        print(row("pooled", feature, unshared, hold, healthy, pre, levels[feature, unshared]))


def row(name: str, feature: str, unshared: str, hold: int, healthy: list[float], pre: list[float],
        levels: set[float]) -> str:
    top = sorted(healthy, reverse=True)[:2] + [float("nan")] * 2
    above = ", ".join(f"> {lv:g}: {sum(p > lv for p in pre)}" for lv in sorted(levels))
    what = f"{feature} ({unshared} 0)" if unshared else feature
    return (f"{name:18s} {what:10s} held {hold:3d} hops | healthy GPUs {len(healthy)}: max {top[0]:.2f}, "
            f"2nd {top[1]:.2f} | precursors {len(pre)}, {above}")


if __name__ == "__main__":
    main()
