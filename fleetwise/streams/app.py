"""The Kafka stream worker: a faust-streaming app around the same `ControlPlane` the embedded
runtime uses.

Per input message the worker does only adapter work: hand the raw bytes to
`ControlPlane.decode` (bad input -> a DeadLetter with the reason and the original bytes),
run `ControlPlane.handle` in event time over a whole fetched batch, and publish what it
routes to the registry's topics.

Batches. faust delivers a message to an agent through ~4 asyncio tasks (the consumer's drain
loop awaits `wait_first(callback(message), suspend_flow.wait())`, plus its stopped/crashed
watchers), the conductor, a channel queue, the stream iterator with its sensors and the
`take` buffer: ~160 us per message, more than all of our processing of its 8 samples. The
telemetry and steps topics therefore bypass that path: `BatchConsumer` (faust's aiokafka
consumer with one method overridden, installed through `app.transport`) hands every batch
it fetched for those topics to the worker in one call. Everything else stays faust's:
group membership and partition assignment (co-partitioned with the state table), table
recovery (partitions stay paused until their changelog is read), flow control during
rebalances, offset commits of acked messages, and the per-message path for every other
topic (inventory, plans, the changelog).

State. Processor state lives in one faust Table, ``fleetwise-state``, changelogged to Kafka
and co-partitioned with the telemetry and steps topics. A processor key ("node/gpu" or "job")
belongs to the partition its input messages use (Kafka's default murmur2 partitioner on the
node or job) and, inside it, to one of `state_buckets` buckets (crc32 of the node or job, so a
node's GPUs share one). One table entry per (partition, bucket) holds the state of all its
keys, in a compact binary form for the feature windows (`FeatureStateCodec`), plus the last
input offset applied per input topic-partition. Checkpoints roll over the partitions: within
every `checkpoint_interval_s` each changed partition is saved once, in its own step (steps
spread evenly over the interval). A step waits for the broker to acknowledge the outputs sent
so far, writes every bucket of its partition, and only then acks that partition's input
offsets, so faust's offset commits never run ahead of the saved state.

A restarted (or newly assigned) worker recovers the table from the changelog and, on first
sight of a partition (or when the table holds entries this worker did not write, after a
rebalance), restores the processors from that partition's buckets. Messages re-delivered
after a crash are skipped for the buckets whose state already holds them: outputs are
at-least-once, state application is exactly-once per key.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import os
import struct
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import faust
import numpy as np
from aiokafka.partitioner import murmur2
from faust.transport.consumer import CONSUMER_FETCHING
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types.tuples import ack_lock
from mode.utils.futures import notify

from fleetwise.actuators.signing import SIGNATURE_HEADER, SIGNED_TOPICS, IdentityVerifier
from fleetwise.schemas import AuditEvent, DeadLetter, GpuSample, NodeBatch, TrainingStep
from fleetwise.schemas import topics as T
from fleetwise.schemas.fast import FastGpuSample, FastTrainingStep
from fleetwise.streams import metrics as M
from fleetwise.streams.kafka_io import PRODUCED_AT_HEADER, client_kwargs, client_security_from_env, topic_name
from fleetwise.streams.limits import evict_idle
from fleetwise.streams.pipeline import ControlPlane, Item, Routed

log = logging.getLogger(__name__)

STATE_TABLE = "fleetwise-state"
# Header on every output: the earliest producer send time among the input messages of the
# batch that produced it (a conservative start point for produce -> output latency).
INPUT_PRODUCED_AT_HEADER = "fleetwise-input-produced-at"
# Buckets per partition: one table entry (one changelog message) each. More buckets make
# entries smaller (Kafka's default max.message.bytes is 1 MiB and a GPU's window state is
# ~2.3 KB, so 64 buckets hold ~25,000 GPUs per partition, ~200,000 per 8-partition topic) at
# a fixed cost per checkpointed partition. Placement depends on it: changing it needs a new
# app id (or an empty changelog).
STATE_BUCKETS = 64
# Processors with at most this many keys are compared in full at every checkpoint (cheap, and
# catches job-level state such as the action policy's that a GPU sample can change).
SMALL_PROCESSOR_KEYS = 256
# Longest a fetch may wait at the broker for data (see BatchConsumerThread): bounds how long
# busy partitions can queue behind a fetch of idle ones. Kafka's Java consumer uses 500 ms;
# an idle worker sends ~10 fetches/s at this value, a negligible load.
FETCH_MAX_WAIT_MS = 100
# How old the worker's consumer metadata may get before a refresh (faust's default: 5 min).
# The group leader assigns partitions from its metadata; one that joins just as a restarted
# broker comes back can hold no metadata for the topics yet, assign every member nothing, and
# the group stays idle until a refresh shows the topics and aiokafka rejoins (its metadata
# snapshot changed). At 10 s the group is working again within seconds; the cost is one
# metadata request per worker every 10 s.
CONSUMER_METADATA_MAX_AGE_S = 10.0
# How often the worker reads whether a state-table recovery is running
# (`fleetwise_state_recovery_seconds`, alerted on in deploy/prometheus/rules.yml).
RECOVERY_WATCH_S = 5.0
# A telemetry or steps message longer than this is dead-lettered undecoded. Kafka's default
# message limit is 1 MiB; a dead letter keeps at most DEADLETTER_ORIGINAL_BYTES of the
# original (base64 when binary: 4/3 of it), so a dead letter always fits under it.
MAX_MESSAGE_BYTES = 512 * 1024
DEADLETTER_ORIGINAL_BYTES = 64 * 1024
# Most entries of the output-partition cache (`send_many`): one per (output topic, key), ~2
# per GPU (features, predictions) plus jobs and nodes; past it the cache starts over (~30 MB).
KEY_PARTITION_CACHE = 200_000
ENTRY_MAGIC = b"FWS1"  # table entry: magic, u32 header length, JSON header, binary arrays
# The same entry zlib-compressed (level 1): the windows' state arrays are mostly zeros and
# repeats (16x smaller on the Kafka benchmark's fleet, for ~2.5 ms of CPU per MB; sending the
# raw bytes through the producer and the broker cost far more). Entries of either kind are read.
COMPRESSED_ENTRY_MAGIC = b"FWZ1"
# (Kafka topic, [(key, value), ...], headers) -> delivery futures
SendMany = Callable[[str, list[tuple[bytes, bytes]], list[tuple[str, bytes]]], Awaitable[list[Any]]]


def _header(headers: Any, name: str) -> bytes | None:
    if not headers:
        return None
    items = headers.items() if isinstance(headers, dict) else headers
    for k, v in items:
        if k == name:
            return v
    return None


def _unsigned(verifier: IdentityVerifier | None, topic: str, message: Any) -> str | None:
    """Why a producer's message is refused undecoded by the identity check (None: read it)."""
    if verifier is None or topic not in SIGNED_TOPICS:
        return None
    verdict = verifier.check(topic, message.value, getattr(message, "key", None),
                             _header(getattr(message, "headers", None), SIGNATURE_HEADER))
    return None if verdict else f"signature: {verdict.reason}"


def produced_at(message: Any) -> float:
    """Producer send time of a message: our header if present, else the Kafka timestamp
    (aiokafka records carry it as int milliseconds, faust messages as float seconds)."""
    raw = _header(message.headers, PRODUCED_AT_HEADER)
    if raw is not None:
        try:
            return float(raw)
        except ValueError:
            pass
    ts = message.timestamp
    return ts / 1000.0 if isinstance(ts, int) else float(ts or 0.0)


def message_key(inner: str) -> str:
    """The input message key a processor key comes from: the node for "node/gpu" (feature
    windows, failure predictor) and "node:NODE" (action policy, GPUs without a job), else
    the job (stragglers, policy)."""
    if inner.startswith("node:"):
        return inner[5:]
    return inner.split("/", 1)[0]


