"""The command lifecycle through the real worker and broker: a fatal XID gives a checkpoint; the
drain comes only after the checkpoint's `done` ack arrives on fleetwise.acks; the resize after
the drain's; every command also reaches the audit topic."""

from __future__ import annotations

import json
import time

import pytest
from test_kube_consumer import cluster  # noqa: F401 - a fixture (nodes on the real API server)
from test_streams_kafka import (  # noqa: F401 - `namespace` is a fixture
    START_TS,
    TICK_S,
    encode,
    namespace,
    node_batches,
    on,
    produce,
)

from fleetwise.actuators import Keyring, sign, verify_command
from fleetwise.schemas import Ack, Command
from fleetwise.schemas import topics as T
from fleetwise.streams.kafka_io import consume_until, produce_records, record_key, topic_name

BAD_GPU = ("node-001", 1)


def xid_batches() -> list[bytes]:
    """Two nodes of a job; node-001/gpu1 reports fatal memory XID 48 from tick 15 on."""
    batches = node_batches(2, 2, 200, seed=1)
    for b in batches:
        for s in b["samples"]:
            s["job"], s["rank"] = "llm", int(s["node"][-1]) * 2 + s["gpu"]
            bad = (s["node"], s["gpu"]) == BAD_GPU and s["ts"] >= START_TS + 15 * TICK_S
            s["metrics"]["DCGM_FI_DEV_XID_ERRORS"] = 48 if bad else 0
    return [encode(b) for b in batches]


async def commands_until(bootstrap: str, prefix: str, want: str, worker, copies: int = 1,
                         timeout_s: float = 90) -> list[Command]:
    """Commands on both command topics, read until `copies` messages of type `want` arrived."""
    topics = [topic_name(T.COMMANDS_TRAINING, prefix), topic_name(T.COMMANDS_KUBE, prefix)]
    try:
        got = await consume_until(
            bootstrap, topics, timeout_s=timeout_s,
            until=lambda ms: worker.check_alive()
            and sum(json.loads(m.value)["type"] == want for m in ms) >= copies)
    except TimeoutError as exc:
        pytest.fail(f"no {want} command: {exc}\n{worker.log_tail()}")
    return [Command.model_validate_json(m.value) for m in got]


class Workers:
    """One or more workers; alive while all are."""

    def __init__(self, workers: list) -> None:
        self.workers = workers

    def check_alive(self) -> bool:
        return all(w.check_alive() for w in self.workers)

    def log_tail(self) -> str:
        return "\n".join(w.log_tail() for w in self.workers)


