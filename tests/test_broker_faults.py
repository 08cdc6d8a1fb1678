"""Integration: the broker itself dies mid-stream (SIGKILL) and comes back on the same log dirs.

Each test starts its own broker (`OwnBroker`: `deploy/kafka/kafka.sh start DIR` in a state
dir of its own, never the session broker other tests share), kills the JVM with SIGKILL while
node agents (`BatchPublisher`, one per node, real) collect and publish and a worker
(`fleetwise worker`, subprocess) consumes, keeps it down longer than the agents' buffers can
hide, and restarts it on the same `server.properties` (same ports, same log dirs).

What is asserted is data, not liveness:
- every batch an agent offered was either acknowledged by the broker or dropped from its
  full buffer, and the drops are exactly what its drop counter (and metric) says;
- the telemetry topic holds only offered batches, and every acknowledged one;
- every sample in the topic is counted exactly once in the features: per GPU-hop, the
  feature record's `samples` equals the distinct (node, gpu, ts) of the topic in that hop
  (resent duplicates are not counted twice, nothing acknowledged is missing);
- the features and decisions (predictions) equal the embedded runtime's over the same
  acknowledged records, i.e. a run without the fault.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest

from fleetwise.agent import BatchPublisher
from fleetwise.agent.publisher import Outgoing
from fleetwise.schemas import NodeBatch
from fleetwise.schemas import topics as T
from fleetwise.streams.kafka_io import consume_until, ensure_topics, topic_name
from tests.kafka_broker import KAFKA_SH, metadata_ok
from tests.test_streams_kafka import (
    Worker,
    as_set,
    differences,
    embedded_outputs,
    ids,
    node_batches,
    record_id,
    wait_for_metric,
)

HOP_S = 600.0


class OwnBroker:
    """A broker of the test's own: `kafka.sh start DIR`, SIGKILL, restart on the same config
    and log dirs (the JVM command `kafka.sh start` uses), `kafka.sh stop DIR` at the end."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.bootstrap = ""
        self.env = dict(os.environ, KAFKA_WATCH_PID=str(os.getpid()))
        self.restarted: subprocess.Popen | None = None  # our child after a restart: we reap it

    def _sh(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(KAFKA_SH), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def start(self) -> OwnBroker:
        proc = self._sh("start", str(self.dir))
        if proc.returncode != 0:
            pytest.fail(f"kafka.sh start {self.dir} failed:\n{proc.stderr}")
        self.bootstrap = proc.stdout.strip().splitlines()[-1].strip()
        return self

    @property
    def pid(self) -> int:
        return int((self.dir / "kafka.pid").read_text())

    def kill(self) -> None:
        """SIGKILL the broker JVM (no shutdown hook, no clean log close) and wait until gone."""
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists():
            try:
                if "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]:
                    break  # a zombie: dead, not yet reaped by its (detached) parent
            except OSError:
                break
            assert time.monotonic() < deadline, f"broker {pid} survived SIGKILL"
            time.sleep(0.05)

    def restart(self, timeout_s: float = 120) -> None:
        """Start the broker again on the same server.properties: same ports, same log dirs,
        so it recovers its logs after the unclean shutdown. Same JVM command as kafka.sh."""
        libs = self._sh("fetch").stdout.strip().splitlines()[-1]
        heap = os.environ.get("KAFKA_HEAP_OPTS", "-Xms128m -Xmx512m").split()
        cmd = [
            "setsid",
            "java",
            *heap,
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-XX:+ExitOnOutOfMemoryError",
            "-XX:CICompilerCount=2",
            "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.dir}/logs",
            f"-Dlog4j.configuration=file:{self.dir}/log4j.properties",
            f"-Dlog4j2.configurationFile={self.dir}/log4j2.properties",
            "-cp",
            f"{libs}/*",
            "kafka.Kafka",
            str(self.dir / "server.properties"),
        ]
        with open(self.dir / "kafka.log", "ab") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=False
            )
        self.restarted = proc
        (self.dir / "kafka.pid").write_text(f"{proc.pid}\n")
        self._watch(proc.pid)
        deadline = time.monotonic() + timeout_s
        while not metadata_ok(self.bootstrap, timeout_s=2):
            assert proc.poll() is None, f"restarted broker exited:\n{self.log_tail()}"
            assert time.monotonic() < deadline, f"restarted broker did not answer:\n{self.log_tail()}"
            time.sleep(0.3)

    def _watch(self, pid: int) -> None:
        """kafka.sh's watchdog, for the restarted JVM (the first one's left with that JVM):
        the broker is stopped when this test process exits, even if it crashes."""
        watchdog = subprocess.Popen(
            ["setsid", "bash", "-c",
             'while kill -0 "$1" 2>/dev/null && kill -0 "$2" 2>/dev/null; do sleep 2; done; '
             'if kill -0 "$2" 2>/dev/null; then kill -TERM "$2"; sleep 5; kill -KILL "$2" 2>/dev/null; fi',
             "watchdog", str(os.getpid()), str(pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        (self.dir / "watchdog.pid").write_text(f"{watchdog.pid}\n")

    def stop(self) -> None:
        """Stop the broker and remove its dir. A restarted broker is this process's child: it
        is stopped and reaped here (kafka.sh would see its zombie as alive for 30 s)."""
        proc, self.restarted = self.restarted, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._sh("stop", str(self.dir), timeout=120)

    def log_tail(self, n: int = 40) -> str:
        lines = (self.dir / "kafka.log").read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])


@pytest.fixture
def own_broker(tmp_path: Path):
    broker = OwnBroker(tmp_path / "kafka").start()
    yield broker
    broker.stop()


class RecordingPublisher(BatchPublisher):
    """The agent's publisher, recording which batches the broker acknowledged and which its
    buffer dropped (for the test's bookkeeping only; behaviour unchanged)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.acked: list[Outgoing] = []
        self.dropped_items: list[Outgoing] = []
        self.buffer._on_drop = self._record_drop
        # The metric is process-wide, labelled by agent name: another test's agents of the same
        # name (an earlier scenario in this pytest run) have counted into it already.
        self.dropped_metric_at_start = self._dropped_metric._value.get()

    def _record_drop(self, item: Outgoing) -> None:
        self.dropped_items.append(item)
        self._on_drop(item)

    async def _send(self, items: list[Outgoing]) -> list[Outgoing]:
        failed = await super()._send(items)
        failed_ids = {id(i) for i in failed}
        self.acked.extend(i for i in items if id(i) not in failed_ids and i.topic == self.telemetry_topic)
        return failed


class Phases:
    """When each step of a scenario ended (seconds since the start), printed at the end: where
    the time goes on a slow machine, and what a failure got to."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.lines: list[str] = []

    def mark(self, what: str) -> None:
        self.lines.append(f"{time.monotonic() - self.t0:7.1f} s  {what}")

    def note(self, what: str) -> None:
        self.lines.append(f"{'':9}  {what}")

    def __str__(self) -> str:
        return "\n".join(["scenario phases:", *self.lines])


# What a joining worker's log says when it reaches a step of the rebalance (aiokafka's lines).
JOIN_STEPS = {"join": "(Re-)joining group", "assigned": "Successfully synced group"}


def join_state(log: str) -> str:
    """How far a joining worker's log says it got into the group (for the scenario's report)."""
    if "Recovery complete" in log:
        return "assigned and recovered (the rebalance was over)"
    if "Successfully synced group" in log:
        return "assigned, recovering its partitions' state (mid-rebalance)"
    return "JoinGroup sent, not yet assigned (mid-rebalance)"


def batch_id(raw: bytes) -> tuple[str, float]:
    d = json.loads(raw)
    return d["node"], d["ts"]


async def run_agents(
    bootstrap: str,
    prefix: str,
    batches: list[dict],
    nodes: int,
    *,
    tick_s: float,
    max_buffer: int,
    at_tick: dict[int, Callable[[], None]],
    hold_at: dict[int, Callable[[], None]] | None = None,
) -> list[RecordingPublisher]:
    """One publisher per node, offering its batch of each tick every `tick_s` of wall time
    (collection never waits for the broker); `at_tick[k]` (a blocking callable) runs in a
    thread when tick k is reached, so collection goes on meanwhile. `hold_at[k]` (blocking)
    runs before tick k and the ticks wait for it (the test's set-up, e.g. a worker starting,
    not the broker: the publishers keep sending what they hold). Waits for delivery."""
    pubs = [
        RecordingPublisher(
            bootstrap,
            agent=f"fault-node-{n:03d}",
            max_buffer=max_buffer,
            topic_prefix=prefix,
            backoff_initial_s=0.1,
            backoff_max_s=0.5,
            request_timeout_ms=3000,
        )
        for n in range(nodes)
    ]
    for p in pubs:
        await p.start()
    loop = asyncio.get_running_loop()
    actions = []
    t0 = loop.time()
    for k in range(len(batches) // nodes):
        if k in (hold_at or {}):
            held = loop.time()
            await loop.run_in_executor(None, hold_at[k])
            t0 += loop.time() - held  # the ticks resume where they stopped
        if k in at_tick:
            actions.append(loop.run_in_executor(None, at_tick[k]))
        for n in range(nodes):
            pubs[n].offer(NodeBatch.model_validate(batches[k * nodes + n]))
        await asyncio.sleep(max(0.0, t0 + (k + 1) * tick_s - loop.time()))
    await asyncio.gather(*actions)
    for p in pubs:
        assert await p.wait_delivered(90), f"{p.agent}: {p.depth} batches never delivered"
        await p.stop(5)
    return pubs


def check_agent_accounting(
    pubs: list[RecordingPublisher], batches: list[dict], topic_ids: list[tuple]
) -> int:
    """Every offered batch acknowledged or dropped; drops == the counter; the topic holds
    every acknowledged batch and nothing that was not offered. Returns the drops."""
    from fleetwise.agent import metrics

    offered = {(b["node"], b["ts"]) for b in batches}
    in_topic = set(topic_ids)
    total_dropped = 0
    for p in pubs:
        acked = {batch_id(i.value) for i in p.acked}
        dropped = [batch_id(i.value) for i in p.dropped_items]
        mine = {b for b in offered if b[0] == p.agent.removeprefix("fault-")}
        counted = metrics.AGENT_DROPPED.labels(node=p.agent)._value.get() - p.dropped_metric_at_start
        assert len(dropped) == p.stats.dropped == counted, (p.agent, len(dropped), p.stats.dropped, counted)
        assert len(set(dropped)) == len(dropped), "a batch dropped twice"
        assert acked | set(dropped) == mine, f"{p.agent}: offered batches neither acked nor dropped"
        assert acked <= in_topic, f"{p.agent}: acknowledged batches missing from the topic"
        total_dropped += len(dropped)
    assert in_topic <= offered, "the topic holds batches nobody offered"
    return total_dropped


def check_samples_counted_once(features: list[dict], telemetry: list[bytes]) -> None:
    """Per GPU-hop: the feature's `samples` == distinct (node, gpu, ts) of the topic in that hop,
    and every GPU's closed hops cover all its samples before its last hop end."""
    samples: dict[str, set[float]] = defaultdict(set)
    for raw in telemetry:
        for s in json.loads(raw)["samples"]:
            samples[f"{s['node']}/{s['gpu']}"].add(s["ts"])
    by_gpu: dict[str, list[dict]] = defaultdict(list)
    for f in features:
        if f.get("scope") == "gpu":
            by_gpu[f"{f['node']}/{f['gpu']}"].append(f)
    assert by_gpu, "no GPU features"
    for key, fs in by_gpu.items():
        ts = samples[key]
        for f in fs:
            want = sum(1 for t in ts if f["ts"] - HOP_S <= t < f["ts"])
            assert f["values"]["samples"] == want, (key, f["ts"], f["values"]["samples"], want)
        last = max(f["ts"] for f in fs)
        counted = sum(f["values"]["samples"] for f in fs)
        assert counted == sum(1 for t in ts if t < last), f"{key}: samples before {last} not all counted once"


async def read_all(bootstrap: str, topic: str, at_least: int, timeout_s: float = 60):
    return await consume_until(bootstrap, [topic], until=lambda ms: len(ms) >= at_least, timeout_s=timeout_s)


async def fault_scenario(
    broker: OwnBroker,
    tmp_path: Path,
    *,
    nodes: int,
    ticks: int,
    kill_at: int,
    down_s: float,
    workers: int = 1,
    rebalance: str = "",
) -> None:
    phases = Phases()
    tag = uuid.uuid4().hex[:8]
    prefix = f"f{tag}."
    await ensure_topics(broker.bootstrap, prefix=prefix)
    pool: list[Worker] = []

    def new_worker() -> Worker:
        w = Worker(broker.bootstrap, prefix, f"fw-fault-{tag}", tmp_path / f"worker{len(pool)}.log")
        pool.append(w)
        return w.start()

    try:
        for _ in range(workers):
            new_worker()
        wait_for_metric(pool[-1], "fleetwise_assigned_partitions", 1, topic=T.TELEMETRY_GPU.name)
        phases.mark("worker assigned")
        batches = node_batches(nodes=nodes, gpus=4, ticks=ticks, seed=41)

        def joiner_in_the_join() -> None:
            """A second worker starts, and this returns once its log shows the rebalance step
            `rebalance` names (JOIN_STEPS): "join", its JoinGroup sent (the first worker learns
            at its next heartbeat, 1 s at most, then revokes and rejoins), or "assigned", its
            partitions assigned and their state being recovered. The kill follows at once.
            Waiting for the step, not a fixed sleep: a worker that cannot reach the broker at
            start exits (fail fast), and its start takes seconds on a loaded machine."""
            joiner = new_worker()
            deadline = time.monotonic() + 120
            while JOIN_STEPS[rebalance] not in joiner.log_path.read_text(errors="replace"):
                assert joiner.check_alive() and time.monotonic() < deadline, f"no {rebalance!r} in 120 s"
                time.sleep(0.02)
            phases.mark(f"second worker at {rebalance!r}")

        def outage() -> None:
            if rebalance:
                state = join_state(pool[-1].log_path.read_text(errors="replace"))
                phases.note(f"the joiner when the broker died: {state}")
            broker.kill()
            phases.mark("broker killed")
            time.sleep(down_s)
            broker.restart()
            phases.mark("broker restarted")

        pubs = await run_agents(
            broker.bootstrap, prefix, batches, nodes, tick_s=0.05, max_buffer=30, at_tick={kill_at: outage},
            hold_at={kill_at: joiner_in_the_join} if rebalance else None,
        )
        phases.mark("agents delivered")
        telemetry_topic = topic_name(T.TELEMETRY_GPU, prefix)
        acked = sum(len(p.acked) for p in pubs)
        msgs = await consume_until(broker.bootstrap, [telemetry_topic], idle_s=3, timeout_s=60)
        telemetry = [m.value for m in msgs]
        dropped = check_agent_accounting(pubs, batches, [batch_id(v) for v in telemetry])
        assert dropped > 0, "the outage was meant to overflow the agents' buffers"
        assert len({batch_id(v) for v in telemetry}) >= acked - dropped

        expected = embedded_outputs(telemetry)  # the same acknowledged records, no fault
        want_f, want_p = expected[T.FEATURES.name], expected.get(T.PREDICTIONS.name, set())
        names = [topic_name(t, prefix) for t in (T.FEATURES, T.PREDICTIONS)]
        from tests.test_streams_kafka import explain_missing

        try:
            got = await consume_until(
                broker.bootstrap,
                names,
                timeout_s=120,
                until=lambda ms: (
                    all(w.check_alive() for w in pool) and len(ids(ms)) >= len(want_f) + len(want_p)
                ),
            )
        except TimeoutError as exc:
            pytest.fail(
                f"{exc}\n{explain_missing(getattr(exc, 'messages', []), want_f, pool)}\n"
                f"broker:\n{broker.log_tail(15)}"
            )
        got += await consume_until(broker.bootstrap, names, timeout_s=2, from_beginning=False)
        features = [m for m in got if m.topic == names[0]]
        predictions = [m for m in got if m.topic == names[1]]
        phases.mark("outputs read")
        assert not differences(as_set(features), want_f), differences(as_set(features), want_f)
        assert not differences(as_set(predictions), want_p), differences(as_set(predictions), want_p)
        # Re-emits count once: one record per id (key and hop end). A feature re-emitted after a
        # restart matches the first within float noise (sums regrouped: `differences` checked
        # that above), so keying by the exact JSON text counted such a hop twice.
        unique = {record_id(m.json()): m.json() for m in features}
        check_samples_counted_once(list(unique.values()), telemetry)
        phases.mark(f"checked: {len(telemetry)} batches in the topic, {dropped} dropped, "
                    f"{len(want_f)} features, {len(want_p)} predictions")
    finally:
        for w in pool:
            w.stop(signal.SIGKILL)
        print(phases)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_broker_sigkilled_and_restarted_mid_stream_loses_nothing_acknowledged(
    own_broker: OwnBroker, tmp_path: Path
) -> None:
    # 4 nodes x 150 ticks of 10 s event time (2 closed hops), one tick per 50 ms; the broker
    # dies at tick 40 and is down ~4 s + its restart: > 30 batches per agent, the buffer.
    await fault_scenario(own_broker, tmp_path, nodes=4, ticks=150, kill_at=40, down_s=4.0)


@pytest.mark.kafka
@pytest.mark.stress
@pytest.mark.timeout(600)
@pytest.mark.parametrize("step", sorted(JOIN_STEPS))
async def test_broker_restart_during_a_worker_rebalance_loses_nothing_acknowledged(
    own_broker: OwnBroker, tmp_path: Path, step: str
) -> None:
    # 16 nodes; a second worker joins and the broker dies right after its JoinGroup, or right
    # after it was assigned partitions (while it recovers their state from the changelog).
    await fault_scenario(own_broker, tmp_path, nodes=16, ticks=150, kill_at=40, down_s=4.0, rebalance=step)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_broker_killed_while_a_second_worker_joins_loses_nothing_acknowledged(
    own_broker: OwnBroker, tmp_path: Path
) -> None:
    # The short rebalance variant for `make test`: 4 nodes; the kill follows the second
    # worker's JoinGroup at once (see fault_scenario's joiner_in_the_join).
    await fault_scenario(own_broker, tmp_path, nodes=4, ticks=150, kill_at=40, down_s=4.0, rebalance="join")
