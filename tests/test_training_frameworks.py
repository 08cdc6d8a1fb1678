"""Framework integrations of the uneven split: Ray Train, DeepSpeed, Megatron-LM, Alpa.

Ray Train runs for real on a local Ray (CPU, 127.0.0.1): a TorchTrainer whose workers take
the plan's shares trains to the same parameters as one process on the whole global batch.
DeepSpeed runs its engine in a gloo group with per-rank micro-batches and the same
weighting. Megatron: megatron-core's config objects and data samplers check the mapping, and
its forward/backward steps train exactly with uneven micro-batch counts. Both loops also take
a signed rebalance through the training plugin mid-run. DeepSpeed's pipeline engine runs on
a plan's stage boundaries, and a rebalance's `layers` move them in the running engine.
Alpa's export is checked as data only (Alpa is archived; its jaxlib is not on PyPI).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import test_training_gradients as tg  # noqa: E402  (the gloo harness, models and reference)

from fleetwise.actuators import Keyring  # noqa: E402
from fleetwise.training import ShareSampler, WeightedHookState, weighted_comm_hook  # noqa: E402
from fleetwise.training.frameworks import ray_train  # noqa: E402
from fleetwise.training.frameworks.ray_train import assign_plan_ranks, plan_trainer  # noqa: E402

PLUGIN_KEYS = Keyring.parse("k1=test-secret-one-0123456789")  # signs the commands, the plugin checks them
REBALANCE = {"samples": {"0": 2, "1": 4, "2": 6}, "global_samples": 12}  # from shares 6/2/4


def _plugin(job: str, model: Any, optimizer: Any, sampler: Any, bus: str, rank: int) -> Any:
    """A rank's training plugin on the file bus (commands only: no step telemetry)."""
    from fleetwise.training.control import TrainingPlugin
    from fleetwise.training.transport import LocalTransport

    return TrainingPlugin(job=job, model=model, optimizer=optimizer, sampler=sampler,
                          transport=LocalTransport(bus), keys=PLUGIN_KEYS, node="n0", gpu=rank,
                          model_name="H100", telemetry=False)


def _bus_with_rebalance(root: Path, job: str, params: dict[str, Any] = REBALANCE) -> Any:
    """A file bus holding one signed rebalance (`REBALANCE` unless `params`) for ``job``."""
    import time

    from fleetwise.actuators import sign
    from fleetwise.schemas import Command
    from fleetwise.schemas import topics as T
    from fleetwise.training.transport import LocalTransport

    bus = LocalTransport(root)
    now = time.time()
    bus.publish(T.COMMANDS_TRAINING.name, job, sign(Command(
        id=f"rb-{job}", type="rebalance", ts=now, job=job, reason="rank 0 slowed to 0.4", seq=1,
        expires_ts=now + 600, params=params), PLUGIN_KEYS))
    return bus


def _applied_step(bus: Any, job: str) -> int:
    """The step the group applied the rebalance at: one `done` ack, with the new shares."""
    from fleetwise.schemas import Ack
    from fleetwise.schemas import topics as T

    done = [a for a in bus.poll(T.ACKS.name, job) if isinstance(a, Ack) and a.status == "done"]
    assert [a.command_id for a in done] == [f"rb-{job}"]  # applied once, for the group
    assert done[0].result["samples"] == REBALANCE["samples"]
    assert 0 < done[0].step < tg.STEPS - 1
    return done[0].step


def _map(shares: list[int]) -> dict[str, Any]:
    total = sum(shares)
    return {
        "job": "test",
        "global_batch": total,
        "seq_len": 16,
        "dp": len(shares),
        "tp": 1,
        "pp": 1,
        "gradient_reduction": "sum",
        "replicas": [{"dp_rank": i, "samples": s, "grad_weight": s / total} for i, s in enumerate(shares)],
        "ranks": [
            {
                "rank": i,
                "node": "n0",
                "gpu": i,
                "dp_rank": i,
                "tp_rank": 0,
                "stage": 0,
                "micro_batch": s,
                "num_micro_batches": 1,
                "samples": s,
                "grad_weight": s / total,
            }
            for i, s in enumerate(shares)
        ],
    }


# ---- Ray Train ---------------------------------------------------------------------------------

RAY_SHARES = [9, 3]
RAY_REBALANCE = (2, [4, 8])  # from step 2 the shares swap weight (a live rebalance)


