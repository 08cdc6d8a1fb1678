"""Planner benchmark: speed at scale, search quality, heterogeneous gain, homogeneous sanity.

Prints markdown tables (copied into docs/benchmarks.md, section "Planner"):

    .venv/bin/python bench/planner.py            # everything (~5 min on 2 shared cores)
    .venv/bin/python bench/planner.py --cases 10 # fewer exhaustive comparisons
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from fleetwise.catalog import lookup
from fleetwise.planner import PlanRequest, cost, parse_gpu_spec, plan_job, replan, resolve_model
from fleetwise.schemas import ModelShape

FOUR_GENERATIONS = ("a100-sxm-80gb", "h100-sxm", "h200", "b200")

# Narayanan et al. 2021 (arXiv 2104.04473), Table 1: model, heads, hidden, layers, TP, PP,
# GPUs, global batch, achieved TFLOP/s per GPU (A100-80GB, seq 2048, vocab 51,200).
NARAYANAN_TABLE_1 = [
    ("gpt-1.7b", 1, 1, 32, 512, 137),
    ("gpt-3.6b", 2, 1, 64, 512, 138),
    ("gpt-7.5b", 4, 1, 128, 512, 142),
    ("gpt-18b", 8, 1, 256, 1024, 135),
    ("gpt-39b", 8, 2, 512, 1536, 138),
    ("gpt-76b", 8, 4, 1024, 1792, 140),
    ("gpt-145b", 8, 8, 1536, 2304, 148),
    ("gpt-310b", 8, 16, 1920, 2160, 155),
    ("gpt-530b", 8, 35, 2520, 2520, 163),
    ("gpt-1t", 8, 64, 3072, 3072, 163),
]
# Selene DGX A100 nodes: 8 x 200 Gb/s HDR InfiniBand per node = 200 GB/s (paper Sec. 5).
SELENE_NODE_GBS = 200.0


def timed(fn, repeat: int = 1):
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def scale() -> None:
    print("### Planning time at scale (one core, best of 3)\n")
    print("| GPUs | pool | model | global batch | plan (tp, pp, dp, ZeRO, recompute) | step s | "
          "uniform s | candidates | plan time s | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for per_type, batch, target in ((256, 2048, 1.0), (2560, 8192, 10.0)):
        spec = ",".join(f"{g}:{per_type}" for g in FOUR_GENERATIONS)
        cluster = parse_gpu_spec(spec)
        request = PlanRequest(model=resolve_model("llama-70b"), global_batch=batch)
        secs, plan = timed(lambda c=cluster, r=request: plan_job(r, c), repeat=3)
        pool = f"{per_type} each of {', '.join(FOUR_GENERATIONS)}"
        print(f"| {len(cluster)} | {pool} | llama-70b | {batch} | "
              f"{plan.tp}, {plan.pp}, {plan.dp}, {plan.zero_stage}, {plan.recompute} | "
              f"{plan.predicted_step_s:.2f} | {plan.uniform_step_s or float('nan'):.2f} | "
              f"{plan.evaluated_candidates} | {secs:.3f} | < {target:g} |")
        if per_type == 256:
            slot = (plan.ranks[0].node, plan.ranks[0].gpu)
            rsecs, (new, diff) = timed(
                lambda p=plan, c=cluster, r=request, s=slot: replan(p, r, c, slowdown={s: 1.3}), repeat=3
            )
            replan_row = (len(cluster), rsecs, len(diff), plan.predicted_step_s, new.predicted_step_s)
    n, rsecs, ndiff, before, after = replan_row
    print("\n### Re-plan after a straggler (one GPU 1.3x slower; live rebalance)\n")
    print("| GPUs | re-plan time s | GPUs whose micro-batches changed | step before s | step after s "
          "| target |")
    print("|---|---|---|---|---|---|")
    print(f"| {n} | {rsecs:.3f} | {ndiff} | {before:.3f} | {after:.3f} | < 0.2 |")


def search_quality(cases: int) -> None:
    print(f"\n### Search vs exhaustive ({cases} seeded random cases, <= 64 GPUs, <= 3 types)\n")
    rng = np.random.default_rng(2024)
    types = ["h100-sxm", "b200", "a100-sxm-80gb", "h200", "l40s", "a100-sxm-40gb"]
    gaps, times_fast, times_full = [], [], []
    worst = None
    for i in range(cases):
        k = int(rng.integers(1, 4))
        chosen = rng.choice(types, size=k, replace=False)
        counts = rng.integers(1, 65 // k, size=k)
        spec = ",".join(f"{t}:{int(c)}" for t, c in zip(chosen, counts, strict=True))
        layers = int(rng.integers(4, 17))
        hidden = int(rng.choice([1024, 2048, 3072]))
        model = ModelShape(name=f"case{i}", layers=layers, hidden=hidden, heads=16, seq_len=2048, vocab=32000)
        request = PlanRequest(model=model, global_batch=int(rng.choice([32, 64, 96, 128, 256])))
        cluster = parse_gpu_spec(spec)
        tf, fast = timed(lambda r=request, c=cluster: plan_job(r, c))
        te, full = timed(lambda r=request, c=cluster: plan_job(replace(r, exhaustive=True), c))
        gap = fast.predicted_step_s / full.predicted_step_s - 1
        gaps.append(gap)
        times_fast.append(tf)
        times_full.append(te)
        if worst is None or gap > worst[0]:
            worst = (gap, spec, layers, hidden, request.global_batch)
    print("| cases | median gap | worst gap | cases with gap 0 | mean search s | mean exhaustive s "
          "| target |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {cases} | {100 * statistics.median(gaps):.2f}% | {100 * max(gaps):.2f}% | "
          f"{sum(g <= 1e-12 for g in gaps)} | {statistics.mean(times_fast):.3f} | "
          f"{statistics.mean(times_full):.3f} | median <= 2%, worst <= 5% |")
    print(f"\nWorst case: `{worst[1]}`, {worst[2]} layers, hidden {worst[3]}, batch {worst[4]}.")


def heterogeneous_gain() -> None:
    print("\n### Heterogeneous split vs uniform split, 50/50 H100-SXM + B200 (compute-bound)\n")
    h100, b200 = lookup("h100-sxm"), lookup("b200")
    r = b200.capability_tflops("bf16") / h100.capability_tflops("bf16")
    r_peak = b200.peak("bf16") / h100.peak("bf16")
    print("| pool | model | global batch | plan (tp, pp, dp) | step s | uniform s | speedup | "
          "bound (1-f)+f r | share of bound | target |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, model, batch in (
        ("h100-sxm:32,b200:32", "llama-7b", 2048),
        ("h100-sxm:64,b200:64", "llama-13b", 4096),
        ("h100-sxm:128,b200:128", "llama-70b", 4096),
    ):
        cluster = parse_gpu_spec(spec)
        plan = plan_job(PlanRequest(model=resolve_model(model), global_batch=batch), cluster)
        bound = 0.5 + 0.5 * r
        speedup = plan.uniform_step_s / plan.predicted_step_s
        print(f"| {spec} | {model} | {batch} | {plan.tp}, {plan.pp}, {plan.dp} | "
              f"{plan.predicted_step_s:.3f} | {plan.uniform_step_s:.3f} | {speedup:.3f} | {bound:.3f} | "
              f"{speedup / bound:.1%} | >= 90% |")
    print(f"\nr = achieved-capability ratio B200/H100 = {r:.3f} (peak ratio {r_peak:.3f} x family "
          f"efficiency {b200.efficiency}/{h100.efficiency}); the peak-ratio bound would be "
          f"{0.5 + 0.5 * r_peak:.3f}.")


def elementwise_share(model: ModelShape, micro_batch: int, tp: int) -> float:
    """Share of one A100-80GB layer's compute time (full recompute, SP when tp > 1) spent in the
    memory-bound element-wise ops (``cost.layer_elementwise_step_bytes`` at HBM speed)."""
    a100 = lookup("a100-sxm-80gb")
    s = model.seq_len
    gemm_rate = a100.capability_tflops("bf16") * cost.MFU_TO_COMPUTE * 1e12
    gemm_rate *= cost.layer_gemm_efficiency(model, s, micro_batch, tp)
    gemm_s = cost.layer_forward_flops(model, s) * micro_batch * 4.0 / tp / gemm_rate
    mem_bytes = cost.layer_elementwise_step_bytes(model, s, micro_batch, tp, "full", tp > 1)
    mem_s = mem_bytes / (a100.memory_bw_bytes_s * cost.HBM_EFFICIENCY)
    return mem_s / (mem_s + gemm_s)


def narayanan() -> None:
    print("\n### Homogeneous sanity: Narayanan et al. 2021, Table 1 (A100-80GB, full recompute)\n")
    print("| model | TP | PP | GPUs | batch | published TFLOP/s/GPU | predicted TFLOP/s/GPU | error | "
          "micro-batch | GEMM-size eff. | element-wise share | predicted step s | "
          "with micro-batch 1: TFLOP/s/GPU, error, GEMM-size eff. |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors, errors_b1 = [], []
    for name, tp, pp, gpus, batch, published in NARAYANAN_TABLE_1:
        model = resolve_model(name)
        cluster = parse_gpu_spec(f"a100-sxm-80gb:{gpus}", network_gbs=SELENE_NODE_GBS)
        request = PlanRequest(
            model=model, global_batch=batch, strategy=(tp, pp, gpus // (tp * pp)), recompute="full",
            zero_stages=(0,),
        )
        plan = plan_job(request, cluster)
        plan_b1 = plan_job(replace(request, micro_batch=1), cluster)
        flops = batch * cost.model_flops_per_sample(model, model.seq_len, "full")  # their formula
        predicted = flops / plan.predicted_step_s / gpus / 1e12
        predicted_b1 = flops / plan_b1.predicted_step_s / gpus / 1e12
        err, err_b1 = predicted / published - 1, predicted_b1 / published - 1
        errors.append(err)
        errors_b1.append(err_b1)
        eff = cost.layer_gemm_efficiency(model, model.seq_len, plan.micro_batch_size, tp)
        eff_b1 = cost.layer_gemm_efficiency(model, model.seq_len, 1, tp)
        share = elementwise_share(model, plan.micro_batch_size, tp)
        print(f"| {name} | {tp} | {pp} | {gpus} | {batch} | {published} | {predicted:.0f} | {err:+.1%} | "
              f"{plan.micro_batch_size} | {eff:.3f} | {share:.1%} | {plan.predicted_step_s:.2f} | "
              f"{predicted_b1:.0f}, {err_b1:+.1%}, {eff_b1:.3f} |")
    for label, errs in (("Planner's micro-batch", errors), ("Micro-batch 1", errors_b1)):
        print(f"\n{label}: mean absolute error {statistics.mean(abs(e) for e in errs):.1%}, worst "
              f"{max(errs, key=abs):+.1%}, {sum(abs(e) <= 0.2 for e in errs)} of {len(errs)} within 20%.")
    ampere = lookup("a100-sxm-80gb").efficiency
    print(f"\nLarge-GEMM compute efficiency assumed for A100: catalog MFU {ampere} x MFU_TO_COMPUTE "
          f"{cost.MFU_TO_COMPUTE:.3f} = {ampere * cost.MFU_TO_COMPUTE:.3f}; element-wise ops at "
          f"HBM_EFFICIENCY {cost.HBM_EFFICIENCY} x 2.039 TB/s.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=50, help="exhaustive comparisons (default 50)")
    args = parser.parse_args()
    scale()
    heterogeneous_gain()
    narayanan()
    search_quality(args.cases)


if __name__ == "__main__":
    main()
