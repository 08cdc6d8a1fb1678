"""Turn a `Plan` into what training frameworks and schedulers read.

Pure functions over plain data: each returns a list, dict or string and writes nothing.

- `megatron_args`: the Megatron-LM command-line arguments (with `check_megatron_rules`,
  the checks Megatron's own launcher applies, so a bad plan fails here, not on 1,000 GPUs).
- `microbatch_map`: the per-rank micro-batch shares the training plugin applies, with the
  gradient weights that keep the update exact when shares are unequal.
- `deepspeed_config`: a DeepSpeed config dict.
- `ray_scaling_config`: Ray Train `ScalingConfig` as data, with per-GPU-type worker groups.
- `kai_envelope`: the KAI Scheduler job envelope (per GPU type counts, PodGroup manifest,
  pod template hints).

Frameworks take one micro-batch size for every rank. An uneven plan (different samples
per data-parallel replica) is exported with the plan's *common* micro-batch (the largest
divisor of every rank's micro-batch that keeps the framework's batch arithmetic exact);
the per-replica shares are then applied by the Fleetwise training plugin from
`microbatch_map`.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from fleetwise.catalog import GpuSpec, UnknownGpuError, lookup
from fleetwise.planner.stages import stage_spans
from fleetwise.schemas import ModelShape, Plan, RankPlan

__all__ = [
    "ExportError",
    "check_megatron_rules",
    "common_micro_batch",
    "deepspeed_config",
    "kai_envelope",
    "megatron_arg_dict",
    "megatron_args",
    "microbatch_map",
    "pipeline_layout",
    "ray_accelerator_type",
    "ray_scaling_config",
    "stage_layer_counts",
]

# Keys of `megatron_arg_dict` that describe the launch, not a Megatron flag.
_LAUNCHER_KEYS = frozenset({"world_size"})

# KAI Scheduler names (github.com/NVIDIA/KAI-Scheduler; REFERENCE.md "Kubernetes and KAI").
KAI_SCHEDULER_NAME = "kai-scheduler"
KAI_QUEUE_LABEL = "kai.scheduler/queue"
KAI_SUBGROUP_LABEL = "kai.scheduler/subgroup-name"
KAI_POD_GROUP_ANNOTATION = "pod-group-name"
KAI_POD_GROUP_API_VERSION = "scheduling.run.ai/v2alpha2"
# GPU Feature Discovery node label with the product name (REFERENCE.md).
GFD_PRODUCT_LABEL = "nvidia.com/gpu.product"


class ExportError(ValueError):
    """The plan cannot be expressed in the target framework's terms; the message says why."""

    def __init__(self, message: str, violations: list[str] | None = None) -> None:
        self.violations = list(violations or [])
        super().__init__(message)


# ---- plan structure helpers ------------------------------------------------------------------


def replica_samples(plan: Plan) -> dict[int, int]:
    """Samples per step of each data-parallel replica; checks ranks of a replica agree."""
    samples: dict[int, int] = {}
    for rank in plan.ranks:
        seen = samples.setdefault(rank.dp_rank, rank.samples)
        if seen != rank.samples:
            raise ExportError(
                f"data-parallel replica {rank.dp_rank} has ranks with different samples per step "
                f"({seen} and {rank.samples} on rank {rank.rank}); every rank of a replica must agree"
            )
    return samples


def rank_layer_counts(plan: Plan, layout: Mapping[str, Sequence[int]] | None = None) -> dict[int, int]:
    """Layers each rank of a pipeline plan holds: its stage's, from the plan or from `layout`
    ({stage: [first, last]}, what a rebalance moved the stage boundaries to)."""
    spans = {int(s): (int(v[0]), int(v[1])) for s, v in layout.items()} if layout else {}
    out = {}
    for rank in plan.ranks:
        first, last = spans.get(rank.stage, rank.layers)
        out[rank.rank] = last - first + 1
    return out


