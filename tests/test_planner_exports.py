"""Planner exports (Megatron-LM, DeepSpeed, Ray, KAI, micro-batch map) and plan rendering.

Framework checks use the frameworks' own code: megatron-core's `TransformerConfig` and
`PipelineParallelLayerLayout`, DeepSpeed's `DeepSpeedConfig` inside a real gloo process
group, and the KAI PodGroup CRD's openAPIV3Schema through `jsonschema`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from rich.console import Console

from fleetwise.catalog import lookup
from fleetwise.planner.exports import (
    ExportError,
    check_megatron_rules,
    common_micro_batch,
    deepspeed_config,
    kai_envelope,
    megatron_arg_dict,
    megatron_args,
    microbatch_map,
    pipeline_layout,
    ray_accelerator_type,
    ray_scaling_config,
    stage_layer_counts,
)
from fleetwise.planner.render import plan_figure, plan_summary, plan_table, rank_ranges, simulate_1f1b
from fleetwise.schemas import ModelShape, Plan, RankPlan

SHARED = Path(__file__).resolve().parents[2] / "shared"
REPO = Path(__file__).resolve().parents[1]


# ---- hand-built plans ------------------------------------------------------------------------


def build_plan(
    replicas: list[tuple[str, int, int]],
    stage_layers: list[int],
    tp: int = 1,
    *,
    zero: int = 1,
    dtype: str = "bf16",
    recompute: str = "none",
    sequence_parallel: bool = False,
    gpus_per_node: int = 8,
    model_name: str = "test-model",
) -> Plan:
    """One data-parallel replica per (gpu model, micro_batch, num_micro_batches)."""
    pp = len(stage_layers)
    ranks = []
    node_index: dict[str, int] = {}
    rank = 0
    starts = np.cumsum([0, *stage_layers])
    for dp_rank, (gpu, micro, count) in enumerate(replicas):
        spec = lookup(gpu)
        for stage in range(pp):
            for t in range(tp):
                used = node_index.get(gpu, 0)
                node_index[gpu] = used + 1
                ranks.append(
                    RankPlan(
                        rank=rank,
                        node=f"{spec.id}-n{used // gpus_per_node:03d}",
                        gpu=used % gpus_per_node,
                        model=spec.id,
                        capability_tflops=spec.capability_tflops(dtype),
                        micro_batch=micro,
                        num_micro_batches=count,
                        stage=stage,
                        layers=(int(starts[stage]), int(starts[stage + 1] - 1)),
                        dp_rank=dp_rank,
                        tp_rank=t,
                        memory_gb=0.6 * spec.memory_gb,
                        memory_capacity_gb=spec.memory_gb,
                    )
                )
                rank += 1
    global_batch = sum(m * c for _, m, c in replicas)
    return Plan(
        job="llm-test",
        model=model_name,
        dtype=dtype,
        dp=len(replicas),
        tp=tp,
        pp=pp,
        zero_stage=zero,
        global_batch=global_batch,
        seq_len=2048,
        recompute=recompute,
        sequence_parallel=sequence_parallel,
        predicted_step_s=1.5,
        uniform_step_s=2.1,
        tokens_per_s=global_batch * 2048 / 1.5,
        mfu=0.41,
        ranks=ranks,
    )


MODEL = ModelShape(name="test-model", layers=32, hidden=4096, heads=32, seq_len=2048, vocab=32000)
GQA_MODEL = ModelShape(
    name="gqa", layers=24, hidden=2048, heads=16, seq_len=4096, vocab=32000, ffn_hidden=5632, kv_heads=4
)


def uniform_plan(**kw) -> Plan:
    return build_plan([("h100-sxm", 2, 4)] * 4, [32], **kw)


def uneven_first_last_plan() -> Plan:
    # Middle stages even (9, 9), first and last differ: the --decoder-first/last flags.
    return build_plan([("b200", 4, 5), ("h100-sxm", 4, 3)], [6, 9, 9, 8], tp=2)


def uneven_layout_plan() -> Plan:
    # Middle stages differ (10, 7, 7): needs --pipeline-model-parallel-layout.
    return build_plan([("b200", 2, 6), ("h100-sxm", 2, 2)], [5, 10, 7, 7, 3])


# ---- Megatron-LM -----------------------------------------------------------------------------


def _flag_value(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_megatron_args_uniform_plan_carry_parallelism_and_batch():
    plan = uniform_plan()
    args = megatron_args(plan, MODEL)
    assert _flag_value(args, "--tensor-model-parallel-size") == "1"
    assert _flag_value(args, "--pipeline-model-parallel-size") == "1"
    assert _flag_value(args, "--global-batch-size") == "32"
    # Megatron derives num_microbatches = global / (micro x dp); it must equal the plan's count.
    micro = int(_flag_value(args, "--micro-batch-size"))
    assert plan.global_batch // (micro * plan.dp) == plan.ranks[0].num_micro_batches
    assert "--bf16" in args and "--fp16" not in args
    assert "--use-distributed-optimizer" in args
    assert "--pipeline-model-parallel-layout" not in args
    assert "--decoder-first-pipeline-num-layers" not in args
    assert "--group-query-attention" not in args


def test_megatron_args_gqa_and_zero0_fp16():
    plan = build_plan([("a100-sxm-80gb", 1, 8)] * 2, [12, 12], tp=4, zero=0, dtype="fp16")
    args = megatron_args(plan, GQA_MODEL)
    assert "--group-query-attention" in args
    assert _flag_value(args, "--num-query-groups") == "4"
    assert _flag_value(args, "--ffn-hidden-size") == "5632"
    assert "--fp16" in args and "--bf16" not in args
    assert "--use-distributed-optimizer" not in args
    assert int(_flag_value(args, "--max-position-embeddings")) >= int(_flag_value(args, "--seq-length"))


def test_megatron_uneven_first_last_uses_first_last_flags():
    args = megatron_args(uneven_first_last_plan(), MODEL)
    assert _flag_value(args, "--decoder-first-pipeline-num-layers") == "6"
    assert _flag_value(args, "--decoder-last-pipeline-num-layers") == "8"
    assert "--pipeline-model-parallel-layout" not in args


def test_megatron_uneven_middle_uses_layout():
    args = megatron_args(uneven_layout_plan(), MODEL)
    assert "--pipeline-model-parallel-layout" in args
    assert "--decoder-first-pipeline-num-layers" not in args


def test_megatron_uneven_microbatch_uses_common_size_that_megatron_accepts():
    plan = build_plan([("b200", 6, 4), ("h100-sxm", 4, 2)], [32])  # 24 + 8 = 32
    micro = common_micro_batch(plan)
    assert all(r.micro_batch % micro == 0 for r in plan.ranks)
    assert plan.global_batch % (micro * plan.dp) == 0
    assert check_megatron_rules(megatron_arg_dict(plan, MODEL)) == []


def test_recompute_and_sequence_parallel_flags():
    plan = build_plan([("h100-sxm", 2, 4)] * 2, [16, 16], tp=2, recompute="full", sequence_parallel=True)
    args = megatron_args(plan, MODEL)
    assert _flag_value(args, "--recompute-granularity") == "full"
    assert _flag_value(args, "--recompute-method") in ("uniform", "block")
    assert "--recompute-num-layers" in args
    assert "--sequence-parallel" in args
    selective = megatron_args(
        build_plan([("h100-sxm", 2, 4)] * 2, [32], tp=2, recompute="selective"), MODEL
    )
    assert _flag_value(selective, "--recompute-granularity") == "selective"
    assert "--recompute-method" not in selective


def test_megatron_rejects_replicas_with_different_layer_splits():
    plan = uniform_plan()
    bad = plan.model_copy(deep=True)
    bad.ranks[0] = bad.ranks[0].model_copy(update={"layers": (0, 30)})
    with pytest.raises(ExportError, match="same layer split"):
        megatron_args(bad, MODEL)


def test_megatron_rejects_non_contiguous_stages():
    plan = build_plan([("h100-sxm", 2, 4)], [16, 16])
    gap = plan.model_copy(deep=True)
    gap.ranks[1] = gap.ranks[1].model_copy(update={"layers": (17, 31)})
    with pytest.raises(ExportError, match="contiguous"):
        stage_layer_counts(gap, 32)


@pytest.mark.slow
def test_pipeline_layout_expands_to_plan_counts_with_megatron_grammar():
    # Megatron's own expansion; checked against our counts for many shapes.
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    for counts in ([4], [1, 1], [5, 3, 3, 2], [2, 7, 7, 7, 1], [3, 1, 1, 4, 4, 2], [12, 11, 12, 11, 1]):
        layout = pipeline_layout(counts)
        stages = PipelineParallelLayerLayout.parse_str_to_list(layout)
        assert [sum(1 for x in stage if x.name == "decoder") for stage in stages] == counts, layout
        assert stages[0][0].name == "embedding" and stages[-1][-1].name == "loss"


LAYOUT = "pipeline_model_parallel_layout"

# Each entry: what to break, and a fragment of the violation message.
RULE_CASES = [
    ({"hidden_size": 4100}, "hidden size 4100 is not divisible by attention heads 32"),
    ({"tensor_model_parallel_size": 3, "world_size": 12}, "attention heads 32 must be a multiple"),
    ({"global_batch_size": 30}, "global batch size 30 is not divisible"),
    ({"num_layers": 30, "pipeline_model_parallel_size": 4, "world_size": 16}, "not divisible by pipeline"),
    ({"sequence_parallel": True}, "sequence parallelism needs tensor parallel size > 1"),
    ({"max_position_embeddings": 1024}, "max position embeddings 1024 must be >= seq length 2048"),
    ({"fp16": True}, "only one of --bf16 and --fp16"),
    ({"recompute_granularity": "full"}, "needs recompute method"),
    ({"recompute_granularity": "selective", "recompute_method": "uniform"}, "not supported with selective"),
    ({"recompute_granularity": "selective", "recompute_num_layers": 1}, "must be unset with selective"),
    ({"world_size": 6, "pipeline_model_parallel_size": 4}, "world size 6 is not divisible"),
    ({"micro_batch_size": 0}, "micro batch size must be > 0"),
    ({"group_query_attention": True, "num_query_groups": 5}, "not divisible by query groups 5"),
    ({"ffn_hidden_size": 11001, "tensor_model_parallel_size": 2, "world_size": 8}, "ffn hidden size 11001"),
    (
        {"pipeline_model_parallel_size": 4, "world_size": 16, "decoder_first_pipeline_num_layers": 6},
        "26 middle layers are not divisible by 3",
    ),
    (
        {"pipeline_model_parallel_size": 2, "world_size": 8, "decoder_first_pipeline_num_layers": 32},
        "0 middle layers remain for 1",
    ),
    (
        {"pipeline_model_parallel_size": 2, "world_size": 8, LAYOUT: "Et*10|t*20,L"},
        "holds 30 decoder layers",
    ),
    (
        {"pipeline_model_parallel_size": 3, "world_size": 12, LAYOUT: "Et*16|t*16,L"},
        "not a multiple of pipeline size 3",
    ),
    (
        {"pipeline_model_parallel_size": 2, "world_size": 8, LAYOUT: "t*16|Et*16,L"},
        "must start with the embedding",
    ),
]


@pytest.mark.parametrize(("change", "message"), RULE_CASES)
def test_check_megatron_rules_flags_each_violation(change, message):
    base = megatron_arg_dict(uniform_plan(), MODEL)
    assert check_megatron_rules(base) == []
    violations = check_megatron_rules({**base, **change})
    assert any(message in v for v in violations), violations


def test_megatron_args_strict_raises_with_all_violations():
    plan = build_plan([("h100-sxm", 2, 4)] * 2, [32], sequence_parallel=True)
    with pytest.raises(ExportError) as info:
        megatron_args(plan, MODEL)
    assert any("sequence parallelism" in v for v in info.value.violations)
    assert "--sequence-parallel" in megatron_args(plan, MODEL, strict=False)


def _transformer_config_kwargs(args: dict) -> dict:
    import torch

    kwargs = dict(
        num_layers=args["num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        ffn_hidden_size=args["ffn_hidden_size"],
        tensor_model_parallel_size=args["tensor_model_parallel_size"],
        pipeline_model_parallel_size=args["pipeline_model_parallel_size"],
        sequence_parallel=args["sequence_parallel"],
        gated_linear_unit=args["swiglu"],
        bf16=args["bf16"],
        fp16=args["fp16"],
        params_dtype=torch.bfloat16 if args["bf16"] else torch.float16 if args["fp16"] else torch.float32,
        recompute_granularity=args["recompute_granularity"],
        recompute_method=args["recompute_method"],
        recompute_num_layers=args["recompute_num_layers"],
        num_layers_in_first_pipeline_stage=args["decoder_first_pipeline_num_layers"],
        num_layers_in_last_pipeline_stage=args["decoder_last_pipeline_num_layers"],
        pipeline_model_parallel_layout=args["pipeline_model_parallel_layout"],
    )
    if args["pipeline_model_parallel_size"] > 1:
        kwargs["pipeline_dtype"] = kwargs["params_dtype"]
    if args["group_query_attention"]:
        kwargs["num_query_groups"] = args["num_query_groups"]
    return kwargs


def _megatron_stage_counts(config, pp: int) -> list[int]:
    """Decoder layers per pipeline rank as Megatron computes them from its config."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    layout = config.pipeline_model_parallel_layout
    if layout is not None:
        # get_num_layers_to_build ignores pp_rank for layouts (reads the initialised PP group).
        return [layout.get_num_layers_to_build(LayerType.decoder, pp_rank=rank) for rank in range(pp)]
    return [get_num_layers_to_build(config, vp_stage=None, pp_rank=rank) for rank in range(pp)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("plan", "model"),
    [
        (uniform_plan(), MODEL),
        (uneven_first_last_plan(), MODEL),
        (uneven_layout_plan(), MODEL),
        (build_plan([("a100-sxm-80gb", 1, 8)] * 2, [12, 12], tp=4, zero=0, dtype="fp16"), GQA_MODEL),
        (build_plan([("h100-sxm", 2, 4)] * 2, [16, 16], tp=2, recompute="full", sequence_parallel=True), MODEL),  # noqa: E501
        (build_plan([("b200", 3, 4), ("h200", 1, 4)], [9, 8, 7], tp=2, recompute="selective"), GQA_MODEL),
    ],
    ids=["uniform", "first-last", "layout", "gqa-fp16", "full-recompute-sp", "selective-3stage"],
)
def test_megatron_transformer_config_accepts_export_and_builds_plan_stages(plan, model):
    from megatron.core.transformer import TransformerConfig

    args = megatron_arg_dict(plan, model)
    assert check_megatron_rules(args) == []
    config = TransformerConfig(**_transformer_config_kwargs(args))
    assert config.tensor_model_parallel_size == plan.tp
    assert config.pipeline_model_parallel_size == plan.pp
    assert _megatron_stage_counts(config, plan.pp) == stage_layer_counts(plan, model.layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model_name", "gpus", "global_batch", "strategy"),
    [
        ("llama-13b", "a100-sxm-40gb:8,h100-sxm:8", 64, (1, 4, 4)),
        ("gpt-39b", "a100-sxm-80gb:16,b200:16", 256, None),
        ("llama-7b", "h100-sxm:8,b200:8", 128, None),
    ],
)
def test_planner_plans_export_to_a_valid_megatron_config(model_name, gpus, global_batch, strategy):
    # End to end: plans from the planner core, exported, accepted by megatron-core, and
    # Megatron builds exactly the plan's layers on every pipeline rank.
    from megatron.core.transformer import TransformerConfig

    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    model = resolve_model(model_name)
    request = PlanRequest(model=model, global_batch=global_batch, strategy=strategy)
    plan = plan_job(request, parse_gpu_spec(gpus))
    args = megatron_arg_dict(plan, model)
    assert check_megatron_rules(args) == []
    config = TransformerConfig(**_transformer_config_kwargs(args))
    assert _megatron_stage_counts(config, plan.pp) == stage_layer_counts(plan, model.layers)


