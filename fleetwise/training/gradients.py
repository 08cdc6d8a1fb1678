"""Exact gradient averaging when data-parallel ranks process different numbers of samples.

The gradient of the global batch's mean loss is sum_i (n_i / N) * g_i, where rank i holds
n_i of the N samples and g_i is the gradient of the mean loss over its own n_i samples.
So every rank scales its gradient by n_i / N and the ranks SUM-all-reduce. Dividing by the
data-parallel size instead (what DDP and FSDP do by default) is only right when all n_i
are equal. The same holds for tokens: with a loss that is the mean over the rank's tokens,
the weight is the rank's share of the global batch's tokens.

Entry points (public contract, called by code outside this repository):

- `allreduce_gradients(module, local_samples, global_samples=None, group=None)`: call after
  `loss.backward()` in a plain (non-DDP) loop. `allreduce_token_gradients` is the token form.
- `WeightedHookState` + `weighted_comm_hook`: a `DistributedDataParallel.register_comm_hook`
  hook (modelled on torch's `default_hooks.allreduce_hook`; with a hook registered DDP does
  not divide by the world size itself, the hook owns the whole reduction).
  `TokenWeightedHookState` is the token form.
- `weighted_fsdp(module, state)`: the same weighting for FSDP2 (`fully_shard`) modules,
  through FSDP2's custom reduce-scatter and a divide factor of 1.

torch is imported lazily so `fleetwise.training` imports without the `train` extra.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch
    import torch.distributed as dist

__all__ = [
    "DEFAULT_BUCKET_MB",
    "TokenWeightedHookState",
    "WeightedHookState",
    "WeightedReduceScatter",
    "allreduce_gradients",
    "allreduce_token_gradients",
    "weighted_comm_hook",
    "weighted_fsdp",
]

# DDP's default bucket cap (torch.nn.parallel.DistributedDataParallel bucket_cap_mb).
DEFAULT_BUCKET_MB = 25.0


def _check_count(name: str, value: Any, *, allow_none: bool = False) -> float | None:
    """A sample/token count: a non-negative finite number (None allowed where it means 'sum')."""
    if value is None:
        if allow_none:
            return None
        raise ValueError(f"{name} is required")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return number


def _weight(local: float, total: float) -> float:
    """This rank's share of the global batch; 0 when the whole batch is empty."""
    return local / total if total > 0 else 0.0


# ---- plain loop: allreduce_gradients ---------------------------------------------------------


def _buckets(params: list[Any], bucket_bytes: int) -> list[list[Any]]:
    """Group parameters by (device, dtype) in order, each group cut into ~bucket_bytes pieces."""
    groups: OrderedDict[tuple[Any, Any], list[Any]] = OrderedDict()
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    out: list[list[Any]] = []
    for group in groups.values():
        current: list[Any] = []
        size = 0
        for p in group:
            nbytes = p.numel() * p.element_size()
            if current and size + nbytes > bucket_bytes:
                out.append(current)
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            out.append(current)
    return out


def _reduce(
    module: Any,
    local: float,
    total_given: float | None,
    group: Any,
    bucket_mb: float,
    what: str,
    summed: bool = False,
) -> float:
    """Weighted SUM all-reduce of `module`'s gradients; returns the global count.

    Gradients are of the mean over `local` (weight local/total) or, with `summed`, of the
    sum over them (weight 1/total, Megatron's per-token-loss convention).
    """
    import torch
    import torch.distributed as dist

    params = [p for p in _parameters(module) if p.requires_grad]
    for p in params:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} has a sparse gradient; weighted reduction "
                "supports dense gradients only (use DDP with weighted_comm_hook for sparse embeddings)"
            )
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call init_process_group first")

    # One float64 side tensor: [this rank's count, then 1.0 per parameter that has a gradient
    # here]. Summed over the group it gives the global count and which parameters received a
    # gradient on some rank (those with none anywhere keep .grad None, as DDP leaves them).
    meta = torch.zeros(1 + len(params), dtype=torch.float64)
    meta[0] = local
    for i, p in enumerate(params):
        if p.grad is not None:
            meta[1 + i] = 1.0
    device = params[0].device if params else torch.device("cpu")
    if device.type != "cpu" and dist.get_backend(group) != "gloo":
        meta = meta.to(device)

    if total_given is None:
        # The weights need the global count first.
        dist.all_reduce(meta, group=group)
        total = float(meta[0])
        meta_work = None
    else:
        total = total_given
        meta_work = dist.all_reduce(meta, group=group, async_op=True)
    weight = (1.0 / total if total > 0 else 0.0) if summed else _weight(local, total)

    works = []
    bucket_bytes = max(1, int(bucket_mb * 1024 * 1024))
    for bucket in _buckets(params, bucket_bytes):
        grads = [
            p.grad.reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            for p in bucket
        ]
        flat = torch.cat(grads) if len(grads) > 1 else grads[0].clone()
        if weight == 0.0 or local == 0.0:
            # An empty share contributes zeros, whatever its (NaN) mean-of-nothing gradient.
            flat.zero_()
        else:
            flat.mul_(weight)
        works.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))

    if meta_work is not None:
        meta_work.wait()
        summed = float(meta[0])
        if not math.isclose(summed, total, rel_tol=1e-9, abs_tol=1e-9):
            for work, _, _ in works:
                work.wait()
            raise ValueError(
                f"global_{what}={total_given:g} but the ranks' local_{what} sum to {summed:g}; "
                f"pass global_{what}=None to use the sum"
            )
    present = meta[1:].cpu().tolist()
    index = {id(p): i for i, p in enumerate(params)}
    for work, flat, bucket in works:
        work.wait()
        offset = 0
        for p in bucket:
            n = p.numel()
            if present[index[id(p)]] == 0:
                p.grad = None
            elif p.grad is None:
                p.grad = flat[offset : offset + n].view_as(p).clone()
            else:
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
    return total


