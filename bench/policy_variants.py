"""Alert-policy variants replayed over the generators' traces, scored once (a development look).

The packaged model's probability of each GPU-hop does not depend on the alert policy, so each
trace of the telemetry generators written apart from the project (`bench/independent_eval.py`)
is scored once (`policy_choice.score_hops`, cached as a pickle next to the trace) and every
variant of the packaged policy is replayed over the scores (`replay_policy`, the stream
worker's policy step), pooled per generator: false alarms (per 1,000 GPU-days), long-precursor
recall at 12 h, any-precursor recall at 30 min, precision (alert episodes) and hot-but-healthy
GPUs flagged. A variant names AlertPolicy fields; `rules`
is the rules alone, `packaged` the packaged policy as it is.

    .venv/bin/python bench/policy_variants.py --fleet-seeds 42 43 --blind-seeds 32 --liquid-seeds 46 \\
        --cloud-seeds 36 37 --variants packaged rules k_raise_thermal=36,k_raise_sbe=36 k_raise_thermal=72

Only for looking at development seeds: a variant chosen here is judged on fresh seeds
(`bench/independent_eval.py`) and simulator members (`bench/failure_eval.py --targets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import pickle
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from failure_eval import model_tag  # noqa: E402
from independent_eval import INTERVAL_S, add_site_gpus, generate  # noqa: E402

from fleetwise.predictors.failure import AlertPolicy, FailurePredictor  # noqa: E402
from fleetwise.predictors.policy_choice import HopScores, replay_policy, score_hops  # noqa: E402


@dataclasses.dataclass
class Tally:
    """One variant's figures over the traces of a generator (or all of them), summed."""

    false_alerts: int = 0
    true_alerts: int = 0
    gpu_days: float = 0.0
    long_caught: int = 0  # precursor >= 18 h, called at >= 12 h lead
    long_n: int = 0
    any_caught: int = 0  # any precursor, called at >= 30 min lead
    any_n: int = 0
    hot_flagged: int = 0  # hot-but-healthy GPUs alerted
    hot: int = 0

    def add(self, m: dict[str, Any], gpu_days: float) -> None:
        """Add one trace's `replay_policy` metrics."""
        self.false_alerts += m["false_alerts"]
        self.true_alerts += m["true_alerts"]
        self.gpu_days += gpu_days
        self.long_caught += m["recall_long_precursor_12h"]["caught"]
        self.long_n += m["recall_long_precursor_12h"]["n"]
        self.any_caught += m["recall_with_precursor_30min"]["caught"]
        self.any_n += m["recall_with_precursor_30min"]["n"]
        self.hot_flagged += round((m["hot_healthy_flagged_share"] or 0.0) * m["hot_healthy_gpus"])
        self.hot += m["hot_healthy_gpus"]

    def __add__(self, other: Tally) -> Tally:
        pairs = zip(dataclasses.astuple(self), dataclasses.astuple(other), strict=True)
        return Tally(*(a + b for a, b in pairs))

    def row(self) -> str:
        fa, true = self.false_alerts, self.true_alerts
        precision = f"{true / (true + fa):.2f} ({true}/{true + fa})" if true + fa else "-"
        return (f"{fa} ({fa / self.gpu_days * 1000:.2f}) | {self.long_caught}/{self.long_n} | "
                f"{self.any_caught}/{self.any_n} | {precision} | {self.hot_flagged}/{self.hot}")


def gpu_samples(trace: Path) -> Iterator[dict[str, Any]]:
    """GPU sample dicts of a generator's trace (sample lines and node batches)."""
    with gzip.open(trace, "rt") as fh:
        for line in fh:
            r = json.loads(line)
            if "metrics" in r:
                yield r
            elif "samples" in r:
                yield from r["samples"]


def variant(spec: str, packaged: AlertPolicy) -> AlertPolicy:
    """'rules', 'packaged', or 'field=value,...' over the packaged policy with the model's alerts on."""
    if spec == "rules":
        return dataclasses.replace(packaged, model_alerts=False)
    if spec == "packaged":
        return packaged
    fields = {f.name: f.type for f in dataclasses.fields(AlertPolicy)}
    values: dict[str, Any] = {}
    for item in spec.split(","):
        name, _, text = item.partition("=")
        if name not in fields or not text:
            raise SystemExit(f"variant {spec!r}: {name!r} is not an AlertPolicy field=value")
        kind = type(getattr(packaged, name))
        values[name] = text.lower() in ("1", "true") if kind is bool else kind(text)
    return dataclasses.replace(packaged, model_alerts=True, **values)


def hop_scores(trace_dir: Path, predictor: FailurePredictor) -> HopScores:
    # Keyed like failure_eval's stored scores: the model, the rules and the feature code.
    cache = trace_dir / f"hop-scores-{model_tag(predictor)}.pkl"
    if cache.exists():
        return pickle.loads(cache.read_bytes())
    scores = score_hops(gpu_samples(trace_dir / "trace.jsonl.gz"), predictor)
    cache.write_bytes(pickle.dumps(scores))
    return scores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for kind in INTERVAL_S:
        ap.add_argument(f"--{kind}-seeds", type=int, nargs="*", default=[])
    ap.add_argument("--variants", nargs="+", default=["packaged", "rules"])
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--failure-rate", type=float, default=30.0, help="per 1,000 GPU-days")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/fleetwise-independent"))
    args = ap.parse_args()
    add_site_gpus()  # the generators' GPUs the packaged catalog lacks
    predictor = FailurePredictor.load()
    policies = [(spec, variant(spec, predictor.policy)) for spec in args.variants]
    tallies: dict[str, dict[str, Tally]] = {spec: {} for spec, _ in policies}
    for kind in INTERVAL_S:
        for seed in getattr(args, f"{kind}_seeds"):
            d = generate(kind, seed, args.cache, gpus=args.gpus, days=args.days, interval=INTERVAL_S[kind],
                         failures_per_1000_gpu_days=args.failure_rate)
            scores = hop_scores(d, predictor)
            labels = [json.loads(x) for x in (d / "labels.jsonl").read_text().splitlines() if x.strip()]
            for spec, policy in policies:
                m, _ = replay_policy(scores, labels, predictor, policy)
                tallies[spec].setdefault(kind, Tally()).add(m, scores.gpu_days)
    print("variant | generator | false alarms (per 1,000 GPU-days) | long @12 h | any precursor @30 min | "
          "precision (true / all episodes) | hot-but-healthy flagged")
    for spec, by_kind in tallies.items():
        for kind, tally in [*by_kind.items(), ("pooled", sum(by_kind.values(), Tally()))]:
            print(f"{spec} | {kind} | {tally.row()}")


if __name__ == "__main__":
    main()
