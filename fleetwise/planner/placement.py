"""Cost-based placement of one job over a fleet of GPU pools in racks and sites (docs/placement.md).

Pure: inventories, telemetry and settings in, ranked options out; no I/O.

An *option* is one pool (one site x one GPU type, homogeneous) and the ``N`` GPUs chosen in it.
Its total cost is a weighted sum of explicit terms, each dimensionless:

  compute   step time / the fleet's best per-type estimate      (planner's step when planned)
  memory    least model-state bytes per GPU / usable bytes        (hard: > 1 never fits)
  load      mean live utilisation of the chosen GPUs
  comm      gradient all-reduce time with the mean link between chosen GPUs / reference step
  latency   mean link latency between chosen GPUs / the spine's latency
  thermal   mean heat of the chosen GPUs, 0 at ``cool_c`` .. 1 at the slowdown point (their
            temperature at full power where known, else their temperature now)
  carbon    gCO2 per step / (the best energy per step x the dirtiest site's intensity)
  move      seconds to move the job's state here / the job's remaining seconds

Inside a pool the GPUs are chosen by an exact dynamic programme over the topology tree
(power domain > rack > node > NVLink group) minimising the terms that depend on the choice
(load, thermal, move, comm, latency) under the hard constraints (rack power budgets, failure
domain shares). Pools are ranked with a cheap per-GPU-type step estimate, a lower bound of the
planner's step; the planner then runs on the best pools in order until no unplanned pool's
bound can beat the best planned total (branch and bound), so the first option is the minimum
of the stated cost over all pools.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from fleetwise.catalog import GpuSpec, UnknownGpuError, lookup
from fleetwise.planner import cost
from fleetwise.planner.cluster import Cluster, GpuSlot, cluster_from_inventory
from fleetwise.planner.search import InfeasiblePlanError, plan_job, request_for_intent
from fleetwise.schemas import GpuSample, JobConstraints, JobIntent, NodeInventory, Plan

__all__ = [
    "PRESETS",
    "TERMS",
    "WORKLOAD_PRESET",
    "FleetIndex",
    "GpuState",
    "NetworkModel",
    "PlacementError",
    "PlacementOption",
    "PlacementResult",
    "PlacementSettings",
    "PoolModel",
    "carbon_intensity",
    "parse_weights",
    "place_job",
    "placement_envelope",
    "placement_table",
    "pool_models",
    "rack_power_w",
    "telemetry_from_samples",
]

TERMS: tuple[str, ...] = ("compute", "memory", "load", "comm", "latency", "thermal", "carbon", "move")

# Weights per workload preset (docs/placement.md, "Presets"). Judgement, not measurement: a
# bandwidth-hungry training job pays for every slow link each step; a compute-dense batch job
# mostly for its FLOPs and energy; a latency-bound (inference) job for hop latency and load.
PRESETS: dict[str, dict[str, float]] = {
    "bandwidth-hungry": {"compute": 1.0, "memory": 0.1, "load": 0.5, "comm": 1.0, "latency": 0.05,
                         "thermal": 0.3, "carbon": 0.2, "move": 1.0},
    "compute-dense": {"compute": 1.0, "memory": 0.1, "load": 0.5, "comm": 0.2, "latency": 0.0,
                      "thermal": 0.3, "carbon": 0.5, "move": 1.0},
    "latency-bound": {"compute": 0.5, "memory": 0.1, "load": 1.0, "comm": 0.3, "latency": 1.0,
                      "thermal": 0.5, "carbon": 0.1, "move": 1.0},
}
WORKLOAD_PRESET: dict[str, str] = {
    "training": "bandwidth-hungry", "batch": "compute-dense", "inference": "latency-bound",
}

# Telemetry metric names (dcgm-exporter field names; REFERENCE.md "Telemetry (NVIDIA)").
M_UTIL = "DCGM_FI_DEV_GPU_UTIL"
M_TEMP = "DCGM_FI_DEV_GPU_TEMP"
M_POWER = "DCGM_FI_DEV_POWER_USAGE"
M_SLOWDOWN = "DCGM_FI_DEV_SLOWDOWN_TEMP"  # used when a sample carries it

# The catalog has no throttle temperature. nvidia-smi -q on A100/H100 SXM reports "GPU Max
# Operating Temp" 85-87 C and "GPU Slowdown Temp" ~90 C (recalled, not verified here): 87 C is
# where clocks start to drop. Assumption; a sample's DCGM_FI_DEV_SLOWDOWN_TEMP overrides it.
DEFAULT_SLOWDOWN_C = 87.0
# Heat is measured from here (an idle air-cooled GPU in a cold aisle). Assumption.
DEFAULT_COOL_C = 30.0
# World-average grid carbon intensity is ~480 gCO2/kWh (Ember, Global Electricity Review 2024;
# recalled, not verified here): used for sites the configuration does not list.
DEFAULT_CARBON_G_PER_KWH = 480.0


class PlacementError(ValueError):
    """The placement request is invalid or nothing can hold the job; the message says why."""


@dataclass(frozen=True)
class GpuState:
    """The latest live readings of one GPU (None = not reported)."""

    util_pct: float | None = None
    temp_c: float | None = None
    power_w: float | None = None
    job: str | None = None
    slowdown_c: float | None = None
    ts: float = 0.0
    # How hot it would run at full power (its own temperature-on-power fit: `temp_at_tdp_c` of
    # the feature records). The thermal term prefers it to `temp_c`: a job runs its GPUs at
    # full power, and an idle GPU in a hot aisle reads cool now.
    full_power_c: float | None = None


def telemetry_from_samples(
    samples: Iterable[GpuSample | Mapping[str, Any]],
) -> dict[tuple[str, int], GpuState]:
    """The latest state per (node, GPU) from GPU samples (records or dicts with the same keys).

    Later ``ts`` wins; equal ``ts``: the later sample in the input.
    """
    out: dict[tuple[str, int], GpuState] = {}
    for s in samples:
        if isinstance(s, GpuSample):
            node, gpu, ts, metrics, job = s.node, s.gpu, s.ts, s.metrics, s.job
        else:
            node, gpu, ts = s["node"], int(s["gpu"]), float(s["ts"])
            metrics, job = s.get("metrics") or {}, s.get("job")
        key = (node, gpu)
        old = out.get(key)
        if old is not None and old.ts > ts:
            continue
        out[key] = GpuState(
            util_pct=metrics.get(M_UTIL), temp_c=metrics.get(M_TEMP), power_w=metrics.get(M_POWER),
            job=job, slowdown_c=metrics.get(M_SLOWDOWN), ts=ts,
        )
    return out


def with_full_power(
    state: Mapping[tuple[str, int], GpuState], features: Iterable[Any],
) -> dict[tuple[str, int], GpuState]:
    """``state`` with each GPU's temperature at full power from GPU feature records (objects with
    ``scope``, ``node``, ``gpu``, ``ts`` and ``values``: `temp_at_tdp_c`); the latest record of
    a GPU wins."""
    latest: dict[tuple[str, int], tuple[float, float]] = {}
    for fv in features:
        temp = fv.values.get("temp_at_tdp_c")
        key, ts = (fv.node, int(fv.gpu)), float(fv.ts)
        if fv.scope == "gpu" and temp is not None and ts >= latest.get(key, (ts,))[0]:
            latest[key] = (ts, float(temp))
    out = dict(state)
    for key, (_ts, temp) in latest.items():
        out[key] = replace(out.get(key, GpuState()), full_power_c=temp)
    return out


@dataclass(frozen=True)
class NetworkModel:
    """Link latencies and the bandwidths the inventory does not give (docs/placement.md).

    Latencies are one-hop message latencies; all are assumptions of typical order (NVLink and
    PCIe a few us, one InfiniBand leaf switch ~5 us, leaf-spine-leaf ~8 us, inter-site ~5 us
    per km of fibre, 2 ms ~ 400 km). ``inter_rack_oversubscription`` divides the node NIC
    bandwidth for traffic between racks (2:1 above the leaf; 1 for a non-blocking fat tree).
    """

    nvlink_latency_s: float = 2e-6
    pcie_latency_s: float = 5e-6
    rack_latency_s: float = 5e-6
    spine_latency_s: float = 8e-6
    wan_latency_s: float = 2e-3
    inter_rack_oversubscription: float = 2.0
    wan_gbs: float = 12.5  # 100 Gb/s between sites for one job's transfer (assumption)


@dataclass
class PlacementSettings:
    """What the caller fixes; every field has a documented default (docs/placement.md)."""

    gpus: int | None = None  # GPUs to place; None: constraints.max_gpus, else min_gpus
    weights: Mapping[str, float] | None = None  # full weights; None: the workload's preset
    preset: str | None = None  # preset name (for the report); None: from the workload
    max_rack_share: float = 0.5  # at most this share of the job's GPUs in one rack
    max_domain_share: float | None = None  # ... in one power domain; None: max_rack_share
    min_tokens_per_s: float | None = None  # throughput floor; None: constraints.min_tokens_per_s
    current: Sequence[tuple[str, int]] = ()  # GPUs the job runs on now (empty: a new job)
    current_step_s: float | None = None  # the job's step time now; None: planned on `current`
    remaining_s: float = 24 * 3600.0  # the job's remaining run time at its current speed
    restart_s: float = 300.0  # stop, restore and warm-up time of a move (assumption)
    carbon: Mapping[str, float | Sequence[tuple[float, float]]] = field(default_factory=dict)
    default_carbon_g_per_kwh: float = DEFAULT_CARBON_G_PER_KWH
    now_ts: float | None = None  # start of the carbon window (needed with a time series)
    default_slowdown_c: float = DEFAULT_SLOWDOWN_C
    cool_c: float = DEFAULT_COOL_C
    min_planned: int = 3  # plan at least this many pools (the "few best")
    max_planned: int = 8  # plan at most this many (then the optimum is not proved)
    network: NetworkModel = field(default_factory=NetworkModel)


def parse_weights(text: str | None, workload: str = "training") -> tuple[str, dict[str, float]]:
    """``"compute-dense,carbon=2"``, ``"carbon=2"`` or a preset name -> (preset, full weights).

    The preset defaults to the workload's (training: bandwidth-hungry, batch: compute-dense,
    inference: latency-bound). Raises ``PlacementError`` naming the bad part.
    """
    preset = WORKLOAD_PRESET.get(workload, "bandwidth-hungry")
    overrides: dict[str, float] = {}
    for raw in (text or "").split(","):
        part = raw.strip()
        if not part:
            continue
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep:
            if key not in PRESETS:
                raise PlacementError(f"weights: unknown preset {part!r}; presets: {', '.join(PRESETS)}")
            preset = key
            continue
        if key not in TERMS:
            raise PlacementError(f"weights: unknown term {key!r}; terms: {', '.join(TERMS)}")
        try:
            number = float(value)
        except ValueError:
            raise PlacementError(f"weights: {key}={value.strip()!r} is not a number") from None
        if not math.isfinite(number) or number < 0:
            raise PlacementError(f"weights: {key} must be a finite number >= 0, got {value.strip()!r}")
        overrides[key] = number
    return preset, {**PRESETS[preset], **overrides}


def carbon_intensity(
    value: float | Sequence[tuple[float, float]], start: float | None, duration_s: float, site: str = "?",
) -> float:
    """Mean gCO2/kWh over ``[start, start + duration_s]``: a constant, or a step series of
    ``(ts, g)`` points (each value holds until the next point; before the first: the first)."""
    if isinstance(value, int | float):
        if value < 0 or not math.isfinite(value):
            raise PlacementError(f"carbon.{site}: intensity must be >= 0, got {value!r}")
        return float(value)
    points = sorted((float(t), float(g)) for t, g in value)
    if not points:
        raise PlacementError(f"carbon.{site}: empty time series")
    if any(g < 0 or not math.isfinite(g) for _, g in points):
        raise PlacementError(f"carbon.{site}: intensities must be finite and >= 0")
    if start is None:
        raise PlacementError(f"carbon.{site}: a time series needs now_ts (the window's start)")
    if duration_s <= 0:
        return _value_at(points, start)
    end = start + duration_s
    total = 0.0
    for i, (ts, g) in enumerate(points):
        nxt = points[i + 1][0] if i + 1 < len(points) else math.inf
        lo, hi = max(start, ts if i else -math.inf), min(end, nxt)
        if hi > lo:
            total += g * (hi - lo)
    return total / duration_s


def _value_at(points: list[tuple[float, float]], t: float) -> float:
    value = points[0][1]
    for ts, g in points:
        if ts <= t:
            value = g
    return value


# ---- the fleet as a topology tree ----------------------------------------------------------------


@dataclass
class _Node:
    name: str
    site: str
    domain: str
    rack: str
    budget_w: float | None
    net_gbs_per_gpu: float
    pcie_gbs: float
    nvlink_gbs: float  # per direction, per GPU
    slots: list[GpuSlot]


class FleetIndex:
    """Inventories indexed once: nodes with their site, power domain and rack, GPU slots.

    A node's power domain is its ``labels["power_domain"]`` (default: its rack); a node with
    no rack is a rack of its own; no site: site ``"default"``. A rack must sit in one site and
    one power domain and have one budget; raises ``PlacementError`` naming the rack otherwise.
    """

    def __init__(self, inventories: Sequence[NodeInventory]) -> None:
        try:
            self.cluster: Cluster = cluster_from_inventory(list(inventories))
        except ValueError as exc:
            raise PlacementError(str(exc)) from None
        by_node: dict[str, list[GpuSlot]] = {}
        for slot in self.cluster.slots:
            by_node.setdefault(slot.node, []).append(slot)
        self.nodes: dict[str, _Node] = {}
        rack_meta: dict[str, tuple[str, str, float | None, str]] = {}
        for inv in inventories:
            slots = by_node[inv.node]
            spec = slots[0].spec
            rack = inv.rack or inv.node
            site = inv.site or "default"
            domain = inv.labels.get("power_domain") or rack
            meta = (site, domain, inv.rack_power_budget_w, inv.node)
            old = rack_meta.setdefault(rack, meta)
            for what, i in (("site", 0), ("power domain", 1), ("rack_power_budget_w", 2)):
                if old[i] != meta[i]:
                    raise PlacementError(
                        f"inventory: rack {rack!r} has {what} {old[i]!r} on node {old[3]!r} but "
                        f"{meta[i]!r} on node {inv.node!r}"
                    )
            nvlink = self.cluster.nvlink_gbs(inv.node, spec) / 2.0  # datasheets quote both directions
            self.nodes[inv.node] = _Node(
                name=inv.node, site=site, domain=domain, rack=rack, budget_w=inv.rack_power_budget_w,
                net_gbs_per_gpu=self.cluster.network_gbs(inv.node) / len(slots),
                pcie_gbs=self.cluster.pcie_gbs(inv.node, spec), nvlink_gbs=nvlink, slots=slots,
            )
        self.rack_budget: dict[str, float | None] = {r: m[2] for r, m in rack_meta.items()}
        self.rack_site: dict[str, str] = {r: m[0] for r, m in rack_meta.items()}
        self.rack_nodes: dict[str, list[str]] = {}
        for node in self.nodes.values():
            self.rack_nodes.setdefault(node.rack, []).append(node.name)
        self.slot: dict[tuple[str, int], GpuSlot] = {s.key: s for s in self.cluster.slots}

    def node_of(self, key: tuple[str, int]) -> _Node:
        return self.nodes[key[0]]


def _current_w(slot: GpuSlot, state: GpuState | None, job: str) -> float:
    """A GPU's power now: measured, else its TDP when busy with another job, else 0."""
    if state is not None and state.power_w is not None:
        return float(state.power_w)
    if state is not None and state.job is not None and state.job != job:
        return float(slot.spec.tdp_w)
    return 0.0