def state_partition(inner: str, partitions: int) -> int:
    """Partition of a key's state: the one Kafka's default partitioner (murmur2, as the Java
    and aiokafka producers use) gives the input message of that key (telemetry by node, steps
    by job), so a key's state is saved with, and moves with, its input partition."""
    return (murmur2(message_key(inner).encode()) & 0x7FFFFFFF) % partitions


def state_bucket(inner: str, buckets: int) -> int:
    """Bucket of a key inside its partition (stable across processes and Python runs), by the
    key's part before any "/": a node's GPUs are saved and restored together, so a restore
    from buckets saved at different times never joins a GPU's state with a peer's from
    another time (node-peer context reads the peers' state)."""
    return zlib.crc32(inner.split("/", 1)[0].encode()) % buckets


def record_keys(record: Item) -> tuple[str, ...]:
    """The processor keys (inner, without the processor name) an input record belongs to
    (pydantic records or the fast path's structs, which have the same attribute names)."""
    if isinstance(record, FastGpuSample | GpuSample):
        return (f"{record.node}/{record.gpu}",)
    if isinstance(record, NodeBatch):
        return tuple(f"{s.node}/{s.gpu}" for s in record.samples)
    if isinstance(record, FastTrainingStep | TrainingStep):
        return (record.job, f"{record.node}/{record.gpu}")
    return ()


# --------------------------------------------------------------------------- entry encoding
def encode_entry(header: dict, blob: bytes = b"") -> bytes:
    """A table entry: compressed (magic, header length, JSON header, binary payload)."""
    text = json.dumps(header, separators=(",", ":")).encode()
    entry = b"".join((ENTRY_MAGIC, struct.pack("<I", len(text)), text, blob))
    return COMPRESSED_ENTRY_MAGIC + zlib.compress(entry, 1)


def decode_entry(value: Any) -> tuple[dict, memoryview]:
    """(header, binary payload) of a table entry; ValueError when it is not one."""
    raw = value if isinstance(value, bytes | bytearray | memoryview) else str(value).encode()
    view = memoryview(raw)
    if bytes(view[:4]) == COMPRESSED_ENTRY_MAGIC:
        try:
            view = memoryview(zlib.decompress(view[4:]))
        except zlib.error as exc:
            raise ValueError(f"corrupt fleetwise state entry: {exc}") from exc
    if bytes(view[:4]) != ENTRY_MAGIC or len(view) < 8:
        raise ValueError("not a fleetwise state entry")
    (n,) = struct.unpack("<I", view[4:8])
    return json.loads(bytes(view[8:8 + n])), view[8 + n:]