def _ray_loop(config: dict[str, Any]) -> None:
    """Train the test MLP with the plan's shares inside a Ray Train worker."""
    import ray.train.torch

    from fleetwise.training import ShareSampler, WeightedHookState, weighted_comm_hook
    from fleetwise.training.frameworks.ray_train import worker_share

    torch.set_num_threads(1)
    share = worker_share(config)
    # DDP on CPU over gloo; the MLP has a deliberately unused layer.
    model = ray.train.torch.prepare_model(
        tg.build("mlp"), parallel_strategy_kwargs={"find_unused_parameters": True}
    )
    state = WeightedHookState(local_samples=share.local_samples, global_samples=share.global_batch)
    model.register_comm_hook(state, weighted_comm_hook)
    opt = tg.optimizer(model)
    x, y, _ = tg.data("mlp")
    sampler = ShareSampler(tg.N_SAMPLES, share.shares, share.dp_rank, seed=3)
    from_step, new_shares = config["rebalance"]
    for step in range(tg.STEPS):
        if step == from_step:
            sampler.set_shares(new_shares, from_step)
        idx = sampler.indices(step)
        state.set_samples(len(idx), sampler.global_samples(step))
        opt.zero_grad(set_to_none=True)
        tg.sample_loss(model, x[idx], y[idx]).backward()
        opt.step()
    if share.world_rank == 0:
        torch.save(tg.params(model), config["out"])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ray_torch_trainer_workers_take_plan_shares(tmp_path):
    ray = pytest.importorskip("ray")
    from ray.train import RunConfig

    # Ray workers import this module (and the gradient tests' helpers) by name from tests/.
    tests_dir = str(Path(__file__).resolve().parent)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": tests_dir}},
    )
    try:
        out = tmp_path / "params.pt"
        trainer = plan_trainer(
            _ray_loop,
            _map(RAY_SHARES),
            train_loop_config={"out": str(out), "rebalance": RAY_REBALANCE},
            resources_per_worker={"CPU": 0.5},
            run_config=RunConfig(storage_path=str(tmp_path / "ray"), name="fleetwise-test"),
        )
        assert trainer.train_loop_config[ray_train.CONFIG_KEY]["shares"] == RAY_SHARES
        result = trainer.fit()
        assert result.error is None
        got = torch.load(out, weights_only=False)
    finally:
        ray.shutdown()
    truth = tg.reference("mlp")
    assert tg.rel_err(got, truth) < tg.TOL
    assert tg.rel_err(truth, tg.params(tg.build("mlp"))) > 1e-3


def test_assign_plan_ranks_matches_gpu_types():
    # Ray put an H100 worker first, the plan put B200 replicas first.
    assert assign_plan_ranks(["H100", "B200", "B200"], ["B200", "B200", "H100"]) == [2, 0, 1]
    assert assign_plan_ranks([None, None], [None, None]) == [0, 1]
    assert assign_plan_ranks(["H100", None], [None, "H100"]) == [1, 0]
    with pytest.raises(ValueError, match="3 Ray workers"):
        assign_plan_ranks([None] * 3, [None] * 2)


def test_plan_trainer_uses_ray_scaling_config_types():
    pytest.importorskip("ray")
    scaling = {
        "num_workers": 2,
        "use_gpu": True,
        "resources_per_worker": {"GPU": 1},
        "accelerator_type": None,
        "placement_strategy": "PACK",
        "worker_groups": [
            {"gpu_model": "b200", "accelerator_type": "B200", "num_workers": 1, "ranks": [0]},
            {"gpu_model": "h100-sxm", "accelerator_type": "H100", "num_workers": 1, "ranks": [1]},
        ],
    }
    trainer = plan_trainer(lambda config: None, _map([10, 6]), scaling=scaling)
    cfg = trainer.train_loop_config[ray_train.CONFIG_KEY]
    assert cfg == {"shares": [10, 6], "global_batch": 16, "accelerator_types": ["B200", "H100"]}
    with pytest.raises(ValueError, match="tp=2"):
        plan_trainer(lambda config: None, {**_map([4, 4]), "tp": 2})


# keep names used by the Ray loop importable for static checkers
_ = (ShareSampler, WeightedHookState, weighted_comm_hook, json, Path)


# ---- DeepSpeed -----------------------------------------------------------------------------------

