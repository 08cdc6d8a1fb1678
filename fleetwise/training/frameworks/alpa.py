"""Alpa: the plan as Alpa's manual pipeline-stage options. UNTESTED against Alpa itself.

Alpa (github.com/alpa-projects/alpa) is archived and its jaxlib build is not on PyPI, so this
export is checked here only as data. The option names are Alpa's own
(alpa/pipeline_parallel/stage_construction.py, `ManualStageOption`;
alpa/parallel_method.py, `PipeshardParallel`; alpa/shard_parallel/auto_sharding.py,
`AutoShardingOption.force_batch_dim_to_mesh_dim`):

    method = alpa.PipeshardParallel(
        num_micro_batches=export["num_micro_batches"],
        layer_option=alpa.AutoLayerOption(layer_num=export["layer_num"]),  # or ManualLayerOption
        stage_option=alpa.ManualStageOption(**export["stage_option"]),
        pipeline_schedule="1f1b",
    )

`forward_stage_layer_ids` follows the plan's (possibly uneven) layer split per stage;
each stage's submesh is its (hosts, GPUs per host) and its logical mesh (dp, tp), with the
batch dimension forced onto the data-parallel mesh axis. Alpa shards each stage's batch
evenly over its submesh, so uneven per-replica shares cannot be expressed: the export uses
the plan's common micro-batch, and `uneven_shares_dropped` says when the plan had them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["alpa_stage_option"]


def alpa_stage_option(plan: Any, num_layers: int | None = None) -> dict[str, Any]:
    """Alpa `ManualStageOption` fields (and `PipeshardParallel` arguments) for a `Plan`.

    `num_layers` defaults to the layers the plan's stages cover; each Alpa layer is one
    decoder layer (mark boundaries with `alpa.mark_pipeline_boundary()` per decoder layer,
    or `AutoLayerOption(layer_num=...)`).
    """
    from fleetwise.planner.exports import ExportError, common_micro_batch, stage_layer_counts

    counts = stage_layer_counts(plan, num_layers)
    layer_ids: list[list[int]] = []
    start = 0
    for c in counts:
        layer_ids.append(list(range(start, start + c)))
        start += c
    physical, logical = [], []
    for stage in range(plan.pp):
        ranks = [r for r in plan.ranks if r.stage == stage]
        per_node: dict[str, int] = defaultdict(int)
        for r in ranks:
            per_node[r.node] += 1
        sizes = set(per_node.values())
        if len(sizes) != 1:
            raise ExportError(
                f"stage {stage} uses {dict(per_node)} GPUs per node; Alpa submeshes need the same "
                "number of GPUs on every host of a stage"
            )
        physical.append([len(per_node), sizes.pop()])
        logical.append([plan.dp, plan.tp])
    micro = common_micro_batch(plan)
    if plan.global_batch % (micro * plan.dp):
        raise ExportError(
            f"global batch {plan.global_batch} is not a whole number of micro-batches of "
            f"{micro} x dp {plan.dp}"
        )
    shares = {r.samples for r in plan.ranks}
    return {
        "stage_option": {
            "forward_stage_layer_ids": layer_ids,
            "submesh_physical_shapes": physical,
            "submesh_logical_shapes": logical,
            "submesh_autosharding_option_dicts": [{"force_batch_dim_to_mesh_dim": 0} for _ in counts],
        },
        "layer_num": start,
        "num_micro_batches": plan.global_batch // (micro * plan.dp),
        "micro_batch": micro,
        "pipeline_schedule": "1f1b",
        "uneven_shares_dropped": len(shares) > 1,
        "tested": False,
    }
