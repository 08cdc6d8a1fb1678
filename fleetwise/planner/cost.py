"""Cost model of one training step of a decoder-only transformer (see docs/planner.md).

Plain functions over numbers: FLOPs, parameter counts, memory and collective times. The
search (``search.py``) vectorises them over pipeline classes and stages.
"""

from __future__ import annotations

from fleetwise.schemas import ModelShape

GB = 1e9

# Mixed-precision Adam keeps 16 bytes of model state per parameter: 2 (bf16 weights) +
# 2 (bf16 grads) + 12 (fp32 master weights, momentum, variance).
# ZeRO (Rajbhandari et al. 2019, arXiv 1910.02054, Sec. 5 / Fig. 1): stage 1 = 4 + 12/N_d,
# stage 2 = 2 + 14/N_d, stage 3 = 16/N_d bytes per parameter.
STATE_BYTES_PER_PARAM = 16.0

# Communication volume relative to a plain all-reduce of the gradients (ZeRO paper Sec. 7:
# stages 1-2 = reduce-scatter + all-gather = the same volume; stage 3 = 1.5x).
ZERO_COMM_FACTOR = {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.5}

# Bytes an Adam step touches per parameter it owns: reads and writes the 12 B fp32 state,
# reads the 2 B gradient, writes the 2 B weight (memory-bound; same state layout as above).
OPTIMIZER_BYTES_PER_PARAM = 2 * 12 + 2 + 2

# Activations and the tensors exchanged between ranks are 2-byte (bf16/fp16), as in
# Korthikanti et al. 2022 (arXiv 2205.05198); fp32 training doubles them.
ACT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 2, "fp32": 4}

# Share of the link's per-direction bandwidth an NCCL ring collective reaches (bus
# bandwidth): nccl-tests all_reduce_perf on DGX A100 reports ~230 GB/s bus bandwidth over
# 300 GB/s per-direction NVLink3, ~0.75; we use the same share for every link. Assumption.
COLLECTIVE_EFFICIENCY = 0.75

# Memory a rank cannot give to the model: CUDA context, NCCL buffers and cuBLAS workspaces
# (~0.5-1 GB on a PyTorch rank; assumption), plus the headroom of JobConstraints (5%).
RESERVED_BYTES = 1.0 * GB
DEFAULT_MEMORY_HEADROOM = 0.05

RECOMPUTE_MODES = ("none", "selective", "full")


def kv_hidden(model: ModelShape) -> int:
    """Width of the key (and of the value) projection: ``hidden * kv_heads / heads``."""
    kv = model.kv_heads or model.heads
    return model.hidden * kv // model.heads


def mlp_matrices(model: ModelShape) -> int:
    """2 for a GELU MLP; 3 for a gated (SwiGLU) MLP (``gated_mlp`` extra key)."""
    return 3 if getattr(model, "gated_mlp", False) else 2


def layer_params(model: ModelShape) -> float:
    """Parameters of one transformer layer (weights, biases, two layer norms).

    For a GPT shape (ffn = 4h, no GQA) this is 12h^2 + 13h, as in Narayanan et al. 2021
    (arXiv 2104.04473, Sec. 5.1: P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h))).
    """
    h, kv, f = model.hidden, kv_hidden(model), model.ffn
    attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
    mlp = mlp_matrices(model) * h * f + f + h
    return float(attn + mlp + 4 * h)


def embedding_params(model: ModelShape, seq_len: int) -> float:
    """Token embedding (V x h) plus learned positions (s x h) as in GPT (Narayanan Sec. 5.1)."""
    positions = 0 if getattr(model, "gated_mlp", False) else seq_len  # Llama uses RoPE
    return float((model.vocab + positions) * model.hidden)


def total_params(model: ModelShape, seq_len: int) -> float:
    """Parameters of the whole model (output layer tied to the embedding)."""
    return model.layers * layer_params(model) + embedding_params(model, seq_len)


