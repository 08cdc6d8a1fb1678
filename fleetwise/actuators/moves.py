"""What the policy needs to decide consolidations and migrations from the stream.

`UtilisationWindow` keeps the last window of per-GPU utilisation (one value per closed feature
hop, as arrays: the replay path hands thousands at once) and who ran where; at a check it
gives a consolidation `FleetSnapshot` with samples only for nodes that stayed low (the others
cannot be candidates, so their samples would only cost time). `migration_for` asks placement
whether a job with a known plan has a much cheaper home than where it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from fleetwise.actuators.consolidation import (
    FleetSnapshot,
    JobState,
    UtilSample,
    nodes_from_inventory,
)
from fleetwise.schemas import JobConstraints, JobIntent, NodeInventory, Plan

GpuKey = tuple[str, int]


class UtilisationWindow:
    """Per-GPU utilisation (0..100 %) with event times, the job/rank on each GPU, and each GPU's
    latest temperature at full power (for placement's thermal term)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = float(window_s)
        self._keys: dict[GpuKey, int] = {}
        self._key_list: list[GpuKey] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (ts, gpu index, util)
        self._jobs: list[tuple[float, np.ndarray, list[str | None], list[int | None]]] = []
        self._full_power_c = np.full(0, np.nan)  # per GPU index, the latest known

    def observe(self, keys: Sequence[GpuKey], ts: np.ndarray, util: np.ndarray,
                jobs: Sequence[str | None] | None = None, ranks: Sequence[int | None] | None = None,
                full_power_c: np.ndarray | None = None) -> None:
        index = self._keys
        idx = np.fromiter((index[k] if k in index else self._add(k) for k in keys), dtype=np.int64,
                          count=len(keys))
        if full_power_c is not None and len(idx):
            if len(self._full_power_c) < len(self._key_list):
                grown = np.full(len(self._key_list), np.nan)
                grown[:len(self._full_power_c)] = self._full_power_c
                self._full_power_c = grown
            known = np.flatnonzero(~np.isnan(full_power_c))[::-1]  # the latest row of a GPU first
            gpus, first = np.unique(idx[known], return_index=True)
            self._full_power_c[gpus] = np.asarray(full_power_c)[known[first]]
        # Copies: `util` is usually a column of the closed hops' feature matrix, and a view
        # would keep that whole matrix alive as long as the window holds the chunk (~100 MiB
        # for a replayed day of 512 GPUs).
        ts = np.array(ts, dtype=np.float64)
        self._chunks.append((ts, idx, np.array(util, dtype=np.float64)))
        if jobs is not None and ranks is not None and len(ts):
            self._jobs.append((float(ts.max()), idx, list(jobs), list(ranks)))

    def _add(self, key: GpuKey) -> int:
        self._keys[key] = len(self._key_list)
        self._key_list.append(key)
        return self._keys[key]

    def prune(self, now: float) -> None:
        start = now - self.window_s
        self._chunks = [c for c in self._chunks if len(c[0]) and c[0].max() >= start]
        self._jobs = [j for j in self._jobs if j[0] >= start]

    def low_nodes(self, now: float, below_pct: float) -> set[str]:
        """Nodes whose every GPU value in the window is below `below_pct` (cheap pre-filter)."""
        if not self._chunks:
            return set()
        ts = np.concatenate([c[0] for c in self._chunks])
        idx = np.concatenate([c[1] for c in self._chunks])
        util = np.concatenate([c[2] for c in self._chunks])
        inside = ts >= now - self.window_s
        high = np.zeros(len(self._key_list), dtype=bool)
        np.logical_or.at(high, idx[inside], ~(util[inside] < below_pct))
        seen = np.zeros(len(self._key_list), dtype=bool)
        seen[idx[inside]] = True
        nodes: dict[str, bool] = {}
        for i, (node, _gpu) in enumerate(self._key_list):
            if seen[i]:
                nodes[node] = nodes.get(node, True) and not high[i]
        return {n for n, low in nodes.items() if low}

    def samples(self, now: float, nodes: set[str]) -> list[UtilSample]:
        out = []
        for ts, idx, util in self._chunks:
            for t, i, u in zip(ts.tolist(), idx.tolist(), util.tolist(), strict=True):
                node, gpu = self._key_list[i]
                if node in nodes and t >= now - self.window_s and u == u:  # u == u: not NaN
                    out.append(UtilSample(ts=t, node=node, gpu=gpu, util=min(max(u / 100.0, 0.0), 1.0)))
        return out

    def full_power_c(self) -> dict[GpuKey, float]:
        """Each GPU's latest known temperature at full power (`temp_at_tdp_c`)."""
        return {self._key_list[i]: float(self._full_power_c[i])
                for i in np.flatnonzero(~np.isnan(self._full_power_c))}

    def placements(self) -> dict[str, dict[int, GpuKey]]:
        """The latest job -> {rank: GPU} seen in the window."""
        where: dict[GpuKey, tuple[str, int]] = {}
        for _ts, idx, jobs, ranks in self._jobs:
            for i, job, rank in zip(idx.tolist(), jobs, ranks, strict=True):
                key = self._key_list[i]
                if job is None or rank is None:
                    where.pop(key, None)
                else:
                    where[key] = (job, int(rank))
        out: dict[str, dict[int, GpuKey]] = {}
        for key, (job, rank) in sorted(where.items()):
            out.setdefault(job, {})[rank] = key
        return out

    def forget_job(self, job: str) -> int:
        """A job ended: the GPUs its samples named are in no job from now (until a sample names
        it again). Returns how many labels were dropped."""
        dropped = 0
        for i, (ts, idx, jobs, ranks) in enumerate(self._jobs):
            if job in jobs:
                dropped += sum(1 for j in jobs if j == job)
                self._jobs[i] = (ts, idx, [None if j == job else j for j in jobs],
                                 [None if j == job else r for j, r in zip(jobs, ranks, strict=True)])
        return dropped

    def to_json(self) -> dict:
        return {"window_s": self.window_s}  # a restart rebuilds the window from new samples


def consolidation_snapshot(
    window: UtilisationWindow, inventory: Iterable[NodeInventory], now: float, below_pct: float,
    out_of_service: Iterable[GpuKey], hibernating: Iterable[str],
) -> FleetSnapshot | None:
    """The snapshot for `plan_consolidation`, or None when no node stayed low."""
    window.prune(now)
    low = window.low_nodes(now, below_pct)
    if not low:
        return None
    out = set(out_of_service)
    nodes, budgets = nodes_from_inventory(inventory, hibernating=hibernating, out_of_service=out)
    serving = {(n.node, g) for n in nodes if not n.hibernating for g in n.gpus}
    jobs = []
    for job, ranks in sorted(window.placements().items()):
        gpus = tuple(k for _, k in sorted(ranks.items()) if k in serving)
        if not gpus:
            continue
        # A job that fits on one node stays on one node (its ranks talk over NVLink there).
        one_node = len({node for node, _ in gpus}) == 1
        jobs.append(JobState(job=job, gpus=gpus, group_size=len(gpus) if one_node else 1))
    return FleetSnapshot(ts=now, nodes=nodes, jobs=tuple(jobs), rack_power_budget_w=budgets,
                         samples=tuple(window.samples(now, low)))


@dataclass(frozen=True)
class Migration:
    """A much cheaper home for a job: where it goes, and the placement totals behind it."""

    job: str
    destination: list[GpuKey]
    site: str
    gpu_type: str
    current_total: float
    best_total: float
    transfer_s: float
    plan: Plan | None = None  # the job planned on the destination (None: placement only estimated it)


def migration_for(plan: Plan, inventory: Sequence[NodeInventory], out_of_service: Iterable[GpuKey],
                  min_saving: float, remaining_s: float = 24 * 3600.0,
                  full_power_c: Mapping[GpuKey, float] | None = None) -> Migration | None:
    """Ask placement where the job would go now (its current GPUs as the starting point, so the
    move's cost counts); a migration when the best option is another set of GPUs whose total
    cost is at least `min_saving` below staying (placement itself refuses cross-site moves
    that do not pay back over the remaining time). `full_power_c`: GPUs' temperatures at full
    power (`UtilisationWindow.full_power_c`), for placement's thermal term."""
    from fleetwise.planner import resolve_model
    from fleetwise.planner.placement import GpuState, PlacementError, PlacementSettings, place_job

    out = set(out_of_service)
    current = [(r.node, r.gpu) for r in plan.ranks]
    usable = [inv.model_copy(update={"gpus": [g for g in inv.gpus if (inv.node, g.index) not in out]})
              for inv in inventory]
    try:
        intent = JobIntent(job=plan.job, model=resolve_model(plan.model), global_batch=plan.global_batch,
                           seq_len=plan.seq_len, constraints=JobConstraints(min_gpus=len(current),
                                                                           max_gpus=len(current)))
        # The job may stay as spread as it is now (a job in one rack is not forced to spread out).
        rack_of = {inv.node: inv.rack or inv.node for inv in inventory}
        per_rack: dict[str, int] = {}
        for node, _gpu in current:
            per_rack[rack_of.get(node, node)] = per_rack.get(rack_of.get(node, node), 0) + 1
        share = max(PlacementSettings.max_rack_share, max(per_rack.values()) / len(current))
        telemetry = {k: GpuState(full_power_c=t) for k, t in (full_power_c or {}).items()}
        result = place_job(intent, usable, telemetry, settings=PlacementSettings(
            current=current, current_step_s=plan.predicted_step_s, remaining_s=remaining_s,
            max_rack_share=share))
    except (PlacementError, ValueError, KeyError):
        return None
    if not result.options:
        return None
    best = result.options[0]
    here = set(current)
    stay = next((o for o in result.options if set(o.gpus) == here), None)
    if set(best.gpus) == here or stay is None:
        return None
    if best.total > stay.total * (1.0 - min_saving):
        return None
    return Migration(job=plan.job, destination=list(best.gpus), site=best.site, gpu_type=best.gpu_type,
                     current_total=stay.total, best_total=best.total, transfer_s=best.transfer_s,
                     plan=best.plan.model_copy(update={"constraints": plan.constraints})
                     if best.plan is not None else None)


def hibernating_nodes(gpus: Mapping[GpuKey, str]) -> set[str]:
    """Nodes all of whose known GPUs are hibernating."""
    state: dict[str, bool] = {}
    for (node, _gpu), status in gpus.items():
        state[node] = state.get(node, True) and status == "hibernating"
    return {n for n, asleep in state.items() if asleep}
