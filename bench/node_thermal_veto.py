"""What a node-peer thermal veto would remove from the failure model's alerts (a what-if).

On gen C and gen D (bench/liquid_fleet.py, bench/cloud_fleet.py) most of the model's false
alarms were row- or hall-wide heat: several GPUs of one node over 0.9 at once, each on its own
temperature residual. This reads the decisions of `fleetwise replay --model-alerts` and the
trace's labels, and counts each model-raised alert (the hop an episode starts) as true (the GPU
fails within 48 h) or false, and whether a veto would have held it back: its top signal is
thermal (`temp_*`, `rth_ratio`) and at least `--peers` other GPUs of its node had a thermal
prediction at p >= 0.9 within an hour of it. A what-if over decisions, not the detector; the hold
it led to, which sees only the peer hops closed before it in arrival order, is
`AlertPolicy.shared_heat_peers` (docs/benchmarks.md, "Shared heat"). Over decisions made with
that hold on, this counts what a looser veto would still remove.

    FLEETWISE_CATALOG_EXTRA=bench/cloud_site_gpus.csv fleetwise replay T/trace.jsonl.gz \
        --out d.jsonl --model-alerts
    .venv/bin/python bench/node_thermal_veto.py d.jsonl T/labels.jsonl
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict

HORIZON_S = 48 * 3600.0
WINDOW_S = 3600.0


def _thermal(prediction: dict) -> bool:
    top = prediction["signals"][1]["name"] if len(prediction["signals"]) > 1 else ""
    return top.startswith("temp_") or top == "rth_ratio"


def count(decisions: str, labels: str, peers: int) -> Counter:
    fails: dict[tuple[str, int], list[float]] = defaultdict(list)
    with open(labels) as fh:
        for rec in map(json.loads, fh):
            if rec["kind"] == "failure":
                fails[(rec["node"], rec["gpu"])].append(rec["ts"])
    hot: dict[str, list[tuple[float, int]]] = defaultdict(list)  # node -> thermal p >= 0.9
    raises: list[tuple[tuple[str, int], float, bool]] = []
    alert_on: dict[tuple[str, int], bool] = {}
    with open(decisions) as fh:
        for r in map(json.loads, fh):
            if r.get("kind") != "prediction" or r.get("type") != "failure":
                continue
            key = (r["node"], r["gpu"])
            if r["probability"] >= 0.9 and _thermal(r):
                hot[r["node"]].append((r["ts"], r["gpu"]))
            if r["alert"] and not alert_on.get(key) and r["signals"][0]["value"] == "model":
                raises.append((key, r["ts"], _thermal(r)))
            alert_on[key] = r["alert"]
    out: Counter = Counter()
    for (node, gpu), ts, thermal in raises:
        true = any(0.0 <= f - ts <= HORIZON_S for f in fails[(node, gpu)])
        warm_peers = {g for t, g in hot[node] if g != gpu and abs(t - ts) <= WINDOW_S}
        veto = thermal and len(warm_peers) >= peers
        out["true" if true else "false", "vetoed" if veto else "kept"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("decisions")
    ap.add_argument("labels")
    ap.add_argument("--peers", type=int, default=2, help="other GPUs of the node hot at once")
    args = ap.parse_args()
    for (truth, fate), n in sorted(count(args.decisions, args.labels, args.peers).items()):
        print(f"{truth} alerts {fate}: {n}")


if __name__ == "__main__":
    main()
