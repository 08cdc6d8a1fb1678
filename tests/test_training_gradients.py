"""Exact uneven data parallelism on real torch.distributed (gloo, CPU, separate processes).

Every multi-process test trains 3 ranks with uneven shares that change mid-run (one rank
drops to zero samples) and checks that parameters after several steps match both the
uniform split of the same global batches and one process training on the whole global
batch (float64, relative error < 1e-9): through `allreduce_gradients`, DDP with
`weighted_comm_hook`, the token-weighted forms, and FSDP2 (`fully_shard`) with
`weighted_fsdp`. The sampler's no-skip/no-repeat property is checked with hypothesis.
"""

from __future__ import annotations

import os
import socket
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from fleetwise.training import (  # noqa: E402
    ShareSampler,
    TokenWeightedHookState,
    WeightedHookState,
    allreduce_gradients,
    allreduce_token_gradients,
    load_microbatch_map,
    shares_from_microbatch_map,
    weighted_comm_hook,
    weighted_fsdp,
)

WORLD = 3
N_SAMPLES = 54  # 4 full global batches of 12 and a short one of 6
GLOBAL = 12
UNIFORM = [4, 4, 4]
# Uneven shares; from step 2 rank 1 gets nothing (a rank with an empty share).
UNEVEN = [(0, [7, 2, 3]), (2, [9, 0, 3])]
STEPS = 5
TOL = 1e-9


# ---- multi-process harness (also used by test_training_frameworks.py) ----------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Any, kwargs: dict[str, Any], out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        result = fn(rank, world, **kwargs)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out, f"rank{rank}.err"), "w") as fh:
            fh.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_workers(fn: Any, world: int, out: Path, **kwargs: Any) -> list[Any]:
    """Run fn(rank, world, **kwargs) in `world` forked processes in one gloo group; their results.

    On failure the message holds every rank's traceback (the first rank to fail is often not
    the one torch reports: the others see a closed connection).
    """
    out.mkdir(parents=True, exist_ok=True)
    try:
        torch.multiprocessing.start_processes(
            _entry, args=(world, free_port(), fn, kwargs, str(out)), nprocs=world, start_method="fork"
        )
    except Exception as exc:
        errors = [p.read_text() for p in sorted(out.glob("rank*.err"))]
        errors.sort(key=lambda text: "Connection" in text)  # root causes first
        raise AssertionError("worker failed:\n" + "\n".join(errors)) from exc
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def rel_err(a: Any, b: Any) -> float:
    a = torch.cat([t.reshape(-1) for t in a])
    b = torch.cat([t.reshape(-1) for t in b])
    return float((a - b).norm() / b.norm())


# ---- models and data ---------------------------------------------------------------------------


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
        self.unused = torch.nn.Linear(2, 2)  # never used: its grad must stay None

    def forward(self, x: Any) -> Any:
        return self.net(x)


class TinyTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 8)
        self.layer = torch.nn.TransformerEncoderLayer(
            d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True
        )
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: Any, pad: Any = None) -> Any:
        return self.head(self.layer(self.proj(x), src_key_padding_mask=pad))


def build(name: str, dtype: Any = torch.float64) -> Any:
    torch.manual_seed(11)
    model = {"mlp": MLP, "transformer": TinyTransformer}[name]()
    return model.to(dtype)


def data(name: str, dtype: Any = torch.float64) -> tuple[Any, Any, Any]:
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 6, (N_SAMPLES,), generator=g)
    if name == "mlp":
        x = torch.randn(N_SAMPLES, 6, generator=g, dtype=torch.float64)
        y = torch.randn(N_SAMPLES, 3, generator=g, dtype=torch.float64)
    else:
        x = torch.randn(N_SAMPLES, 5, 6, generator=g, dtype=torch.float64)
        y = torch.randn(N_SAMPLES, 5, 3, generator=g, dtype=torch.float64)
    return x.to(dtype), y.to(dtype), lengths


