"""Parallelism planning for mixed GPU generations: cost model, search and re-planning."""

from fleetwise.planner.cluster import Cluster, GpuSlot, cluster_from_inventory, parse_gpu_spec
from fleetwise.planner.models import MODEL_PRESETS, load_model, parse_model_dict, resolve_model
from fleetwise.planner.replan import RankDiff, diff_plans, plan_timeline, replan
from fleetwise.planner.search import (
    InfeasiblePlanError,
    PlanRequest,
    plan_job,
    request_for_intent,
    request_for_plan,
)
from fleetwise.planner.shares import proportional_shares

__all__ = [
    "MODEL_PRESETS",
    "Cluster",
    "GpuSlot",
    "InfeasiblePlanError",
    "PlanRequest",
    "RankDiff",
    "cluster_from_inventory",
    "diff_plans",
    "load_model",
    "parse_gpu_spec",
    "parse_model_dict",
    "plan_job",
    "plan_timeline",
    "proportional_shares",
    "replan",
    "request_for_intent",
    "request_for_plan",
    "resolve_model",
]
