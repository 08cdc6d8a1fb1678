"""Small aiokafka helpers: create the registry's topics, produce records as JSON, consume
until a condition holds. Used by the worker, the node agent, the tests and the bench.

Everything here is an adapter: it moves bytes between Kafka and the plain records of
`fleetwise.schemas`; no processing logic lives here.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from fleetwise.schemas import (
    TOPICS,
    Ack,
    AuditEvent,
    Command,
    DeadLetter,
    FeatureVector,
    OperatorAction,
    Prediction,
    Record,
    Topic,
)
from fleetwise.schemas.inventory import NodeInventory
from fleetwise.schemas.plans import Plan
from fleetwise.schemas.telemetry import GpuSample, NodeBatch, TrainingStep

# Header the producer stamps with its wall-clock send time (Unix seconds as ASCII), so a
# consumer can measure produce -> output latency even when the broker rewrites timestamps
# (message.timestamp.type=LogAppendTime). Metrics only: processing never reads it.
PRODUCED_AT_HEADER = "fleetwise-produced-at"


# --------------------------------------------------------------------------- security
# Client security comes from the environment (or files it names), never from code; see
# docs/security.md. Unset FLEETWISE_KAFKA_SECURITY means PLAINTEXT: no settings are added.
SECURITY_ENV = "FLEETWISE_KAFKA_SECURITY"
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")


class KafkaSecurityError(ValueError):
    """Bad or incomplete Kafka client security settings; the message names the variable."""


def _secret(env: Mapping[str, str], name: str) -> str | None:
    """`name` from the environment, or the first line of the file `name`_FILE names."""
    value = env.get(name)
    path = env.get(f"{name}_FILE")
    if value and path:
        raise KafkaSecurityError(f"set {name} or {name}_FILE, not both")
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                value = f.read().strip()
        except OSError as exc:
            raise KafkaSecurityError(f"{name}_FILE={path}: cannot read it ({exc.strerror})") from None
        if not value:
            raise KafkaSecurityError(f"{name}_FILE={path} is empty")
    return value or None


def client_security_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """aiokafka client kwargs (producer, consumer, admin) for the security settings in the
    environment; `{}` for PLAINTEXT (the default), so plain clients are built exactly as before.

    FLEETWISE_KAFKA_SECURITY         PLAINTEXT (default) | SSL | SASL_SSL | SASL_PLAINTEXT
    FLEETWISE_KAFKA_SASL_MECHANISM   SCRAM-SHA-512 (default) | SCRAM-SHA-256 | PLAIN
    FLEETWISE_KAFKA_USER             SASL user name (or FLEETWISE_KAFKA_USER_FILE)
    FLEETWISE_KAFKA_PASSWORD         SASL password, or FLEETWISE_KAFKA_PASSWORD_FILE (preferred)
    FLEETWISE_KAFKA_CA_FILE          PEM CA bundle the broker certificate must chain to
                                     (default: the system's trust store)
    FLEETWISE_KAFKA_CERT_FILE / FLEETWISE_KAFKA_KEY_FILE   optional client certificate (mTLS)

    `kafka.sh start --secure DIR` writes one file of these per component (DIR/env/<user>.env).
    The TLS context verifies the broker's certificate and host name; there is no switch to
    turn that off.
    """
    env = os.environ if env is None else env
    protocol = (env.get(SECURITY_ENV) or "PLAINTEXT").strip().upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise KafkaSecurityError(f"{SECURITY_ENV}={protocol!r} is not one of {', '.join(SECURITY_PROTOCOLS)}")
    if protocol == "PLAINTEXT":
        return {}
    params: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        mechanism = (env.get("FLEETWISE_KAFKA_SASL_MECHANISM") or "SCRAM-SHA-512").strip().upper()
        if mechanism not in SASL_MECHANISMS:
            raise KafkaSecurityError(f"FLEETWISE_KAFKA_SASL_MECHANISM={mechanism!r} is not one of "
                                     f"{', '.join(SASL_MECHANISMS)}")
        user = _secret(env, "FLEETWISE_KAFKA_USER")
        password = _secret(env, "FLEETWISE_KAFKA_PASSWORD")
        if not user:
            raise KafkaSecurityError(f"{SECURITY_ENV}={protocol} needs FLEETWISE_KAFKA_USER")
        if not password:
            raise KafkaSecurityError(f"{SECURITY_ENV}={protocol} needs FLEETWISE_KAFKA_PASSWORD_FILE "
                                     "(or FLEETWISE_KAFKA_PASSWORD)")
        params.update(sasl_mechanism=mechanism, sasl_plain_username=user, sasl_plain_password=password)
    if protocol.endswith("SSL"):
        params["ssl_context"] = _ssl_context(env)
    return params


def _ssl_context(env: Mapping[str, str]) -> Any:
    import ssl

    cafile = env.get("FLEETWISE_KAFKA_CA_FILE") or None
    if cafile and not os.path.isfile(cafile):
        raise KafkaSecurityError(f"FLEETWISE_KAFKA_CA_FILE={cafile} is not a file")
    try:
        context = ssl.create_default_context(cafile=cafile)  # verifies certificate and host name
    except ssl.SSLError as exc:
        raise KafkaSecurityError(f"FLEETWISE_KAFKA_CA_FILE={cafile}: not a PEM CA bundle ({exc})") from None
    cert, key = env.get("FLEETWISE_KAFKA_CERT_FILE"), env.get("FLEETWISE_KAFKA_KEY_FILE")
    if bool(cert) != bool(key):
        raise KafkaSecurityError("FLEETWISE_KAFKA_CERT_FILE and FLEETWISE_KAFKA_KEY_FILE go together")
    if cert:
        try:
            context.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as exc:
            raise KafkaSecurityError(f"FLEETWISE_KAFKA_CERT_FILE={cert} / FLEETWISE_KAFKA_KEY_FILE={key}: "
                                     f"{exc}") from None
    return context


def client_kwargs(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The environment's security settings under explicit `kwargs` (which win)."""
    return {**client_security_from_env(), **kwargs}


def topic_name(topic: Topic | str, prefix: str = "") -> str:
    """The Kafka topic name for a registry entry, with an optional namespace prefix (tests)."""
    name = topic.name if isinstance(topic, Topic) else topic
    return f"{prefix}{name}"


def topic_configs(topic: Topic) -> dict[str, str]:
    """Broker-side topic settings the registry implies (compaction for latest-per-key topics)."""
    if topic.compacted:
        return {"cleanup.policy": "compact"}
    return {}


def record_key(record: BaseModel) -> str:
    """The message key the topic registry prescribes for a record (DESIGN.md "Keys").

    Telemetry batches and inventories by node, GPU-scoped outputs by "node/gpu",
    steps, plans and commands by job, dead letters by their source.
    """
    if isinstance(record, NodeBatch | NodeInventory):
        return record.node
    if isinstance(record, GpuSample):
        return f"{record.node}/{record.gpu}"
    if isinstance(record, TrainingStep):
        return record.job
    if isinstance(record, FeatureVector):
        if record.scope == "rank" and record.job:
            return record.job
        return f"{record.node}/{record.gpu}"
    if isinstance(record, Prediction):
        if record.gpu is not None:
            return f"{record.node}/{record.gpu}"
        return record.job or record.node
    if isinstance(record, Command):
        return record.job or (f"{record.node}/{record.gpu}" if record.node else record.id)
    if isinstance(record, DeadLetter):
        return record.source
    if isinstance(record, Plan):
        return record.job
    if isinstance(record, Ack | AuditEvent):
        return record.job or (f"{record.node}/{record.gpu}" if record.node else record.command_id or "")
    if isinstance(record, OperatorAction):
        return record.command_id or f"{record.node}/{record.gpu}"
    raise TypeError(f"no registry key rule for {type(record).__name__}")


def encode_record(record: BaseModel | bytes | str | Mapping[str, Any] | None) -> bytes | None:
    """JSON bytes for a record; bytes pass through untouched (to send deliberately bad input);
    None stays None (a tombstone: the deletion of its key on a compacted topic)."""
    if record is None or isinstance(record, bytes):
        return record
    if isinstance(record, str):
        return record.encode("utf-8")
    if isinstance(record, Record):
        return record.to_json_bytes()
    if isinstance(record, BaseModel):
        return record.model_dump_json(exclude_none=True).encode("utf-8")
    return json.dumps(record, separators=(",", ":")).encode("utf-8")


# --------------------------------------------------------------------------- admin
async def ensure_topics(
    bootstrap: str,
    topics: Iterable[Topic] = TOPICS,
    *,
    prefix: str = "",
    replication_factor: int = 1,
    timeout_s: float = 30.0,
) -> list[str]:
    """Create the topics (registry partition counts, compaction) if missing; wait for leaders.

    Existing topics are left as they are (a partition count is never changed behind a
    running consumer group's back). Returns the topic names.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    topics = list(topics)
    wanted = {topic_name(t, prefix): t for t in topics}
    admin = AIOKafkaAdminClient(**client_kwargs(
        {"bootstrap_servers": bootstrap, "request_timeout_ms": int(timeout_s * 1000)}))
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        missing = [
            NewTopic(name, t.partitions, replication_factor, topic_configs=topic_configs(t))
            for name, t in wanted.items()
            if name not in existing
        ]
        if missing:
            resp = await admin.create_topics(missing, timeout_ms=int(timeout_s * 1000))
            for err in resp.topic_errors:
                name, code = err[0], err[1]
                if code and for_code(code) is not TopicAlreadyExistsError:
                    message = err[2] if len(err) > 2 else ""
                    raise for_code(code)(f"could not create topic {name}: {message}")
        deadline = time.monotonic() + timeout_s
        while True:
            described = await admin.describe_topics(list(wanted))
            pending = [d.get("topic") for d in described if not _has_leaders(d)]
            if not pending:
                return list(wanted)
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics without partition leaders after {timeout_s}s: {pending}")
            await asyncio.sleep(0.1)
    finally:
        await admin.close()


def _has_leaders(desc: Mapping[str, Any]) -> bool:
    parts = desc.get("partitions") or []
    return (
        desc.get("error_code", 0) == 0
        and len(parts) > 0
        and all(p.get("error_code", 0) == 0 and p.get("leader", -1) >= 0 for p in parts)
    )


# --------------------------------------------------------------------------- produce
async def start_producer(bootstrap: str, *, idempotent: bool = True, linger_ms: int = 5, **kwargs: Any):
    """A started AIOKafkaProducer; idempotent by default (no duplicates from its own retries)."""
    from aiokafka import AIOKafkaProducer

    params: dict[str, Any] = {
        "bootstrap_servers": bootstrap,
        "enable_idempotence": idempotent,
        "linger_ms": linger_ms,
        "max_batch_size": 256 * 1024,
        "acks": "all" if idempotent else 1,
    }
    params.update(kwargs)
    producer = AIOKafkaProducer(**client_kwargs(params))
    await producer.start()
    return producer


async def send_records(
    producer: Any,
    topic: str,
    records: Iterable[BaseModel | bytes | str | Mapping[str, Any] | None],
    *,
    key: str | Callable[[Any], str] | None = None,
    stamp_produced_at: bool = True,
    wait: bool = True,
) -> int:
    """Send records as JSON to `topic` (None: a tombstone under `key`); returns how many were sent.

    `key`: a fixed key, a function of the record, or None for the registry rule
    (`record_key`; raw bytes/str then go without a key). With `wait`, returns after the
    broker acknowledged all of them.
    """
    futures = []
    count = 0
    for record in records:
        if callable(key):
            k = key(record)
        elif key is not None:
            k = key
        elif isinstance(record, BaseModel):
            k = record_key(record)
        else:
            k = None
        headers = [(PRODUCED_AT_HEADER, repr(time.time()).encode())] if stamp_produced_at else None
        futures.append(
            await producer.send(
                topic, encode_record(record), key=k.encode() if k is not None else None, headers=headers
            )
        )
        count += 1
    if wait and futures:
        await asyncio.gather(*futures)
    return count


async def produce_records(
    bootstrap: str,
    topic: str,
    records: Iterable[BaseModel | bytes | str | Mapping[str, Any] | None],
    *,
    key: str | Callable[[Any], str] | None = None,
    idempotent: bool = True,
) -> int:
    """One-shot: start a producer, send `records` to `topic`, wait for the acks, stop."""
    producer = await start_producer(bootstrap, idempotent=idempotent)
    try:
        return await send_records(producer, topic, records, key=key)
    finally:
        await producer.stop()


# --------------------------------------------------------------------------- consume
@dataclass(frozen=True)
class Consumed:
    """One consumed message, decoupled from the client library."""

    topic: str
    partition: int
    offset: int
    key: str | None
    value: bytes | None  # None: a tombstone (a compacted topic's deletion of the key)
    timestamp_ms: int
    headers: tuple[tuple[str, bytes], ...] = field(default_factory=tuple)

    def json(self) -> Any:
        return json.loads(self.value)

    def header(self, name: str) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


class ConsumeTimeout(TimeoutError):
    """`consume_until`'s condition never became true; `messages` holds what was read."""

    def __init__(self, text: str, messages: list[Consumed]) -> None:
        super().__init__(text)
        self.messages = messages


async def consume_until(
    bootstrap: str,
    topics: Sequence[str],
    *,
    until: Callable[[list[Consumed]], bool] | None = None,
    timeout_s: float = 30.0,
    idle_s: float | None = None,
    from_beginning: bool = True,
    isolation_level: str = "read_uncommitted",
) -> list[Consumed]:
    """Read `topics` (no consumer group, no commits) until `until(messages)` is true, the
    topics stay quiet for `idle_s`, or `timeout_s` passes; returns everything read.

    Raises ConsumeTimeout (a TimeoutError holding what was read) when `until` is given and
    never became true.
    """
    from aiokafka import AIOKafkaConsumer

    consumer = AIOKafkaConsumer(
        *topics,
        **client_kwargs({
            "bootstrap_servers": bootstrap,
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest" if from_beginning else "latest",
            "isolation_level": isolation_level,
            "metadata_max_age_ms": 1000,
        }),
    )
    try:
        await consumer.start()
    except BaseException:
        await consumer.stop()  # a refused start (auth, ACLs) leaves nothing open behind
        raise
    messages: list[Consumed] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last_new = loop.time()
    try:
        while True:
            if until is not None and until(messages):
                return messages
            now = loop.time()
            if now > deadline:
                if until is None:
                    return messages
                raise ConsumeTimeout(f"condition not met after {timeout_s}s on {list(topics)}; "
                                     f"read {len(messages)} messages", messages)
            if idle_s is not None and now - last_new > idle_s and until is None:
                return messages
            batch = await consumer.getmany(timeout_ms=200, max_records=10_000)
            for tp, msgs in batch.items():
                for m in msgs:
                    messages.append(
                        Consumed(
                            topic=tp.topic,
                            partition=tp.partition,
                            offset=m.offset,
                            key=m.key.decode("utf-8", "replace") if m.key is not None else None,
                            value=m.value,
                            timestamp_ms=m.timestamp,
                            headers=tuple((k, v) for k, v in (m.headers or ())),
                        )
                    )
                    last_new = loop.time()
    finally:
        await consumer.stop()


def run(coro: Any) -> Any:
    """Run a coroutine from synchronous code (CLI, bench)."""
    return asyncio.run(coro)