def wait_until_all_hold_partitions(workers: list) -> None:
    deadline = time.monotonic() + 90
    while True:
        try:
            held = [w.metric("fleetwise_assigned_partitions", topic=T.TELEMETRY_GPU.name) for w in workers]
        except OSError:
            held = [0.0] * len(workers)
        if sum(held) == T.TELEMETRY_GPU.partitions and min(held) > 0:
            return
        assert all(w.check_alive() for w in workers) and time.monotonic() < deadline, held
        time.sleep(0.5)


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("n_workers", [1, 2])
async def test_drain_waits_for_the_checkpoint_ack_and_resize_for_the_drain_ack(
    kafka_bootstrap: str, namespace, n_workers: int,  # noqa: F811 - the fixture imported above
):
    # With two workers the ack lands on whichever acks partition its key gives; every worker
    # reads the acks whole, so the one whose policy sent the checkpoint gets it.
    prefix, new_worker = namespace
    worker = Workers([new_worker().start() for _ in range(n_workers)])
    if n_workers > 1:
        wait_until_all_hold_partitions(worker.workers)
    await produce(kafka_bootstrap, prefix, xid_batches())
    first = await commands_until(kafka_bootstrap, prefix, "checkpoint", worker)
    assert {c.type for c in first} == {"checkpoint"}  # no drain before the checkpoint is acked
    checkpoint = first[0]
    assert (checkpoint.node, checkpoint.gpu) == BAD_GPU and checkpoint.job == "llm" and checkpoint.seq == 1
    assert verify_command(checkpoint, Keyring(), now=checkpoint.ts, job="llm")

    ack = Ack(command_id=checkpoint.id, ts=checkpoint.ts + 20, job="llm", by="training-plugin",
              status="done", step=120, result={"checkpoint_uri": "file:///ckpt/120", "step": 120})
    await produce_records(kafka_bootstrap, topic_name(T.ACKS, prefix), [ack], key=record_key)
    got = await commands_until(kafka_bootstrap, prefix, "drain", worker, copies=2)
    drains = [c for c in got if c.type == "drain"]
    # one drain, on both command topics (the rank leaves; the GPU is cordoned)
    assert {c.id for c in drains} == {drains[0].id} and len(drains) == 2
    drain = drains[0]
    assert drain.requires == [checkpoint.id] and drain.seq == 2 and (drain.node, drain.gpu) == BAD_GPU
    assert sum(1 for c in got if c.type == "checkpoint") == 1  # the alert, still raised, asks nothing new

    done = Ack(command_id=drain.id, ts=drain.ts + 30, job="llm", gpu=1, node="node-001",
               by="kube-consumer", status="done")
    await produce_records(kafka_bootstrap, topic_name(T.ACKS, prefix), [done], key=record_key)
    got = await commands_until(kafka_bootstrap, prefix, "resize", worker, copies=2)
    resize = next(c for c in got if c.type == "resize")
    assert resize.params["leave"] == [list(BAD_GPU)] and resize.requires == [] and resize.seq == 3
    # The audit topic holds the commands as sent and the policy's audit events (no "type").
    audit = await consume_until(kafka_bootstrap, [topic_name(T.AUDIT, prefix)], timeout_s=10,
                                until=lambda ms: len(audited_commands(ms)) >= 3)
    assert [c["type"] for c in audited_commands(audit)][:3] == ["checkpoint", "drain", "resize"], [
        json.loads(m.value) for m in audit]


def audited_commands(messages: list) -> list[dict]:
    return [r for r in (json.loads(m.value) for m in messages) if r["kind"] == "command"]


@pytest.mark.kafka
async def test_a_plan_tombstone_ends_the_job_on_the_worker(kafka_bootstrap: str, namespace):  # noqa: F811
    """The job's owner withdraws its plan (a null value under the job's key on the compacted
    plans topic): the worker audits the end with its reason and drops the job's state."""
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    prefix, new_worker = namespace
    worker = new_worker().start()
    plan = plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=64, job="llm",
                                strategy=(1, 1, 4)), parse_gpu_spec("h100-sxm:4"))
    # The plan, then its tombstone (a null value under the job's key).
    await produce_records(kafka_bootstrap, topic_name(T.PLANS, prefix), [plan, None], key="llm")
    try:
        got = await consume_until(kafka_bootstrap, [topic_name(T.AUDIT, prefix)], timeout_s=60,
                                  until=lambda ms: worker.check_alive() and any(
                                      json.loads(m.value).get("event") == "job_ended" for m in ms))
    except TimeoutError as exc:
        pytest.fail(f"no job_ended audit event: {exc}\n{worker.log_tail()}")
    ended = [json.loads(m.value) for m in got if json.loads(m.value).get("event") == "job_ended"]
    assert len(ended) == 1 and ended[0]["job"] == "llm"
    assert ended[0]["reason"] == "job llm ended (plan withdrawn): its state is dropped"
    deadline = time.monotonic() + 30  # the gauge follows at the next checkpoint
    while worker.metric("fleetwise_policy_jobs_ended") != 1.0:
        assert time.monotonic() < deadline and worker.check_alive(), worker.log_tail()
        time.sleep(0.5)