def stage_layer_counts(plan: Plan, num_layers: int | None = None) -> list[int]:
    """Decoder layers per pipeline stage, checked to be contiguous and equal across replicas.

    Megatron builds one pipeline layout for all data-parallel replicas, so a plan whose
    replicas split the layers differently cannot be exported to it.
    """
    by_stage: dict[int, tuple[int, int]] = {}
    for rank in plan.ranks:
        first, last = rank.layers
        if last < first:
            raise ExportError(f"rank {rank.rank}: layer range {list(rank.layers)} is empty")
        seen = by_stage.setdefault(rank.stage, (first, last))
        if seen != (first, last):
            raise ExportError(
                f"stage {rank.stage} holds layers {list(seen)} on one replica and {[first, last]} "
                f"on rank {rank.rank}; Megatron needs the same layer split on every replica"
            )
    try:
        spans = stage_spans(by_stage, last=None if num_layers is None else num_layers - 1)
    except ValueError as exc:
        raise ExportError(str(exc)) from None
    if len(spans) != plan.pp:
        raise ExportError(f"stages {sorted(spans)} do not cover 0..{plan.pp - 1}")
    return [last - first + 1 for first, last in (spans[stage] for stage in range(plan.pp))]


def common_micro_batch(plan: Plan) -> int:
    """The one micro-batch size a framework launcher is given for this plan.

    The largest divisor of every rank's micro-batch such that
    global_batch % (micro_batch * dp) == 0 (Megatron's and DeepSpeed's batch rule). For a
    uniform plan whose micro-batch already satisfies the rule, that is the plan's micro-batch.
    Falls back to the gcd when no divisor satisfies the rule (`check_megatron_rules` then says so).
    """
    sizes = [r.micro_batch for r in plan.ranks if r.micro_batch > 0]
    if not sizes:
        raise ExportError("no rank has a positive micro-batch")
    g = math.gcd(*sizes)
    for candidate in range(g, 0, -1):
        if g % candidate == 0 and plan.global_batch % (candidate * plan.dp) == 0:
            return candidate
    return g


def pipeline_layout(counts: list[int]) -> str:
    """Megatron `--pipeline-model-parallel-layout` string for decoder layers per stage.

    Grammar (megatron/core/transformer/pipeline_parallel_layer_layout.py, `parse_str_to_list`):
    stages split by "|", "E" embedding, "t" decoder layer, "L" loss, "x*n" repeats one
    character, "(...)*n" repeats a group, commas are cosmetic. The embedding goes on the
    first stage and the loss on the last, e.g. [5, 3, 3, 2] -> "Et*5|,(t*3|)*2,t*2,L".
    """
    if not counts or any(c < 1 for c in counts):
        raise ExportError(f"every pipeline stage needs at least one layer, got {counts}")

    def run(n: int) -> str:
        return "t" if n == 1 else f"t*{n}"

    if len(counts) == 1:
        return f"E{run(counts[0])},L"
    tokens = [f"E{run(counts[0])}|"]
    middle = counts[1:-1]
    i = 0
    while i < len(middle):
        j = i
        while j < len(middle) and middle[j] == middle[i]:
            j += 1
        tokens.append(f"({run(middle[i])}|)*{j - i}" if j - i > 1 else f"{run(middle[i])}|")
        i = j
    tokens.append(f"{run(counts[-1])},L")
    return ",".join(tokens)


# ---- Megatron-LM -----------------------------------------------------------------------------

# Plan.recompute -> (granularity, method, num_layers). Full recompute needs a method and a
# layer count (megatron/core/transformer/transformer_config.py); 1 layer per uniform unit
# recomputes every layer, the memory figure the cost model assumes.
_RECOMPUTE = {
    "none": (None, None, None),
    "": (None, None, None),
    "selective": ("selective", None, None),
    "full": ("full", "uniform", 1),
    "full-uniform": ("full", "uniform", 1),
    "full-block": ("full", "block", 1),
}


