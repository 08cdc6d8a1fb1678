"""Where the training plugin sends step records and acks and reads its commands.

Three transports with one small interface (`Transport`), so the plugin is the same on Kafka,
on the embedded bus and in tests:

- `KafkaTransport`: the real topics (`fleetwise.telemetry.steps`, `fleetwise.commands.training`,
  `fleetwise.acks`, keyed by job), one aiokafka producer and consumer on a private event loop
  thread, so a training loop calls plain blocking methods;
- `LocalTransport`: one JSON-lines file per topic in a directory, appended with O_APPEND
  (one `write` per record); several processes (the ranks of a job, the elastic agent's
  restarted workers, a bench's control plane) share it. Read positions are byte offsets, so
  they go into a checkpoint and a restarted worker reads on from where its checkpoint was;
- `BusTransport`: an in-process `fleetwise.streams.embedded.EventBus` (one process).

`publish` may block (a slow broker): the plugin calls it from its telemetry thread, never
from the training step. `poll` never blocks for long: rank 0 calls it at step boundaries.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from fleetwise.actuators.signing import SIGNATURE_HEADER, IdentityKeys
from fleetwise.schemas import Record, plans_message
from fleetwise.schemas import topics as T

__all__ = ["BusTransport", "KafkaTransport", "LocalTransport", "Transport", "decode_record"]

log = logging.getLogger(__name__)


@runtime_checkable
class Transport(Protocol):
    """What the plugin needs from a message bus."""

    def publish(self, topic: str, key: str, record: Record) -> None:
        """Send one record (may block while the bus is slow)."""

    def poll(self, topic: str, key: str | None = None) -> list[Record]:
        """Records of `topic` (with message key `key` when given) not returned before."""

    def position(self, topic: str) -> dict[str, int]:
        """Where the next `poll` of `topic` reads from (saved in checkpoints)."""

    def seek(self, topic: str, position: Mapping[str, int]) -> None:
        """Read `topic` on from a saved `position`."""

    def close(self) -> None:
        """Release connections and files."""


def decode_record(topic: str, value: bytes | str | Mapping[str, Any] | None,
                  key: bytes | str | None = None) -> Record:
    """A message value as its topic's record type (the topic registry's `value_type`); on the
    plans topic also a job's end (a `job_end` record, or a tombstone: a null value under `key`)."""
    if topic == T.PLANS.name:
        return plans_message(value, key)
    kind = T.topic(topic).value_type
    if isinstance(value, Mapping):
        return kind.model_validate(value)  # type: ignore[return-value]
    return kind.model_validate_json(value)  # type: ignore[return-value]


def _decoded(topic: str, value: Any, key: Any, where: str) -> Record | None:
    """`decode_record`, or None (logged) for a message that is not its topic's record: one bad
    message on a shared topic must not stop a consumer (the worker dead-letters it)."""
    from pydantic import ValidationError

    try:
        return decode_record(topic, value, key)
    except (ValidationError, ValueError) as exc:
        log.warning("skipped %s: not a %s record: %s", where, topic, str(exc).splitlines()[0])
        return None


