"""Membership changes through torch's elastic agent, on real torch.distributed (gloo, CPU).

Each "node" is one torchrun agent (`--nproc-per-node 1`) with a c10d rendezvous on a store
hosted by the test (so no node's departure takes the store with it). The workers run
`fleetwise.training.example` (float64 MLP, `ShareSampler`, `allreduce_gradients`,
`TrainingPlugin`) and log the sample ids and per-sample losses of every step; the expected
trajectory is the uninterrupted run's, computed on one process over the same global batches.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fleetwise.actuators import Keyring, sign  # noqa: E402
from fleetwise.schemas import Ack, Command  # noqa: E402
from fleetwise.schemas import topics as T  # noqa: E402
from fleetwise.training import elastic  # noqa: E402
from fleetwise.training.example import read_logs, reference_losses, trajectory  # noqa: E402
from fleetwise.training.transport import LocalTransport  # noqa: E402

KEY_SPEC = "test=elastic-test-secret-0123456789"
KEYS = Keyring.parse(KEY_SPEC)
NUM_SAMPLES = 4096
GLOBAL = 48


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A store, agents by node name, the bus directory and the workers' logs."""

    def __init__(self, tmp: Path, steps: int, shares: str, extra: list[str]) -> None:
        self.tmp = tmp
        self.port = _free_port()
        self.store = elastic.serve_store(self.port)
        self.bus = LocalTransport(tmp / "bus")
        self.log_dir = tmp / "logs"
        self.args = ["--job", "job-e", "--steps", str(steps), "--num-samples", str(NUM_SAMPLES),
                     "--shares", shares, "--bus-dir", str(tmp / "bus"), "--log-dir", str(self.log_dir),
                     "--checkpoint-dir", str(tmp / "ckpt"), "--gloo-timeout", "20", *extra]
        self.agents: dict[str, subprocess.Popen] = {}
        self.acks: list[Ack] = []
        self.seq = 0

    def start(self, node: str) -> None:
        cmd = elastic.agent_command("fleetwise.training.example", self.args, run_id="job-e", nnodes="1:4",
                                    endpoint=f"127.0.0.1:{self.port}", module=True)
        env = elastic.agent_env(FLEETWISE_NODE=node, OMP_NUM_THREADS="1", FLEETWISE_SIGNING_KEYS=KEY_SPEC,
                                LOGLEVEL="INFO")
        out = open(self.tmp / f"agent-{node}.log", "ab")  # noqa: SIM115
        self.agents[node] = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        time.sleep(0.05)  # agents' pids ascend: the rendezvous ranks nodes in that order

    def send(self, **kw) -> Command:
        self.seq += 1
        cmd = sign(Command(ts=time.time(), job="job-e", reason="test", seq=self.seq, **kw), KEYS)
        self.bus.publish(T.COMMANDS_TRAINING.name, "job-e", cmd)
        return cmd

    def rows(self) -> list[dict]:
        return read_logs(self.log_dir) if self.log_dir.exists() else []

    def wait(self, what, timeout: float, why: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.acks.extend(self.bus.poll(T.ACKS.name))
            found = what()
            if found:
                return found
            time.sleep(0.1)
        dead = {n: p.returncode for n, p in self.agents.items() if p.poll() not in (None, 0)}
        acks = [(a.command_id, a.status, a.detail) for a in self.acks]
        raise AssertionError(f"timed out waiting for {why}; acks {acks}; agents ended {dead}; see {self.tmp}")

    def ack(self, cid: str, status: str):
        return next((a for a in self.acks if a.command_id == cid and a.status == status), None)

    def max_step(self, world: int | None = None) -> int:
        steps = [r["step"] for r in self.rows() if world is None or r["world"] == world]
        return max(steps, default=-1)

    def finish(self, timeout: float) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for p in self.agents.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
        codes = {n: p.poll() for n, p in self.agents.items()}
        self.close()
        return codes

    def close(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
        self.acks.extend(self.bus.poll(T.ACKS.name))


def _assert_exact(job: Job, steps: int) -> dict[int, list[int]]:
    losses, ids = trajectory(job.rows())
    assert sorted(ids) == list(range(steps)), f"steps seen {sorted(ids)}"
    expected = reference_losses(steps, NUM_SAMPLES, GLOBAL)
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(got - want) <= 1e-9 * abs(want), f"step {step}: loss {got!r} != uninterrupted {want!r}"
    # No sample skipped or repeated: every step's global batch is exactly the sampler's, and
    # the steps together never see an id twice (4096 samples > steps x 48).
    from fleetwise.training.sampler import ShareSampler

    order = ShareSampler(NUM_SAMPLES, [GLOBAL], 0, seed=0)
    for step in range(steps):
        assert ids[step] == sorted(order.global_indices(step)), f"step {step}: wrong samples"
    every = [i for s in range(steps) for i in ids[s]]
    assert len(every) == len(set(every)) == steps * GLOBAL
    return ids


@pytest.mark.timeout(240)
def test_drain_to_three_ranks_and_resize_back_to_four_keeps_the_trajectory(tmp_path: Path) -> None:
    steps = 36
    job = Job(tmp_path, steps, "12,12,12,12", ["--step-delay", "0.08"])
    try:
        for node in ("n0", "n1", "n2", "n3"):
            job.start(node)
        job.wait(lambda: job.max_step(4) >= 4, 120, "four ranks to train")
        job.send(id="ckpt-1", type="checkpoint", params={"before": "drain"})
        job.send(id="drain-1", type="drain", node="n3", gpu=0, requires=["ckpt-1"],
                         params={"replan": True})
        done = job.wait(lambda: job.ack("drain-1", "done"), 120, "the drain to finish at three ranks")
        assert job.ack("ckpt-1", "done").result["step"] <= job.ack("drain-1", "applied").step
        assert done.result["world_size"] == 3 and done.step == job.ack("drain-1", "applied").step
        drained_at = done.step
        job.wait(lambda: job.max_step(3) >= drained_at + 3, 60, "three ranks to train")
        job.send(id="resize-1", type="resize", params={"world_size": 4, "join": [["n4", 0]]})
        job.wait(lambda: job.ack("resize-1", "applied"), 60, "the resize checkpoint")
        job.start("n4")
        grown = job.wait(lambda: job.ack("resize-1", "done"), 120, "the group to grow back to four")
        assert grown.result["world_size"] == 4
        codes = job.finish(120)
    finally:
        job.close()
    # The drained node's agent was signalled out; the others finished the run.
    assert codes["n3"] not in (None, 0) and all(codes[n] == 0 for n in ("n0", "n1", "n2", "n4")), codes
    rows = job.rows()
    worlds = {r["step"]: r["world"] for r in sorted(rows, key=lambda r: r["t"])}
    assert {worlds[s] for s in range(drained_at)} == {4}
    assert {worlds[s] for s in range(drained_at, grown.step)} == {3}
    assert {worlds[s] for s in range(grown.step, steps)} == {4}
    # Each membership change resumed exactly where its checkpoint was: no step ran twice.
    assert sorted(r["step"] for r in rows if r["world"] == 3) == sorted(
        s for s in range(drained_at, grown.step) for _ in range(3))
    _assert_exact(job, steps)
    assert not [a for a in job.acks if a.status in ("rejected", "failed")]


@pytest.mark.timeout(240)
def test_a_node_killed_with_sigkill_restarts_smaller_from_the_last_checkpoint(tmp_path: Path) -> None:
    steps = 30
    job = Job(tmp_path, steps, "16,16,16", ["--step-delay", "0.08", "--checkpoint-every", "5"])
    try:
        for node in ("n0", "n1", "n2"):
            job.start(node)
        job.wait(lambda: job.max_step(3) >= 12, 120, "three ranks past step 12")
        victim = max((r for r in job.rows() if r["node"] == "n2"), key=lambda r: r["t"])
        killed_at = job.max_step(3)
        os.kill(victim["pid"], signal.SIGKILL)  # the rank ...
        os.kill(job.agents["n2"].pid, signal.SIGKILL)  # ... and its node's agent: the node is gone
        codes = job.finish(180)
    finally:
        job.close()
    assert codes["n2"] == -signal.SIGKILL and codes["n0"] == 0 and codes["n1"] == 0, codes
    rows = job.rows()
    resumed = {r["resumed"] for r in rows if r["world"] == 2}
    assert len(resumed) == 1, resumed
    (restart,) = resumed
    # Restarted from the last complete periodic checkpoint before the kill, at two ranks.
    assert restart % 5 == 0 and killed_at - 5 <= restart <= killed_at + 1, (restart, killed_at)
    assert elastic.read_meta(elastic.checkpoint_dir_for(tmp_path / "ckpt", restart))["world_size"] == 3
    assert max(r["step"] for r in rows if r["world"] == 2) == steps - 1
    _assert_exact(job, steps)


@pytest.mark.timeout(240)
def test_a_migration_stops_the_job_and_the_moved_job_resumes_from_its_snapshot(tmp_path: Path) -> None:
    # The policy's three commands: `snapshot` (the plugin checkpoints into the job's own store,
    # named by the policy, and the job stops), `transfer` (the KAI consumer's: here the test
    # starts the job's agents on two other nodes, a new rendezvous), `restore` (the new group
    # already resumed from the snapshot, its newest checkpoint, so nothing is loaded twice).
    steps = 30
    job = Job(tmp_path, steps, "24,24", ["--step-delay", "0.08"])
    uri = "fleetwise://checkpoints/job-e/migrate-1800000000"
    moved = None
    try:
        for node in ("n0", "n1"):
            job.start(node)
        job.wait(lambda: job.max_step(2) >= 5, 120, "two ranks to train")
        snap = job.send(id="mg-snapshot", type="migrate", params={"phase": "snapshot", "checkpoint_uri": uri})
        taken = job.wait(lambda: job.ack(snap.id, "done"), 60, "the snapshot")
        codes = job.finish(60)
        assert codes == {"n0": 0, "n1": 0}, codes  # the job stopped there, cleanly
        assert taken.result["checkpoint_uri"] == (tmp_path / "ckpt" / "migrate-1800000000").resolve().as_uri()
        job.seq += 1  # the transfer (seq 2) goes to the KAI consumer
        moved = Job(tmp_path, steps, "24,24", ["--step-delay", "0.08"])  # a new rendezvous
        moved.seq = job.seq
        for node in ("m0", "m1"):
            moved.start(node)
        moved.bus.publish(T.ACKS.name, "job-e", Ack(command_id="mg-transfer", ts=time.time(),
                                                     by="kube-consumer", status="done"))
        restore = moved.send(id="mg-restore", type="migrate", requires=["mg-transfer"],
                             params={"phase": "restore", "checkpoint_uri": uri})
        done = moved.wait(lambda: moved.ack(restore.id, "done"), 120, "the restore phase")
        assert f"already resumed from step {taken.result['step']}" in done.detail
        assert moved.finish(120) == {"m0": 0, "m1": 0}
    finally:
        job.close()
        if moved is not None:
            moved.close()
    rows = job.rows()
    assert {r["resumed"] for r in rows if r["node"] in ("m0", "m1")} == {taken.result["step"]}
    assert min(r["step"] for r in rows if r["node"] in ("m0", "m1")) == taken.result["step"]
    _assert_exact(job, steps)
    assert not [a for a in moved.acks + job.acks if a.status in ("rejected", "failed")]


@pytest.mark.timeout(300)
def test_a_pipeline_loses_a_stage_is_re_split_and_grows_a_stage_back(tmp_path: Path) -> None:
    # Three stages of a 6-layer pipeline (2 layers each). The last stage's GPU is drained: the
    # group restarts as two stages (the script's own even split, 3 + 3). The control plane's
    # re-plan for two GPUs (a resize to the same members with new `layers`) moves the boundary
    # in the running group; a growth onto a new node with three stages' boundaries restarts it
    # as three stages on them. A re-plan to data parallelism is refused: a pipeline script cannot
    # change form while it runs. The losses stay the uninterrupted single-process run's.
    steps = 40
    job = Job(tmp_path, steps, "16,16,16", ["--step-delay", "0.08", "--pipeline-layers", "6"])
    pp = lambda n: {"dp": 1, "tp": 1, "pp": n}  # noqa: E731
    try:
        for node in ("n0", "n1", "n2"):
            job.start(node)
        job.wait(lambda: job.max_step(3) >= 4, 120, "three stages to train")
        job.send(id="ckpt-1", type="checkpoint", params={"before": "drain"})
        job.send(id="drain-1", type="drain", node="n2", gpu=0, requires=["ckpt-1"])
        drained = job.wait(lambda: job.ack("drain-1", "done"), 120, "the drain to finish at two stages")
        assert drained.result["world_size"] == 2 and drained.result["layers"] == {"0": [0, 2], "1": [3, 5]}
        job.wait(lambda: job.max_step(2) >= drained.step + 3, 60, "two stages to train")
        job.send(id="replan-1", type="resize", params={
            "world_size": 2, "leave": [["n2", 0]], "strategy": pp(2), "samples": {"0": 48},
            "layers": {"0": [0, 1], "1": [2, 5]}})
        moved = job.wait(lambda: job.ack("replan-1", "done"), 60, "the re-plan's boundaries")
        assert moved.detail == "same members: new layers applied", moved.detail
        assert moved.result["layers"] == {"0": [0, 1], "1": [2, 5]}
        job.send(id="to-dp", type="resize", params={"world_size": 2, "strategy": {"dp": 2, "tp": 1, "pp": 1},
                                                   "samples": {"0": 24, "1": 24}})
        refused = job.wait(lambda: job.ack("to-dp", "failed"), 60, "a re-plan to data parallelism refused")
        assert "cannot change form while it runs" in refused.detail
        job.wait(lambda: job.max_step(2) >= moved.step + 2, 60, "two stages on the new boundaries")
        job.send(id="grow-1", type="resize", params={
            "world_size": 3, "join": [["n3", 0]], "strategy": pp(3), "samples": {"0": 48},
            "layers": {"0": [0, 0], "1": [1, 3], "2": [4, 5]}})
        job.wait(lambda: job.ack("grow-1", "applied"), 60, "the growth's checkpoint")
        job.start("n3")
        grown = job.wait(lambda: job.ack("grow-1", "done"), 120, "three stages again")
        assert grown.result["world_size"] == 3 and grown.result["layers"] == {
            "0": [0, 0], "1": [1, 3], "2": [4, 5]}
        codes = job.finish(120)
    finally:
        job.close()
    assert codes["n2"] not in (None, 0) and all(codes[n] == 0 for n in ("n0", "n1", "n3")), codes
    rows = sorted(job.rows(), key=lambda r: r["t"])
    last = {(r["step"], r["rank"]): (r["world"], r["layers"]) for r in rows}  # each step's final run
    phases = ((0, drained.step, 3, [[0, 1], [2, 3], [4, 5]]), (drained.step, moved.step, 2, [[0, 2], [3, 5]]),
              (moved.step, grown.step, 2, [[0, 1], [2, 5]]), (grown.step, steps, 3, [[0, 0], [1, 3], [4, 5]]))
    for begin, end, world, spans in phases:
        for step in range(begin, end):
            assert [last[step, r] for r in range(world)] == [(world, s) for s in spans], step
    losses, ids = trajectory(rows)
    expected = reference_losses(steps, NUM_SAMPLES, GLOBAL, pipeline_layers=6)
    assert len(losses) == steps and all(len(ids[s]) == GLOBAL for s in range(steps))
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert abs(got - want) <= 1e-9 * abs(want), f"step {step}: loss {got!r} != uninterrupted {want!r}"
    assert {a.command_id for a in job.acks if a.status in ("rejected", "failed")} == {"to-dp"}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
