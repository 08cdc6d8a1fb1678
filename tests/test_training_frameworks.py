"""Framework integrations of the uneven split: Ray Train, DeepSpeed, Megatron-LM, Alpa.

Ray Train runs for real on a local Ray (CPU, 127.0.0.1): a TorchTrainer whose workers take
the plan's shares trains to the same parameters as one process on the whole global batch.
DeepSpeed runs its engine in a gloo group with per-rank micro-batches and the same
weighting. Megatron: megatron-core's config objects and data samplers check the mapping.
Alpa's export is checked as data only (Alpa is archived; its jaxlib is not on PyPI).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import test_training_gradients as tg  # noqa: E402  (the gloo harness, models and reference)

from fleetwise.training import ShareSampler, WeightedHookState, weighted_comm_hook  # noqa: E402
from fleetwise.training.frameworks import ray_train  # noqa: E402
from fleetwise.training.frameworks.ray_train import assign_plan_ranks, plan_trainer  # noqa: E402


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