# Per-rank (micro_batch, num_micro_batches) = (3, 2), (2, 1), (2, 2): shares 6, 2, 4.
DS_MAP_MICRO = [(3, 2), (2, 1), (2, 2)]


def _ds_map() -> dict[str, Any]:
    mb = _map([m * c for m, c in DS_MAP_MICRO])
    for row, (m, c) in zip(mb["ranks"], DS_MAP_MICRO, strict=True):
        row["micro_batch"], row["num_micro_batches"] = m, c
    return mb


def _ds_worker(rank: int, world: int, stages: list[int], bus: str | None = None) -> dict[str, Any]:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    from fleetwise.training.frameworks.deepspeed import micro_batches, rank_config, weighted_backward

    deepspeed.init_distributed(dist_backend="gloo")  # joins the harness's process group
    mb = _ds_map()
    results: dict[str, Any] = {}
    # DeepSpeed reduces fp32/fp16/bf16 gradients only (engine.split_half_float_double_sparse).
    x, y, _ = tg.data("mlp", torch.float32)
    for stage in stages:
        base = {  # the shape of fleetwise.planner.exports.deepspeed_config's output
            "train_batch_size": mb["global_batch"],
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage, "overlap_comm": stage > 0, "reduce_scatter": True},
            "steps_per_print": 1000,
            "zero_allow_untested_optimizer": True,  # a plain torch SGD under ZeRO-1
        }
        config = rank_config(base, mb, rank)
        model = tg.build("mlp", torch.float32)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=tg.optimizer(model), config=config)
        sampler = ShareSampler(tg.N_SAMPLES, [r["samples"] for r in mb["replicas"]], rank, seed=3)
        micro = config["train_micro_batch_size_per_gpu"]
        plugin = None
        if bus is not None:  # rebalances come as signed commands, through the training plugin
            plugin = _plugin("ds", engine.module, engine.optimizer, sampler, bus, rank)
        shares_seen, micro_seen = [], []
        for step in range(tg.STEPS):
            if plugin is None and step == tg.UNEVEN[1][0]:
                sampler.set_shares(tg.UNEVEN[1][1], step)  # a rebalance: rank 1 drops to zero samples
            total = sampler.global_samples(step)
            shares_seen.append(list(sampler.shares_at(step)))
            # An empty share (rank 1 from step 2) runs one dummy micro-batch with weight 0.
            chunks = micro_batches(sampler.indices(step), micro)
            micro_seen.append(len(chunks))
            for chunk, counted in chunks:
                weighted_backward(engine, tg.sample_loss(engine, x[chunk], y[chunk]), counted, total)
            engine.step()
            if plugin is not None:
                plugin.end_step(samples=len(sampler.indices(step)), micro_batch=micro)
        if plugin is not None:
            plugin.acks.flush()
        results[stage] = {"params": tg.params(engine.module), "config": config, "shares": shares_seen,
                          "microbatches": micro_seen}
    return results


