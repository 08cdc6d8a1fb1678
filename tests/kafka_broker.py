"""Pytest plugin: a real Apache Kafka broker for integration tests.

Register it from ``tests/conftest.py`` with ``pytest_plugins = ["tests.kafka_broker"]``.

Fixtures
--------
``kafka_bootstrap`` (session) -> ``str``
    Bootstrap address ("host:port[,host:port...]") of a broker that answered a Metadata
    request. Chosen in this order:

    1. ``FLEETWISE_KAFKA_BOOTSTRAP`` -- an existing cluster (nothing is started or stopped);
    2. testcontainers' ``KafkaContainer().with_kraft()`` when a Docker engine answers
       (set ``FLEETWISE_KAFKA_DOCKER=0`` to skip this; ``FLEETWISE_KAFKA_IMAGE`` picks the image);
    3. a local broker from Maven Central jars: ``deploy/kafka/kafka.sh start <tmpdir>``,
       stopped with ``kafka.sh stop`` at the end of the session.

    When no broker can be had the fixture FAILS (it never skips) with the reason.

``kafka_topic_factory`` (function) -> ``async (prefix="test", partitions=3, configs=None) -> str``
    Creates a uniquely named topic with ``partitions`` partitions, waits until every
    partition has a leader, and deletes the topics it made when the test ends.

Helpers
-------
``unique_topic(prefix) -> str``; ``await create_topic(bootstrap, name, partitions=1, ...)``;
``await delete_topics(bootstrap, names)``.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
KAFKA_SH = REPO_ROOT / "deploy" / "kafka" / "kafka.sh"
ENV_BOOTSTRAP = "FLEETWISE_KAFKA_BOOTSTRAP"
ENV_DOCKER = "FLEETWISE_KAFKA_DOCKER"
ENV_IMAGE = "FLEETWISE_KAFKA_IMAGE"
START_TIMEOUT_S = 900  # includes a first-time jar fetch from Maven Central


# --------------------------------------------------------------------------- helpers
def unique_topic(prefix: str = "test") -> str:
    """A topic name no other test (or test run) will use."""
    return f"fleetwise-{prefix}-{os.getpid()}-{uuid.uuid4().hex[:10]}"


def metadata_ok(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """True when any broker in ``bootstrap`` answers a Metadata request listing >= 1 broker.

    Uses ``kafka.sh probe`` (a wire-protocol Metadata request, not an open-port check), the
    same readiness test ``kafka.sh start`` uses, so there is one implementation of it.
    """
    for hostport in bootstrap.split(","):
        try:
            probe = subprocess.run(["bash", str(KAFKA_SH), "probe", hostport.strip()],
                                   capture_output=True, timeout=timeout_s + 5, check=False)
        except subprocess.TimeoutExpired:
            continue
        if probe.returncode == 0:
            return True
    return False


async def create_topic(
    bootstrap: str,
    name: str,
    partitions: int = 1,
    replication_factor: int = 1,
    configs: Mapping[str, str] | None = None,
    timeout_s: float = 30.0,
) -> str:
    """Create ``name`` with ``partitions`` partitions (idempotent) and wait until all have leaders."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.errors import TopicAlreadyExistsError, for_code

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    await admin.start()
    try:
        resp = await admin.create_topics(
            [NewTopic(name, partitions, replication_factor, topic_configs=dict(configs or {}))],
            timeout_ms=int(timeout_s * 1000),
        )
        for err in resp.topic_errors:
            topic, code = err[0], err[1]
            if code and for_code(code) is not TopicAlreadyExistsError:
                message = err[2] if len(err) > 2 else ""
                raise for_code(code)(f"could not create topic {topic}: {message}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            described = await admin.describe_topics([name])
            if described and _topic_ready(described[0], partitions):
                return name
            if loop.time() > deadline:
                raise TimeoutError(f"topic {name} not ready after {timeout_s}s: {described}")
            await asyncio.sleep(0.1)
    finally:
        await admin.close()


def _topic_ready(desc: Mapping, partitions: int) -> bool:
    parts = desc.get("partitions") or []
    return (
        desc.get("error_code", 0) == 0
        and len(parts) == partitions
        and all(p.get("error_code", 0) == 0 and p.get("leader", -1) >= 0 for p in parts)
    )


async def delete_topics(bootstrap: str, names: Iterable[str], timeout_s: float = 30.0) -> None:
    """Delete topics; best effort (errors are ignored)."""
    names = list(names)
    if not names:
        return
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await admin.start()
        await admin.delete_topics(names, timeout_ms=int(timeout_s * 1000))
    except Exception:  # noqa: BLE001 - cleanup must not fail a passing test
        pass
    finally:
        await admin.close()


# --------------------------------------------------------------------------- broker sources
def _docker_engine_answers() -> bool:
    if os.environ.get(ENV_DOCKER, "").strip().lower() in {"0", "false", "no", "off"}:
        return False
    try:
        import docker  # the SDK testcontainers itself uses
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=5)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - no engine, no socket, no permission: all mean "no Docker"
        return False