def rack_power_w(
    index: FleetIndex, rack: str, chosen: Iterable[tuple[str, int]],
    telemetry: Mapping[tuple[str, int], GpuState], job: str,
) -> float:
    """GPU power of ``rack`` under a plan: chosen GPUs at TDP, every other GPU at its power now."""
    chosen_set = set(chosen)
    total = 0.0
    for node in index.rack_nodes[rack]:
        for slot in index.nodes[node].slots:
            if slot.key in chosen_set:
                total += slot.spec.tdp_w
            else:
                total += _current_w(slot, telemetry.get(slot.key), job)
    return total


# ---- per pool: costs per GPU and per link level --------------------------------------------------


@dataclass
class PoolModel:
    """One pool (site x GPU type) with everything the GPU choice depends on.

    ``unit[key]``: the per-GPU cost (load, thermal and move terms, weighted, / N);
    pair costs: a pair of chosen GPUs costs ``pair_cost(a, b)`` (comm and latency, weighted),
    by the lowest level they share (NVLink group, node, rack, else spine).
    """

    site: str
    spec: GpuSpec
    n: int
    keys: list[tuple[str, int]]
    unit: dict[tuple[str, int], float]
    load: dict[tuple[str, int], float]
    heat: dict[tuple[str, int], float]
    move: dict[tuple[str, int], float]  # seconds of transfer this GPU adds
    group_d: dict[tuple[str, int], tuple[float, float]]  # (node, group) -> (comm, latency) raw
    node_d: dict[str, tuple[float, float]]
    rack_d: dict[str, tuple[float, float]]
    spine_d: tuple[float, float]
    rack_cap: dict[str, int]  # most GPUs of the job per rack (power budget and share)
    domain_cap: int
    share_cap: int
    weights: Mapping[str, float]
    remaining_s: float
    step_est_s: float
    mem_term: float
    tokens_est: float
    cross_site: bool
    transfer_all_s: float  # moving the whole state here (cross-site rule)

    def level_d(self, a: tuple[str, int], b: tuple[str, int], index: FleetIndex) -> tuple[float, float]:
        """Raw (comm, latency) term contribution of the pair ``a``, ``b``."""
        na, nb = index.node_of(a), index.node_of(b)
        if na.name == nb.name:
            ga, gb = index.slot[a].nvlink_group, index.slot[b].nvlink_group
            if ga == gb:
                return self.group_d[(na.name, ga)]
            return self.node_d[na.name]
        if na.rack == nb.rack:
            return self.rack_d[na.rack]
        return self.spine_d

    def pair_cost(self, a: tuple[str, int], b: tuple[str, int], index: FleetIndex) -> float:
        comm, lat = self.level_d(a, b, index)
        return self.weights["comm"] * comm + self.weights["latency"] * lat


