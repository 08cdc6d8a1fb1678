"""Megatron-LM / megatron-core: how the plan's uneven split maps onto Megatron.

Megatron's own arithmetic (megatron-core 0.16, read from its source):

- Without `--calculate-per-token-loss`, `schedules.forward_step_calc_loss` divides each
  micro-batch's loss by its token count and by the *local* `num_microbatches`, and the DDP
  wrapper scales gradients by 1/dp (`distributed_data_parallel.py`,
  gradient_scaling_factor): the mean of the replicas' means, exact only for equal shares.
- With `--calculate-per-token-loss` (`TransformerConfig.calculate_per_token_loss`), the loss
  function returns (loss sum, token count, ...), the schedule neither divides by the count nor
  by `num_microbatches`, DDP sums (scaling factor 1), and `finalize_model_grads` all-reduces the
  token count over the data-parallel group and scales gradients by 1/total. That is exactly the
  global-batch token mean, whatever each replica's number of micro-batches or tokens.

So the mapping is: `--calculate-per-token-loss` always (count samples as "tokens" for a
per-sample mean: `per_sample_loss_func`), each data-parallel replica passes its own
`num_microbatches` to `forward_backward_func` (the schedules take it per call; pipeline
stages of one replica agree, replicas may differ) and reads its own share of each global batch
(`ShareSampler` in place of Megatron-LM's `MegatronPretrainingSampler`), and the pipeline
split comes from the planner's `megatron_arg_dict` (`--decoder-first/last-pipeline-num-layers`
or `--pipeline-model-parallel-layout`).

What runs here on CPU (tests/test_training_frameworks.py): the arguments through
megatron-core's `TransformerConfig`, and megatron-core's own `forward_step`/`backward_step`
with per-token loss per micro-batch on 3 gloo ranks with uneven micro-batch counts, reduced
by `finalize_per_token_grads` (the data-parallel part of `finalize_model_grads`, whose
megatron DDP buffers need CUDA): parameters equal one-process training. Not run here: the
full `forward_backward_func` (it allocates CUDA tensors), megatron DDP, pipeline stages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fleetwise.training.sampler import MicrobatchMap, load_microbatch_map

__all__ = [
    "finalize_per_token_grads",
    "megatron_plan_args",
    "megatron_rank_schedule",
    "per_sample_loss_func",
]


def megatron_plan_args(plan: Any, model: Any) -> dict[str, Any]:
    """Megatron-LM arguments for an uneven plan: the planner's export + per-token loss.

    `plan`/`model`: a `fleetwise.schemas.Plan` and `ModelShape`. Reuses
    `fleetwise.planner.exports.megatron_arg_dict` (parallelism, layer split, common micro
    batch) and adds `calculate_per_token_loss`, which makes Megatron's reduction a sum divided
    by the global token count (see the module docstring).
    """
    from fleetwise.planner.exports import megatron_arg_dict

    args = megatron_arg_dict(plan, model)
    args["calculate_per_token_loss"] = True
    return args


def megatron_rank_schedule(mb_map: MicrobatchMap | Mapping[str, Any], rank: int) -> dict[str, int]:
    """What one Megatron rank passes per step: its micro-batch size and number of micro-batches.

    `forward_backward_func(..., num_microbatches=n, micro_batch_size=m)`; every rank of a
    data-parallel replica (all its pipeline stages and tensor-parallel ranks) gets the same.
    """
    mb = mb_map if isinstance(mb_map, MicrobatchMap) else load_microbatch_map(mb_map)
    micro, count = mb.micro_batches(rank)
    return {
        "dp_rank": mb.dp_rank(rank),
        "micro_batch_size": micro,
        "num_microbatches": count,
        "samples": mb.local_samples(rank),
    }


def per_sample_loss_func(per_sample_loss: Any) -> tuple[Any, Any, dict[str, Any]]:
    """Megatron per-token-loss triple for a per-sample loss vector (samples count as tokens).

    Returns (sum of losses, number of samples, {"lm loss": ...}) as megatron-core's
    `forward_step_calc_loss` expects with `calculate_per_token_loss=True`.
    """
    import torch

    total = per_sample_loss.sum()
    count = torch.tensor(per_sample_loss.numel(), dtype=torch.int)
    return total, count, {"lm loss": torch.stack([total.detach(), count.to(total.dtype)])}


def finalize_per_token_grads(module: Any, num_tokens: Any, group: Any = None) -> float:
    """The data-parallel step of megatron's `finalize_model_grads` with per-token loss.

    Gradients hold the sum of this rank's per-token (or per-sample) losses; SUM all-reduce
    them and the token counts over `group`, then scale by 1/total, so every rank holds the
    global token-mean gradient. Returns the global token count.
    """
    from fleetwise.training.gradients import _reduce

    return _reduce(module, float(num_tokens), None, group, 25.0, "tokens", summed=True)
