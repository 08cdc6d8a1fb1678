"""The training plugin's command consumer: commands from the control plane, applied at a step boundary.

Two layers:

- `CommandGate` (pure, no torch): what the contract (DESIGN.md "Command lifecycle") asks of a
  consumer, in order: a command already accepted is a duplicate (ack `done`, "duplicate",
  nothing changes); then `verify_command` (unsigned, forged, unknown key, other job, expired,
  out of sequence -> ack `rejected` with the reason); then it waits until every command it
  `requires` is done; then it is due. Its state goes into checkpoints.
- `TrainingPlugin` (inside the training loop, every rank): step telemetry, and at each step
  boundary (every `sync_every` steps) rank 0 polls its job's commands, runs them through the
  gate and broadcasts the due ones (one int64 broadcast per boundary; the commands themselves
  only when there are some), so every rank applies them at the same step:

  - `rebalance`: new per-rank shares (`samples`, or `speed_factors` relative to the plan's
    shares) into the `ShareSampler` (and a `WeightedHookState` when given); new pipeline stage
    boundaries (`layers`: {stage: [first, last]}): every rank checkpoints, builds its stage's
    new layers (the `rebuild` callback) and loads them from that checkpoint, resharded by
    parameter name, then goes on in the same process at the same step;
  - `checkpoint`: torch.distributed.checkpoint, `done` ack with {"checkpoint_uri", "step"};
  - `drain` / `resize`: checkpoint, then the leaving rank's node leaves and the others
    re-rendezvous through torch's elastic agent at the new size (`fleetwise.training.elastic`);
    the new group loads the checkpoint resharded and continues at the same step and data
    position, and acks `done`;
  - `migrate`: phase "snapshot" checkpoints to the given URI, acks, and ends the job here;
    phase "restore" loads a URI at a boundary (a job restarted elsewhere also calls
    `restore(uri)` at start); phase "transfer" is the orchestrator's.

Acks go to `fleetwise.acks` (key job), by "training-plugin", with the step at which the
command took effect (the number of steps completed at that boundary).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fleetwise.actuators.signing import Keyring, verify_command
from fleetwise.planner.shares import proportional_shares
from fleetwise.planner.stages import layout_json, stage_spans
from fleetwise.schemas import Ack, Command
from fleetwise.schemas import topics as T
from fleetwise.streams.keys import keyring_from_env
from fleetwise.training import elastic
from fleetwise.training.telemetry import ComputeTimer, Outbox, StepReporter, gpu_model

__all__ = ["ACK_BY", "HANDLED", "CommandGate", "TrainingPlugin", "scaled_shares"]

ACK_BY = "training-plugin"
HANDLED = frozenset({"rebalance", "checkpoint", "drain", "resize", "migrate"})


def scaled_shares(base: Sequence[int], factors: Mapping[str, float] | Mapping[int, float],
                  total: int | None = None) -> list[int]:
    """Shares proportional to `base[i] * factor[i]` (a rank without a factor keeps 1.0), summing
    to `total` (default: the sum of `base`), by largest remainder (ties to the lower rank).

    `speed_factors` are plan-relative: a rank at 0.5 gets about half its plan share and the
    others take the rest, so every rank's step time evens out again."""
    keyed = {int(k): float(v) for k, v in factors.items()}
    bad = [k for k in keyed if not 0 <= k < len(base)]
    if bad:
        raise ValueError(f"speed_factors: ranks {bad} are not in this job's {len(base)} ranks")
    weights = [b * max(keyed.get(i, 1.0), 1e-3) for i, b in enumerate(base)]
    total = sum(base) if total is None else int(total)
    if sum(weights) <= 0:
        raise ValueError(f"speed_factors: no rank left with a positive share (base {list(base)})")
    return proportional_shares(weights, total)


def _even(total: int, world: int) -> list[int]:
    return scaled_shares([1] * world, {}, total)


def _layer_range(layout: Mapping[int, tuple[int, int]]) -> tuple[int, int]:
    return min(f for f, _ in layout.values()), max(b for _, b in layout.values())


def _form_hint(strategy: Mapping[str, Any] | None, pipeline: bool) -> str:
    """Why a re-plan's `world_size` (GPUs) differs from this group's ranks, when it says."""
    if not strategy or pipeline:
        return ""
    per_replica = int(strategy.get("tp", 1)) * int(strategy.get("pp", 1))
    if per_replica == 1:
        return ""
    return (f" (the re-plan counts GPUs: tp {strategy.get('tp', 1)} x pp {strategy.get('pp', 1)} per "
            "data-parallel replica; this plugin's group holds one rank per replica, and a job with "
            "tensor or pipeline parallelism in each replica is resized by restarting it on the new plan)")


