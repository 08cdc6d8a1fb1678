"""Per-rank shares of every global batch, with no sample skipped or repeated.

`ShareSampler` cuts one deterministic global sample order (a permutation of the dataset
seeded by (seed, epoch)) into consecutive global batches; step s's global batch is split
among the data-parallel ranks in rank order by their shares. Because the cut depends only
on the global order and the share schedule, ranks agree without communicating, shares can
change at any step boundary (`set_shares(shares, from_step)`), and the world size can change
too (a resize 4 -> 3 keeps the global order: the new ranks continue from the same offset).
`state_dict()` / `load_state_dict()` carry (seed, epoch, step, schedule) for checkpoints.

Also here: reading the planner's per-rank micro-batch map (`fleetwise plan --microbatch-map`,
`fleetwise.planner.exports.microbatch_map`) into per-data-parallel-rank shares.

Pure Python and numpy (no torch): a `ShareSampler` is a `batch_sampler` for
`torch.utils.data.DataLoader` (it yields one list of indices per step).
"""

from __future__ import annotations

import bisect
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetwise.planner.shares import proportional_shares

__all__ = [
    "MicrobatchMap",
    "ShareSampler",
    "load_microbatch_map",
    "shares_from_microbatch_map",
]


def _check_shares(shares: Sequence[int] | Mapping[Any, int], field: str = "shares") -> list[int]:
    """Shares as a list by data-parallel rank; a mapping {"0": n, "1": m} is accepted too."""
    if isinstance(shares, Mapping):
        try:
            keyed = {int(k): v for k, v in shares.items()}
        except (TypeError, ValueError):
            raise ValueError(
                f"{field}: keys must be data-parallel ranks 0..n-1, got {list(shares)}"
            ) from None
        if sorted(keyed) != list(range(len(keyed))):
            raise ValueError(
                f"{field}: keys must be data-parallel ranks 0..{len(keyed) - 1}, got {sorted(keyed)}"
            )
        shares = [keyed[i] for i in range(len(keyed))]
    out = []
    for i, s in enumerate(shares):
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"{field}[{i}] must be an integer >= 0, got {s!r}")
        out.append(int(s))
    if not out:
        raise ValueError(f"{field} is empty")
    if sum(out) == 0:
        raise ValueError(f"{field} sum to 0; a global batch needs at least one sample")
    return out


