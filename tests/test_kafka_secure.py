"""The secure broker (`kafka.sh start --secure`): SASL/SCRAM-SHA-512 over TLS, KRaft's
StandardAuthorizer and one user per component with least-privilege ACLs.

A broker of its own (its own state dir and ports, started once for this module) so the plain
broker the other tests share stays as it is. Clients get their settings the way components
do: from the environment (`client_security_from_env`), here the files `kafka.sh` writes
(DIR/env/<user>.env); nothing secret is in the code.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetwise.schemas import Ack, Command, NodeBatch
from fleetwise.schemas import topics as T
from fleetwise.streams.kafka_io import (
    KafkaSecurityError,
    client_security_from_env,
    consume_until,
    produce_records,
    start_producer,
)

REPO = Path(__file__).resolve().parents[1]
KAFKA_SH = REPO / "deploy" / "kafka" / "kafka.sh"
USERS = ("admin", "agent", "worker", "plugin", "kube-consumer")
# This module's broker limits each agent client id to 64 KiB/s (the default is 1 MiB/s), so a
# flood is throttled within seconds.
AGENT_BYTE_RATE = 65536
START_TS = 1_764_489_600.0


# --------------------------------------------------------------------------- broker
class SecureBroker:
    def __init__(self, state: Path, bootstrap: str) -> None:
        self.state, self.bootstrap = state, bootstrap

    def env(self, user: str) -> dict[str, str]:
        """The client settings kafka.sh wrote for `user` (DIR/env/<user>.env)."""
        out = {}
        for line in (self.state / "env" / f"{user}.env").read_text().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                out[key] = value
        return out


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    state = tmp_path_factory.mktemp("kafka-secure")
    env = dict(os.environ, KAFKA_WATCH_PID=str(os.getpid()),
               FLEETWISE_KAFKA_AGENT_BYTE_RATE=str(AGENT_BYTE_RATE))
    try:
        proc = subprocess.run(["bash", str(KAFKA_SH), "start", "--secure", str(state)], env=env,
                              capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            pytest.fail(f"kafka.sh start --secure failed (rc={proc.returncode}):\n{proc.stderr}",
                        pytrace=False)
        yield SecureBroker(state, proc.stdout.strip().splitlines()[-1])
    finally:
        subprocess.run(["bash", str(KAFKA_SH), "stop", str(state)], env=env, timeout=120, check=False)


@pytest.fixture
def as_user(secure_broker: SecureBroker, monkeypatch: pytest.MonkeyPatch):
    """`as_user(name)`: this process's Kafka clients authenticate as `name` from now on."""

    def switch(user: str | None, **overrides: str | None) -> None:
        """`overrides`: FLEETWISE_KAFKA_<NAME> variables to set (None: to remove)."""
        for key in [k for k in os.environ if k.startswith("FLEETWISE_KAFKA_")]:
            monkeypatch.delenv(key)
        if user is not None:
            for key, value in secure_broker.env(user).items():
                monkeypatch.setenv(key, value)
        for name, value in overrides.items():
            if value is None:
                monkeypatch.delenv(f"FLEETWISE_KAFKA_{name}", raising=False)
            else:
                monkeypatch.setenv(f"FLEETWISE_KAFKA_{name}", value)

    return switch


def node_batch(node: str, tick: int, xid: dict[int, float] | None = None) -> NodeBatch:
    ts = START_TS + 10.0 * tick
    samples = [{"ts": ts, "node": node, "gpu": g, "model": "NVIDIA H100 80GB HBM3",
                "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60.0 + g, "DCGM_FI_DEV_POWER_USAGE": 500.0 + 5 * g,
                            "DCGM_FI_DEV_SM_CLOCK": 1980.0, "DCGM_FI_DEV_GPU_UTIL": 95.0,
                            "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 0.0,
                            "DCGM_FI_DEV_XID_ERRORS": (xid or {}).get(g, 0.0)}} for g in range(8)]
    return NodeBatch.model_validate({"ts": ts, "node": node, "samples": samples})