@pytest.mark.slow
@pytest.mark.parametrize(
    "change",
    [
        {"tensor_model_parallel_size": 3, "world_size": 12},
        {"recompute_granularity": "full"},
        {"recompute_granularity": "selective", "recompute_num_layers": 1},
        {"pipeline_model_parallel_size": 4, "world_size": 16, "decoder_first_pipeline_num_layers": 6},
        {"pipeline_model_parallel_size": 2, "world_size": 8, LAYOUT: "Et*10|t*20,L"},
        {"group_query_attention": True, "num_query_groups": 3, "tensor_model_parallel_size": 2},
    ],
)
def test_megatron_rules_agree_with_transformer_config_rejections(change):
    # Where megatron-core itself validates, a violation we report must also fail there.
    from megatron.core.transformer import TransformerConfig

    args = {**megatron_arg_dict(uniform_plan(), MODEL), **change}
    assert check_megatron_rules(args)
    with pytest.raises((ValueError, AssertionError)):
        TransformerConfig(**_transformer_config_kwargs(args))


# ---- micro-batch map -------------------------------------------------------------------------


def test_microbatch_map_shares_and_weights():
    plan = build_plan([("b200", 4, 5), ("h100-sxm", 4, 3)], [32], tp=2)
    mb = microbatch_map(plan)
    assert mb["dp"] == 2 and mb["tp"] == 2 and mb["pp"] == 1
    assert len(mb["ranks"]) == len(plan.ranks)
    assert sum(r["samples"] for r in mb["replicas"]) == plan.global_batch
    assert sum(r["grad_weight"] for r in mb["replicas"]) == pytest.approx(1.0)
    by_rank = {r.rank: r for r in plan.ranks}
    for entry in mb["ranks"]:
        source = by_rank[entry["rank"]]
        assert entry["micro_batch"] * entry["num_micro_batches"] == entry["samples"] == source.samples
        assert entry["dp_rank"] == source.dp_rank and entry["stage"] == source.stage
    json.dumps(mb)  # the plugin reads it as JSON


