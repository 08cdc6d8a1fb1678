"""Ray Train: a `TorchTrainer` whose workers take the plan's per-rank shares.

The driver builds the trainer from the planner's micro-batch map (`plan_trainer`): one Ray
worker per data-parallel replica, the shares in `train_loop_config`. Inside the training
loop each worker calls `worker_share(config)` to learn its data-parallel rank and sample
count; with `ray.train.torch.prepare_model` (a DDP model) it registers
`weighted_comm_hook` so the uneven shares combine into the global-batch mean.

Ray numbers its workers by its own placement, not by GPU type. On a mixed fleet a worker's
plan rank is chosen by its node's Ray accelerator type (`accelerator_type:<T>` resource,
named by `fleetwise.planner.exports.ray_accelerator_type`): `assign_plan_ranks` gives
each worker a replica planned for its GPU type (workers of one type keep Ray's order).
Without accelerator types (CPU, single type) worker i takes replica i.

Tested here on a local Ray (CPU, 127.0.0.1): tests/test_training_frameworks.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleetwise.training.sampler import MicrobatchMap, load_microbatch_map

__all__ = [
    "CONFIG_KEY",
    "WorkerShare",
    "assign_plan_ranks",
    "plan_loop_config",
    "plan_trainer",
    "worker_share",
]

# Key of the plan's shares in `train_loop_config`.
CONFIG_KEY = "fleetwise"


def plan_loop_config(
    mb_map: MicrobatchMap | Mapping[str, Any], types_by_dp_rank: Mapping[int, str | None] | None = None
) -> dict[str, Any]:
    """The part of `train_loop_config` a worker reads: shares and each replica's GPU type."""
    mb = mb_map if isinstance(mb_map, MicrobatchMap) else load_microbatch_map(mb_map)
    types = {int(k): v for k, v in (types_by_dp_rank or {}).items()}
    return {
        "shares": list(mb.shares),
        "global_batch": mb.global_batch,
        "accelerator_types": [types.get(i) for i in range(len(mb.shares))],
    }


def assign_plan_ranks(worker_types: Sequence[str | None], plan_types: Sequence[str | None]) -> list[int]:
    """Data-parallel rank for each Ray worker, matching GPU types (a pure function).

    `worker_types[w]` is the accelerator type worker w runs on, `plan_types[d]` the type the
    plan put replica d on (None: unknown). Each worker takes the lowest free replica of its
    type; the rest are paired in order. Raises if the counts differ.
    """
    if len(worker_types) != len(plan_types):
        raise ValueError(
            f"{len(worker_types)} Ray workers but the plan has {len(plan_types)} data-parallel replicas"
        )
    free = list(range(len(plan_types)))
    out: list[int | None] = [None] * len(worker_types)
    for w, wtype in enumerate(worker_types):
        if wtype is None:
            continue
        for d in free:
            if plan_types[d] == wtype:
                out[w] = d
                free.remove(d)
                break
    for w in range(len(worker_types)):
        if out[w] is None:
            out[w] = free.pop(0)
    return [int(d) for d in out if d is not None]


@dataclass(frozen=True)
class WorkerShare:
    """What a Ray worker needs to train its share: its data-parallel rank and the shares."""

    world_rank: int
    dp_rank: int
    shares: list[int]
    global_batch: int

    @property
    def local_samples(self) -> int:
        return self.shares[self.dp_rank]


def _node_accelerator_type() -> str | None:
    """This worker's node's Ray accelerator type (from its `accelerator_type:<T>` resource)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            for key in node.get("Resources", {}):
                if key.startswith("accelerator_type:"):
                    return key.split(":", 1)[1]
    return None


def worker_share(config: Mapping[str, Any]) -> WorkerShare:
    """Inside `train_loop_per_worker`: this worker's data-parallel rank and share.

    Collective over the Ray Train process group (every worker must call it): workers
    exchange their accelerator types to agree on `assign_plan_ranks`.
    """
    import ray.train
    import torch.distributed as dist

    if CONFIG_KEY not in config:
        raise KeyError(f"train_loop_config lacks {CONFIG_KEY!r}; build the trainer with plan_trainer")
    plan = config[CONFIG_KEY]
    ctx = ray.train.get_context()
    world_rank, world = ctx.get_world_rank(), ctx.get_world_size()
    shares = [int(s) for s in plan["shares"]]
    if world != len(shares):
        raise ValueError(f"{world} Ray workers but the plan has {len(shares)} data-parallel replicas")
    mine = _node_accelerator_type()
    types: list[Any] = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(types, mine)
    else:
        types = [mine]
    ranks = assign_plan_ranks(types, plan.get("accelerator_types") or [None] * world)
    return WorkerShare(world_rank, ranks[world_rank], shares, int(plan["global_batch"]))


def plan_trainer(
    train_loop_per_worker: Callable[[dict[str, Any]], Any],
    mb_map: MicrobatchMap | Mapping[str, Any],
    *,
    train_loop_config: Mapping[str, Any] | None = None,
    scaling: Mapping[str, Any] | None = None,
    use_gpu: bool = False,
    resources_per_worker: Mapping[str, float] | None = None,
    run_config: Any = None,
    types_by_dp_rank: Mapping[int, str | None] | None = None,
) -> Any:
    """A `ray.train.torch.TorchTrainer` with one worker per data-parallel replica of the plan.

    `scaling` is `fleetwise.planner.exports.ray_scaling_config(plan)` (its accelerator type,
    placement and per-worker resources are used; `use_gpu` follows it); without it the
    trainer asks for `use_gpu`/`resources_per_worker` as given (CPU tests). The plan's shares
    reach the loop as `config["fleetwise"]` (read with `worker_share`).
    """
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    mb = mb_map if isinstance(mb_map, MicrobatchMap) else load_microbatch_map(mb_map)
    if mb.raw.get("tp", 1) != 1 or mb.raw.get("pp", 1) != 1:
        raise ValueError(
            "plan_trainer runs pure data parallelism (one worker per replica); the plan has "
            f"tp={mb.raw.get('tp')}, pp={mb.raw.get('pp')}"
        )
    types = dict(types_by_dp_rank or {})
    kwargs: dict[str, Any] = {"num_workers": len(mb.shares), "use_gpu": use_gpu}
    if scaling is not None:
        kwargs.update(
            use_gpu=bool(scaling.get("use_gpu", use_gpu)),
            accelerator_type=scaling.get("accelerator_type"),
            placement_strategy=scaling.get("placement_strategy", "PACK"),
            resources_per_worker=dict(scaling.get("resources_per_worker") or {}) or None,
        )
        if not types:
            groups = scaling.get("worker_groups", [])
            by_rank = {r: g.get("accelerator_type") for g in groups for r in g["ranks"]}
            types = {mb.dp_rank(r): t for r, t in by_rank.items() if r in mb.ranks}
    if resources_per_worker is not None:
        kwargs["resources_per_worker"] = dict(resources_per_worker)
    config = dict(train_loop_config or {})
    config[CONFIG_KEY] = plan_loop_config(mb, types)
    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(**kwargs),
        run_config=run_config,
    )
