"""Re-planning a running job (GPUs lost, added or measured slower) and per-stage timelines."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from fleetwise.planner import cost
from fleetwise.planner.cluster import Cluster, GpuSlot
from fleetwise.planner.search import (
    Candidate,
    InfeasiblePlanError,
    Layout,
    PlanRequest,
    TpGroups,
    _expand,
    _materialise,
    _Search,
    plan_job,
)
from fleetwise.schemas import Plan

SlotKey = tuple[str, int]
_DIFF_FIELDS = ("micro_batch", "num_micro_batches", "stage", "layers", "dp_rank", "tp_rank")


@dataclass
class RankDiff:
    """What changes for one GPU between two plans (``None``: not in that plan)."""

    node: str
    gpu: int
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    changed: list[str] = field(default_factory=list)


def _rank_view(rank: Any) -> dict[str, Any]:
    return {
        "micro_batch": rank.micro_batch, "num_micro_batches": rank.num_micro_batches,
        "stage": rank.stage, "layers": list(rank.layers), "dp_rank": rank.dp_rank, "tp_rank": rank.tp_rank,
    }


def diff_plans(before: Plan, after: Plan) -> list[RankDiff]:
    """Per GPU differences (only GPUs whose part changed), sorted by node and GPU."""
    old = {(r.node, r.gpu): _rank_view(r) for r in before.ranks}
    new = {(r.node, r.gpu): _rank_view(r) for r in after.ranks}
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        changed = list(_DIFF_FIELDS) if a is None or b is None else [f for f in _DIFF_FIELDS if a[f] != b[f]]
        if changed:
            out.append(RankDiff(node=key[0], gpu=key[1], before=a, after=b, changed=changed))
    return out


class _Fixed:
    """A plan's own assignment of GPUs to replicas and stages, re-costed on a cluster."""

    def __init__(self, plan: Plan, request: PlanRequest, cluster: Cluster) -> None:
        self.search = _Search(request, cluster)
        fleet = self.search.fleet
        K = fleet.kinds
        by_key = {s.key: s for s in fleet.usable}
        tp, pp, dp = plan.tp, plan.pp, plan.dp
        cells: dict[tuple[int, int], list[Any]] = {}
        for r in plan.ranks:
            cells.setdefault((r.dp_rank, r.stage), []).append(r)
        slots: list[tuple[GpuSlot, ...]] = []
        kinds, nodes = [], []
        index = np.zeros((dp, pp), dtype=np.int64)
        for (d, stage), members in sorted(cells.items()):
            members.sort(key=lambda x: x.tp_rank)
            missing = [(m.node, m.gpu) for m in members if (m.node, m.gpu) not in by_key]
            if missing:
                raise ValueError(f"plan GPUs {missing} are not in the cluster")
            group = tuple(by_key[(m.node, m.gpu)] for m in members)
            # a TP group runs at the pace of its slowest member
            member_kinds = [fleet.slot_kind[s.key] for s in group]
            kind = min(member_kinds, key=lambda k: K.cap_tflops[k])
            index[d, stage] = len(slots)
            slots.append(group)
            kinds.append(kind)
            nodes.append(fleet.node_index[group[0].node])
        self.groups = TpGroups(kind=np.array(kinds, dtype=np.int64), node=np.array(nodes, dtype=np.int64),
                               slots=slots)
        self.layout = Layout(tp, pp, dp, str(getattr(plan, "arrangement", "grouped")), index)
        self.cls = self.search.ev.classes(self.layout, self.groups)
        first = sorted({(r.stage, r.layers) for r in plan.ranks})
        self.layers = [last - begin + 1 for _, (begin, last) in first]
        self.micro = np.zeros(dp, dtype=np.int64)
        for r in plan.ranks:
            self.micro[r.dp_rank] = r.num_micro_batches
        self.b = plan.ranks[0].micro_batch


