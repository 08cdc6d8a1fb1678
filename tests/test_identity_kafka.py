"""Producers' identities through the real broker and worker (docs/security.md, "Producer
identities"): with the identity master key set, the worker reads telemetry and inventories only
when signed by the node they are keyed by, and acks only when signed by their job's plugin (or
the kube consumer); each producer's key signs as itself alone."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_acks_kafka import commands_until, xid_batches
from test_streams_kafka import namespace, on  # noqa: F401 - `namespace` is a fixture

from fleetwise.actuators.signing import SIGNATURE_HEADER, IdentityKeys, identity_key
from fleetwise.schemas import Ack, GpuInventory, NodeInventory
from fleetwise.schemas import topics as T
from fleetwise.streams.kafka_io import consume_until, topic_name
from fleetwise.training.transport import KafkaTransport

REPO = Path(__file__).resolve().parents[1]
MASTER = "the-identity-master-key-0123456789"
START = 1764547200.0
UNSIGNED = ("signature: unsigned: no fleetwise-signature header (the workers require signed {} "
            "messages: FLEETWISE_IDENTITY_KEY on the producer)")


def cli_key(identity: str) -> str:
    """What `fleetwise keys identity` prints for the identity (its FLEETWISE_IDENTITY_KEY)."""
    return subprocess.run([sys.executable, "-m", "fleetwise.cli", "keys", "identity", identity],
                          env={"FLEETWISE_IDENTITY_MASTER_KEY": MASTER, "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, cwd=REPO, check=True).stdout.strip()


def batch(node: str, ts: float) -> bytes:
    samples = [{"ts": ts, "node": node, "gpu": g, "model": "NVIDIA H100 80GB HBM3",
                "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 500.0}} for g in range(2)]
    return json.dumps({"node": node, "ts": ts, "samples": samples}).encode()


async def send(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes, bytes | None]]) -> None:
    """(key, value, signature header or None) messages, as a producer without a key of its own."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for key, value, header in messages:
            await producer.send_and_wait(topic, value, key=key,
                                         headers=[(SIGNATURE_HEADER, header)] if header is not None else [])
    finally:
        await producer.stop()


def dead_reasons(bootstrap: str, prefix: str, worker, count: int) -> list[str]:
    try:
        got = asyncio.run(consume_until(bootstrap, [topic_name(T.DEADLETTER, prefix)], timeout_s=90,
                                        until=lambda ms: worker.check_alive() and len(ms) >= count))
    except TimeoutError as exc:
        pytest.fail(f"{exc}\n{worker.log_tail()}")
    return sorted(json.loads(m.value)["reason"] for m in got)