@contextmanager
def _removing_deepspeed_shm() -> Iterator[None]:
    """DeepSpeed's CPU accelerator leaves shared-memory buffers behind: remove the new ones."""
    shm = Path("/dev/shm")
    before = set(shm.glob("deepspeed_*")) if shm.is_dir() else set()
    try:
        yield
    finally:
        for leftover in (set(shm.glob("deepspeed_*")) if shm.is_dir() else set()) - before:
            leftover.unlink(missing_ok=True)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeed_engine_uneven_micro_batches_equal_single_process(tmp_path):
    pytest.importorskip("deepspeed")
    stages = [0, 1]
    with _removing_deepspeed_shm():
        results = tg.run_workers(_ds_worker, tg.WORLD, tmp_path, stages=stages)
    # fp32 (DeepSpeed does not reduce float64): agreement to fp32 rounding, while the
    # 1/dp average DeepSpeed does by default lands far away (the weighting is what matters).
    # The MLP's last two tensors are its never-used layer: DeepSpeed gives it zero gradients
    # (so weight decay moves it) where torch leaves None; the trained layers are compared.
    used = slice(0, 4)
    truth = tg.reference("mlp", dtype=torch.float32)[used]
    init = tg.params(tg.build("mlp", torch.float32))[used]
    for stage in stages:
        for rank, res in enumerate(results):
            got = res[stage]
            assert got["config"]["train_micro_batch_size_per_gpu"] == DS_MAP_MICRO[rank][0]
            assert got["config"]["gradient_accumulation_steps"] == DS_MAP_MICRO[rank][1]
            assert tg.rel_err(got["params"][used], truth) < 1e-5, (stage, rank)
    assert tg.rel_err(truth, init) > 1e-3
    assert tg.rel_err(results[0][0]["params"][used], _uniform_average_fp32()[used]) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_signed_rebalance_reaches_a_deepspeed_engine_loop_through_the_plugin(tmp_path):
    """The DeepSpeed loop (ZeRO 1, unmanaged accumulation) takes its micro-batches from the
    plugin's ShareSampler: a rebalance command changes each rank's accumulation count at a step
    boundary, and the engine still trains to one process's parameters."""
    pytest.importorskip("deepspeed")
    bus = _bus_with_rebalance(tmp_path / "bus", "ds")
    with _removing_deepspeed_shm():
        results = tg.run_workers(_ds_worker, tg.WORLD, tmp_path / "out", stages=[1],
                                 bus=str(tmp_path / "bus"))
    at = _applied_step(bus, "ds")
    used = slice(0, 4)  # as above: the never-used layer differs by design
    truth = tg.reference("mlp", dtype=torch.float32)[used]
    for rank, res in enumerate(results):
        got = res[1]
        assert got["shares"][:at] == [[6, 2, 4]] * at and got["shares"][at:] == [[2, 4, 6]] * (tg.STEPS - at)
        micro = DS_MAP_MICRO[rank][0]
        assert got["microbatches"][:at] == [DS_MAP_MICRO[rank][1]] * at
        assert got["microbatches"][at:-1] == [-(-(2 * rank + 2) // micro)] * (tg.STEPS - 1 - at)
        assert tg.rel_err(got["params"][used], truth) < 1e-5, rank


# ---- DeepSpeed's pipeline engine: the plan's stage boundaries, moved by a rebalance ------------

PIPE_STEPS, PIPE_MICRO, PIPE_GAS = 10, 2, 4  # steps; micro-batch size; micro-batches per step
# The module: an input layer, 4 planned layers, a head. The plan's layout counts the 4:
PIPE_LAYOUT = {0: (0, 0), 1: (1, 3)}  # stage 0: input + layer 0; stage 1: layers 1-3 + head
PIPE_RESPLIT = {"0": [0, 2], "1": [3, 3]}  # the rebalance: layers 1-2 move to stage 0


def _pipe_layers() -> list[Any]:
    torch.manual_seed(5)  # every rank and the reference build the same layers
    planned = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()) for _ in range(4)]
    return [torch.nn.Linear(6, 6), *planned, torch.nn.Linear(6, 6)]


def _pipe_data() -> list[list[tuple[Any, Any]]]:
    g = torch.Generator().manual_seed(9)
    return [[(torch.randn(PIPE_MICRO, 6, generator=g), torch.randn(PIPE_MICRO, 6, generator=g))
             for _ in range(PIPE_GAS)] for _ in range(PIPE_STEPS)]


def _pipe_loss(out: Any, target: Any) -> Any:
    return (out - target).pow(2).mean()


def _pipe_optimizer(params: Any) -> Any:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # momentum: state that must move too


def _ds_pipe_worker(rank: int, world: int, bus: str, ckpt: str) -> dict[str, Any]:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    from fleetwise.training.control import TrainingPlugin
    from fleetwise.training.frameworks.deepspeed import PipelineStages
    from fleetwise.training.transport import LocalTransport

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_batch_size": PIPE_MICRO * PIPE_GAS, "train_micro_batch_size_per_gpu": PIPE_MICRO,
              "gradient_accumulation_steps": PIPE_GAS, "steps_per_print": 10**6}
    stages = PipelineStages(_pipe_layers(), PIPE_LAYOUT, config, optimizer=_pipe_optimizer,
                            leading=1, trailing=1, loss_fn=_pipe_loss)
    batch = PIPE_MICRO * PIPE_GAS  # one data-parallel replica: every stage reads the whole batch
    sampler = ShareSampler(PIPE_STEPS * batch, [batch] + [0] * (world - 1), rank)
    plugin = TrainingPlugin(job="dspipe", model=stages.engine.module, optimizer=stages.engine.optimizer,
                            sampler=sampler, transport=LocalTransport(bus), keys=PLUGIN_KEYS, node="n0",
                            gpu=rank, model_name="H100", telemetry=False, checkpoint_dir=ckpt,
                            sync_every=2, stage=stages.stage, layers=stages.layers,
                            rebuild=stages.rebuild)
    losses, held = [], []
    for micro_batches in _pipe_data():
        engine = stages.engine  # a re-split replaces it
        losses.append(float(engine.train_batch(data_iter=iter(micro_batches))))
        held.append(sorted({int(name.split(".")[0]) for name, _ in engine.module.named_parameters()}))
        plugin.end_step(samples=batch if rank == 0 else 0)
    plugin.acks.flush()
    return {"losses": losses, "held": held, "layers": plugin.layers}


