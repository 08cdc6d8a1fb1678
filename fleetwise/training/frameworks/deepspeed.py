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
and bf16/fp16 on GPUs.

Pipelines: DeepSpeed's pipeline engine needs managed accumulation, so a pipelined plan keeps
the common micro-batch (`rank_config` refuses it). `PipelineStages` runs the engine with the
plan's stage boundaries instead of DeepSpeed's own partitioning, and moves them when a
rebalance's `layers` asks (the training plugin's `rebuild`): every stage checkpoints, builds
a new `PipelineModule` and engine for the new boundaries and loads its layers, with their
optimizer state, by name (a PipelineModule names a layer's parameters by its global index,
`7.weight`, whichever stage holds it). Tested on CPU with gloo (two stages, SGD with momentum):
the losses equal one process's on the whole model before and after a re-split.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache
from typing import Any

from fleetwise.planner.stages import stage_spans
from fleetwise.training.sampler import MicrobatchMap, load_microbatch_map

__all__ = ["PipelineStages", "micro_batches", "micro_weight", "rank_config", "stage_bounds",
           "weighted_backward"]


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


def stage_bounds(layout: Mapping[Any, Sequence[int]], num_layers: int, *, leading: int = 0,
                 trailing: int = 0) -> list[int]:
    """A plan's layout ({stage: (first, last)}, inclusive, as its ranks and a rebalance's `layers`
    give it) as DeepSpeed's `PipelineModule.parts`: stage s holds module layers
    parts[s]..parts[s+1]-1 of `num_layers`.

    The plan counts the model's repeated layers; the module may have `leading` layers before
    them (an embedding) and `trailing` after (a final norm, the head), which stay with the first
    and the last stage. Raises ValueError unless the stages are 0..n-1 holding contiguous,
    non-empty runs of every planned layer in stage order."""
    try:
        spans = stage_spans(layout, last=num_layers - leading - trailing - 1)
    except ValueError as exc:
        raise ValueError(f"layout: {exc} (of {num_layers} module layers, {leading} before and "
                         f"{trailing} after the planned ones)") from None
    ends = [leading + spans[s][1] + 1 for s in sorted(spans)]
    return [0, *ends[:-1], num_layers]


@cache
def _planned_module_class() -> type:
    from deepspeed.pipe import PipelineModule

    class PlannedPipelineModule(PipelineModule):  # type: ignore[misc]
        """A PipelineModule whose stage boundaries are given (`parts`), not partitioned by DeepSpeed."""

        def __init__(self, *args: Any, parts: Sequence[int], **kwargs: Any) -> None:
            self._planned_parts = list(parts)
            super().__init__(*args, **kwargs)

        def _partition_layers(self, method: str = "uniform") -> None:  # DeepSpeed's hook
            self.parts = list(self._planned_parts)
            stage = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[stage], stop=self.parts[stage + 1])

    return PlannedPipelineModule


class PipelineStages:
    """A DeepSpeed pipeline engine on a plan's stage boundaries, which a rebalance can move.

    `layers`: the model's layers in order, as `PipelineModule` takes them (`LayerSpec` builds
    only a stage's own layers; modules given built are shared by every build). `layout`:
    {stage: (first, last)} (a plan's ranks' `stage` and `layers`). `config`: the DeepSpeed
    config (`fleetwise.planner.exports.deepspeed_config`), ZeRO stage 0. `optimizer`: builds the
    stage's optimizer from its parameters (None: the config's `optimizer` section). `leading`
    / `trailing`: module layers before the plan's first layer (an embedding) and after its last
    (final norm, head); they stay with the first / last stage. Other keywords go to
    `PipelineModule` (`loss_fn`, `topology`, `activation_checkpoint_interval`, ...).

    Train with `engine` (re-read it after each step: a re-split replaces it) and give the
    training plugin `stage`, `layers` and `rebuild`:

        stages = PipelineStages(layers, layout, config, optimizer=lambda p: SGD(p, lr=0.1),
                                loss_fn=loss)
        plugin = TrainingPlugin(model=stages.engine.module, optimizer=stages.engine.optimizer,
                                stage=stages.stage, layers=stages.layers, rebuild=stages.rebuild, ...)
        loss = stages.engine.train_batch(data_iter=...); plugin.end_step(samples=...)
    """

    def __init__(self, layers: Sequence[Any], layout: Mapping[int, Sequence[int]],
                 config: Mapping[str, Any], *,
                 optimizer: Callable[[Iterable[Any]], Any] | None = None, leading: int = 0,
                 trailing: int = 0, **module_kwargs: Any) -> None:
        zero = int((config.get("zero_optimization") or {}).get("stage", 0))
        if zero:
            # The plugin moves layers through torch.distributed.checkpoint, which reads a torch
            # optimizer's state by parameter name; ZeRO keeps it in DeepSpeed's own partitions.
            raise ValueError(f"PipelineStages needs ZeRO stage 0 (the config has {zero}): stage "
                             "boundaries move with the optimizer state found by parameter name")
        self._layers = list(layers)
        self._config = dict(config)
        self._optimizer = optimizer
        self._extra = {"leading": leading, "trailing": trailing}
        self._module_kwargs = module_kwargs
        self.layout: dict[int, tuple[int, int]] = {}
        self.engine: Any = None
        self._build(*self._checked(layout))

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return int(self.engine.stage_id)

    @property
    def layers(self) -> tuple[int, int]:
        """This rank's planned layers (first, last; inclusive)."""
        return self.layout[self.stage]

    def rebuild(self, layers: tuple[int, int], layout: Mapping[int, Sequence[int]]) -> tuple[Any, Any]:
        """The training plugin's callback: this stage built for `layout`; its (module, optimizer)
        for the plugin to load from the re-split's checkpoint. `engine` is the new one after;
        a refused layout (ValueError) leaves the running engine as it was."""
        stage = self.stage  # the topology, so a rank's stage, stays; only the boundaries move
        parts, spans = self._checked(layout)
        if len(spans) != len(self.layout):
            raise ValueError(f"rebuild: the layout has {len(spans)} stages, the running pipeline "
                             f"{len(self.layout)}")
        wanted = spans[stage]
        if wanted != tuple(layers):
            raise ValueError(f"rebuild: the plugin asked for layers {tuple(layers)}, the layout gives "
                             f"stage {stage} {wanted}")
        self._build(parts, spans)
        return self.engine.module, self.engine.optimizer

    def _checked(self, layout: Mapping[int, Sequence[int]]) -> tuple[list[int], dict[int, tuple[int, int]]]:
        """(PipelineModule parts, {stage: (first, last)}) of a layout of every module layer."""
        return stage_bounds(layout, len(self._layers), **self._extra), stage_spans(layout)

    def _build(self, parts: list[int], spans: dict[int, tuple[int, int]]) -> None:
        import deepspeed

        module = _planned_module_class()(layers=self._layers, num_stages=len(parts) - 1, parts=parts,
                                         **self._module_kwargs)
        optimizer = self._optimizer(module.parameters()) if self._optimizer is not None else None
        params = None if optimizer is not None else module.parameters()
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                                    model_parameters=params, config=self._config)
        self.layout = spans
