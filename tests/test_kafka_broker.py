"""Integration tests against a real Apache Kafka broker (see tests/kafka_broker.py).

They check the broker semantics the stream workers rely on: keyed records stay ordered per
key, consumer groups deliver every record exactly once and resume from committed offsets,
and the idempotent producer writes each record once.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from tests.kafka_broker import metadata_ok, unique_topic

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(240)]


def _json(value) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _sample(i: int, key: str, seq: int) -> dict:
    node, gpu = key.split("/")
    return {
        "ts": 1764489600.0 + i * 0.5,
        "node": node,
        "gpu": int(gpu),
        "model": "NVIDIA H100 80GB HBM3",
        "seq": seq,
        "metrics": {"DCGM_FI_DEV_GPU_TEMP": 55 + i % 20, "DCGM_FI_DEV_POWER_USAGE": 400.0 + i},
    }


async def _consume(consumer: AIOKafkaConsumer, expected: int, timeout_s: float = 60.0) -> list:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    out = []
    while len(out) < expected and loop.time() < deadline:
        batches = await consumer.getmany(timeout_ms=500)
        for msgs in batches.values():
            out.extend(msgs)
    return out


def test_broker_answers_metadata(kafka_bootstrap: str) -> None:
    assert metadata_ok(kafka_bootstrap)


async def test_topic_factory_creates_partitions(kafka_bootstrap: str, kafka_topic_factory) -> None:
    topic = await kafka_topic_factory("parts", partitions=5)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        (desc,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    assert desc["topic"] == topic
    assert sorted(p["partition"] for p in desc["partitions"]) == [0, 1, 2, 3, 4]


async def test_keyed_json_roundtrip_group_preserves_per_key_order(
    kafka_bootstrap: str, kafka_topic_factory
) -> None:
    topic = await kafka_topic_factory("roundtrip", partitions=3)
    keys = [f"node-{n:03d}/{g}" for n in range(5) for g in range(2)]  # telemetry key: node/gpu
    sent: dict[str, list[int]] = defaultdict(list)
    partition_of: dict[str, set[int]] = defaultdict(set)

    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        key_serializer=str.encode,
        value_serializer=_json,
        acks="all",
        linger_ms=5,
    )
    await producer.start()
    try:
        futures = []
        for i in range(100):
            key = keys[i % len(keys)]
            seq = len(sent[key])
            sent[key].append(seq)
            futures.append((key, await producer.send(topic, key=key, value=_sample(i, key, seq))))
        for key, fut in futures:
            meta = await fut
            partition_of[key].add(meta.partition)
    finally:
        await producer.stop()

    # Keyed partitioning: one key -> one partition, and the keys spread over the partitions.
    assert all(len(p) == 1 for p in partition_of.values())
    assert len({next(iter(p)) for p in partition_of.values()}) > 1

    group = unique_topic("group")
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        key_deserializer=bytes.decode,
        value_deserializer=json.loads,
    )
    await consumer.start()
    try:
        received = await _consume(consumer, 100)
        await consumer.commit()
        extra = await consumer.getmany(timeout_ms=1000)
    finally:
        await consumer.stop()

    assert len(received) == 100
    assert not any(extra.values()), "records delivered twice"
    got: dict[str, list[int]] = defaultdict(list)
    for msg in received:
        assert msg.value["node"] + "/" + str(msg.value["gpu"]) == msg.key
        assert msg.partition in partition_of[msg.key]
        got[msg.key].append(msg.value["seq"])
    assert got == sent  # every record, once, in per-key order

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await admin.close()
    assert sum(om.offset for tp, om in committed.items() if tp.topic == topic) == 100


async def test_consumer_group_resumes_from_committed_offsets(
    kafka_bootstrap: str, kafka_topic_factory
) -> None:
    topic = await kafka_topic_factory("resume", partitions=1)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, value_serializer=_json)
    await producer.start()
    try:
        for i in range(20):
            await producer.send(topic, value={"i": i})
        await producer.flush()
    finally:
        await producer.stop()

    group = unique_topic("resume-group")
    tp = TopicPartition(topic, 0)

    def consumer() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(
            topic,
            bootstrap_servers=kafka_bootstrap,
            group_id=group,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            value_deserializer=json.loads,
        )

    first = consumer()
    await first.start()
    try:
        head = (await _consume(first, 10))[:10]
        await first.commit({tp: head[-1].offset + 1})
    finally:
        await first.stop()
    assert [m.value["i"] for m in head] == list(range(10))

    second = consumer()
    await second.start()
    try:
        tail = await _consume(second, 10)
    finally:
        await second.stop()
    assert [m.value["i"] for m in tail] == list(range(10, 20))


async def test_idempotent_producer_writes_each_record_once(kafka_bootstrap: str, kafka_topic_factory) -> None:
    topic = await kafka_topic_factory("idempotent", partitions=3)
    n = 300
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap,
        enable_idempotence=True,  # implies acks=all; the broker assigns a producer id
        key_serializer=str.encode,
        value_serializer=_json,
        linger_ms=2,
    )
    await producer.start()
    try:
        futures = [await producer.send(topic, key=f"job-{i % 7}", value={"id": i}) for i in range(n)]
        metas = await asyncio.gather(*futures)
        # aiokafka internals (checked only while they exist): the broker granted a producer id.
        txn = getattr(producer, "_txn_manager", "absent")
        if txn != "absent":
            assert txn is not None and txn.producer_id >= 0
    finally:
        await producer.stop()

    # The broker assigned contiguous offsets 0..k-1 in every partition: no duplicate, no gap.
    by_partition: dict[int, list[int]] = defaultdict(list)
    for meta in metas:
        by_partition[meta.partition].append(meta.offset)
    for offsets in by_partition.values():
        assert sorted(offsets) == list(range(len(offsets)))

    partitions = [TopicPartition(topic, p) for p in range(3)]
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        value_deserializer=json.loads,
    )
    await consumer.start()
    try:
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        assert sum(end.values()) == n
        received = await _consume(consumer, n)
    finally:
        await consumer.stop()
    ids = [m.value["id"] for m in received]
    assert len(ids) == n
    assert sorted(ids) == list(range(n))