def _pipe_reference() -> list[float]:
    """One process, the whole model, the same micro-batches and accumulation: each step's mean loss."""
    model = torch.nn.Sequential(*_pipe_layers())
    opt = _pipe_optimizer(model.parameters())
    out = []
    for micro_batches in _pipe_data():
        opt.zero_grad()
        total = 0.0
        for x, y in micro_batches:
            loss = _pipe_loss(model(x), y) / PIPE_GAS
            loss.backward()
            total += float(loss.detach())
        opt.step()
        out.append(total)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rebalance_moves_the_stage_boundaries_of_a_deepspeed_pipeline_engine(tmp_path):
    """DeepSpeed's pipeline engine on the plan's boundaries (not its own partitioning); a signed
    rebalance with `layers` moves two layers to stage 0 at a step boundary, in the running
    processes, and the losses stay those of one process training the whole model (momentum
    included: the optimizer state moved with its layers)."""
    pytest.importorskip("deepspeed")
    from fleetwise.schemas import Ack
    from fleetwise.schemas import topics as T

    bus = _bus_with_rebalance(tmp_path / "bus", "dspipe", {"layers": PIPE_RESPLIT})
    with _removing_deepspeed_shm():
        results = tg.run_workers(_ds_pipe_worker, 2, tmp_path / "out", bus=str(tmp_path / "bus"),
                                 ckpt=str(tmp_path / "ckpt"))
    done = [a for a in bus.poll(T.ACKS.name, "dspipe") if isinstance(a, Ack) and a.status == "done"]
    assert [a.command_id for a in done] == ["rb-dspipe"] and done[0].result["layers"] == PIPE_RESPLIT
    at = done[0].step
    assert 2 <= at <= 4  # at a boundary (sync_every=2) near the start: most steps run re-split
    # Module layers (the planned ones shifted by the input layer): 0-1 | 2-5, then 0-3 | 4-5.
    held = {0: [[0, 1]] * at + [[0, 1, 2, 3]] * (PIPE_STEPS - at),
            1: [[2, 3, 4, 5]] * at + [[4, 5]] * (PIPE_STEPS - at)}
    for rank, res in enumerate(results):
        assert res["held"] == held[rank], rank
        assert res["layers"] == tuple(PIPE_RESPLIT[str(rank)])
    reference = _pipe_reference()
    assert reference[-1] < 0.8 * reference[0]  # it trains
    for rank, res in enumerate(results):
        diff = max(abs(a - b) / abs(b) for a, b in zip(res["losses"], reference, strict=True))
        assert diff < 1e-5, (rank, res["losses"], reference)


def _ds_refused_rebuild_worker(rank: int, world: int) -> dict[str, Any]:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    from fleetwise.training.frameworks.deepspeed import PipelineStages

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_batch_size": PIPE_MICRO, "train_micro_batch_size_per_gpu": PIPE_MICRO,
              "gradient_accumulation_steps": 1, "steps_per_print": 10**6}
    stages = PipelineStages(_pipe_layers(), {0: (0, 3)}, config, optimizer=_pipe_optimizer,
                            leading=1, trailing=1, loss_fn=_pipe_loss)
    engine, refused = stages.engine, []
    for layers, layout in [((0, 2), {0: (0, 3)}), ((0, 1), {0: (0, 1), 1: (2, 3)}),
                           ((0, 3), {0: (0, 4)})]:
        try:
            stages.rebuild(layers, layout)
        except ValueError as exc:
            refused.append(str(exc))
    return {"refused": refused, "same_engine": stages.engine is engine, "layout": stages.layout}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_refused_pipeline_rebuild_leaves_the_running_engine(tmp_path):
    """A layout the running pipeline cannot take (other layers for this stage, another stage
    count, a wrong layer count) is refused with the reason before anything is built."""
    pytest.importorskip("deepspeed")
    with _removing_deepspeed_shm():
        (res,) = tg.run_workers(_ds_refused_rebuild_worker, 1, tmp_path)
    assert res["same_engine"] and res["layout"] == {0: (0, 3)}
    assert res["refused"][0] == "rebuild: the plugin asked for layers (0, 2), the layout gives stage 0 (0, 3)"
    assert res["refused"][1] == "rebuild: the layout has 2 stages, the running pipeline 1"
    assert "the stages end at layer 4, the model's last is 3" in res["refused"][2]
    assert len(res["refused"]) == 3