def sample_loss(model: Any, x: Any, y: Any) -> Any:
    """Mean over samples (transformer: per sample, mean over its positions first)."""
    out = model(x)
    err = (out - y).pow(2)
    return err.flatten(1).mean(dim=1).mean()


def token_mask(lengths: Any) -> Any:
    return torch.arange(5)[None, :] < lengths[:, None]  # True = real token


def token_loss(model: Any, x: Any, y: Any, lengths: Any) -> Any:
    """Mean over this batch's real tokens (padding excluded)."""
    mask = token_mask(lengths)
    out = model(x, pad=~mask)
    err = (out - y).pow(2).mean(dim=-1)
    return (err * mask).sum() / mask.sum()


def optimizer(model: Any) -> Any:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def params(model: Any) -> list[Any]:
    model = getattr(model, "module", model)
    out = []
    for p in model.parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(full.detach().clone())
    return out


def schedule_sampler(rank: int, schedule: list[tuple[int, list[int]]]) -> ShareSampler:
    return ShareSampler(N_SAMPLES, schedule[0][1], rank, seed=3)


def apply_schedule(sampler: ShareSampler, schedule: list[tuple[int, list[int]]], step: int) -> None:
    """A rebalance at a step boundary, the same call on every rank."""
    for from_step, shares in schedule[1:]:
        if from_step == step:
            sampler.set_shares(shares, from_step)


def reference(name: str, tokens: bool = False, dtype: Any = torch.float64) -> list[Any]:
    """One process, whole global batch per step (the sampler's global order)."""
    model = build(name, dtype)
    opt = optimizer(model)
    x, y, lengths = data(name, dtype)
    sampler = ShareSampler(N_SAMPLES, UNIFORM, 0, seed=3)
    for step in range(STEPS):
        idx = sampler.global_indices(step)
        opt.zero_grad()
        if tokens:
            token_loss(model, x[idx], y[idx], lengths[idx]).backward()
        else:
            sample_loss(model, x[idx], y[idx]).backward()
        opt.step()
    return params(model)


# ---- workers -----------------------------------------------------------------------------------


def _plain_worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """allreduce_gradients after backward; global_samples given on odd steps, summed on even."""
    results: dict[str, Any] = {}
    for name in names:
        for label, schedule in (("uneven", UNEVEN), ("uniform", [(0, UNIFORM)])):
            model = build(name)
            opt = optimizer(model)
            x, y, _ = data(name)
            sampler = schedule_sampler(rank, schedule)
            seen = []
            for step in range(STEPS):
                apply_schedule(sampler, schedule, step)
                idx = sampler.indices(step)
                seen.extend(idx)
                opt.zero_grad(set_to_none=True)
                if idx:  # an empty share runs no backward: grads stay None and count as zeros
                    sample_loss(model, x[idx], y[idx]).backward()
                total = sampler.global_samples(step) if step % 2 else None
                allreduce_gradients(model, len(idx), total)
                if step == 0:
                    results[(name, label, "grad0")] = [
                        p.grad.clone() for p in model.parameters() if p.grad is not None
                    ]
                opt.step()
            results[(name, label)] = params(model)
            results[(name, label, "seen")] = seen
            if name == "mlp":
                results[(name, label, "unused_grad")] = [p.grad for p in model.unused.parameters()]
    # A wrong global count is refused on every rank.
    model = build("mlp")
    x, y, _ = data("mlp")
    sample_loss(model, x[:2], y[:2]).backward()
    try:
        allreduce_gradients(model, 2, global_samples=5)
        results["mismatch"] = None
    except ValueError as exc:
        results["mismatch"] = str(exc)
    return results