def plan_timeline(plan: Plan, request: PlanRequest, cluster: Cluster) -> list[dict[str, Any]]:
    """Per replica and stage, where one step's time goes (for plotting).

    Each item: ``dp_rank, stage, model, node, layers, num_micro_batches`` and seconds
    ``compute_s`` (its layers' FLOPs, all micro-batches), ``comm_s`` (TP collectives and
    stage-to-stage sends), ``sync_s`` (gradient synchronisation + optimizer step, once),
    ``idle_s`` (waiting: pipeline bubble and waiting for slower replicas) and ``step_s``.
    """
    fixed = _Fixed(plan, request, cluster)
    ev, K = fixed.search.ev, fixed.search.fleet.kinds
    layout, cls = fixed.layout, fixed.cls
    res = ev.evaluate(layout, cls, fixed.b, plan.zero_stage, plan.recompute,
                      fixed_layers=fixed.layers, fixed_micro=fixed.micro)
    if not res.feasible:
        raise InfeasiblePlanError("the plan no longer fits in memory on this cluster", res.needs)
    tp, pp = layout.tp, layout.pp
    ps, fs, _, _ = ev.stage_arrays(cls.kinds, cls.same_node, tp, fixed.b, plan.zero_stage, plan.recompute,
                                   layout.dp)
    m = request.model
    flops_layer = ev.layer_fwd * fixed.b * cost.recompute_flops_factor(m, ev.s, plan.recompute) / tp
    logits = 3.0 * ev.logits_fwd * fixed.b / tp
    f_layer, f_logits = ev.gemm_eff(tp, fixed.b)
    sync = float(res.dp_comm_s + res.optimizer_s)
    step = float(res.step_s)
    out = []
    starts = np.concatenate([[0], np.cumsum(fixed.layers)])
    for d in range(layout.dp):
        c = int(cls.inverse[d])
        n_mb = int(fixed.micro[d])
        for stage in range(pp):
            kind = int(cls.kinds[c, stage])
            cap = float(K.cap_tflops[kind]) * 1e12
            n_layers = fixed.layers[stage]
            compute_mb = n_layers * flops_layer / (cap * f_layer) + (
                logits / (cap * f_logits) if stage == pp - 1 else 0.0
            )
            total_mb = float(fs[c, stage] + n_layers * ps[c, stage])
            compute = n_mb * compute_mb
            comm = n_mb * max(0.0, total_mb - compute_mb)
            group = fixed.groups.slots[int(layout.index[d, stage])]
            out.append({
                "dp_rank": d, "stage": stage, "model": K.ids[kind], "node": group[0].node,
                "layers": [int(starts[stage]), int(starts[stage + 1]) - 1], "num_micro_batches": n_mb,
                "compute_s": compute, "comm_s": comm, "sync_s": sync,
                "idle_s": max(0.0, step - compute - comm - sync), "step_s": step,
            })
    return out


def replan(
    plan: Plan,
    request: PlanRequest,
    cluster: Cluster,
    *,
    remove: set[SlotKey] | frozenset[SlotKey] | tuple = (),
    add: list[GpuSlot] | tuple = (),
    slowdown: dict[SlotKey, float] | None = None,
) -> tuple[Plan, list[RankDiff]]:
    """A new plan after GPUs left, joined or were measured slower, and the per-GPU diff.

    ``slowdown[(node, gpu)] = f`` means the GPU now takes ``f`` times as long (f = 1.25:
    25% slower). With only slowdowns the GPUs keep their TP/PP places and layers and only
    the micro-batch counts move (a live rebalance). When GPUs leave or join, the same TP and
    PP degrees are kept if the new set allows them; otherwise the job is planned afresh.
    """
    slowdown = dict(slowdown or {})
    for key, factor in slowdown.items():
        if not factor > 0:
            raise ValueError(f"slowdown for {key}: factor must be > 0, got {factor}")
    removed = {tuple(k) for k in remove}
    present = {s.key for s in cluster.slots}
    added = {a.key for a in add}
    unknown = sorted(k for k in removed | set(slowdown) if k not in present and k not in added)
    if unknown:
        raise ValueError(f"GPUs not in the cluster: {unknown}")
    slots = [s for s in cluster.slots if s.key not in removed] + list(add)
    slots = [replace(s, speed=s.speed / slowdown[s.key]) if s.key in slowdown else s for s in slots]
    new_cluster = Cluster(
        slots=slots, node_network_gbs=dict(cluster.node_network_gbs),
        node_nvlink_gbs=dict(cluster.node_nvlink_gbs), node_pcie_gbs=dict(cluster.node_pcie_gbs),
        default_network_gbs=cluster.default_network_gbs,
    )
    if not removed and not add:
        new_plan = _rebalance(plan, request, new_cluster)
    else:
        new_plan = _keep_degrees(plan, request, new_cluster)
    return new_plan, diff_plans(plan, new_plan)


