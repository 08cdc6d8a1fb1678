"""DeepSpeed: per-rank micro-batches and gradient accumulation with the exact weighting.

`fleetwise.planner.exports.deepspeed_config(plan)` gives one config for every rank, with
the plan's *common* micro-batch (DeepSpeed's batch rule train_batch = micro x GAS x dp
assumes equal ranks). For the uneven split each rank gets its own config
(`rank_config`): its own `train_micro_batch_size_per_gpu` and `gradient_accumulation_steps`
from the micro-batch map, and two DeepSpeed settings (deepspeed/runtime/config.py,
constants.py; DeepSpeed >= 0.18) that make the engine's reduction a plain sum:

- `"gradient_allreduce_op": "sum"`: the data-parallel all-reduce sums (engine.allreduce_bucket
  and the ZeRO optimizers skip their 1/dp division);
- `"managed_gradient_accumulation": false`: `engine.backward()` only accumulates and
  `engine.step()` is the boundary, so ranks may run different numbers of micro-batches.

Each micro-batch's mean loss is then scaled by (micro-batch samples / global samples) and
passed to `engine.backward(loss, scale_wrt_gas=False)` (`weighted_backward`): the summed
gradient is the global-batch mean. `train_batch_size` is left out of the per-rank config
(DeepSpeed derives it per rank; it is only used for logging and sample counters).

Tested here: the engine (ZeRO 0 and 1, CPU, gloo, 3 ranks) trains to the same parameters as
one process on the whole batch (tests/test_training_frameworks.py), also when a signed
rebalance reaches the loop through `TrainingPlugin` mid-run (the accumulation count follows the
new share; the micro-batch size stays the one given to `initialize`). Not tested: ZeRO 2/3
and bf16/fp16 on GPUs, and the pipeline engine (which DeepSpeed does not allow with
unmanaged accumulation; a pipelined plan keeps the common micro-batch).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

from fleetwise.training.sampler import MicrobatchMap, load_microbatch_map

__all__ = ["micro_batches", "micro_weight", "rank_config", "weighted_backward"]


def rank_config(
    base: Mapping[str, Any], mb_map: MicrobatchMap | Mapping[str, Any], rank: int
) -> dict[str, Any]:
    """This rank's DeepSpeed config: `base` (deepspeed_config's output) with its own batch sizes.

    Raises ValueError for plans DeepSpeed cannot run unevenly (pipeline parallelism).
    """
    mb = mb_map if isinstance(mb_map, MicrobatchMap) else load_microbatch_map(mb_map)
    if int(mb.raw.get("pp", 1)) > 1:
        raise ValueError(
            "DeepSpeed's pipeline engine needs managed gradient accumulation; an uneven split "
            f"cannot be applied with pp={mb.raw['pp']} (use the common micro-batch config)"
        )
    micro, count = mb.micro_batches(rank)
    if micro < 1 or count < 1:
        raise ValueError(f"rank {rank}: micro_batch {micro} x num_micro_batches {count} must be >= 1")
    config = copy.deepcopy(dict(base))
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = micro
    config["gradient_accumulation_steps"] = count
    config["gradient_allreduce_op"] = "sum"
    config["managed_gradient_accumulation"] = False
    zero = dict(config.get("zero_optimization") or {})
    if zero.get("overlap_comm") and int(zero.get("stage", 0)) != 2:
        # DeepSpeed allows overlap_comm with unmanaged accumulation only at ZeRO stage 2
        # (engine.py, _do_sanity_check); it is an overlap optimization, not a result change.
        zero["overlap_comm"] = False
        config["zero_optimization"] = zero
    return config


def micro_batches(
    indices: Sequence[int], micro_batch: int, *, dummy: int | None = 0
) -> list[tuple[list[int], int]]:
    """This step's share as (micro-batch indices, samples it counts for) pairs.

    Micro-batches of `micro_batch` (the last may be shorter). An empty share gives one
    micro-batch of the `dummy` sample counting for 0 samples: ZeRO 1/2 reduce gradients in
    backward hooks, so every rank must run at least one backward per step (with weight 0 it
    changes nothing); `dummy=None` returns no micro-batch instead (ZeRO 0 accepts that).
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    idx = list(indices)
    if not idx:
        return [] if dummy is None else [([dummy], 0)]
    chunks = [idx[i : i + micro_batch] for i in range(0, len(idx), micro_batch)]
    return [(chunk, len(chunk)) for chunk in chunks]


def micro_weight(micro_samples: float, global_samples: float) -> float:
    """Loss weight of one micro-batch whose loss is the mean over its `micro_samples`."""
    if global_samples <= 0 or not math.isfinite(global_samples):
        raise ValueError(f"global_samples must be > 0, got {global_samples}")
    if micro_samples < 0:
        raise ValueError(f"micro_samples must be >= 0, got {micro_samples}")
    return micro_samples / global_samples


def weighted_backward(engine: Any, loss: Any, micro_samples: float, global_samples: float) -> Any:
    """`engine.backward` of a micro-batch's mean loss, weighted by its share of the global batch.

    Needs `rank_config`'s settings (sum all-reduce, unmanaged accumulation); call
    `engine.step()` once after the rank's last micro-batch of the step.
    """
    return engine.backward(loss * micro_weight(micro_samples, global_samples), scale_wrt_gas=False)