def layer_forward_flops(model: ModelShape, seq_len: int) -> float:
    """Forward FLOPs of one layer for one sample (a multiply-add = 2 FLOPs).

    QKV and output projections, attention scores and the weighted sum of values (4 s^2 h),
    and the MLP. For a GPT shape: 24 s h^2 + 4 s^2 h, the per-layer term of Narayanan's
    72 B s l h^2 (1 + s/(6h)) / 3.
    """
    s, h, kv, f = seq_len, model.hidden, kv_hidden(model), model.ffn
    proj = 2 * s * h * (h + 2 * kv) + 2 * s * h * h
    attention = 4 * s * s * h
    mlp = 2 * mlp_matrices(model) * s * h * f
    return float(proj + attention + mlp)


def logits_forward_flops(model: ModelShape, seq_len: int) -> float:
    """Forward FLOPs of the output (logit) layer for one sample: 2 s h V."""
    return 2.0 * seq_len * model.hidden * model.vocab


def recompute_flops_factor(model: ModelShape, seq_len: int, recompute: str) -> float:
    """FLOPs of forward + backward (+ recomputation) of a layer over its forward FLOPs.

    Backward costs 2x forward (Narayanan Sec. 5.1); full recomputation adds one more
    forward (4x); selective recomputation (Korthikanti Sec. 5) re-runs only the attention
    score and value matmuls (4 s^2 h).
    """
    if recompute == "full":
        return 4.0
    if recompute == "selective":
        fwd = layer_forward_flops(model, seq_len)
        return 3.0 + 4.0 * seq_len * seq_len * model.hidden / fwd
    return 3.0


def model_flops_per_sample(model: ModelShape, seq_len: int, recompute: str = "none") -> float:
    """Training FLOPs per sample: 3x (4x with full recompute) forward layers + 3x logits.

    With ``recompute="full"`` and a GPT shape this equals Narayanan's per-sample
    96 s l h^2 (1 + s/(6h) + V/(16 l h)); with ``"none"`` the 72 form (model FLOPs, for MFU).
    """
    layer = layer_forward_flops(model, seq_len) * recompute_flops_factor(model, seq_len, recompute)
    return model.layers * layer + 3.0 * logits_forward_flops(model, seq_len)


def activation_bytes_per_layer(
    model: ModelShape, seq_len: int, micro_batch: int, tp: int, recompute: str, sequence_parallel: bool,
    act_bytes: int = 2,
) -> float:
    """Activation memory one layer keeps for one micro-batch until its backward pass.

    Korthikanti et al. 2022 (arXiv 2205.05198), Sec. 4 and Table 2, with s sequence,
    b micro-batch, h hidden, a heads, t tensor-parallel size (2-byte activations):
      no parallelism        s b h (34 + 5 a s / h)
      TP                    s b h (10 + 24/t + 5 a s / (h t))
      TP + SP               s b h / t (34 + 5 a s / h)
      selective recompute   34 s b h / t  (with SP; s b h (10 + 24/t) without)
      full recompute        2 s b h (the layer input; / t with SP)
    """
    s, b, h, a, t = seq_len, micro_batch, model.hidden, model.heads, tp
    sbh = s * b * h
    if recompute == "full":
        per = 2.0 * sbh / (t if sequence_parallel else 1)
    elif recompute == "selective":
        per = 34.0 * sbh / t if sequence_parallel else sbh * (10.0 + 24.0 / t)
    elif sequence_parallel or t == 1:
        per = sbh / t * (34.0 + 5.0 * a * s / h)
    else:
        per = sbh * (10.0 + 24.0 / t + 5.0 * a * s / (h * t))
    return per * act_bytes / 2.0


def logits_activation_bytes(model: ModelShape, seq_len: int, micro_batch: int, tp: int) -> float:
    """The output layer's fp32 logits kept for the loss: 4 s b V / t bytes (Korthikanti Sec. 4.3)."""
    return 4.0 * seq_len * micro_batch * model.vocab / tp


def state_bytes_per_param(zero_stage: int, dp: int) -> float:
    """Model-state bytes per parameter on one rank under ZeRO ``zero_stage`` over ``dp`` ranks."""
    if zero_stage == 0:
        return STATE_BYTES_PER_PARAM
    if zero_stage == 1:
        return 4.0 + 12.0 / dp
    if zero_stage == 2:
        return 2.0 + 14.0 / dp
    if zero_stage == 3:
        return 16.0 / dp
    raise ValueError(f"zero_stage must be 0..3, got {zero_stage}")


