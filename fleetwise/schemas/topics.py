"""Topic registry: every Kafka topic Fleetwise uses, its key and its record type."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from fleetwise.schemas.decisions import Ack, Command, DeadLetter, OperatorAction, Prediction
from fleetwise.schemas.features import FeatureVector
from fleetwise.schemas.inventory import NodeInventory
from fleetwise.schemas.plans import Plan
from fleetwise.schemas.telemetry import NodeBatch, TrainingStep


@dataclass(frozen=True)
class Topic:
    name: str
    key: str  # what the message key is, e.g. "node/gpu", "node", "job"
    value_type: type[BaseModel]
    partitions: int
    compacted: bool = False
    description: str = ""


INVENTORY = Topic("fleetwise.inventory", "node", NodeInventory, 4, compacted=True,
                  description="node inventories, latest per node")
TELEMETRY_GPU = Topic("fleetwise.telemetry.gpu", "node", NodeBatch, 8,
                      description="one node batch of GPU samples per message")
TELEMETRY_STEPS = Topic("fleetwise.telemetry.steps", "job", TrainingStep, 8,
                        description="per-rank training step timings")
FEATURES = Topic("fleetwise.features", "node/gpu", FeatureVector, 8,
                  description="windowed per-GPU and per-rank features")
PLANS = Topic("fleetwise.plans", "job", Plan, 4, compacted=True, description="current plan per job")
PREDICTIONS = Topic("fleetwise.predictions", "node/gpu", Prediction, 4,
                    description="failure, straggler and trend predictions")
COMMANDS_TRAINING = Topic("fleetwise.commands.training", "job", Command, 4,
                          description="commands for the training-side plugin")
COMMANDS_KUBE = Topic("fleetwise.commands.kube", "job", Command, 4,
                      description="commands for the Kubernetes / KAI consumer")
ACKS = Topic("fleetwise.acks", "job", Ack, 4,
             description="consumers' acknowledgements of commands (key: job, else node)")
OPERATOR = Topic("fleetwise.operator", "target", OperatorAction, 1,
                 description="operators' approvals, denials and GPU returns")
AUDIT = Topic("fleetwise.audit", "job", Command, 4,
              description="every command emitted, and every rail, expiry and approval event (AuditEvent)")
DEADLETTER = Topic("fleetwise.deadletter", "source", DeadLetter, 1,
                   description="rejected records with the reason and original bytes")

TOPICS: tuple[Topic, ...] = (
    INVENTORY, TELEMETRY_GPU, TELEMETRY_STEPS, FEATURES, PLANS, PREDICTIONS,
    COMMANDS_TRAINING, COMMANDS_KUBE, ACKS, OPERATOR, AUDIT, DEADLETTER,
)


def topic(name: str) -> Topic:
    """The registry entry for a topic name; KeyError lists the known names."""
    for t in TOPICS:
        if t.name == name:
            return t
    raise KeyError(f"unknown topic {name!r}; known: {', '.join(t.name for t in TOPICS)}")