def _ddp_worker(rank: int, world: int, names: list[str]) -> dict[str, Any]:
    """DDP + weighted_comm_hook (uneven, counts changed between steps) vs plain DDP (uniform)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results: dict[str, Any] = {}
    for name in names:
        for label, schedule in (("uneven", UNEVEN), ("uniform", [(0, UNIFORM)])):
            model = DDP(build(name), find_unused_parameters=(name == "mlp"))
            state = WeightedHookState(local_samples=0, global_samples=GLOBAL)
            if label == "uneven":
                model.register_comm_hook(state, weighted_comm_hook)
            opt = optimizer(model)
            x, y, _ = data(name)
            sampler = schedule_sampler(rank, schedule)
            for step in range(STEPS):
                apply_schedule(sampler, schedule, step)
                idx = sampler.indices(step)
                # global_samples=None on the last step: the hook all-reduces the counts itself.
                total = sampler.global_samples(step) if step < STEPS - 1 else None
                state.set_samples(len(idx), total)
                opt.zero_grad(set_to_none=True)
                # An empty share still runs forward/backward (NaN mean loss): the hook zeroes it.
                sample_loss(model, x[idx], y[idx]).backward()
                opt.step()
            results[(name, label)] = params(model)
    return results


def _token_worker(rank: int, world: int) -> dict[str, Any]:
    """Token-weighted: allreduce_token_gradients (global summed) and DDP + TokenWeightedHookState."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    results: dict[str, Any] = {}
    x, y, lengths = data("transformer")
    for entry in ("allreduce", "ddp"):
        model = build("transformer")
        state = TokenWeightedHookState(local_tokens=1, global_tokens=None)
        if entry == "ddp":
            model = DDP(model)
            model.register_comm_hook(state, weighted_comm_hook)
        opt = optimizer(model)
        sampler = schedule_sampler(rank, UNEVEN)
        for step in range(STEPS):
            apply_schedule(sampler, UNEVEN, step)
            idx = sampler.indices(step)
            local, total = sampler.tokens(step, lengths.numpy())
            assert local == int(lengths[idx].sum())
            opt.zero_grad(set_to_none=True)
            if entry == "allreduce":
                if idx:
                    token_loss(model, x[idx], y[idx], lengths[idx]).backward()
                allreduce_token_gradients(model, local, None)
            else:
                # Counts from the sampler (no all-reduce) on even steps, found by the hook on odd.
                state.set_tokens(local, total if step % 2 == 0 else None)
                # An empty share runs a dummy one-sample batch (attention with a padding mask
                # rejects an empty batch); local_tokens=0 makes the hook ignore its gradient.
                batch = idx or [0]
                token_loss(model, x[batch], y[batch], lengths[batch]).backward()
            opt.step()
        results[entry] = params(model)
    return results