def _shares_list(samples: Mapping[str, Any] | Sequence[int], world: int, field: str) -> list[int]:
    if isinstance(samples, Mapping):
        try:
            keyed = {int(k): int(v) for k, v in samples.items()}
        except (TypeError, ValueError):
            raise ValueError(f"{field}: expected {{dp_rank: samples}} integers, got {dict(samples)}") \
                from None
        if sorted(keyed) != list(range(world)):
            raise ValueError(f"{field}: needs ranks 0..{world - 1}, got {sorted(keyed)}")
        out = [keyed[i] for i in range(world)]
    else:
        out = [int(v) for v in samples]
        if len(out) != world:
            raise ValueError(f"{field}: {len(out)} shares for {world} ranks")
    if any(v < 0 for v in out) or sum(out) <= 0:
        raise ValueError(f"{field}: shares must be >= 0 and sum to > 0, got {out}")
    return out


class CommandGate:
    """Dedupe -> verify -> wait for `requires` -> due, and the ack each step of that earns.

    `now` is the consumer's clock (wall time live; event time in replay and benches).
    """

    def __init__(self, job: str, keys: Keyring | Mapping[str, bytes] | None = None, *,
                 node: str | None = None, gpu: int | None = None, rank: int | None = 0) -> None:
        self.job = job
        self.keys = keys if keys is not None else keyring_from_env()
        self.node, self.gpu, self.rank = node, gpu, rank
        self.accepted: dict[str, str] = {}  # id -> "pending" | "done"
        self.pending: list[Command] = []
        self.in_flight: list[Command] = []  # due, announced to the ranks, not applied yet
        self.done: set[str] = set()  # ids whose `done` ack was seen (ours or another consumer's)
        self.last_seq: int | None = None

    def ack(self, command: Command | str, status: str, now: float, *, step: int | None = None,
            detail: str | None = None, result: Mapping[str, Any] | None = None) -> Ack:
        cid = command if isinstance(command, str) else command.id
        return Ack(command_id=cid, ts=now, job=self.job, node=self.node, gpu=self.gpu, rank=self.rank,
                   by=ACK_BY, status=status, step=step, detail=detail, result=dict(result or {}))

    def offer(self, command: Command, now: float, step: int | None = None) -> Ack:
        """One arriving command: `received` (accepted, pending), `rejected`, or `done` "duplicate"."""
        if command.id in self.accepted:
            return self.ack(command, "done", now, step=step, detail="duplicate")
        verdict = verify_command(command, self.keys, now, last_seq=self.last_seq, job=self.job)
        if not verdict:
            return self.ack(command, "rejected", now, step=step, detail=verdict.reason)
        if command.type not in HANDLED:
            return self.ack(command, "rejected", now, step=step,
                            detail=f"command type {command.type!r} is not the training plugin's "
                                   f"(it handles {', '.join(sorted(HANDLED))})")
        if command.dry_run:
            self.accepted[command.id] = "done"
            return self.ack(command, "done", now, step=step, detail="dry run: nothing applied")
        self.accepted[command.id] = "pending"
        if command.seq is not None:
            self.last_seq = command.seq if self.last_seq is None else max(self.last_seq, command.seq)
        self.pending.append(command)
        return self.ack(command, "received", now, step=step)

    @staticmethod
    def requirements(command: Command) -> list[str]:
        """Ids that must be done first: `requires`, and a drain's `requires_checkpoint` param."""
        need = list(command.requires)
        extra = command.params.get("requires_checkpoint")
        if isinstance(extra, str) and extra not in need:
            need.append(extra)
        return need

    @property
    def waiting(self) -> bool:
        """True when a pending command waits for another's `done` ack."""
        return any(not set(self.requirements(c)) <= self.done for c in self.pending)

    def note_done(self, command_ids: Iterable[str]) -> None:
        """`done` acks seen on fleetwise.acks (another consumer's, e.g. the kube consumer's)."""
        self.done.update(command_ids)

    def due(self, now: float, step: int | None = None) -> tuple[list[Command], list[Ack]]:
        """Pending commands whose requirements are done, in arrival order (removed from pending),
        and `rejected` acks for those that expired while waiting."""
        ready: list[Command] = []
        acks: list[Ack] = []
        keep: list[Command] = []
        for c in self.pending:
            if c.expires_ts is not None and now > c.expires_ts:
                self.accepted[c.id] = "done"
                acks.append(self.ack(c, "rejected", now, step=step,
                                     detail=f"expired at {c.expires_ts:.3f} while waiting for "
                                            f"{', '.join(self.requirements(c))}"))
            elif set(self.requirements(c)) <= self.done:
                ready.append(c)
            else:
                keep.append(c)
        self.pending = keep
        self.in_flight.extend(ready)
        return ready, acks

    def applied(self, command_id: str) -> None:
        """Every rank has acted on the command (whatever the outcome): no longer in flight."""
        self.in_flight = [c for c in self.in_flight if c.id != command_id]

    def finished(self, command_id: str) -> None:
        """The command's `done` ack was sent: it satisfies others' `requires`."""
        self.accepted[command_id] = "done"
        self.done.add(command_id)

    def state(self) -> dict[str, Any]:
        # In-flight commands go back to pending: a group restored from this state applies them.
        waiting = [*self.in_flight, *self.pending]
        return {"accepted": dict(self.accepted), "pending": [c.model_dump(mode="json") for c in waiting],
                "done": sorted(self.done), "last_seq": self.last_seq}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.accepted = dict(state.get("accepted", {}))
        self.pending = [Command.model_validate(c) for c in state.get("pending", [])]
        self.in_flight = []
        self.done = set(state.get("done", []))
        self.last_seq = state.get("last_seq")


