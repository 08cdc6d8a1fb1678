"""Planner core: memory feasibility, exact batch sums, layer splits, search quality, re-planning."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleetwise.catalog import lookup
from fleetwise.planner import (
    MODEL_PRESETS,
    GpuSlot,
    InfeasiblePlanError,
    PlanRequest,
    cost,
    parse_gpu_spec,
    parse_model_dict,
    plan_job,
    plan_timeline,
    replan,
    resolve_model,
)
from fleetwise.planner.search import _allocate, _minmax_layers
from fleetwise.schemas import ModelShape, Plan

SMALL = ModelShape(name="small", layers=12, hidden=1024, heads=16, seq_len=1024, vocab=32000)


def _check_plan(plan: Plan, request: PlanRequest) -> None:
    """Invariants every plan must satisfy."""
    L = request.model.layers
    # memory: no rank above its capacity
    for r in plan.ranks:
        assert r.memory_gb <= r.memory_capacity_gb, (r.node, r.gpu, r.memory_gb)
    # each replica's ranks agree; samples sum exactly to the global batch
    per_replica: dict[int, set[int]] = {}
    for r in plan.ranks:
        per_replica.setdefault(r.dp_rank, set()).add(r.samples)
    assert all(len(v) == 1 for v in per_replica.values())
    assert sum(next(iter(v)) for v in per_replica.values()) == plan.global_batch
    assert all(r.num_micro_batches >= 1 for r in plan.ranks)
    # layers: contiguous stages covering 0..L-1, each >= 1 layer
    spans = sorted({(r.stage, r.layers) for r in plan.ranks})
    assert [s for s, _ in spans] == list(range(plan.pp))
    expected_first = 0
    for _, (first, last) in spans:
        assert first == expected_first and last >= first
        expected_first = last + 1
    assert expected_first == L
    # ranks are distinct GPUs, numbered 0..n-1
    assert sorted(r.rank for r in plan.ranks) == list(range(plan.dp * plan.tp * plan.pp))
    assert len({(r.node, r.gpu) for r in plan.ranks}) == len(plan.ranks)
    # a TP group never mixes GPU types
    groups: dict[tuple[int, int], set[str]] = {}
    for r in plan.ranks:
        groups.setdefault((r.dp_rank, r.stage), set()).add(r.model)
    assert all(len(v) == 1 for v in groups.values())


# ---- cost model ---------------------------------------------------------------------------


def test_flops_formula_matches_narayanan_with_full_recompute():
    """96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per sample, arXiv 2104.04473 eq. (3)."""
    m = MODEL_PRESETS["gpt-145b"]
    s, h, L, V = m.seq_len, m.hidden, m.layers, m.vocab
    narayanan = 96 * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    assert cost.model_flops_per_sample(m, s, "full") == pytest.approx(narayanan, rel=1e-9)


def test_param_count_matches_narayanan():
    m = MODEL_PRESETS["gpt-1t"]
    s, h, L, V = m.seq_len, m.hidden, m.layers, m.vocab
    narayanan = 12 * L * h**2 * (1 + 13 / (12 * h) + (V + s) / (12 * L * h))
    assert cost.total_params(m, s) == pytest.approx(narayanan, rel=1e-6)
    assert 0.99e12 < cost.total_params(m, s) < 1.02e12


def test_activation_memory_orders():
    m = MODEL_PRESETS["gpt-18b"]
    none = cost.activation_bytes_per_layer(m, 2048, 1, 8, "none", True)
    sel = cost.activation_bytes_per_layer(m, 2048, 1, 8, "selective", True)
    full = cost.activation_bytes_per_layer(m, 2048, 1, 8, "full", True)
    assert full < sel < none
    # sequence parallelism divides everything by t
    no_sp = cost.activation_bytes_per_layer(m, 2048, 1, 8, "none", False)
    assert none < no_sp


def test_zero_stages_shrink_state():
    assert [cost.state_bytes_per_param(z, 8) for z in range(4)] == sorted(
        (cost.state_bytes_per_param(z, 8) for z in range(4)), reverse=True
    )
    assert cost.state_bytes_per_param(3, 16) == pytest.approx(1.0)


def test_gemm_curve_fit_reproduces_the_published_a100_points():
    """The fitted f(n) times the fitted plateau stays close to NVIDIA's A100 cuBLAS BF16 points."""
    sizes = np.array([n for n, _ in cost.GEMM_CURVE_A100_BF16], dtype=float)
    published = np.array([t for _, t in cost.GEMM_CURVE_A100_BF16])
    fitted = np.array([cost.GEMM_CURVE_T_INF_TFLOPS * cost.gemm_efficiency(n, n, n) for n in sizes])
    assert float(np.sqrt(np.mean((fitted - published) ** 2))) < 12.0
    # the fit must follow the curve's rise, not just its average: small sizes far below large
    assert fitted[sizes == 1024][0] < 0.5 * fitted[sizes == 8192][0]