def _job_size(intent: JobIntent, settings: PlacementSettings) -> int:
    c = intent.constraints
    n = settings.gpus or c.max_gpus or c.min_gpus
    if n is None:
        raise PlacementError(
            f"job {intent.job!r}: how many GPUs? set constraints.max_gpus or constraints.min_gpus "
            "in the intent (or the GPU count in the settings)"
        )
    if c.min_gpus is not None and n < c.min_gpus:
        raise PlacementError(f"gpus: {n} is below constraints.min_gpus = {c.min_gpus}")
    if c.max_gpus is not None and n > c.max_gpus:
        raise PlacementError(f"gpus: {n} is above constraints.max_gpus = {c.max_gpus}")
    return n


def allowed_gpu_types(c: JobConstraints) -> tuple[set[str] | None, set[str]]:
    """The catalog ids a job may run on (None: any) and those it must not, from its intent's
    constraints; raises PlacementError naming an entry the catalog does not resolve."""

    def ids(names: Iterable[str], where: str) -> set[str]:
        out = set()
        for i, name in enumerate(names):
            try:
                out.add(lookup(name).id)
            except UnknownGpuError as exc:
                raise PlacementError(f"{where}.{i}: {exc}") from None
        return out

    allow = ids(c.gpu_types, "constraints.gpu_types") if c.gpu_types is not None else None
    return allow, ids(c.exclude_gpu_types, "constraints.exclude_gpu_types")


def _est_step_s(intent: JobIntent, spec: GpuSpec, n: int) -> float:
    """A lower bound of the planner's step on ``n`` GPUs of ``spec``: the batch's model FLOPs
    (no recomputation) at the planner's large-GEMM rate on every GPU, nothing else."""
    flops = intent.global_batch * cost.model_flops_per_sample(intent.model, intent.sequence_length, "none")
    rate = spec.capability_tflops(intent.dtype) * cost.MFU_TO_COMPUTE * 1e12
    return flops / (n * rate)