class FeatureStateCodec:
    """The feature windows' state of many keys at once, as float64 arrays.

    `GpuFeatureWindows.state(key)` builds JSON lists per key (~0.1-0.35 ms each); a checkpoint
    of thousands of GPUs then costs seconds. This takes the windows' bulk state
    (`export_state`: one numpy gather per state array for all keys of a bucket) and writes the
    arrays as raw little-endian float64 rows; `restore` gives them back through
    `import_state`. Shapes travel in the header: an entry written by a different state layout
    fails loudly at restore instead of restoring garbage.
    """

    def __init__(self, windows: Any) -> None:
        self.windows = windows

    def supported(self) -> bool:
        return hasattr(self.windows, "export_state") and hasattr(self.windows, "import_state")

    def encode(self, keys: Sequence[str]) -> tuple[dict, bytes]:
        """(header, binary rows) for `keys` (all known to the windows)."""
        metas, job_ranks, arrays = self.windows.export_state(keys)
        shapes, parts = [], []
        for name, rows in arrays.items():
            rows = np.ascontiguousarray(rows, dtype="<f8")
            shapes.append([name, list(rows.shape[1:])])
            parts.append(rows.tobytes())
        header = {"keys": list(keys), "meta": metas, "job": [j for j, _ in job_ranks],
                  "rank": [r for _, r in job_ranks], "arrays": shapes}
        return header, b"".join(parts)

    def restore(self, header: dict, blob: memoryview) -> list[str]:
        """Restore every key of an encoded bucket; returns the keys."""
        keys = header["keys"]
        n = len(keys)
        columns, at = {}, 0
        for name, shape in header["arrays"]:
            count = n * int(np.prod(shape, dtype=np.int64))
            columns[name] = np.frombuffer(blob, dtype="<f8", count=count, offset=at).reshape(n, *shape)
            at += 8 * count
        # import_state refuses an entry with arrays this code does not keep, or without one it
        # kept from the start (one added since restores fresh); arrays of another shape fail in
        # numpy's assignment.
        self.windows.import_state(keys, header["meta"], list(zip(header["job"], header["rank"], strict=True)),
                                  columns)
        return keys


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
        state_buckets: int = STATE_BUCKETS,
        changelog: Callable[[int, str, bytes], Any] | None = None,
        send_many: SendMany | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        max_state_keys: int | None = None,
        identity_verifier: IdentityVerifier | None = None,
    ) -> None:
        self.control = control
        # With an identity master key set, every telemetry batch and step record must be signed
        # by its writer (docs/security.md, "Producer identities"); others are dead-lettered undecoded.
        self.identity_verifier = identity_verifier
        # Limits (docs/streams.md, "Limits"): a message longer than this is dead-lettered
        # undecoded (its original cut to `DEADLETTER_ORIGINAL_BYTES`); over `max_state_keys`
        # GPUs in the feature windows, the longest idle in event time are evicted.
        self.max_message_bytes = max_message_bytes
        self.max_state_keys = max_state_keys
        self.table = table  # faust Table (uses .data and .send_changelog) or a stand-in
        # (partition, key, entry) -> None, or an awaitable giving a delivery future; the
        # default is faust's send_changelog (buffered, not awaited).
        self.changelog = changelog or table.send_changelog
        self.send = send  # async (topic, key, value, headers) -> awaitable delivery future
        # async (topic, [(key, value), ...], headers) -> delivery futures; `send` per record if None
        self.send_many = send_many
        self.prefix = topic_prefix
        self.state_partitions = state_partitions
        self.state_buckets = state_buckets
        codec = FeatureStateCodec(control.features)
        self.codec: FeatureStateCodec | None = codec if codec.supported() else None
        self._place: dict[str, tuple[int, int]] = {}  # inner key -> (partition, bucket)
        self._full_place: dict[str, tuple[tuple[int, int], str]] = {}  # full key -> (place, processor)
        self._last_offset: dict[str, int] = {}  # "topic:partition" -> last offset applied
        # "topic:partition" -> offset up to which the changelog holds every message's effect
        # (entries this worker wrote, or restored): input offsets may be acked up to it
        self._saved: dict[str, int] = {}
        self._written: dict[str, bytes] = {}  # table key -> entry this worker wrote / restored
        # Entries are stamped (writer, seq): this process's id and a counter. table key ->
        # {writer: highest seq this worker wrote or restored}: an entry at or below it is an
        # older state its memory has moved on from (the table shows one when faust's
        # recovery reads the changelog back while a newer checkpoint is still in flight).
        self.writer = uuid.uuid4().hex  # an identity, not a decision: outputs do not depend on it
        self._seq = 0
        self._known: dict[str, dict[str, int]] = {}
        self._synced: set[int] = set()  # partitions whose state this worker holds
        # "topic:partition" -> (lo, hi, {bucket: offset}): after a restore, messages up to lo
        # are in every bucket's state, those in (lo, hi] in some buckets' only.
        self._replay: dict[str, tuple[int, int, dict[int, int]]] = {}
        self._dirty: set[int] = set()  # partitions changed since the last checkpoint
        self._small_text: dict[str, str] = {}  # full key -> JSON last saved (small processors)
        self._small_names: set[str] = set()  # processors compared in full at checkpoints
        self._pending: list[asyncio.Future] = []  # output deliveries not yet awaited
        self._state_bytes = 0
        # partition -> whether this worker holds it now (set by the app from the consumer's
        # assignment); state of a partition it no longer holds is not written
        self.owns: Callable[[int], bool] = lambda partition: True

    # -- decoding --------------------------------------------------------------------------
    # -- placement and state entries -------------------------------------------------------
    def place(self, inner: str) -> tuple[int, int]:
        """(partition, bucket) of a processor key's state."""
        where = self._place.get(inner)
        if where is None:
            where = self._place[inner] = (state_partition(inner, self.state_partitions),
                                          state_bucket(inner, self.state_buckets))
        return where

    def table_key(self, partition: int, bucket: int) -> str:
        return f"{partition}.{bucket}"

    def _sync_partition(self, partition: int) -> None:
        """Restore a partition's state from the table on first sight, or when the table holds
        entries this worker did not write (recovered after a rebalance or a restart)."""
        data = self.table.data
        foreign: list[tuple[int, Any]] = []
        present: list[tuple[int, Any]] = []
        for b in range(self.state_buckets):
            key = self.table_key(partition, b)
            value = data.get(key)
            mine = self._written.get(key)
            if value is not None and value is not mine and value != mine:
                if mine is not None and self._superseded(key, value):
                    value = data[key] = mine  # the newer entry is this worker's (or on its way)
                else:
                    foreign.append((b, value))
            if value is not None:
                present.append((b, value))
        if partition in self._synced and not foreign:
            return
        self._synced.add(partition)
        if not foreign:
            return
        # Another worker saved this partition since this one last did (it held the partition
        # meanwhile): the table is the truth now. Every bucket is restored, this worker's own
        # entries too (its memory may be ahead of them), and the applied offsets become the
        # entries' own: messages after them are re-delivered from the committed offset and
        # applied again.
        bucket_offsets: dict[str, dict[int, int]] = {}
        for b, value in present:
            for tp, offset in decode_entry(value)[0].get("offsets", {}).items():
                bucket_offsets.setdefault(tp, {})[b] = int(offset)
        suffix = f":{partition}"
        for tp in [tp for tp in self._last_offset if tp.endswith(suffix)]:
            del self._last_offset[tp]
            self._saved.pop(tp, None)
        self._dirty.discard(partition)
        restored: set[str] = set()
        for b, value in present:
            header, blob = decode_entry(value)
            self._remember(self.table_key(partition, b), header)
            if header.get("features") and self.codec is not None:
                restored.update(f"features:{inner}" for inner in self.codec.restore(header["features"], blob))
            for full, state in header.get("other", {}).items():
                self.control.restore(full, state)
                self._small_text[full] = json.dumps(state, sort_keys=True)
                restored.add(full)
            key = self.table_key(partition, b)
            self._state_bytes += len(value) - len(self._written.get(key, b""))
            self._written[key] = value
        # Keys of this partition the entries lack were first seen after their save: their
        # messages come again, so they start over.
        stale = [full for full in self.control.keys()  # noqa: SIM118 - ControlPlane is not a mapping
                 if full not in restored and self.place(full.partition(":")[2])[0] == partition]
        for full in stale:
            self.control.forget(full)
            self._small_text.pop(full, None)
        log.info("restored partition %d from %d state entries (%d keys, %d started over)",
                 partition, len(present), len(restored), len(stale))
        for tp, per_bucket in bucket_offsets.items():
            # A bucket without an entry for tp holds nothing of it: it needs everything.
            offsets = [per_bucket.get(b, -1) for b in range(self.state_buckets)]
            lo, hi = min(offsets), max(offsets)
            self._last_offset[tp] = hi
            self._saved[tp] = lo
            self._replay[tp] = (lo, hi, dict(enumerate(offsets)))

    def _superseded(self, key: str, value: Any) -> bool:
        """Whether table entry `value` of `key` is one this worker already wrote or restored,
        or an older one of the same writer: its memory holds that state and more."""
        try:
            header = decode_entry(value)[0]
        except ValueError:
            return False
        writer, seq = header.get("writer"), header.get("seq")
        known = self._known.get(key, {})
        return writer in known and isinstance(seq, int) and seq <= known[writer]

    def _remember(self, key: str, header: dict) -> None:
        writer, seq = header.get("writer"), header.get("seq")
        if isinstance(writer, str) and isinstance(seq, int):
            known = self._known.setdefault(key, {})
            known[writer] = max(seq, known.get(writer, seq))

    def _keep_replayed(self, records: list[Item], replay: tuple[int, int, dict[int, int]],
                       offset: int) -> list[Item]:
        """The records of a re-delivered message whose bucket's saved state lacks them
        (`replay`: the partition's (lo, hi, {bucket: offset}) after a restore)."""
        lo, hi, per_bucket = replay
        if offset <= lo:
            return []
        kept = []
        for record in records:
            inners = record_keys(record)
            if inners and per_bucket.get(self.place(inners[0])[1], -1) >= offset:
                continue
            kept.append(record)
        return kept

    # -- one batch -------------------------------------------------------------------------
    async def process_events(self, topic: str, events: Sequence[Any]) -> list[Routed]:
        """`process_messages` for faust events (anything with a `.message`)."""
        return await self.process_messages(topic, [event.message for event in events])

    async def process_messages(self, topic: str, messages: Sequence[Any]) -> list[Routed]:
        """Decode, handle and publish one batch of messages of `topic` (a registry name), in
        offset order per partition. A message needs `.topic`, `.partition`, `.offset`,
        `.value`, `.headers` and `.timestamp` (aiokafka's ConsumerRecord and faust's
        ConsumerMessage have them). Outputs are sent, not awaited: the next checkpoint waits
        for them. Returns what was routed."""
        produced: list[float] = []
        last: dict[int, int] = {}
        skipped = 0
        for partition in {msg.partition for msg in messages}:
            self._sync_partition(partition)
        replay = self._replay
        applied = self._last_offset
        kept: list[Any] = []
        replays: dict[int, tuple[int, int, dict[int, int]]] = {}  # index in kept -> replay
        for msg in messages:
            offset = msg.offset
            tp = f"{topic}:{msg.partition}"
            if tp in replay:
                entry = replay[tp]
                last[msg.partition] = offset
                if offset > entry[1]:
                    del replay[tp]
                elif offset <= entry[0]:  # in every bucket's saved state
                    skipped += 1
                    continue
                else:
                    replays[len(kept)] = entry
            elif offset <= applied.get(tp, -1):
                # Already applied by this process: faust seeks back to the committed offset
                # after a rebalance that left the partition here, and the state in memory
                # holds everything up to the last applied offset.
                skipped += 1
                continue
            last[msg.partition] = offset
            kept.append(msg)
            produced.append(produced_at(msg))
        # One decode call for the whole batch (clean node batches in one msgspec call).
        limit = self.max_message_bytes
        refused: dict[int, str] = {}  # index in kept -> why it is dead-lettered undecoded
        for i, msg in enumerate(kept):
            if msg.value is not None and len(msg.value) > limit:  # a flood inside one message
                refused[i] = (f"message: {len(msg.value)} bytes is over the limit of {limit} bytes "
                              f"(original cut to its first {DEADLETTER_ORIGINAL_BYTES} bytes)")
            elif why := _unsigned(self.identity_verifier, topic, msg):
                refused[i] = why
        small = [msg for i, msg in enumerate(kept) if i not in refused] if refused else kept
        decoded = self.control.decode_messages(
            topic, [msg.value for msg in small],
            [f"{msg.topic}:{msg.partition}:{msg.offset}" for msg in small])
        for i in sorted(refused):
            msg = kept[i]
            decoded.insert(i, [self.control.dead_letter(
                f"{msg.topic}:{msg.partition}:{msg.offset}", refused[i],
                (msg.value or b"")[:DEADLETTER_ORIGINAL_BYTES])])
        if topic in _KEYED_BY:
            _check_keys(self.control, _KEYED_BY[topic], kept, decoded)
        if replays:
            for i, entry in replays.items():
                decoded[i] = self._keep_replayed(decoded[i], entry, kept[i].offset)
        records: list[Item] = [item for items in decoded for item in items]
        for record in records:
            if isinstance(record, DeadLetter):
                M.DEADLETTER.labels(M.reason_category(record.reason)).inc()
        samples = len(records)
        M.MESSAGES_IN.labels("worker", topic).inc(len(messages))
        M.SAMPLES_IN.labels("worker", topic).inc(samples)
        if skipped:
            M.REDELIVERED.labels(topic).inc(skipped)

        routed = self.control.handle(topic, records) if records else []
        for partition, offset in last.items():
            applied[f"{topic}:{partition}"] = offset
        self._dirty.update(last)
        if self.max_state_keys is not None and len(self.control.features.keys()) > self.max_state_keys:
            self._evict()

        headers = [(INPUT_PRODUCED_AT_HEADER, repr(min(produced, default=0.0)).encode())]
        futures: list[Any] = []
        by_topic: dict[str, list[tuple[bytes, bytes]]] = {}
        decisions: dict[tuple[str, str], int] = {}
        for out_topic, key, record in routed:
            items = by_topic.get(out_topic)
            if items is None:
                items = by_topic[out_topic] = []
            items.append((key.encode(), record.to_json_bytes()))
            kind = getattr(record, "kind", "record")
            label = getattr(record, "type", None) or getattr(record, "scope", kind)
            decisions[kind, label] = decisions.get((kind, label), 0) + 1
        for out_topic, items in by_topic.items():
            name = topic_name(out_topic, self.prefix)
            if self.send_many is not None:
                futures.extend(await self.send_many(name, items, headers))
            else:
                for key_bytes, value in items:
                    futures.append(await self.send(name, key_bytes, value, headers))
        for (kind, label), n in decisions.items():  # one counter update per label per batch
            M.DECISIONS_OUT.labels(kind, label).inc(n)
        if ("audit", "audit") in decisions:
            count_policy_events(routed, self.control)
        if decisions.get(("deadletter", "deadletter")):
            gate = T.TELEMETRY_GPU.name + "#"  # refused by the limits (`ControlPlane.gate`), after decoding
            for _t, _k, record in routed:
                if isinstance(record, DeadLetter) and record.source.startswith(gate):
                    M.DEADLETTER.labels(M.reason_category(record.reason)).inc(getattr(record, "count", 1))
        # Latency (wall clock, measurement only) ends when the batch's outputs are acknowledged.
        if futures:
            done = asyncio.gather(*futures)
            done.add_done_callback(lambda f: f.cancelled() or f.exception() or _observe(topic, produced))
            self._pending.append(done)
        else:
            _observe(topic, produced)
        M.BATCH_SIZE.labels(topic).observe(len(messages))
        return routed

    def _evict(self) -> None:
        """Evict the GPUs idle longest in event time down to 90% of `max_state_keys`; their
        partitions are saved again without them (a GPU that comes back starts over)."""
        evicted = evict_idle(self.control, int(self.max_state_keys * 0.9))  # type: ignore[operator]
        for inner in evicted:
            self._dirty.add(self.place(inner)[0])
            self._full_place.pop(f"features:{inner}", None)
            self._full_place.pop(f"failure:{inner}", None)
        M.forget_gpus(evicted)
        M.STATE_EVICTED.inc(len(evicted))
        M.WINDOW_STATE_KEYS.set(len(self.control.features.keys()))
        log.warning("state bound %d: evicted %d idle GPUs", self.max_state_keys, len(evicted))

    def _changed_small_keys(self, live: Iterable[str]) -> Iterable[str]:
        """Keys of small processors (other than the feature windows) whose state changed."""
        per_processor: dict[str, list[str]] = {}
        for full in live:
            name = full.partition(":")[0]
            if name != "features" or self.codec is None:
                per_processor.setdefault(name, []).append(full)
        self._small_names = set()
        for name, fulls in per_processor.items():
            if len(fulls) > SMALL_PROCESSOR_KEYS:
                continue
            self._small_names.add(name)
            for full in fulls:
                if json.dumps(self.control.state(full), sort_keys=True) != self._small_text.get(full):
                    yield full

    def begin_round(self) -> list[int]:
        """The partitions a checkpoint round must save: those changed since they were last
        saved, and those of small processors (e.g. the action policy's job state, which a GPU
        sample can change) whose state differs from what was last saved. Sorted."""
        live = self.control.keys()
        for full in self._changed_small_keys(live):
            self._dirty.add(self.place(full.partition(":")[2])[0])
        self._drop_gone(live)
        # A partition revoked at a rebalance stays dirty: if it comes back with no newer
        # entries from another worker, this worker's memory is still its latest state.
        return sorted(partition for partition in self._dirty if self.owns(partition))

    def _drop_gone(self, live: Sequence[str]) -> None:
        """Forget the per-key caches (placement, last saved JSON) of keys the processors no
        longer hold: a job the straggler detector or the policy retired, a GPU evicted. They
        grew with every job ever seen (~+1 entry per job in each, for the life of the worker).
        A gone key whose state was saved marks its partition dirty, so the next save leaves it
        out of the table too (a restore would bring the retired key back otherwise)."""
        keep = set(live)
        for full in [f for f in self._small_text if f not in keep]:
            del self._small_text[full]
            self._dirty.add(self.place(full.partition(":")[2])[0])
        for full in [f for f in self._full_place if f not in keep]:
            del self._full_place[full]
        inner = {f.partition(":")[2] for f in live}
        for key in [k for k in self._place if k not in inner]:
            del self._place[key]

    def snapshot(self, partitions: Iterable[int] | None = None) -> Snapshot:
        """Encode the state of every bucket of `partitions` (default: a whole round,
        `begin_round()`) that changed since it was last saved (synchronous: CPU only) and put
        it in the table's local data. The outputs sent so far travel with it: `write` waits
        for them before the entries go to the changelog. Each entry carries its partition's
        last applied offsets, so a partition's inputs may be acked once its own entries are
        written, whatever the other partitions' state: the snapshot's `saved` says up to which
        offset each input topic-partition's messages are in the changelog once it is written."""
        outputs, self._pending = self._pending, []
        # A partition revoked at a rebalance belongs to its new owner's state now: writing
        # ours would overwrite what it saved (it restores from the changelog on first sight).
        dirty = {partition for partition in (self.begin_round() if partitions is None else partitions)
                 if partition in self._dirty and self.owns(partition)}
        self._dirty -= dirty
        entries: list[tuple[int, str, bytes]] = []
        if not dirty:
            return Snapshot(outputs, entries, dict(self._saved))
        groups: dict[tuple[int, int], dict[str, list[str]]] = {}
        placed = self._full_place
        for full in self.control.keys():  # noqa: SIM118 - ControlPlane is not a mapping
            known = placed.get(full)  # a step runs 8 times per interval: parse each key once
            if known is None:
                name, _, inner = full.partition(":")
                known = placed[full] = (self.place(inner), name)
            where, name = known
            if where[0] in dirty:
                groups.setdefault(where, {}).setdefault(name, []).append(full)
        self._seq += 1
        for partition in sorted(dirty):
            offsets = {tp: off for tp, off in self._last_offset.items()
                       if tp.rpartition(":")[2] == str(partition)}
            self._saved.update(offsets)
            for bucket in range(self.state_buckets):
                by_name = groups.get((partition, bucket), {})
                header: dict[str, Any] = {"offsets": offsets, "features": None, "other": {},
                                          "writer": self.writer, "seq": self._seq}
                blob = b""
                for name, fulls in by_name.items():
                    if name == "features" and self.codec is not None:
                        header["features"], blob = self.codec.encode([f.partition(":")[2] for f in fulls])
                        continue
                    for full in fulls:
                        state = self.control.state(full)
                        header["other"][full] = state
                        if name in self._small_names:
                            self._small_text[full] = json.dumps(state, sort_keys=True)
                value = encode_entry(header, blob)
                key = self.table_key(partition, bucket)
                self._remember(key, header)
                self._state_bytes += len(value) - len(self._written.get(key, b""))
                self.table.data[key] = value
                self._written[key] = value
                entries.append((partition, key, value))
        M.WINDOW_STATE_KEYS.set(len(self._place))
        M.WINDOW_STATE_BYTES.set(self._state_bytes)
        set_policy_job_gauges(self.control)
        return Snapshot(outputs, entries, dict(self._saved))

    async def write(self, snapshot: Snapshot) -> int:
        """Wait until the broker acknowledged the snapshot's outputs, then write its entries
        to the changelog and wait for those too. Ack the inputs the snapshot covers only
        after this returns. Returns the number of entries written."""
        if snapshot.outputs:
            await asyncio.gather(*snapshot.outputs)
        deliveries = []
        for partition, key, value in snapshot.entries:
            sent = self.changelog(partition, key, value)
            if inspect.isawaitable(sent):
                deliveries.append(await sent)
        if deliveries:
            await asyncio.gather(*deliveries)
        return len(snapshot.entries)

    async def checkpoint(self) -> int:
        """`snapshot` then `write`: everything processed so far is saved when it returns."""
        return await self.write(self.snapshot())


