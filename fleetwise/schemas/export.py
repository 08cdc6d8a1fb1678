"""JSON Schema export for every record type (`fleetwise schemas export DIR`)."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from fleetwise.schemas.decisions import Ack, AuditEvent, Command, DeadLetter, OperatorAction, Prediction
from fleetwise.schemas.features import FeatureVector
from fleetwise.schemas.inventory import NodeInventory
from fleetwise.schemas.jobs import JobIntent, ModelShape
from fleetwise.schemas.plans import JobEnd, Plan
from fleetwise.schemas.telemetry import GpuSample, NodeBatch, TrainingStep

RECORD_TYPES: dict[str, type[BaseModel]] = {
    "gpu_sample": GpuSample,
    "node_batch": NodeBatch,
    "training_step": TrainingStep,
    "node_inventory": NodeInventory,
    "model_shape": ModelShape,
    "job_intent": JobIntent,
    "feature_vector": FeatureVector,
    "plan": Plan,
    "job_end": JobEnd,
    "prediction": Prediction,
    "ack": Ack,
    "audit": AuditEvent,
    "operator": OperatorAction,
    "command": Command,
    "deadletter": DeadLetter,
}


def json_schemas() -> dict[str, dict]:
    return {name: model.model_json_schema() for name, model in RECORD_TYPES.items()}


def write_json_schemas(directory: Path) -> list[Path]:
    """Write one `<record>.schema.json` per record type; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, schema in json_schemas().items():
        path = directory / f"{name}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        written.append(path)
    return written