def _heat(state: GpuState | None, settings: PlacementSettings) -> float:
    if state is None:
        return 0.0
    temp = state.full_power_c if state.full_power_c is not None else state.temp_c
    if temp is None:
        return 0.0
    top = state.slowdown_c if state.slowdown_c is not None else settings.default_slowdown_c
    span = max(top - settings.cool_c, 1e-9)
    return min(1.0, max(0.0, (temp - settings.cool_c) / span))


def _cap(share: float, n: int) -> int:
    return max(1, math.floor(share * n + 1e-9))


@dataclass
class _Context:
    intent: JobIntent
    settings: PlacementSettings
    index: FleetIndex
    telemetry: Mapping[tuple[str, int], GpuState]
    n: int
    weights: dict[str, float]
    preset: str
    step_ref: float
    energy_ref: float  # W s per step of the reference
    carbon_ref: float  # g/kWh
    carbon: dict[str, float]
    state_bytes: float
    bw_ref: float  # GB/s per GPU of the fleet's slowest inter-rack link
    current: set[tuple[str, int]]
    current_site: str | None
    current_step_s: float | None
    min_tokens: float | None
    rejected: list[dict[str, str]]


def pool_models(
    intent: JobIntent, index: FleetIndex, telemetry: Mapping[tuple[str, int], GpuState] | None = None,
    settings: PlacementSettings | None = None,
) -> tuple[list[PoolModel], list[dict[str, str]]]:
    """Every candidate pool's model and the pools rejected before any GPU choice (with why)."""
    ctx = _context(intent, index, telemetry or {}, settings or PlacementSettings())
    return _pools(ctx), ctx.rejected


def _context(
    intent: JobIntent, index: FleetIndex, telemetry: Mapping[tuple[str, int], GpuState],
    settings: PlacementSettings,
) -> _Context:
    n = _job_size(intent, settings)
    if settings.weights is None:
        preset, weights = parse_weights(settings.preset, intent.workload)
    else:
        missing = [t for t in TERMS if t not in settings.weights]
        if missing:
            raise PlacementError(f"weights: missing terms {missing}")
        bad = [t for t in TERMS if not (math.isfinite(settings.weights[t]) and settings.weights[t] >= 0)]
        if bad:
            raise PlacementError(f"weights: {bad[0]} must be a finite number >= 0")
        preset, weights = settings.preset or "custom", {t: float(settings.weights[t]) for t in TERMS}
    if not 0 < settings.max_rack_share <= 1:
        raise PlacementError(f"max_rack_share must be in (0, 1], got {settings.max_rack_share}")
    dshare = settings.max_domain_share
    if dshare is not None and not 0 < dshare <= 1:
        raise PlacementError(f"max_domain_share must be in (0, 1], got {dshare}")
    if settings.remaining_s < 0:
        raise PlacementError(f"remaining_s must be >= 0, got {settings.remaining_s}")
    if settings.min_planned < 1 or settings.max_planned < settings.min_planned:
        raise PlacementError("need 1 <= min_planned <= max_planned")
    allow, exclude = allowed_gpu_types(intent.constraints)
    specs = {s.spec.id: s.spec for s in index.cluster.slots}
    for key in settings.current:
        if key not in index.slot:
            raise PlacementError(f"current: GPU {key[0]}/{key[1]} is not in the inventory")
    current = set(settings.current)
    current_site = None
    if current:
        # The site holding most of the job's GPUs; a tie goes to the first site by name (not to
        # a set's iteration order, which changes with the interpreter's hash seed).
        per_site = Counter(index.node_of(k).site for k in current)
        current_site = min(per_site, key=lambda site: (-per_site[site], site))
    min_tokens = settings.min_tokens_per_s
    if min_tokens is None:
        extra = getattr(intent.constraints, "min_tokens_per_s", None)
        if extra is not None:
            try:
                min_tokens = float(extra)
            except (TypeError, ValueError):
                raise PlacementError(f"constraints.min_tokens_per_s: not a number: {extra!r}") from None
    ctx = _Context(
        intent=intent, settings=settings, index=index, telemetry=telemetry, n=n, weights=weights,
        preset=preset, step_ref=math.inf, energy_ref=math.inf, carbon_ref=0.0, carbon={},
        state_bytes=cost.STATE_BYTES_PER_PARAM * cost.total_params(intent.model, intent.sequence_length),
        bw_ref=min(nd.net_gbs_per_gpu for nd in index.nodes.values())
        / settings.network.inter_rack_oversubscription,
        current=current, current_site=current_site, current_step_s=settings.current_step_s,
        min_tokens=min_tokens, rejected=[],
    )
    site_names = sorted({node.site for node in index.nodes.values()})
    for site in site_names:
        value = settings.carbon.get(site, settings.default_carbon_g_per_kwh)
        ctx.carbon[site] = carbon_intensity(value, settings.now_ts, settings.remaining_s, site)
    unknown = sorted(set(settings.carbon) - set(site_names))
    if unknown:
        raise PlacementError(
            f"carbon: site {unknown[0]!r} is not in the inventory (sites: {', '.join(site_names)})"
        )
    # references: the fastest type estimate and the least energy per step among usable types
    for spec in specs.values():
        if _type_reason(spec, allow, exclude, intent.dtype) is None:
            step = _est_step_s(intent, spec, n)
            ctx.step_ref = min(ctx.step_ref, step)
            ctx.energy_ref = min(ctx.energy_ref, n * spec.tdp_w * step)
    if not math.isfinite(ctx.step_ref):
        raise PlacementError(
            f"job {intent.job!r}: no GPU type in the inventory is allowed and supports {intent.dtype} "
            f"(types: {', '.join(sorted(specs))})"
        )
    ctx.carbon_ref = max(ctx.carbon.values()) or 1.0
    if current and ctx.current_step_s is None:
        ctx.current_step_s = _plan_on(ctx, sorted(current))[0]
    return ctx


def _type_reason(spec: GpuSpec, allow: set[str] | None, exclude: set[str], dtype: str) -> str | None:
    if allow is not None and spec.id not in allow:
        return "type not in constraints.gpu_types"
    if spec.id in exclude:
        return "type in constraints.exclude_gpu_types"
    if not spec.supports(dtype):
        return f"no {dtype} support in hardware"
    return None