def _fsdp_worker(rank: int, world: int) -> dict[str, Any]:
    """FSDP2: weighted_fsdp (custom reduce-scatter) and the loss-scaling alternative."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, Any] = {}
    x, y, _ = data("transformer")
    for variant in ("comm", "loss_scale"):
        model = build("transformer")
        fully_shard(model.layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = WeightedHookState(local_samples=1, global_samples=GLOBAL)
        if variant == "comm":
            weighted_fsdp(model, state)
        else:
            for sub in model.modules():
                if hasattr(sub, "set_gradient_divide_factor"):
                    sub.set_gradient_divide_factor(1.0)
                    sub.set_force_sum_reduction_for_comms(True)
        opt = optimizer(model)
        sampler = schedule_sampler(rank, UNEVEN)
        for step in range(STEPS):
            apply_schedule(sampler, UNEVEN, step)
            idx = sampler.indices(step)
            total = sampler.global_samples(step)
            state.set_samples(len(idx), total)
            opt.zero_grad(set_to_none=True)
            if variant == "comm":
                loss = sample_loss(model, x[idx], y[idx])  # NaN for an empty share: zeroed in the comm
            else:
                # Scale the loss by local/global. Every rank runs exactly one forward and
                # backward (FSDP's all-gathers and reduce-scatters are collective): an empty
                # share runs one dummy sample with weight 0 (a zero loss, not NaN).
                batch = idx or [0]
                loss = sample_loss(model, x[batch], y[batch]) * (len(idx) / total)
            loss.backward()
            opt.step()
        results[variant] = params(model)
    return results


# ---- tests: gradients ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_allreduce_gradients_uneven_equals_uniform_and_single_process(tmp_path):
    names = ["mlp", "transformer"]
    results = run_workers(_plain_worker, WORLD, tmp_path, names=names)
    for name in names:
        truth = reference(name)
        for rank, res in enumerate(results):
            assert rel_err(res[(name, "uneven", "grad0")], res[(name, "uniform", "grad0")]) < TOL
            assert rel_err(res[(name, "uneven")], res[(name, "uniform")]) < TOL, (name, rank)
            assert rel_err(res[(name, "uneven")], truth) < TOL, (name, rank)
            assert rel_err(res[(name, "uneven")], results[0][(name, "uneven")]) == 0.0
        # Training moved the parameters (the comparison is not between two initial states).
        assert rel_err(truth, params(build(name))) > 1e-3
        # Every sample of the epoch was processed exactly once across ranks.
        seen = Counter(i for res in results for i in res[(name, "uneven", "seen")])
        assert sorted(seen) == list(range(N_SAMPLES)) and set(seen.values()) == {1}
    assert all(g is None for g in results[0][("mlp", "uneven", "unused_grad")])
    for res in results:
        assert res["mismatch"] is not None and "global_samples=5" in res["mismatch"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_weighted_comm_hook_uneven_equals_plain_ddp_uniform(tmp_path):
    names = ["mlp", "transformer"]
    results = run_workers(_ddp_worker, WORLD, tmp_path, names=names)
    for name in names:
        truth = reference(name)
        for res in results:
            assert rel_err(res[(name, "uniform")], truth) < TOL  # DDP's own averaging, equal shares
            assert rel_err(res[(name, "uneven")], res[(name, "uniform")]) < TOL
            assert rel_err(res[(name, "uneven")], truth) < TOL


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_token_weighted_variants_equal_global_token_mean(tmp_path):
    results = run_workers(_token_worker, WORLD, tmp_path)
    truth = reference("transformer", tokens=True)
    sample_truth = reference("transformer")
    for res in results:
        assert rel_err(res["allreduce"], truth) < TOL
        assert rel_err(res["ddp"], truth) < TOL
    # Sample weighting would be a different update (lengths vary), so the check has teeth.
    assert rel_err(truth, sample_truth) > 1e-4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp2_fully_shard_uneven_equals_single_process(tmp_path):
    results = run_workers(_fsdp_worker, WORLD, tmp_path)
    truth = reference("transformer")
    for res in results:
        assert rel_err(res["comm"], truth) < TOL
        assert rel_err(res["loss_scale"], truth) < TOL


def test_allreduce_gradients_rejects_bad_counts():
    model = build("mlp")
    with pytest.raises(ValueError, match="local_samples"):
        allreduce_gradients(model, -1)
    with pytest.raises(TypeError, match="global_samples"):
        allreduce_gradients(model, 1, "all")
    with pytest.raises(ValueError, match="exceeds"):
        WeightedHookState(local_samples=5, global_samples=4)
    with pytest.raises(ValueError, match="local_tokens"):
        TokenWeightedHookState(local_tokens=float("nan"))
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="not initialized"):
            allreduce_gradients(model, 1)


def test_hook_state_weights_follow_rebalance():
    state = WeightedHookState(local_samples=3, global_samples=12)
    assert state.weight() == 0.25
    state.set_samples(0, 12)
    assert state.weight() == 0.0
    state.local_samples, state.global_samples = 6, 8  # plain attributes work too
    assert state.weight() == 0.75
    state.set_samples(4, None)
    assert state.weight() is None
    tokens = TokenWeightedHookState(local_tokens=30, global_tokens=120)
    assert tokens.weight() == 0.25 and tokens.local_tokens == 30
    tokens.set_tokens(10, 20)
    assert tokens.weight() == 0.5 and tokens.global_tokens == 20


# ---- tests: sampler ----------------------------------------------------------------------------


def _all_indices(sampler_args: dict[str, Any], world_shares: list[int]) -> list[list[int]]:
    """Per step, the concatenation over ranks of what each rank's own sampler yields."""
    per_rank = [
        list(ShareSampler(**sampler_args, shares=world_shares, rank=r)) for r in range(len(world_shares))
    ]
    steps = len(per_rank[0])
    assert all(len(p) == steps for p in per_rank)
    return [[i for r in range(len(world_shares)) for i in per_rank[r][s]] for s in range(steps)]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 200),
    shares=st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(lambda s: sum(s) > 0),
    seed=st.integers(0, 2**31),
    drop_last=st.booleans(),
)
def test_sampler_covers_each_sample_once_for_random_shares(n, shares, seed, drop_last):
    args = {"num_samples": n, "seed": seed, "drop_last": drop_last}
    steps = _all_indices(args, shares)
    flat = [i for step in steps for i in step]
    assert len(flat) == len(set(flat))  # nothing repeated
    full, rest = divmod(n, sum(shares))
    if drop_last:
        assert len(flat) == full * sum(shares)
    else:
        assert sorted(flat) == list(range(n))  # nothing skipped
    for s, step in enumerate(steps):
        expected = sum(shares) if s < full else rest
        assert len(step) == expected
        # Each rank's list is its share (the short final batch pro rata: within 1 of exact).
        sampler = ShareSampler(n, shares, 0, seed=seed, drop_last=drop_last)
        split = sampler.split(s)
        for r, share in enumerate(shares):
            assert abs(split[r] - share * expected / sum(shares)) < 1


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(20, 150),
    before=st.lists(st.integers(0, 7), min_size=1, max_size=5).filter(lambda s: sum(s) > 0),
    after=st.lists(st.integers(0, 7), min_size=1, max_size=5).filter(lambda s: sum(s) > 0),
    switch=st.integers(0, 4),
    seed=st.integers(0, 1000),
)
def test_sampler_share_change_and_resize_mid_epoch_skip_nothing(n, before, after, switch, seed):
    """Shares (and the number of ranks) change at a step boundary; checkpoint/restore across it."""
    switch = min(switch, ShareSampler(n, before, 0).steps_in_epoch())
    seen: list[int] = []
    # Before the switch: len(before) ranks.
    olds = [ShareSampler(n, before, r, seed=seed) for r in range(len(before))]
    for step in range(switch):
        for s in olds:
            seen.extend(s.indices(step))
    for s in olds:
        s.set_position(0, switch)
    state = olds[0].state_dict()  # checkpoint at the boundary (any rank's dict)
    # After: a new world of len(after) ranks restores and applies the new shares.
    news = []
    for r in range(len(after)):
        s = ShareSampler(n, [1], r, seed=12345)
        s.load_state_dict(state)
        s.set_shares(after, switch)
        news.append(s)
    steps = [list(s) for s in news]
    assert len({len(x) for x in steps}) == 1
    for s in range(len(steps[0])):
        for r in range(len(after)):
            seen.extend(steps[r][s])
    assert sorted(seen) == list(range(n))