def megatron_arg_dict(plan: Plan, model: ModelShape) -> dict[str, Any]:
    """Megatron-LM arguments as a dict keyed by argparse dest (plus `world_size`).

    `True` values are store-true flags; `None` means "not passed".
    """
    counts = stage_layer_counts(plan, model.layers)
    recompute = _RECOMPUTE.get(plan.recompute.lower())
    if recompute is None:
        raise ExportError(f"recompute {plan.recompute!r} has no Megatron equivalent; use none|selective|full")
    granularity, method, recompute_layers = recompute
    args: dict[str, Any] = {
        "world_size": len(plan.ranks),
        "num_layers": model.layers,
        "hidden_size": model.hidden,
        "num_attention_heads": model.heads,
        "ffn_hidden_size": model.ffn,
        # SwiGLU-style gated MLP (three matrices); presets mark it with the extra key gated_mlp.
        "swiglu": bool(getattr(model, "gated_mlp", False)),
        "group_query_attention": model.kv_heads is not None,
        "num_query_groups": model.kv_heads,
        "seq_length": plan.seq_len,
        "max_position_embeddings": max(plan.seq_len, model.seq_len),
        "tensor_model_parallel_size": plan.tp,
        "pipeline_model_parallel_size": plan.pp,
        "global_batch_size": plan.global_batch,
        "micro_batch_size": common_micro_batch(plan),
        # fp8 runs through Transformer Engine on top of bf16 master weights.
        "bf16": plan.dtype in ("bf16", "fp8"),
        "fp16": plan.dtype == "fp16",
        "fp8_format": "hybrid" if plan.dtype == "fp8" else None,
        "sequence_parallel": plan.sequence_parallel,
        "recompute_granularity": granularity,
        "recompute_method": method,
        "recompute_num_layers": recompute_layers,
        # Megatron's distributed optimizer shards optimizer state over data-parallel ranks
        # (ZeRO-1 in Rajbhandari et al., arXiv 1910.02054); it is the closest native match
        # for ZeRO >= 1 (stages 2-3 would need Megatron-FSDP).
        "use_distributed_optimizer": plan.zero_stage >= 1,
        "decoder_first_pipeline_num_layers": None,
        "decoder_last_pipeline_num_layers": None,
        "pipeline_model_parallel_layout": None,
    }
    if plan.pp > 1 and len(set(counts)) > 1:
        middle = counts[1:-1]
        if len(set(middle)) <= 1:
            # Only first and/or last differ from evenly split middle stages.
            even = middle[0] if middle else None
            if counts[0] != even:
                args["decoder_first_pipeline_num_layers"] = counts[0]
            if counts[-1] != even:
                args["decoder_last_pipeline_num_layers"] = counts[-1]
        else:
            args["pipeline_model_parallel_layout"] = pipeline_layout(counts)
    return args


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def megatron_args(plan: Plan, model: ModelShape, strict: bool = True) -> list[str]:
    """The Megatron-LM argument list for this plan (parallelism, model shape, batch, precision).

    With `strict`, raises `ExportError` listing every rule Megatron's launcher would reject.
    """
    args = megatron_arg_dict(plan, model)
    if strict:
        violations = check_megatron_rules(args)
        if violations:
            raise ExportError("plan violates Megatron-LM rules: " + "; ".join(violations), violations)
    out: list[str] = []
    for dest, value in args.items():
        if dest in _LAUNCHER_KEYS or value is None or value is False:
            continue
        out.append(_flag(dest))
        if value is not True:
            out.append(str(value))
    return out


def _layout_stage_counts(layout: str) -> list[str] | None:
    """Expand a layout string to one string of layer characters per stage (Megatron's grammar)."""
    text = layout.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    stages = text.split("|")
    if any(ch not in "ELtm" for stage in stages for ch in stage):
        return None
    return stages


