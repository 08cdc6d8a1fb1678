"""The node agent's Prometheus metrics (served by `fleetwise agent --metrics-port`).

The dropped-batches counter and the buffer-depth gauge are the shared ones from
`fleetwise.streams.metrics` (the Grafana dashboard reads them); the rest are the agent's own.
All are labelled by `agent` = the agent's node name (or "sim" for a simulated fleet).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from fleetwise.streams.metrics import AGENT_BUFFERED, AGENT_DROPPED, AGENT_OVERSIZED, start_metrics_server

SAMPLES_COLLECTED = Counter(
    "fleetwise_agent_samples_collected_total", "GPU samples the agent collected", ["agent"]
)
BATCHES_COLLECTED = Counter(
    "fleetwise_agent_batches_collected_total", "node batches the agent collected", ["agent"]
)
BATCHES_SENT = Counter(
    "fleetwise_agent_batches_sent_total", "node batches acknowledged by the broker", ["agent"]
)
INVENTORIES_SENT = Counter(
    "fleetwise_agent_inventories_sent_total", "node inventories acknowledged by the broker", ["agent"]
)
SEND_ERRORS = Counter(
    "fleetwise_agent_send_errors_total",
    "failed sends and failed connection attempts (the batches stay buffered)",
    ["agent"],
)
COLLECT_ERRORS = Counter(
    "fleetwise_agent_collect_errors_total", "collection ticks that failed (source unreachable)", ["agent"]
)
# A tick is one NVML sweep or one exporter scrape: milliseconds normally, seconds when stuck.
COLLECT_SECONDS = Histogram(
    "fleetwise_agent_collect_seconds",
    "wall time of one collection tick",
    ["agent"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

__all__ = [
    "AGENT_BUFFERED", "AGENT_DROPPED", "AGENT_OVERSIZED",
    "BATCHES_COLLECTED", "BATCHES_SENT", "COLLECT_ERRORS",
    "COLLECT_SECONDS", "INVENTORIES_SENT", "SAMPLES_COLLECTED", "SEND_ERRORS", "start_metrics_server",
]