def _start_testcontainer(request: pytest.FixtureRequest) -> str:
    try:
        from testcontainers.community.kafka import KafkaContainer  # testcontainers >= 4.15
    except ImportError:
        from testcontainers.kafka import KafkaContainer

    image = os.environ.get(ENV_IMAGE)
    container = (KafkaContainer(image) if image else KafkaContainer()).with_kraft()
    container.start()
    request.addfinalizer(container.stop)
    return container.get_bootstrap_server()


def _start_local_broker(request: pytest.FixtureRequest, state_dir: Path) -> str:
    env = dict(os.environ)
    # If this pytest process dies without running finalizers, the broker goes with it.
    env["KAFKA_WATCH_PID"] = str(os.getpid())

    def stop() -> None:
        subprocess.run(["bash", str(KAFKA_SH), "stop", str(state_dir)], env=env, timeout=120, check=False)

    try:
        proc = subprocess.run(
            ["bash", str(KAFKA_SH), "start", str(state_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        stop()
        pytest.fail(
            f"{KAFKA_SH} start timed out after {START_TIMEOUT_S}s:\n{exc.stderr or ''}", pytrace=False
        )
    if proc.returncode != 0:
        stop()
        pytest.fail(
            f"could not start a local Kafka broker ({KAFKA_SH} start, rc={proc.returncode}):\n"
            f"{proc.stderr}\n{proc.stdout}",
            pytrace=False,
        )
    request.addfinalizer(stop)
    lines = proc.stdout.strip().splitlines()
    if not lines:
        pytest.fail(f"{KAFKA_SH} start printed no bootstrap address:\n{proc.stderr}", pytrace=False)
    return lines[-1].strip()


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def kafka_bootstrap(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Bootstrap address of a real Kafka broker (see module docstring for the order)."""
    existing = os.environ.get(ENV_BOOTSTRAP, "").strip()
    if existing:
        if not metadata_ok(existing):
            pytest.fail(f"{ENV_BOOTSTRAP}={existing} does not answer a Kafka Metadata request", pytrace=False)
        return existing

    docker_error = ""
    if _docker_engine_answers():
        try:
            bootstrap = _start_testcontainer(request)
        except Exception as exc:  # noqa: BLE001 - fall back to the local broker, keep the reason
            docker_error = f"testcontainers KafkaContainer failed: {exc!r}; "
        else:
            if metadata_ok(bootstrap):
                return bootstrap
            docker_error = f"testcontainers KafkaContainer at {bootstrap} did not answer; "

    bootstrap = _start_local_broker(request, tmp_path_factory.mktemp("kafka"))
    if not metadata_ok(bootstrap):
        pytest.fail(
            f"{docker_error}local broker at {bootstrap} does not answer a Metadata request", pytrace=False
        )
    return bootstrap


TopicFactory = Callable[..., Awaitable[str]]


@pytest.fixture
async def kafka_topic_factory(kafka_bootstrap: str):
    """``await kafka_topic_factory(prefix="test", partitions=3, configs=None) -> topic name``."""
    created: list[str] = []

    async def make(
        prefix: str = "test", partitions: int = 3, configs: Mapping[str, str] | None = None
    ) -> str:
        name = unique_topic(prefix)
        await create_topic(kafka_bootstrap, name, partitions=partitions, configs=configs)
        created.append(name)
        return name

    yield make
    await delete_topics(kafka_bootstrap, created)


def pytest_report_header(config: pytest.Config) -> str:
    existing = os.environ.get(ENV_BOOTSTRAP, "").strip()
    if existing:
        return f"kafka: existing cluster {ENV_BOOTSTRAP}={existing}"
    return "kafka: started on demand (testcontainers if Docker answers, else deploy/kafka/kafka.sh)"