def test_grad_weights_reproduce_the_full_batch_gradient():
    # Least squares on a global batch split unevenly over replicas: weighting each replica's
    # mean gradient by grad_weight and summing gives the full-batch mean gradient; 1/DP does not.
    plan = build_plan([("b200", 5, 4), ("h100-sxm", 3, 2), ("a100-sxm-80gb", 2, 1)], [32])
    mb = microbatch_map(plan)
    rng = np.random.default_rng(7)
    x = rng.normal(size=(plan.global_batch, 6))
    y = rng.normal(size=plan.global_batch)
    w = rng.normal(size=6)

    def mean_grad(xs, ys):
        return 2 * xs.T @ (xs @ w - ys) / len(ys)

    full = mean_grad(x, y)
    start = 0
    weighted = np.zeros(6)
    naive = np.zeros(6)
    for replica in mb["replicas"]:
        n = replica["samples"]
        g = mean_grad(x[start : start + n], y[start : start + n])
        weighted += replica["grad_weight"] * g
        naive += g / plan.dp
        start += n
    assert start == plan.global_batch
    np.testing.assert_allclose(weighted, full, rtol=1e-12, atol=1e-12)
    assert not np.allclose(naive, full)


def test_microbatch_map_rejects_inconsistent_replica():
    plan = build_plan([("h100-sxm", 2, 4)] * 2, [16, 16])
    bad = plan.model_copy(deep=True)
    bad.ranks[1] = bad.ranks[1].model_copy(update={"num_micro_batches": 5})
    with pytest.raises(ExportError, match="replica 0"):
        microbatch_map(bad)