class Snapshot(NamedTuple):
    """Output deliveries to wait for, then table entries (partition, key, value) to write;
    once they are (and the snapshots before it), the changelog holds the effect of every
    message of an input "topic:partition" up to `saved[topic:partition]`."""

    outputs: list[asyncio.Future]
    entries: list[tuple[int, str, bytes]]
    saved: dict[str, int]

    def ackable(self, tp: str, offsets: list[int]) -> tuple[list[int], list[int]]:
        """`offsets` of input `tp` split into (those the snapshot's state covers, the rest)."""
        upto = self.saved.get(tp, -1)
        return [o for o in offsets if o <= upto], [o for o in offsets if o > upto]


_KEYED_BY = {T.TELEMETRY_GPU.name: "node", T.TELEMETRY_STEPS.name: "job"}
_UNKEYED = object()


def _check_keys(control: ControlPlane, field: str, messages: Sequence[Any],
                decoded: list[list[Item]]) -> None:
    """Dead-letter (in place) each message whose key is not the node (job) of its records:
    the key chose its partition, and a key's state lives in the partition of its node (job),
    so such a record would be applied where its state is not. A message without a key too."""
    for i, (msg, items) in enumerate(zip(messages, decoded, strict=True)):
        key = getattr(msg, "key", _UNKEYED)
        if key is _UNKEYED:  # a stand-in message without keys (tests driving StreamProcessor)
            continue
        text = key.decode("utf-8", "replace") if isinstance(key, bytes | bytearray) else key
        wrong = next((getattr(it, field) for it in items
                      if not isinstance(it, DeadLetter) and getattr(it, field) != text), None)
        if wrong is None:
            continue
        reason = (f"key: message has no key ({field} {wrong!r} expected)" if text is None else
                  f"key: message key {text!r} differs from the payload's {field} {wrong!r}")
        decoded[i] = [control.dead_letter(f"{msg.topic}:{msg.partition}:{msg.offset}", reason,
                                          msg.value[:DEADLETTER_ORIGINAL_BYTES])]