def check_megatron_rules(args: dict[str, Any]) -> list[str]:
    """Rules Megatron-LM checks at launch, applied to a `megatron_arg_dict`-style dict.

    Sources: megatron/training/arguments.py (`validate_args`), megatron/core/
    num_microbatches_calculator.py, megatron/core/transformer/transformer_config.py and
    pipeline_parallel_layer_layout.py, megatron/core/tensor_parallel/layers.py. Returns
    one message per violation (empty list: Megatron accepts the arguments).
    """
    v: list[str] = []
    get = args.get
    tp = get("tensor_model_parallel_size") or 1
    pp = get("pipeline_model_parallel_size") or 1
    layers = get("num_layers")
    hidden = get("hidden_size")
    heads = get("num_attention_heads")
    world = get("world_size")
    micro = get("micro_batch_size")
    global_batch = get("global_batch_size")

    if tp < 1 or pp < 1:
        v.append(f"tensor ({tp}) and pipeline ({pp}) parallel sizes must be >= 1")
        return v
    dp = None
    if world is not None:
        if world % (tp * pp):
            v.append(f"world size {world} is not divisible by tensor x pipeline parallel size {tp * pp}")
        else:
            dp = world // (tp * pp)
    if micro is None or micro <= 0:
        v.append(f"micro batch size must be > 0, got {micro}")
    if global_batch is not None and global_batch <= 0:
        v.append(f"global batch size must be > 0, got {global_batch}")
    if dp and micro and micro > 0 and global_batch and global_batch % (micro * dp):
        v.append(
            f"global batch size {global_batch} is not divisible by micro batch size {micro} "
            f"times data parallel size {dp}"
        )
    if hidden is not None and heads and hidden % heads:
        v.append(f"hidden size {hidden} is not divisible by attention heads {heads}")
    if heads and heads % tp:
        v.append(f"attention heads {heads} must be a multiple of tensor parallel size {tp}")
    if get("group_query_attention"):
        groups = get("num_query_groups")
        if not groups:
            v.append("--group-query-attention needs --num-query-groups")
        else:
            if heads and heads % groups:
                v.append(f"attention heads {heads} are not divisible by query groups {groups}")
            if groups % tp and tp % groups:
                v.append(f"query groups {groups} must be a multiple or divisor of tensor parallel size {tp}")
    ffn = get("ffn_hidden_size")
    if ffn and ffn % tp:
        # ColumnParallelLinear splits the output dimension evenly over TP ranks.
        v.append(f"ffn hidden size {ffn} is not divisible by tensor parallel size {tp}")
    seq = get("seq_length")
    max_pos = get("max_position_embeddings")
    if seq is not None and max_pos is not None and max_pos < seq:
        v.append(f"max position embeddings {max_pos} must be >= seq length {seq}")
    if get("bf16") and get("fp16"):
        v.append("only one of --bf16 and --fp16 may be set")
    if get("sequence_parallel") and tp == 1:
        # Megatron silently switches it off at tp=1: the plan would not get what it assumed.
        v.append("sequence parallelism needs tensor parallel size > 1")

    granularity = get("recompute_granularity")
    method = get("recompute_method")
    if granularity is not None:
        if granularity not in ("full", "selective"):
            v.append(f"recompute granularity must be full or selective, got {granularity!r}")
        elif granularity == "selective":
            if method is not None:
                v.append("recompute method is not supported with selective recompute granularity")
            if get("recompute_num_layers") is not None:
                v.append("recompute num layers must be unset with selective recompute granularity")
        else:
            if method not in ("uniform", "block"):
                v.append("full recompute granularity needs recompute method uniform or block")
            if get("recompute_num_layers") is None:
                v.append("full recompute granularity needs recompute num layers")
    elif method is not None:
        v.append("recompute method given without recompute granularity")

    first = get("decoder_first_pipeline_num_layers")
    last = get("decoder_last_pipeline_num_layers")
    layout = get("pipeline_model_parallel_layout")
    if layout is not None:
        if first is not None or last is not None:
            v.append("pipeline model parallel layout cannot be combined with first/last stage layer counts")
        stages = _layout_stage_counts(layout)
        if stages is None:
            v.append(f"pipeline layout {layout!r} has characters other than E, L, t, m")
        else:
            if len(stages) % pp:
                v.append(f"pipeline layout has {len(stages)} stages, not a multiple of pipeline size {pp}")
            flat = "".join(stages)
            if not flat.startswith("E") or flat.count("E") != 1:
                v.append("pipeline layout must start with the embedding (E) exactly once")
            if not flat.endswith("L") or flat.count("L") != 1:
                v.append("pipeline layout must end with the loss (L) exactly once")
            if layers is not None and flat.count("t") != layers:
                v.append(f"pipeline layout holds {flat.count('t')} decoder layers, the model has {layers}")
    elif first is not None or last is not None:
        if pp < 2:
            v.append("uneven first/last stage layers need pipeline parallel size > 1")
        remaining, middle_stages = layers or 0, pp
        for name, value in (("first", first), ("last", last)):
            if value is not None:
                if value <= 0:
                    v.append(f"layers in the {name} pipeline stage must be > 0, got {value}")
                remaining -= value
                middle_stages -= 1
        if bool(remaining) != bool(middle_stages) or remaining < 0:
            v.append(f"{remaining} middle layers remain for {middle_stages} middle pipeline stages")
        elif middle_stages and remaining % middle_stages:
            v.append(f"{remaining} middle layers are not divisible by {middle_stages} middle pipeline stages")
    elif layers is not None and layers % pp:
        v.append(f"number of layers {layers} is not divisible by pipeline parallel size {pp}")
    return v