def _pools(ctx: _Context) -> list[PoolModel]:
    intent, settings, index, tel = ctx.intent, ctx.settings, ctx.index, ctx.telemetry
    n, w, net = ctx.n, ctx.weights, settings.network
    allow, exclude = allowed_gpu_types(intent.constraints)
    sites = set(intent.constraints.sites) if intent.constraints.sites is not None else None
    # free GPUs per (site, type), in inventory order
    members: dict[tuple[str, str], list[tuple[str, int]]] = {}
    specs: dict[str, GpuSpec] = {}
    busy_count: Counter[tuple[str, str]] = Counter()
    for node in index.nodes.values():
        for slot in node.slots:
            pool = (node.site, slot.spec.id)
            specs[slot.spec.id] = slot.spec
            state = tel.get(slot.key)
            if state is not None and state.job is not None and state.job != intent.job:
                busy_count[pool] += 1
                continue
            members.setdefault(pool, []).append(slot.key)
    for pool in busy_count:
        members.setdefault(pool, [])
    out: list[PoolModel] = []
    share_cap = _cap(settings.max_rack_share, n)
    domain_cap = _cap(settings.max_domain_share or settings.max_rack_share, n)
    pairs = n * (n - 1) / 2.0
    for (site, gpu_id), keys in sorted(members.items()):
        spec = specs[gpu_id]

        def reject(reason: str, site: str = site, gpu_id: str = gpu_id) -> None:
            ctx.rejected.append({"site": site, "gpu_type": gpu_id, "reason": reason})

        reason = _type_reason(spec, allow, exclude, intent.dtype)
        if reason is None and sites is not None and site not in sites:
            reason = "site not in constraints.sites"
        if reason is not None:
            reject(reason)
            continue
        if len(keys) < n:
            reject(f"{len(keys)} free GPUs, the job needs {n}")
            continue
        usable = spec.memory_gb * 1e9 * (1.0 - intent.constraints.min_memory_headroom) - cost.RESERVED_BYTES
        mem_need = ctx.state_bytes / n
        if usable <= 0 or mem_need > usable:
            reject(f"memory: even fully sharded, model state needs {mem_need / 1e9:.1f} GB per GPU, "
                   f"{max(usable, 0) / 1e9:.1f} GB usable")
            continue
        step_est = _est_step_s(intent, spec, n)
        tokens_est = intent.global_batch * intent.sequence_length / step_est
        if ctx.min_tokens is not None and tokens_est < ctx.min_tokens:
            reject(f"throughput: at most {tokens_est:,.0f} tokens/s < floor {ctx.min_tokens:,.0f}")
            continue
        cross = ctx.current_site is not None and site != ctx.current_site
        transfer_all = ctx.state_bytes / (net.wan_gbs * 1e9) if cross else 0.0
        if cross:
            why = _cross_site_reason(ctx, step_est, transfer_all)
            if why is not None:
                reject(why)
                continue
        nodes = [index.nodes[k] for k in dict.fromkeys(k[0] for k in keys)]
        nic_min = min(nd.net_gbs_per_gpu for nd in nodes)
        # a move lands over the WAN, or in parallel over the chosen GPUs' NICs
        move_bw = net.wan_gbs * 1e9 if cross else n * nic_min * 1e9
        # raw terms: mean over pairs of (reference bandwidth / the pair's link bandwidth) and of
        # (the pair's link latency / the spine latency)
        comm_k = ctx.bw_ref / pairs if n > 1 else 0.0
        lat_k = 1.0 / (pairs * net.spine_latency_s) if n > 1 else 0.0

        def d(bw_gbs: float, lat: float, comm_k: float = comm_k, lat_k: float = lat_k) -> tuple[float, float]:
            return (comm_k / bw_gbs, lat_k * lat)

        group_d: dict[tuple[str, int], tuple[float, float]] = {}
        node_d: dict[str, tuple[float, float]] = {}
        rack_d: dict[str, tuple[float, float]] = {}
        rack_nic: dict[str, float] = {}
        for nd in nodes:
            node_d[nd.name] = d(nd.pcie_gbs, net.pcie_latency_s)
            for slot in nd.slots:
                if nd.nvlink_gbs > 0:
                    group_d[(nd.name, slot.nvlink_group)] = d(nd.nvlink_gbs, net.nvlink_latency_s)
                else:
                    group_d[(nd.name, slot.nvlink_group)] = node_d[nd.name]
            rack_nic[nd.rack] = min(rack_nic.get(nd.rack, math.inf), nd.net_gbs_per_gpu)
        for rack, nic in rack_nic.items():
            rack_d[rack] = d(nic, net.rack_latency_s)
        spine_d = d(nic_min / net.inter_rack_oversubscription, net.spine_latency_s)
        unit, load, heat, move = {}, {}, {}, {}
        state_share = ctx.state_bytes / n
        for key in keys:
            state = tel.get(key)
            # a GPU's load from this very job is not load against keeping it
            own = state is not None and state.job == intent.job
            load[key] = (state.util_pct or 0.0) / 100.0 if state is not None and not own else 0.0
            load[key] = min(1.0, max(0.0, load[key]))
            heat[key] = _heat(state, settings)
            move[key] = 0.0 if (not ctx.current or key in ctx.current) else state_share / move_bw
            if settings.remaining_s > 0:
                mv = move[key] / settings.remaining_s
            else:
                mv = math.inf if move[key] else 0.0
            unit[key] = (w["load"] * load[key] + w["thermal"] * heat[key]) / n + w["move"] * mv
        # rack caps: power budget (conservative in which GPUs are chosen) and the share
        rack_cap: dict[str, int] = {}
        in_rack: dict[str, list[tuple[str, int]]] = {}
        for key in keys:
            in_rack.setdefault(index.node_of(key).rack, []).append(key)
        for rack, rkeys in in_rack.items():
            cap = min(share_cap, len(rkeys))
            budget = index.rack_budget[rack]
            if budget is not None:
                cap = min(cap, _power_cap(index, rack, rkeys, spec, tel, intent.job, budget))
            rack_cap[rack] = cap
        out.append(PoolModel(
            site=site, spec=spec, n=n, keys=keys, unit=unit, load=load, heat=heat, move=move,
            group_d=group_d, node_d=node_d, rack_d=rack_d, spine_d=spine_d, rack_cap=rack_cap,
            domain_cap=domain_cap, share_cap=share_cap, weights=w, remaining_s=settings.remaining_s,
            step_est_s=step_est, mem_term=(mem_need + cost.RESERVED_BYTES) / (usable + cost.RESERVED_BYTES),
            tokens_est=tokens_est, cross_site=cross, transfer_all_s=transfer_all,
        ))
    return out


def _power_cap(
    index: FleetIndex, rack: str, rkeys: list[tuple[str, int]], spec: GpuSpec,
    tel: Mapping[tuple[str, int], GpuState], job: str, budget: float,
) -> int:
    """Most GPUs of this pool in ``rack`` whatever GPUs are picked: the rack's power now, plus
    TDP for each chosen GPU, minus the least power now of that many candidates."""
    now = rack_power_w(index, rack, (), tel, job)
    cur = sorted(_current_w(index.slot[k], tel.get(k), job) for k in rkeys)
    k, removed = 0, 0.0
    while k < len(cur) and now + (k + 1) * spec.tdp_w - (removed + cur[k]) <= budget + 1e-9:
        removed += cur[k]
        k += 1
    return k