def test_gemm_efficiency_saturates_and_is_symmetric():
    sizes = [256, 512, 1024, 2048, 4096, 8192, 16384]
    effs = [cost.gemm_efficiency(n, n, n) for n in sizes]
    assert all(a < b for a, b in zip(effs, effs[1:], strict=False))
    assert effs[0] < 0.1 and effs[-1] > 0.99
    # forward and backward GEMMs (dimensions permuted) get the same efficiency
    assert cost.gemm_efficiency(2048, 768, 6144) == pytest.approx(cost.gemm_efficiency(6144, 2048, 768))
    # a batched kernel counts its whole work
    assert cost.gemm_efficiency(2048, 2048, 128, batch=16) > cost.gemm_efficiency(2048, 2048, 128)


def test_layer_efficiency_falls_with_tp_and_rises_with_micro_batch():
    m = MODEL_PRESETS["gpt-18b"]
    by_tp = [cost.layer_gemm_efficiency(m, 2048, 1, t) for t in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(by_tp, by_tp[1:], strict=False))
    by_b = [cost.layer_gemm_efficiency(m, 2048, b, 8) for b in (1, 2, 4)]
    assert all(a < b for a, b in zip(by_b, by_b[1:], strict=False))
    assert 0.0 < by_tp[-1] < by_tp[0] <= 1.0


def test_mfu_conversion_reproduces_the_reference_run():
    """Planned with its own configuration, the catalog's reference run (1T GPT, 3,072 A100s,
    Narayanan et al. 2021) comes out near the catalog MFU: the conversion is self-consistent."""
    model = MODEL_PRESETS["gpt-1t"]
    cluster = parse_gpu_spec("a100-sxm-80gb:3072", network_gbs=200.0)
    request = PlanRequest(model=model, global_batch=3072, strategy=(8, 64, 6), recompute="full",
                          zero_stages=(0,), micro_batch=1)
    plan = plan_job(request, cluster)
    achieved = 3072 * cost.model_flops_per_sample(model, model.seq_len, "full") / plan.predicted_step_s / 3072
    ampere = lookup("a100-sxm-80gb")
    assert achieved / (ampere.peak("bf16") * 1e12) == pytest.approx(ampere.efficiency, rel=0.08)
    assert cost.MFU_TO_COMPUTE > 1.0  # the MFU contains the bubble and TP time the model adds back