# ---- micro-batch map (training plugin) -------------------------------------------------------


def microbatch_map(plan: Plan) -> dict[str, Any]:
    """The per-rank micro-batch map the Fleetwise training plugin reads.

    Each data-parallel replica i processes t_i samples per step. The exact gradient of the
    global batch is sum_i (t_i / sum(t)) * g_i with g_i the replica's mean gradient, so each
    rank scales its mean gradient by `grad_weight` = t_i / global_batch before a SUM
    all-reduce over its data-parallel group (never 1/DP, which is only right for equal
    shares; REFERENCE.md, Megatron-LM notes). Ranks of one replica share its weight; the
    weights of the replicas sum to 1.
    """
    samples = replica_samples(plan)
    total = sum(samples.values())
    if total != plan.global_batch:
        raise ExportError(
            f"replicas process {total} samples per step but the global batch is {plan.global_batch}"
        )
    ranks = [
        {
            "rank": r.rank,
            "node": r.node,
            "gpu": r.gpu,
            "dp_rank": r.dp_rank,
            "tp_rank": r.tp_rank,
            "stage": r.stage,
            "micro_batch": r.micro_batch,
            "num_micro_batches": r.num_micro_batches,
            "samples": r.samples,
            "grad_weight": r.samples / plan.global_batch,
        }
        for r in sorted(plan.ranks, key=lambda r: r.rank)
    ]
    replicas = [
        {"dp_rank": dp_rank, "samples": s, "grad_weight": s / plan.global_batch}
        for dp_rank, s in sorted(samples.items())
    ]
    return {
        "job": plan.job,
        "global_batch": plan.global_batch,
        "seq_len": plan.seq_len,
        "dp": plan.dp,
        "tp": plan.tp,
        "pp": plan.pp,
        "gradient_reduction": "sum",  # each rank pre-scales by grad_weight
        "replicas": replicas,
        "ranks": ranks,
    }


# ---- DeepSpeed -------------------------------------------------------------------------------


def deepspeed_config(plan: Plan, gradient_clipping: float = 1.0) -> dict[str, Any]:
    """A DeepSpeed config for this plan (https://www.deepspeed.ai/docs/config-json/).

    train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x dp
    holds exactly. DeepSpeed gives every rank the same micro-batch: for uneven plans the
    config carries the common micro-batch and the plugin applies per-replica shares from
    `microbatch_map`.
    """
    micro = common_micro_batch(plan)
    if plan.global_batch % (micro * plan.dp):
        raise ExportError(
            f"global batch {plan.global_batch} cannot be split as micro batch x accumulation x dp "
            f"with dp={plan.dp}: it is not divisible by {micro * plan.dp}"
        )
    if plan.pp > 1 and plan.zero_stage >= 2:
        # deepspeed/runtime/pipe/engine.py asserts this: ZeRO-2/3 partition gradients, which
        # the pipeline engine's gradient accumulation does not support.
        raise ExportError(
            f"DeepSpeed's pipeline engine supports ZeRO stage 0 or 1 only; plan has pp={plan.pp}, "
            f"zero stage {plan.zero_stage}"
        )
    zero: dict[str, Any] = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        zero.update(
            overlap_comm=True,
            contiguous_gradients=True,
            reduce_scatter=True,
            reduce_bucket_size=500_000_000,  # DeepSpeed's default bucket (5e8 elements)
            allgather_bucket_size=500_000_000,
        )
    if plan.zero_stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=50_000_000,  # DeepSpeed default 5e7
            stage3_param_persistence_threshold=100_000,  # DeepSpeed default 1e5
            stage3_gather_16bit_weights_on_model_save=True,
        )
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": plan.global_batch // (micro * plan.dp),
        "gradient_clipping": gradient_clipping,
        "zero_optimization": zero,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if plan.dtype in ("bf16", "fp8"):
        config["bf16"] = {"enabled": True}
    elif plan.dtype == "fp16":
        # Dynamic loss scaling (loss_scale 0) is DeepSpeed's recommended fp16 setting.
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    return config