def _cross_site_reason(ctx: _Context, step_s: float, transfer_s: float) -> str | None:
    """Why a move to another site does not pay (None: it does): the time saved over the job's
    remaining work must beat the transfer plus the restart."""
    cur = ctx.current_step_s
    if cur is None or not math.isfinite(cur):
        return "cross-site: the job's current step time is unknown"
    gain = ctx.settings.remaining_s * (1.0 - step_s / cur)
    pay = transfer_s + ctx.settings.restart_s
    if gain <= pay:
        return (f"cross-site move does not pay: saves {max(gain, 0.0):,.0f} s of the remaining "
                f"{ctx.settings.remaining_s:,.0f} s, costs {pay:,.0f} s (transfer {transfer_s:,.0f} s "
                f"+ restart {ctx.settings.restart_s:,.0f} s)")
    return None


# ---- exact GPU choice in a pool: min-plus DP over the topology tree -------------------------------


def _combine(
    children: list[np.ndarray], d: float, cap: int, kmax: int,
) -> tuple[np.ndarray, list[np.ndarray]]:
    """Cost of taking k GPUs below a tree node whose cross-child pairs cost ``d`` each:
    ``d C(k,2) + min over splits sum_c (f_c(k_c) - d C(k_c,2))`` (min-plus convolution)."""
    acc = np.zeros(1)
    choices: list[np.ndarray] = []
    for f in children:
        j = np.arange(len(f), dtype=float)
        g = f - d * j * (j - 1) / 2.0
        size = min(len(acc) + len(f) - 1, kmax + 1)
        out = np.full(size, np.inf)
        arg = np.zeros(size, dtype=np.int64)
        for jj in range(min(len(f), size)):
            if not np.isfinite(g[jj]):
                continue
            seg = acc[: size - jj] + g[jj]
            view = out[jj : jj + len(seg)]
            better = seg < view
            view[better] = seg[better]
            arg[jj : jj + len(seg)][better] = jj
        acc = out
        choices.append(arg)
    k = np.arange(len(acc), dtype=float)
    acc = acc + d * k * (k - 1) / 2.0
    if cap + 1 < len(acc):
        acc = acc[: cap + 1]
    return acc, choices


def choose_gpus(pool: PoolModel, index: FleetIndex) -> tuple[float, list[tuple[str, int]]]:
    """The N GPUs of ``pool`` with the least selection cost (per-GPU terms + pair terms) under
    the rack and power-domain caps; (inf, []) when no choice satisfies them. Exact."""
    n, w = pool.n, pool.weights

    def wd(pair: tuple[float, float]) -> float:
        return w["comm"] * pair[0] + w["latency"] * pair[1]

    tree: dict[str, dict[str, dict[str, dict[int, list[tuple[str, int]]]]]] = {}
    for key in pool.keys:
        nd = index.node_of(key)
        tree.setdefault(nd.domain, {}).setdefault(nd.rack, {}).setdefault(nd.name, {}).setdefault(
            index.slot[key].nvlink_group, []).append(key)
    dom_arrays, dom_trace = [], []
    for dom in sorted(tree):
        rack_arrays, rack_trace = [], []
        for rack in sorted(tree[dom]):
            cap = pool.rack_cap[rack]
            node_arrays, node_trace = [], []
            for node in sorted(tree[dom][rack]):
                grp_arrays, grp_trace = [], []
                for grp in sorted(tree[dom][rack][node]):
                    gkeys = sorted(tree[dom][rack][node][grp], key=lambda k: (pool.unit[k], k))[: min(n, cap)]
                    k = np.arange(len(gkeys) + 1, dtype=float)
                    f = np.concatenate([[0.0], np.cumsum([pool.unit[x] for x in gkeys])])
                    f = f + wd(pool.group_d[(node, grp)]) * k * (k - 1) / 2.0
                    grp_arrays.append(f)
                    grp_trace.append(gkeys)
                f, ch = _combine(grp_arrays, wd(pool.node_d[node]), cap, n)
                node_arrays.append(f)
                node_trace.append((grp_trace, ch))
            f, ch = _combine(node_arrays, wd(pool.rack_d[rack]), cap, n)
            rack_arrays.append(f)
            rack_trace.append((node_trace, ch))
        f, ch = _combine(rack_arrays, wd(pool.spine_d), pool.domain_cap, n)
        dom_arrays.append(f)
        dom_trace.append((rack_trace, ch))
    f, ch = _combine(dom_arrays, wd(pool.spine_d), n, n)
    if len(f) <= n or not np.isfinite(f[n]):
        return math.inf, []
    chosen: list[tuple[str, int]] = []

    def split(k: int, choices: list[np.ndarray]) -> list[int]:
        takes = [0] * len(choices)
        for i in range(len(choices) - 1, -1, -1):
            takes[i] = int(choices[i][k]) if k < len(choices[i]) else 0
            k -= takes[i]
        return takes

    for (rack_trace, rch), kd in zip(dom_trace, split(n, ch), strict=True):
        if not kd:
            continue
        for (node_trace, nch), kr in zip(rack_trace, split(kd, rch), strict=True):
            if not kr:
                continue
            for (grp_trace, gch), kn in zip(node_trace, split(kr, nch), strict=True):
                if not kn:
                    continue
                for gkeys, kg in zip(grp_trace, split(kn, gch), strict=True):
                    chosen.extend(gkeys[:kg])
    return float(f[n]), sorted(chosen)


def selection_cost(pool: PoolModel, chosen: Sequence[tuple[str, int]], index: FleetIndex) -> float:
    """The selection cost of a given choice, term by term (what ``choose_gpus`` minimises)."""
    total = sum(pool.unit[k] for k in chosen)
    for i, a in enumerate(chosen):
        for b in chosen[i + 1:]:
            total += pool.pair_cost(a, b, index)
    return total


def _comm_terms(pool: PoolModel, chosen: Sequence[tuple[str, int]], index: FleetIndex) -> tuple[float, float]:
    """Raw comm and latency terms of a choice, summed over pairs by their shared level."""
    # pairs per level from group/node/rack counts (not N^2 pairs)
    groups = Counter((k[0], index.slot[k].nvlink_group) for k in chosen)
    nodes = Counter(k[0] for k in chosen)
    racks = Counter(index.node_of(k).rack for k in chosen)
    n = len(chosen)

    def c2(x: int) -> int:
        return x * (x - 1) // 2

    comm = lat = 0.0
    g_pairs: Counter[str] = Counter()
    for (node, grp), cnt in groups.items():
        dc, dl = pool.group_d[(node, grp)]
        comm += c2(cnt) * dc
        lat += c2(cnt) * dl
        g_pairs[node] += c2(cnt)
    r_pairs: Counter[str] = Counter()
    for node, cnt in nodes.items():
        dc, dl = pool.node_d[node]
        comm += (c2(cnt) - g_pairs[node]) * dc
        lat += (c2(cnt) - g_pairs[node]) * dl
        r_pairs[index.nodes[node].rack] += c2(cnt)
    inside = 0
    for rack, cnt in racks.items():
        dc, dl = pool.rack_d[rack]
        comm += (c2(cnt) - r_pairs[rack]) * dc
        lat += (c2(cnt) - r_pairs[rack]) * dl
        inside += c2(cnt)
    dc, dl = pool.spine_d
    comm += (c2(n) - inside) * dc
    lat += (c2(n) - inside) * dl
    return comm, lat