@pytest.mark.kafka
async def test_the_job_end_verb_writes_the_tombstone(kafka_bootstrap: str):
    """`fleetwise job end JOB --bootstrap` writes what the worker reads as the job's end (a null
    value under the job's key on fleetwise.plans); without --bootstrap it prints the replay line."""
    import asyncio
    import uuid

    from typer.testing import CliRunner

    from fleetwise.cli import app
    from fleetwise.streams.pipeline import ControlPlane

    job = f"job-end-{uuid.uuid4().hex[:8]}"
    printed = CliRunner().invoke(app, ["job", "end", job, "--ts", "2025-12-01T00:00:00Z"])
    assert printed.exit_code == 0, printed.output
    (line,) = printed.output.strip().splitlines()
    (end,) = ControlPlane().decode_obj(None, json.loads(line), source="line 1")
    assert (type(end).__name__, end.job, end.ts) == ("JobEnd", job, 1764547200.0)

    # The verb runs its own event loop: off this test's.
    sent = await asyncio.to_thread(CliRunner().invoke, app,
                                   ["job", "end", job, "--bootstrap", kafka_bootstrap])
    assert sent.exit_code == 0, sent.output
    got = await consume_until(kafka_bootstrap, [T.PLANS.name], timeout_s=60,
                              until=lambda ms: any(m.key == job for m in ms))
    (tomb,) = [m for m in got if m.key == job]
    assert tomb.value is None


def _metric_is(worker, name: str, value: float, **labels: str) -> bool:
    try:
        return worker.metric(name, **labels) == value
    except OSError:  # the metrics endpoint is not up yet
        return False


async def holds_the_job(worker) -> None:
    """Until the worker holds the job's plan and every telemetry partition: inventories and plans
    come on separate topics, and a job's growth is decided by the holder of its state's partition,
    so a node that joins before then is not a capacity event for it."""
    import asyncio

    deadline = time.monotonic() + 60
    all_partitions = float(T.TELEMETRY_GPU.partitions)
    while not (_metric_is(worker, "fleetwise_policy_jobs", 1.0) and _metric_is(
            worker, "fleetwise_assigned_partitions", all_partitions, topic=T.TELEMETRY_GPU.name)):
        assert time.monotonic() < deadline and worker.check_alive(), worker.log_tail()
        await asyncio.sleep(0.5)


@pytest.mark.kafka
async def test_a_job_started_with_its_intent_grows_on_the_worker_when_a_node_joins(
    kafka_bootstrap: str, namespace, tmp_path,  # noqa: F811
):
    """`fleetwise job start --intent ... --bootstrap` puts the job's plan, with its intent's
    max_gpus, on fleetwise.plans; a node joining (its inventory on the broker) makes the worker
    grow the job onto it: one signed resize with the joining GPUs, on both command topics."""
    import asyncio

    from typer.testing import CliRunner

    from fleetwise.cli import app
    from fleetwise.schemas import GpuInventory, NodeInventory

    prefix, new_worker = namespace
    worker = new_worker().start()

    def inventory(node: str, ts: float) -> NodeInventory:
        return NodeInventory(ts=ts, node=node, gpus=[GpuInventory(index=g, model="NVIDIA H100 80GB HBM3")
                                                     for g in range(4)])

    here = tmp_path / "n1.jsonl"
    here.write_text(inventory("n1", START_TS).to_json() + "\n")
    intent = tmp_path / "job.yaml"
    intent.write_text("job: grows\nmodel: llama-7b\nglobal_batch: 64\nconstraints: {max_gpus: 8}\n")
    await produce_records(kafka_bootstrap, topic_name(T.INVENTORY, prefix), [inventory("n1", START_TS)],
                          key=record_key)
    started = await asyncio.to_thread(CliRunner().invoke, app, [
        "job", "start", "--intent", str(intent), "--gpus", str(here), "--bootstrap", kafka_bootstrap,
        "--topic-prefix", prefix])
    assert started.exit_code == 0, started.output
    assert "started job grows (4 GPUs)" in started.output
    await holds_the_job(worker)
    await produce_records(kafka_bootstrap, topic_name(T.INVENTORY, prefix),
                          [inventory("n2", START_TS + 600)], key=record_key)
    got = await commands_until(kafka_bootstrap, prefix, "resize", worker, copies=2)
    grows = [c for c in got if c.type == "resize"]
    assert {c.id for c in grows} == {grows[0].id} and len(grows) == 2  # one command, both topics
    grow = grows[0]
    assert grow.job == "grows" and grow.seq == 1 and grow.ts == START_TS + 600
    assert grow.params["join"] == [["n2", g] for g in range(4)] and grow.params["world_size"] == 8
    assert verify_command(grow, Keyring(), now=grow.ts, job="grows")