def test_pipeline_stage_bounds_take_a_plans_layout_and_name_what_is_wrong():
    from fleetwise.training.frameworks.deepspeed import PipelineStages, stage_bounds

    assert stage_bounds({0: (0, 0), 1: (1, 3)}, 4) == [0, 1, 4]
    assert stage_bounds({"1": [2, 3], "0": [0, 1]}, 4) == [0, 2, 4]  # a rebalance's JSON form
    # An embedding before the planned layers and a head after them stay with the end stages.
    assert stage_bounds({0: (0, 0), 1: (1, 2), 2: (3, 3)}, 7, leading=2, trailing=1) == [0, 3, 5, 7]
    with pytest.raises(ValueError, match="the model's last is 2 .of 6 module layers, 2 before and 1"):
        stage_bounds({0: (0, 3)}, 6, leading=2, trailing=1)
    for layout, says in [({0: (0, 1), 1: (3, 3)}, "stage 1 holds layers 3-3"),
                         ({0: (0, 1)}, "end at layer 1"), ({1: (0, 3)}, "do not cover 0..0"),
                         ({0: (0, 2), 1: (3, 2)}, "stage 1 holds layers 3-2"), ({0: "x"}, "integers")]:
        with pytest.raises(ValueError, match=says):
            stage_bounds(layout, 4)
    with pytest.raises(ValueError, match="ZeRO stage 0 .the config has 1"):
        PipelineStages([], {0: (0, 0)}, {"zero_optimization": {"stage": 1}})


def _uniform_average_fp32() -> list[Any]:
    """What DeepSpeed's default (mean of the ranks' mean gradients) trains to with these shares."""
    model = tg.build("mlp", torch.float32)
    opt = tg.optimizer(model)
    x, y, _ = tg.data("mlp", torch.float32)
    sampler = ShareSampler(tg.N_SAMPLES, [m * c for m, c in DS_MAP_MICRO], 0, seed=3)
    for step in range(tg.STEPS):
        if step == tg.UNEVEN[1][0]:
            sampler.set_shares(tg.UNEVEN[1][1], step)
        opt.zero_grad()
        ranks = [sampler.indices(step, r) for r in range(tg.WORLD)]
        loss = sum(tg.sample_loss(model, x[idx], y[idx]) for idx in ranks if idx) / tg.WORLD
        loss.backward()
        opt.step()
    return tg.params(model)


def test_deepspeed_rank_config_from_planner_export():
    from fleetwise.planner.exports import deepspeed_config, microbatch_map
    from fleetwise.training.frameworks.deepspeed import micro_batches, micro_weight, rank_config

    plan = _mixed_plan()
    base = deepspeed_config(plan)
    mb = microbatch_map(plan)
    for row in mb["ranks"]:
        cfg = rank_config(base, mb, row["rank"])
        assert cfg["train_micro_batch_size_per_gpu"] == row["micro_batch"]
        assert cfg["gradient_accumulation_steps"] == row["num_micro_batches"]
        assert cfg["gradient_allreduce_op"] == "sum" and cfg["managed_gradient_accumulation"] is False
        assert "train_batch_size" not in cfg
        assert cfg["zero_optimization"]["stage"] == base["zero_optimization"]["stage"]
    assert base["train_batch_size"] == plan.global_batch  # the shared export is unchanged
    assert micro_batches(list(range(7)), 3) == [([0, 1, 2], 3), ([3, 4, 5], 3), ([6], 1)]
    assert micro_batches([], 3, dummy=5) == [([5], 0)] and micro_batches([], 3, dummy=None) == []
    assert micro_weight(3, 12) == 0.25
    with pytest.raises(ValueError, match="global_samples"):
        micro_weight(1, 0)
    with pytest.raises(ValueError, match="pp=2"):
        rank_config(base, {**mb, "pp": 2}, 0)


