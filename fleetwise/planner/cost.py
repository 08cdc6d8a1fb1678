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