def ring_allreduce_s(nbytes: float, ranks: int, gbs: float) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``ranks`` at ``gbs`` GB/s bus bandwidth.

    A ring moves 2 (n - 1) / n of the buffer through each rank's link (Patarasuk & Yuan 2009).
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbs * GB)


def tp_collectives_per_layer(recompute: str) -> int:
    """All-reduces (or all-gather + reduce-scatter pairs with SP) per layer per micro-batch.

    Megatron TP: 2 in the forward, 2 in the backward (Shoeybi et al. 2019, Fig. 4); a full
    recompute repeats the forward's 2.
    """
    return 6 if recompute == "full" else 4


# ---- memory-bound (element-wise) work of a layer -------------------------------------------
#
# Layer norms, bias + GeLU/SwiGLU, dropout, residual adds and the scale/mask/softmax/dropout of
# the attention scores do ~1 FLOP per byte, so their time is bytes moved / HBM bandwidth, not
# FLOPs / peak. Ivanov et al. 2021 ("Data Movement Is All You Need", arXiv 2007.00072, Table 1)
# measure these normalisation and element-wise operators at ~0.2% of a BERT-large encoder
# layer's FLOPs but ~39% of its runtime in PyTorch; their share grows as h shrinks (GEMM work
# per token ~h^2, theirs ~h). Their bytes (below) are our own count, not taken from Ivanov.

# Share of the datasheet HBM bandwidth a streaming kernel reaches. BabelStream / STREAM-like
# copy and triad kernels on NVIDIA datacenter GPUs reach ~0.8-0.9 of the datasheet HBM
# bandwidth (BabelStream, Deakin et al., University of Bristol); fused element-wise kernels of
# real layers (with reductions, masks) sit at the low end, so we take 0.85. Assumption.
HBM_EFFICIENCY = 0.85


def layer_elementwise_bytes(
    model: ModelShape, seq_len: int, micro_batch: int, tp: int, sequence_parallel: bool, act_bytes: int = 2,
) -> tuple[float, float]:
    """Bytes one TP rank's memory-bound ops of one layer read + write in ONE forward pass for one
    micro-batch, as ``(hidden-wide ops, attention-score ops)`` (the second part is what selective
    recomputation re-runs).

    The tensors are those of Korthikanti et al. 2022 (arXiv 2205.05198, Sec. 4.1), whose
    stored-activation count is 34 s b h + 5 a s^2 b bytes; here each op is charged what it reads
    and writes (Megatron's fused kernels: one pass per op), with e = ``act_bytes``:
      2 layer norms             read + write s b h each             4 e s b h
      2 bias-dropout-add        read out + residual, write, 1-byte mask: (3 e + 1) s b h each
      MLP activation            GeLU: read + write f_ffn; SwiGLU: read 2 f_ffn, write f_ffn
      scale-mask-softmax        read + write a s^2 b                2 e a s^2 b
      attention dropout         read + write + 1-byte mask          (2 e + 1) a s^2 b
    Per rank: heads and f_ffn are split over t; the layer-norm and dropout-add tensors only with
    sequence parallelism (Korthikanti Sec. 4.2.2).
    """
    s, b, h, a, t = seq_len, micro_batch, model.hidden, model.heads, tp
    e = float(act_bytes)
    sbh = float(s * b * h)
    norm_dropout = (2 * 2 * e + 2 * (3 * e + 1)) * sbh / (t if sequence_parallel else 1)
    mlp_act = mlp_matrices(model) * e * s * b * model.ffn / t
    scores = (2 * e + (2 * e + 1)) * a * s * s * b / t
    return norm_dropout + mlp_act, float(scores)


def layer_elementwise_pass_factor(recompute: str) -> tuple[float, float]:
    """Forward-pass equivalents of element-wise traffic per training step, as (hidden-wide ops,
    attention-score ops): forward 1 + backward 2 (a backward element-wise op reads the upstream
    gradient and its saved input(s) and writes the input gradient: about twice the forward's
    traffic; assumption, the same 2x as for FLOPs, Narayanan Sec. 5.1); full recompute adds
    one forward of everything, selective recompute one forward of the attention-score ops
    (Korthikanti Sec. 5)."""
    if recompute == "full":
        return 4.0, 4.0
    if recompute == "selective":
        return 3.0, 4.0
    return 3.0, 3.0


