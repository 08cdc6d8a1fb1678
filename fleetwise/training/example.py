"""A small, complete training script with the plugin: the reference for docs, tests, bench, demo.

An MLP (float64 by default) regresses synthetic data; each rank takes its share of every global
batch from a `ShareSampler`, gradients combine as the global-batch mean (`allreduce_gradients`),
and a `TrainingPlugin` reports step records and applies commands. Run under torchrun (one
process per node: `fleetwise.training.elastic.agent_command`) or with `launch` below.

Each rank appends one JSON line per step to `--log-dir/rank-<node>.jsonl`: step, world size,
rank, the sample ids it processed, the sum of its per-sample losses and its step time, so a test
can rebuild the loss trajectory and check that no sample was skipped or repeated.

`--slow NODE:FACTOR[@STEP]` emulates an older or throttled GPU: the node's compute takes
`--sample-time x samples x FACTOR` seconds (a sleep proportional to its samples) from STEP on.

`--pipeline-layers N` runs a pipeline instead: one stage per rank (no data parallelism), the
model's N layers split over the stages (`--stage-layers 0-1,2-3`, else as even as possible),
activations and their gradients sent between neighbouring stages, one micro-batch of the whole
global batch per step. The plugin gets the stage, its layers and a `rebuild` callback, so a
`rebalance` with new `layers` moves stage boundaries in the running job. Layer i's parameters
are `layers.i.*` in every stage, so a checkpoint loads under any split.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["launch", "make_data", "make_model", "make_stage", "read_logs", "reference_losses", "run_job",
           "trajectory"]


def make_model(dim: int = 8, hidden: int = 16, seed: int = 0, dtype: str = "float64") -> Any:
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))
    return model.to(getattr(torch, dtype))


def make_stage(first: int, last: int, num_layers: int, dim: int = 8, seed: int = 0,
               dtype: str = "float64") -> Any:
    """Layers `first`..`last` (inclusive) of an MLP of `num_layers` (dim -> dim with tanh, the
    last dim -> 1): every layer is drawn in order from `seed`, so any split of the model holds
    the same initial weights as the whole."""
    import torch

    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            every = [torch.nn.Linear(dim, 1 if i == num_layers - 1 else dim) for i in range(num_layers)]
            self.layers = torch.nn.ModuleDict({str(i): every[i] for i in range(first, last + 1)})

        def forward(self, x: Any) -> Any:
            for i in range(first, last + 1):
                x = self.layers[str(i)](x)
                if i < num_layers - 1:
                    x = torch.tanh(x)
            return x

    return Stage().to(getattr(torch, dtype))


def make_data(num_samples: int, dim: int = 8, seed: int = 1, dtype: str = "float64") -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, dim, generator=g, dtype=torch.float64)
    noise = torch.randn(num_samples, 1, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(dim=1, keepdim=True)) + 0.1 * noise
    return x.to(getattr(torch, dtype)), y.to(getattr(torch, dtype))


def _optimizer(model: Any, lr: float) -> Any:
    import torch

    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def reference_losses(steps: int, num_samples: int, global_batch: int, *, seed: int = 0, lr: float = 0.05,
                     dim: int = 8, hidden: int = 16, pipeline_layers: int = 0) -> list[float]:
    """The uninterrupted run on one process: each step's global batch (the sampler's global
    order) as one batch. Any split of it over any number of ranks gives these losses (with
    `pipeline_layers`, the pipeline's model whole: any split into stages gives them too)."""
    import torch

    from fleetwise.training.sampler import ShareSampler

    model = (make_stage(0, pipeline_layers - 1, pipeline_layers, dim, seed) if pipeline_layers
             else make_model(dim, hidden, seed))
    opt = _optimizer(model, lr)
    x, y = make_data(num_samples, dim)
    order = ShareSampler(num_samples, [global_batch], 0, seed=seed)
    out = []
    for step in range(steps):
        ids = order.global_indices(step)
        loss = torch.nn.functional.mse_loss(model(x[ids]), y[ids])
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def _slow_factor(specs: Sequence[str], node: str, step: int) -> float:
    factor = 1.0
    for spec in specs:
        who, _, rest = spec.partition(":")
        value, _, start = rest.partition("@")
        if who == node and step >= int(start or 0):
            factor = float(value)
    return factor


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--job", default="example")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--num-samples", type=int, default=4096)
    p.add_argument("--shares", default="16,16,16,16", help="initial samples per rank per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--bus-dir", help="LocalTransport directory (default: no bus)")
    p.add_argument("--kafka", help="Kafka bootstrap (instead of --bus-dir)")
    p.add_argument("--kafka-prefix", default="")
    p.add_argument("--checkpoint-dir")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=1)
    p.add_argument("--log-dir")
    p.add_argument("--model-name", help="GPU model for step records (default: what CUDA reports)")
    p.add_argument("--sample-time", type=float, default=0.0, help="emulated compute seconds per sample")
    p.add_argument("--slow", action="append", default=[], help="NODE:FACTOR[@STEP]")
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (tests: time to act)")
    p.add_argument("--gloo-timeout", type=float, default=60.0)
    p.add_argument("--no-plugin", action="store_true", help="baseline: no telemetry, no commands")
    p.add_argument("--pipeline-layers", type=int, default=0, help="a pipeline of this many layers, a "
                   "stage per rank (0: data parallel)")
    p.add_argument("--stage-layers", help="first-last layers per stage, e.g. 0-1,2-3 (default: even)")
    ns = p.parse_args(argv)

    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from fleetwise.training import allreduce_gradients
    from fleetwise.training.control import TrainingPlugin
    from fleetwise.training.sampler import ShareSampler
    from fleetwise.training.transport import BusTransport, KafkaTransport, LocalTransport

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=ns.gloo_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("FLEETWISE_NODE", f"node-{rank}")
    shares = [int(s) for s in ns.shares.split(",")]
    if len(shares) != world:  # started at another size than the plan: keep the global batch
        from fleetwise.training.control import scaled_shares

        shares = scaled_shares([1] * world, {}, sum(shares))

    pipeline: dict[str, Any] = {}
    if ns.pipeline_layers:
        # One data-parallel rank: rank 0's share is the global batch; every stage reads it whole.
        shares = [sum(shares)] + [0] * (world - 1)
        if ns.stage_layers:
            spans = [tuple(map(int, s.split("-"))) for s in ns.stage_layers.split(",")]
        else:
            from fleetwise.training.control import scaled_shares

            counts = scaled_shares([1] * world, {}, ns.pipeline_layers)
            spans = [(sum(counts[:r]), sum(counts[:r + 1]) - 1) for r in range(world)]

        def rebuild(span: tuple[int, int], layout: Any = None) -> tuple[Any, Any]:
            stage = make_stage(span[0], span[1], ns.pipeline_layers, seed=ns.seed)
            return stage, _optimizer(stage, ns.lr)

        model, opt = rebuild(spans[rank])
        pipeline = {"stage": rank, "layers": spans[rank], "rebuild": rebuild}
    else:
        model = make_model(seed=ns.seed)
        opt = _optimizer(model, ns.lr)
    x, y = make_data(ns.num_samples)
    sampler = ShareSampler(ns.num_samples, shares, rank, seed=ns.seed)
    if ns.kafka:
        transport: Any = KafkaTransport(ns.kafka, prefix=ns.kafka_prefix, from_beginning=True)
    elif ns.bus_dir:
        transport = LocalTransport(ns.bus_dir)
    else:
        from fleetwise.streams.embedded import EventBus

        transport = BusTransport(EventBus())
    plugin = TrainingPlugin(job=ns.job, model=model, optimizer=opt, sampler=sampler, transport=transport,
                            checkpoint_dir=ns.checkpoint_dir, checkpoint_every=ns.checkpoint_every,
                            sync_every=ns.sync_every, node=node, model_name=ns.model_name,
                            telemetry=not ns.no_plugin, **pipeline)
    resumed = plugin.restore()
    log = None
    if ns.log_dir:
        Path(ns.log_dir).mkdir(parents=True, exist_ok=True)
        log = open(Path(ns.log_dir) / f"rank-{node}.jsonl", "a", buffering=1)  # noqa: SIM115
    batches = iter(sampler)
    try:
        while plugin.step < ns.steps:
            step = plugin.step
            t0 = time.perf_counter()
            ids = next(batches)
            model, opt = plugin.model, plugin.optimizer  # a re-split replaces them
            if pipeline:
                ids = sampler.global_indices(sampler.step - 1)
                first, last = plugin.layers  # type: ignore[misc]
                with plugin.compute():  # the stage's own work (emulated: its layers x samples)
                    delay = ns.sample_time * len(ids) * (last - first + 1) * _slow_factor(ns.slow, node, step)
                    if delay > 0:
                        time.sleep(delay)
                losses = _pipeline_step(dist, model, x[ids], y[ids], rank, world)
            else:
                with plugin.compute():
                    out = model(x[ids])
                    losses = (out - y[ids]).pow(2).sum(dim=1)
                    loss = losses.mean() if ids else out.sum() * 0.0
                    loss.backward()
                    delay = ns.sample_time * len(ids) * _slow_factor(ns.slow, node, step)
                    if delay > 0:
                        time.sleep(delay)
                allreduce_gradients(model, len(ids), sampler.global_samples(sampler.step - 1))
            opt.step()
            opt.zero_grad()
            samples = len(ids)
            if pipeline and losses is None:  # not the last stage: its rows carry no loss
                ids = []
                losses = torch.zeros(0, dtype=torch.float64)
            if ns.step_delay:
                time.sleep(ns.step_delay)
            if log is not None:
                log.write(json.dumps({"step": step, "world": plugin.world_size, "rank": rank, "node": node,
                                      "ids": ids, "loss_sum": float(losses.detach().sum()),
                                      "n": len(ids), "step_time_s": time.perf_counter() - t0,
                                      "shares": plugin.shares, "resumed": resumed, "t": time.time(),
                                      "pid": os.getpid(), "layers": plugin.layers}) + "\n")
            if ns.no_plugin:
                plugin.step += 1  # the baseline: no record, no command boundary
            else:
                plugin.end_step(samples=samples)
    finally:
        if log is not None:
            log.close()
    plugin.close()
    if rank == 0 and ns.log_dir:
        params = [p.detach().flatten().tolist() for p in plugin.model.parameters()]
        (Path(ns.log_dir) / "final.json").write_text(json.dumps({"step": plugin.step, "params": params,
                                                                  "sync_s": plugin.sync_s,
                                                                  "overhead_s": plugin.overhead_s,
                                                                  "overhead_cpu_s": plugin.overhead_cpu_s,
                                                                  "syncs": plugin.syncs}))
    # Every rank reaches the end before any tears its group down: a rank that destroyed its
    # gloo group while a peer's was still sending aborted now and then ("terminate called
    # without an active exception", exit -6) in `make demo`.
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _pipeline_step(dist: Any, stage: Any, x: Any, y: Any, rank: int, world: int) -> Any:
    """Forward and backward of one micro-batch through this rank's stage: activations in from
    the previous stage and out to the next, their gradients back. The last stage's per-sample
    losses, else None (the gradients are the whole model's: the loss is the batch mean)."""
    import torch

    first, last = rank == 0, rank == world - 1
    if first:
        inp = x
    else:
        inp = torch.empty(x.shape, dtype=x.dtype)
        dist.recv(inp, src=rank - 1)
        inp.requires_grad_(True)
    out = stage(inp)
    losses = None
    if last:
        losses = (out - y).pow(2).sum(dim=1)
        losses.mean().backward()
    else:
        dist.send(out.detach(), dst=rank + 1)
        grad = torch.empty(out.shape, dtype=out.dtype)
        dist.recv(grad, src=rank + 1)
        out.backward(grad)
    if not first:
        dist.send(inp.grad, dst=rank - 1)
    return losses