class TrainingPlugin:
    """Telemetry and commands inside a torch.distributed training loop (every rank makes it).

    The loop calls `restore()` once, `with plugin.compute():` around forward + backward, and
    `end_step(samples)` after the optimizer step. A drain, resize or migrate ends the process
    from `end_step` (SystemExit) after its checkpoint: the elastic agent starts the next group.

    `model`/`optimizer`: what checkpoints hold (DDP or FSDP2 modules work: DCP state dicts);
    `sampler`: a `fleetwise.training.ShareSampler` (shares and data position);
    `transport`: a `fleetwise.training.transport` Transport; `checkpoint_dir`: where
    checkpoints go (a shared file system for several nodes); `keys`: the signing keyring
    (default `keyring_from_env()`); `sync_every`: boundaries between command checks (1: every
    step); `checkpoint_every`: periodic checkpoints for failure recovery (0: none);
    `clock`: the time commands' expiry is judged by and records carry (wall time live).
    `stage`, `layers`, `rebuild`: a pipeline stage's index, its layers (first, last; inclusive)
    and `rebuild(layers, layout) -> (module, optimizer)`, which builds this stage for new
    boundaries (`layout`: {stage: (first, last)} of every stage) when a rebalance moves them.
    """

    def __init__(
        self,
        *,
        job: str,
        model: Any,
        optimizer: Any,
        sampler: Any,
        transport: Any,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        keys: Keyring | Mapping[str, bytes] | None = None,
        node: str | None = None,
        gpu: int | None = None,
        model_name: str | None = None,
        hook_state: Any = None,
        sync_every: int = 1,
        checkpoint_every: int = 0,
        telemetry: bool = True,
        capacity: int = 1024,
        clock: Callable[[], float] = time.time,
        park_timeout_s: float = 120.0,
        group: Any = None,
        stage: int | None = None,
        layers: tuple[int, int] | None = None,
        rebuild: Callable[[tuple[int, int], Mapping[int, tuple[int, int]]], tuple[Any, Any]] | None = None,
    ) -> None:
        import torch
        import torch.distributed as dist

        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        self._torch, self._dist = torch, dist
        self.job, self.model, self.optimizer, self.sampler = job, model, optimizer, sampler
        self.transport, self.hook_state, self.group = transport, hook_state, group
        self.checkpoint_dir = checkpoint_dir
        self.sync_every, self.checkpoint_every = sync_every, checkpoint_every
        self.clock, self.park_timeout_s = clock, park_timeout_s
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.node = node or os.environ.get("FLEETWISE_NODE") or socket.gethostname()
        self.gpu = int(gpu if gpu is not None else os.environ.get("LOCAL_RANK", 0))
        self.model_name = model_name or gpu_model()
        self.step = 0
        self.resumed_step: int | None = None  # the step of the checkpoint this group last loaded
        self.base_shares: list[int] = list(sampler.shares)
        self.gate = CommandGate(job, keys, node=self.node, gpu=self.gpu, rank=self.rank)
        if (stage is None) != (layers is None):
            raise ValueError("a pipeline stage needs both `stage` and `layers` (first, last)")
        self.stage, self.rebuild = stage, rebuild
        # The (node, gpu) of every rank: who leaves on a drain of a GPU; and its pipeline stage.
        members: list[Any] = [None] * self.world_size
        dist.all_gather_object(members, (self.node, self.gpu, stage, layers), group=group)
        self.members: list[tuple[str, int]] = [(str(m[0]), int(m[1])) for m in members]
        self.stages: list[int] | None = [int(m[2]) for m in members] if stage is not None else None
        # Stage -> (first, last) layers, inclusive (as a plan's ranks give them); None: no pipeline.
        self.layout: dict[int, tuple[int, int]] | None = (
            {int(m[2]): (int(m[3][0]), int(m[3][1])) for m in members} if stage is not None else None)
        self.acks = Outbox(transport.publish, capacity=capacity, name=f"fleetwise-acks-{self.rank}")
        self.reporter = (StepReporter(transport.publish, job=job, rank=self.rank, node=self.node,
                                      gpu=self.gpu, model=self.model_name, capacity=capacity, clock=clock)
                         if telemetry else None)
        self.timer = ComputeTimer(cuda=torch.cuda.is_available() and _on_cuda(model))
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._announce_work: Any = None  # the boundary's asynchronous broadcast, waited one step later
        self._announced: list[str] = []  # rank 0: what that broadcast announced
        self.sync_s = 0.0  # time spent deciding commands at boundaries
        self.syncs = 0
        # The plugin's own time per step: the record plus the boundary's decision (not the work
        # a command asks for, such as a checkpoint).
        self.overhead_s = 0.0
        self.overhead_cpu_s = 0.0  # the same, in this thread's CPU time (without waits and preemption)
        self.history: list[tuple[int, str, str]] = []  # (step, command id, what happened)
        self._step_start = time.perf_counter()

    # ---- the loop ---------------------------------------------------------------------------
    def compute(self) -> ComputeTimer:
        """`with plugin.compute():` around forward + backward (barrier-free timer)."""
        return self.timer

    def end_step(self, samples: int, micro_batch: int | None = None) -> None:
        """After the optimizer step: this step's record, then the boundary (commands, checkpoints)."""
        now, cpu = time.perf_counter(), time.thread_time()
        if self.reporter is not None:
            compute = self.timer.last_s if self.timer.last_s is not None else 0.0
            self.reporter.record(self.step, now - self._step_start, compute, micro_batch=micro_batch,
                                 samples=samples)
        self.step += 1
        boundary = self.step % self.sync_every == 0
        commands = self._collect() if boundary else []
        self.overhead_s += time.perf_counter() - now
        self.overhead_cpu_s += time.thread_time() - cpu
        for command in commands:
            self._apply(command)
        if boundary:
            t0, cpu = time.perf_counter(), time.thread_time()
            self._announce()
            self.sync_s += time.perf_counter() - t0
            self.overhead_s += time.perf_counter() - t0
            self.overhead_cpu_s += time.thread_time() - cpu
            self.syncs += 1
        if self.checkpoint_every and self.step % self.checkpoint_every == 0 and self.checkpoint_dir:
            self.checkpoint()
        self._step_start = time.perf_counter()

    @property
    def shares(self) -> list[int]:
        return list(self.sampler.shares)

    @property
    def layers(self) -> tuple[int, int] | None:
        """This rank's pipeline stage's layers (first, last), inclusive; None without a pipeline."""
        return None if self.layout is None or self.stage is None else self.layout[self.stage]

    # ---- commands ---------------------------------------------------------------------------
    def _publish_ack(self, ack: Ack) -> None:
        self.acks.put(T.ACKS.name, self.job, ack)

    def _announce(self) -> None:
        """Rank 0 decides which commands act at the next boundary and starts telling every rank
        (an asynchronous broadcast of their count that overlaps the next step)."""
        payload: list[str] = []
        if self.rank == 0:
            now = self.clock()
            for command in self.transport.poll(T.COMMANDS_TRAINING.name, self.job):
                ack = self.gate.offer(command, now, step=self.step)
                self._publish_ack(ack)
                if ack.status != "received":
                    self.history.append((self.step, command.id, f"{ack.status}: {ack.detail}"))
            if self.gate.waiting:
                seen = self.transport.poll(T.ACKS.name, self.job)
                self.gate.note_done(a.command_id for a in seen if a.status == "done")
            ready, expired = self.gate.due(now, step=self.step)
            for ack in expired:
                self._publish_ack(ack)
            payload = [c.model_dump_json() for c in ready]
        self._announced = payload
        self._flag[0] = len(payload)
        self._announce_work = self._dist.broadcast(self._flag, 0, group=self.group, async_op=True)

    def _collect(self) -> list[Command]:
        """The commands announced at the previous boundary, the same on every rank."""
        work, self._announce_work = self._announce_work, None
        if work is None:
            return []
        work.wait()
        if not int(self._flag[0]):
            return []
        box: list[Any] = [self._announced]
        self._dist.broadcast_object_list(box, 0, group=self.group)
        return [Command.model_validate_json(text) for text in box[0]]

    def _ack(self, command: Command, status: str, *, detail: str | None = None,
             result: Mapping[str, Any] | None = None) -> None:
        self.history.append((self.step, command.id, status if detail is None else f"{status}: {detail}"))
        if status == "done":
            self.gate.finished(command.id)
        if self.rank == 0:
            self._publish_ack(self.gate.ack(command, status, self.clock(), step=self.step, detail=detail,
                                            result=result))

    def _apply(self, command: Command) -> None:
        self.gate.applied(command.id)  # (a resize's checkpoint must not hold it as in flight)
        try:
            handler = getattr(self, f"_apply_{command.type}")
            handler(command)
        except (ValueError, KeyError, TypeError) as exc:  # bad params: nothing changed
            self._ack(command, "failed", detail=str(exc))

    def _apply_rebalance(self, command: Command) -> None:
        p = command.params
        # Everything is checked before anything changes: a bad part fails the whole command.
        layout = self._new_layout(p["layers"]) if "layers" in p else None
        new: list[int] | None = None
        if "samples" in p:
            new = _shares_list(p["samples"], self.world_size, "samples")
        elif "speed_factors" in p:
            new = scaled_shares(self.base_shares, p["speed_factors"], sum(self.base_shares))
        elif layout is None:
            raise ValueError("rebalance params need 'samples', 'speed_factors' or 'layers'")
        if new is not None and "global_samples" in p and int(p["global_samples"]) != sum(new):
            raise ValueError(f"samples sum to {sum(new)}, global_samples is {p['global_samples']}")
        # The new plan's shares: later speed factors scale these.
        changed, result = self._in_force(command, new, layout, base="samples" in p)
        if new is not None:
            result["global_samples"] = sum(new)
        self._ack(command, "done", result=result,
                  detail=None if changed else "no change: already in force")

    def _in_force(self, command: Command, shares: list[int] | None, layout: dict[int, tuple[int, int]] | None,
                  *, base: bool) -> tuple[list[str], dict[str, Any]]:
        """New shares (from the next step; `base`: the plan's, which speed factors scale) and
        stage boundaries (re-split now) where they differ from those in force: (what changed,
        the ack's result)."""
        result: dict[str, Any] = {}
        changed = []
        if shares is not None:
            result["samples"] = {str(i): n for i, n in enumerate(shares)}
            if shares != self.shares:
                changed.append("shares")
                if base:
                    self.base_shares = list(shares)
                self.sampler.set_shares(shares, from_step=self.sampler.step)
                if self.hook_state is not None:
                    self.hook_state.set_samples(shares[self.rank], sum(shares))
        if layout is not None:
            result["layers"] = layout_json(layout)
            if layout != self.layout:
                changed.append("layers")
                self.gate.accepted[command.id] = "done"  # in the checkpoint: never applied twice
                result["checkpoint_uri"] = self._resplit(layout)
        return changed, result

    def _new_layout(self, spec: Any, stages: int | None = None) -> dict[int, tuple[int, int]]:
        """`layers` of a rebalance ({stage: [first, last]}, inclusive), checked against this
        job's stages (`stages`: that many instead, for a resize): every stage once, contiguous,
        the same layers in all."""
        if self.layout is None or self.stage is None or self.rebuild is None:
            raise ValueError("layers: this rank runs no pipeline stage the plugin can rebuild "
                             "(TrainingPlugin(stage=, layers=, rebuild=))")
        if self.checkpoint_dir is None:
            raise ValueError("layers: new stage boundaries go through a checkpoint, and the plugin "
                             "has no checkpoint_dir")
        if not isinstance(spec, Mapping):
            raise ValueError(f"layers: expected {{stage: [first, last]}}, got {spec!r}")
        first, last = _layer_range(self.layout)
        try:
            layout = stage_spans(spec, first=first, last=last)
        except ValueError as exc:
            raise ValueError(f"layers: {exc}") from None
        want = set(range(stages)) if stages is not None else set(self.layout)
        if set(layout) != want:
            raise ValueError(f"layers: stages {sorted(layout)} are not this job's stages {sorted(want)}")
        return layout

    def _resplit(self, layout: dict[int, tuple[int, int]]) -> str:
        """New stage boundaries in this process: checkpoint every stage's layers, build this
        stage's new ones, load them from the checkpoint (DCP finds each parameter by name,
        whichever stage saved it), and train on. Returns the checkpoint's URI."""
        saved = layout_json(layout)
        where = self.checkpoint(extra={"layers": saved})
        model, optimizer = self.rebuild(layout[self.stage], dict(layout))  # type: ignore[misc,index]
        elastic.load_checkpoint(elastic.path_of(where), model, optimizer, group=self.group)
        self.model, self.optimizer, self.layout = model, optimizer, dict(layout)
        return where

    def _apply_checkpoint(self, command: Command) -> None:
        uri = command.params.get("checkpoint_uri") or command.params.get("uri")
        where = self.checkpoint(uri)
        self._ack(command, "done", result={"checkpoint_uri": where, "step": self.step})

    def _apply_drain(self, command: Command) -> None:
        if command.node is None:
            raise ValueError("drain needs the node (and gpu) to drain")
        leave = [[command.node, command.gpu]] if command.gpu is not None else [
            [n, g] for n, g in self.members if n == command.node]
        if not any(tuple(x) in self.members for x in map(tuple, leave)):
            self._ack(command, "done", detail=f"no rank of {self.job} runs on {command.node}/{command.gpu}")
            return
        self._resize(command, leave=leave, join=[], samples=None, world_size=None)

    def _apply_resize(self, command: Command) -> None:
        p = command.params
        self._resize(command, leave=p.get("leave", []), join=p.get("join", []), samples=p.get("samples"),
                     world_size=p.get("world_size"), strategy=p.get("strategy"), layers=p.get("layers"))

    def _resize_in_place(self, command: Command, samples: Any,
                         layout: dict[int, tuple[int, int]] | None) -> None:
        """A resize to the same members: the re-plan's shares and stage boundaries, in place."""
        new = None
        if samples is not None:
            new = (self._pipeline_shares(sum(_shares_list(samples, 1, "samples"))) if self.layout is not None
                   else _shares_list(samples, self.world_size, "samples"))
        changed, result = self._in_force(command, new, layout, base=True)
        result["world_size"] = self.world_size
        detail = (f"same members: new {' and '.join(changed)} applied" if changed
                  else "no change: same members")
        self._ack(command, "done", detail=detail, result=result)

    def _pipeline_shares(self, total: int) -> list[int]:
        """A pipeline without data parallelism: the global batch on the first stage's rank."""
        assert self.stages is not None
        return [total if st == 0 else 0 for st in self.stages]

    def _resize(self, command: Command, *, leave: Sequence[Sequence[Any]], join: Sequence[Any],
                samples: Any, world_size: int | None, strategy: Mapping[str, Any] | None = None,
                layers: Any = None) -> None:
        leaving = [r for r, m in enumerate(self.members) if [m[0], m[1]] in [[n, g] for n, g in leave]]
        if world_size is not None and not leave and not join and int(world_size) < self.world_size:
            leaving = list(range(int(world_size), self.world_size))  # the highest ranks leave
        new_world = self.world_size - len(leaving) + len(join)
        if world_size is not None and int(world_size) != new_world:
            raise ValueError(f"world_size {world_size} does not match {self.world_size} ranks "
                             f"- {len(leaving)} leaving + {len(join)} joining"
                             + _form_hint(strategy, self.layout is not None))
        if new_world < 1:
            raise ValueError("a resize cannot leave no rank")
        layout = None
        if self.layout is not None:
            # A pipeline of one stage per rank: the re-plan must be one too (its replica's
            # samples are the global batch, read by the first stage).
            if strategy and (int(strategy.get("dp", 1)) != 1 or int(strategy.get("tp", 1)) != 1):
                raise ValueError(
                    f"the re-plan is dp {strategy.get('dp', 1)} x tp {strategy.get('tp', 1)} x pp "
                    f"{strategy.get('pp', 1)}; this job runs one pipeline stage per rank, without data or "
                    "tensor parallelism, and cannot change form while it runs")
            if samples is not None:
                _shares_list(samples, 1, "samples")
            if layers is not None:
                layout = self._new_layout(layers, stages=new_world)
        elif samples is not None:
            _shares_list(samples, new_world, "samples")
        if new_world == self.world_size and not leaving:
            # Same members (e.g. the re-planned resize after a drain this job already did): only
            # the plan's new shares and stage boundaries, if any, apply.
            self._resize_in_place(command, samples, layout)
            return
        self.gate.accepted[command.id] = "done"  # in the checkpoint: never applied twice
        resize = {"id": command.id, "type": command.type, "from_world": self.world_size,
                  "world_size": new_world, "samples": samples, "leaving": leaving,
                  "join": [list(j) for j in join]}
        if layout is not None:
            resize["layers"] = layout_json(layout)
        where = self.checkpoint(extra={"resize": resize})
        self._ack(command, "applied", detail=f"checkpointed; {len(leaving)} leaving, {len(join)} joining",
                  result={"checkpoint_uri": where, "step": self.step, "world_size": new_world})
        if self.rank in leaving:
            self._exit(leave=True)
        self._exit(park=bool(join))

    def _apply_migrate(self, command: Command) -> None:
        phase = command.params.get("phase", "snapshot")
        uri = command.params.get("checkpoint_uri")
        if phase == "snapshot":
            where = self.checkpoint(uri)
            self._ack(command, "done", detail="snapshot taken; this job stops here",
                      result={"checkpoint_uri": where, "step": self.step})
            self._exit(code=0)
        elif phase == "restore":
            if not uri:
                raise ValueError("migrate restore needs params.checkpoint_uri")
            path = elastic.resolve_checkpoint_uri(uri, job=self.job, root=self.checkpoint_dir)
            if not (path / elastic.META_FILE).is_file():
                raise ValueError(f"migrate restore: no complete checkpoint at {path}")
            snapshot_step = int(elastic.read_meta(path)["step"])
            if self.resumed_step is not None and self.resumed_step >= snapshot_step:
                # The group started from this snapshot (the newest checkpoint in its store) or a
                # later one: loading it again would throw the steps since away.
                self._ack(command, "done", detail=f"already resumed from step {self.resumed_step} "
                          f"(the snapshot is step {snapshot_step}): nothing loaded",
                          result={"checkpoint_uri": path.resolve().as_uri(), "step": self.step})
                return
            self.restore(path)
            self._ack(command, "done", result={"checkpoint_uri": path.resolve().as_uri(), "step": self.step})
        else:
            self._ack(command, "done", detail=f"phase {phase!r} is the orchestrator's: nothing to do here")

    # ---- checkpoints ------------------------------------------------------------------------
    def _meta(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"job": self.job, "step": self.step, "world_size": self.world_size,
                                "sampler": self.sampler.state_dict(), "base_shares": self.base_shares,
                                "gate": self.gate.state(),
                                "commands_position": self.transport.position(T.COMMANDS_TRAINING.name)}
        if self.layout is not None:
            meta["layers"] = layout_json(self.layout)
        meta.update(extra or {})
        return meta

    def checkpoint(self, uri: str | os.PathLike[str] | None = None, *,
                   extra: Mapping[str, Any] | None = None) -> str:
        """Checkpoint now (every rank calls it at the same boundary); returns the file:// URI."""
        if uri is None:
            if self.checkpoint_dir is None:
                raise ValueError("no checkpoint URI given and the plugin has no checkpoint_dir")
            uri = elastic.checkpoint_dir_for(self.checkpoint_dir, self.step)
        uri = elastic.resolve_checkpoint_uri(uri, job=self.job, root=self.checkpoint_dir)
        # Rank 0's consumer state is the job's: every rank writes the same meta through rank 0.
        return elastic.save_checkpoint(uri, self.model, self.optimizer, self._meta(extra), group=self.group)

    def restore(self, uri: str | os.PathLike[str] | None = None) -> int:
        """Load `uri`, else the newest checkpoint in `checkpoint_dir` (none: start at step 0);
        returns the step to run next. Re-splits the shares when the world size changed."""
        if uri is not None:
            path: Any = elastic.resolve_checkpoint_uri(uri, job=self.job, root=self.checkpoint_dir)
        else:
            path = elastic.latest_checkpoint(self.checkpoint_dir) if self.checkpoint_dir else None
        if path is None:
            return self.step
        saved_meta = elastic.read_meta(path)
        saved = saved_meta.get("layers")
        # A resize to another number of stages names the new boundaries (or leaves this group's own).
        wanted = (saved_meta.get("resize") or {}).get("layers") or saved
        layout = {int(k): (int(v[0]), int(v[1])) for k, v in wanted.items()} if wanted else None
        if layout is not None and self.layout is not None and layout != self.layout:
            mine = layout_json(self.layout)
            if set(layout) == set(self.layout):
                # Saved under other stage boundaries (a re-split): build this stage's layers as then.
                if self.rebuild is None:
                    raise ValueError(f"{path} was saved with stage layers {wanted}; this group's stages are "
                                     f"{mine} and the plugin has no rebuild callback for other boundaries")
                self.model, self.optimizer = self.rebuild(layout[self.stage], dict(layout))  # type: ignore[index]
                self.layout = layout
            elif _layer_range(layout) != _layer_range(self.layout):
                raise ValueError(f"{path} holds layers {wanted}; this group's stages {mine} hold others")
            # Else another number of stages (a resize without boundaries for it): this group's own
            # split; every stage loads its layers by parameter name, whichever stage saved them.
        meta = elastic.load_checkpoint(path, self.model, self.optimizer, group=self.group)
        self.step = self.resumed_step = int(meta["step"])
        self.sampler.load_state_dict(meta["sampler"])
        self.base_shares = list(meta.get("base_shares") or self.sampler.shares)
        if self.rank == 0:
            self.gate.restore(meta.get("gate", {}))
            if meta.get("commands_position"):
                self.transport.seek(T.COMMANDS_TRAINING.name, meta["commands_position"])
        resize = meta.get("resize")
        if len(self.sampler.shares) != self.world_size or resize:
            total = sum(self.sampler.shares)
            samples = resize.get("samples") if resize else None
            if self.stages is not None:
                new = self._pipeline_shares(sum(_shares_list(samples, 1, "samples")) if samples else total)
            elif samples is not None and len(samples) == self.world_size:
                new = _shares_list(samples, self.world_size, "samples")
            else:
                new = _even(total, self.world_size)
            self.sampler.set_shares(new, from_step=self.sampler.step, rank=self.rank)
            self.base_shares = list(new)
            if self.hook_state is not None:
                self.hook_state.set_samples(new[self.rank], sum(new))
        elif self.sampler.rank != self.rank:
            self.sampler.set_rank(self.rank)
        if resize and self.rank == 0:
            detail = f"resumed at world size {self.world_size}"
            if self.world_size != resize["world_size"]:
                detail += f" (asked {resize['world_size']})"
            self.gate.finished(resize["id"])
            result = {"checkpoint_uri": path.resolve().as_uri(), "step": self.step,
                      "world_size": self.world_size}
            if self.layout is not None:
                result["layers"] = layout_json(self.layout)
            self._publish_ack(self.gate.ack(resize["id"], "done", self.clock(), step=self.step, detail=detail,
                                            result=result))
        self._step_start = time.perf_counter()
        return self.step

    # ---- leaving ----------------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the boundary's broadcast; send queued records and acks (up to `timeout_s`)."""
        if self._announce_work is not None:
            self._announce_work.wait()
            self._announce_work = None
        if self.reporter is not None:
            self.reporter.close(timeout_s)
        self.acks.close(timeout_s)

    def _exit(self, *, leave: bool = False, park: bool = False, code: int | None = None) -> None:
        self.close()
        if leave:
            elastic.leave_agent()
            raise SystemExit(0)
        if code is not None:
            self._dist.destroy_process_group()
            raise SystemExit(code)
        if park and elastic.under_elastic_agent():
            # Wait at the boundary for the agent to restart us when the new node has joined.
            deadline = time.monotonic() + self.park_timeout_s
            while time.monotonic() < deadline:
                time.sleep(0.05)
        raise SystemExit(elastic.RESTART_EXIT_CODE)


def _on_cuda(model: Any) -> bool:
    try:
        return next(model.parameters()).is_cuda
    except (StopIteration, AttributeError):
        return False
