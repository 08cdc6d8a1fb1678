"""Prometheus metrics shared by the stream worker and the node agent.

One set of metric objects per process (the default prometheus-client registry), so the
worker and the agent expose the same names; `component` tells them apart in queries.
The Grafana dashboard in deploy/grafana/fleetwise.json is built over exactly these names.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

SAMPLES_IN = Counter(
    "fleetwise_samples_in_total",
    "GPU samples (and training steps) received, before validation",
    ["component", "topic"],
)
MESSAGES_IN = Counter(
    "fleetwise_messages_in_total",
    "Kafka messages received (one node batch is one message)",
    ["component", "topic"],
)
DEADLETTER = Counter(
    "fleetwise_deadletter_total",
    "records rejected to the dead-letter topic, by reason category",
    ["reason"],
)
REDELIVERED = Counter(
    "fleetwise_redelivered_skipped_total",
    "messages skipped because the state already held them (re-delivered after a restart or rebalance)",
    ["topic"],
)
ASSIGNED_PARTITIONS = Gauge(
    "fleetwise_assigned_partitions",
    "input partitions assigned to this worker (after the last rebalance)",
    ["topic"],
)
CONSUMER_LAG = Gauge(
    "fleetwise_consumer_lag_messages",
    "messages behind the partition's high-water mark after the last processed batch",
    ["topic", "partition"],
)
WINDOW_STATE_KEYS = Gauge(
    "fleetwise_window_state_keys",
    "keys (node/gpu or job) with live processor state in this worker",
)
WINDOW_STATE_BYTES = Gauge(
    "fleetwise_window_state_bytes",
    "JSON size of the processor state last saved to the changelogged table, summed over keys",
)
STATE_RECOVERY = Gauge(
    "fleetwise_state_recovery_seconds",
    "how long this worker's current recovery of the state table (its changelog read back after a "
    "start or rebalance; input waits meanwhile) has run, 0 when none is running",
)
CHECKPOINT_WRITES = Gauge(
    "fleetwise_checkpoint_writes_pending",
    "checkpoint writes started and not yet acknowledged by the broker (at most 1: a checkpoint "
    "waits while one is in flight)",
)
# Buckets span a co-located broker (ms) to a backed-up worker (tens of s); the issue's
# latency target is p99 < 500 ms, so the buckets are dense around it.
PROCESSING_LATENCY = Histogram(
    "fleetwise_processing_latency_seconds",
    "wall time from the producer's send to the worker's output being acknowledged",
    ["topic"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0),
)
BATCH_SIZE = Histogram(
    "fleetwise_batch_messages",
    "messages per processed stream.take batch",
    ["topic"],
    buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000),
)
DECISIONS_OUT = Counter(
    "fleetwise_decisions_out_total",
    "records emitted by the worker: features, predictions, commands",
    ["kind", "type"],
)
# The alerting rules (deploy/prometheus/rules.yml) watch these: audit events by event name
# ("breaker_open", "breaker_held", "expired", "suppressed", ...: one label value per event the
# policy emits, a small fixed set) and whether the drain circuit breaker is open now.
AUDIT_EVENTS = Counter(
    "fleetwise_audit_events_total",
    "audit events the control plane emitted (rails, circuit breaker, expiries, approvals), by event",
    ["event"],
)
BREAKER_OPEN = Gauge(
    "fleetwise_breaker_open",
    "1 while the drain circuit breaker is open in this worker's policy, else 0",
)
PEER_DRAINS = Gauge(
    "fleetwise_peer_drains",
    "GPUs other workers are taking out of service (their drains, read on the command topics), "
    "counted by this worker's fleet-wide rails",
)
# The action policy's per-job state: jobs known only from predictions are dropped once silent
# for a day of event time (fleetwise/actuators/policy.py, RETIRE_JOB_S); the rest stay.
POLICY_JOBS = Gauge(
    "fleetwise_policy_jobs",
    "jobs the action policy holds state for in this worker (at the last checkpoint)",
)
POLICY_JOBS_RETIRED = Gauge(
    "fleetwise_policy_jobs_retired",
    "jobs the action policy dropped as silent since this worker started",
)
POLICY_JOBS_ENDED = Gauge(
    "fleetwise_policy_jobs_ended",
    "ended jobs (plan tombstone or job_end record) the action policy dropped since this worker started",
)
STATE_EVICTED = Counter(
    "fleetwise_state_evicted_keys_total",
    "GPUs whose window state was evicted (idle longest in event time) to keep the worker under its bound",
)
AGENT_OVERSIZED = Counter(
    "fleetwise_agent_oversized_total",
    "node batches the agent dropped because the broker refused them as too large (never retried)",
    ["node"],
)
AGENT_DROPPED = Counter(
    "fleetwise_agent_dropped_total",
    "node batches the agent dropped (oldest first) because its buffer was full",
    ["node"],
)
AGENT_BUFFERED = Gauge(
    "fleetwise_agent_buffered_batches",
    "node batches waiting in the agent's buffer for the broker",
    ["node"],
)

# Per GPU, as of its last closed feature hop (fleetwise.predictors.trends): a worker holds only
# its partitions' GPUs, so roll-ups per rack and site are Prometheus's (sum/min/avg by the
# labels; the Grafana dashboard's "Thermal headroom" panels), which see every worker.
_GPU_LABELS = ["node", "gpu", "rack", "site"]
GPU_HEADROOM = Gauge(
    "fleetwise_gpu_thermal_headroom_celsius",
    "thermal limit minus the GPU's temperature: at='now' the hop's hottest sample, at='full_power' "
    "its own temperature-on-power fit at TDP",
    [*_GPU_LABELS, "at"],
)
GPU_DRIFT = Gauge(
    "fleetwise_gpu_temp_drift_celsius_per_day",
    "how fast the GPU's temperature at full power rises (its 6 h against its 72 h fit)",
    _GPU_LABELS,
)
GPU_UTILISATION = Gauge(
    "fleetwise_gpu_utilisation_percent",
    "the GPU's mean utilisation over its last closed feature hop",
    _GPU_LABELS,
)
GPU_LAST_HOP = Gauge(
    "fleetwise_gpu_last_hop_timestamp_seconds",
    "event time (Unix s) of the GPU's last closed feature hop: the per-GPU gauges are as of then "
    "(series of a GPU without a hop for GPU_SERIES_STALE_S of the worker's event time are removed)",
    _GPU_LABELS,
)
# A GPU that stopped reporting, or whose partition moved to another worker, would keep its last
# values here (twice in the roll-ups, in the second case): its series go once the worker's
# newest hop is this much later than its last (event time; checked every _SWEEP_EVERY_S of it).
GPU_SERIES_STALE_S = 3600.0
_SWEEP_EVERY_S = 600.0
# Per GPU: the label values its series were set with, and the end of its last hop seen here.
_gpu_series: dict[tuple[str, int], tuple[tuple[str, str, str, str], float]] = {}
_last_sweep_ts = [-math.inf]


def observe_gpu_headroom(keys: Sequence[tuple[str, int]], places: Sequence[tuple[str | None, str | None]],
                         ts: Any, hops: Any) -> None:
    """Set the per-GPU gauges from closed hops (`ControlPlane.hop_observers`; a GPU's later hop
    in the same call overwrites its earlier one). Unknown values are left as they were."""
    for i, (node, gpu) in enumerate(keys):
        rack, site = places[i]
        labels = (node, str(gpu), rack or "", site or "")
        old = _gpu_series.get((node, int(gpu)))
        if old is not None and old[0] != labels:  # moved to another rack or site: one series per GPU
            forget_gpus([f"{node}/{gpu}"])
        _gpu_series[(node, int(gpu))] = (labels, float(ts[i]))
        GPU_LAST_HOP.labels(*labels).set(float(ts[i]))
        for gauge, value, extra in ((GPU_HEADROOM, hops.headroom_c[i], ("now",)),
                                    (GPU_HEADROOM, hops.headroom_at_tdp_c[i], ("full_power",)),
                                    (GPU_DRIFT, hops.drift_c_per_day[i], ()),
                                    (GPU_UTILISATION, hops.util_pct[i], ())):
            if not math.isnan(value):
                gauge.labels(*labels, *extra).set(float(value))
    newest = max((float(t) for t in ts), default=None)
    if newest is not None and abs(newest - _last_sweep_ts[0]) >= _SWEEP_EVERY_S:
        _last_sweep_ts[0] = newest
        forget_gpus([f"{n}/{g}" for (n, g), (_, t) in _gpu_series.items() if t < newest - GPU_SERIES_STALE_S])


def forget_gpus(keys: Sequence[str]) -> None:
    """Remove the per-GPU series of GPUs ("node/gpu") whose state the worker dropped (evicted as
    idle) or that went stale: a GPU gone no longer shows its last values in the roll-ups."""
    for key in keys:
        node, _, gpu = key.rpartition("/")
        known = _gpu_series.pop((node, int(gpu)), None)
        if known is None:
            continue
        labels = known[0]
        for gauge, extra in ((GPU_HEADROOM, ("now",)), (GPU_HEADROOM, ("full_power",)), (GPU_DRIFT, ()),
                             (GPU_UTILISATION, ()), (GPU_LAST_HOP, ())):
            with contextlib.suppress(KeyError):  # never set (an unknown value)
                gauge.remove(*labels, *extra)


# Reason text is free-form (it names fields and values); metrics need a small, fixed label
# set, so a reason is mapped to the first category whose pattern it matches.
_REASON_CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = (
    # the limits (docs/streams.md, "Limits"): a flood, a unit mix-up, an oversized message, a
    # message keyed by another node than its payload's
    ("rate_limited", re.compile(r"^rate:")),
    ("implausible", re.compile(r"outside the plausible range")),
    ("oversized", re.compile(r"^message: \d+ bytes is over the limit")),
    ("wrong_key", re.compile(r"^key:")),
    ("unsigned", re.compile(r"^signature:")),  # a producer's message its writer did not sign
    ("unknown_model", re.compile(r"unknown gpu|^model:", re.I)),
    ("not_json", re.compile(r"not valid json|expected a json object|empty message", re.I)),
    ("not_finite", re.compile(r"finite", re.I)),
    ("timestamp", re.compile(r"timestamp|(^|[ ;.])ts:", re.I)),
)


def reason_category(reason: str) -> str:
    """A low-cardinality label for a dead-letter reason ("invalid" when nothing matches)."""
    for name, pattern in _REASON_CATEGORIES:
        if pattern.search(reason):
            return name
    return "invalid"


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> int:
    """Serve /metrics on `port` (0 picks a free port); returns the port in use."""
    server, _thread = start_http_server(port, addr=addr)
    return int(server.server_address[1])


class RecoveryClock:
    """How long the running state recovery has lasted, from periodic looks at whether one runs
    (`fleetwise_state_recovery_seconds`): 0 when none runs; a look that finds one after none
    starts the count."""

    def __init__(self) -> None:
        self.began: float | None = None

    def observe(self, in_recovery: bool, now: float) -> float:
        if not in_recovery:
            self.began = None
            return 0.0
        if self.began is None:
            self.began = now
        return now - self.began