# ---- planning and ranking ------------------------------------------------------------------------


@dataclass
class PlacementOption:
    """One ranked destination: the pool, the chosen GPUs, every cost term and the total."""

    rank: int
    site: str
    gpu_type: str
    gpus: list[tuple[str, int]]
    terms: dict[str, float]  # raw, dimensionless (docs/placement.md)
    weighted: dict[str, float]  # terms x weights
    total: float
    step_s: float
    step_source: str  # "planner" or "estimate" (a lower bound of the planner's)
    tokens_per_s: float
    nodes: int
    racks: dict[str, int]  # GPUs of the job per rack
    rack_power: dict[str, tuple[float, float | None]]  # rack -> (GPU power under the plan W, budget W)
    max_rack_share: float
    cross_site: bool
    transfer_s: float
    gco2_per_hour: float
    plan: Plan | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpus"] = [f"{n}/{g}" for n, g in self.gpus]
        out["rack_power"] = {r: {"power_w": p, "budget_w": b} for r, (p, b) in self.rack_power.items()}
        out["plan"] = None if self.plan is None else {
            "tp": self.plan.tp, "pp": self.plan.pp, "dp": self.plan.dp, "zero_stage": self.plan.zero_stage,
            "recompute": self.plan.recompute, "predicted_step_s": self.plan.predicted_step_s,
            "mfu": self.plan.mfu,
        }
        return out


@dataclass
class PlacementResult:
    """Ranked options (best first) and the pools that could not hold the job."""

    job: str
    gpus: int
    preset: str
    weights: dict[str, float]
    options: list[PlacementOption]
    rejected: list[dict[str, str]]
    planned: int  # pools ranked with the planner's step
    planner_runs: int  # planner runs (identical GPU sets are planned once)
    optimal: bool  # True: no unplanned pool's lower bound beats the first option
    references: dict[str, float]
    current_site: str | None = None
    current_step_s: float | None = None

    @property
    def best(self) -> PlacementOption | None:
        return self.options[0] if self.options else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job, "gpus": self.gpus, "preset": self.preset, "weights": self.weights,
            "planned": self.planned, "planner_runs": self.planner_runs, "optimal": self.optimal,
            "references": self.references,
            "current_site": self.current_site, "current_step_s": self.current_step_s,
            "options": [o.to_dict() for o in self.options], "rejected": self.rejected,
        }


def _plan_on(ctx: _Context, keys: Sequence[tuple[str, int]]) -> tuple[float | None, Plan | None, str]:
    """The planner's step on exactly these GPUs: (step, plan, '') or (None, None, why)."""
    index, intent = ctx.index, ctx.intent
    cl = index.cluster
    nodes = {k[0] for k in keys}
    sub = Cluster(
        slots=[index.slot[k] for k in keys],
        node_network_gbs={n: cl.node_network_gbs[n] for n in nodes if n in cl.node_network_gbs},
        node_nvlink_gbs={n: cl.node_nvlink_gbs[n] for n in nodes if n in cl.node_nvlink_gbs},
        node_pcie_gbs={n: cl.node_pcie_gbs[n] for n in nodes if n in cl.node_pcie_gbs},
        default_network_gbs=cl.default_network_gbs,
    )
    request = request_for_intent(intent)
    try:
        plan = plan_job(request, sub)
    except InfeasiblePlanError as exc:
        return None, None, f"planner: {exc}"
    except ValueError as exc:
        return None, None, f"planner: {exc}"
    return plan.predicted_step_s, plan, ""


@dataclass
class _Scored:
    pool: PoolModel
    chosen: list[tuple[str, int]]
    sel: float
    est_total: float


def _plan_signature(index: FleetIndex, pool: PoolModel, chosen: Sequence[tuple[str, int]]) -> tuple:
    """What the planner's step depends on: the GPU type and, node by node in name order, the
    node's links and its chosen GPUs per NVLink group (identical signatures plan identically)."""
    per_node: dict[str, Counter[int]] = {}
    for key in chosen:
        per_node.setdefault(key[0], Counter())[index.slot[key].nvlink_group] += 1
    cl = index.cluster
    return (pool.spec.id, tuple(
        (cl.network_gbs(node), cl.nvlink_gbs(node, pool.spec), cl.pcie_gbs(node, pool.spec),
         tuple(per_node[node][g] for g in sorted(per_node[node])))
        for node in sorted(per_node)
    ))


def _fixed_terms(ctx: _Context, pool: PoolModel, step_s: float) -> dict[str, float]:
    energy = ctx.n * pool.spec.tdp_w * step_s
    return {
        "compute": step_s / ctx.step_ref,
        "memory": pool.mem_term,
        "carbon": energy * ctx.carbon[pool.site] / (ctx.energy_ref * ctx.carbon_ref),
    }


def _weighted_fixed(ctx: _Context, pool: PoolModel, step_s: float) -> float:
    return sum(ctx.weights[t] * v for t, v in _fixed_terms(ctx, pool, step_s).items())