def _mixed_plan():
    """A real planner plan for a mixed H100/B200 fleet, pure data parallelism (uneven shares)."""
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model

    request = PlanRequest(
        model=resolve_model("gpt-1.3b"), global_batch=128, strategy=(1, 1, 8), zero_stages=(1,)
    )
    plan = plan_job(request, parse_gpu_spec("h100-sxm:4,b200:4"))
    assert len({r.samples for r in plan.ranks}) > 1, "the test needs an uneven plan"
    return plan


# ---- Megatron-LM (megatron-core) -------------------------------------------------------------------

MEGATRON_MICRO = [(3, 2), (1, 2), (2, 2)]  # (micro_batch_size, num_microbatches) per replica: 6, 2, 4


class _MegatronMLP(tg.MLP):
    """The test MLP with the hook megatron-core's forward_step calls on every model."""

    def set_input_tensor(self, input_tensor: Any) -> None:  # first pipeline stage: no input
        pass


def _megatron_worker(rank: int, world: int, bus: str | None = None) -> dict[str, Any]:
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fleetwise.training.frameworks.megatron import (
        finalize_per_token_grads,
        megatron_rank_schedule,
        per_sample_loss_func,
    )

    mb = _map([m * c for m, c in MEGATRON_MICRO])
    for row, (m, c) in zip(mb["ranks"], MEGATRON_MICRO, strict=True):
        row["micro_batch"], row["num_micro_batches"] = m, c
    schedule = megatron_rank_schedule(mb, rank)
    config = TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, calculate_per_token_loss=True
    )
    torch.manual_seed(11)
    model = _MegatronMLP().double()
    opt = tg.optimizer(model)
    x, y, _ = tg.data("mlp")
    sampler = ShareSampler(tg.N_SAMPLES, [r["samples"] for r in mb["replicas"]], rank, seed=3)

    def forward_step_func(data_iterator: Any, model: Any) -> tuple[Any, Any]:
        idx = next(data_iterator)
        out = model(x[idx])
        return out, lambda output: per_sample_loss_func((output - y[idx]).pow(2).mean(dim=1))

    plugin = None
    if bus is not None:  # the training plugin in the loop: commands from the bus, at step boundaries
        plugin = _plugin("mg", model, opt, sampler, bus, rank)
    tokens_seen, shares_seen, micro_seen = [], [], []
    for step in range(tg.STEPS):
        shares_seen.append(list(sampler.shares_at(step)))
        idx = sampler.indices(step)
        micro = schedule["micro_batch_size"]
        chunks = [idx[i : i + micro] for i in range(0, len(idx), micro)]  # the last may be short
        opt.zero_grad(set_to_none=True)
        data_iterator = iter(chunks)
        micro_seen.append(len(chunks))
        total_tokens = torch.zeros([], dtype=torch.int)
        for i in range(len(chunks)):  # this replica's own num_microbatches
            output, num_tokens = forward_step(
                forward_step_func, data_iterator, model, len(chunks), None, [], config,
                cp_group_size=1, is_first_microbatch=(i == 0), is_last_stage=True,
            )  # fmt: skip
            total_tokens += num_tokens
            backward_step(None, output, None, ModelType.encoder_or_decoder, config)
        tokens_seen.append(finalize_per_token_grads(model, int(total_tokens)))
        opt.step()
        if plugin is not None:
            plugin.end_step(samples=len(idx), micro_batch=micro)
    if plugin is not None:
        plugin.acks.flush()
    return {"params": tg.params(model), "schedule": schedule, "tokens": tokens_seen, "shares": shares_seen,
            "microbatches": micro_seen}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_megatron_core_per_token_loss_with_uneven_microbatch_counts(tmp_path):
    pytest.importorskip("megatron.core")
    results = tg.run_workers(_megatron_worker, tg.WORLD, tmp_path)
    truth = tg.reference("mlp")
    for rank, res in enumerate(results):
        assert res["schedule"]["micro_batch_size"] == MEGATRON_MICRO[rank][0]
        assert res["schedule"]["num_microbatches"] == MEGATRON_MICRO[rank][1]
        # Global counts as Megatron's finalize_model_grads sees them: 12 per step, 6 at the end.
        assert res["tokens"] == [12.0, 12.0, 12.0, 12.0, 6.0]
        assert tg.rel_err(res["params"], truth) < tg.TOL, rank


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_signed_rebalance_reaches_a_megatron_core_loop_through_the_plugin(tmp_path):
    """Megatron's loop takes its micro-batches from the plugin's ShareSampler, so a rebalance
    command changes each replica's number of micro-batches at a step boundary; with per-token
    loss the parameters stay those of one process on the whole batch."""
    pytest.importorskip("megatron.core")
    bus = _bus_with_rebalance(tmp_path / "bus", "mg")
    results = tg.run_workers(_megatron_worker, tg.WORLD, tmp_path / "out", bus=str(tmp_path / "bus"))
    at = _applied_step(bus, "mg")
    truth = tg.reference("mlp")
    for rank, res in enumerate(results):
        assert res["shares"][:at] == [[6, 2, 4]] * at
        assert res["shares"][at:] == [[2, 4, 6]] * (tg.STEPS - at)
        assert res["tokens"] == [12.0, 12.0, 12.0, 12.0, 6.0]  # the global batch, however split
        # Megatron's num_microbatches per replica follows: ceil(share / its micro-batch size).
        micro = MEGATRON_MICRO[rank][0]
        assert res["microbatches"][:at] == [2] * at
        assert res["microbatches"][at:-1] == [-(-(2 * rank + 2) // micro)] * (tg.STEPS - 1 - at)
        assert tg.rel_err(res["params"], truth) < tg.TOL, rank


def test_megatron_plan_args_add_per_token_loss_to_planner_export():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fleetwise.planner import resolve_model
    from fleetwise.planner.exports import megatron_arg_dict, microbatch_map
    from fleetwise.training.frameworks.megatron import megatron_plan_args, megatron_rank_schedule

    plan = _mixed_plan()
    model = resolve_model("gpt-1.3b")
    args = megatron_plan_args(plan, model)
    assert args["calculate_per_token_loss"] is True
    exported = megatron_arg_dict(plan, model)
    assert {k: v for k, v in args.items() if k != "calculate_per_token_loss"} == exported
    config = TransformerConfig(
        num_layers=args["num_layers"],
        hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        calculate_per_token_loss=args["calculate_per_token_loss"],
    )
    assert config.calculate_per_token_loss
    mb = microbatch_map(plan)
    schedules = [megatron_rank_schedule(mb, row["rank"]) for row in mb["ranks"]]
    assert sum(s["samples"] for s in schedules) == plan.global_batch  # tp = pp = 1 here
    for s in schedules:
        assert s["micro_batch_size"] * s["num_microbatches"] == s["samples"]


# ---- Alpa (export only, untested against Alpa) ------------------------------------------------------


def test_alpa_manual_stage_option_follows_plan_stages():
    from fleetwise.planner import PlanRequest, parse_gpu_spec, plan_job, resolve_model
    from fleetwise.planner.exports import stage_layer_counts
    from fleetwise.training.frameworks.alpa import alpa_stage_option

    model = resolve_model("gpt-1.3b")
    request = PlanRequest(model=model, global_batch=128, strategy=(1, 2, 4), zero_stages=(0,))
    plan = plan_job(request, parse_gpu_spec("h100-sxm:4,b200:4"))
    export = alpa_stage_option(plan, model.layers)
    option = export["stage_option"]
    # Exactly the fields of alpa.ManualStageOption (alpa/pipeline_parallel/stage_construction.py).
    assert set(option) == {
        "forward_stage_layer_ids",
        "submesh_physical_shapes",
        "submesh_logical_shapes",
        "submesh_autosharding_option_dicts",
    }
    counts = stage_layer_counts(plan, model.layers)
    assert [len(ids) for ids in option["forward_stage_layer_ids"]] == counts
    assert [i for ids in option["forward_stage_layer_ids"] for i in ids] == list(range(model.layers))
    assert export["layer_num"] == model.layers
    shapes = zip(option["submesh_physical_shapes"], option["submesh_logical_shapes"], strict=True)
    for physical, logical in shapes:
        assert physical[0] * physical[1] == plan.dp * plan.tp == logical[0] * logical[1]
    assert export["num_micro_batches"] * export["micro_batch"] * plan.dp == plan.global_batch
    assert export["tested"] is False
