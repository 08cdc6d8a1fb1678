"""Node agent: inventory + collectors (NVML, dcgm-exporter, simulator) -> Kafka.

An adapter package: it reads the node (NVML, an HTTP scrape, sysfs, the simulator), builds
the records of `fleetwise.schemas`, and hands them to an idempotent Kafka producer through a
bounded drop-oldest buffer. See docs/agent.md.
"""

from fleetwise.agent.buffer import DropOldestBuffer
from fleetwise.agent.collector import Collector, CollectorError, batches_by_node
from fleetwise.agent.config import (
    AgentConfigError,
    NodeConfig,
    parse_labels,
    parse_nic,
    parse_nvlink_groups,
    parse_power,
)
from fleetwise.agent.dcgm import DcgmCollector, gpus_from_page, samples_from_page
from fleetwise.agent.inventory import build_inventory, read_sys_nics
from fleetwise.agent.nvml import NvmlCollector
from fleetwise.agent.prom import PromPage, PromParseError, PromSample, parse_exposition
from fleetwise.agent.publisher import BatchPublisher, PublisherStats
from fleetwise.agent.runner import AgentRun, run_agent
from fleetwise.agent.sim import SimCollector

__all__ = [
    "AgentConfigError", "AgentRun", "BatchPublisher", "Collector", "CollectorError", "DcgmCollector",
    "DropOldestBuffer", "NodeConfig", "NvmlCollector", "PromPage", "PromParseError", "PromSample",
    "PublisherStats", "SimCollector", "batches_by_node", "build_inventory", "gpus_from_page",
    "parse_exposition", "parse_labels", "parse_nic", "parse_nvlink_groups", "parse_power",
    "read_sys_nics", "run_agent", "samples_from_page",
]