def place_job(
    intent: JobIntent, inventory: FleetIndex | Sequence[NodeInventory],
    telemetry: Mapping[tuple[str, int], GpuState] | None = None, settings: PlacementSettings | None = None,
) -> PlacementResult:
    """Rank the pools that can hold ``intent`` (best first) with every cost term.

    Raises ``PlacementError`` for invalid input (naming the field) and when the inventory has
    no usable GPU type at all; pools that cannot hold the job are listed in ``rejected``.
    """
    settings = settings or PlacementSettings()
    index = inventory if isinstance(inventory, FleetIndex) else FleetIndex(inventory)
    ctx = _context(intent, index, telemetry or {}, settings)
    scored: list[_Scored] = []
    for pool in _pools(ctx):
        sel, chosen = choose_gpus(pool, index)
        if not chosen:
            ctx.rejected.append({"site": pool.site, "gpu_type": pool.spec.id, "reason": (
                f"no {pool.n} GPUs fit the rack power budgets and failure-domain shares "
                f"(<= {pool.share_cap} per rack, <= {pool.domain_cap} per power domain)")})
            continue
        scored.append(_Scored(pool, chosen, sel, sel + _weighted_fixed(ctx, pool, pool.step_est_s)))
    scored.sort(key=lambda s: (s.est_total, s.pool.site, s.pool.spec.id))
    # Branch and bound in order of the lower bound: a pool's planned total is >= its estimated
    # total, so once the next estimate cannot beat the best planned total, no pool can.
    options: list[PlacementOption] = []
    best = math.inf
    evaluated = runs = 0
    optimal = True
    cache: dict[tuple, tuple[float | None, Plan | None, str]] = {}
    unplanned: list[_Scored] = []
    for i, s in enumerate(scored):
        if evaluated >= settings.min_planned and s.est_total >= best:
            unplanned = scored[i:]
            break
        sig = _plan_signature(index, s.pool, s.chosen)
        if sig not in cache:
            if runs >= settings.max_planned:
                optimal = s.est_total >= best
                unplanned = scored[i:]
                break
            runs += 1
            cache[sig] = _plan_on(ctx, s.chosen)
        evaluated += 1
        step, plan, why = cache[sig]
        if step is None:
            ctx.rejected.append({"site": s.pool.site, "gpu_type": s.pool.spec.id, "reason": why})
            continue
        if plan is not None and not {(r.node, r.gpu) for r in plan.ranks} <= set(s.chosen):
            plan = None  # planned on an identical set of other GPUs: same step, other names
        tokens = intent.global_batch * intent.sequence_length / step
        if ctx.min_tokens is not None and tokens < ctx.min_tokens:
            ctx.rejected.append({"site": s.pool.site, "gpu_type": s.pool.spec.id, "reason": (
                f"throughput: planned {tokens:,.0f} tokens/s < floor {ctx.min_tokens:,.0f}")})
            continue
        if s.pool.cross_site:
            why2 = _cross_site_reason(ctx, step, s.pool.transfer_all_s)
            if why2 is not None:
                ctx.rejected.append({"site": s.pool.site, "gpu_type": s.pool.spec.id, "reason": why2})
                continue
        opt = _option(ctx, s, step, plan, planned=True)
        best = min(best, opt.total)
        options.append(opt)
    for s in unplanned:
        options.append(_option(ctx, s, s.pool.step_est_s, None, planned=False))
    options.sort(key=lambda o: (o.total, o.step_source != "planner", o.site, o.gpu_type))
    for rank, opt in enumerate(options, start=1):
        opt.rank = rank
    if options and options[0].step_source == "planner" and options[0].plan is None:
        options[0].plan = _plan_on(ctx, options[0].gpus)[1]  # the envelope needs its own plan
        runs += 1
    return PlacementResult(
        job=intent.job, gpus=ctx.n, preset=ctx.preset, weights=dict(ctx.weights), options=options,
        rejected=ctx.rejected, planned=evaluated, planner_runs=runs, optimal=optimal,
        references={"step_ref_s": ctx.step_ref, "energy_ref_j": ctx.energy_ref,
                    "carbon_ref_g_per_kwh": ctx.carbon_ref},
        current_site=ctx.current_site, current_step_s=ctx.current_step_s,
    )


def _option(ctx: _Context, s: _Scored, step: float, plan: Plan | None, planned: bool) -> PlacementOption:
    pool, chosen, index, n = s.pool, s.chosen, ctx.index, ctx.n
    comm, lat = _comm_terms(pool, chosen, index)
    moved_s = sum(pool.move[k] for k in chosen)
    terms = {
        **_fixed_terms(ctx, pool, step),
        "load": sum(pool.load[k] for k in chosen) / n,
        "comm": comm,
        "latency": lat,
        "thermal": sum(pool.heat[k] for k in chosen) / n,
        "move": moved_s / pool.remaining_s if pool.remaining_s > 0 else (math.inf if moved_s else 0.0),
    }
    terms = {t: terms[t] for t in TERMS}
    weighted = {t: ctx.weights[t] * v for t, v in terms.items()}
    racks = Counter(index.node_of(k).rack for k in chosen)
    power = {r: (rack_power_w(index, r, chosen, ctx.telemetry, ctx.intent.job), index.rack_budget[r])
             for r in sorted(racks)}
    notes = []
    if not planned:
        notes.append("not planned: its lower bound cannot beat the first option")
    elif plan is not None and len(plan.ranks) < n:
        notes.append(f"the planner's fastest split uses {len(plan.ranks)} of the {n} GPUs")
    return PlacementOption(
        rank=0, site=pool.site, gpu_type=pool.spec.id, gpus=list(chosen), terms=terms, weighted=weighted,
        total=sum(weighted.values()), step_s=step, step_source="planner" if planned else "estimate",
        tokens_per_s=ctx.intent.global_batch * ctx.intent.sequence_length / step,
        nodes=len({k[0] for k in chosen}), racks=dict(sorted(racks.items())), rack_power=power,
        max_rack_share=max(racks.values()) / n, cross_site=pool.cross_site,
        transfer_s=moved_s, gco2_per_hour=n * pool.spec.tdp_w / 1000.0 * ctx.carbon[pool.site],
        plan=plan, notes=notes,
    )


# ---- outputs -------------------------------------------------------------------------------------


def placement_envelope(
    option: PlacementOption, job: str, queue: str, gpus_per_pod: int | None = None,
    namespace: str | None = None,
) -> dict[str, Any]:
    """The KAI envelope of the planner (``exports.kai_envelope``) for a planned option, with
    the placement: each pod template may only land on the option's nodes (node affinity on
    ``kubernetes.io/hostname``), and a ``placement`` block (site, racks, GPUs per node)."""
    from fleetwise.planner.exports import kai_envelope

    if option.plan is None:
        raise PlacementError(f"option {option.rank} ({option.site}/{option.gpu_type}) was not planned; "
                             "only planned options have an envelope")
    env = kai_envelope(option.plan, job, queue, gpus_per_pod=gpus_per_pod, namespace=namespace)
    nodes_of: dict[str, list[str]] = {}
    for r in option.plan.ranks:
        nodes_of.setdefault(r.model, [])
        if r.node not in nodes_of[r.model]:
            nodes_of[r.model].append(r.node)
    for tmpl in env["pod_templates"]:
        hosts = sorted(nodes_of[tmpl["gpu_model"]])
        match = {"key": "kubernetes.io/hostname", "operator": "In", "values": hosts}
        tmpl["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [match]}]}}}
    per_node = Counter(k[0] for k in option.gpus)
    env["placement"] = {
        "site": option.site, "gpu_type": option.gpu_type, "racks": option.racks,
        "gpus_per_node": dict(sorted(per_node.items())), "total_cost": option.total,
    }
    return env


def placement_table(result: PlacementResult, top: int | None = None) -> Any:
    """A rich Table of the ranked options (one row each, every term weighted, then the total)."""
    from rich.table import Table

    table = Table(title=f"placement of {result.job} on {result.gpus} GPUs (weights: {result.preset})")
    for col in ("#", "site", "GPU", "nodes", "racks", "step s", "tokens/s", *TERMS, "total"):
        table.add_column(col, justify="left" if col in ("site", "GPU") else "right")
    for opt in result.options[: top or None]:
        step = f"{opt.step_s:.3g}" + ("" if opt.step_source == "planner" else "*")
        table.add_row(
            str(opt.rank), opt.site, opt.gpu_type, str(opt.nodes), str(len(opt.racks)), step,
            f"{opt.tokens_per_s:,.0f}", *(f"{opt.weighted[t]:.3f}" for t in TERMS), f"{opt.total:.3f}",
        )
    return table