def read_logs(log_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every rank's complete step lines. A rank's last line may still be being written (a line
    of thousands of sample ids is more than one write) when the job is read while it runs: only
    lines ended by a newline are read; the rest comes with the next read."""
    rows = []
    for path in sorted(Path(log_dir).glob("rank-*.jsonl")):
        text = path.read_text()
        complete = text[:text.rfind("\n") + 1]
        rows.extend(json.loads(line) for line in complete.splitlines() if line.strip())
    return rows


def trajectory(rows: list[dict[str, Any]]) -> tuple[list[float], dict[int, list[int]]]:
    """(global loss per step, sample ids per step) from the rank logs, keeping for each step the
    records of its last run (a step re-run after a restart from a checkpoint replaces the
    first attempt: the restarted group's state is the checkpoint's)."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_step.setdefault(row["step"], []).append(row)
    losses, ids = [], {}
    for step in sorted(by_step):
        attempts = by_step[step]
        last = max(attempts, key=lambda r: r["t"])
        group = [r for r in attempts if (r["world"], r["resumed"]) == (last["world"], last["resumed"])]
        current = {r["node"]: r for r in sorted(group, key=lambda r: r["t"])}.values()
        n = sum(r["n"] for r in current)
        losses.append(sum(r["loss_sum"] for r in current) / n)
        ids[step] = sorted(i for r in current for i in r["ids"])
    return losses, ids


def run_job(tmp: Path, name: str, shares: list[int], steps: int, sample_time: float, slow: list[str],
            control: bool = False, extra: list[str] | None = None,
            timeout_s: float = 300.0, pipeline_layers: int = 0) -> dict[str, Any]:
    """Run one job of `len(shares)` ranks on this machine (node-0, node-1, ...) with a file bus;
    with `control`, this process runs the embedded control plane (fleetwise.streams.embedded)
    on the ranks' step records, with the job's plan, and sends its commands back to the ranks.
    `pipeline_layers`: a pipeline of that many layers, a stage per rank, evenly split (the
    plan says so, so the control plane re-splits it when a stage slows down).
    Returns step times (slowest rank per step), shares per step, rank 0's final numbers, the acks
    and the commands."""
    from fleetwise.schemas import topics as T
    from fleetwise.training.control import scaled_shares
    from fleetwise.training.transport import LocalTransport

    nodes = [f"node-{r}" for r in range(len(shares))]
    bus_dir, log_dir = tmp / name / "bus", tmp / name / "logs"
    args = ["--job", name, "--steps", str(steps), "--shares", ",".join(map(str, shares)),
            "--num-samples", "65536", "--bus-dir", str(bus_dir), "--log-dir", str(log_dir),
            "--sample-time", str(sample_time), "--model-name", "H100"]
    for spec in slow:
        args += ["--slow", spec]
    if pipeline_layers:  # a re-split goes through a checkpoint
        args += ["--pipeline-layers", str(pipeline_layers), "--checkpoint-dir", str(tmp / name / "ckpt")]
    args += extra or []
    bus = LocalTransport(bus_dir)
    runtime = None
    commands: list[Any] = []
    if control:
        from fleetwise.actuators.config import PolicyConfig
        from fleetwise.schemas import Plan, RankPlan
        from fleetwise.streams.embedded import EmbeddedRuntime
        from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

        runtime = EmbeddedRuntime(ControlPlane(ControlPlaneConfig(
            policy=PolicyConfig(), failure_predictor=False, publish_features=False)))
        # The job's current plan (what the planner published): the policy rebalances its shares,
        # or a pipeline's stage boundaries (the example's even split).
        world = len(shares)
        counts = scaled_shares([1] * world, {}, pipeline_layers) if pipeline_layers else [2] * world
        spans = [(sum(counts[:r]), sum(counts[:r + 1]) - 1) if pipeline_layers else (0, 1)
                 for r in range(world)]
        plan = Plan(job=name, dp=1 if pipeline_layers else world, tp=1, pp=world if pipeline_layers else 1,
                    zero_stage=0, global_batch=sum(shares), seq_len=1,
                    predicted_step_s=sample_time * max(shares), tokens_per_s=0.0, mfu=0.0,
                    ranks=[RankPlan(rank=r, node=nodes[r], gpu=0, model="h100-sxm", capability_tflops=1.0,
                                    micro_batch=sum(shares) if pipeline_layers else s,
                                    stage=r if pipeline_layers else 0, layers=spans[r],
                                    dp_rank=0 if pipeline_layers else r, memory_gb=1.0,
                                    memory_capacity_gb=80.0) for r, s in enumerate(shares)])
        runtime.feed(T.PLANS.name, [plan])

        def forward(key: str, cmd: Any) -> None:  # the control plane's commands, to the ranks' bus
            commands.append(cmd)
            bus.publish(T.COMMANDS_TRAINING.name, key, cmd)

        runtime.bus.subscribe(T.COMMANDS_TRAINING.name, forward)
    procs = launch(len(shares), args, port=_free_port(), nodes=nodes)
    deadline = time.monotonic() + timeout_s
    fed = 0
    acks: list[Any] = []
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            for p in procs:
                p.kill()
            raise TimeoutError(f"{name}: ranks did not finish in {timeout_s} s")
        if runtime is not None:
            records = bus.poll(T.TELEMETRY_STEPS.name)
            if records:
                fed += len(records)
                runtime.feed(T.TELEMETRY_STEPS.name, records)
            answered = bus.poll(T.ACKS.name)  # the fleet state (and a pipeline's layers) follow them
            if answered:
                acks += answered
                runtime.feed(T.ACKS.name, answered)
        time.sleep(0.005)
    codes = [p.returncode for p in procs]
    if any(codes):
        raise RuntimeError(f"{name}: ranks exited {codes}; logs in {log_dir}")
    rows = read_logs(log_dir)
    final = json.loads((log_dir / "final.json").read_text())
    acks += bus.poll(T.ACKS.name)
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in rows:
        by_step.setdefault(r["step"], []).append(r)
    step_time = [max(r["step_time_s"] for r in by_step[s]) for s in sorted(by_step)]
    shares_at = [by_step[s][0]["shares"] for s in sorted(by_step)]
    return {"step_time": step_time, "shares": shares_at, "final": final, "acks": acks, "commands": commands,
            "steps_fed": fed}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(nprocs: int, args: Sequence[str], *, port: int, nodes: Sequence[str] | None = None,
           env: dict[str, str] | None = None, cwd: str | None = None) -> list[subprocess.Popen]:
    """Start `nprocs` ranks of this script without an elastic agent (static membership)."""
    procs = []
    for rank in range(nprocs):
        e = dict(os.environ, **(env or {}))
        e.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), FLEETWISE_NODE=(nodes[rank] if nodes else f"node-{rank}"),
                 OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "fleetwise.training.example", *args]
        procs.append(subprocess.Popen(cmd, env=e, cwd=cwd))
    return procs


if __name__ == "__main__":
    raise SystemExit(main())