# --------------------------------------------------------------------------- settings (no broker)
def test_plaintext_is_the_default_and_adds_no_settings() -> None:
    assert client_security_from_env({}) == {}
    assert client_security_from_env({"FLEETWISE_KAFKA_SECURITY": "plaintext"}) == {}


def test_sasl_ssl_settings_come_from_the_environment_and_files(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    got = client_security_from_env({"FLEETWISE_KAFKA_SECURITY": "SASL_SSL", "FLEETWISE_KAFKA_USER": "agent",
                                    "FLEETWISE_KAFKA_PASSWORD_FILE": str(secret)})
    assert got["security_protocol"] == "SASL_SSL" and got["sasl_mechanism"] == "SCRAM-SHA-512"
    assert got["sasl_plain_username"] == "agent" and got["sasl_plain_password"] == "s3cret"
    import ssl

    assert got["ssl_context"].verify_mode == ssl.CERT_REQUIRED and got["ssl_context"].check_hostname


@pytest.mark.parametrize(("env", "named"), [
    ({"FLEETWISE_KAFKA_SECURITY": "TLS"}, "FLEETWISE_KAFKA_SECURITY"),
    ({"FLEETWISE_KAFKA_SECURITY": "SASL_SSL", "FLEETWISE_KAFKA_PASSWORD": "x"}, "FLEETWISE_KAFKA_USER"),
    ({"FLEETWISE_KAFKA_SECURITY": "SASL_SSL", "FLEETWISE_KAFKA_USER": "a"}, "FLEETWISE_KAFKA_PASSWORD_FILE"),
    ({"FLEETWISE_KAFKA_SECURITY": "SASL_SSL", "FLEETWISE_KAFKA_USER": "a",
      "FLEETWISE_KAFKA_PASSWORD_FILE": "/nonexistent/pw"}, "FLEETWISE_KAFKA_PASSWORD_FILE=/nonexistent/pw"),
    ({"FLEETWISE_KAFKA_SECURITY": "SASL_SSL", "FLEETWISE_KAFKA_USER": "a", "FLEETWISE_KAFKA_PASSWORD": "x",
      "FLEETWISE_KAFKA_PASSWORD_FILE": "/tmp/pw"}, "not both"),
    ({"FLEETWISE_KAFKA_SECURITY": "SASL_SSL", "FLEETWISE_KAFKA_USER": "a", "FLEETWISE_KAFKA_PASSWORD": "x",
      "FLEETWISE_KAFKA_SASL_MECHANISM": "GSSAPI"}, "FLEETWISE_KAFKA_SASL_MECHANISM"),
    ({"FLEETWISE_KAFKA_SECURITY": "SSL", "FLEETWISE_KAFKA_CA_FILE": "/nonexistent/ca.pem"},
     "FLEETWISE_KAFKA_CA_FILE"),
])
def test_bad_security_settings_name_the_variable(env: dict[str, str], named: str) -> None:
    with pytest.raises(KafkaSecurityError, match=named.replace(".", r"\.")):
        client_security_from_env(env)


# --------------------------------------------------------------------------- broker: files and ACL table
@pytest.mark.kafka
def test_secure_start_writes_secrets_private_and_acls_name_only_registry_topics(secure_broker) -> None:
    state = secure_broker.state
    for user in USERS:
        assert (state / "users" / f"{user}.password").stat().st_mode & 0o077 == 0, user
    for private in ("tls/ca.key", "tls/broker.key", "tls/store.pass", "server.properties"):
        assert (state / private).stat().st_mode & 0o077 == 0, private
    props = (state / "server.properties").read_text()
    assert "StandardAuthorizer" in props and "PLAINTEXT" not in props.replace("auto.create", "")
    registry = {t.name for t in T.TOPICS}
    table = [line.split() for line in (state / "acls.txt").read_text().splitlines() if line.strip()]
    literal_topics = {row[3] for row in table if row[1] == "topic" and row[2] == "literal"}
    assert literal_topics == registry, literal_topics ^ registry
    # least privilege, as the table says: only the worker writes commands; agents write only
    # telemetry and inventories
    writers = {(row[0], row[3]) for row in table if row[1] == "topic" and "Write" in row[4].split(",")}
    assert {t for u, t in writers if u == "agent"} == {T.TELEMETRY_GPU.name, T.INVENTORY.name}
    for commands in (T.COMMANDS_TRAINING.name, T.COMMANDS_KUBE.name):
        assert {u for u, t in writers if t == commands} == {"worker"}
    # produce quotas per client id for the two users one per node or job (agents, plugins)
    quotas = {(row[0], row[1], row[2]): float(row[3]) for row in
              (line.split() for line in (state / "quotas.txt").read_text().splitlines() if line.strip())}
    assert quotas == {("agent", "<default>", "producer_byte_rate"): AGENT_BYTE_RATE,
                      ("plugin", "<default>", "producer_byte_rate"): 1048576.0}
    assert "quotas: 2" in (state / "setup.log").read_text()


# --------------------------------------------------------------------------- broker: refusals
@pytest.mark.kafka
async def test_a_client_without_credentials_is_refused(secure_broker, as_user) -> None:
    from aiokafka.errors import KafkaConnectionError, KafkaError

    as_user(None)  # plain: no TLS, no SASL
    with pytest.raises(KafkaError):
        await asyncio.wait_for(produce_records(secure_broker.bootstrap, T.TELEMETRY_GPU.name,
                                               [node_batch("node-x", 0)]), 60)
    # TLS to a trusted broker, but no SASL login
    as_user("agent", SECURITY="SSL")
    with pytest.raises((KafkaConnectionError, KafkaError)):
        await asyncio.wait_for(produce_records(secure_broker.bootstrap, T.TELEMETRY_GPU.name,
                                               [node_batch("node-x", 0)]), 60)
    # the right user with a wrong password
    as_user("agent", PASSWORD_FILE=None, PASSWORD="not-the-password")
    with pytest.raises(KafkaError):
        await asyncio.wait_for(produce_records(secure_broker.bootstrap, T.TELEMETRY_GPU.name,
                                               [node_batch("node-x", 0)]), 60)


@pytest.mark.kafka
@pytest.mark.parametrize(("user", "topic"), [
    ("agent", T.COMMANDS_TRAINING.name),
    ("agent", T.COMMANDS_KUBE.name),
    ("plugin", T.COMMANDS_TRAINING.name),
    ("kube-consumer", T.COMMANDS_KUBE.name),
    ("agent", T.FEATURES.name),
])
async def test_a_component_writing_outside_its_acls_is_refused_by_the_broker(
    secure_broker, as_user, user: str, topic: str
) -> None:
    from aiokafka.errors import TopicAuthorizationFailedError

    from fleetwise.actuators import sign

    await _ensure_registry_topics(secure_broker, as_user)
    as_user(user)
    forged = sign(Command(id=f"drain-forged-{user}", type="drain", ts=START_TS, node="node-000", gpu=0,
                          reason="forged"))
    producer = await start_producer(secure_broker.bootstrap, request_timeout_ms=20_000)
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            await asyncio.wait_for(producer.send_and_wait(topic, forged.to_json_bytes(), key=b"node-000"), 60)
    finally:
        await producer.stop()
    as_user("admin")
    seen = await consume_until(secure_broker.bootstrap, [topic], timeout_s=3)
    assert not [m for m in seen if b"forged" in m.value]


@pytest.mark.kafka
async def test_an_agent_may_not_read_what_the_worker_decides(secure_broker, as_user) -> None:
    from aiokafka.errors import KafkaError

    await _ensure_registry_topics(secure_broker, as_user)
    as_user("agent")
    with pytest.raises(KafkaError):  # TopicAuthorizationFailed on the consumer's metadata
        await asyncio.wait_for(consume_until(secure_broker.bootstrap, [T.COMMANDS_KUBE.name], timeout_s=5,
                                             until=lambda ms: False), 60)


@pytest.mark.kafka
@pytest.mark.slow
async def test_a_flooding_agent_is_throttled_to_its_quota_and_another_agent_is_not(
    secure_broker, as_user
) -> None:
    # Agents share the `agent` user; the quota is per client id (fleetwise-agent-<node>), so a
    # node that floods is slowed to its rate and the next node's agent still gets through.
    # Garbage on the inventory topic: a worker dead-letters it (no worker reads it here).
    await _ensure_registry_topics(secure_broker, as_user)
    as_user("agent")
    chunk = b"x" * 16384

    async def send(client_id: str, n: int) -> float:
        producer = await start_producer(secure_broker.bootstrap, client_id=client_id,
                                        request_timeout_ms=120_000)
        try:
            start = time.monotonic()
            for _ in range(n):
                await producer.send_and_wait(T.INVENTORY.name, chunk, key=client_id.encode())
            return time.monotonic() - start
        finally:
            await producer.stop()

    flood_bytes = 80 * len(chunk)  # 1.25 MiB: ~20 s of quota, ~11 of which the broker's rate
    flooded = await send("fleetwise-agent-flood", 80)  # window lets through at once
    quiet = await send("fleetwise-agent-quiet", 4)
    assert flooded >= 0.25 * flood_bytes / AGENT_BYTE_RATE, flooded  # >= 5 s; unthrottled < 1 s
    assert quiet < flooded / 3, (quiet, flooded)


async def _ensure_registry_topics(broker: SecureBroker, as_user) -> None:
    from fleetwise.streams.kafka_io import ensure_topics

    as_user("worker")  # the worker creates the registry's topics (it holds Create on them)
    await ensure_topics(broker.bootstrap)


# --------------------------------------------------------------------------- broker: the pipeline
@pytest.mark.kafka
@pytest.mark.slow
async def test_agent_worker_and_kube_consumer_work_with_their_own_credentials(
    secure_broker, as_user, tmp_path: Path
) -> None:
    """An agent (agent user) publishes node batches with an XID 79 on one GPU; the worker
    (worker user, subprocess) turns them into features, a failure alert and a drain command;
    the kube consumer (kube-consumer user) reads the command and acknowledges it."""
    from fleetwise.agent.publisher import BatchPublisher

    worker_env = dict(os.environ, **secure_broker.env("worker"), PYTHONUNBUFFERED="1",
                      FLEETWISE_CACHE=str(tmp_path / "cache"))
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "fleetwise.cli", "worker", "--bootstrap", secure_broker.bootstrap,
             "--app-id", "fleetwise", "--checkpoint-interval", "1", "--loglevel", "info"],
            cwd=REPO, env=worker_env, stdout=log, stderr=subprocess.STDOUT)
    try:
        as_user("admin")
        # the worker created the topics (as the worker user) and joined its group
        deadline = time.monotonic() + 120
        while not await _group_is_stable(secure_broker, "fleetwise"):
            assert worker.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            await asyncio.sleep(1.0)

        as_user("agent")
        publisher = BatchPublisher(secure_broker.bootstrap, agent="secure-test")
        await publisher.start()
        for tick in range(130):  # two 600 s hops and more; XID 79 on node-001/3 from tick 30
            for n in range(2):
                xid = {3: 79.0} if n == 1 and tick >= 30 else None
                publisher.offer(node_batch(f"node-{n:03d}", tick, xid))
        assert await publisher.wait_delivered(60), publisher.stats
        await publisher.stop()
        assert publisher.stats.batches_sent == 260 and publisher.stats.dropped == 0

        as_user("kube-consumer")
        try:
            got = await consume_until(
                secure_broker.bootstrap, [T.COMMANDS_KUBE.name], timeout_s=120,
                until=lambda ms: worker.poll() is None and any(b'"drain"' in m.value for m in ms))
        except TimeoutError as exc:
            pytest.fail(f"{exc}\nworker log:\n{log_path.read_text()[-6000:]}")
        drains = [Command.model_validate_json(m.value) for m in got if b'"drain"' in m.value]
        assert {(c.node, c.gpu) for c in drains} == {("node-001", 3)}
        assert any("xid79" in json.dumps(c.params) or "xid79" in c.reason for c in drains)
        ack = Ack(command_id=drains[0].id, ts=drains[0].ts + 5, node="node-001", gpu=3, by="kube-consumer",
                  status="received")
        await produce_records(secure_broker.bootstrap, T.ACKS.name, [ack])

        as_user("admin")
        outputs = await consume_until(secure_broker.bootstrap, [T.FEATURES.name, T.ACKS.name], timeout_s=30,
                                      until=lambda ms: any(m.topic == T.ACKS.name for m in ms)
                                      and sum(m.topic == T.FEATURES.name for m in ms) >= 16)
        assert {json.loads(m.value)["node"] for m in outputs if m.topic == T.FEATURES.name} == \
            {"node-000", "node-001"}
        assert worker.poll() is None, log_path.read_text()[-4000:]
    finally:
        worker.send_signal(signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait(timeout=10)
    assert "TopicAuthorizationFailed" not in log_path.read_text()


async def _group_is_stable(broker: SecureBroker, group: str) -> bool:
    """Whether the consumer group has members and a settled assignment (as the current user)."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(bootstrap_servers=broker.bootstrap, **client_security_from_env())
    await admin.start()
    try:
        described = await admin.describe_consumer_groups([group])
    except KafkaError:  # no coordinator yet (the offsets topic is being created)
        return False
    finally:
        await admin.close()
    # DescribeGroups: groups[i] = (error_code, group_id, state, protocol_type, protocol, members, ...)
    return bool(described and described[0].groups and described[0].groups[0][2] == "Stable")


@pytest.mark.kafka
async def test_the_kube_consumer_runs_under_its_own_acls(secure_broker, as_user) -> None:
    """The real `fleetwise kube consumer` loop (dry run: no cluster) as the kube-consumer user:
    it reads commands, acks (a command's `requires`), operator actions and plan tombstones (job
    ends) and writes its acks. Before its ACLs covered all four it failed at its first poll."""
    from fleetwise.actuators import sign

    await _ensure_registry_topics(secure_broker, as_user)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEETWISE_KAFKA_")}
    env.update(secure_broker.env("kube-consumer"))
    consumer = subprocess.Popen(
        [sys.executable, "-m", "fleetwise.cli", "kube", "consumer", "--bootstrap", secure_broker.bootstrap,
         "--dry-run", "--max-seconds", "120"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        as_user("admin")
        drain = sign(Command(id=f"drain-kube-acl-{os.getpid()}", type="drain", ts=time.time(),
                             node="node-000", gpu=0, reason="the kube consumer's ACLs"))
        await produce_records(secure_broker.bootstrap, T.COMMANDS_KUBE.name, [drain],
                              key=lambda _r: "node-000")
        await produce_records(secure_broker.bootstrap, T.PLANS.name, [None], key="llm")  # a job's end

        def acked(ms) -> bool:
            assert consumer.poll() is None, consumer.communicate()[1][-4000:]
            return any(json.loads(m.value).get("command_id") == drain.id for m in ms)

        got = await consume_until(secure_broker.bootstrap, [T.ACKS.name], timeout_s=90, until=acked)
        ack = next(json.loads(m.value) for m in got if json.loads(m.value).get("command_id") == drain.id)
        assert ack["by"] == "kube-consumer" and ack["status"] in ("applied", "done"), ack
        assert consumer.poll() is None  # still polling all its topics
    finally:
        consumer.terminate()
        _out, err = consumer.communicate(timeout=30)
    assert "AuthorizationFailed" not in err, err[-4000:]
