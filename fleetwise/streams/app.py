"""The Kafka stream worker: a faust-streaming app around the same `ControlPlane` the embedded
runtime uses.

Per input message the worker does only adapter work: hand the raw bytes to
`ControlPlane.decode` (bad input -> a DeadLetter with the reason and the original bytes),
batch messages with `stream.take_events` so Python overhead is per batch, run
`ControlPlane.handle` in event time, and publish what it routes to the registry's topics.

State. Processor state lives in one faust Table, ``fleetwise-state``, changelogged to Kafka.
One entry per processor key ("node/gpu" or "job"): ``{"state": {processor: state},
"offsets": {"topic:partition": offset}}``. Every `checkpoint_interval_s` the worker writes
the entries of the keys changed since the last checkpoint (each key always to the changelog
partition of its input partition, so the latest write wins on recovery and state moves with
its partition), and only then acks the input events, so faust's offset commits never run
ahead of the saved state; outputs are acknowledged by the broker before the batch is done.
A restarted worker recovers the table from the changelog and, on first sight of a key,
restores the processors from it. Because an entry records the last input offset applied to
the key, messages re-delivered after a crash are skipped for keys whose state already holds
them: outputs are at-least-once, state application is exactly-once per key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import faust

from fleetwise.schemas import DeadLetter, GpuSample, NodeBatch, Record, TrainingStep
from fleetwise.schemas import topics as T
from fleetwise.streams import metrics as M
from fleetwise.streams.kafka_io import PRODUCED_AT_HEADER, topic_name
from fleetwise.streams.pipeline import ControlPlane, Routed

log = logging.getLogger(__name__)

STATE_TABLE = "fleetwise-state"
# Header on every output: the earliest producer send time among the input messages of the
# batch that produced it (a conservative start point for produce -> output latency).
INPUT_PRODUCED_AT_HEADER = "fleetwise-input-produced-at"
# Processors with at most this many keys are checked in full after every batch (cheap, and
# catches job-level state such as the action policy's that a GPU sample can change).
SMALL_PROCESSOR_KEYS = 256


def _header(headers: Any, name: str) -> bytes | None:
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for k, v in items:
        if k == name:
            return v
    return None


def produced_at(message: Any) -> float:
    """Producer send time of a faust message: our header if present, else the Kafka timestamp."""
    raw = _header(message.headers, PRODUCED_AT_HEADER)
    if raw is not None:
        try:
            return float(raw)
        except ValueError:
            pass
    return float(message.timestamp or 0.0)


def state_partition(inner: str, partitions: int) -> int:
    """Changelog partition for a key's state: the partition Kafka's default partitioner
    (murmur2, as the Java and aiokafka producers use) gives the input message of that key
    (telemetry by node, steps by job). Every write of a key then lands in one changelog
    partition (so the latest write wins on recovery) and moves with its input partition."""
    from aiokafka.partitioner import murmur2

    message_key = inner.split("/", 1)[0]
    return (murmur2(message_key.encode()) & 0x7FFFFFFF) % partitions


def record_keys(record: Record) -> tuple[str, ...]:
    """The processor keys (inner, without the processor name) an input record belongs to."""
    if isinstance(record, GpuSample):
        return (f"{record.node}/{record.gpu}",)
    if isinstance(record, NodeBatch):
        return tuple(f"{s.node}/{s.gpu}" for s in record.samples)
    if isinstance(record, TrainingStep):
        return (record.job, f"{record.node}/{record.gpu}")
    return ()


class StreamProcessor:
    """The worker's logic between faust and the ControlPlane (no faust types in its API
    beyond the events it is handed), so it can be driven and tested on its own."""

    def __init__(
        self,
        control: ControlPlane,
        table: Any,
        send: Callable[[str, bytes, bytes, list[tuple[str, bytes]]], Any],
        *,
        topic_prefix: str = "",
        state_partitions: int = T.TELEMETRY_GPU.partitions,
    ) -> None:
        self.control = control
        self.state_partitions = state_partitions
        self._partition_of: dict[str, int] = {}
        self.table = table  # faust Table (uses .data and .send_changelog) or a stand-in
        self.send = send  # async (topic, key, value, headers) -> awaitable delivery future
        self.prefix = topic_prefix
        self._offsets: dict[str, dict[str, int]] = {}  # inner key -> {"topic:partition": offset}
        self._saved_json: dict[str, str] = {}  # inner key -> JSON of the state last saved
        self._restored_from: dict[str, Any] = {}  # inner key -> offsets of the entry restored
        self._dirty: set[str] = set()  # keys changed since the last checkpoint

    # -- decoding --------------------------------------------------------------------------
    def decode(self, topic: str, raw: bytes | None, source: str) -> list[Record]:
        """Records of one message: a fast path for a clean node batch (validated in pydantic's
        Rust core), else the ControlPlane's per-sample validation with dead letters."""
        if raw is None:
            return [self.control.dead_letter(source, "empty message (no value)", b"")]
        if topic == T.TELEMETRY_GPU.name and raw[:1] == b"{":
            try:
                batch = NodeBatch.model_validate_json(raw)
            except ValueError:
                batch = None
            if batch is not None and all(self.control.model_id(s.model) for s in batch.samples):
                return list(batch.samples)
        return self.control.decode(topic, raw, source=source)

    # -- state -----------------------------------------------------------------------------
    def _restore_if_newer(self, inner: str) -> None:
        entry = self.table.data.get(inner)
        if not entry:
            return
        offsets = entry.get("offsets", {})
        if self._restored_from.get(inner) == offsets or self._offsets.get(inner) == offsets:
            return  # this worker wrote (or already restored) exactly that entry
        log.info("restoring %s from the state table (offsets %s)", inner, offsets)
        for name, state in entry.get("state", {}).items():
            self.control.restore(f"{name}:{inner}", state)
        self._offsets[inner] = dict(offsets)
        self._restored_from[inner] = offsets
        self._saved_json[inner] = json.dumps(entry.get("state", {}), sort_keys=True)

    def _already_applied(self, inner: str, tp: str, offset: int) -> bool:
        return self._offsets.get(inner, {}).get(tp, -1) >= offset

    def _snapshot(self, touched: set[str]) -> dict[str, dict]:
        """State entries for the touched keys (plus changed keys of small processors)."""
        by_inner: dict[str, dict[str, dict]] = {}
        per_processor: dict[str, list[str]] = {}
        for full in self.control.keys():  # noqa: SIM118 - ControlPlane is not a mapping
            name, _, inner = full.partition(":")
            per_processor.setdefault(name, []).append(inner)
        for name, inners in per_processor.items():
            small = len(inners) <= SMALL_PROCESSOR_KEYS
            for inner in inners:
                if inner in touched or small:
                    by_inner.setdefault(inner, {})[name] = self.control.state(f"{name}:{inner}")
        out: dict[str, dict] = {}
        for inner, states in by_inner.items():
            text = json.dumps(states, sort_keys=True)
            if inner not in touched and self._saved_json.get(inner) == text:
                continue
            out[inner] = {"state": states, "text": text}
        return out

    # -- one batch -------------------------------------------------------------------------
    async def process_events(self, topic: str, events: Sequence[Any]) -> list[Routed]:
        """Decode, deduplicate, handle and publish one batch of faust events of `topic`
        (a registry name); save state for the keys touched. Returns what was routed."""
        t0 = time.perf_counter()
        records: list[Record] = []
        touched: set[str] = set()
        tp_of_inner: dict[str, tuple[str, int]] = {}
        first_produced = None
        dead = 0
        for event in events:
            msg = event.message
            tp = f"{topic}:{msg.partition}"
            source = f"{msg.topic}:{msg.partition}:{msg.offset}"
            produced = produced_at(msg)
            first_produced = produced if first_produced is None else min(first_produced, produced)
            decoded = self.decode(topic, event.value if event.value is not None else msg.value, source)
            M.MESSAGES_IN.labels("worker", topic).inc()
            M.SAMPLES_IN.labels("worker", topic).inc(len(decoded))
            for record in decoded:
                if isinstance(record, DeadLetter):
                    records.append(record)
                    dead += 1
                    M.DEADLETTER.labels(M.reason_category(record.reason)).inc()
                    continue
                inners = record_keys(record)
                if inners:
                    primary = inners[0]
                    self._restore_if_newer(primary)
                    if self._already_applied(primary, tp, msg.offset):
                        continue  # re-delivered after a restart; this key's state has it
                    for inner in inners:
                        touched.add(inner)
                        tp_of_inner[inner] = (tp, msg.offset)
                records.append(record)

        routed = self.control.handle(topic, records) if records else []
        for inner, (tp, offset) in tp_of_inner.items():
            self._offsets.setdefault(inner, {})[tp] = offset
        self._dirty |= touched

        # 1. outputs, acknowledged by the broker before any state or offset moves on
        headers = [(INPUT_PRODUCED_AT_HEADER, repr(first_produced or 0.0).encode())]
        futures = []
        for out_topic, key, record in routed:
            value = record.model_dump_json(exclude_none=True).encode()
            futures.append(await self.send(topic_name(out_topic, self.prefix), key.encode(), value, headers))
            kind = getattr(record, "kind", "record")
            label = getattr(record, "type", None) or getattr(record, "scope", kind)
            M.DECISIONS_OUT.labels(kind, label).inc()
        for fut in futures:
            await fut
        # 3. metrics (wall clock is measurement only; processing above is event time)
        now = time.time()
        for event in events:
            M.PROCESSING_LATENCY.labels(topic).observe(max(0.0, now - produced_at(event.message)))
        M.BATCH_SIZE.labels(topic).observe(len(events))
        log.debug("batch %s: %d messages, %d records, %d dead, %d out, %.1f ms", topic, len(events),
                  len(records), dead, len(routed), 1000 * (time.perf_counter() - t0))
        return routed

    def checkpoint(self) -> int:
        """Write the state of every key changed since the last checkpoint to the table (and
        its changelog). Call it only when the outputs of all processed batches have been
        acknowledged, and ack the input events only after it. Returns the keys written."""
        snapshot = self._snapshot(self._dirty)
        self._dirty = set()
        for inner, item in snapshot.items():
            partition = self._partition_of.get(inner)
            if partition is None:
                partition = self._partition_of[inner] = state_partition(inner, self.state_partitions)
            offsets = dict(self._offsets.get(inner, {}))
            entry = {"state": item["state"], "offsets": offsets}
            self.table.data[inner] = entry
            self.table.send_changelog(partition, inner, entry)
            self._saved_json[inner] = item["text"]
            self._restored_from[inner] = offsets
        M.WINDOW_STATE_KEYS.set(len(self._saved_json))
        M.WINDOW_STATE_BYTES.set(sum(len(t) for t in self._saved_json.values()))
        return len(snapshot)