@pytest.mark.kafka
async def test_a_growth_decided_by_the_worker_makes_the_job_s_pod_on_the_cluster(
    kafka_bootstrap: str, namespace, cluster, tmp_path,  # noqa: F811 - fixtures imported above
):
    """The acting path whole: a job of bare pods on the API server, started for the control
    plane with its intent; a node's inventory on the broker; the worker's signed resize on
    fleetwise.commands.kube; the KAI consumer makes the job's pod on that node (a copy of its
    pod, held to the node) and grows the gang, and acks done on fleetwise.acks."""
    import asyncio
    import threading

    from typer.testing import CliRunner

    from fleetwise.cli import app
    from fleetwise.kube.consumer import ANN_JOINED_BY, ClientApi, KubeConsumer
    from fleetwise.schemas import GpuInventory, NodeInventory
    from fleetwise.training.transport import KafkaTransport

    prefix, new_worker = namespace
    worker = new_worker().start()
    nodes = cluster.add_nodes(["h100-sxm", "h100-sxm"])
    home, joining = cluster.node_name(0), cluster.node_name(1)
    cluster.deploy("grows-k8s", {home: nodes[home]})

    def inventory(node: str, ts: float) -> NodeInventory:
        return NodeInventory(ts=ts, node=node, gpus=[GpuInventory(index=g, model="NVIDIA H100 80GB HBM3")
                                                     for g in range(8)])

    here = tmp_path / "home.jsonl"
    here.write_text(inventory(home, START_TS).to_json() + "\n")
    intent = tmp_path / "job.yaml"
    intent.write_text("job: grows-k8s\nmodel: llama-7b\nglobal_batch: 64\nconstraints: {max_gpus: 16}\n")
    await produce_records(kafka_bootstrap, topic_name(T.INVENTORY, prefix), [inventory(home, START_TS)],
                          key=record_key)
    started = await asyncio.to_thread(CliRunner().invoke, app, [
        "job", "start", "--intent", str(intent), "--gpus", str(here), "--bootstrap", kafka_bootstrap,
        "--topic-prefix", prefix])
    assert started.exit_code == 0, started.output
    consumer = KubeConsumer(ClientApi(cluster.kube.api_client()), Keyring(), namespace=cluster.ns,
                            clock=lambda: START_TS + 600)  # the command's event time, as wall time live
    transport = KafkaTransport(kafka_bootstrap, prefix=prefix, from_beginning=True)
    stop = threading.Event()
    carrying = threading.Thread(target=consumer.run, args=(transport, stop, 0.1), daemon=True)
    carrying.start()
    try:
        await holds_the_job(worker)
        await produce_records(kafka_bootstrap, topic_name(T.INVENTORY, prefix),
                              [inventory(joining, START_TS + 600)], key=record_key)

        def done(messages: list) -> bool:
            return worker.check_alive() and any(
                m.topic == topic_name(T.ACKS, prefix) and json.loads(m.value)["by"] == "kube-consumer"
                and json.loads(m.value)["status"] in ("done", "failed", "rejected") for m in messages)

        try:
            got = await consume_until(kafka_bootstrap, [topic_name(T.ACKS, prefix)], timeout_s=90, until=done)
        except TimeoutError as exc:
            pytest.fail(f"no kube-consumer ack: {exc}\n{worker.log_tail()}\n{consumer.log[-5:]}")
    finally:
        stop.set()
        await asyncio.to_thread(carrying.join, 10)
        transport.close()
    (ack,) = [json.loads(m.value) for m in got if json.loads(m.value)["by"] == "kube-consumer"
              and json.loads(m.value)["status"] != "received"]
    assert ack["status"] == "done", ack
    pods = cluster.pods("grows-k8s")
    (new,) = [p for p in pods.values()
              if (p.metadata.annotations or {}).get(ANN_JOINED_BY) == ack["command_id"]]
    required = new.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    assert {e.key: e.values for e in required.node_selector_terms[0].match_expressions}[
        "kubernetes.io/hostname"] == [joining]
    assert cluster.pod_group("grows-k8s")["spec"]["minMember"] == 2


