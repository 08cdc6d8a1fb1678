"""Training-side plugin: exact uneven data parallelism inside a PyTorch job.

torch is imported only under this package, and lazily: `import fleetwise.training` works
without the `train` extra; the gradient functions import torch when called.
"""

from fleetwise.training.control import CommandGate, TrainingPlugin
from fleetwise.training.gradients import (
    TokenWeightedHookState,
    WeightedHookState,
    WeightedReduceScatter,
    allreduce_gradients,
    allreduce_token_gradients,
    weighted_comm_hook,
    weighted_fsdp,
)
from fleetwise.training.sampler import (
    MicrobatchMap,
    ShareSampler,
    load_microbatch_map,
    shares_from_microbatch_map,
)
from fleetwise.training.telemetry import StepReporter
from fleetwise.training.transport import BusTransport, KafkaTransport, LocalTransport

__all__ = [
    "BusTransport",
    "CommandGate",
    "KafkaTransport",
    "LocalTransport",
    "StepReporter",
    "TrainingPlugin",
    "MicrobatchMap",
    "ShareSampler",
    "TokenWeightedHookState",
    "WeightedHookState",
    "WeightedReduceScatter",
    "allreduce_gradients",
    "allreduce_token_gradients",
    "load_microbatch_map",
    "shares_from_microbatch_map",
    "weighted_comm_hook",
    "weighted_fsdp",
]
