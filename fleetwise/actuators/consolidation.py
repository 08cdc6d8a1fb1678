"""Consolidation and hibernation: pack low-utilisation work onto the fewest, most efficient nodes.

Pure (no I/O): a :class:`FleetSnapshot` (nodes, racks and their power budgets, jobs on GPUs,
utilisation samples, queued work) goes in, a :class:`ConsolidationPlan` comes out: which job
GPUs move where (one unsigned ``consolidate`` :class:`~fleetwise.schemas.Command` per job),
which emptied nodes hibernate, which hibernating nodes wake for queued work, and the watts,
GPU-hours and gCO2 saved over a stated horizon. The lead's policy signs and emits the commands.

Heuristic (docs/consolidation.md): *first-fit-decreasing by efficiency* with a
*local-improvement pass*. A keep-set of nodes is chosen (nodes that must stay, then the
largest and most efficient candidates until their free GPUs can hold everything else);
every other candidate node is emptied in turn (fewest used GPUs first) by placing its job
units, largest first, on the first destination in efficiency order (fuller first among
equals) that passes every rail; a node whose units do not all fit is rolled back and kept.
The improvement pass then retries every kept candidate until a round frees nothing.

Rails: a move never takes a rack over its power budget, never puts more than
``rack_share`` of a job's GPUs in one rack (at least one NVLink group), never splits an
NVLink group that the job needs and currently has, and moves at most ``max_moves`` jobs per
plan (each at most once: its GPUs go straight to their final place). Only nodes whose
utilisation stayed below a threshold for a whole window of event-time samples are emptied.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from types import MappingProxyType
from typing import Any, Literal

from fleetwise.actuators.ids import command_id
from fleetwise.catalog import GpuSpec, UnknownGpuError, lookup
from fleetwise.schemas import Command
from fleetwise.schemas.inventory import NodeInventory

__all__ = [
    "DEFAULT_GCO2_PER_KWH",
    "IDLE_POWER_SHARE",
    "ConsolidationConfig",
    "ConsolidationError",
    "ConsolidationPlan",
    "FleetSnapshot",
    "JobMove",
    "JobState",
    "NodeAction",
    "NodeState",
    "PendingJob",
    "Savings",
    "UtilSample",
    "gpu_efficiency",
    "nodes_from_inventory",
    "plan_consolidation",
    "sustained_low_nodes",
]

# World-average carbon intensity of electricity generation in 2023: 480 gCO2/kWh (Ember,
# Global Electricity Review 2024). Used for any site without its own figure.
DEFAULT_GCO2_PER_KWH = 480.0
# Idle GPU power as a share of TDP (H100: ~70 W of 700 W; the simulator uses the same share,
# fleetwise/sim/fleet.py, from sample-metrics.prom's 71 W idle H100).
IDLE_POWER_SHARE = 0.10
HEURISTIC = "first-fit-decreasing by efficiency (TFLOPS/W) + local-improvement pass"

Gpu = tuple[str, int]  # (node, GPU index)


class ConsolidationError(ValueError):
    """Malformed snapshot or config; the message names the offending field."""


# --- inputs ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeState:
    """One node: its GPUs in service (drained ones left out), where it sits, whether it sleeps.

    ``nvlink_groups``: GPU indexes that share an NVLink domain; empty means the whole node is
    one domain (a job group needing co-location then needs one node). ``base_w``: the node's
    non-GPU power when awake (CPUs, memory, fans); ``None`` takes the config default.
    """

    node: str
    rack: str
    model: str
    gpus: tuple[int, ...]
    site: str = "default"
    nvlink_groups: tuple[tuple[int, ...], ...] = ()
    hibernating: bool = False
    base_w: float | None = None


@dataclass(frozen=True)
class JobState:
    """A running job: its GPUs in rank order and what constrains a move.

    ``group_size``: consecutive ranks that must share one NVLink domain (tensor-parallel
    group; the whole job when it equals the GPU count); 1 means no co-location need. The rule
    binds a group only while the group has the property (all on one domain now).
    ``memory_gb``: per-GPU memory need; ``None`` means at least the current GPU's memory.
    ``utilisation``: used for GPUs with no samples in the window (``None``: assume 1.0).
    ``movable=False`` pins the job (e.g. in a per-job cooldown of the policy).
    """

    job: str
    gpus: tuple[Gpu, ...]
    group_size: int = 1
    memory_gb: float | None = None
    dtype: str = "bf16"
    utilisation: float | None = None
    movable: bool = True


@dataclass(frozen=True)
class UtilSample:
    """One GPU utilisation sample (0..1, e.g. DCGM_FI_DEV_GPU_UTIL / 100) at event time ``ts``."""

    ts: float
    node: str
    gpu: int
    util: float


@dataclass(frozen=True)
class PendingJob:
    """Queued work: ``gpus`` GPUs with ``memory_gb`` each, in NVLink groups of ``group_size``."""

    job: str
    gpus: int
    group_size: int = 1
    memory_gb: float = 0.0


@dataclass(frozen=True)
class FleetSnapshot:
    """Everything one consolidation decision needs, as of event time ``ts``.

    A rack missing from ``rack_power_budget_w`` has no budget (no power rail there).
    """

    ts: float
    nodes: tuple[NodeState, ...]
    jobs: tuple[JobState, ...] = ()
    rack_power_budget_w: Mapping[str, float] = field(default_factory=dict)
    samples: tuple[UtilSample, ...] = ()
    pending: tuple[PendingJob, ...] = ()


@dataclass(frozen=True)
class ConsolidationConfig:
    """Thresholds, rails and accounting parameters (defaults in docs/consolidation.md)."""

    low_util_threshold: float = 0.30  # node mean GPU utilisation below this ...
    window_s: float = 3600.0  # ... for this long (event time) makes it a candidate
    bucket_s: float = 60.0  # samples are averaged per node in buckets of this width
    max_gap_s: float = 300.0  # a longer hole in a node's samples means "not known to be low"
    max_moves: int = 16  # jobs moved per plan
    rack_share: float = 0.5  # at most this share of a job's GPUs in one rack
    max_dst_util: float = 0.9  # a job moved to another model must fit under this utilisation
    same_model_only: bool = False
    idle_power_share: float = IDLE_POWER_SHARE
    node_base_w: float = 0.0  # non-GPU power of an awake node (0: GPU power only, conservative)
    pue: float = 1.0  # facility watts per IT watt
    horizon_h: float = 24.0  # savings are stated over this horizon (low load assumed to last)
    gco2_per_kwh: Mapping[str, float] = field(default_factory=dict)  # per site
    default_gco2_per_kwh: float = DEFAULT_GCO2_PER_KWH
    spare_nodes: int = 0  # emptied nodes kept awake as headroom (most efficient first)
    improve_rounds: int = 5
    dry_run: bool = False

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, what: str) -> None:
            if not ok:
                raise ConsolidationError(f"config.{name}={getattr(self, name)!r}: {what}")

        check("low_util_threshold", 0 < self.low_util_threshold <= 1, "must be in (0, 1]")
        check("window_s", self.window_s > 0, "must be > 0")
        check("bucket_s", self.bucket_s > 0, "must be > 0")
        check("max_gap_s", self.max_gap_s >= self.bucket_s, "must be >= bucket_s")
        check("max_moves", self.max_moves >= 0, "must be >= 0")
        check("rack_share", 0 < self.rack_share <= 1, "must be in (0, 1]")
        check("max_dst_util", 0 < self.max_dst_util <= 1, "must be in (0, 1]")
        check("idle_power_share", 0 <= self.idle_power_share < 1, "must be in [0, 1)")
        check("node_base_w", self.node_base_w >= 0, "must be >= 0")
        check("pue", self.pue >= 1, "must be >= 1")
        check("horizon_h", self.horizon_h > 0, "must be > 0")
        check("default_gco2_per_kwh", self.default_gco2_per_kwh >= 0, "must be >= 0")
        check("spare_nodes", self.spare_nodes >= 0, "must be >= 0")
        check("improve_rounds", self.improve_rounds >= 0, "must be >= 0")
        for site, value in self.gco2_per_kwh.items():
            if not value >= 0:
                raise ConsolidationError(f"config.gco2_per_kwh[{site!r}]={value!r}: must be >= 0")
        object.__setattr__(self, "gco2_per_kwh", MappingProxyType(dict(self.gco2_per_kwh)))


# --- outputs -----------------------------------------------------------------------------


@dataclass(frozen=True)
class JobMove:
    """One job's GPUs that change place: ``(rank, source, destination)`` per moved GPU."""

    job: str
    moves: tuple[tuple[int, Gpu, Gpu], ...]
    reason: str
    evidence: tuple[str, ...]