def _parameters(module: Any) -> list[Any]:
    if hasattr(module, "parameters"):
        return list(module.parameters())
    if isinstance(module, Iterable):
        return list(module)
    raise TypeError(f"expected a torch.nn.Module or an iterable of parameters, got {type(module).__name__}")


def allreduce_gradients(
    module: Any,
    local_samples: float,
    global_samples: float | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> None:
    """Make every parameter's `.grad` the global-batch mean gradient on every rank.

    Call after `loss.backward()` where `loss` is the mean over this rank's `local_samples`
    samples. Each rank's gradient is scaled by local/global and SUM-all-reduced over `group`
    (default: the world), in flattened buckets of `bucket_mb` per (device, dtype).
    `global_samples=None` uses the sum of `local_samples` over the group (found by the same
    small all-reduce that tracks which parameters have gradients); when given, it is checked
    against that sum. A rank with no samples contributes zeros (its gradient may be None or
    NaN). Parameters with no gradient on any rank keep `.grad = None`.
    `module` is an `nn.Module` or an iterable of parameters; every rank must pass the same
    parameters in the same order.
    """
    local = _check_count("local_samples", local_samples)
    total = _check_count("global_samples", global_samples, allow_none=True)
    assert local is not None
    _reduce(module, local, total, group, bucket_mb, "samples")


def allreduce_token_gradients(
    module: Any,
    local_tokens: float,
    global_tokens: float | None = None,
    group: dist.ProcessGroup | None = None,
    *,
    bucket_mb: float = DEFAULT_BUCKET_MB,
) -> None:
    """Token-weighted `allreduce_gradients`, for variable-length batches.

    Call after `loss.backward()` where `loss` is the mean over this rank's `local_tokens`
    (e.g. the tokens that count toward the loss, padding excluded); leaves the gradient of
    the mean over all the global batch's tokens on every rank.
    """
    local = _check_count("local_tokens", local_tokens)
    total = _check_count("global_tokens", global_tokens, allow_none=True)
    assert local is not None
    _reduce(module, local, total, group, bucket_mb, "tokens")


# ---- DDP communication hook -------------------------------------------------------------------


@dataclass
class WeightedHookState:
    """State for `weighted_comm_hook`: this rank's and the global batch's sample counts.

    Change the counts between steps (a rebalance) with `set_samples` or by assigning the
    attributes; the hook reads them for every bucket. `global_samples=None` makes the hook
    all-reduce the counts with each bucket (one extra tiny all-reduce per bucket).
    `process_group` None means the default group.
    """

    local_samples: float
    global_samples: float | None = None
    process_group: Any = None

    unit = "samples"

    def __post_init__(self) -> None:
        self.set_samples(self.local_samples, self.global_samples)

    def set_samples(self, local_samples: float, global_samples: float | None = None) -> None:
        """New counts for the next step (every rank must switch at the same step)."""
        local = _check_count(f"local_{self.unit}", local_samples)
        total = _check_count(f"global_{self.unit}", global_samples, allow_none=True)
        if total is not None and local is not None and local > total:
            raise ValueError(f"local_{self.unit}={local_samples} exceeds global_{self.unit}={global_samples}")
        self.local_samples = local_samples
        self.global_samples = global_samples

    @property
    def local_count(self) -> float:
        return float(self.local_samples)

    @property
    def global_count(self) -> float | None:
        return None if self.global_samples is None else float(self.global_samples)

    def weight(self) -> float | None:
        """local/global, or None when the global count must be found by all-reduce."""
        total = self.global_count
        return None if total is None else _weight(self.local_count, total)


class TokenWeightedHookState(WeightedHookState):
    """`WeightedHookState` counted in tokens (loss = mean over this rank's tokens).

    `TokenWeightedHookState(local_tokens=..., global_tokens=...)`; `set_tokens` between steps.
    """

    unit = "tokens"

    def __init__(self, local_tokens: float, global_tokens: float | None = None, process_group: Any = None):
        self.process_group = process_group
        self.set_tokens(local_tokens, global_tokens)

    def set_tokens(self, local_tokens: float, global_tokens: float | None = None) -> None:
        self.set_samples(local_tokens, global_tokens)

    @property
    def local_tokens(self) -> float:
        return self.local_samples

    @local_tokens.setter
    def local_tokens(self, value: float) -> None:
        self.local_samples = value

    @property
    def global_tokens(self) -> float | None:
        return self.global_samples

    @global_tokens.setter
    def global_tokens(self, value: float | None) -> None:
        self.global_samples = value

    def __repr__(self) -> str:
        return (
            f"TokenWeightedHookState(local_tokens={self.local_tokens!r}, "
            f"global_tokens={self.global_tokens!r})"
        )


# `bucket` (a dist.GradBucket) and the return (a torch.futures.Future[torch.Tensor]) carry no
# annotations: DDP's _check_comm_hook compares annotations with the torch types by identity,
# and this module's postponed (string) annotations would fail that check.
def weighted_comm_hook(state: WeightedHookState, bucket):  # noqa: ANN001, ANN201
    """DDP communication hook: scale the bucket by local/global, SUM all-reduce, return its Future.

    `ddp.register_comm_hook(WeightedHookState(local_samples=n_i, global_samples=N), weighted_comm_hook)`.
    DDP applies no 1/world division of its own once a hook is registered (see torch's
    `ddp_comm_hooks/default_hooks.py`, which divides inside the hook), so the result is the
    global-batch mean gradient. A rank with no samples contributes zeros (run forward and
    backward on an empty or dummy batch so DDP's reducer fires; its gradient is ignored).
    """
    import torch
    import torch.distributed as dist

    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    local = state.local_count
    weight = state.weight()
    if weight is not None:
        if weight == 0.0:
            buffer.zero_()
        else:
            buffer.mul_(weight)
        work = dist.all_reduce(buffer, group=group, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    # Unknown global count: reduce sum_i n_i * g_i and sum_i n_i, then divide.
    count = torch.tensor([local], dtype=torch.float64)
    if buffer.device.type != "cpu" and dist.get_backend(group) != "gloo":
        count = count.to(buffer.device)
    count_work = dist.all_reduce(count, group=group, async_op=True)
    if local == 0.0:
        buffer.zero_()
    else:
        buffer.mul_(local)
    data_fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        count_work.wait()
        total = float(count[0])
        return reduced.div_(total) if total > 0 else reduced.zero_()

    return data_fut.then(finish)


# ---- FSDP2 (fully_shard) ----------------------------------------------------------------------


def _reduce_scatter_base() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    return ReduceScatter


class WeightedReduceScatter:
    """FSDP2 custom reduce-scatter: scale this rank's unsharded gradient by local/global first.

    Used by `weighted_fsdp`; it needs FSDP2's divide factor set to 1 and SUM reductions
    (`set_gradient_divide_factor(1.0)`, `set_force_sum_reduction_for_comms(True)`), which
    `weighted_fsdp` sets, so that FSDP adds no 1/world division of its own.
    """

    def __new__(cls, state: WeightedHookState) -> Any:
        import torch
        import torch.distributed as dist

        base = _reduce_scatter_base()

        class _Weighted(base):  # type: ignore[misc, valid-type]
            def __init__(self, state: WeightedHookState) -> None:
                self.state = state

            def allocate(self, size: Any, *, dtype: Any, device: Any) -> torch.Tensor:
                return torch.empty(*size, dtype=dtype, device=device)

            def __call__(
                self, output_tensor: Any, input_tensor: Any, group: Any, op: Any, async_op: bool = False
            ) -> Any:
                weight = self.state.weight()
                if weight is None:
                    raise ValueError(
                        "weighted_fsdp needs global counts (global_samples/global_tokens) in its state"
                    )
                if weight == 0.0:
                    input_tensor.zero_()
                else:
                    input_tensor.mul_(weight)
                return dist.reduce_scatter_tensor(
                    output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group, async_op=async_op
                )

        return _Weighted(state)


def weighted_fsdp(module: Any, state: WeightedHookState) -> Any:
    """Make an FSDP2 (`torch.distributed.fsdp.fully_shard`) model reduce with local/global weights.

    For every FSDP module under (and including) `module`: gradient divide factor 1, SUM
    reductions, and a `WeightedReduceScatter` reading `state` (so a rebalance is a
    `state.set_samples` call). The loss stays the mean over this rank's samples (or tokens).
    Equivalent without the custom comm: `set_gradient_divide_factor(1.0)` and scale the loss
    by local/global before backward. Returns `module`.
    """
    from torch.distributed.fsdp import FSDPModule

    if state.weight() is None:
        raise ValueError(
            "weighted_fsdp needs the global count: give the state global_samples (or global_tokens)"
        )
    comm = WeightedReduceScatter(state)
    found = False
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            found = True
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)
            sub.set_custom_reduce_scatter(comm)
    if not found:
        raise TypeError(
            "weighted_fsdp: no FSDP2 module found; apply torch.distributed.fsdp.fully_shard first"
        )
    return module