class LocalTransport:
    """Topics as JSON-lines files in `root`, safe for several processes (O_APPEND writes).

    Each line is `{"key": ..., "value": {record}}`. A half-written last line (a writer
    killed mid-write is not possible with one `write`, but a reader can race a writer on
    some file systems) is left for the next poll.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()

    def path(self, topic: str) -> Path:
        T.topic(topic)  # only registered topics, as on the broker
        return self.root / f"{topic}.jsonl"

    def publish(self, topic: str, key: str, record: Record) -> None:
        data = f'{{"key":{json.dumps(key)},"value":{record.to_json()}}}\n'.encode()
        fd = os.open(self.path(topic), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def poll(self, topic: str, key: str | None = None) -> list[Record]:
        path = self.path(topic)
        with self._lock:
            start = self._offsets.get(topic, 0)
            try:
                with path.open("rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except FileNotFoundError:
                return []
            end = data.rfind(b"\n") + 1  # whole lines only
            self._offsets[topic] = start + end
        out: list[Record] = []
        for line in data[:end].splitlines():
            if not line.strip():
                continue
            obj = json.loads(line)
            if key is None or obj.get("key") == key:
                record = _decoded(topic, obj["value"], obj.get("key"), f"{path.name} line")
                if record is not None:
                    out.append(record)
        return out

    def position(self, topic: str) -> dict[str, int]:
        return {"0": self._offsets.get(topic, 0)}

    def seek(self, topic: str, position: Mapping[str, int]) -> None:
        with self._lock:
            self._offsets[topic] = int(position.get("0", 0))

    def close(self) -> None:
        pass


class BusTransport:
    """An in-process embedded EventBus (`fleetwise.streams.embedded.EventBus`) as a transport."""

    def __init__(self, bus: Any) -> None:
        self.bus = bus
        self._offsets: dict[str, int] = {}
        self._lock = threading.Lock()

    def publish(self, topic: str, key: str, record: Record) -> None:
        with self._lock:
            self.bus.publish(topic, key, record)

    def poll(self, topic: str, key: str | None = None) -> list[Record]:
        with self._lock:
            log = self.bus.logs.get(topic, [])
            start = self._offsets.get(topic, 0)
            self._offsets[topic] = len(log)
            return [r for k, r in log[start:] if key is None or k == key]

    def position(self, topic: str) -> dict[str, int]:
        return {"0": self._offsets.get(topic, 0)}

    def seek(self, topic: str, position: Mapping[str, int]) -> None:
        self._offsets[topic] = int(position.get("0", 0))

    def close(self) -> None:
        pass


class KafkaTransport:
    """The plugin's Kafka client: a producer and (lazily, per topic) a consumer without a group.

    Runs aiokafka on its own event loop thread so callers stay synchronous. `prefix` namespaces
    topic names (tests). `from_beginning`: where a topic is first read from when no position was
    restored (False: only what arrives after the first poll, so a new job does not act on an
    older job's commands of the same name).
    """

    def __init__(self, bootstrap: str, *, prefix: str = "", from_beginning: bool = False,
                 send_timeout_s: float = 30.0, signer: IdentityKeys | Literal["env"] | None = "env") -> None:
        """`signer`: the producer's identity key that signs what it publishes (step records,
        acks; docs/security.md "Producer identities"); "env" (default): from
        FLEETWISE_IDENTITY_KEY[_FILE] when set; None: unsigned."""
        if signer == "env":
            from fleetwise.streams.keys import identity_keys_from_env

            signer = identity_keys_from_env()
        self.signer: IdentityKeys | None = signer  # type: ignore[assignment]
        self.bootstrap = bootstrap
        self.prefix = prefix
        self.from_beginning = from_beginning
        self.send_timeout_s = send_timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fleetwise-kafka", daemon=True)
        self._thread.start()
        self._producer: Any = None
        self._consumers: dict[str, Any] = {}
        self._positions: dict[str, dict[str, int]] = {}

    def _run(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _name(self, topic: str) -> str:
        T.topic(topic)
        return f"{self.prefix}{topic}"

    def publish(self, topic: str, key: str, record: Record) -> None:
        from fleetwise.streams.kafka_io import start_producer

        async def send() -> None:
            if self._producer is None:
                self._producer = await start_producer(self.bootstrap, linger_ms=2)
            value = record.to_json_bytes()
            headers = []
            if self.signer is not None:
                signature = self.signer.header(value, self.signer.signs_as(topic, key))
                headers.append((SIGNATURE_HEADER, signature))
            await self._producer.send_and_wait(self._name(topic), value, key=key.encode(), headers=headers)

        self._run(send(), self.send_timeout_s)

    async def _consumer(self, topic: str) -> Any:
        consumer = self._consumers.get(topic)
        if consumer is not None:
            return consumer
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from fleetwise.streams.kafka_io import client_kwargs

        # Credentials and CA from the environment (FLEETWISE_KAFKA_*, docs/security.md).
        consumer = AIOKafkaConsumer(**client_kwargs({
            "bootstrap_servers": self.bootstrap, "group_id": None, "enable_auto_commit": False,
            "auto_offset_reset": "earliest" if self.from_beginning else "latest",
            "metadata_max_age_ms": 1000}))
        await consumer.start()
        name = self._name(topic)
        parts = consumer.partitions_for_topic(name)
        if not parts:
            await consumer._client.force_metadata_update()  # the topic was created just now
            parts = consumer.partitions_for_topic(name) or {0}
        tps = [TopicPartition(name, p) for p in sorted(parts)]
        consumer.assign(tps)
        saved = self._positions.get(topic, {})
        for tp in tps:
            if str(tp.partition) in saved:
                consumer.seek(tp, saved[str(tp.partition)])
            elif self.from_beginning:
                await consumer.seek_to_beginning(tp)
            else:
                await consumer.seek_to_end(tp)
        for tp in tps:  # resolve positions now: "latest" means from this moment on
            self._positions.setdefault(topic, {})[str(tp.partition)] = await consumer.position(tp)
        self._consumers[topic] = consumer
        return consumer

    def poll(self, topic: str, key: str | None = None) -> list[Record]:
        async def fetch() -> list[Record]:
            consumer = await self._consumer(topic)
            batch = await consumer.getmany(timeout_ms=0, max_records=1000)
            out: list[Record] = []
            for tp, msgs in sorted(batch.items(), key=lambda kv: kv[0].partition):
                for m in msgs:
                    self._positions.setdefault(topic, {})[str(tp.partition)] = m.offset + 1
                    if key is not None and (m.key or b"").decode("utf-8", "replace") != key:
                        continue
                    record = _decoded(topic, m.value, m.key, f"{tp.topic}:{tp.partition}:{m.offset}")
                    if record is not None:
                        out.append(record)
            return out

        return self._run(fetch(), 30.0)

    def position(self, topic: str) -> dict[str, int]:
        return dict(self._positions.get(topic, {}))

    def seek(self, topic: str, position: Mapping[str, int]) -> None:
        self._positions[topic] = {str(k): int(v) for k, v in position.items()}

        async def reseek() -> None:
            consumer = self._consumers.get(topic)
            if consumer is None:
                return
            from aiokafka import TopicPartition

            for p, off in self._positions[topic].items():
                consumer.seek(TopicPartition(self._name(topic), int(p)), off)

        self._run(reseek(), 30.0)

    def close(self) -> None:
        async def stop() -> None:
            for consumer in self._consumers.values():
                await consumer.stop()
            if self._producer is not None:
                await self._producer.stop()

        try:
            self._run(stop(), 30.0)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