def layer_elementwise_step_bytes(
    model: ModelShape, seq_len: int, micro_batch: int, tp: int, recompute: str, sequence_parallel: bool,
    act_bytes: int = 2,
) -> float:
    """Memory-bound bytes per layer per micro-batch on one TP rank, forward + backward
    (+ recomputation); its time is this / (HBM bandwidth x HBM_EFFICIENCY)."""
    wide, scores = layer_elementwise_bytes(model, seq_len, micro_batch, tp, sequence_parallel, act_bytes)
    k_wide, k_scores = layer_elementwise_pass_factor(recompute)
    return k_wide * wide + k_scores * scores


# ---- compute efficiency as a function of GEMM size -----------------------------------------
#
# Achieved compute rate of a GPU = dense peak x COMPUTE efficiency of its family x
# gemm_efficiency(size). See docs/planner.md, "Compute efficiency".

# Saturating GEMM-size curve f(n) = n^p / (n^p + n_half^p), the shape of NVIDIA's published
# cuBLAS BF16 throughput of square (m = n = k) GEMMs on A100 vs size: NVIDIA developer blog
# "CUDA 11 Features Revealed" (2020), Figure 6 "Mixed-precision matrix multiply on A100 with
# cuBLAS" (reproduced in github.com/stas00/ml-engineering, compute/accelerator/README.md).
# The 32 points n = 256..8192 (step 256) read off that figure are GEMM_CURVE_A100_BF16; a
# least-squares fit of T_inf f(n) gives T_inf = 285 TFLOP/s (91% of the 312 peak), n_half
# = 1342, p = 2.18 (RMS error 9.9 TFLOP/s; the sawtooth of wave quantization is smoothed
# out). f is normalised to 1 for large GEMMs, so the family factor below is the efficiency
# of large GEMMs. Only the shape of this one A100 curve is used, for every GPU (assumption:
# newer GPUs have more SMs and would saturate at somewhat larger sizes).
GEMM_HALF_SIZE = 1342.0
GEMM_SIZE_EXPONENT = 2.18
GEMM_CURVE_A100_BF16: tuple[tuple[int, float], ...] = tuple(zip(
    range(256, 8193, 256),
    (5, 28, 65, 88, 152, 150, 202, 195, 245, 230, 238, 235, 248, 242, 260, 260, 245, 275, 265,
     260, 258, 282, 278, 276, 276, 276, 279, 280, 283, 285, 288, 290),
    strict=True,
))
GEMM_CURVE_T_INF_TFLOPS = 285.3


def gemm_efficiency(m: float, n: float, k: float, batch: float = 1.0) -> float:
    """Share of the large-GEMM rate an (m x k) @ (k x n) GEMM (``batch`` of them in one kernel)
    reaches: f of the square GEMM with the same work, size ``(batch m n k)^(1/3)``.

    Small GEMMs are slow because they have too few output tiles to fill every SM (wave and
    tile quantization, NVIDIA "Matrix Multiplication Background" guide, Sec. 3) and too short
    a k-loop to hide each tile's prologue/epilogue: both are about the work per kernel. The
    equal-work size is symmetric in m, n, k, so the two backward GEMMs (dgrad, wgrad: the same
    dimensions permuted) get the forward GEMM's efficiency.
    """
    size = (batch * m * n * k) ** (1.0 / 3.0)
    if size <= 0:
        return 0.0
    ratio = (GEMM_HALF_SIZE / size) ** GEMM_SIZE_EXPONENT
    return 1.0 / (1.0 + ratio)