@pytest.mark.kafka
async def test_an_approval_acts_only_when_signed_under_the_operators_key(
    kafka_bootstrap: str, namespace, tmp_path,  # noqa: F811
):
    """With failures held for approval: an approval signed under a key the worker does not hold
    is refused (an `operator_rejected` audit event with the reason, no command); the same
    approval under the operators' key releases the held checkpoint."""
    from fleetwise.actuators import operator_keyring, sign
    from fleetwise.schemas import OperatorAction

    ops = "ops-1=the-operators-secret-0123456789"
    policy = tmp_path / "policy.yaml"
    policy.write_text("failure: {mode: approve}\n")
    prefix, new_worker = namespace
    worker = new_worker("--policy", str(policy), env={"FLEETWISE_OPERATOR_KEYS": ops})
    worker.start()
    await produce(kafka_bootstrap, prefix, xid_batches())

    def audit_events(ms) -> list[dict]:
        records = [json.loads(m.value) for m in on(T.AUDIT, prefix, ms)]
        return [r for r in records if r.get("kind") == "audit"]

    async def audit_until(event: str) -> dict:
        try:
            got = await consume_until(kafka_bootstrap, [topic_name(T.AUDIT, prefix)], timeout_s=90,
                                      until=lambda ms: worker.check_alive()
                                      and any(e["event"] == event for e in audit_events(ms)))
        except TimeoutError as exc:
            pytest.fail(f"no {event} audit event: {exc}\n{worker.log_tail()}")
        return next(e for e in audit_events(got) if e["event"] == event)

    held = await audit_until("awaiting_approval")
    approve = OperatorAction(ts=START_TS + 3600, action="approve", command_id=held["command_id"], by="ops")
    wrong = sign(approve, operator_keyring())  # the development operator key: not this fleet's
    await produce_records(kafka_bootstrap, topic_name(T.OPERATOR, prefix), [wrong], key=record_key)
    refused = await audit_until("operator_rejected")
    assert refused["command_id"] == held["command_id"]
    assert "unknown key id 'dev-operator'" in refused["reason"]

    # The real verb, with this fleet's operator key and topic prefix (off this test's event loop).
    import asyncio

    from typer.testing import CliRunner

    from fleetwise.cli import app

    verb = ["approve", held["command_id"], "--bootstrap", kafka_bootstrap, "--by", "ops",
            "--ts", str(START_TS + 3600)]
    sent = await asyncio.to_thread(CliRunner().invoke, app, verb,
                                   env={"FLEETWISE_OPERATOR_KEYS": ops, "FLEETWISE_TOPIC_PREFIX": prefix})
    assert sent.exit_code == 0 and topic_name(T.OPERATOR, prefix) in sent.output, sent.output
    got = await commands_until(kafka_bootstrap, prefix, "checkpoint", worker)
    assert [c.id for c in got if c.type == "checkpoint"] == [held["command_id"]]
    assert verify_command(got[0], Keyring(), now=got[0].ts, job="llm")