def _rebalance(plan: Plan, request: PlanRequest, cluster: Cluster) -> Plan:
    """Same GPUs, same places and layers; new micro-batch counts for the measured speeds."""
    fixed = _Fixed(plan, request, cluster)
    ev = fixed.search.ev
    res = ev.evaluate(fixed.layout, fixed.cls, fixed.b, plan.zero_stage, plan.recompute,
                      fixed_layers=fixed.layers)
    if not res.feasible:
        raise InfeasiblePlanError("the rebalanced plan does not fit in memory", res.needs)
    micro = _expand(res.per_class, fixed.cls.inverse, fixed.cls.counts)
    cand = Candidate(fixed.layout, fixed.b, plan.zero_stage, plan.recompute, res)
    new = _materialise(fixed.search, cand, fixed.groups, fixed.cls, micro)
    new.notes.append("live rebalance: same TP/PP places and layers, micro-batches moved")
    return new


# Keep the running TP/PP degrees unless a fresh plan is this much faster: rebuilding the
# model-parallel groups and resharding layers costs far more than moving micro-batches.
KEEP_DEGREES_TOLERANCE = 0.05


def _keep_degrees(plan: Plan, request: PlanRequest, cluster: Cluster) -> Plan:
    """Plan on the new GPU set, keeping TP and PP unless that is clearly slower.

    A pure pipeline (one stage per GPU: tp 1, dp 1) stays one, with a stage per GPU of the new
    set, whenever that fits: its training script runs one stage per rank and cannot become
    data-parallel while it runs (the plugin refuses such a re-plan)."""
    if plan.tp == 1 and plan.dp == 1 and plan.pp > 1:
        try:
            kept = plan_job(replace(request, strategy=(1, len(cluster.slots), 1), exhaustive=False), cluster)
            kept.notes.append(f"re-planned as a pipeline of one stage per GPU: pp {plan.pp} -> {kept.pp}")
            return kept
        except (InfeasiblePlanError, ValueError):
            pass
    fresh = plan_job(replace(request, strategy=None), cluster)
    if (fresh.tp, fresh.pp) == (plan.tp, plan.pp):
        fresh.notes.append(f"re-planned keeping tp={plan.tp} pp={plan.pp}; dp {plan.dp} -> {fresh.dp}")
        return fresh
    try:
        fleet = _Search(replace(request, strategy=None), cluster).fleet
        groups = len(fleet.groups(plan.tp).kind)
        dp = min(groups // plan.pp, request.global_batch)
        if dp >= 1:
            kept = plan_job(replace(request, strategy=(plan.tp, plan.pp, dp), exhaustive=False), cluster)
            if kept.predicted_step_s <= fresh.predicted_step_s * (1 + KEEP_DEGREES_TOLERANCE):
                kept.notes.append(f"re-planned keeping tp={plan.tp} pp={plan.pp}; dp {plan.dp} -> {dp}")
                return kept
    except (InfeasiblePlanError, ValueError):
        pass
    fresh.notes.append(
        f"re-planned with new degrees tp={fresh.tp} pp={fresh.pp} (keeping tp={plan.tp} pp={plan.pp} "
        f"did not fit or was more than {KEEP_DEGREES_TOLERANCE:.0%} slower)"
    )
    return fresh