def _observe(topic: str, produced: Sequence[float]) -> None:
    now = time.time()
    hist = M.PROCESSING_LATENCY.labels(topic)
    for sent in produced:
        hist.observe(max(0.0, now - sent))


# (Kafka topic, [(partition, [aiokafka ConsumerRecord, ...]), ...]) -> None
BatchHandler = Callable[[str, list[tuple[Any, list[Any]]]], Awaitable[None]]


class ActivePartitions:
    """faust's live set of active partitions as the consumer thread's fetch reads it: a
    partition is in it while it is in the set, but it is never empty to aiokafka.

    aiokafka's `Fetcher.fetched_records(partitions)` returns the records of every partition
    when `partitions` is empty, and faust hands it the live set, which a rebalance empties
    (every partition paused) while that fetch waits in the consumer thread. The fetch then
    returned the changelog partitions' records to a worker whose flow was stopped; they were
    dropped with the fetch position past them, and when that happened after table recovery
    had sought the changelog back, recovery waited for records that never came (the worker
    took no input)."""

    __slots__ = ("live",)

    def __init__(self, live: set[Any]) -> None:
        self.live = live

    def __contains__(self, tp: object) -> bool:
        return tp in self.live

    def __bool__(self) -> bool:
        return True


class BatchConsumer(faust_aiokafka.Consumer):
    """faust's aiokafka consumer, handing each fetched batch of some topics to one handler.

    Only `_drain_messages` (faust-streaming 0.15.3, `faust/transport/consumer.py`) is
    replaced, and only for the topics in `transport.batch_handlers`: their records of one
    fetch go to `handler(topic, [(tp, records), ...])` in one call (aiokafka
    `ConsumerRecord`s in offset order per partition), without faust's per-message tasks,
    conductor, channel queue, stream iterator and `ConsumerMessage` objects. The rest of the
    loop is faust's: records come from `_wait_next_records` (so paused partitions, e.g.
    during table recovery, are not fetched), delivery stops when flow stops or the consumer
    generation changes (rebalance), read offsets, gaps and `broker_commit_every` are kept as
    faust keeps them, and messages of every other topic take faust's own per-message path.

    The handler acks offsets itself (`ack_offsets`) once their state is saved; faust then
    commits them. Per-message sensors (`on_message_in`, stream events) are not called for
    these topics: the worker's own Prometheus metrics count them. A batch is shielded from
    cancellation (faust cancels the fetcher at a rebalance) so it is applied whole or not at
    all.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._reseek_at: dict[Any, int] = {}  # tp -> read offset it was last sought back to

    def _new_consumer_thread(self) -> BatchConsumerThread:
        return BatchConsumerThread(self, loop=self.loop, beacon=self.beacon)

    async def _getmany(self, active_partitions: set[Any] | None, timeout: float) -> Any:
        if active_partitions is not None:
            active_partitions = ActivePartitions(active_partitions)  # type: ignore[assignment]
        return await super()._getmany(active_partitions, timeout)

    async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - needs a broker
        handlers: dict[str, BatchHandler] = self.transport.batch_handlers  # type: ignore[attr-defined]
        callback = self.callback
        consumer_should_stop = self._stopped.is_set
        fetcher_should_stop = fetcher._stopped.is_set
        read_offset = self._read_offset
        acks_enabled_for = self.app.topics.acks_enabled_for
        to_message = self._to_message
        try:
            while not (consumer_should_stop() or fetcher_should_stop()):
                self.diag.set_flag(CONSUMER_FETCHING)
                # No commit here every `broker_commit_every` acks, unlike faust's loop: that
                # commit first flushes the producer (outputs and state entries in flight) and
                # would hold up delivery meanwhile. faust's commit timer
                # (`broker_commit_interval`) commits in a task of its own.
                records, active = await self._wait_next_records(1.0)
                # as faust: getmany may return at once for a while without yielding the loop
                await self.sleep(0)
                if records is None or self.should_stop:
                    continue
                if not self.flow_active:
                    # as faust's getmany: records fetched while flow stopped are dropped and
                    # the partitions go back to their committed offsets
                    try:
                        await self.perform_seek()
                        for tp, tp_records in records.items():
                            # changelog partitions have no committed offset to go back to
                            if tp_records and (read_offset[tp] is None or self._is_changelog_tp(tp)):
                                await self._put_back(tp, tp_records[0].offset)
                    except Exception as exc:  # noqa: BLE001 - faust logs and carries on too
                        self.log.warning("exception performing seek when flow not active %r", exc)
                    continue
                generation = self.app.consumer_generation_id
                batches: dict[str, list[Any]] = {}
                for tp, tp_records in records.items():
                    if not self.flow_active or self.app.consumer_generation_id != generation:
                        break
                    if not (active is None or tp in active or tp in self._buffered_partitions):
                        if tp_records:
                            await self._put_back(tp, tp_records[0].offset)
                        continue
                    self.app.monitor.track_tp_end_offset(tp, self.highwater(tp))
                    batch: list[Any] | None = None
                    if tp.topic in handlers:
                        if tp_records and await self._skipped_ahead(tp, tp_records[0].offset):
                            continue
                        batch = []
                        batches.setdefault(tp.topic, []).append((tp, batch))
                    for record in tp_records:
                        offset = record.offset
                        r_offset = read_offset[tp]
                        if r_offset is not None and offset < r_offset:
                            continue  # faust drops these too (already read)
                        if r_offset and offset - r_offset > 1 and acks_enabled_for(tp.topic):
                            await self._add_gap(tp, r_offset + 1, offset)
                        if batch is not None:
                            batch.append(record)
                        else:
                            await self.wait_first(callback(to_message(tp, record)), self.suspend_flow.wait())
                        read_offset[tp] = offset
                if not self.flow_active or self.app.consumer_generation_id != generation:
                    # a rebalance began during this fetch: like faust's streams (which skip
                    # events of an old generation), hand nothing over; faust seeks each
                    # partition back to its committed offset for whoever owns it now
                    continue
                for topic, tp_batches in batches.items():
                    tp_batches = [(tp, batch) for tp, batch in tp_batches if batch]
                    if tp_batches:
                        # what faust's stream sensor records per event: its aiokafka thread
                        # checks it to report partitions whose stream stopped processing
                        now = time.monotonic()
                        inbound = self.app.monitor.stream_inbound_time
                        for tp, _ in tp_batches:
                            inbound[tp] = now
                        await asyncio.shield(handlers[topic](topic, tp_batches))
                self.diag.unset_flag(CONSUMER_FETCHING)
        except self.consumer_stopped_errors:
            if self.transport.app.should_stop:
                self.log.info("Broker stopped consumer, shutting down...")
                return
            raise
        except asyncio.CancelledError:
            if self.transport.app.should_stop:
                self.log.info("Consumer shutting down for user cancel.")
                return
            raise
        except Exception as exc:
            self.log.exception("Drain messages raised: %r", exc)
            raise
        finally:
            self.diag.unset_flag(CONSUMER_FETCHING)

    async def _put_back(self, tp: Any, first: int) -> None:
        """Seek `tp` back to `first`, the first of its fetched records that were not handed
        over (its partition paused meanwhile for table recovery, or flow stopped): the fetch
        position has moved past them. Without it they were lost whenever the partition had
        no committed offset yet (faust's seek to committed then does nothing, and
        `_skipped_ahead` has no read offset to compare with): a worker taking over a
        partition at its first rebalance dropped its first messages. Changelog partitions
        too: faust's recovery seeks them when it starts, but records dropped after that seek
        left recovery waiting for them (`ActivePartitions` removes how that happened)."""
        if tp in self.assignment():
            self.log.info("records of %s from %d fetched while paused: seeking back", tp, first)
            await self.seek(tp, first)

    async def _skipped_ahead(self, tp: Any, first: int) -> bool:
        """Whether a fetch of a batch topic starts past the next offset to read, and if so seek
        the partition back to it (once per read offset). Records fetched before a seek can
        arrive after it (faust's post-rebalance seek to the committed offsets runs while the
        fetcher works): handing such a batch over would skip what lies between, for good.
        (Records dropped because their partition was paused meanwhile are put back where
        they are dropped, `_put_back`; this also catches any such drop left.) The telemetry
        and steps topics have contiguous offsets; a gap
        found again at the same read offset (retention deleted the records) is accepted."""
        read = self._read_offset[tp]
        if read is None or first <= read + 1 or self._reseek_at.get(tp) == read:
            return False
        self._reseek_at[tp] = read
        if tp in self.assignment():
            # `read` may be the last offset read (one is re-delivered: the worker skips what
            # it already applied) or, after faust's seek, the committed one (the next to read).
            self.log.warning("fetch of %s starts at %d, past read offset %d: seeking back", tp, first, read)
            await self.seek(tp, read)
        return True

    def ack_offsets(self, tp: Any, offsets: Iterable[int]) -> int:
        """`Consumer.ack` for records known by partition and offset (no message objects):
        faust commits a partition up to its first offset not acked. Returns how many were
        new."""
        if not self.app.topics.acks_enabled_for(tp.topic):
            return 0
        with ack_lock:  # the lock faust's own `ack` holds over the same bookkeeping
            committed = self._committed_offset[tp]
            index = self._acked_index[tp]
            acked = self._acked[tp]
            n = 0
            try:
                for offset in offsets:
                    if (committed is None or offset >= committed) and offset not in index:
                        index.add(offset)
                        acked.append(offset)
                        n += 1
                self._n_acked += n
            finally:
                notify(self._waiting_for_ack)
        return n


class BatchConsumerThread(faust_aiokafka.AIOKafkaConsumerThread):
    """faust's aiokafka consumer thread with a short fetch long-poll (`FETCH_MAX_WAIT_MS`).

    aiokafka keeps one fetch in flight per broker, and a partition whose fetched records are
    still buffered is left out of the next fetch. When the only partitions left in it are
    idle ones (the steps topic, inventories, plans), the broker holds that fetch for the
    whole `fetch_max_wait_ms` (faust hard-codes 1,500 ms) while the busy telemetry
    partitions wait behind it: input stalled for ~1.5 s every few seconds at 25,000
    samples/s, which was the p99 latency."""

    def _create_worker_consumer(self, transport: Any) -> Any:
        consumer = super()._create_worker_consumer(transport)
        # Read by AIOKafkaConsumer.start() when it builds its fetcher (no public setter).
        consumer._fetch_max_wait_ms = FETCH_MAX_WAIT_MS
        return consumer


class BatchTransport(faust_aiokafka.Transport):
    """faust's aiokafka transport with `BatchConsumer`; `batch_handlers` maps a Kafka topic
    name to the coroutine that takes its fetched batches."""

    Consumer = BatchConsumer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batch_handlers: dict[str, BatchHandler] = {}


def faust_credentials(security: dict[str, Any]) -> Any:
    """faust's `broker_credentials` for aiokafka kwargs from `client_security_from_env` (None
    for PLAINTEXT): the worker's consumer, producer and topic creation all use them."""
    protocol = security.get("security_protocol", "PLAINTEXT")
    if protocol == "PLAINTEXT":
        return None
    if protocol == "SSL":
        return faust.SSLCredentials(security["ssl_context"])
    return faust.SASLCredentials(username=security["sasl_plain_username"],
                                 password=security["sasl_plain_password"],
                                 ssl_context=security.get("ssl_context"),
                                 mechanism=security["sasl_mechanism"])


