"""Node identities through the real broker and worker: with the agent master key set, the worker
reads telemetry and inventories only when signed by the key of the node they are keyed by; an
agent's key signs for its own node alone (docs/security.md, "Node identities")."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_streams_kafka import namespace, on  # noqa: F401 - `namespace` is a fixture

from fleetwise.actuators.signing import NODE_SIGNATURE_HEADER, AgentKeys, agent_node_key
from fleetwise.schemas import GpuInventory, NodeInventory
from fleetwise.schemas import topics as T
from fleetwise.streams.kafka_io import consume_until, topic_name

REPO = Path(__file__).resolve().parents[1]
MASTER = "the-agents-master-key-0123456789"
START = 1764547200.0


def batch(node: str, ts: float) -> bytes:
    samples = [{"ts": ts, "node": node, "gpu": g, "model": "NVIDIA H100 80GB HBM3",
                "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 500.0}} for g in range(2)]
    return json.dumps({"node": node, "ts": ts, "samples": samples}).encode()


@pytest.mark.kafka
def test_the_worker_reads_only_what_a_node_signed_for_itself(kafka_bootstrap: str, namespace):  # noqa: F811
    prefix, new_worker = namespace
    worker = new_worker(env={"FLEETWISE_AGENT_MASTER_KEY": MASTER}).start()
    # The real agent, with the key `fleetwise keys agent` derives for its node.
    derived = subprocess.run([sys.executable, "-m", "fleetwise.cli", "keys", "agent", "good-node"],
                             env={"FLEETWISE_AGENT_MASTER_KEY": MASTER, "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()
    agent = subprocess.run(
        [sys.executable, "-m", "fleetwise.cli", "agent", "--bootstrap", kafka_bootstrap, "--source", "sim",
         "--sim-gpus", "h100-sxm:2", "--node", "good-node", "--interval", "60", "--count", "40", "--fast",
         "--topic-prefix", prefix, "--no-create-topics", "--loglevel", "warning", "--json"],
        env={"FLEETWISE_AGENT_KEY": derived, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        cwd=REPO, timeout=90)
    assert agent.returncode == 0, agent.stderr
    assert json.loads(agent.stdout)["batches_sent"] == 40

    # A compromised good-node writing under another node's name, and a writer with no key.
    good = AgentKeys.parse(derived)
    own_key = agent_node_key(MASTER.encode(), "good-node")
    b1, b2, b3 = (batch("victim", START + 60 * i) for i in (1, 2, 3))
    forged = [
        (b1, None),  # unsigned
        (b2, good.header(b2, "good-node")),  # keyed victim, signed as good-node
        # names the victim in the header, under good-node's key
        (b3, b"victim;hmac-sha256:" + hmac.new(own_key, b3, hashlib.sha256).hexdigest().encode()),
    ]
    inventory = NodeInventory(ts=START, node="victim",
                              gpus=[GpuInventory(index=0, model="NVIDIA H100 80GB HBM3")])

    async def send() -> None:
        from aiokafka import AIOKafkaProducer

        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            for value, header in forged:
                headers = [(NODE_SIGNATURE_HEADER, header)] if header is not None else []
                await producer.send_and_wait(topic_name(T.TELEMETRY_GPU, prefix), value, key=b"victim",
                                             headers=headers)
            await producer.send_and_wait(topic_name(T.INVENTORY, prefix), inventory.to_json_bytes(),
                                         key=b"victim")
        finally:
            await producer.stop()

    asyncio.run(send())
    topics = [topic_name(t, prefix) for t in (T.FEATURES, T.DEADLETTER)]
    try:
        got = asyncio.run(consume_until(
            kafka_bootstrap, topics, timeout_s=90,
            until=lambda ms: worker.check_alive() and len(on(T.DEADLETTER, prefix, ms)) >= 4
            and len(on(T.FEATURES, prefix, ms)) >= 2))
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{worker.log_tail()}")
    reasons = sorted(json.loads(m.value)["reason"] for m in on(T.DEADLETTER, prefix, got))
    assert reasons == sorted([
        "signature: unsigned: no fleetwise-node-signature header (the workers require signed agent "
        "messages: FLEETWISE_AGENT_KEY on the agent)",
        "signature: signed with node 'good-node''s key but keyed 'victim': a node signs only its own "
        "messages",
        "signature: bad signature under node 'victim''s key: forged or altered",
        "signature: unsigned: no fleetwise-node-signature header (the workers require signed agent "
        "messages: FLEETWISE_AGENT_KEY on the agent)",
    ]), reasons
    sources = {json.loads(m.value)["source"].split(":")[0] for m in on(T.DEADLETTER, prefix, got)}
    assert sources == {topic_name(T.TELEMETRY_GPU, prefix), topic_name(T.INVENTORY, prefix)}
    nodes = {json.loads(m.value)["node"] for m in on(T.FEATURES, prefix, got)}
    assert nodes == {"good-node"}  # the signed node's telemetry went through; none of the victim's
    assert worker.metric("fleetwise_deadletter_total", reason="unsigned") == 4.0