def layer_gemm_efficiency(model: ModelShape, seq_len: int, micro_batch: int, tp: int) -> float:
    """FLOP-weighted efficiency of one layer's matmuls on one TP rank (time-additive:
    ``sum(flops) / sum(flops_i / f_i)``).

    Per rank with Megatron TP (Shoeybi et al. 2019, Sec. 3) the GEMMs have m = b s tokens
    (the whole sequence after the SP all-gather): QKV (k = h, n = (h + 2 h_kv)/t), attention
    output (k = h/t, n = h), MLP in (k = h, n = k_mlp f / t, gate and up fused), MLP out
    (k = f/t, n = h); attention scores (s x d x s) and the weighted sum of values (s x s x d)
    are batched over b a / t heads (d = h/a).
    """
    s, b, h, t = seq_len, micro_batch, model.hidden, tp
    tokens = float(s * b)
    kv, f, k_mlp = kv_hidden(model), model.ffn, mlp_matrices(model)
    head_dim = h / model.heads
    heads = b * model.heads / t
    gemms = (  # (m, n, k, batch)
        (tokens, (h + 2 * kv) / t, h, 1.0),
        (tokens, h, h / t, 1.0),
        (tokens, (k_mlp - 1) * f / t, h, 1.0),
        (tokens, h, f / t, 1.0),
        (s, s, head_dim, heads),
        (s, head_dim, s, heads),
    )
    flops = [2.0 * m * n * k * bat for m, n, k, bat in gemms]
    time = sum(fl / gemm_efficiency(m, n, k, bat) for fl, (m, n, k, bat) in zip(flops, gemms, strict=True))
    return sum(flops) / time


def logits_gemm_efficiency(model: ModelShape, seq_len: int, micro_batch: int, tp: int) -> float:
    """Efficiency of the output layer's GEMM (m = b s, k = h, n = V / t)."""
    return gemm_efficiency(seq_len * micro_batch, model.vocab / tp, model.hidden)


# The catalog's family efficiency is an end-to-end MFU; the ampere figure (0.52) is the 1T GPT
# run of Narayanan et al. 2021 (arXiv 2104.04473): 163 TFLOP/s per A100 with t = 8, p = 64,
# 3,072 GPUs (d = 6), global batch 3,072, b = 1 (m = 512 micro-batches per pipeline), full
# recompute, h = 25,600, 160 heads, 128 layers, s = 2,048. That MFU already contains what
# this cost model adds explicitly (the 1F1B bubble, TP collectives) and the GEMM size of that
# run. MFU_TO_COMPUTE converts it into the large-GEMM compute efficiency the cost model
# needs, by solving the cost model's own step time for that run:
#   MFU x peak x (m + p - 1) (F / (E f peak) + T_tp) = m F
# with F the per-layer, per-micro-batch FLOPs of one TP rank, f = layer_gemm_efficiency and
# T_tp the TP collectives (A100 NVLink3 600 GB/s both directions, NVIDIA A100 datasheet).
# The same factor is applied to every family (assumption: the families' reference MFUs come
# from runs of similar shape), so ratios between families stay the catalog's.
_REFERENCE_RUN = {
    "hidden": 25600, "heads": 160, "layers": 128, "seq_len": 2048, "vocab": 51200,
    "tp": 8, "pp": 64, "micro_batches": 512, "micro_batch": 1, "nvlink_gbs": 600.0, "mfu": 0.52,
    "peak_tflops": 312.0, "hbm_tbs": 2.039,  # 80-GB A100s (Narayanan Sec. 5), datasheet HBM2e
}


def _mfu_to_compute_factor() -> float:
    r = _REFERENCE_RUN
    model = ModelShape(name="gpt-1t-reference", layers=r["layers"], hidden=r["hidden"], heads=r["heads"],
                       seq_len=r["seq_len"], vocab=r["vocab"])
    s, b, t, p, m = r["seq_len"], r["micro_batch"], r["tp"], r["pp"], r["micro_batches"]
    peak = r["peak_tflops"] * 1e12
    flops = layer_forward_flops(model, s) * b * recompute_flops_factor(model, s, "full") / t
    bw = r["nvlink_gbs"] / 2.0 * COLLECTIVE_EFFICIENCY
    t_tp = tp_collectives_per_layer("full") * ring_allreduce_s(b * s * model.hidden * 2.0, t, bw)
    f = layer_gemm_efficiency(model, s, b, t)
    hbm = r["hbm_tbs"] * 1e12 * HBM_EFFICIENCY
    t_mem = layer_elementwise_step_bytes(model, s, b, t, "full", True) / hbm
    compute_s = m * flops / ((m + p - 1) * r["mfu"] * peak) - t_tp - t_mem
    efficiency = flops / (f * peak * compute_s)
    return efficiency / r["mfu"]


MFU_TO_COMPUTE = _mfu_to_compute_factor()
