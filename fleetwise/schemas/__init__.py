"""Record types (pydantic v2) and the topic registry: the contracts between components."""

from fleetwise.schemas._base import (
    Record,
    Timestamp,
    describe_error,
    is_dcgm_blank,
    parse_timestamp,
)
from fleetwise.schemas.decisions import (
    Ack,
    AuditEvent,
    Command,
    DeadLetter,
    OperatorAction,
    Prediction,
    Signal,
)
from fleetwise.schemas.features import FeatureVector
from fleetwise.schemas.inventory import GpuInventory, Nic, NodeInventory
from fleetwise.schemas.jobs import JobConstraints, JobIntent, ModelShape
from fleetwise.schemas.plans import JobEnd, Plan, RankPlan, plans_message
from fleetwise.schemas.telemetry import GpuSample, NodeBatch, TrainingStep
from fleetwise.schemas.topics import TOPICS, Topic, topic

__all__ = [
    "Ack", "AuditEvent", "Command", "DeadLetter", "FeatureVector", "GpuInventory", "GpuSample",
    "JobConstraints", "JobEnd", "JobIntent", "ModelShape", "Nic", "NodeBatch", "NodeInventory",
    "OperatorAction", "Plan", "Prediction", "RankPlan", "Record", "Signal", "TOPICS", "Timestamp",
    "Topic", "TrainingStep", "describe_error", "is_dcgm_blank", "parse_timestamp", "plans_message",
    "topic",
]