def test_elementwise_traffic_covers_what_korthikanti_stores_and_splits_like_it():
    """Forward element-wise traffic of a GPT layer moves at least the tensors Korthikanti et al.
    count as stored (34 s b h + 5 a s^2 b bytes, written once each); it is linear in the
    micro-batch, the score part is split over TP ranks, and the layer-norm/dropout part only
    with sequence parallelism."""
    m = MODEL_PRESETS["gpt-18b"]
    s, h, a = 2048, m.hidden, m.heads
    wide, scores = cost.layer_elementwise_bytes(m, s, 1, 1, False)
    assert wide + scores >= 34 * s * h + 5 * a * s * s
    assert scores >= 5 * a * s * s
    two = cost.layer_elementwise_bytes(m, s, 2, 1, False)
    assert two == pytest.approx((2 * wide, 2 * scores))
    sp_wide, sp_scores = cost.layer_elementwise_bytes(m, s, 1, 8, True)
    tp_wide, tp_scores = cost.layer_elementwise_bytes(m, s, 1, 8, False)
    assert sp_wide == pytest.approx(wide / 8) and sp_scores == pytest.approx(scores / 8)
    assert wide / 8 < tp_wide < wide
    steps = [cost.layer_elementwise_step_bytes(m, s, 1, 8, rc, True) for rc in ("none", "selective", "full")]
    assert steps[0] < steps[1] < steps[2]


def test_elementwise_share_of_layer_time_grows_as_hidden_shrinks():
    """Element-wise work is ~h per token and GEMM work ~h^2, so the memory-bound share of a
    layer's time is larger for the 1.7B GPT (h = 2304) than for the 1T GPT (h = 25,600)."""
    a100 = lookup("a100-sxm-80gb")
    large = a100.capability_tflops("bf16") * cost.MFU_TO_COMPUTE * 1e12
    hbm = a100.memory_bw_bytes_s * cost.HBM_EFFICIENCY
    shares = []
    for name, tp in (("gpt-1.7b", 1), ("gpt-1t", 8)):
        m = MODEL_PRESETS[name]
        flops = cost.layer_forward_flops(m, 2048) * 4.0 / tp
        gemm_s = flops / (large * cost.layer_gemm_efficiency(m, 2048, 1, tp))
        mem_s = cost.layer_elementwise_step_bytes(m, 2048, 1, tp, "full", tp > 1) / hbm
        shares.append(mem_s / (mem_s + gemm_s))
    assert shares[0] > shares[1] > 0.0


def test_lower_hbm_bandwidth_lengthens_the_pipeline():
    """A100 40GB and 80GB have the same peak and family efficiency, but 1.555 vs 2.039 TB/s of
    HBM: with the same split, the 40GB pipeline (step minus optimizer) is slower."""
    model = MODEL_PRESETS["gpt-1.3b"]
    pipes = {}
    for gpu in ("a100-sxm-40gb", "a100-sxm-80gb"):
        request = PlanRequest(model=model, global_batch=64, strategy=(1, 1, 8), micro_batch=1,
                              zero_stages=(1,))
        plan = plan_job(request, parse_gpu_spec(f"{gpu}:8"))
        pipes[gpu] = plan.pipeline_s
    assert pipes["a100-sxm-40gb"] > pipes["a100-sxm-80gb"]


