"""Fleet simulator: synthetic DCGM telemetry, training step records, failures and their labels.

See docs/simulator.md for the model (physics, statistics, traps) and the label format.
"""

from fleetwise.sim.config import FAILURE_CLASSES, SimConfig, SimConfigError, parse_gpu_spec
from fleetwise.sim.simulator import FleetSimulator, Tick
from fleetwise.sim.trace import summarize_labels, write_labels, write_trace

__all__ = [
    "FAILURE_CLASSES",
    "FleetSimulator",
    "SimConfig",
    "SimConfigError",
    "Tick",
    "parse_gpu_spec",
    "summarize_labels",
    "write_labels",
    "write_trace",
]