# ---- Ray Train -------------------------------------------------------------------------------

# Ray's size-specific A100 types (ray/util/accelerators/accelerators.py: NVIDIA_A100_40G,
# NVIDIA_A100_80G); Ray does not add them to nodes by itself, the node must be labelled.
_RAY_A100_BY_MEMORY = {40: "A100-40G", 80: "A100-80G"}
# ray/util/accelerators/accelerators.py AMD names.
_RAY_AMD = {
    "mi250x": "AMD-Instinct-MI250X",
    "mi250x-gcd": "AMD-Instinct-MI250X",
    "mi300x": "AMD-Instinct-MI300X-OAM",
}
# ray/_private/accelerators/nvidia_gpu.py: NVIDIA_GPU_NAME_PATTERN; Ray names an NVIDIA
# node's accelerator type by the first upper-case/number token of the NVML device name.
_RAY_NVIDIA_NAME = re.compile(r"\w+\s+([A-Z0-9]+)")


def _spec(model_id: str) -> GpuSpec | None:
    try:
        return lookup(model_id)
    except UnknownGpuError:
        return None


def ray_accelerator_type(model_id: str) -> str | None:
    """Ray's accelerator type name for a catalog GPU (e.g. "H100", "B200", "A100-80G")."""
    spec = _spec(model_id)
    if spec is None:
        return None
    if spec.id in _RAY_AMD:
        return _RAY_AMD[spec.id]
    if spec.vendor.upper() != "NVIDIA" or not spec.nvml_names:
        return None
    match = _RAY_NVIDIA_NAME.match(spec.nvml_names[0])
    if not match:
        return None
    token = match.group(1)
    if token == "A100":
        return _RAY_A100_BY_MEMORY.get(int(round(spec.memory_gb)), token)
    return token


def _groups_by_model(plan: Plan) -> dict[str, list[RankPlan]]:
    groups: dict[str, list[RankPlan]] = defaultdict(list)
    for rank in sorted(plan.ranks, key=lambda r: r.rank):
        groups[rank.model].append(rank)
    return dict(groups)


def ray_scaling_config(plan: Plan) -> dict[str, Any]:
    """Ray Train `ScalingConfig` arguments as data, plus one worker group per GPU type.

    One worker per GPU. `ScalingConfig` takes one `accelerator_type`: it is set when the plan
    uses one GPU type and left None for a mixed plan, whose `worker_groups` say how many
    workers of each type to place (each worker requests `accelerator_type:<T>`, Ray's
    per-type custom resource). PACK keeps tensor-parallel groups on few nodes.
    """
    groups = _groups_by_model(plan)
    worker_groups = []
    for model_id, ranks in groups.items():
        acc = ray_accelerator_type(model_id)
        resources: dict[str, float] = {"GPU": 1}
        if acc:
            # Ray advertises 1 unit of accelerator_type:<T> per node; a tiny fraction per
            # worker pins the worker to that type without limiting workers per node.
            resources[f"accelerator_type:{acc}"] = 0.001
        worker_groups.append(
            {
                "gpu_model": model_id,
                "accelerator_type": acc,
                "num_workers": len(ranks),
                "resources_per_worker": resources,
                "ranks": [r.rank for r in ranks],
                "nodes": sorted({r.node for r in ranks}),
            }
        )
    types = {g["accelerator_type"] for g in worker_groups}
    single = types.pop() if len(worker_groups) == 1 else None
    return {
        "num_workers": len(plan.ranks),
        "use_gpu": True,
        "resources_per_worker": {"GPU": 1},
        "accelerator_type": single,
        "placement_strategy": "PACK",
        "worker_groups": worker_groups,
    }


# ---- KAI Scheduler envelope ------------------------------------------------------------------


def _gfd_product(model_id: str) -> str:
    spec = _spec(model_id)
    if spec is not None and spec.gfd_labels:
        return spec.gfd_labels[0]
    raise ExportError(f"GPU {model_id!r} has no GPU Feature Discovery product label in the catalog")


def _dns_label(text: str) -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    return label[:63].rstrip("-") or "group"