def test_rank_capability_includes_gemm_size():
    """A rank's assumed capability is the large-GEMM rate times its GEMM-size efficiency, so
    the same GPU is assumed slower with more tensor parallelism (smaller per-rank GEMMs)."""
    cluster = parse_gpu_spec("h100-sxm:8")
    model = MODEL_PRESETS["gpt-1.3b"]
    caps = {}
    for tp in (1, 8):
        plan = plan_job(PlanRequest(model=model, global_batch=64, strategy=(tp, 1, 8 // tp), micro_batch=1),
                        cluster)
        caps[tp] = plan.ranks[0].capability_tflops
        large = lookup("h100-sxm").capability_tflops("bf16") * cost.MFU_TO_COMPUTE
        expected = large * cost.layer_gemm_efficiency(model, model.seq_len, 1, tp)
        assert caps[tp] == pytest.approx(expected, rel=1e-3)
    assert caps[8] < caps[1]


# ---- solvers ------------------------------------------------------------------------------


def test_minmax_layers_matches_brute_force():
    rng = np.random.default_rng(7)
    for _ in range(40):
        pp = int(rng.integers(2, 5))
        L = int(rng.integers(pp, 14))
        per = rng.uniform(0.5, 3.0, pp)
        fixed = rng.uniform(0.0, 2.0, pp)
        caps = rng.integers(1, L + 1, pp)
        got = _minmax_layers(per, fixed, caps, L)

        def splits(n, k):
            if k == 1:
                yield (n,)
                return
            for first in range(1, n - k + 2):
                for rest in splits(n - first, k - 1):
                    yield (first, *rest)

        feasible = [x for x in splits(L, pp) if all(a <= c for a, c in zip(x, caps, strict=True))]
        if not feasible:
            assert got is None
            continue
        best = min(max(f + n * p for f, n, p in zip(fixed, x, per, strict=True)) for x in feasible)
        assert got is not None and sum(got) == L and all(1 <= a <= c for a, c in zip(got, caps, strict=True))
        assert max(f + n * p for f, n, p in zip(fixed, got, per, strict=True)) == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(
    a=st.lists(st.floats(0, 5), min_size=1, max_size=4),
    data=st.data(),
)
def test_allocate_sums_exactly_and_is_minmax(a, data):
    k = len(a)
    c = data.draw(st.lists(st.floats(0.1, 4), min_size=k, max_size=k))
    counts = data.draw(st.lists(st.integers(1, 4), min_size=k, max_size=k))
    total = data.draw(st.integers(sum(counts), sum(counts) + 30))
    a_, c_, n_ = np.array(a), np.array(c), np.array(counts)
    got = _allocate(a_, c_, n_, total)
    assert got is not None
    assert sum(base * n + extra for (base, extra), n in zip(got, counts, strict=True)) == total
    worst = max(a_[i] + c_[i] * (base + (1 if extra else 0)) for i, (base, extra) in enumerate(got))
    # brute force on replicas: greedy one unit at a time from ones is optimal for min-max
    reps = [(a[i], c[i]) for i in range(k) for _ in range(counts[i])]
    m = [1] * len(reps)
    for _ in range(total - len(reps)):
        j = min(range(len(reps)), key=lambda r: reps[r][0] + reps[r][1] * (m[r] + 1))
        m[j] += 1
    assert worst == pytest.approx(max(x + y * mm for (x, y), mm in zip(reps, m, strict=True)))


# ---- plans --------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    h100=st.integers(0, 12),
    b200=st.integers(0, 12),
    a100=st.integers(0, 12),
    batch=st.integers(1, 300),
)
def test_random_pools_give_valid_plans(h100, b200, a100, batch):
    parts = [f"{n}:{c}" for n, c in (("h100-sxm", h100), ("b200", b200), ("a100-sxm-80gb", a100)) if c]
    if not parts:
        return
    cluster = parse_gpu_spec(",".join(parts))
    request = PlanRequest(model=SMALL, global_batch=batch)
    plan = plan_job(request, cluster)
    _check_plan(plan, request)
    assert plan.predicted_step_s > 0 and plan.tokens_per_s > 0 and 0 < plan.mfu < 1


def test_heterogeneous_beats_uniform_on_h100_b200():
    cluster = parse_gpu_spec("h100-sxm:16,b200:16")
    request = PlanRequest(model=resolve_model("llama-7b"), global_batch=512)
    plan = plan_job(request, cluster)
    _check_plan(plan, request)
    assert plan.uniform_step_s is not None
    assert plan.predicted_step_s < plan.uniform_step_s
    # faster GPUs get more samples
    samples = {r.model: r.samples for r in plan.ranks if r.stage == 0 and r.tp_rank == 0}
    assert samples["b200"] > samples["h100-sxm"]


def test_uneven_layers_on_mixed_pipeline():
    """One pipeline over a B200 and an H100 group: the faster stage gets more layers."""
    cluster = parse_gpu_spec("b200:8,h100-sxm:8")
    request = PlanRequest(model=resolve_model("llama-13b"), global_batch=64, strategy=(8, 2, 1))
    plan = plan_job(request, cluster)
    _check_plan(plan, request)
    by_stage = {r.stage: r for r in plan.ranks}
    n = {s: r.layers[1] - r.layers[0] + 1 for s, r in by_stage.items()}
    fast = 0 if by_stage[0].model == "b200" else 1
    assert n[fast] > n[1 - fast]
    assert sum(n.values()) == request.model.layers


def test_fixed_strategy_is_honoured():
    cluster = parse_gpu_spec("h100-sxm:32")
    request = PlanRequest(model=resolve_model("llama-13b"), global_batch=128, strategy=(4, 2, 4))
    plan = plan_job(request, cluster)
    assert (plan.tp, plan.pp, plan.dp) == (4, 2, 4)
    _check_plan(plan, request)


def test_fixed_strategy_needing_too_many_gpus_is_refused():
    cluster = parse_gpu_spec("h100-sxm:16")
    request = PlanRequest(model=SMALL, global_batch=64, strategy=(8, 2, 2))
    with pytest.raises(ValueError, match="needs 32 GPUs"):
        plan_job(request, cluster)


def test_infeasible_names_memory_per_gpu_type():
    cluster = parse_gpu_spec("a100-sxm-40gb:2,v100-sxm2-32gb:2")
    request = PlanRequest(model=resolve_model("llama-70b"), global_batch=8, dtype="fp16")
    with pytest.raises(InfeasiblePlanError) as info:
        plan_job(request, cluster)
    msg = str(info.value)
    assert "a100-sxm-40gb needs" in msg and "v100-sxm2-32gb needs" in msg
    for gpu_id, (need, usable, capacity) in info.value.needs.items():
        assert need > usable, gpu_id
        assert usable < capacity == lookup(gpu_id).memory_gb


def test_dtype_without_hardware_support_leaves_gpus_out():
    cluster = parse_gpu_spec("v100-sxm2-32gb:8,h100-sxm:8")
    plan = plan_job(PlanRequest(model=SMALL, global_batch=32, dtype="bf16"), cluster)
    assert {r.model for r in plan.ranks} == {"h100-sxm"}
    assert any("v100-sxm2-32gb" in n for n in plan.notes)


def test_search_within_tolerance_of_exhaustive_on_small_cases():
    rng = np.random.default_rng(3)
    types = ["h100-sxm", "b200", "a100-sxm-80gb", "h200"]
    gaps = []
    for _ in range(6):
        chosen = rng.choice(types, size=int(rng.integers(1, 3)), replace=False)
        spec = ",".join(f"{t}:{int(rng.integers(1, 9))}" for t in chosen)
        model = ModelShape(name="m", layers=int(rng.integers(4, 9)), hidden=1024, heads=8, seq_len=1024)
        request = PlanRequest(model=model, global_batch=int(rng.choice([16, 24, 32])))
        cluster = parse_gpu_spec(spec)
        fast = plan_job(request, cluster)
        full = plan_job(replace(request, exhaustive=True), cluster)
        assert full.predicted_step_s <= fast.predicted_step_s * (1 + 1e-9)
        gaps.append(fast.predicted_step_s / full.predicted_step_s - 1)
    assert max(gaps) <= 0.05


def test_replan_after_slowdown_only_moves_micro_batches():
    cluster = parse_gpu_spec("h100-sxm:16,b200:16")
    request = PlanRequest(model=resolve_model("llama-7b"), global_batch=512)
    plan = plan_job(request, cluster)
    slow = (plan.ranks[0].node, plan.ranks[0].gpu)
    new, diff = replan(plan, request, cluster, slowdown={slow: 1.5})
    assert (new.tp, new.pp, new.dp, new.zero_stage) == (plan.tp, plan.pp, plan.dp, plan.zero_stage)
    _check_plan(new, request)
    assert diff, "a 1.5x straggler must move work"
    assert all(set(d.changed) <= {"num_micro_batches", "micro_batch"} for d in diff)
    before = {(r.node, r.gpu): r for r in plan.ranks}
    after = {(r.node, r.gpu): r for r in new.ranks}
    assert after[slow].samples < before[slow].samples  # the straggler's replica sheds work
    # the rebalanced plan beats keeping the old split on the slowed GPU
    kept, _ = replan(plan, request, cluster, slowdown={slow: 1.0})
    assert kept.predicted_step_s == pytest.approx(plan.predicted_step_s)


def test_replan_after_removal_is_valid_over_the_rest():
    cluster = parse_gpu_spec("h100-sxm:16,b200:16")
    request = PlanRequest(model=resolve_model("llama-7b"), global_batch=512)
    plan = plan_job(request, cluster)
    gone = (plan.ranks[-1].node, plan.ranks[-1].gpu)
    new, diff = replan(plan, request, cluster, remove={gone})
    _check_plan(new, request)
    assert gone not in {(r.node, r.gpu) for r in new.ranks}
    assert any(d.after is None and (d.node, d.gpu) == gone for d in diff)


def test_replan_adding_gpus_uses_them():
    cluster = parse_gpu_spec("h100-sxm:8")
    request = PlanRequest(model=SMALL, global_batch=64)
    plan = plan_job(request, cluster)
    spec = lookup("b200")
    extra = [GpuSlot(node="new-n0", gpu=i, spec=spec, nvlink_group=0) for i in range(8)]
    new, diff = replan(plan, request, cluster, add=extra)
    _check_plan(new, request)
    assert new.predicted_step_s < plan.predicted_step_s
    assert any(r.node == "new-n0" for r in new.ranks)


def test_timeline_accounts_for_the_step():
    cluster = parse_gpu_spec("h100-sxm:8,b200:8")
    request = PlanRequest(model=resolve_model("llama-13b"), global_batch=64)
    plan = plan_job(request, cluster)
    rows = plan_timeline(plan, request, cluster)
    assert len(rows) == plan.dp * plan.pp
    for row in rows:
        assert row["compute_s"] > 0
        total = row["compute_s"] + row["comm_s"] + row["sync_s"] + row["idle_s"]
        assert total == pytest.approx(row["step_s"], rel=1e-6)


# ---- inputs -------------------------------------------------------------------------------


def test_parse_gpu_spec_packs_nodes():
    cluster = parse_gpu_spec("NVIDIA A100-SXM4-80GB:12,gb200:80")
    counts = cluster.counts()
    assert counts == {"a100-sxm-80gb": 12, "gb200": 80}
    nodes = {s.node for s in cluster.slots if s.spec.id == "a100-sxm-80gb"}
    assert nodes == {"a100-sxm-80gb-n000", "a100-sxm-80gb-n001"}
    nvl = {s.node for s in cluster.slots if s.spec.id == "gb200"}
    assert len(nvl) == 2  # NVL72 racks: 72 + 8


@pytest.mark.parametrize(
    "text, message",
    [
        ("h100-sxmm:8", "closest known ids: h100-sxm"),
        ("h100-sxm:0", "count must be at least 1"),
        ("h100-sxm:eight", "not a whole number"),
        ("h100-sxm", "has no count"),
        ("", "empty"),
    ],
)
def test_parse_gpu_spec_errors(text, message):
    with pytest.raises(ValueError, match=message):
        parse_gpu_spec(text)


def test_model_parsing():
    assert resolve_model("LLAMA-70B").kv_heads == 8
    with pytest.raises(ValueError, match="presets"):
        resolve_model("gpt-9")
    with pytest.raises(ValueError, match="hidden"):
        parse_model_dict({"name": "x", "layers": 2, "hidden": 100, "heads": 3})
