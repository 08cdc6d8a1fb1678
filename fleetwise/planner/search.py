"""Search for a data/tensor/pipeline split of a job over a (mixed) set of GPUs.

How it works (docs/planner.md has the details):

1. GPUs are grouped into *kinds* (catalog id x measured speed x node links); tensor-parallel
   groups of ``tp`` identical GPUs are formed inside each NVLink domain.
2. TP groups are ordered (most memory, then fastest first) and laid out as a ``dp x pp``
   matrix, either *grouped* (each pipeline takes consecutive groups: pipelines are
   homogeneous where the counts allow, replicas differ) or *striped* (pipeline j takes groups
   j, j + dp, ...: all pipelines alike, stages differ).
3. Identical pipelines form a *class*; costs are computed per class and stage with numpy,
   so 10,000 GPUs cost about as much as 100.
4. One layer layout (layers per stage, shared by all replicas as Megatron-LM and DeepSpeed
   require) is chosen by a greedy min-max under per-stage memory caps; then the global batch,
   in micro-batches, is split over replicas min-max (exact integer sum).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from fleetwise.catalog import UnsupportedDtypeError, normalize_dtype
from fleetwise.planner import cost
from fleetwise.planner.cluster import Cluster, GpuSlot
from fleetwise.schemas import JobConstraints, JobIntent, ModelShape, Plan, RankPlan

ARRANGEMENTS = ("grouped", "striped")


class InfeasiblePlanError(ValueError):
    """No split of the job fits in the GPUs' memory (or the cluster cannot run it at all)."""

    def __init__(self, message: str, needs: dict[str, tuple[float, float, float]] | None = None) -> None:
        super().__init__(message)
        # per catalog id: (needed GB, usable GB, capacity GB) for the closest candidate
        self.needs = needs or {}


@dataclass
class PlanRequest:
    """What to plan: the model, the batch and the knobs the caller fixes."""

    model: ModelShape
    global_batch: int
    seq_len: int | None = None  # None: the model's seq_len
    dtype: str = "bf16"
    strategy: tuple[int, int, int] | None = None  # (tp, pp, dp) to evaluate instead of searching
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    recompute: str = "auto"  # auto | none | selective | full
    job: str = "job"
    exhaustive: bool = False
    micro_batch: int | None = None  # fix the micro-batch size instead of searching it
    memory_headroom: float = cost.DEFAULT_MEMORY_HEADROOM
    constraints: JobConstraints | None = None  # carried into the plan (growth to max_gpus)

    @property
    def seq(self) -> int:
        return self.seq_len or self.model.seq_len


def request_for_intent(intent: JobIntent) -> PlanRequest:
    """What the planner is asked for a job intent (its model, batch, dtype and constraints)."""
    c = intent.constraints
    return PlanRequest(
        model=intent.model, global_batch=intent.global_batch, seq_len=intent.seq_len, dtype=intent.dtype,
        zero_stages=tuple(c.zero_stages) if c.zero_stages else (0, 1, 2, 3), job=intent.job,
        memory_headroom=c.min_memory_headroom, constraints=c,
    )


def request_for_plan(plan: Plan) -> PlanRequest:
    """What the planner is asked to re-plan a running plan (its model preset, batch, dtype and
    the intent's constraints it carries). Raises ValueError for a model no preset names."""
    from fleetwise.planner.models import resolve_model

    c = plan.constraints
    return PlanRequest(
        model=resolve_model(plan.model), global_batch=plan.global_batch, seq_len=plan.seq_len,
        dtype=plan.dtype, job=plan.job, constraints=c,
        zero_stages=tuple(c.zero_stages) if c and c.zero_stages else (0, 1, 2, 3),
        memory_headroom=c.min_memory_headroom if c else cost.DEFAULT_MEMORY_HEADROOM,
    )


# ---- kinds and TP groups ------------------------------------------------------------------


@dataclass
class Kinds:
    """Distinct GPU kinds of a cluster, as parallel numpy arrays (index = kind id)."""

    ids: list[str]
    cap_tflops: np.ndarray  # TFLOPS on large GEMMs (catalog capability x MFU_TO_COMPUTE x speed)
    peak_tflops: np.ndarray  # dense peak x speed (for MFU)
    usable_bytes: np.ndarray
    capacity_gb: np.ndarray
    membw: np.ndarray  # bytes/s
    nvlink_bw: np.ndarray  # GB/s per direction reached by a collective (0: no NVLink)
    pcie_bw: np.ndarray
    net_bw: np.ndarray  # node NIC GB/s reached by a collective
    node_gpus: np.ndarray  # GPUs on a node of this kind
    order: np.ndarray  # rank of the kind in layout order (0 first)


@dataclass
class TpGroups:
    """The TP groups for one ``tp``, in layout order."""

    kind: np.ndarray  # (n,) kind id per group
    node: np.ndarray  # (n,) node index per group
    slots: list[tuple[GpuSlot, ...]]