class ShareSampler:
    """Gives data-parallel rank `rank` its share of every global batch, in a fixed global order.

    - `num_samples`: dataset size; `shares`: samples per step for each data-parallel rank
      (their sum is the global batch); `rank`: this process's data-parallel rank.
    - `shuffle`/`seed`: the global order is a permutation seeded by (seed, epoch), or
      0..n-1 without shuffle. `set_epoch(epoch)` before each epoch, like DistributedSampler.
    - `drop_last=False` (default): the epoch's final, short global batch is split in
      proportion to the shares, so every sample is seen exactly once per epoch (pass
      `global_samples(step)` / `local_samples(step)` to the gradient reduction). With
      `drop_last=True` the short batch is skipped.
    - Iterating yields this rank's index list for each remaining step of the epoch, starting
      at `step` (0 at an epoch start, or where `load_state_dict`/`set_position` put it); the
      position advances as lists are yielded. `indices(step)` is the same as a pure function.

    A `DataLoader` with `num_workers > 0` reads `num_workers * prefetch_factor` steps ahead;
    a `set_shares` for a step already read applies only to a new iterator, so give
    `from_step` that much lead (or recreate the loader's iterator at the switch).
    """

    def __init__(
        self,
        num_samples: int,
        shares: Sequence[int] | Mapping[Any, int],
        rank: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        epoch: int = 0,
    ) -> None:
        if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = int(epoch)
        first = _check_shares(shares)
        # Share schedule: (from_step, shares), sorted by step, first at step 0. Kept for the
        # whole epoch so any step's slice can be recomputed; reset to its last entry by set_epoch.
        self._schedule: list[tuple[int, list[int]]] = [(0, first)]
        self._offsets: list[int] = [0]  # global-order offset at each schedule entry's step
        self.rank = 0
        self.set_rank(rank)
        self.step = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    # ---- schedule ----------------------------------------------------------------------------

    @property
    def shares(self) -> list[int]:
        """The shares in force at the current position."""
        return list(self.shares_at(self.step))

    @property
    def world_size(self) -> int:
        return len(self.shares_at(self.step))

    def shares_at(self, step: int) -> list[int]:
        i = bisect.bisect_right([s for s, _ in self._schedule], step) - 1
        return self._schedule[i][1]

    def set_rank(self, rank: int) -> None:
        """This process's data-parallel rank (after a resize it may change)."""
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 0:
            raise ValueError(f"rank must be an integer >= 0, got {rank!r}")
        self.rank = int(rank)

    def set_shares(
        self, shares: Sequence[int] | Mapping[Any, int], from_step: int, rank: int | None = None
    ) -> None:
        """Use `shares` from step `from_step` of this epoch on (every rank makes the same call).

        The number of shares may differ from before (a resize); pass this process's new
        `rank` then. Steps before `from_step` keep their earlier shares; a later schedule entry
        at or after `from_step` is replaced.
        """
        new = _check_shares(shares)
        if isinstance(from_step, bool) or not isinstance(from_step, (int, np.integer)) or from_step < 0:
            raise ValueError(f"from_step must be an integer >= 0, got {from_step!r}")
        from_step = int(from_step)
        if from_step > self.steps_in_epoch():
            raise ValueError(f"from_step {from_step} is past the epoch's last step {self.steps_in_epoch()}")
        if rank is not None:
            self.set_rank(rank)
        offset = self.offset(from_step)
        keep = [i for i, (s, _) in enumerate(self._schedule) if s < from_step]
        self._schedule = [self._schedule[i] for i in keep] + [(from_step, new)]
        self._offsets = [self._offsets[i] for i in keep] + [offset]

    # ---- arithmetic --------------------------------------------------------------------------

    def _segment(self, step: int) -> int:
        return bisect.bisect_right([s for s, _ in self._schedule], step) - 1

    def offset(self, step: int) -> int:
        """Position in the epoch's global order where step `step`'s global batch starts."""
        i = self._segment(step)
        start, shares = self._schedule[i]
        return min(self.num_samples, self._offsets[i] + (step - start) * sum(shares))

    def steps_in_epoch(self) -> int:
        """Number of steps in the epoch under the current schedule."""
        start, shares = self._schedule[-1]
        left = self.num_samples - self._offsets[-1]
        per = sum(shares)
        full, rest = divmod(max(left, 0), per)
        return start + full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        """Steps left in the epoch from the current position."""
        return max(0, self.steps_in_epoch() - self.step)

    def split(self, step: int) -> list[int]:
        """Samples of each data-parallel rank at `step` (the final short batch is split pro rata)."""
        if step < 0 or step >= self.steps_in_epoch():
            raise IndexError(f"step {step} is outside the epoch's 0..{self.steps_in_epoch() - 1}")
        shares = self.shares_at(step)
        left = self.num_samples - self.offset(step)
        if left >= sum(shares):
            return list(shares)
        return proportional_shares(shares, left)  # the short last batch, by the same shares

    def global_samples(self, step: int | None = None) -> int:
        """Samples in the global batch at `step` (default: the current position)."""
        return sum(self.split(self.step if step is None else step))

    def local_samples(self, step: int | None = None) -> int:
        """This rank's samples at `step` (default: the current position)."""
        split = self.split(self.step if step is None else step)
        self._check_rank(len(split))
        return split[self.rank]

    def _check_rank(self, world: int) -> None:
        if self.rank >= world:
            raise ValueError(f"rank {self.rank} has no share: the schedule has {world} ranks")

    def order(self) -> np.ndarray:
        """The epoch's global sample order (a permutation of 0..num_samples-1)."""
        if self._order_cache is None or self._order_cache[0] != self.epoch:
            if self.shuffle:
                rng = np.random.default_rng(np.random.SeedSequence([self.seed, self.epoch]))
                order = rng.permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._order_cache = (self.epoch, order)
        return self._order_cache[1]

    def global_indices(self, step: int) -> list[int]:
        """Every index of step `step`'s global batch, in rank order."""
        start = self.offset(step)
        return self.order()[start : start + sum(self.split(step))].tolist()

    def indices(self, step: int, rank: int | None = None) -> list[int]:
        """Indices rank `rank` (default: this rank) processes at step `step` of this epoch."""
        rank = self.rank if rank is None else rank
        split = self.split(step)
        if rank >= len(split):
            raise ValueError(f"rank {rank} has no share: the schedule has {len(split)} ranks at step {step}")
        start = self.offset(step) + sum(split[:rank])
        return self.order()[start : start + split[rank]].tolist()

    def tokens(self, step: int, lengths: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """(local, global) token counts at `step` given each sample's token count, no communication.

        Every rank knows the whole global batch, so the token weights need no all-reduce.
        """
        lengths = np.asarray(lengths)
        local = int(lengths[self.indices(step)].sum())
        return local, int(lengths[self.global_indices(step)].sum())

    # ---- iteration and state -----------------------------------------------------------------

    def __iter__(self) -> Iterator[list[int]]:
        while self.step < self.steps_in_epoch():
            batch = self.indices(self.step)
            self.step += 1
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Start epoch `epoch` at step 0, keeping the shares in force at the end of the last one."""
        last = list(self._schedule[-1][1])
        self.epoch = int(epoch)
        self._schedule = [(0, last)]
        self._offsets = [0]
        self.step = 0

    def set_position(self, epoch: int, step: int) -> None:
        """Continue from (epoch, step) with the current schedule (e.g. after a restart)."""
        if epoch != self.epoch:
            self.set_epoch(epoch)
        if step < 0 or step > self.steps_in_epoch():
            raise ValueError(f"step {step} is outside the epoch's 0..{self.steps_in_epoch()}")
        self.step = int(step)

    def state_dict(self) -> dict[str, Any]:
        """Rank-independent state: any rank's dict restores any rank (at any world size)."""
        return {
            "num_samples": self.num_samples,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "step": self.step,
            "schedule": [[s, list(sh)] for s, sh in self._schedule],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore position and share schedule; keeps this process's rank."""
        for key in ("num_samples", "seed", "epoch", "step", "schedule"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}")
        if int(state["num_samples"]) != self.num_samples:
            raise ValueError(
                f"sampler state is for {state['num_samples']} samples, this dataset has {self.num_samples}"
            )
        self.seed = int(state["seed"])
        self.shuffle = bool(state.get("shuffle", self.shuffle))
        self.drop_last = bool(state.get("drop_last", self.drop_last))
        self.epoch = int(state["epoch"])
        schedule = state["schedule"]
        if not schedule or int(schedule[0][0]) != 0:
            raise ValueError("sampler state schedule must start at step 0")
        self._schedule = [(0, _check_shares(schedule[0][1], "schedule[0]"))]
        self._offsets = [0]
        for i, (step, shares) in enumerate(schedule[1:], start=1):
            checked = _check_shares(shares, f"schedule[{i}]")
            offset = self.offset(int(step))
            self._schedule.append((int(step), checked))
            self._offsets.append(offset)
        self.step = int(state["step"])
        self._order_cache = None

    def __repr__(self) -> str:
        return (
            f"ShareSampler(num_samples={self.num_samples}, rank={self.rank}, shares={self.shares}, "
            f"epoch={self.epoch}, step={self.step})"
        )


# ---- the planner's micro-batch map ----------------------------------------------------------


@dataclass(frozen=True)
class MicrobatchMap:
    """The planner's per-rank micro-batch map, as the training plugin needs it.

    `shares[dp_rank]` = samples per step of each data-parallel replica; `ranks[rank]` = the
    map's row for a global rank (dp_rank, stage, micro_batch, num_micro_batches, ...).
    """

    job: str
    global_batch: int
    shares: list[int]
    ranks: dict[int, dict[str, Any]]
    raw: dict[str, Any]

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global rank `rank`."""
        if rank not in self.ranks:
            raise KeyError(f"rank {rank} is not in the micro-batch map (ranks {sorted(self.ranks)})")
        return int(self.ranks[rank]["dp_rank"])

    def local_samples(self, rank: int) -> int:
        return self.shares[self.dp_rank(rank)]

    def micro_batches(self, rank: int) -> tuple[int, int]:
        """(micro_batch, num_micro_batches) for global rank `rank`."""
        self.dp_rank(rank)  # names the rank when it is missing
        row = self.ranks[rank]
        return int(row["micro_batch"]), int(row["num_micro_batches"])

    def sampler(self, num_samples: int, rank: int, **kwargs: Any) -> ShareSampler:
        """A `ShareSampler` over the plan's shares for global rank `rank`."""
        return ShareSampler(num_samples, self.shares, self.dp_rank(rank), **kwargs)


def shares_from_microbatch_map(data: Mapping[str, Any]) -> list[int]:
    """Samples per step by data-parallel rank, from a `microbatch_map` dict."""
    return _parse_map(data).shares


def _parse_map(data: Mapping[str, Any]) -> MicrobatchMap:
    if not isinstance(data, Mapping):
        raise ValueError(f"micro-batch map must be a JSON object, got {type(data).__name__}")
    for key in ("global_batch", "replicas", "ranks"):
        if key not in data:
            raise ValueError(
                f"micro-batch map lacks {key!r} (write it with `fleetwise plan --microbatch-map`)"
            )
    if data.get("gradient_reduction", "sum") != "sum":
        raise ValueError(f"micro-batch map gradient_reduction {data['gradient_reduction']!r}; expected 'sum'")
    by_dp: dict[int, int] = {}
    for i, rep in enumerate(data["replicas"]):
        try:
            by_dp[int(rep["dp_rank"])] = int(rep["samples"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(
                f"micro-batch map replicas[{i}] needs integer dp_rank and samples, got {rep!r}"
            ) from None
    shares = _check_shares({str(k): v for k, v in by_dp.items()}, "micro-batch map replicas")
    global_batch = int(data["global_batch"])
    if sum(shares) != global_batch:
        raise ValueError(
            f"micro-batch map replicas sum to {sum(shares)} samples, global_batch is {global_batch}"
        )
    ranks: dict[int, dict[str, Any]] = {}
    for i, row in enumerate(data["ranks"]):
        for key in ("rank", "dp_rank", "micro_batch", "num_micro_batches", "samples"):
            if key not in row:
                raise ValueError(f"micro-batch map ranks[{i}] lacks {key!r}")
        if int(row["samples"]) != by_dp.get(int(row["dp_rank"])):
            raise ValueError(
                f"micro-batch map ranks[{i}] (rank {row['rank']}) has {row['samples']} samples but its "
                f"replica {row['dp_rank']} has {by_dp.get(int(row['dp_rank']))}"
            )
        ranks[int(row["rank"])] = dict(row)
    return MicrobatchMap(
        job=str(data.get("job", "")), global_batch=global_batch, shares=shares, ranks=ranks, raw=dict(data)
    )


def load_microbatch_map(source: str | os.PathLike[str] | Mapping[str, Any]) -> MicrobatchMap:
    """Read `fleetwise plan --microbatch-map FILE` output (a path or the parsed dict)."""
    if isinstance(source, Mapping):
        return _parse_map(source)
    with open(source, encoding="utf-8") as fh:
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{source}: not JSON ({exc})") from None
    return _parse_map(data)