def make_app(
    bootstrap: str,
    *,
    app_id: str = "fleetwise",
    store: str = "memory://",
    web_port: int | None = None,
    topic_prefix: str = "",
    control: ControlPlane | None = None,
    take_max: int = 500,
    take_within_s: float = 0.05,
    state_partitions: int = T.TELEMETRY_GPU.partitions,
    session_timeout_s: float = 10.0,
    commit_interval_s: float = 1.0,
    checkpoint_interval_s: float = 5.0,
    **settings: Any,
) -> faust.App:
    """The faust app: topics from the registry, the telemetry / steps / context agents and
    the changelogged state table. `topic_prefix` namespaces every topic (tests).

    `store`: "memory://" (state rebuilt from the changelog at start) or "rocksdb://"
    (needs the python-rocksdict package). Only event time is used in processing.
    """
    if T.TELEMETRY_STEPS.partitions != state_partitions:
        raise ValueError("state table must be co-partitioned with telemetry and steps topics")
    app = faust.App(
        app_id,
        broker=[f"kafka://{hp.strip()}" for hp in bootstrap.split(",")],
        store=store,
        web_enabled=web_port is not None,
        web_port=web_port or 6066,
        topic_partitions=state_partitions,
        topic_replication_factor=1,
        broker_session_timeout=session_timeout_s,
        broker_heartbeat_interval=max(0.5, session_timeout_s / 10),
        broker_rebalance_timeout=session_timeout_s,
        broker_commit_interval=commit_interval_s,
        consumer_auto_offset_reset="earliest",
        stream_wait_empty=False,
        producer_linger_ms=5,
        producer_max_batch_size=256 * 1024,
        key_serializer="raw",
        value_serializer="raw",
        **settings,
    )
    control = control or ControlPlane()

    def source(t: T.Topic) -> faust.TopicT:
        return app.topic(topic_name(t, topic_prefix), partitions=t.partitions,
                         key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    telemetry_topic = source(T.TELEMETRY_GPU)
    steps_topic = source(T.TELEMETRY_STEPS)
    context_topic = app.topic(
        topic_name(T.INVENTORY, topic_prefix), topic_name(T.PLANS, topic_prefix),
        key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw",
    )
    table = app.Table(STATE_TABLE, default=None, partitions=state_partitions,
                      key_type=str)

    async def send(topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> Any:
        return await app.producer.send(topic, key, value, partition=None, timestamp=None, headers=headers)

    processor = StreamProcessor(control, table, send, topic_prefix=topic_prefix,
                                state_partitions=state_partitions)
    app.fleetwise_processor = processor  # type: ignore[attr-defined]  # for tests / introspection
    unprefix = {topic_name(t, topic_prefix): t.name for t in T.TOPICS}

    # Input events stay un-acked (so their offsets are not committed) until a checkpoint has
    # written the state they changed: take_events acks each event once, and the extra
    # reference taken here holds the commit back until `checkpoint_now` releases it.
    lock = asyncio.Lock()
    held: list[tuple[faust.StreamT, Any]] = []
    last_checkpoint = [time.monotonic()]

    async def checkpoint_now() -> None:
        processor.checkpoint()
        for stream, event in held:
            await stream.ack(event)
        held.clear()
        last_checkpoint[0] = time.monotonic()

    async def consume(stream: faust.StreamT, topic: str) -> None:
        async for events in stream.take_events(take_max, within=take_within_s):
            async with lock:
                for event in events:
                    event.message.incref()
                await processor.process_events(topic, events)
                held.extend((stream, event) for event in events)
                if time.monotonic() - last_checkpoint[0] >= checkpoint_interval_s:
                    await checkpoint_now()
            _update_lag(app, events)

    @app.agent(telemetry_topic, name="fleetwise.telemetry")
    async def telemetry(stream: faust.StreamT) -> None:
        await consume(stream, T.TELEMETRY_GPU.name)

    @app.agent(steps_topic, name="fleetwise.steps")
    async def steps(stream: faust.StreamT) -> None:
        await consume(stream, T.TELEMETRY_STEPS.name)

    @app.timer(interval=checkpoint_interval_s)
    async def checkpoint_when_idle() -> None:
        async with lock:
            if held and time.monotonic() - last_checkpoint[0] >= checkpoint_interval_s:
                await checkpoint_now()

    @app.agent(context_topic, name="fleetwise.context")
    async def context(stream: faust.StreamT) -> None:
        # Inventories and plans: latest per node / job, kept in the ControlPlane.
        async for event in stream.events():
            name = unprefix.get(event.message.topic, event.message.topic)
            records = control.decode(name, event.value,
                                     source=f"{event.message.topic}:{event.message.partition}:"
                                     f"{event.message.offset}")
            for out_topic, key, record in control.handle(name, records):
                await app.producer.send(topic_name(out_topic, topic_prefix), key.encode(),
                                        record.model_dump_json(exclude_none=True).encode(),
                                        partition=None, timestamp=None, headers=None)
                if isinstance(record, DeadLetter):
                    M.DEADLETTER.labels(M.reason_category(record.reason)).inc()

    return app


def _update_lag(app: faust.App, events: Sequence[Any]) -> None:
    last: dict[Any, int] = {}
    for event in events:
        last[event.message.tp] = event.message.offset
    for tp, offset in last.items():
        try:
            high = app.consumer.highwater(tp)
        except Exception:  # noqa: BLE001 - lag is best-effort telemetry, never a failure
            continue
        if high is not None:
            M.CONSUMER_LAG.labels(tp.topic, str(tp.partition)).set(max(0, high - offset - 1))


def run_worker(
    bootstrap: str,
    *,
    app_id: str = "fleetwise",
    store: str = "memory://",
    metrics_port: int | None = None,
    web_port: int | None = None,
    topic_prefix: str = "",
    loglevel: str = "warning",
    **kwargs: Any,
) -> None:
    """Create the topics, serve metrics, and run a faust worker until it is stopped."""
    from aiokafka.errors import KafkaError

    from fleetwise.streams.kafka_io import ensure_topics

    try:
        asyncio.run(ensure_topics(bootstrap, prefix=topic_prefix))
    except (KafkaError, OSError, TimeoutError) as exc:
        raise ConnectionError(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    if metrics_port is not None:
        M.start_metrics_server(metrics_port)
    app = make_app(bootstrap, app_id=app_id, store=store, web_port=web_port, topic_prefix=topic_prefix,
                   **kwargs)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True, redirect_stdouts=False)
    worker.execute_from_commandline()