class _Fleet:
    """A cluster reduced to kinds, with TP groups per tp size (cached)."""

    def __init__(self, cluster: Cluster, dtype: str, headroom: float) -> None:
        self.cluster = cluster
        self.dtype = dtype
        self.notes: list[str] = []
        usable = []
        skipped: dict[str, int] = {}
        for slot in cluster.slots:
            if slot.spec.supports(dtype):
                usable.append(slot)
            else:
                skipped[slot.spec.id] = skipped.get(slot.spec.id, 0) + 1
        for gpu_id, n in sorted(skipped.items()):
            self.notes.append(f"{n} x {gpu_id} left out: no {dtype} support in hardware")
        if not usable:
            raise InfeasiblePlanError(
                f"no GPU in the cluster supports {dtype}; "
                + ", ".join(f"{k}: {v}" for k, v in sorted(skipped.items()))
            )
        node_count: dict[str, int] = {}
        for slot in usable:
            node_count[slot.node] = node_count.get(slot.node, 0) + 1
        self.node_names = sorted(node_count)
        node_index = {n: i for i, n in enumerate(self.node_names)}
        key_of: dict[tuple, int] = {}
        rows: list[tuple] = []
        self.slot_kind: dict[tuple[str, int], int] = {}
        for slot in usable:
            spec = slot.spec
            key = (
                spec.id, round(slot.speed, 6), cluster.network_gbs(slot.node),
                node_count[slot.node], cluster.nvlink_gbs(slot.node, spec), cluster.pcie_gbs(slot.node, spec),
            )
            if key not in key_of:
                key_of[key] = len(rows)
                rows.append(key)
            self.slot_kind[slot.key] = key_of[key]
        specs = {s.spec.id: s.spec for s in usable}
        # the catalog's end-to-end MFU becomes a large-GEMM compute efficiency (cost.py,
        # MFU_TO_COMPUTE); the GEMM-size factor is applied per candidate (tp, micro-batch)
        cap = np.array([specs[r[0]].capability_tflops(dtype) * cost.MFU_TO_COMPUTE * r[1] for r in rows])
        mem = np.array([specs[r[0]].memory_gb for r in rows])
        # layout order: most memory first (early stages hold more micro-batches in flight),
        # then fastest, then name and speed so that the order is deterministic
        order_keys = sorted(range(len(rows)), key=lambda k: (-mem[k], -cap[k], rows[k][0], -rows[k][1], k))
        order = np.empty(len(rows), dtype=np.int64)
        order[order_keys] = np.arange(len(rows))
        eff = cost.COLLECTIVE_EFFICIENCY
        self.kinds = Kinds(
            ids=[r[0] for r in rows],
            cap_tflops=cap,
            peak_tflops=np.array([specs[r[0]].peak(dtype) * r[1] for r in rows]),
            usable_bytes=mem * 1e9 * (1.0 - headroom) - cost.RESERVED_BYTES,
            capacity_gb=mem,
            membw=np.array([specs[r[0]].memory_bw_bytes_s for r in rows]),
            nvlink_bw=np.array([r[4] / 2.0 * eff for r in rows]),  # datasheets quote both directions
            pcie_bw=np.array([r[5] * eff for r in rows]),
            net_bw=np.array([r[2] * eff for r in rows]),
            node_gpus=np.array([r[3] for r in rows], dtype=np.int64),
            order=order,
        )
        self.usable = usable
        self.node_index = node_index
        self._groups: dict[int, TpGroups] = {}

    def groups(self, tp: int) -> TpGroups:
        if tp in self._groups:
            return self._groups[tp]
        buckets: dict[tuple[str, int, int], list[GpuSlot]] = {}
        for slot in self.usable:
            if tp > 1 and self.cluster.nvlink_gbs(slot.node, slot.spec) <= 0:
                continue  # TP only inside an NVLink domain
            buckets.setdefault((slot.node, slot.nvlink_group, self.slot_kind[slot.key]), []).append(slot)
        entries = []
        for (node, _, kind), members in buckets.items():
            members.sort(key=lambda s: s.gpu)
            for i in range(len(members) // tp):
                chunk = tuple(members[i * tp : (i + 1) * tp])
                entries.append((int(self.kinds.order[kind]), node, chunk[0].gpu, kind, chunk))
        entries.sort(key=lambda e: e[:3])
        groups = TpGroups(
            kind=np.array([e[3] for e in entries], dtype=np.int64),
            node=np.array([self.node_index[e[1]] for e in entries], dtype=np.int64),
            slots=[e[4] for e in entries],
        )
        self._groups[tp] = groups
        return groups


# ---- one candidate ------------------------------------------------------------------------


@dataclass
class Layout:
    """Which TP groups form which replica and stage: ``index[r, i]`` into ``TpGroups``."""

    tp: int
    pp: int
    dp: int
    arrangement: str
    index: np.ndarray  # (dp, pp) group positions


@dataclass
class Evaluation:
    """The cost model's verdict on one candidate."""

    feasible: bool
    step_s: float = math.inf
    layers: list[int] = field(default_factory=list)  # layers per stage
    per_class: list[tuple[int, int]] | None = None  # micro-batches per class: (base, extra)
    worst_ratio: float = math.inf  # max need / usable over GPUs (for infeasible candidates)
    needs: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    need_arrays: tuple[np.ndarray, np.ndarray] | None = None  # (kinds, bytes) per class and stage
    pipeline_s: float = 0.0
    dp_comm_s: float = 0.0
    optimizer_s: float = 0.0


@dataclass
class _Classes:
    kinds: np.ndarray  # (C, pp) kind per class and stage
    same_node: np.ndarray  # (C,) the whole pipeline is on one node
    inverse: np.ndarray  # (dp,) class of each replica
    counts: np.ndarray  # (C,) replicas per class
    kinds_full: np.ndarray  # (dp, pp)
    nodes_full: np.ndarray  # (dp, pp)

    @property
    def single_node(self) -> bool:
        return bool(np.all(self.nodes_full == self.nodes_full.flat[0]))


@dataclass
class Candidate:
    layout: Layout
    micro_batch: int
    zero_stage: int
    recompute: str
    result: Evaluation


def _arrange(groups: TpGroups, pp: int, dp: int, arrangement: str) -> np.ndarray:
    n = pp * dp
    if arrangement == "grouped":
        return np.arange(n, dtype=np.int64).reshape(dp, pp)
    return np.arange(n, dtype=np.int64).reshape(pp, dp).T.copy()


class _Evaluator:
    """Evaluates candidates for one request on one fleet."""

    def __init__(self, request: PlanRequest, fleet: _Fleet) -> None:
        self.req = request
        self.fleet = fleet
        m = request.model
        s = request.seq
        self.L = m.layers
        self.s = s
        self.act_bytes = cost.ACT_BYTES[fleet.dtype]
        self.layer_params = cost.layer_params(m)
        self.embed_params = cost.embedding_params(m, s)
        self.layer_fwd = cost.layer_forward_flops(m, s)
        self.logits_fwd = cost.logits_forward_flops(m, s)
        self.hidden = m.hidden
        self.lazy_needs = False  # the search fills ``needs`` only for the candidate it reports
        self._gemm_eff: dict[tuple[int, int], tuple[float, float]] = {}

    def gemm_eff(self, tp: int, b: int) -> tuple[float, float]:
        """GEMM-size efficiency (layers, logit layer) of one TP rank at micro-batch ``b``."""
        key = (tp, b)
        if key not in self._gemm_eff:
            m = self.req.model
            self._gemm_eff[key] = (
                cost.layer_gemm_efficiency(m, self.s, b, tp), cost.logits_gemm_efficiency(m, self.s, b, tp),
            )
        return self._gemm_eff[key]

    # -- per class and stage costs --
    def stage_arrays(
        self, kinds_mat: np.ndarray, same_node: np.ndarray, tp: int, b: int, z: int, rc: str, dp: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per (class, stage): seconds per layer, fixed seconds, bytes per layer, fixed bytes.

        All per micro-batch; memory assumes 1F1B with ``pp - i`` micro-batches in flight.
        """
        K = self.fleet.kinds
        m = self.req.model
        C, pp = kinds_mat.shape
        cap = K.cap_tflops[kinds_mat] * 1e12  # (C, pp)
        sp = tp > 1
        layer_flops = self.layer_fwd * b * cost.recompute_flops_factor(m, self.s, rc) / tp
        f_layer, f_logits = self.gemm_eff(tp, b)
        per_layer_s = layer_flops / (cap * f_layer)
        # memory-bound element-wise ops (layer norms, activations, dropout, softmax) at HBM speed
        mem_bytes = cost.layer_elementwise_step_bytes(m, self.s, b, tp, rc, sp, self.act_bytes)
        per_layer_s = per_layer_s + mem_bytes / (K.membw[kinds_mat] * cost.HBM_EFFICIENCY)
        if tp > 1:
            msg = b * self.s * self.hidden * self.act_bytes
            tp_s = cost.tp_collectives_per_layer(rc) * cost.ring_allreduce_s(msg, tp, 1.0)
            per_layer_s = per_layer_s + tp_s / K.nvlink_bw[kinds_mat]
        fixed_s = np.zeros((C, pp))
        fixed_s[:, -1] += 3.0 * self.logits_fwd * b / tp / (cap[:, -1] * f_logits)
        if pp > 1:
            # activations forward and their gradients backward, scatter/gather over the TP ranks
            p2p_bytes = 2.0 * b * self.s * self.hidden * self.act_bytes / tp
            k_send = kinds_mat[:, :-1]
            inside = np.where(K.nvlink_bw[k_send] > 0, K.nvlink_bw[k_send], K.pcie_bw[k_send])
            between = K.net_bw[k_send] / K.node_gpus[k_send]
            bw = np.where(same_node[:, None], inside, between)
            fixed_s[:, :-1] += p2p_bytes / (bw * cost.GB)
        bpp = cost.state_bytes_per_param(z, dp)
        in_flight = (pp - np.arange(pp)).astype(float)  # 1F1B: stage i holds pp - i micro-batches
        act = cost.activation_bytes_per_layer(m, self.s, b, tp, rc, sp, self.act_bytes)
        per_layer_b = self.layer_params / tp * bpp + in_flight * act  # (pp,)
        per_layer_b = np.broadcast_to(per_layer_b, (C, pp))
        fixed_b = np.zeros(pp)
        if pp == 1:
            fixed_b[0] += self.embed_params / tp * bpp
        else:
            fixed_b[0] += self.embed_params / tp * bpp
            fixed_b[-1] += self.req.model.vocab * self.hidden / tp * bpp  # tied output copy
        fixed_b[-1] += cost.logits_activation_bytes(m, self.s, b, tp)
        if rc == "full":  # the layer being recomputed holds its full activations
            fixed_b += cost.activation_bytes_per_layer(m, self.s, b, tp, "none", sp, self.act_bytes)
        if z == 3:  # gathered bf16 weights of the current and the prefetched layer
            fixed_b += 2 * 2.0 * self.layer_params / tp
        fixed_b = np.broadcast_to(fixed_b, (C, pp))
        return per_layer_s, fixed_s, per_layer_b, fixed_b

    def classes(self, layout: Layout, groups: TpGroups) -> _Classes:
        """Identical pipelines (same kinds per stage, same node or not) grouped into classes."""
        pp = layout.pp
        kinds_full = groups.kind[layout.index]  # (dp, pp)
        nodes_full = groups.node[layout.index]
        same = (nodes_full == nodes_full[:, :1]).all(axis=1)
        key = np.concatenate([kinds_full, same[:, None].astype(np.int64)], axis=1)
        uniq, inverse, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
        return _Classes(
            kinds=uniq[:, :pp], same_node=uniq[:, pp].astype(bool), inverse=inverse.reshape(-1),
            counts=counts, kinds_full=kinds_full, nodes_full=nodes_full,
        )

    def evaluate(
        self, layout: Layout, cls: _Classes, b: int, z: int, rc: str,
        fixed_layers: list[int] | None = None, fixed_micro: np.ndarray | None = None,
        even: bool = False,
    ) -> Evaluation:
        """Step time of one candidate (or why it does not fit)."""
        K = self.fleet.kinds
        tp, pp, dp = layout.tp, layout.pp, layout.dp
        n_micro = self.req.global_batch // b
        kinds_mat, counts, inverse = cls.kinds, cls.counts, cls.inverse
        ps, fs, pb, fb = self.stage_arrays(kinds_mat, cls.same_node, tp, b, z, rc, dp)
        usable = K.usable_bytes[kinds_mat]
        caps = np.floor((usable - fb) / pb).astype(np.int64)
        common_caps = caps.min(axis=0)
        L = self.L
        if fixed_layers is not None:
            candidates = [list(fixed_layers)]
        elif even:
            candidates = [_even_split(L, pp)]
        else:
            candidates = []
            if common_caps.min() >= 1 and common_caps.sum() >= L:
                for c in np.argsort(-counts, kind="stable")[:3]:
                    lay = _minmax_layers(ps[c], fs[c], common_caps, L)
                    if lay is not None and lay not in candidates:
                        candidates.append(lay)
                if len(counts) > 1:
                    # all replicas together: stage i's aggregate speed over the classes
                    speed = (counts[:, None] / ps).sum(axis=0)
                    lay = _minmax_layers(1.0 / speed, np.zeros(pp), common_caps, L)
                    if lay is not None and lay not in candidates:
                        candidates.append(lay)
            ev = _even_split(L, pp)
            if ev not in candidates and bool((np.array(ev) <= common_caps).all()):
                candidates.append(ev)
        best = Evaluation(feasible=False)
        for lay in candidates:
            lay_arr = np.array(lay)
            need = fb + lay_arr * pb  # (C, pp)
            ratio = float((need / usable).max())
            if ratio > 1.0:
                if not best.feasible and ratio < best.worst_ratio:
                    best = Evaluation(feasible=False, worst_ratio=ratio, layers=lay,
                                      need_arrays=(kinds_mat, need))
                continue
            stage_s = fs + lay_arr * ps  # (C, pp) seconds per micro-batch
            c_k = stage_s.max(axis=1)
            a_k = stage_s.sum(axis=1) - c_k
            per_class = None
            if fixed_micro is not None:
                pipe = float((a_k[inverse] + c_k[inverse] * fixed_micro).max())
            elif even:
                if n_micro < dp:
                    continue
                micro = np.full(dp, n_micro // dp, dtype=np.int64)
                micro[: n_micro % dp] += 1
                pipe = float((a_k[inverse] + c_k[inverse] * micro).max())
            else:
                per_class = _allocate(a_k, c_k, counts, n_micro)
                if per_class is None:
                    continue
                top = np.array([base + (1 if extra else 0) for base, extra in per_class])
                pipe = float((a_k + c_k * top).max())
            dp_s, opt_s = self._sync_costs(cls, lay_arr, tp, pp, dp, z)
            step = pipe + dp_s + opt_s
            if step < best.step_s:
                best = Evaluation(
                    feasible=True, step_s=step, layers=lay, per_class=per_class, worst_ratio=ratio,
                    pipeline_s=pipe, dp_comm_s=dp_s, optimizer_s=opt_s,
                )
        if not candidates:
            # memory fails before any layout: report the even split's needs
            lay_arr = np.array(_even_split(L, pp))
            need = fb + lay_arr * pb
            best = Evaluation(feasible=False, worst_ratio=float((need / usable).max()),
                              layers=list(lay_arr), need_arrays=(kinds_mat, need))
        if best.need_arrays is not None and not best.feasible and not self.lazy_needs:
            best.needs = self.needs(*best.need_arrays)
        return best

    def needs(self, kinds_mat: np.ndarray, need: np.ndarray) -> dict[str, tuple[float, float, float]]:
        K = self.fleet.kinds
        out: dict[str, tuple[float, float, float]] = {}
        for k in np.unique(kinds_mat):
            mask = kinds_mat == k
            gb = (float(need[mask].max()) + cost.RESERVED_BYTES) / 1e9
            gpu_id = K.ids[k]
            usable = (float(K.usable_bytes[k]) + cost.RESERVED_BYTES) / 1e9
            if gpu_id not in out or gb > out[gpu_id][0]:
                out[gpu_id] = (gb, usable, float(K.capacity_gb[k]))
        return out

    def _sync_costs(
        self, cls: _Classes, lay: np.ndarray, tp: int, pp: int, dp: int, z: int
    ) -> tuple[float, float]:
        """Gradient synchronisation across replicas and the optimizer step (seconds)."""
        K = self.fleet.kinds
        stage_params = lay * self.layer_params
        stage_params[0] += self.embed_params
        if pp > 1:
            stage_params[-1] += self.req.model.vocab * self.hidden
        grad_bytes = stage_params / tp * 2.0  # bf16 gradients per rank
        present = np.unique(cls.kinds)
        if dp > 1:
            if cls.single_node:
                bw = float(K.nvlink_bw[present].min()) if float(K.nvlink_bw[present].min()) > 0 \
                    else float(K.pcie_bw[present].min())
                per_bytes = float(grad_bytes.max())
                dp_s = cost.ring_allreduce_s(per_bytes, dp, bw)
            else:
                # hierarchical: ranks holding the same shard on a node reduce over NVLink first;
                # the node's NICs then carry one copy of each distinct shard on it
                distinct = np.minimum(K.node_gpus[present], tp * pp)
                per_node_gbs = float((K.net_bw[present] / distinct).min())
                dp_s = cost.ring_allreduce_s(float(grad_bytes.max()), dp, per_node_gbs)
            dp_s *= cost.ZERO_COMM_FACTOR[z]
        else:
            dp_s = 0.0
        owned = stage_params.max() / tp / (dp if z >= 1 else 1)
        opt_s = owned * cost.OPTIMIZER_BYTES_PER_PARAM / float(K.membw[present].min())
        return dp_s, opt_s


def _even_split(layers: int, pp: int) -> list[int]:
    """Layers per stage as even as possible; the remainder goes to the last stages
    (the first stages hold the most micro-batches in flight under 1F1B)."""
    base, extra = divmod(layers, pp)
    return [base + (1 if i >= pp - extra else 0) for i in range(pp)]


def plan_stage_split(
    per_layer_s: list[float], layers: int, caps: list[int] | None = None
) -> list[int] | None:
    """Layers per pipeline stage (each >= 1, at most its cap, summing to `layers`) that make the
    slowest stage fastest, given each stage's seconds per layer; None when no split fits.
    What the planner uses for uneven stages; the action policy re-splits a running job with it."""
    pp = len(per_layer_s)
    limit = np.asarray(caps if caps is not None else [layers] * pp, dtype=np.int64)
    return _minmax_layers(np.asarray(per_layer_s, dtype=np.float64), np.zeros(pp), limit, layers)


def _minmax_layers(
    per_layer: np.ndarray, fixed: np.ndarray, caps: np.ndarray, layers: int
) -> list[int] | None:
    """Layers per stage (each >= 1, <= cap, summing to ``layers``) minimising the slowest stage.

    Greedy: start at one layer each and give the next layer to the stage that would be
    fastest with it. Optimal for min-max of increasing per-stage costs.
    """
    pp = len(per_layer)
    if pp > layers or caps.min() < 1 or caps.sum() < layers:
        return None
    n = [1] * pp
    per = [float(x) for x in per_layer]
    fix = [float(x) for x in fixed]
    cap = [int(x) for x in caps]
    # start from the continuous optimum's floor (never above it) to keep the heap short
    inv = sum(1.0 / x for x in per)
    target = (layers + sum(f / x for f, x in zip(fix, per, strict=True))) / inv
    for i in range(pp):
        n[i] = max(1, min(cap[i], int((target - fix[i]) / per[i])))
    while sum(n) > layers:  # rounding overshoot: take back from the slowest stages
        i = max((j for j in range(pp) if n[j] > 1), key=lambda j: fix[j] + n[j] * per[j])
        n[i] -= 1
    heap = [(fix[i] + (n[i] + 1) * per[i], i) for i in range(pp) if n[i] < cap[i]]
    heapq.heapify(heap)
    left = layers - sum(n)
    while left > 0:
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        n[i] += 1
        left -= 1
        if n[i] < cap[i]:
            heapq.heappush(heap, (fix[i] + (n[i] + 1) * per[i], i))
    return n


def _allocate(a: np.ndarray, c: np.ndarray, counts: np.ndarray, total: int) -> list[tuple[int, int]] | None:
    """Split ``total`` micro-batches over replicas (``counts[k]`` identical replicas in class k,
    each taking ``a[k] + c[k] * m`` seconds for ``m``), each >= 1, minimising the slowest.

    Returns per class (base, extra): ``extra`` of its replicas take ``base + 1``.
    """
    n_rep = int(counts.sum())
    if total < n_rep:
        return None
    # continuous optimum T: sum_k counts_k (T - a_k) / c_k = total
    T = (total + float((counts * a / c).sum())) / float((counts / c).sum())
    base = np.maximum(1, np.floor((T - a) / c)).astype(np.int64)
    extra = np.zeros_like(base)
    assigned = int((base * counts).sum())
    if assigned > total:  # clamping to one micro-batch overshot: restart from ones
        base[:] = 1
        assigned = n_rep
    left = total - assigned
    heap = [(float(a[k] + c[k] * (base[k] + 1)), k) for k in range(len(base))]
    heapq.heapify(heap)
    while left > 0:
        _, k = heapq.heappop(heap)
        room = int(counts[k] - extra[k])
        take = min(room, left)
        extra[k] += take
        left -= take
        if extra[k] == counts[k]:
            base[k] += 1
            extra[k] = 0
        heapq.heappush(heap, (float(a[k] + c[k] * (base[k] + 1)), k))
    return [(int(base[k]), int(extra[k])) for k in range(len(base))]


def _expand(per_class: list[tuple[int, int]], inverse: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Per replica micro-batch counts from per class (base, extra): the first ``extra``
    replicas of a class (in replica order) take one more."""
    base = np.array([b for b, _ in per_class], dtype=np.int64)
    extra = np.array([e for _, e in per_class], dtype=np.int64)
    order = np.argsort(inverse, kind="stable")
    starts = np.cumsum(counts) - counts
    within = np.empty(len(inverse), dtype=np.int64)
    within[order] = np.arange(len(inverse)) - starts[inverse[order]]
    return base[inverse] + (within < extra[inverse]).astype(np.int64)


# ---- the search ---------------------------------------------------------------------------

# Pipeline depths tried by the heuristic search besides the divisors of the layer and group
# counts (Megatron-style configurations use these).
_PP_LADDER = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128)
# Micro-batch sizes: every divisor of the global batch up to this. Larger micro-batches give
# larger, more efficient GEMMs (cost.gemm_efficiency) but more activation memory and fewer
# micro-batches to fill the pipeline; the search stops at the first one that does not fit.
_MAX_MICRO_BATCH = 64


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _recompute_modes(request: PlanRequest) -> tuple[str, ...]:
    if request.recompute == "auto":
        return cost.RECOMPUTE_MODES
    if request.recompute not in cost.RECOMPUTE_MODES:
        raise ValueError(f"recompute must be auto, none, selective or full; got {request.recompute!r}")
    return (request.recompute,)


def _validate(request: PlanRequest) -> str:
    if request.global_batch < 1:
        raise ValueError(f"global_batch must be at least 1, got {request.global_batch}")
    if request.seq < 1:
        raise ValueError(f"seq_len must be at least 1, got {request.seq}")
    bad = [z for z in request.zero_stages if z not in (0, 1, 2, 3)]
    if bad or not request.zero_stages:
        raise ValueError(f"zero_stages must be a non-empty subset of 0..3, got {request.zero_stages}")
    if request.micro_batch is not None and (
        request.micro_batch < 1 or request.global_batch % request.micro_batch
    ):
        raise ValueError(
            f"micro_batch {request.micro_batch} must be >= 1 and divide global_batch {request.global_batch}"
        )
    try:
        return normalize_dtype(request.dtype)
    except UnsupportedDtypeError as exc:
        raise ValueError(str(exc)) from None


class _Search:
    def __init__(self, request: PlanRequest, cluster: Cluster) -> None:
        self.req = request
        self.dtype = _validate(request)
        self.fleet = _Fleet(cluster, self.dtype, request.memory_headroom)
        self.ev = _Evaluator(request, self.fleet)
        self.best: Candidate | None = None
        self.closest: Candidate | None = None  # the infeasible candidate nearest to fitting
        self.evaluated = 0
        m = request.model
        # compute-only lower bound of a step: FLOPs of the batch over the GPUs' capability
        self.sample_flops = cost.model_flops_per_sample(m, request.seq, "none")
        self.batch_flops = request.global_batch * self.sample_flops
        self.ev.lazy_needs = True
        self._layer_sample_s: dict[int, np.ndarray] = {}

    def tp_options(self) -> list[int]:
        m = self.req.model
        kv = m.kv_heads or m.heads
        biggest = max(s.spec.nvlink_domain for s in self.fleet.usable)
        sizes = range(1, biggest + 1) if self.req.exhaustive else [2**i for i in range(8) if 2**i <= biggest]
        out = []
        for t in sizes:
            if m.heads % t or kv % t and t % kv:
                continue
            if len(self.fleet.groups(t).kind):
                out.append(t)
        return out

    def pp_options(self, n_groups: int) -> list[int]:
        top = min(self.req.model.layers, n_groups)
        if self.req.exhaustive:
            return list(range(1, top + 1))
        opts = set(_PP_LADDER) | set(_divisors(self.req.model.layers)) | set(_divisors(n_groups))
        return sorted(p for p in opts if 1 <= p <= top)

    def dp_options(self, groups: TpGroups, pp: int) -> list[int]:
        top = min(len(groups.kind) // pp, self.req.global_batch)
        if top < 1:
            return []
        if self.req.exhaustive:
            return list(range(1, top + 1))
        # all groups; or drop whole kinds from the slow/small end of the layout order; or
        # stop at the end of the first 1, 2, 4, ... nodes (gradient sync inside fewer nodes)
        order = self.fleet.kinds.order[groups.kind]
        ends = list(np.flatnonzero(np.diff(order)) + 1)
        node_ends = np.flatnonzero(np.diff(groups.node)) + 1
        ends += [int(node_ends[k - 1]) for k in (2**i for i in range(20)) if k <= len(node_ends)]
        opts = {top} | {min(top, int(e) // pp) for e in ends if int(e) // pp >= 1}
        # the most replicas that split the batch evenly (every replica the same micro-batches)
        opts.add(max(d for d in _divisors(self.req.global_batch) if d <= top))
        return sorted(opts, reverse=True)

    def micro_options(self, dp: int) -> list[int]:
        G = self.req.global_batch
        if self.req.micro_batch is not None:
            return [self.req.micro_batch] if G // self.req.micro_batch >= dp else []
        pool = _divisors(G) if self.req.exhaustive else [b for b in _divisors(G) if b <= _MAX_MICRO_BATCH]
        return [b for b in pool if G // b >= dp]

    def zero_options(self) -> list[int]:
        allowed = sorted(set(self.req.zero_stages))
        if self.req.exhaustive:
            return allowed
        # stage 1 has the all-reduce's volume, less memory and a sharded optimizer step,
        # so it dominates stage 0 in this model
        if 1 in allowed and 0 in allowed:
            allowed.remove(0)
        return allowed

    def layer_sample_s(self, tp: int) -> np.ndarray:
        """Per kind: seconds for one TP group of ``tp`` to run one layer for one sample,
        forward and backward, TP collectives and element-wise memory traffic included (no
        recomputation), at the GEMM-size efficiency of the largest micro-batch the search may
        try (efficiency grows with the micro-batch, so this stays a lower bound for every
        micro-batch size)."""
        if tp not in self._layer_sample_s:
            K = self.fleet.kinds
            ev = self.ev
            b_top = max(self.micro_options(1), default=1)
            f_layer, _ = ev.gemm_eff(tp, b_top)
            secs = ev.layer_fwd * 3.0 / tp / (K.cap_tflops * 1e12 * f_layer)
            # element-wise bytes grow linearly with b, so per sample they are the b = 1 bytes
            mem_bytes = cost.layer_elementwise_step_bytes(
                self.req.model, self.req.seq, 1, tp, "none", tp > 1, ev.act_bytes)
            secs = secs + mem_bytes / (K.membw * cost.HBM_EFFICIENCY)
            if tp > 1:
                msg = self.req.seq * ev.hidden * ev.act_bytes
                ring = cost.ring_allreduce_s(msg, tp, 1.0)
                # kinds without NVLink never form TP groups of tp > 1: their entry is unused
                bw = np.where(K.nvlink_bw > 0, K.nvlink_bw, np.inf)
                secs = secs + cost.tp_collectives_per_layer("none") * ring / bw
            self._layer_sample_s[tp] = secs
        return self._layer_sample_s[tp]

    def lower_bound(self, groups: TpGroups, layout: Layout, micro_batch: int = 1) -> float:
        """No step can be faster: the batch's layer work spread over all used TP groups at
        their best rate, plus the pipeline fill of the first micro-batch on the fastest group."""
        used = groups.kind[layout.index].ravel()
        per = self.layer_sample_s(layout.tp)[used]
        work = self.req.global_batch * self.ev.L / float((1.0 / per).sum())
        fill = (layout.pp - 1) / layout.pp * micro_batch * self.ev.L * float(per.min())
        return work + fill + self.sync_bound(groups, layout, used)

    def sync_bound(self, groups: TpGroups, layout: Layout, used: np.ndarray) -> float:
        """Gradient sync can be no faster than for an average stage (same model as
        ``_Evaluator._sync_costs``, which uses the largest stage)."""
        if layout.dp <= 1:
            return 0.0
        K = self.fleet.kinds
        tp, pp = layout.tp, layout.pp
        grad_bytes = (self.ev.L * self.ev.layer_params + self.ev.embed_params) / pp / tp * 2.0
        present = np.unique(used)
        nodes = groups.node[layout.index]
        if bool(np.all(nodes == nodes.flat[0])):
            bw = float(np.maximum(K.nvlink_bw[present], K.pcie_bw[present]).max())
        else:
            bw = float((K.net_bw[present] / np.minimum(K.node_gpus[present], tp * pp)).min())
        low_z = min(cost.ZERO_COMM_FACTOR[z] for z in self.req.zero_stages)
        return low_z * cost.ring_allreduce_s(grad_bytes, layout.dp, bw)

    def consider(self, layout: Layout, cls: _Classes, b: int, z: int, rc: str) -> Evaluation:
        self.evaluated += 1
        result = self.ev.evaluate(layout, cls, b, z, rc)
        cand = Candidate(layout, b, z, rc, result)
        if result.feasible:
            if self.best is None or result.step_s < self.best.result.step_s * (1 - 1e-12):
                self.best = cand
        elif self.closest is None or result.worst_ratio < self.closest.result.worst_ratio:
            self.closest = cand
        return result

    def run_layout(self, layout: Layout, groups: TpGroups) -> None:
        if self.best is not None and self.lower_bound(groups, layout) >= self.best.result.step_s:
            return
        cls = self.ev.classes(layout, groups)
        exhaustive = self.req.exhaustive
        for rc in _recompute_modes(self.req):
            fitted = False
            for z in self.zero_options():
                if not exhaustive and z == 3 and fitted:
                    break  # ZeRO-3 only adds communication once a lower stage fits
                for b in self.micro_options(layout.dp):
                    best = self.best.result.step_s if self.best is not None else math.inf
                    if self.lower_bound(groups, layout, b) >= best:
                        break  # the bound grows with b
                    if self.consider(layout, cls, b, z, rc).feasible:
                        fitted = True
                    else:
                        break  # activation memory grows with b: larger ones cannot fit either
            if fitted and not exhaustive:
                break  # recomputing more only costs time once a lighter mode fits

    def run(self) -> None:
        """Best-first over (tp, pp, dp, arrangement): layouts in order of their lower bound,
        stopping when no remaining layout can beat the best plan found."""
        strategy = self.req.strategy
        tps = self.tp_options()
        if strategy is not None:
            tp, pp, dp = strategy
            self._check_strategy(tp, pp, dp, tps)
            tps = [tp]
        queue = []
        for tp in tps:
            groups = self.fleet.groups(tp)
            n = len(groups.kind)
            pps = [strategy[1]] if strategy else self.pp_options(n)
            for pp in pps:
                dps = [strategy[2]] if strategy else self.dp_options(groups, pp)
                for dp in dps:
                    for arrangement in ARRANGEMENTS:
                        if arrangement == "striped" and (pp == 1 or dp == 1):
                            continue  # identical to grouped
                        layout = Layout(tp, pp, dp, arrangement, _arrange(groups, pp, dp, arrangement))
                        queue.append((self.lower_bound(groups, layout), len(queue), layout, groups))
        queue.sort(key=lambda item: item[:2])
        for bound, _, layout, groups in queue:
            if self.best is not None and bound >= self.best.result.step_s:
                break
            self.run_layout(layout, groups)

    def _check_strategy(self, tp: int, pp: int, dp: int, tps: list[int]) -> None:
        m = self.req.model
        if min(tp, pp, dp) < 1:
            raise ValueError(f"strategy tp={tp}, pp={pp}, dp={dp}: every degree must be at least 1")
        if m.heads % tp:
            raise ValueError(f"strategy tp={tp}: the model's {m.heads} heads are not divisible by {tp}")
        if pp > m.layers:
            raise ValueError(f"strategy pp={pp}: the model has only {m.layers} layers")
        if dp > self.req.global_batch:
            raise ValueError(f"strategy dp={dp}: more replicas than the global batch {self.req.global_batch}")
        if tp not in tps:
            raise ValueError(f"strategy tp={tp}: no NVLink domain in the cluster holds {tp} identical GPUs")
        have = len(self.fleet.groups(tp).kind)
        if have < pp * dp:
            raise ValueError(
                f"strategy tp={tp}, pp={pp}, dp={dp} needs {tp * pp * dp} GPUs in {pp * dp} "
                f"NVLink groups of {tp}; the cluster has {have} such groups ({have * tp} GPUs usable)"
            )

    def infeasible(self) -> InfeasiblePlanError:
        m = self.req.model
        head = (
            f"no plan fits {m.name} (global batch {self.req.global_batch}, seq {self.req.seq}, "
            f"{self.dtype}) in memory on {len(self.fleet.usable)} GPUs"
        )
        if self.closest is None:
            return InfeasiblePlanError(head + ": no candidate split (too few GPUs or layers)")
        c = self.closest
        needs = self.ev.needs(*c.result.need_arrays) if c.result.need_arrays else c.result.needs
        parts = [
            f"{gpu_id} needs {need:.1f} GB, has {usable:.1f} GB usable of {capacity:.0f} GB"
            for gpu_id, (need, usable, capacity) in sorted(needs.items())
        ]
        where = (
            f"closest: tp={c.layout.tp} pp={c.layout.pp} dp={c.layout.dp} zero={c.zero_stage} "
            f"recompute={c.recompute} micro_batch={c.micro_batch}"
        )
        return InfeasiblePlanError(f"{head}; {where}; per GPU: " + "; ".join(parts), needs)


def plan_job(request: PlanRequest, cluster: Cluster) -> Plan:
    """The fastest split of ``request`` over ``cluster`` that fits in memory.

    Raises ``InfeasiblePlanError`` (naming per GPU type the memory needed vs available for
    the closest candidate) when nothing fits, ``ValueError`` for invalid requests.
    """
    search = _Search(request, cluster)
    search.run()
    if search.best is None:
        raise search.infeasible()
    return _build_plan(search, search.best)


def _build_plan(search: _Search, cand: Candidate, groups: TpGroups | None = None,
                cls: _Classes | None = None) -> Plan:
    ev, fleet = search.ev, search.fleet
    layout, res = cand.layout, cand.result
    groups = groups or fleet.groups(layout.tp)
    cls = cls or ev.classes(layout, groups)
    if res.per_class is not None:
        micro = _expand(res.per_class, cls.inverse, cls.counts)
    else:
        raise AssertionError("a searched candidate carries its micro-batch split")
    return _materialise(search, cand, groups, cls, micro)


def _materialise(search: _Search, cand: Candidate, groups: TpGroups, cls: _Classes,
                 micro: np.ndarray) -> Plan:
    req, ev, fleet = search.req, search.ev, search.fleet
    K = fleet.kinds
    layout, res = cand.layout, cand.result
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    b, z, rc = cand.micro_batch, cand.zero_stage, cand.recompute
    assert int(micro.sum()) * b == req.global_batch, "micro-batches must sum to the global batch"
    starts = np.concatenate([[0], np.cumsum(res.layers)])
    m = req.model
    act = cost.activation_bytes_per_layer(m, ev.s, b, tp, rc, tp > 1, ev.act_bytes)
    bpp = cost.state_bytes_per_param(z, dp)
    _, _, _, fixed_b = ev.stage_arrays(cls.kinds[:1], cls.same_node[:1], tp, b, z, rc, dp)
    f_layer, _ = ev.gemm_eff(tp, b)  # the capability a rank is planned with, at its GEMM sizes
    ranks: list[RankPlan] = []
    for stage in range(pp):
        first, last = int(starts[stage]), int(starts[stage + 1]) - 1
        n_layers = res.layers[stage]
        for r in range(dp):
            group = groups.slots[int(layout.index[r, stage])]
            kind = int(groups.kind[layout.index[r, stage]])
            in_flight = min(pp - stage, int(micro[r]))
            mem = (
                n_layers * (ev.layer_params / tp * bpp + in_flight * act)
                + float(fixed_b[0, stage]) + cost.RESERVED_BYTES
            )
            for t_rank, slot in enumerate(group):
                ranks.append(RankPlan(
                    rank=t_rank + tp * (r + dp * stage), node=slot.node, gpu=slot.gpu, model=slot.spec.id,
                    capability_tflops=round(float(K.cap_tflops[kind]) * f_layer, 3), micro_batch=b,
                    num_micro_batches=int(micro[r]), stage=stage, layers=(first, last), dp_rank=r,
                    tp_rank=t_rank, memory_gb=round(mem / 1e9, 3),
                    memory_capacity_gb=float(K.capacity_gb[kind]),
                ))
    ranks.sort(key=lambda x: x.rank)
    uniform = ev.evaluate(layout, cls, b, z, rc, even=True)
    step = res.step_s
    used = np.concatenate([groups.kind[layout.index].ravel()])
    peak = float(K.peak_tflops[used].sum()) * tp * 1e12
    model_flops = req.global_batch * cost.model_flops_per_sample(m, req.seq, "none")
    used_gpus = tp * pp * dp
    notes = list(fleet.notes)
    idle = len(fleet.usable) - used_gpus
    if idle:
        # Either they do not form whole TP/PP groups, or adding them costs more in gradient sync
        # than their compute saves: the search compared both.
        notes.append(
            f"{idle} of {len(fleet.usable)} usable GPUs left idle: no faster plan uses them "
            "(whole TP/PP groups, or sync cost above their compute)"
        )
    notes.append(
        f"{layout.arrangement} layout; step = pipeline {res.pipeline_s:.4f} s + gradient sync "
        f"{res.dp_comm_s:.4f} s + optimizer {res.optimizer_s:.4f} s"
    )
    return Plan(
        job=req.job, model=m.name, dtype=search.dtype, dp=dp, tp=tp, pp=pp, zero_stage=z,
        global_batch=req.global_batch, seq_len=req.seq, recompute=rc, sequence_parallel=tp > 1,
        predicted_step_s=step, uniform_step_s=uniform.step_s if uniform.feasible else None,
        tokens_per_s=req.global_batch * req.seq / step, mfu=model_flops / (step * peak),
        ranks=ranks, notes=notes, arrangement=layout.arrangement, micro_batch_size=b,
        layers_per_stage=list(res.layers), pipeline_s=res.pipeline_s, dp_comm_s=res.dp_comm_s,
        optimizer_s=res.optimizer_s, evaluated_candidates=search.evaluated, constraints=req.constraints,
    )