@dataclass(frozen=True)
class NodeAction:
    """A node to hibernate or wake, with why."""

    node: str
    action: Literal["hibernate", "wake"]
    gpus: int
    reason: str
    evidence: tuple[str, ...] = ()


@dataclass(frozen=True)
class Savings:
    """What the plan saves over ``horizon_h`` (negative when waking costs more than it saves).

    ``watts_saved`` is IT power (GPUs + node base); energy and gCO2 include the PUE.
    ``gpu_hours_saved`` counts powered GPU-hours avoided (hibernated minus woken GPUs).
    """

    before_w: float
    after_w: float
    watts_saved: float
    horizon_h: float
    gpu_hours_saved: float
    energy_kwh_saved: float
    gco2_saved: float
    nodes_hibernated: int
    nodes_woken: int
    gpus_hibernated: int
    gpus_woken: int
    watts_saved_by_site: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ConsolidationPlan:
    ts: float
    heuristic: str
    low_nodes: Mapping[str, float]  # candidate node -> highest bucket utilisation in the window
    moves: tuple[JobMove, ...]
    hibernate: tuple[NodeAction, ...]
    wake: tuple[NodeAction, ...]
    savings: Savings
    commands: tuple[Command, ...]
    kept_awake: Mapping[str, str]  # emptied node -> why it stays awake
    unplaced_pending: tuple[str, ...]  # queued jobs the awake + woken capacity still cannot hold
    rack_power_w: Mapping[str, float]  # rack -> IT watts after the plan (racks with a node)
    active_nodes_before: int
    active_nodes_after: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (commands as their record dicts)."""
        return {
            "ts": self.ts,
            "heuristic": self.heuristic,
            "low_nodes": dict(self.low_nodes),
            "moves": [
                {
                    "job": m.job,
                    "reason": m.reason,
                    "evidence": list(m.evidence),
                    "moves": [
                        {"rank": r, "from": {"node": s[0], "gpu": s[1]}, "to": {"node": d[0], "gpu": d[1]}}
                        for r, s, d in m.moves
                    ],
                }
                for m in self.moves
            ],
            "hibernate": [_action_dict(a) for a in self.hibernate],
            "wake": [_action_dict(a) for a in self.wake],
            "kept_awake": dict(self.kept_awake),
            "unplaced_pending": list(self.unplaced_pending),
            "savings": {
                k: (dict(v) if isinstance(v, Mapping) else v) for k, v in self.savings.__dict__.items()
            },
            "rack_power_w": dict(self.rack_power_w),
            "active_nodes_before": self.active_nodes_before,
            "active_nodes_after": self.active_nodes_after,
            "commands": [c.model_dump() for c in self.commands],
        }


def _action_dict(a: NodeAction) -> dict[str, Any]:
    return {
        "node": a.node, "action": a.action, "gpus": a.gpus, "reason": a.reason, "evidence": list(a.evidence)
    }


# --- catalog helpers ---------------------------------------------------------------------


def _capability(spec: GpuSpec, dtype: str) -> float:
    """Achieved TFLOPS in ``dtype``, else in the nearest supported 16-bit type (V100: fp16)."""
    for d in (dtype, "bf16", "fp16"):
        if spec.supports(d):
            return spec.capability_tflops(d)
    raise ConsolidationError(f"GPU {spec.id!r} supports neither {dtype}, bf16 nor fp16")


@cache
def gpu_efficiency(model: str) -> float:
    """Achieved bf16 (else fp16) TFLOPS per TDP watt of a catalog GPU: the packing order."""
    spec = lookup(model)
    return _capability(spec, "bf16") / spec.tdp_w


# --- sustained low utilisation -----------------------------------------------------------


def sustained_low_nodes(
    samples: Iterable[UtilSample],
    nodes: Iterable[NodeState],
    now: float,
    config: ConsolidationConfig | None = None,
) -> dict[str, float]:
    """Nodes whose mean GPU utilisation stayed below the threshold for the whole window.

    Samples in ``(now - window_s - max_gap_s, now]`` are averaged per node in ``bucket_s``
    buckets (the mean over the node's GPUs that reported). A node qualifies when every bucket
    in the window is below ``low_util_threshold``, its samples reach back to
    ``now - window_s``, its last one is no older than ``max_gap_s`` and no hole between
    buckets exceeds ``max_gap_s``: missing or stale telemetry never makes a node "low".
    Returns node -> highest bucket utilisation (the evidence).
    """
    cfg = config or ConsolidationConfig()
    in_service = {n.node: set(n.gpus) for n in nodes if not n.hibernating}
    lo = now - cfg.window_s - cfg.max_gap_s
    buckets: dict[str, dict[int, dict[int, tuple[float, float]]]] = defaultdict(lambda: defaultdict(dict))
    for s in samples:
        if s.node not in in_service or s.gpu not in in_service[s.node] or not lo < s.ts <= now:
            continue
        b = math.floor(s.ts / cfg.bucket_s)
        prev = buckets[s.node][b].get(s.gpu)
        if prev is None or s.ts >= prev[0]:  # latest sample of the GPU in the bucket
            buckets[s.node][b][s.gpu] = (s.ts, s.util)
    out: dict[str, float] = {}
    start = now - cfg.window_s
    for node, by_bucket in buckets.items():
        keys = sorted(by_bucket)
        times = [k * cfg.bucket_s for k in keys]
        before = [t for t in times if t <= start]
        if not before or now - (times[-1] + cfg.bucket_s) > cfg.max_gap_s:
            continue  # the samples do not reach back to the window's start, or they went stale
        span = [t for t in times if t >= before[-1]]
        if any(b - a > cfg.max_gap_s for a, b in zip(span, span[1:], strict=False)):
            continue
        means = [
            sum(u for _, u in by_bucket[k].values()) / len(by_bucket[k])
            for k, t in zip(keys, times, strict=True)
            if t + cfg.bucket_s > start
        ]
        worst = max(means)
        if worst < cfg.low_util_threshold:
            out[node] = worst
    return out


def _gpu_utilisation(samples: Iterable[UtilSample], now: float, window_s: float) -> dict[Gpu, float]:
    """Mean utilisation per GPU over the window (the load a moved GPU brings along)."""
    acc: dict[Gpu, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in samples:
        if now - window_s < s.ts <= now:
            a = acc[(s.node, s.gpu)]
            a[0] += s.util
            a[1] += 1
    return {g: a[0] / a[1] for g, a in acc.items()}


# --- validation --------------------------------------------------------------------------


@dataclass
class _Node:
    name: str
    rack: str
    site: str
    spec: GpuSpec
    gpus: tuple[int, ...]
    domains: tuple[tuple[int, ...], ...]
    domain_of: dict[int, int]
    hibernating: bool
    base_w: float
    idle_w: float
    efficiency: float


def _validate(snap: FleetSnapshot, cfg: ConsolidationConfig) -> dict[str, _Node]:
    if not isinstance(snap.ts, int | float) or not math.isfinite(snap.ts):
        raise ConsolidationError(f"snapshot.ts={snap.ts!r}: must be finite Unix seconds")
    nodes: dict[str, _Node] = {}
    for i, n in enumerate(snap.nodes):
        where = f"nodes[{i}]"
        if not n.node:
            raise ConsolidationError(f"{where}.node: empty")
        if n.node in nodes:
            raise ConsolidationError(f"{where}.node: duplicate node {n.node!r}")
        if not n.rack:
            raise ConsolidationError(f"{where}.rack: empty (node {n.node})")
        try:
            spec = lookup(n.model)
        except UnknownGpuError as e:
            raise ConsolidationError(f"{where}.model: {e}") from None
        if len(set(n.gpus)) != len(n.gpus) or any(g < 0 for g in n.gpus):
            raise ConsolidationError(f"{where}.gpus: indexes must be distinct and >= 0, got {list(n.gpus)}")
        domain_of: dict[int, int] = {}
        domains: list[tuple[int, ...]] = []
        for gi, group in enumerate(n.nvlink_groups):
            members = tuple(sorted(g for g in group if g in n.gpus))
            for g in group:
                if g not in n.gpus:
                    continue
                if g in domain_of:
                    raise ConsolidationError(f"{where}.nvlink_groups[{gi}]: GPU {g} is in two groups")
                domain_of[g] = len(domains)
            if members:
                domains.append(members)
        if not n.nvlink_groups and n.gpus:
            domains = [tuple(sorted(n.gpus))]
            domain_of = {g: 0 for g in n.gpus}
        for g in sorted(n.gpus):
            if g not in domain_of:
                domain_of[g] = len(domains)
                domains.append((g,))
        base = cfg.node_base_w if n.base_w is None else n.base_w
        if base < 0:
            raise ConsolidationError(f"{where}.base_w={n.base_w!r}: must be >= 0")
        nodes[n.node] = _Node(
            name=n.node, rack=n.rack, site=n.site or "default", spec=spec, gpus=tuple(sorted(n.gpus)),
            domains=tuple(domains), domain_of=domain_of, hibernating=n.hibernating, base_w=base,
            idle_w=spec.tdp_w * cfg.idle_power_share, efficiency=gpu_efficiency(spec.id),
        )
    for rack, budget in snap.rack_power_budget_w.items():
        if not budget > 0:
            raise ConsolidationError(f"rack_power_budget_w[{rack!r}]={budget!r}: must be > 0")
    held: dict[Gpu, str] = {}
    names: set[str] = set()
    for i, j in enumerate(snap.jobs):
        where = f"jobs[{i}]"
        if not j.job or j.job in names:
            raise ConsolidationError(f"{where}.job: empty or duplicate job name {j.job!r}")
        names.add(j.job)
        if not j.gpus:
            raise ConsolidationError(f"{where}.gpus: a job holds at least one GPU ({j.job})")
        if j.group_size < 1:
            raise ConsolidationError(f"{where}.group_size={j.group_size}: must be >= 1")
        if j.utilisation is not None and not 0 <= j.utilisation <= 1:
            raise ConsolidationError(f"{where}.utilisation={j.utilisation!r}: must be in [0, 1]")
        if j.memory_gb is not None and not j.memory_gb >= 0:
            raise ConsolidationError(f"{where}.memory_gb={j.memory_gb!r}: must be >= 0")
        for k, (node, gpu) in enumerate(j.gpus):
            n = nodes.get(node)
            if n is None or gpu not in n.gpus:
                raise ConsolidationError(f"{where}.gpus[{k}]: {node}/gpu{gpu} is not an in-service GPU")
            if n.hibernating:
                raise ConsolidationError(f"{where}.gpus[{k}]: {node} is hibernating")
            if (node, gpu) in held:
                raise ConsolidationError(
                    f"{where}.gpus[{k}]: {node}/gpu{gpu} already held by job {held[(node, gpu)]!r}"
                )
            held[(node, gpu)] = j.job
    for i, s in enumerate(snap.samples):
        if not 0 <= s.util <= 1:
            raise ConsolidationError(f"samples[{i}].util={s.util!r}: must be in [0, 1] (a fraction)")
    for i, p in enumerate(snap.pending):
        if p.gpus < 1 or p.group_size < 1 or p.gpus % p.group_size:
            raise ConsolidationError(
                f"pending[{i}]: gpus={p.gpus} must be >= 1 and a multiple of group_size={p.group_size}"
            )
    return nodes


# --- the packing state -------------------------------------------------------------------


class _Pack:
    """Mutable assignment with an undo log, so a node that cannot be emptied rolls back."""

    def __init__(
        self,
        snap: FleetSnapshot,
        cfg: ConsolidationConfig,
        nodes: dict[str, _Node],
        util: dict[Gpu, float],
    ) -> None:
        self.cfg = cfg
        self.nodes = nodes
        self.budget = dict(snap.rack_power_budget_w)
        self.jobs = {j.job: j for j in snap.jobs}
        self.loc: dict[str, list[Gpu]] = {j.job: list(j.gpus) for j in snap.jobs}
        self.occ: dict[Gpu, tuple[str, int]] = {
            g: (j.job, r) for j in snap.jobs for r, g in enumerate(j.gpus)
        }
        self.used: Counter[str] = Counter(g[0] for g in self.occ)
        self.work: dict[tuple[str, int], float] = {}
        self.need_mem: dict[tuple[str, int], float] = {}
        self.rack_count: dict[str, Counter[str]] = {}
        for j in snap.jobs:
            self.rack_count[j.job] = Counter(nodes[n].rack for n, _ in j.gpus)
            for r, g in enumerate(j.gpus):
                src = nodes[g[0]].spec
                u = util.get(g, j.utilisation if j.utilisation is not None else 1.0)
                self.work[(j.job, r)] = u * _capability(src, j.dtype)
                self.need_mem[(j.job, r)] = src.memory_gb if j.memory_gb is None else j.memory_gb
        self.rack_w: dict[str, float] = defaultdict(float)
        for n in nodes.values():
            if not n.hibernating:
                self.rack_w[n.rack] += n.base_w + len(n.gpus) * n.idle_w
        for g, (job, r) in self.occ.items():
            self.rack_w[nodes[g[0]].rack] += self.gpu_w(g[0], job, r) - nodes[g[0]].idle_w
        self.moved: Counter[str] = Counter()  # job -> GPUs away from their original place
        self.orig = {j.job: tuple(j.gpus) for j in snap.jobs}
        self.log: list[tuple[str, int, Gpu, Gpu]] = []

    def gpu_w(self, node: str, job: str, rank: int) -> float:
        """Power of a GPU on ``node`` carrying the rank's work (utilisation capped at 1)."""
        n = self.nodes[node]
        u = min(1.0, self.work[(job, rank)] / _capability(n.spec, self.jobs[job].dtype))
        return n.idle_w + u * (n.spec.tdp_w - n.idle_w)

    def limit(self, job: str) -> int:
        j = self.jobs[job]
        return max(j.group_size, math.floor(self.cfg.rack_share * len(j.gpus) + 1e-9))

    def fits_model(self, job: str, rank: int, node: str) -> bool:
        n = self.nodes[node]
        src = self.nodes[self.orig[job][rank][0]].spec
        if n.spec.id == src.id:
            return True
        if self.cfg.same_model_only or n.spec.memory_gb < self.need_mem[(job, rank)]:
            return False
        cap = _capability(n.spec, self.jobs[job].dtype)
        return self.work[(job, rank)] <= self.cfg.max_dst_util * cap

    def free(self, node: str) -> list[int]:
        return [g for g in self.nodes[node].gpus if (node, g) not in self.occ]

    def move(self, job: str, rank: int, dst: Gpu) -> None:
        src = self.loc[job][rank]
        self._apply(job, rank, src, dst)
        self.log.append((job, rank, src, dst))

    def _apply(self, job: str, rank: int, src: Gpu, dst: Gpu) -> None:
        ns, nd = self.nodes[src[0]], self.nodes[dst[0]]
        self.rack_w[ns.rack] -= self.gpu_w(src[0], job, rank) - ns.idle_w
        self.rack_w[nd.rack] += self.gpu_w(dst[0], job, rank) - nd.idle_w
        del self.occ[src]
        self.occ[dst] = (job, rank)
        self.loc[job][rank] = dst
        self.used[src[0]] -= 1
        self.used[dst[0]] += 1
        self.rack_count[job][ns.rack] -= 1
        self.rack_count[job][nd.rack] += 1
        orig = self.orig[job][rank]
        self.moved[job] += (dst != orig) - (src != orig)

    def rollback(self, mark: int) -> None:
        while len(self.log) > mark:
            job, rank, src, dst = self.log.pop()
            self._apply(job, rank, dst, src)

    def moved_jobs(self) -> set[str]:
        return {j for j, c in self.moved.items() if c > 0}


# --- the heuristic -----------------------------------------------------------------------


def _units(pack: _Pack, node: str) -> list[tuple[str, list[int], bool]]:
    """Job units on ``node``: whole NVLink groups the job needs and has, else single GPUs."""
    n = pack.nodes[node]
    by_job: dict[str, list[int]] = defaultdict(list)
    for g in n.gpus:
        if (node, g) in pack.occ:
            job, rank = pack.occ[(node, g)]
            by_job[job].append(rank)
    units: list[tuple[str, list[int], bool]] = []
    for job, ranks in by_job.items():
        size = pack.jobs[job].group_size
        seen: set[int] = set()
        for rank in sorted(ranks):
            if rank in seen:
                continue
            first = rank - rank % size
            group = list(range(first, min(first + size, len(pack.loc[job]))))
            locs = [pack.loc[job][r] for r in group]
            together = (
                size > 1
                and len(group) > 1
                and all(loc[0] == node for loc in locs)
                and len({n.domain_of[loc[1]] for loc in locs}) == 1
            )
            if together:
                units.append((job, group, True))
                seen.update(group)
            else:
                units.append((job, [rank], False))
                seen.add(rank)
    # Largest first; among equals the heaviest work (it has the fewest destinations).
    units.sort(key=lambda u: (-len(u[1]), -max(pack.work[(u[0], r)] for r in u[1]), u[0], u[1][0]))
    return units


def _try_place(pack: _Pack, unit: tuple[str, list[int], bool], order: list[str]) -> bool:
    job, ranks, together = unit
    limit = pack.limit(job)
    for node in order:
        n = pack.nodes[node]
        if len(n.gpus) - pack.used[node] < len(ranks):
            continue
        free = pack.free(node)
        if not all(pack.fits_model(job, r, node) for r in ranks):
            continue
        src_racks = Counter(pack.nodes[pack.loc[job][r][0]].rack for r in ranks)
        after = pack.rack_count[job][n.rack] + len(ranks) - src_racks[n.rack]
        if after > limit and after > pack.rack_count[job][n.rack]:
            continue
        if together:
            domains = [d for d in n.domains if sum((node, g) not in pack.occ for g in d) >= len(ranks)]
            if not domains:
                continue
            # Best fit: the domain with the fewest free GPUs that still holds the group.
            domain = min(domains, key=lambda d: (sum((node, g) not in pack.occ for g in d), d[0]))
            slots = [g for g in domain if (node, g) not in pack.occ][: len(ranks)]
        else:
            slots = free[: len(ranks)]
        mark = len(pack.log)
        for r, g in zip(ranks, slots, strict=True):
            pack.move(job, r, (node, g))
        budget = pack.budget.get(n.rack)
        if budget is not None and pack.rack_w[n.rack] > budget + 1e-6:
            pack.rollback(mark)
            continue
        return True
    return False


def _try_empty(pack: _Pack, node: str, keep: set[str], eligible_dst: set[str]) -> bool:
    """Move every job GPU off ``node`` or change nothing."""
    units = _units(pack, node)
    if not units:
        return True
    jobs = {u[0] for u in units}
    if any(not pack.jobs[j].movable for j in jobs):
        return False
    if len(pack.moved_jobs() | jobs) > pack.cfg.max_moves:
        return False
    mark = len(pack.log)
    for unit in units:
        order = sorted(
            (d for d in eligible_dst if d != node),
            key=lambda d: (
                d not in keep, -pack.nodes[d].efficiency, len(pack.nodes[d].gpus) - pack.used[d], d
            ),
        )
        if not _try_place(pack, unit, order):
            pack.rollback(mark)
            return False
    return True


def _pack_fleet(pack: _Pack, low: Mapping[str, float], spread: bool) -> set[str]:
    """Empty as many low nodes as the rails allow; returns the emptied nodes."""
    nodes, cfg = pack.nodes, pack.cfg
    awake = [n for n in sorted(nodes) if not nodes[n].hibernating]
    pinned = {g[0] for g, (job, _) in pack.occ.items() if not pack.jobs[job].movable}
    candidates = [n for n in awake if n in low and n not in pinned]
    keep: set[str] = {n for n in awake if n not in candidates}
    # Keep-set: largest, most efficient, fullest candidates until the kept free GPUs hold the rest
    # (with ``spread``, taken round-robin over racks so a job's share per rack can stay small).
    order = sorted(candidates, key=lambda n: (-len(nodes[n].gpus), -nodes[n].efficiency, -pack.used[n], n))
    if spread:
        position: Counter[str] = Counter(nodes[n].rack for n in keep)
        ranked = []
        for n in order:
            ranked.append((position[nodes[n].rack], len(ranked), n))
            position[nodes[n].rack] += 1
        order = [n for _, _, n in sorted(ranked)]
    free_kept = sum(len(pack.free(n)) for n in keep)
    outside = sum(pack.used[n] for n in candidates)
    for n in order:
        if free_kept >= outside:
            break
        keep.add(n)
        free_kept += len(pack.free(n))
        outside -= pack.used[n]

    emptied: set[str] = set()

    def empty_order(names: Iterable[str]) -> list[str]:
        return sorted(names, key=lambda n: (pack.used[n], nodes[n].efficiency, -len(nodes[n].gpus), n))

    # Pass 1: first-fit-decreasing of the non-kept candidates into the kept nodes.
    for n in empty_order(c for c in candidates if c not in keep):
        if _try_empty(pack, n, keep, keep):
            emptied.add(n)
        else:
            keep.add(n)
    # Pass 2 (local improvement): retry kept candidates against what is left, until stable.
    for _ in range(cfg.improve_rounds):
        progress = False
        for n in empty_order(c for c in candidates if c in keep and pack.used[c] < len(nodes[c].gpus)):
            if _try_empty(pack, n, keep, keep - {n}):
                keep.discard(n)
                emptied.add(n)
                progress = True
        if not progress:
            break
    return emptied


def plan_consolidation(
    snapshot: FleetSnapshot, config: ConsolidationConfig | None = None
) -> ConsolidationPlan:
    """Decide moves, hibernations and wakes for one snapshot (pure; same input, same plan)."""
    cfg = config or ConsolidationConfig()
    nodes = _validate(snapshot, cfg)
    now = float(snapshot.ts)
    low = sustained_low_nodes(snapshot.samples, snapshot.nodes, now, cfg)
    util = _gpu_utilisation(snapshot.samples, now, cfg.window_s)
    # Multi-start: the keep-set ordered by efficiency, then spread over racks (for the
    # failure-domain rail); the plan that frees most nodes wins, then fewer watts, fewer moves.
    best: tuple[tuple[int, float, int], _Pack, set[str]] | None = None
    for spread in (False, True):
        pack = _Pack(snapshot, cfg, nodes, util)
        emptied = _pack_fleet(pack, low, spread)
        still = (n for n in nodes if not nodes[n].hibernating and n not in emptied)
        awake_w = sum(_site_watts(pack, still).values())
        score = (-len(emptied), awake_w, len(pack.moved_jobs()))
        if best is None or score < best[0]:
            best = (score, pack, emptied)
    assert best is not None
    _, pack, emptied = best
    awake = [n for n in sorted(nodes) if not nodes[n].hibernating]
    before_site = _site_watts(_Pack(snapshot, cfg, nodes, util), awake)

    # Hibernation candidates: emptied nodes, most efficient last (they are the best spares).
    idle_nodes = sorted(emptied, key=lambda n: (nodes[n].efficiency, len(nodes[n].gpus), n))
    kept_awake: dict[str, str] = {}
    for n in sorted(emptied, key=lambda n: (-nodes[n].efficiency, -len(nodes[n].gpus), n))[: cfg.spare_nodes]:
        kept_awake[n] = f"spare: config.spare_nodes={cfg.spare_nodes}"
    # Queued work: keep emptied nodes awake, then wake hibernating ones, until it fits.
    awake_after = [n for n in awake if n not in emptied or n in kept_awake]
    unplaced = _fit_pending(pack, snapshot.pending, awake_after)
    for n in sorted(emptied, key=lambda n: (-nodes[n].efficiency, -len(nodes[n].gpus), n)):
        if not unplaced:
            break
        if n in kept_awake:
            continue
        kept_awake[n] = f"queued work needs it: {', '.join(unplaced)}"
        awake_after.append(n)
        unplaced = _fit_pending(pack, snapshot.pending, awake_after)
    hibernate = [n for n in idle_nodes if n not in kept_awake]
    for n in hibernate:
        pack.rack_w[nodes[n].rack] -= nodes[n].base_w + len(nodes[n].gpus) * nodes[n].idle_w
    woken: list[tuple[str, list[str]]] = []
    sleepers = sorted(
        (n for n in nodes.values() if n.hibernating), key=lambda n: (-n.efficiency, -len(n.gpus), n.name)
    )
    for n in sleepers:
        if not unplaced:
            break
        budget = pack.budget.get(n.rack)
        full = n.base_w + len(n.gpus) * n.spec.tdp_w  # conservative: the queued work runs at TDP
        if budget is not None and pack.rack_w[n.rack] + full > budget + 1e-6:
            continue
        if not any(_pending_fits_node(p, n) for p in snapshot.pending if p.job in unplaced):
            continue
        waiting = list(unplaced)
        awake_after.append(n.name)
        pack.rack_w[n.rack] += n.base_w + len(n.gpus) * n.idle_w
        unplaced = _fit_pending(pack, snapshot.pending, awake_after)
        woken.append((n.name, waiting))

    moves = _job_moves(pack, low, cfg)
    move_cmds = {m.job: _move_command(m, now, cfg) for m in moves}
    hib_actions = []
    commands: list[Command] = list(move_cmds.values())
    for n in hibernate:
        node = nodes[n]
        vacated = sorted(
            move_cmds[m.job].id for m in moves if any(src[0] == n for _, src, _ in m.moves)
        )
        evidence = (f"util:{n}:max={low[n]:.3f}<{cfg.low_util_threshold:g}:window={cfg.window_s:g}s",)
        reason = (
            f"{n} empty after consolidation (utilisation below {cfg.low_util_threshold:.0%} for "
            f"{cfg.window_s:g} s); hibernating saves {node.base_w + len(node.gpus) * node.idle_w:.0f} W idle"
        )
        action = NodeAction(n, "hibernate", len(node.gpus), reason, evidence)
        hib_actions.append(action)
        commands.append(
            Command(
                id=command_id("consolidate", "hibernate", n, now, *vacated), type="consolidate", ts=now,
                node=n, reason=reason, evidence=list(evidence), requires=vacated,
                params={"action": "hibernate", "gpus": list(node.gpus)}, dry_run=cfg.dry_run,
            )
        )
    wake_actions = []
    for n, waiting in woken:
        node = nodes[n]
        reason = f"queued work does not fit the awake fleet: {', '.join(waiting)}"
        evidence = tuple(f"pending:{p}" for p in waiting)
        wake_actions.append(NodeAction(n, "wake", len(node.gpus), reason, evidence))
        commands.append(
            Command(
                id=command_id("consolidate", "wake", n, now, *waiting), type="consolidate", ts=now, node=n,
                reason=reason, evidence=list(evidence),
                params={"action": "wake", "gpus": list(node.gpus), "for": waiting}, dry_run=cfg.dry_run,
            )
        )

    after_site = _site_watts(pack, awake_after)
    savings = _savings(cfg, before_site, after_site, hib_actions, wake_actions)
    racks_with_nodes = {n.rack for n in nodes.values()}
    return ConsolidationPlan(
        ts=now,
        heuristic=HEURISTIC,
        low_nodes=MappingProxyType(dict(sorted(low.items()))),
        moves=tuple(moves),
        hibernate=tuple(hib_actions),
        wake=tuple(wake_actions),
        savings=savings,
        commands=tuple(commands),
        kept_awake=MappingProxyType(dict(sorted(kept_awake.items()))),
        unplaced_pending=tuple(unplaced),
        rack_power_w=MappingProxyType(
            {r: max(0.0, pack.rack_w.get(r, 0.0)) for r in sorted(racks_with_nodes)}
        ),
        active_nodes_before=len(awake),
        active_nodes_after=len(awake_after),
    )


def _pending_fits_node(p: PendingJob, n: _Node) -> bool:
    return n.spec.memory_gb >= p.memory_gb and any(len(d) >= p.group_size for d in n.domains)


def _fit_pending(pack: _Pack, pending: Sequence[PendingJob], awake: Iterable[str]) -> list[str]:
    """Queued jobs (largest first) that do not fit the free GPUs of ``awake`` nodes."""
    free: dict[str, dict[int, int]] = {}
    for name in sorted(set(awake)):
        n = pack.nodes[name]
        per_domain: dict[int, int] = defaultdict(int)
        for g in n.gpus:
            if (name, g) not in pack.occ:
                per_domain[n.domain_of[g]] += 1
        free[name] = per_domain
    unplaced: list[str] = []
    for p in sorted(pending, key=lambda p: (-p.gpus, -p.group_size, p.job)):
        groups = p.gpus // p.group_size
        taken: list[tuple[str, int]] = []
        for name, per_domain in free.items():
            if pack.nodes[name].spec.memory_gb < p.memory_gb:
                continue
            for d in sorted(per_domain):
                while groups - len(taken) > 0 and per_domain[d] >= p.group_size:
                    per_domain[d] -= p.group_size
                    taken.append((name, d))
            if len(taken) == groups:
                break
        if len(taken) < groups:
            for name, d in taken:
                free[name][d] += p.group_size
            unplaced.append(p.job)
    return unplaced


def _job_moves(pack: _Pack, low: Mapping[str, float], cfg: ConsolidationConfig) -> list[JobMove]:
    moves: list[JobMove] = []
    for job in sorted(pack.moved_jobs()):
        pairs = tuple(
            (r, src, dst) for r, (src, dst) in enumerate(zip(pack.orig[job], pack.loc[job], strict=True))
            if src != dst
        )
        sources = sorted({src[0] for _, src, _ in pairs})
        dests = sorted({dst[0] for _, _, dst in pairs})
        evidence = tuple(
            f"util:{n}:max={low[n]:.3f}<{cfg.low_util_threshold:g}:window={cfg.window_s:g}s"
            for n in sources if n in low
        )
        reason = (
            f"consolidate: move {len(pairs)} GPU(s) of {job} off {', '.join(sources)} (sustained low "
            f"utilisation) onto {', '.join(dests)} so the emptied nodes can hibernate"
        )
        moves.append(JobMove(job, pairs, reason, evidence))
    return moves


def _move_command(m: JobMove, now: float, cfg: ConsolidationConfig) -> Command:
    flat = [f"{r}:{s[0]}/{s[1]}>{d[0]}/{d[1]}" for r, s, d in m.moves]
    return Command(
        id=command_id("consolidate", "move", m.job, now, *flat),
        type="consolidate",
        ts=now,
        job=m.job,
        node=m.moves[0][1][0],
        reason=m.reason,
        evidence=list(m.evidence),
        params={
            "action": "move",
            "moves": [
                {"rank": r, "from": {"node": s[0], "gpu": s[1]}, "to": {"node": d[0], "gpu": d[1]}}
                for r, s, d in m.moves
            ],
            "checkpoint_first": True,
        },
        dry_run=cfg.dry_run,
    )


def _site_watts(pack: _Pack, awake: Iterable[str]) -> dict[str, float]:
    """IT watts per site of the awake nodes under the pack's current assignment."""
    out: dict[str, float] = defaultdict(float)
    for n in (pack.nodes[a] for a in set(awake)):
        out[n.site] += n.base_w + len(n.gpus) * n.idle_w
    for g, (job, r) in pack.occ.items():
        n = pack.nodes[g[0]]
        out[n.site] += pack.gpu_w(g[0], job, r) - n.idle_w
    return dict(out)


def _savings(
    cfg: ConsolidationConfig,
    before_site: Mapping[str, float],
    after_site: Mapping[str, float],
    hibernated: Sequence[NodeAction],
    woken: Sequence[NodeAction],
) -> Savings:
    before_w = sum(before_site.values())
    after_w = sum(after_site.values())
    sites = sorted(set(before_site) | set(after_site))
    by_site = {s: before_site.get(s, 0.0) - after_site.get(s, 0.0) for s in sites}
    gco2 = sum(
        w * cfg.pue * cfg.horizon_h / 1000.0 * cfg.gco2_per_kwh.get(s, cfg.default_gco2_per_kwh)
        for s, w in by_site.items()
    )
    gpus_h = sum(a.gpus for a in hibernated)
    gpus_w = sum(a.gpus for a in woken)
    saved = before_w - after_w
    return Savings(
        before_w=before_w,
        after_w=after_w,
        watts_saved=saved,
        horizon_h=cfg.horizon_h,
        gpu_hours_saved=(gpus_h - gpus_w) * cfg.horizon_h,
        energy_kwh_saved=saved * cfg.pue * cfg.horizon_h / 1000.0,
        gco2_saved=gco2,
        nodes_hibernated=len(hibernated),
        nodes_woken=len(woken),
        gpus_hibernated=gpus_h,
        gpus_woken=gpus_w,
        watts_saved_by_site=MappingProxyType(by_site),
    )


# --- adapters ----------------------------------------------------------------------------


def nodes_from_inventory(
    inventories: Iterable[NodeInventory],
    hibernating: Iterable[str] = (),
    out_of_service: Iterable[Gpu] = (),
) -> tuple[tuple[NodeState, ...], dict[str, float]]:
    """NodeStates and rack power budgets from inventory records (drained GPUs left out).

    A node without a rack is its own failure domain (rack = node name); the budget of a rack
    is the smallest ``rack_power_budget_w`` its nodes report. Mixed-model nodes are refused.
    """
    asleep = set(hibernating)
    out = set(out_of_service)
    states: list[NodeState] = []
    budgets: dict[str, float] = {}
    for i, inv in enumerate(sorted(inventories, key=lambda r: r.node)):
        models = {g.model for g in inv.gpus}
        if len(models) > 1:
            raise ConsolidationError(f"inventory[{i}].gpus: node {inv.node} mixes models {sorted(models)}")
        if not models:
            continue
        rack = inv.rack or inv.node
        if inv.rack_power_budget_w is not None:
            budgets[rack] = min(budgets.get(rack, math.inf), inv.rack_power_budget_w)
        states.append(
            NodeState(
                node=inv.node, rack=rack, model=models.pop(), site=inv.site or "default",
                gpus=tuple(g.index for g in inv.gpus if (inv.node, g.index) not in out),
                nvlink_groups=tuple(tuple(grp) for grp in inv.nvlink_groups),
                hibernating=inv.node in asleep,
            )
        )
    return tuple(states), budgets