@pytest.mark.kafka
def test_the_worker_reads_only_what_a_node_signed_for_itself(kafka_bootstrap: str, namespace):  # noqa: F811
    prefix, new_worker = namespace
    worker = new_worker(env={"FLEETWISE_IDENTITY_MASTER_KEY": MASTER}).start()
    # The real agent, with the key `fleetwise keys identity node/good-node` derives.
    derived = cli_key("node/good-node")
    agent = subprocess.run(
        [sys.executable, "-m", "fleetwise.cli", "agent", "--bootstrap", kafka_bootstrap, "--source", "sim",
         "--sim-gpus", "h100-sxm:2", "--node", "good-node", "--interval", "60", "--count", "40", "--fast",
         "--topic-prefix", prefix, "--no-create-topics", "--loglevel", "warning", "--json"],
        env={"FLEETWISE_IDENTITY_KEY": derived, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
        cwd=REPO, timeout=90)
    assert agent.returncode == 0, agent.stderr
    assert json.loads(agent.stdout)["batches_sent"] == 40

    # A compromised good-node writing under another node's name, and a writer with no key.
    good = IdentityKeys.parse(derived)
    own_key = identity_key(MASTER.encode(), "node/good-node")
    b1, b2, b3 = (batch("victim", START + 60 * i) for i in (1, 2, 3))
    claimed = b"node/victim;hmac-sha256:" + hmac.new(own_key, b3, hashlib.sha256).hexdigest().encode()
    asyncio.run(send(kafka_bootstrap, topic_name(T.TELEMETRY_GPU, prefix), [
        (b"victim", b1, None),  # unsigned
        (b"victim", b2, good.header(b2, "node/good-node")),  # keyed victim, signed as good-node
        (b"victim", b3, claimed),  # names the victim, under good-node's key
    ]))
    inventory = NodeInventory(ts=START, node="victim",
                              gpus=[GpuInventory(index=0, model="NVIDIA H100 80GB HBM3")])
    asyncio.run(send(kafka_bootstrap, topic_name(T.INVENTORY, prefix),
                     [(b"victim", inventory.to_json_bytes(), None)]))
    assert dead_reasons(kafka_bootstrap, prefix, worker, 4) == sorted([
        UNSIGNED.format(T.TELEMETRY_GPU.name),
        "signature: signed as 'node/good-node' but keyed 'victim': only 'node/victim' may write it",
        "signature: bad signature under 'node/victim''s key: forged or altered",
        UNSIGNED.format(T.INVENTORY.name),
    ])
    got = asyncio.run(consume_until(kafka_bootstrap, [topic_name(T.FEATURES, prefix)], timeout_s=30,
                                    until=lambda ms: len(ms) >= 2))
    assert {json.loads(m.value)["node"] for m in got} == {"good-node"}  # none of the victim's
    assert worker.metric("fleetwise_deadletter_total", reason="unsigned") == 4.0


@pytest.mark.kafka
async def test_another_jobs_plugin_cannot_ack_for_this_job(kafka_bootstrap: str, namespace,  # noqa: F811
                                                          monkeypatch):
    """A checkpoint for job llm; a `done` ack for it signed by job other's plugin is dead-lettered
    and no drain follows; the same ack from llm's own plugin (KafkaTransport with its key from
    the environment) releases the drain."""
    prefix, new_worker = namespace
    worker = new_worker(env={"FLEETWISE_IDENTITY_MASTER_KEY": MASTER}).start()
    simulator = IdentityKeys(master=MASTER.encode())  # signs each node's batches as that node
    await send(kafka_bootstrap, topic_name(T.TELEMETRY_GPU, prefix), [
        (json.loads(raw)["node"].encode(), raw, simulator.header(raw, "node/" + json.loads(raw)["node"]))
        for raw in xid_batches()])
    (checkpoint,) = [c for c in await commands_until(kafka_bootstrap, prefix, "checkpoint", worker)
                     if c.type == "checkpoint"]
    ack = Ack(command_id=checkpoint.id, ts=checkpoint.ts + 20, job="llm", by="training-plugin",
              status="done", step=120, result={"checkpoint_uri": "file:///ckpt/120", "step": 120})

    def publish(signer: IdentityKeys | str) -> None:
        transport = KafkaTransport(kafka_bootstrap, prefix=prefix, signer=signer)  # type: ignore[arg-type]
        try:
            transport.publish(T.ACKS.name, "llm", ack)
        finally:
            transport.close()

    await asyncio.to_thread(publish, IdentityKeys.parse(cli_key("job/other")))
    assert await asyncio.to_thread(dead_reasons, kafka_bootstrap, prefix, worker, 1) == [
        "signature: signed as 'job/other' but keyed 'llm': only 'job/llm' or 'kube-consumer' may write it"]
    await asyncio.sleep(3)  # the worker had time to act on it, had it read it
    commands = [json.loads(m.value) for m in await consume_until(
        kafka_bootstrap, [topic_name(T.COMMANDS_TRAINING, prefix)], timeout_s=5, idle_s=2)]
    assert [c["type"] for c in commands] == ["checkpoint"]  # no drain
    monkeypatch.setenv("FLEETWISE_IDENTITY_KEY", cli_key("job/llm"))
    await asyncio.to_thread(publish, "env")
    drains = [c for c in await commands_until(kafka_bootstrap, prefix, "drain", worker) if c.type == "drain"]
    assert drains and drains[0].requires == [checkpoint.id]