def make_app(
    bootstrap: str,
    *,
    app_id: str = "fleetwise",
    store: str = "memory://",
    web_port: int | None = None,
    topic_prefix: str = "",
    control: ControlPlane | None = None,
    take_max: int = 500,
    state_partitions: int = T.TELEMETRY_GPU.partitions,
    session_timeout_s: float = 10.0,
    commit_interval_s: float = 1.0,
    checkpoint_interval_s: float = 5.0,
    state_buckets: int = STATE_BUCKETS,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    max_state_keys: int | None = None,
    identity_verifier: IdentityVerifier | None = None,
    **settings: Any,
) -> faust.App:
    """The faust app: topics from the registry, the changelogged state table, the context
    agent (inventories, plans) and the telemetry / steps batch handlers (`BatchConsumer`).
    `topic_prefix` namespaces every topic (tests); `take_max` caps the messages of one
    fetched batch (faust's `broker_max_poll_records`).

    `store`: "memory://" (state rebuilt from the changelog at start) or "rocksdb://"
    (needs the python-rocksdict package). Only event time is used in processing.
    """
    if T.TELEMETRY_STEPS.partitions != state_partitions:
        raise ValueError("state table must be co-partitioned with telemetry and steps topics")
    # faust keeps per-app table data on disk; out of the working directory, beside the other
    # caches (FLEETWISE_CACHE, as deploy/kafka uses), unless the caller sets `datadir`.
    cache = Path(os.environ.get("FLEETWISE_CACHE", Path.home() / ".cache" / "fleetwise"))
    if "datadir" not in settings:
        (cache / "faust").mkdir(parents=True, exist_ok=True)  # faust makes only the last level
        settings["datadir"] = str(cache / "faust" / "{conf.name}-data")
    if "broker_credentials" not in settings:
        credentials = faust_credentials(client_security_from_env())
        if credentials is not None:
            settings["broker_credentials"] = credentials
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
        consumer_metadata_max_age_ms=int(CONSUMER_METADATA_MAX_AGE_S * 1000),
        broker_max_poll_records=take_max,
        stream_wait_empty=False,
        producer_linger_ms=5,
        producer_max_batch_size=256 * 1024,
        key_serializer="raw",
        value_serializer="raw",
        **settings,
    )
    # The public setter, before anything has built the default transport: the consumer is
    # created from it when the worker starts.
    transport = BatchTransport(app.conf.broker_consumer, app)
    app.transport = transport
    control = control or ControlPlane()
    control.hop_observers.append(M.observe_gpu_headroom)

    def source(t: T.Topic) -> faust.TopicT:
        return app.topic(topic_name(t, topic_prefix), partitions=t.partitions,
                         key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")

    telemetry_topic = source(T.TELEMETRY_GPU)
    steps_topic = source(T.TELEMETRY_STEPS)
    # Context: inventories and plans, and what drives the fleet state: consumers' acks,
    # operators' actions (approvals, GPU returns) and the commands of every worker (the
    # fleet-wide rails count the other workers' drains). Read whole by every worker (`context`).
    context_names = [topic_name(t, topic_prefix) for t in (T.INVENTORY, T.PLANS, T.ACKS, T.OPERATOR,
                                                            T.COMMANDS_TRAINING, T.COMMANDS_KUBE)]
    # Entries are bytes we encode ourselves (`encode_entry`): no serializer work in faust.
    table = app.Table(STATE_TABLE, default=None, partitions=state_partitions,
                      key_type=str, value_type=bytes)
    table.value_serializer = "raw"  # read when the changelog topic is first built (lazily)

    async def send(topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> Any:
        return await app.producer.send(topic, key, value, partition=None, timestamp=None, headers=headers)

    partitions: dict[str, list[int]] = {}
    # (topic, key) -> partition: a cache of murmur2 over output keys. Keys include job names,
    # so it grew with every job ever seen; emptied when it passes KEY_PARTITION_CACHE entries
    # (a pure function of the key: emptying it changes no partition).
    key_partition: dict[tuple[str, bytes], int] = {}

    async def send_many(topic: str, items: list[tuple[bytes, bytes]],
                        headers: list[tuple[str, bytes]]) -> list[Any]:
        """Outputs in one record batch per partition (aiokafka `create_batch`/`send_batch`):
        ~7 us per record instead of ~22 us through `send`, which matters when a hop closes
        for thousands of GPUs at once. Partitions as Kafka's default partitioner (murmur2 of
        the key), as `send` would choose them."""
        aio = app.producer._ensure_producer()  # faust's aiokafka producer (no batch API in faust)
        parts = partitions.get(topic)
        if parts is None:
            parts = partitions[topic] = sorted(await aio.partitions_for(topic))
        by_partition: dict[int, list[tuple[bytes, bytes]]] = {}
        if len(key_partition) > KEY_PARTITION_CACHE:
            key_partition.clear()
        for key, value in items:
            where = key_partition.get((topic, key))
            if where is None:
                where = key_partition[topic, key] = parts[(murmur2(key) & 0x7FFFFFFF) % len(parts)]
            by_partition.setdefault(where, []).append((key, value))
        futures = []
        for partition, records in by_partition.items():
            batch, n = aio.create_batch(), 0
            for key, value in records:
                if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                    if n:  # full: ship it and start the next one
                        futures.append(await aio.send_batch(batch, topic, partition=partition))
                        batch, n = aio.create_batch(), 0
                    if batch.append(key=key, value=value, timestamp=None, headers=headers) is None:
                        futures.append(await send(topic, key, value, headers))  # over a batch alone
                        continue
                n += 1
            if n:
                futures.append(await aio.send_batch(batch, topic, partition=partition))
        return futures

    async def changelog(partition: int, key: str, value: bytes) -> Any:
        # Straight to the producer (force: not attached to the current event), not through
        # faust's send_changelog buffer: that buffer is drained one message at a time and,
        # while it holds more than 100 messages, faust stops delivering input to the streams.
        return await table.changelog_topic.send(key=key, value=value, partition=partition, force=True)

    processor = StreamProcessor(control, table, send, topic_prefix=topic_prefix,
                                state_partitions=state_partitions, state_buckets=state_buckets,
                                changelog=changelog, send_many=send_many,
                                max_message_bytes=max_message_bytes, max_state_keys=max_state_keys,
                                identity_verifier=identity_verifier)
    app.fleetwise_processor = processor  # type: ignore[attr-defined]  # for tests / introspection
    state_topic = telemetry_topic.get_topic_name()  # co-partitioned with steps and the table

    def owns(partition: int) -> bool:
        return any(tp.topic == state_topic and tp.partition == partition
                   for tp in app.consumer.assignment())

    processor.owns = owns
    # Inventories, plans and job ends reach every worker: a job's growth to its intent is
    # decided by the one worker holding its state's partition (not by each of them).
    control.policy.decides_for = lambda job: owns(processor.place(job)[0])
    unprefix = {topic_name(t, topic_prefix): t.name for t in T.TOPICS}

    # Input messages stay un-acked (so their offsets are not committed) until a checkpoint has
    # waited for their outputs and written the state they changed; then they are acked and
    # faust commits them. Checkpoints roll: a round saves each changed partition once, one
    # partition per step, the steps spread evenly over `checkpoint_interval_s`, and each step
    # acks only its own partition's inputs. Saving everything at once encoded all GPUs' state
    # and sent it to the changelog in one burst every interval (~25 MB for 8,000 GPUs before
    # compression), which the outputs then waited behind; a step is 1/N of that. A step
    # encodes under the lock (CPU) and then waits for the broker in a task of its own, so
    # consumption goes on meanwhile; steps are written one after the other.
    lock = asyncio.Lock()
    held: dict[Any, list[int]] = {}  # tp -> offsets processed since its partition was saved
    round_left: list[int] = []  # partitions of the current round not yet saved
    step_s = [checkpoint_interval_s]  # time between steps in the current round
    last_step = [time.monotonic()]
    writing: list[asyncio.Task] = []

    async def write_and_ack(snapshot: Snapshot, offsets: dict[Any, list[int]],
                            previous: asyncio.Task | None) -> None:
        if previous is not None:
            await previous  # entries of a partition reach the changelog in snapshot order
        await processor.write(snapshot)
        consumer = app.consumer
        assigned = consumer.assignment()
        for tp, tp_offsets in offsets.items():
            # A partition revoked meanwhile is no longer ours to commit: its new owner
            # resumes from the last committed offset and skips what the saved state holds.
            if tp in assigned:
                consumer.ack_offsets(tp, tp_offsets)

    def take_ackable(snapshot: Snapshot, partitions: set[int] | None) -> dict[Any, list[int]]:
        """The held offsets (of `partitions`, default all) whose effect the snapshot saves;
        they leave `held`. Offsets above what it saves stay held for a later step, except
        those of a partition not assigned now (mid-rebalance, or moved to another worker):
        faust re-delivers them from the committed offset if the partition comes back."""
        ackable = {}
        for tp in [tp for tp in held if partitions is None or tp.partition in partitions]:
            ackable[tp], rest = snapshot.ackable(f"{unprefix[tp.topic]}:{tp.partition}", held.pop(tp))
            if rest and processor.owns(tp.partition):
                held[tp] = rest
        return ackable

    def start_write(snapshot: Snapshot, offsets: dict[Any, list[int]]) -> None:
        previous = writing.pop() if writing else None
        if previous is not None and previous.done():
            previous.result()  # a failed write raises here: the worker stops, a restart resumes
            previous = None
        M.CHECKPOINT_WRITES.inc()
        task = asyncio.ensure_future(write_and_ack(snapshot, offsets, previous))
        task.add_done_callback(_log_failed_checkpoint)
        task.add_done_callback(lambda _: M.CHECKPOINT_WRITES.dec())  # also when cancelled
        writing.append(task)

    def checkpoint_step() -> None:
        """Save the next partition of the round (a new round when the last one is done).
        Call with `lock` held."""
        if not round_left:
            # Partitions with inputs to ack but no changed state (all re-delivered) too.
            round_left.extend(sorted(set(processor.begin_round()) | {tp.partition for tp in held}))
            step_s[0] = checkpoint_interval_s / max(1, len(round_left))
        last_step[0] = time.monotonic()
        if not round_left:
            return
        partition = round_left.pop(0)
        snapshot = processor.snapshot([partition])
        start_write(snapshot, take_ackable(snapshot, {partition}))

    def write_in_flight() -> bool:
        return bool(writing) and not writing[-1].done()

    def checkpoint_all() -> None:
        """Save every changed partition and ack every input now (idle). Call with `lock` held."""
        round_left.clear()
        last_step[0] = time.monotonic()
        snapshot = processor.snapshot()
        start_write(snapshot, take_ackable(snapshot, None))

    async def consume(kafka_topic: str, batches: list[tuple[Any, list[Any]]]) -> None:
        """A fetched batch of telemetry or steps records (BatchConsumer's handler)."""
        records = batches[0][1] if len(batches) == 1 else [r for _, rs in batches for r in rs]
        async with lock:
            await processor.process_messages(unprefix[kafka_topic], records)
            for tp, rs in batches:
                held.setdefault(tp, []).extend([r.offset for r in rs])
            # One write in flight at most: while the broker is slower than the steps come due,
            # a step waits (its partition's inputs stay held) rather than queue one encoded
            # snapshot per step behind the last (a worker behind the broker grew ~14 MB/min).
            if time.monotonic() - last_step[0] >= step_s[0] and not write_in_flight():
                checkpoint_step()
        _update_lag(app, {tp: rs[-1].offset for tp, rs in batches})

    async def count_assigned(sender: Any, assigned: Any, **_kwargs: Any) -> None:
        counts = {telemetry_topic.get_topic_name(): 0, steps_topic.get_topic_name(): 0}
        for tp in assigned:
            if tp.topic in counts:
                counts[tp.topic] += 1
        for name, n in counts.items():
            M.ASSIGNED_PARTITIONS.labels(unprefix[name]).set(n)

    app.on_partitions_assigned.connect(count_assigned)

    for batch_topic in (telemetry_topic, steps_topic):
        # Subscribed through faust's conductor (so the assignor co-partitions them with the
        # state table and acks count for them); delivered in batches to `consume`.
        app.topics.add(batch_topic)
        transport.batch_handlers[batch_topic.get_topic_name()] = consume

    @app.timer(interval=checkpoint_interval_s)
    async def checkpoint_when_idle() -> None:
        async with lock:
            # Idle, or the steps are waiting behind a slow write: in the second case a save of
            # everything would queue behind that write too, once per interval (a worker whose
            # changelog writes were slow grew ~10 MB/min that way). The next step takes it.
            if held and time.monotonic() - last_step[0] >= checkpoint_interval_s and not write_in_flight():
                checkpoint_all()

    recovery_clock = M.RecoveryClock()

    @app.timer(interval=RECOVERY_WATCH_S)
    async def watch_recovery() -> None:
        # A recovery that never ends (faust waits for changelog events that do not come) stops
        # the worker's input while its lag gauges keep their last values: this one keeps rising.
        M.STATE_RECOVERY.set(recovery_clock.observe(app.in_recovery, time.monotonic()))

    @app.task
    async def context() -> None:
        """Inventories and plans (latest per node / job), acks, operator actions and commands,
        read whole by every worker from the start (no consumer group): each worker's straggler
        detector learns every GPU's model, an ack reaches the worker whose policy sent the
        command, whichever partition it is on, and every worker counts the drains the others
        sent (and their acks) in its fleet-wide rails."""
        from aiokafka import AIOKafkaConsumer

        consumer = AIOKafkaConsumer(*context_names, **client_kwargs({
            "bootstrap_servers": bootstrap, "group_id": None, "enable_auto_commit": False,
            "auto_offset_reset": "earliest", "metadata_max_age_ms": 5000,
        }))
        await consumer.start()
        try:
            while True:
                fetched = await consumer.getmany(timeout_ms=500, max_records=500)
                for tp, messages in fetched.items():
                    name = unprefix.get(tp.topic, tp.topic)
                    for m in messages:
                        source = f"{tp.topic}:{tp.partition}:{m.offset}"
                        why = _unsigned(identity_verifier, name, m)
                        if why:  # an inventory or ack its writer did not sign: never applied
                            cut = (m.value or b"")[:DEADLETTER_ORIGINAL_BYTES]
                            records = [control.dead_letter(source, why, cut)]
                        else:
                            records = control.decode(name, m.value, source=source, key=m.key)
                        async with lock:  # state changes never interleave with a checkpoint
                            routed = control.handle(name, records)
                        for out_topic, key, record in routed:
                            await app.producer.send(topic_name(out_topic, topic_prefix), key.encode(),
                                                    record.to_json_bytes(),
                                                    partition=None, timestamp=None, headers=None)
                            if isinstance(record, DeadLetter):
                                M.DEADLETTER.labels(M.reason_category(record.reason)).inc()
                        count_policy_events(routed, control)
        finally:
            await consumer.stop()

    return app


def count_policy_events(routed: Sequence[Routed], control: ControlPlane) -> None:
    """Audit events by name, whether the drain circuit breaker is open (alerting rules), the
    GPUs other workers are taking out, and the jobs the policy holds, retired and ended (after
    every call: a job ends on the context task, which leaves no partition to checkpoint)."""
    for _topic, _key, record in routed:
        if isinstance(record, AuditEvent):
            M.AUDIT_EVENTS.labels(record.event).inc()
    M.BREAKER_OPEN.set(0 if control.policy.breaker_open_since is None else 1)
    M.PEER_DRAINS.set(len(control.policy.peers.out()))
    set_policy_job_gauges(control)


def set_policy_job_gauges(control: ControlPlane) -> None:
    policy = control.policy
    M.POLICY_JOBS.set(len(policy.jobs))
    M.POLICY_JOBS_RETIRED.set(policy.retired_jobs)
    M.POLICY_JOBS_ENDED.set(policy.ended_jobs)


def _log_failed_checkpoint(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("checkpoint failed; its inputs stay un-acked (re-delivered after a restart): %r",
                  task.exception())


def _update_lag(app: faust.App, last: dict[Any, int]) -> None:
    """Lag gauges from the last offset processed per partition."""
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
    # faust's terminal progress spinner, when on, sets the root logger to DEBUG and handles
    # every debug record (aiokafka logs one per message sent): ~4% of the worker's CPU.
    worker.spinner = None
    worker.execute_from_commandline()