def kai_envelope(
    plan: Plan, job: str, queue: str, gpus_per_pod: int | None = None, namespace: str | None = None
) -> dict[str, Any]:
    """The job envelope for KAI Scheduler: per-GPU-type counts, a PodGroup and pod hints.

    KAI cannot set quotas per GPU type (KAI issues #145, #1087), so the envelope states
    what the job needs of each type. Pods: one per node of the plan holding all its GPUs
    of the job (`gpus_per_pod=None`), or `gpus_per_pod` GPUs each. The PodGroup is a gang:
    minMember = all pods; one subGroup per GPU type (pods join it through the
    `kai.scheduler/subgroup-name` label) so each type's pods are gang-counted on their own.
    """
    if not job:
        raise ExportError("job name is empty")
    if not queue:
        raise ExportError("queue name is empty")
    if gpus_per_pod is not None and gpus_per_pod < 1:
        raise ExportError(f"gpus per pod must be >= 1, got {gpus_per_pod}")
    name = _dns_label(job)
    # (GPU model, GPUs per pod) -> GPUs, nodes, pods. Nodes holding different numbers of the
    # job's GPUs get different pod shapes, hence separate groups.
    shapes: dict[tuple[str, int], dict[str, Any]] = {}
    for model_id, ranks in _groups_by_model(plan).items():
        per_node = Counter(r.node for r in ranks)
        if gpus_per_pod is None:
            for node, count in sorted(per_node.items()):
                shape = shapes.setdefault((model_id, count), {"gpus": 0, "nodes": set(), "pods": 0})
                shape["gpus"] += count
                shape["nodes"].add(node)
                shape["pods"] += 1
        else:
            if len(ranks) % gpus_per_pod:
                raise ExportError(
                    f"{len(ranks)} {model_id} GPUs cannot be split into pods of {gpus_per_pod} GPUs"
                )
            shapes[(model_id, gpus_per_pod)] = {
                "gpus": len(ranks),
                "nodes": set(per_node),
                "pods": len(ranks) // gpus_per_pod,
            }
    models_with_several_shapes = {m for m, _ in shapes if sum(1 for k in shapes if k[0] == m) > 1}
    node_groups = []
    for (model_id, pod_gpus), shape in shapes.items():
        group_name = model_id if model_id not in models_with_several_shapes else f"{model_id}-x{pod_gpus}"
        node_groups.append(
            {
                "name": _dns_label(group_name),
                "gpu_model": model_id,
                "gpu_product": _gfd_product(model_id),
                "gpus": shape["gpus"],
                "nodes": len(shape["nodes"]),
                "pods": shape["pods"],
                "gpus_per_pod": pod_gpus,
            }
        )
    min_member = sum(g["pods"] for g in node_groups)
    metadata: dict[str, Any] = {"name": name, "labels": {KAI_QUEUE_LABEL: queue}}
    if namespace:
        metadata["namespace"] = namespace
    pod_group = {
        "apiVersion": KAI_POD_GROUP_API_VERSION,
        "kind": "PodGroup",
        "metadata": metadata,
        "spec": {
            "minMember": min_member,
            "queue": queue,
            "subGroups": [{"name": g["name"], "minMember": g["pods"]} for g in node_groups],
        },
    }
    pod_templates = [
        {
            "gpu_model": g["gpu_model"],
            "replicas": g["pods"],
            "metadata": {
                "labels": {KAI_QUEUE_LABEL: queue, KAI_SUBGROUP_LABEL: g["name"]},
                "annotations": {KAI_POD_GROUP_ANNOTATION: name},
            },
            "spec": {
                "schedulerName": KAI_SCHEDULER_NAME,
                "nodeSelector": {GFD_PRODUCT_LABEL: g["gpu_product"]},
                "containers": [
                    # Quantities as strings: the official Python client refuses ints.
                    {"name": "trainer", "resources": {"limits": {"nvidia.com/gpu": str(g["gpus_per_pod"])}}}
                ],
            },
        }
        for g in node_groups
    ]
    return {
        "job": job,
        "queue": queue,
        "pod_group_name": name,
        "gang": True,
        "gpus": len(plan.ranks),
        "nodes": len({r.node for r in plan.ranks}),
        "min_member": min_member,
        "node_groups": node_groups,
        "pod_group": pod_group,
        "pod_templates": pod_templates,
    }