def test_sampler_resize_4_to_3_keeps_global_order():
    n = 100
    four = [ShareSampler(n, [5, 5, 5, 5], r, seed=9) for r in range(4)]
    for s in four:
        s.set_position(0, 2)
    state = four[0].state_dict()
    three = []
    for r in range(3):
        s = ShareSampler(n, [1], r)
        s.load_state_dict(state)
        s.set_shares([8, 6, 6], 2)
        three.append(s)
    uninterrupted = ShareSampler(n, [20], 0, seed=9)
    assert [i for s in three for i in s.indices(2)] == uninterrupted.global_indices(2)
    assert three[0].offset(2) == 40 and three[0].global_samples(2) == 20


def test_sampler_is_deterministic_and_resumable():
    a = ShareSampler(50, [3, 2], 1, seed=4)
    b = ShareSampler(50, [3, 2], 1, seed=4)
    assert list(a) == list(b)
    a.set_epoch(1)
    first = [next(iter(a)) for _ in range(3)]
    state = a.state_dict()
    rest_a = list(a)
    c = ShareSampler(50, [3, 2], 1, seed=0)
    c.load_state_dict(state)
    assert list(c) == rest_a
    b.set_epoch(1)
    assert [b.indices(s) for s in range(3)] == first
    other_seed = ShareSampler(50, [3, 2], 0, seed=5).order().tolist()
    assert ShareSampler(50, [3, 2], 0, seed=4).order().tolist() != other_seed
    assert sorted(other_seed) == list(range(50))
    assert ShareSampler(50, [3, 2], 0, shuffle=False).indices(1) == [5, 6, 7]


