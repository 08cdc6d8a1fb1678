"""Integration: the node agent against a real Apache Kafka broker (fixture `kafka_bootstrap`)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from fleetwise.agent import BatchPublisher, SimCollector, run_agent
from fleetwise.schemas import NodeBatch, NodeInventory
from fleetwise.schemas.topics import INVENTORY, TELEMETRY_GPU
from fleetwise.streams.kafka_io import PRODUCED_AT_HEADER, consume_until, topic_name

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(120)]
REPO = Path(__file__).resolve().parents[1]


def prefix() -> str:
    return f"agent-{os.getpid()}-{uuid.uuid4().hex[:8]}-"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_topics(bootstrap: str, pre: str, n_batches: int, n_inventories: int):
    topics = [topic_name(INVENTORY, pre), topic_name(TELEMETRY_GPU, pre)]

    def enough(msgs):
        inv = sum(1 for m in msgs if m.topic == topics[0])
        return inv >= n_inventories and len(msgs) - inv >= n_batches

    msgs = asyncio.run(consume_until(bootstrap, topics, until=enough, timeout_s=30))
    inventories = [m for m in msgs if m.topic == topics[0]]
    batches = [m for m in msgs if m.topic == topics[1]]
    return inventories, batches


def test_cli_agent_sim_source_publishes_inventory_and_node_batches(kafka_bootstrap):
    pre = prefix()
    count, nodes = 6, 3
    proc = subprocess.run(
        [sys.executable, "-m", "fleetwise.cli", "agent", "--bootstrap", kafka_bootstrap, "--source", "sim",
         "--sim-nodes", str(nodes), "--sim-gpus", "h100-sxm:16,a100-sxm-80gb:8", "--seed", "11",
         "--count", str(count), "--fast", "--topic-prefix", pre, "--json", "--loglevel", "warning"],
        capture_output=True, text=True, timeout=90, cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["batches_sent"] == count * nodes and summary["undelivered"] == 0
    inventories, batches = read_topics(kafka_bootstrap, pre, count * nodes, nodes)
    assert len(batches) == count * nodes and len(inventories) == nodes
    invs = [NodeInventory.model_validate_json(m.value) for m in inventories]
    assert {i.node for i in invs} == {"node-000", "node-001", "node-002"}
    assert all(m.key == i.node for m, i in zip(inventories, invs, strict=True))  # keyed by node
    by_model = {i.node: i.gpus[0].model for i in invs}
    assert by_model["node-002"] == "NVIDIA A100-SXM4-80GB" and len(invs[0].nvlink_groups[0]) == 8
    per_node = defaultdict(list)
    for m in batches:
        b = NodeBatch.model_validate_json(m.value)
        assert m.key == b.node and len(b.samples) == 8
        assert m.header(PRODUCED_AT_HEADER) is not None
        per_node[(b.node, m.partition)].append(b.ts)
    # one partition per node (key = node), event time in order within it
    assert len(per_node) == nodes
    assert all(ts == sorted(ts) and len(ts) == count for ts in per_node.values())


def test_agent_buffers_through_an_outage_then_delivers(kafka_bootstrap):
    """The publisher starts against a real closed port: collection goes on, the buffer fills
    and drops the oldest with a counter; once pointed at the broker, the buffered (newest)
    batches and the inventory are delivered."""
    pre = prefix()
    count, max_buffer = 30, 8

    async def scenario():
        collector = SimCollector(gpus="h100-sxm:8", seed=5, interval_s=0.05, ticks=count)
        pub = BatchPublisher(f"127.0.0.1:{closed_port()}", agent="it-outage", max_buffer=max_buffer,
                             topic_prefix=pre, backoff_max_s=0.5, request_timeout_ms=5000)
        stop = asyncio.Event()
        task = asyncio.create_task(run_agent(collector, pub, interval_s=0.05, count=count,
                                             stop=stop, flush_timeout_s=30))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while pub.stats.batches_offered < count:  # collection proceeds with no broker
            assert loop.time() < deadline, f"collection stalled at {pub.stats.batches_offered}"
            await asyncio.sleep(0.05)
        during = (pub.stats.batches_sent, pub.stats.dropped, pub.depth, pub.stats.connect_errors)
        buffered_ts = [NodeBatch.model_validate_json(i.value).ts for i in pub.buffer.peek_all()]
        pub.set_bootstrap(kafka_bootstrap)
        run = await asyncio.wait_for(task, 60)
        return run, pub, during, buffered_ts

    run, pub, during, buffered_ts = asyncio.run(scenario())
    sent_during, dropped_during, depth_during, connect_errors = during
    assert run.ticks == count and sent_during == 0 and connect_errors >= 1
    assert dropped_during == count - max_buffer and depth_during == max_buffer
    assert run.delivered and pub.stats.batches_sent == max_buffer and pub.stats.inventories_sent == 1
    inventories, batches = read_topics(kafka_bootstrap, pre, max_buffer, 1)
    delivered_ts = [NodeBatch.model_validate_json(m.value).ts for m in batches]
    # exactly the newest batches survived, in order, and nothing else arrived
    reference = SimCollector(gpus="h100-sxm:8", seed=5, interval_s=0.05, ticks=count)
    reference.start()
    all_ts = [b.ts for _ in range(count) for b in reference.collect(0.0)]
    assert delivered_ts == buffered_ts == all_ts[-max_buffer:]
    assert NodeInventory.model_validate_json(inventories[0].value).node == "node-000"
