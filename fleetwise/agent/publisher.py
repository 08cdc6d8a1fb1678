"""Delivery of node batches and inventories to Kafka, decoupled from collection.

`offer()` is synchronous and O(1): it encodes the batch and appends it to a bounded buffer
that drops the oldest batch when full (`DropOldestBuffer`). A background task sends what is
buffered with an idempotent producer (acks=all, so the producer's own retries never write a
duplicate), reconnecting with exponential backoff while the broker is away. Collection
never waits for the broker.

Delivery is at least once across reconnects: a batch whose acknowledgement was lost with
the connection is sent again by the next producer session (a new producer id), so the
stream side tolerates duplicates (same node, GPU and ts). Memory is bounded by
`max_buffer` queued batches plus at most `max_in_flight` being sent.

With `signer` (the node's identity key, docs/security.md "Producer identities") every message
carries the `fleetwise-signature` header, an HMAC over its bytes that the workers check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiokafka.errors import MessageSizeTooLargeError, RecordTooLargeError

from fleetwise.actuators.signing import SIGNATURE_HEADER, IdentityKeys, node_identity
from fleetwise.agent import metrics
from fleetwise.agent.buffer import DropOldestBuffer
from fleetwise.schemas import NodeBatch, NodeInventory
from fleetwise.schemas.topics import INVENTORY, TELEMETRY_GPU
from fleetwise.streams.kafka_io import (
    PRODUCED_AT_HEADER,
    client_security_from_env,
    encode_record,
    ensure_topics,
    topic_name,
)

log = logging.getLogger("fleetwise.agent")


@dataclass(frozen=True)
class Outgoing:
    """One encoded message waiting for the broker."""

    topic: str
    key: bytes
    value: bytes
    samples: int  # GPU samples inside (0 for an inventory)
    ts: float  # event time of the record
    signature: bytes | None = None  # the signature header's value (signed agents)


@dataclass
class PublisherStats:
    batches_offered: int = 0
    batches_sent: int = 0
    samples_sent: int = 0
    inventories_sent: int = 0
    dropped: int = 0
    oversized: int = 0  # refused as too large by the client or the broker: dropped, never retried
    send_errors: int = 0
    connect_errors: int = 0
    connects: int = 0


class BatchPublisher:
    """Buffers NodeBatches and sends them in the background; see the module docstring."""

    def __init__(
        self,
        bootstrap: str,
        *,
        agent: str = "agent",
        max_buffer: int = 1000,
        max_in_flight: int = 256,
        topic_prefix: str = "",
        linger_ms: int = 20,
        request_timeout_ms: int = 10_000,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 5.0,
        create_topics: bool = True,
        signer: IdentityKeys | None = None,
    ) -> None:
        self.bootstrap = bootstrap
        self.signer = signer
        self.agent = agent
        self.max_in_flight = max(1, min(max_in_flight, max_buffer))
        self.telemetry_topic = topic_name(TELEMETRY_GPU, topic_prefix)
        self.inventory_topic = topic_name(INVENTORY, topic_prefix)
        self.topic_prefix = topic_prefix
        self.linger_ms = linger_ms
        self.request_timeout_ms = request_timeout_ms
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.create_topics = create_topics
        self.stats = PublisherStats()
        # Create every series now so a dashboard shows 0, not "no data", before the first event.
        for counter in (metrics.SAMPLES_COLLECTED, metrics.BATCHES_COLLECTED, metrics.BATCHES_SENT,
                        metrics.INVENTORIES_SENT, metrics.SEND_ERRORS, metrics.COLLECT_ERRORS):
            counter.labels(agent=agent)
        self._dropped_metric = metrics.AGENT_DROPPED.labels(node=agent)
        self._depth_metric = metrics.AGENT_BUFFERED.labels(node=agent)
        self.buffer: DropOldestBuffer[Outgoing] = DropOldestBuffer(max_buffer, on_drop=self._on_drop)
        self._inventories: dict[bytes, Outgoing] = {}  # latest per node; never dropped
        self._in_flight = 0
        self._producer: Any = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._retarget = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closing = False
        self._outage_since: float | None = None

    # --- collection side (synchronous, never blocks) -----------------------------------------
    def _on_drop(self, item: Outgoing) -> None:
        self.stats.dropped += 1
        self._dropped_metric.inc()

    def offer(self, batch: NodeBatch) -> None:
        """Queue a batch for sending; drops the oldest queued batch when the buffer is full."""
        value = encode_record(batch)
        item = Outgoing(self.telemetry_topic, batch.node.encode(), value, len(batch.samples), batch.ts,
                        self._signature(value, batch.node))
        self.buffer.push(item)
        self.stats.batches_offered += 1
        self._changed()

    def offer_inventory(self, inventory: NodeInventory) -> None:
        """Queue a node's inventory; it is sent before any batch and kept until delivered."""
        key = inventory.node.encode()
        value = encode_record(inventory)
        self._inventories[key] = Outgoing(self.inventory_topic, key, value, 0, inventory.ts,
                                          self._signature(value, inventory.node))
        self._changed()

    def _signature(self, value: bytes, node: str) -> bytes | None:
        """Raises KeyringError when this agent's key is another node's."""
        return None if self.signer is None else self.signer.header(value, node_identity(node))

    def _changed(self) -> None:
        self._depth_metric.set(self.depth)
        self._idle.clear()
        self._wake.set()

    @property
    def depth(self) -> int:
        """Batches not yet acknowledged: queued plus being sent."""
        return len(self.buffer) + self._in_flight

    @property
    def pending(self) -> int:
        return self.depth + len(self._inventories)

    def set_bootstrap(self, bootstrap: str) -> None:
        """Point the publisher at another broker list; takes effect at the next (re)connect."""
        self.bootstrap = bootstrap
        self._retarget.set()

    # --- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the background sender. Returns at once: an unreachable broker is an outage,
        not an error (the batches wait in the buffer)."""
        if self._task is None:
            self._closing = False
            self._task = asyncio.create_task(self._run(), name=f"fleetwise-agent-sender-{self.agent}")

    async def wait_delivered(self, timeout_s: float) -> bool:
        """Wait until everything offered so far is acknowledged; False on timeout."""
        try:
            await asyncio.wait_for(self._wait_idle(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _wait_idle(self) -> None:
        while self.pending:
            self._idle.clear()
            await self._idle.wait()

    async def stop(self, flush_timeout_s: float = 10.0) -> bool:
        """Try to deliver what is buffered for up to `flush_timeout_s`, then stop.
        Returns True when nothing was left undelivered."""
        delivered = await self.wait_delivered(flush_timeout_s) if self._task is not None else not self.pending
        # The sender exits at the top of its loop when it sees _closing; cancelling is only the
        # fallback for a sender stuck in a send (a cancel racing an event wake-up can be lost
        # in asyncio.wait_for on Python 3.11, so it is not the normal path).
        self._closing = True
        self._wake.set()
        self._retarget.set()
        if self._task is not None:
            done, _ = await asyncio.wait({self._task}, timeout=self.request_timeout_ms / 1000.0 + 1.0)
            if not done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        await self._close_producer()
        if not delivered:
            log.warning("agent stopping with %d batches and %d inventories undelivered",
                        self.depth, len(self._inventories))
        return delivered

    # --- sender --------------------------------------------------------------------------------
    async def _connect(self) -> None:
        from aiokafka import AIOKafkaProducer

        if self.create_topics:
            await ensure_topics(self.bootstrap, (INVENTORY, TELEMETRY_GPU), prefix=self.topic_prefix,
                                timeout_s=self.request_timeout_ms / 1000.0)
        producer = AIOKafkaProducer(
            bootstrap_servers=self.bootstrap,
            client_id=f"fleetwise-agent-{self.agent}",
            enable_idempotence=True,
            acks="all",
            linger_ms=self.linger_ms,
            max_batch_size=256 * 1024,
            request_timeout_ms=self.request_timeout_ms,
            retry_backoff_ms=100,
            compression_type=None,
            # TLS / SASL from the environment, read at every (re)connect: a rotated password
            # file takes effect at the next reconnect (docs/security.md)
            **client_security_from_env(),
        )
        try:
            await producer.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), 5.0)
            raise
        self._producer = producer
        self.stats.connects += 1

    async def _close_producer(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(producer.stop(), self.request_timeout_ms / 1000.0)

    async def _send(self, items: list[Outgoing]) -> list[Outgoing]:
        """Send items; returns those that were not acknowledged."""
        producer = self._producer
        futures: list[tuple[Outgoing, Any]] = []
        failed: list[Outgoing] = []
        for n, item in enumerate(items):
            headers = [(PRODUCED_AT_HEADER, repr(time.time()).encode())]
            if item.signature is not None:
                headers.append((SIGNATURE_HEADER, item.signature))
            try:
                fut = await producer.send(item.topic, item.value, key=item.key, headers=headers)
            except MessageSizeTooLargeError as exc:  # over max_request_size: never goes, whatever the broker
                self._oversized(item, exc)
                continue
            except Exception as exc:  # metadata timeout, closed connection: the rest fail too
                log.debug("send failed: %r", exc)
                failed.extend(items[n:])
                break
            futures.append((item, fut))
        results = await asyncio.gather(*(f for _, f in futures), return_exceptions=True) if futures else []
        for (item, _), result in zip(futures, results, strict=True):
            if isinstance(result, MessageSizeTooLargeError | RecordTooLargeError):
                self._oversized(item, result)  # the broker's max.message.bytes: retrying cannot help
                continue
            if isinstance(result, BaseException):
                failed.append(item)
                continue
            if item.topic == self.inventory_topic:
                self.stats.inventories_sent += 1
                metrics.INVENTORIES_SENT.labels(agent=self.agent).inc()
            else:
                self.stats.batches_sent += 1
                self.stats.samples_sent += item.samples
                metrics.BATCHES_SENT.labels(agent=self.agent).inc()
        return failed

    def _oversized(self, item: Outgoing, exc: BaseException) -> None:
        """A batch too large to ever be accepted: dropped and counted, so it does not block the
        buffer behind it (it would be requeued and fail again forever)."""
        self.stats.oversized += 1
        metrics.AGENT_OVERSIZED.labels(node=self.agent).inc()
        log.error("dropping a %d-byte message for %s: too large for the broker (%r)",
                  len(item.value), item.topic, exc)

    def _outage(self, what: str, exc: BaseException | None) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            log.warning("broker %s unreachable (%s: %s); buffering up to %d batches",
                        self.bootstrap, what, exc, self.buffer.max_items)

    def _recovered(self) -> None:
        if self._outage_since is not None:
            log.info("broker %s reachable again after %.1f s; %d batches dropped so far",
                     self.bootstrap, time.monotonic() - self._outage_since, self.stats.dropped)
            self._outage_since = None

    async def _pause(self, seconds: float) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    async def _backoff(self, seconds: float) -> None:
        """Sleep before the next attempt; a new bootstrap (set_bootstrap) cuts it short."""
        self._retarget.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._retarget.wait(), seconds)

    async def _run(self) -> None:
        backoff = self.backoff_initial_s
        while not self._closing:
            if self._producer is None:
                try:
                    await self._connect()
                except Exception as exc:
                    self.stats.connect_errors += 1
                    metrics.SEND_ERRORS.labels(agent=self.agent).inc()
                    self._outage("connect", exc)
                    await self._backoff(backoff)
                    backoff = min(backoff * 2, self.backoff_max_s)
                    continue
            # Inventories go first: a worker needs a node's inventory to read its batches.
            items: list[Outgoing] = list(self._inventories.values())
            items += self.buffer.take(max(0, self.max_in_flight - len(items)))
            if not items:
                self._depth_metric.set(self.depth)
                self._idle.set()
                await self._pause(1.0)
                continue
            n_batches = sum(1 for i in items if i.topic != self.inventory_topic)
            self._in_flight = n_batches
            try:
                failed = await self._send(items)
            finally:
                self._in_flight = 0
            # Inventories that went through are done, unless a newer one was offered meanwhile.
            failed_ids = {id(i) for i in failed}
            for item in items:
                if (item.topic == self.inventory_topic and id(item) not in failed_ids
                        and self._inventories.get(item.key) is item):
                    del self._inventories[item.key]
            failed_batches = [i for i in failed if i.topic != self.inventory_topic]
            if failed_batches:
                self.buffer.requeue(failed_batches)
            self._depth_metric.set(self.depth)
            if failed:
                self.stats.send_errors += len(failed)
                metrics.SEND_ERRORS.labels(agent=self.agent).inc(len(failed))
                self._outage("send", None)
                await self._close_producer()
                await self._backoff(backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
            else:
                self._recovered()
                backoff = self.backoff_initial_s