@pytest.mark.kafka
@pytest.mark.slow
async def test_two_workers_keep_one_fleet_drain_cap_by_reading_each_others_commands(
    kafka_bootstrap: str, namespace, tmp_path,  # noqa: F811 - the fixture imported above
):
    """Fleet cap 1, two workers holding half the partitions each. node-000/gpu1's fatal XID is
    drained by whichever worker holds its partition; the other reads that drain on the command
    topics, so the same XID on 15 more nodes (all 8 partitions, so both workers') is held back
    by the cap on both, not drained once more by the worker that sent nothing."""
    prefix, new_worker = namespace
    policy = tmp_path / "policy.yaml"
    # the breaker and the staleness rail stay out of the way: this is about the cap
    policy.write_text("rails: {max_drained_gpus_fleet: 1, breaker_drains: 100, stale_after_s: 86400}\n")
    workers = [new_worker("--policy", str(policy)).start() for _ in range(2)]
    wait_until_all_hold_partitions(workers)
    both = Workers(workers)
    batches = node_batches(16, 2, 140, seed=3)  # 10 s ticks: every GPU closes a hop after tick 15
    for b in batches:
        for s in b["samples"]:
            fatal = s["gpu"] == 1 and s["ts"] >= START_TS + 15 * TICK_S
            s["metrics"]["DCGM_FI_DEV_XID_ERRORS"] = 48 if fatal else 0
    await produce(kafka_bootstrap, prefix, [encode(b) for b in batches if b["node"] == "node-000"])
    first = await commands_until(kafka_bootstrap, prefix, "drain", both)
    assert [(c.node, c.gpu) for c in first if c.type == "drain"] == [("node-000", 1)]
    deadline = time.monotonic() + 60  # the worker that did not send it has read it
    while sum(w.metric("fleetwise_peer_drains") for w in workers) != 1.0:
        assert time.monotonic() < deadline and both.check_alive(), both.log_tail()
        time.sleep(0.5)

    await produce(kafka_bootstrap, prefix, [encode(b) for b in batches if b["node"] != "node-000"])
    try:
        got = await consume_until(
            kafka_bootstrap, [topic_name(T.AUDIT, prefix)], timeout_s=90,
            until=lambda ms: both.check_alive() and sum(
                json.loads(m.value).get("event") == "fleet_drain_cap" for m in ms) >= 15)
    except TimeoutError as exc:
        seen = [(a.get("event") or a.get("type"), a.get("node"), a.get("gpu"), a.get("reason"))
                for a in (json.loads(m.value) for m in exc.messages)]
        pytest.fail(f"not every later XID was held back by the fleet cap: {exc}\n{seen}\n{both.log_tail()}")
    held = {json.loads(m.value)["node"] for m in got if json.loads(m.value).get("event") == "fleet_drain_cap"}
    assert held == {f"node-{n:03d}" for n in range(1, 16)}
    sent = await consume_until(kafka_bootstrap, [topic_name(T.COMMANDS_KUBE, prefix)], timeout_s=10, idle_s=3)
    assert [(c["node"], c["type"]) for c in (json.loads(m.value) for m in sent)] == [("node-000", "drain")]