# ---- DeepSpeed -------------------------------------------------------------------------------


def test_deepspeed_config_batch_relation_and_precision():
    uneven_shares = build_plan([("b200", 6, 4), ("h100-sxm", 4, 2)], [32])
    for plan in (uniform_plan(), uneven_first_last_plan(), uneven_shares):
        config = deepspeed_config(plan)
        assert config["train_batch_size"] == plan.global_batch
        assert (
            config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * plan.dp
            == plan.global_batch
        )
        assert config["bf16"] == {"enabled": True} and "fp16" not in config
        assert config["zero_optimization"]["stage"] == plan.zero_stage
    fp16 = deepspeed_config(build_plan([("v100-sxm2-32gb", 2, 2)] * 2, [32], zero=2, dtype="fp16"))
    assert fp16["fp16"]["enabled"] is True and "bf16" not in fp16


def test_deepspeed_config_rejects_zero2_with_pipeline():
    with pytest.raises(ExportError, match="ZeRO stage 0 or 1"):
        deepspeed_config(build_plan([("h100-sxm", 2, 2)] * 2, [16, 16], zero=2))


_DS_SCRIPT = textwrap.dedent(
    """
    import json, os, socket, sys
    import torch.multiprocessing as mp

    def worker(rank, world, port, cases, out):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world))
        import deepspeed
        import torch.distributed as dist
        from deepspeed.runtime.config import DeepSpeedConfig

        deepspeed.init_distributed(dist_backend="gloo", rank=rank, world_size=world)
        results = []
        for case in cases:
            groups = [dist.new_group(members) for members in case["dp_groups"]]
            mine = next(g for g, members in zip(groups, case["dp_groups"]) if rank in members)

            class DataParallelMpu:  # DeepSpeed's mpu interface: data-parallel size from a real group
                def get_data_parallel_world_size(self):
                    return dist.get_world_size(group=mine)

                def get_data_parallel_rank(self):
                    return dist.get_rank(group=mine)

            try:
                c = DeepSpeedConfig(case["config"], mpu=DataParallelMpu() if case["use_mpu"] else None)
                results.append({"ok": True, "world_size": c.world_size,
                                "train_batch_size": c.train_batch_size,
                                "micro": c.train_micro_batch_size_per_gpu,
                                "gas": c.gradient_accumulation_steps,
                                "zero_stage": c.zero_optimization_stage,
                                "bf16": c.bfloat16_config.enabled})
            except Exception as exc:
                results.append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        spec = json.load(open(sys.argv[1]))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        world = spec["world_size"]
        mp.spawn(worker, args=(world, port, spec["cases"], sys.argv[2]), nprocs=world)
    """
)


