"""Integer shares of a batch: the one apportionment the planner, the actuators and the plugin use."""

from __future__ import annotations

from collections.abc import Sequence


def proportional_shares(weights: Sequence[float], total: int) -> list[int]:
    """Integer shares of `total` proportional to `weights` (largest remainder; ties by index)."""
    if total < 0 or not weights or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"cannot split {total} by weights {list(weights)}")
    s = float(sum(weights))
    exact = [w * total / s for w in weights]
    shares = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - shares[i]), i))
    for i in order[: total - sum(shares)]:
        shares[i] += 1
    return shares