@pytest.mark.kafka
@pytest.mark.slow
async def test_two_workers_and_the_kube_consumer_never_drain_past_the_fleet_cap_on_the_cluster(
    kafka_bootstrap: str, namespace, cluster, tmp_path,  # noqa: F811 - fixtures imported above
):
    """End to end, with a race the workers' own count cannot always see: fleet cap 1, two
    workers holding half the partitions each, the same fatal XID on every GPU 1 of 16 nodes at
    once (so each worker may decide a drain before it has read the other's), and the kube
    consumer carrying out drains on the API server. However many drains the workers send, the
    cluster ends with exactly one GPU drained: one drain `done`, any other `rejected` by the
    consumer's count of the cluster; every other XID is held back by the workers' cap; a late
    drain from another sender is refused by the consumer too."""
    import asyncio
    import threading

    from fleetwise.actuators.config import Rails
    from fleetwise.kube.consumer import ClientApi, KubeConsumer, count_drained
    from fleetwise.training.transport import KafkaTransport

    prefix, new_worker = namespace
    policy = tmp_path / "policy.yaml"
    policy.write_text("rails: {max_drained_gpus_fleet: 1, breaker_drains: 100, stale_after_s: 86400}\n")
    workers = [new_worker("--policy", str(policy)).start() for _ in range(2)]
    nodes = list(cluster.add_nodes(["h100-sxm"] * 16))
    # The consumer judges expiry by its clock: the recording's end, as wall time would be live.
    consumer = KubeConsumer(ClientApi(cluster.kube.api_client()), Keyring(), namespace=cluster.ns,
                            rails=Rails(max_drained_gpus_fleet=1), clock=lambda: START_TS + 140 * TICK_S)
    transport = KafkaTransport(kafka_bootstrap, prefix=prefix, from_beginning=True)
    stop = threading.Event()
    carrying = threading.Thread(target=consumer.run, args=(transport, stop, 0.1), daemon=True)
    carrying.start()
    try:
        wait_until_all_hold_partitions(workers)
        both = Workers(workers)
        batches = node_batches(16, 2, 140, seed=3)
        for b in batches:
            b["node"] = nodes[int(b["node"][-3:])]
            for s in b["samples"]:
                s["node"] = b["node"]
                fatal = s["gpu"] == 1 and s["ts"] >= START_TS + 15 * TICK_S
                s["metrics"]["DCGM_FI_DEV_XID_ERRORS"] = 48 if fatal else 0
        await produce(kafka_bootstrap, prefix, [encode(b) for b in batches])

        def settled(messages: list) -> bool:
            drains, finals, held = set(), set(), set()
            for m in messages:
                record = json.loads(m.value)
                if m.topic == topic_name(T.COMMANDS_KUBE, prefix) and record["type"] == "drain":
                    drains.add(record["id"])
                elif m.topic == topic_name(T.ACKS, prefix) and record["by"] == "kube-consumer" \
                        and record["status"] in ("done", "rejected", "failed"):
                    finals.add(record["command_id"])
                elif m.topic == topic_name(T.AUDIT, prefix) and record.get("event") == "fleet_drain_cap":
                    held.add(record["node"])
            return both.check_alive() and bool(drains) and drains <= finals and len(held) + len(drains) >= 16

        topics = [topic_name(t, prefix) for t in (T.COMMANDS_KUBE, T.ACKS, T.AUDIT)]
        try:
            got = await consume_until(kafka_bootstrap, topics, timeout_s=120, until=settled)
        except TimeoutError as exc:
            pytest.fail(f"the drains did not settle: {exc}\n{both.log_tail()}")
        # Whether the workers raced or not, one more drain from a sender that has not read the
        # others (a third worker, say) reaches the consumer, which counts the cluster and refuses it.
        late = sign(Command(id="drain-late-sender", type="drain", ts=START_TS + 100 * TICK_S, node=nodes[15],
                            gpu=0, reason="a worker that had not read the others' drains",
                            expires_ts=START_TS + 100 * TICK_S + 3600), Keyring())
        transport.publish(T.COMMANDS_KUBE.name, nodes[15], late)
        answer = await consume_until(
            kafka_bootstrap, [topic_name(T.ACKS, prefix)], timeout_s=60,
            until=lambda ms: any(json.loads(m.value)["command_id"] == late.id
                                 and json.loads(m.value)["status"] != "received" for m in ms))
    finally:
        stop.set()
        await asyncio.to_thread(carrying.join, 10)
        transport.close()
    records = [(m.topic, json.loads(m.value)) for m in got]
    drains = [r for t, r in records if t == topic_name(T.COMMANDS_KUBE, prefix) and r["type"] == "drain"]
    acks = {r["command_id"]: r for t, r in records
            if t == topic_name(T.ACKS, prefix) and r["by"] == "kube-consumer" and r["status"] != "received"}
    statuses = sorted(acks[d["id"]]["status"] for d in drains)
    details = [acks[d["id"]].get("detail") for d in drains]
    assert statuses == ["done"] + ["rejected"] * (len(drains) - 1), details
    refused = [acks[d["id"]] for d in drains if acks[d["id"]]["status"] == "rejected"]
    assert all("fleet drain cap" in a["detail"] for a in refused), refused
    (late_ack,) = [a for a in map(json.loads, (m.value for m in answer))
                   if a["command_id"] == late.id and a["status"] != "received"]
    assert late_ack["status"] == "rejected" and late_ack["detail"].startswith(
        "fleet drain cap: 1 of 128 GPUs on the cluster are drained (cap 1)"), late_ack
    on_cluster = [{"annotations": cluster.node(n).metadata.annotations or {}, "gpus": 8} for n in nodes]
    assert count_drained(on_cluster) == (1, 128)  # one GPU out, whichever worker's drain it was
    print(f"drain commands the workers sent: {len(drains)} (2: both decided before reading the other's)")