def _dp_groups(plan: Plan) -> list[list[int]]:
    groups: dict[tuple[int, int], list[int]] = {}
    for r in plan.ranks:
        groups.setdefault((r.stage, r.tp_rank), []).append(r.rank)
    return [sorted(g) for g in groups.values()]


@pytest.mark.slow
def test_deepspeed_config_validates_in_real_gloo_group(tmp_path):
    # Three 4-GPU plans: pure DP, DP x PP, and uneven DP shares; plus a broken config that
    # DeepSpeed must reject, so the check is shown to bite.
    dp4 = build_plan([("h100-sxm", 2, 4)] * 4, [32])
    dp2pp2 = build_plan([("h100-sxm", 2, 4)] * 2, [16, 16])
    uneven = build_plan([("b200", 6, 2), ("h100-sxm", 2, 2), ("b200", 6, 2), ("h100-sxm", 2, 2)], [32])
    broken = {**deepspeed_config(dp4), "gradient_accumulation_steps": 3}
    cases = [
        {"config": deepspeed_config(dp4), "dp_groups": _dp_groups(dp4), "use_mpu": False},
        {"config": deepspeed_config(dp2pp2), "dp_groups": _dp_groups(dp2pp2), "use_mpu": True},
        {"config": deepspeed_config(uneven), "dp_groups": _dp_groups(uneven), "use_mpu": True},
        {"config": broken, "dp_groups": _dp_groups(dp4), "use_mpu": False},
    ]
    (tmp_path / "ds_check.py").write_text(_DS_SCRIPT)
    (tmp_path / "spec.json").write_text(json.dumps({"world_size": 4, "cases": cases}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    # DeepSpeed's CPU accelerator leaves its shared-memory all-reduce buffers in /dev/shm
    # (~70 MB per rank per run); remove the ones this run made.
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_*")) if shm.is_dir() else set()
    try:
        proc = subprocess.run(
            [sys.executable, str(tmp_path / "ds_check.py"), str(tmp_path / "spec.json"), str(tmp_path)],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        for leftover in (set(shm.glob("deepspeed_*")) if shm.is_dir() else set()) - before:
            leftover.unlink(missing_ok=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(4):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for result, plan in zip(results[:3], (dp4, dp2pp2, uneven), strict=True):
            assert result["ok"], result
            assert result["world_size"] == plan.dp
            assert result["train_batch_size"] == plan.global_batch
            assert result["zero_stage"] == plan.zero_stage and result["bf16"] is True
        assert not results[3]["ok"] and "train_batch_size is not equal" in results[3]["error"]


# ---- Ray -------------------------------------------------------------------------------------


def test_ray_accelerator_types_follow_ray_names():
    # Names as Ray defines them (ray/util/accelerators/accelerators.py) and as its NVIDIA
    # manager derives them from NVML names.
    assert ray_accelerator_type("h100-sxm") == "H100"
    assert ray_accelerator_type("NVIDIA H100 80GB HBM3") == "H100"
    assert ray_accelerator_type("b200") == "B200"
    assert ray_accelerator_type("h200") == "H200"
    assert ray_accelerator_type("a100-sxm-80gb") == "A100-80G"
    assert ray_accelerator_type("a100-sxm-40gb") == "A100-40G"
    assert ray_accelerator_type("v100-sxm2-32gb") == "V100"
    assert ray_accelerator_type("mi300x") == "AMD-Instinct-MI300X-OAM"
    assert ray_accelerator_type("no-such-gpu") is None


def test_ray_scaling_config_single_and_mixed():
    single = ray_scaling_config(uniform_plan())
    assert single["num_workers"] == 4 and single["use_gpu"] is True
    assert single["accelerator_type"] == "H100"
    assert single["resources_per_worker"] == {"GPU": 1}
    mixed_plan = uneven_first_last_plan()
    mixed = ray_scaling_config(mixed_plan)
    assert mixed["accelerator_type"] is None
    workers = sum(g["num_workers"] for g in mixed["worker_groups"])
    assert workers == mixed["num_workers"] == len(mixed_plan.ranks)
    types = {g["accelerator_type"] for g in mixed["worker_groups"]}
    assert types == {"B200", "H100"}
    for group in mixed["worker_groups"]:
        assert f"accelerator_type:{group['accelerator_type']}" in group["resources_per_worker"]
        assert {mixed_plan.ranks[r].model for r in group["ranks"]} == {group["gpu_model"]}
    assert mixed["placement_strategy"] in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


# ---- KAI Scheduler ---------------------------------------------------------------------------


def _crd_schema(path: Path) -> dict:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    crd = next(d for d in docs if d.get("kind") == "CustomResourceDefinition")
    served = [v for v in crd["spec"]["versions"] if v.get("served")]
    version = next(v for v in served if v["name"] == "v2alpha2")
    return version["schema"]["openAPIV3Schema"]


@pytest.fixture(scope="module")
def podgroup_schema() -> dict:
    shared = SHARED / "data" / "kai" / "scheduling.run.ai_podgroups.yaml"
    packaged = REPO / "fleetwise" / "kube" / "crds" / "scheduling.run.ai_podgroups.yaml"
    if shared.exists():
        # The package copy must be the real CRD, unchanged.
        assert packaged.read_text() == shared.read_text()
    return _crd_schema(packaged)


def test_kai_envelope_podgroup_matches_crd(podgroup_schema):
    import jsonschema

    from fleetwise.kube.crds import validate_manifest

    plan = build_plan([("b200", 4, 5), ("h100-sxm", 4, 3)] * 4, [8, 8, 8, 8], tp=2)  # 32 + 32 GPUs
    env = kai_envelope(plan, "llm-test", "team-a")
    pod_group = env["pod_group"]
    jsonschema.Draft7Validator(podgroup_schema).validate(pod_group)
    assert validate_manifest(pod_group) == []
    assert pod_group["apiVersion"] == "scheduling.run.ai/v2alpha2" and pod_group["kind"] == "PodGroup"
    assert pod_group["spec"]["queue"] == "team-a"
    # Gang: every pod; default one pod per node (8 GPUs each).
    assert pod_group["spec"]["minMember"] == env["min_member"] == 64 // 8
    assert sum(s["minMember"] for s in pod_group["spec"]["subGroups"]) == env["min_member"]
    assert {g["gpu_model"]: g["gpus"] for g in env["node_groups"]} == {"b200": 32, "h100-sxm": 32}


def test_kai_envelope_pod_hints_resolve_back_to_plan_gpus():
    plan = uneven_first_last_plan()
    env = kai_envelope(plan, "LLM_Test", "q1", gpus_per_pod=4)
    assert env["min_member"] == len(plan.ranks) // 4
    for template in env["pod_templates"]:
        spec = template["spec"]
        assert spec["schedulerName"] == "kai-scheduler"
        assert template["metadata"]["labels"]["kai.scheduler/queue"] == "q1"
        assert template["metadata"]["annotations"]["pod-group-name"] == env["pod_group"]["metadata"]["name"]
        product = spec["nodeSelector"]["nvidia.com/gpu.product"]
        # The GFD product label resolves, through the catalog, to the GPU the plan uses.
        assert lookup(product).id == template["gpu_model"]
        assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    names = {s["name"] for s in env["pod_group"]["spec"]["subGroups"]}
    assert {t["metadata"]["labels"]["kai.scheduler/subgroup-name"] for t in env["pod_templates"]} == names
    assert env["pod_group"]["metadata"]["name"] == "llm-test"  # a DNS label


def test_kai_envelope_rejects_bad_pod_split_and_validation_catches_bad_objects():
    from fleetwise.kube.crds import validate_manifest

    plan = build_plan([("h100-sxm", 2, 2)] * 3, [32])  # 3 GPUs
    with pytest.raises(ExportError, match="cannot be split into pods of 2"):
        kai_envelope(plan, "j", "q", gpus_per_pod=2)
    good = kai_envelope(plan, "j", "q")["pod_group"]
    assert validate_manifest({**good, "spec": {**good["spec"], "minMember": 0}})
    assert validate_manifest({**good, "apiVersion": "scheduling.run.ai/v1"})


# ---- rendering -------------------------------------------------------------------------------


def _render(renderable) -> str:
    console = Console(width=200, record=True, force_terminal=False)
    console.print(renderable)
    return console.export_text()


def test_plan_table_one_row_per_gpu_for_small_plans():
    plan = uneven_first_last_plan()
    text = _render(plan_table(plan))
    for r in plan.ranks:
        assert r.node in text
    assert "b200" in text and "h100-sxm" in text
    assert "4 x 5" in text and "4 x 3" in text  # micro-batch x count per replica


def test_plan_table_groups_large_plans():
    plan = build_plan([("b200", 4, 5)] * 8 + [("h100-sxm", 4, 3)] * 8, [8, 8, 8, 8], tp=4)  # 512 GPUs
    table = plan_table(plan)
    assert len(plan.ranks) > 64
    # One row per (model, stage) here; the counts add up to every GPU.
    assert table.row_count == 2 * 4
    counts = [int(c) for c in table.columns[1]._cells]
    assert sum(counts) == len(plan.ranks)


def test_rank_ranges():
    assert rank_ranges([7, 0, 1, 2, 5, 8]) == "0-2,5,7-8"
    assert rank_ranges([]) == ""


def test_plan_summary_states_parallelism_and_prediction():
    plan = uneven_first_last_plan()
    text = plan_summary(plan)
    assert f"DP={plan.dp}" in text and f"TP={plan.tp}" in text and f"PP={plan.pp}" in text
    assert f"ZeRO={plan.zero_stage}" in text
    assert f"{plan.speedup:.2f}x" in text
    assert "tokens/s" in text and "MFU" in text


def test_simulate_1f1b_bubble_matches_closed_form():
    # Equal stages: the 1F1B step is (m + p - 1) (f + b), so the bubble fraction is
    # (p - 1) / (m + p - 1) (REFERENCE.md, Narayanan et al. 2021).
    for p, m in ((4, 8), (2, 1), (5, 3), (1, 4)):
        events = simulate_1f1b([1.0] * p, m)
        makespan = max(e[3] for stage in events for e in stage)
        busy = m * 3.0
        assert makespan == pytest.approx((m + p - 1) * 3.0)
        assert 1 - busy / makespan == pytest.approx((p - 1) / (m + p - 1))
        for stage in events:  # each stage does every forward and backward once, without overlap
            expected = [("F", j) for j in range(m)] + [("B", j) for j in range(m)]
            assert sorted((k, j) for k, j, _, _ in stage) == sorted(expected)
            spans = sorted((s, e) for _, _, s, e in stage)
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:], strict=False))


def _png(fig, path):
    fig.savefig(path, dpi=110)
    return path


def test_plan_figure_renders_png(tmp_path):
    plan = uneven_first_last_plan()
    timeline = [
        {"dp_rank": d, "stage": s, "compute_s": 1.0 + 0.1 * s, "comm_s": 0.1, "sync_s": 0.2}
        for d in range(plan.dp)
        for s in range(plan.pp)
    ]
    out = _png(plan_figure(plan, timeline), tmp_path / "plan.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    big = build_plan([("b200", 4, 5)] * 8 + [("h100-sxm", 4, 3)] * 8, [8, 8, 8, 8], tp=2)
    assert _png(plan_figure(big, None), tmp_path / "big.png").stat().st_size > 10_000


def test_stage_spans_is_the_one_check_of_a_stage_layout():
    from fleetwise.planner.stages import stage_spans

    assert stage_spans({"1": [2, 3], "0": [0, 1]}, last=3) == {0: (0, 1), 1: (2, 3)}
    assert stage_spans({0: (4, 9)}, first=4) == {0: (4, 9)}  # the end unchecked without `last`
    for layout, kw, says in [
        ({0: (0, 1), 1: (3, 3)}, {}, "stage 1 holds layers 3-3; .* from 0 in stage order"),
        ({0: (1, 3)}, {"first": 0, "last": 3}, "stage 0 holds layers 1-3; .* from 0 to 3"),
        ({0: (0, 1)}, {"last": 3}, "the stages end at layer 1, the model's last is 3"),
        ({0: (0, 1), 2: (2, 3)}, {}, r"stages \[0, 2\] do not cover 0..1"),
        ({}, {}, "do not cover"),
        ({0: (0, "x")}, {}, "integers"),
        ({0: (0,)}, {}, "integers"),
    ]:
        with pytest.raises(ValueError, match=says):
            stage_spans(layout, **kw)