def test_sampler_rejects_bad_input():
    with pytest.raises(ValueError, match="shares"):
        ShareSampler(10, [0, 0], 0)
    with pytest.raises(ValueError, match=r"shares\[1\]"):
        ShareSampler(10, [1, -1], 0)
    with pytest.raises(ValueError, match="num_samples"):
        ShareSampler(0, [1], 0)
    s = ShareSampler(10, [2, 2], 3)
    with pytest.raises(ValueError, match="rank 3 has no share"):
        s.indices(0)
    with pytest.raises(ValueError, match="from_step"):
        s.set_shares([1, 1], 99)
    with pytest.raises(ValueError, match="10 samples"):
        ShareSampler(11, [1], 0).load_state_dict(s.state_dict())


def test_microbatch_map_from_plan_cli_loads_into_shares(tmp_path):
    """`fleetwise plan --microbatch-map` on a mixed H100/B200 fleet -> per-rank shares."""
    import json

    from typer.testing import CliRunner

    from fleetwise.cli import app

    path = tmp_path / "map.json"
    args = ["plan", "--model", "gpt-1.3b", "--gpus", "h100-sxm:4,b200:4", "--global-batch", "128"]
    result = CliRunner().invoke(app, [*args, "--microbatch-map", str(path)])
    assert result.exit_code == 0, result.output
    exported = json.loads(path.read_text())
    mb = load_microbatch_map(path)
    assert sum(mb.shares) == exported["global_batch"] == mb.global_batch == 128
    assert mb.shares == shares_from_microbatch_map(exported)
    assert len(set(mb.shares)) > 1  # the faster B200 replicas take more samples
    for row in exported["ranks"]:
        assert mb.local_samples(row["rank"]) == row["samples"]
        assert mb.micro_batches(row["rank"]) == (row["micro_batch"], row["num_micro_batches"])
        assert abs(row["grad_weight"] - mb.local_samples(row["rank"]) / mb.global_batch) < 1e-12
    rank = exported["ranks"][-1]["rank"]
    sampler = mb.sampler(1000, rank, seed=1)
    assert sampler.local_samples(0) == mb.local_samples(rank)
    with pytest.raises(ValueError, match="global_batch"):
        load_microbatch_map(dict(exported, global_batch=exported["global_batch"] + 1))
    with pytest.raises(ValueError, match="replicas"):
        load_microbatch_map({"global_batch": 1, "ranks": []})
    with pytest.raises(KeyError, match="rank 999"):
        mb.local_samples(999)


def test_sampler_serves_a_dataloader():
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.arange(30))
    sampler = ShareSampler(30, [4, 2], 1, seed=2)
    got = [batch[0].tolist() for batch in DataLoader(ds, batch_sampler=sampler)]
    assert got == [ShareSampler(30, [4, 2], 1, seed=2).indices(s) for s in range(5)]
    assert sampler.step == 5 and len(sampler) == 0
