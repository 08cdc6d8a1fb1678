"""What the control plane refuses before the feature windows: implausible readings, skewed
clocks and floods (docs/streams.md, "Limits").

The schemas check types and finiteness; these check that a finite, well-typed value can be a
reading of a real GPU, in the unit the contract says (DESIGN.md: DCGM fields as dcgm-exporter
reports them: W, C, MHz, %). A value outside its field's bounds is almost always a unit
mix-up (mW for W, K for C, Hz for MHz) or a broken exporter, and a single one poisons a GPU's
windows for days (the exponentially weighted context keeps it), so the sample is
dead-lettered with the field, the value, the bounds and the likely unit.

Event time. A sample's `ts` must be in [2000, 2100) and within `max_ahead_s` / `max_behind_s`
of the stream's event time: the newest sample accepted so far among the GPUs of its input
partition (Kafka's default partitioner on the node, as the worker places state). Per
partition, not per stream: a worker sees the partitions in any interleaving, a replay in file
order, but each partition's samples in the same order both ways, and the reference is
recomputed from the feature windows' own per-GPU `last_ts` (which the worker checkpoints and
restores), so the verdict does not depend on how samples were batched or where a worker
restarted. A partition with no sample yet has no reference: only the absolute bounds apply.

Floods. A GPU may send at most `max_rate_hz` x hop samples in one hop of event time (the
windows' own per-hop sample count, which is checkpointed state); the excess is dead-lettered,
one dead letter per GPU per call with the count (a flood must not become a flood of dead
letters), and other GPUs are not touched.

All checks are numpy over the call's columns; per sample only one dict lookup (the GPU's
slot), the same the windows do. Nothing here allocates state of its own.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Any

import numpy as np

from fleetwise.predictors.features import A_NSAMPLE, F_REASONS_OLD, INPUT_FIELDS, GpuFeatureWindows, _is_blank
from fleetwise.schemas import DeadLetter
from fleetwise.schemas.fast import SampleColumns
from fleetwise.schemas.topics import TELEMETRY_GPU

TS_MIN = 946_684_800.0  # 2000-01-01T00:00:00Z
TS_MAX = 4_102_444_800.0  # 2100-01-01T00:00:00Z
_EXACT = float(2**53)  # counters and bitmasks above this are not exact in a double: garbage

# field -> (low, high, unit, what a value above `high` most likely is)
PLAUSIBLE: dict[str, tuple[float, float, str, str]] = {
    "DCGM_FI_DEV_GPU_TEMP": (-40.0, 150.0, "C", "Kelvin or Fahrenheit?"),
    "DCGM_FI_DEV_MEMORY_TEMP": (-40.0, 150.0, "C", "Kelvin or Fahrenheit?"),
    "DCGM_FI_DEV_POWER_USAGE": (0.0, 5000.0, "W", "milliwatts?"),
    "DCGM_FI_DEV_SM_CLOCK": (0.0, 5000.0, "MHz", "Hz or kHz?"),
    "DCGM_FI_DEV_GPU_UTIL": (0.0, 100.0, "%", "not a percentage?"),
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": (0.0, _EXACT, "bitmask", "not a bitmask"),
    F_REASONS_OLD: (0.0, _EXACT, "bitmask", "not a bitmask"),
    "DCGM_FI_DEV_XID_ERRORS": (0.0, 65535.0, "XID", "not an XID"),
}
_LEVEL_OR_COUNTER = (0.0, _EXACT, "count", "not a count")


@dataclass(frozen=True)
class Limits:
    """Bounds the gate applies (docs/streams.md, "Limits"); defaults are the contract."""

    bounds: dict[str, tuple[float, float, str, str]] = field(default_factory=lambda: dict(PLAUSIBLE))
    ts_min: float = TS_MIN
    ts_max: float = TS_MAX
    max_ahead_s: float = 86_400.0  # a day ahead of the partition's event time: a skewed clock
    max_behind_s: float = 7 * 86_400.0  # a week behind it: older than any agent buffer holds
    # Samples per GPU per second of event time, averaged over a hop (DCGM's fastest useful
    # collection is 1 Hz; agents default to one sample per 10 s).
    max_rate_hz: float = 2.0


def node_partition(node: str, partitions: int = TELEMETRY_GPU.partitions) -> int:
    """The telemetry partition of a node's messages: Kafka's default partitioner (murmur2 of
    the key), as the producers and the worker's state placement use."""
    from aiokafka.partitioner import murmur2

    return (murmur2(node.encode()) & 0x7FFFFFFF) % partitions


class SampleGate:
    """Refuses implausible, skewed and flooding samples before the feature windows (see the
    module docstring). `dead_letter(source, reason, raw, ts)` makes the dead letters (the
    ControlPlane's, so they are counted with the others)."""

    def __init__(
        self,
        windows: GpuFeatureWindows,
        dead_letter: Callable[..., DeadLetter],
        limits: Limits | None = None,
        partitions: int = TELEMETRY_GPU.partitions,
    ) -> None:
        self.windows = windows
        self.dead_letter = dead_letter
        self.partitions = partitions
        self.rate_limited = 0  # samples refused for rate, in total (a flood's size)
        self._node_part: dict[str, int] = {}
        self._slot_part = np.empty(0, np.int64)  # partition of each windows slot
        # The slots in partition order (for the per-partition event time), for `_by_part_n` slots
        self._by_part_n = -1
        self._by_part = self._part_starts = self._part_ids = np.empty(0, np.int64)
        self._below = self._above = np.empty((0, 0), dtype=bool)  # `_bounds`' reused masks
        self.limits = limits or Limits()

    @property
    def limits(self) -> Limits:
        return self._limits

    @limits.setter
    def limits(self, limits: Limits) -> None:
        self._limits = limits
        fields = [*INPUT_FIELDS, F_REASONS_OLD]
        lo = np.full(len(fields), 0.0)
        hi = np.full(len(fields), _EXACT)
        for j, name in enumerate(fields):
            lo[j], hi[j], *_ = limits.bounds.get(name, _LEVEL_OR_COUNTER)
        self._fields, self._lo, self._hi = fields, lo, hi

    # ------------------------------------------------------------------------------------
    def check(self, cols: SampleColumns) -> tuple[SampleColumns, list[DeadLetter]]:
        """(the samples to keep, dead letters for the rest), in order."""
        kept, letters, _slots = self.screen(cols)
        return kept, letters

    def screen(self, cols: SampleColumns) -> tuple[SampleColumns, list[DeadLetter], np.ndarray]:
        """`check`, and the windows slot of each kept sample (-1: a GPU the windows have not
        seen yet), for `GpuFeatureWindows.ingest_samples(slots=...)`: the gate looks every
        sample's GPU up anyway, so the windows need not do it again."""
        n = len(cols)
        if n == 0:
            return cols, [], np.empty(0, np.int64)
        reasons: dict[int, str] = {}
        ts = cols.ts
        self._bounds(cols.metrics, reasons)
        lim = self.limits
        if not (ts.min() >= lim.ts_min and ts.max() < lim.ts_max):  # (NaN: look row by row)
            outside = (ts < lim.ts_min) | (ts >= lim.ts_max)
            for i in np.flatnonzero(outside).tolist():
                reasons.setdefault(
                    i, f"ts: {float(ts[i])!r} is outside 2000-01-01..2100-01-01 (Unix seconds expected)"
                )
        slots, fresh = self._slots(cols)
        self._skew(cols, slots, fresh, reasons)
        rate = self._rate(cols, slots, fresh, reasons)
        if not reasons and not rate:
            return cols, [], slots
        letters = [
            self.dead_letter(self._source(cols, i), reason, self._raw(cols, i), float(ts[i]))
            for i, reason in sorted(reasons.items())
        ]
        for (node, gpu), (first, count) in rate.items():
            letter = self.dead_letter(
                self._source(cols, first),
                f"rate: {count} samples of {node}/{gpu} over the limit of "
                f"{self._per_hop()} per {self.windows.hop_s:g} s hop of event time",
                self._raw(cols, first),
                float(ts[first]),
            )
            letter.count = count  # type: ignore[attr-defined]  # extra field (Record allows them)
            letters.append(letter)
        keep = np.ones(n, dtype=bool)
        keep[list(reasons)] = False
        for idx in self._rate_rows:
            keep[idx] = False
        return _take(cols, keep), letters, slots[keep]

    # -- plausibility -----------------------------------------------------------------------
    def _bounds(self, x: np.ndarray, reasons: dict[int, str]) -> None:
        """Metric values outside their field's bounds, the first such field of each row.

        Compared a block of rows at a time into two reused masks: the chunk's matrix is read
        once, in cache, and no chunk-sized temporaries are allocated."""
        lo, hi, block = self._lo, self._hi, self._BLOCK
        if len(self._below) < min(len(x), block):
            self._below = np.empty((min(len(x), block), len(lo)), dtype=bool)
            self._above = np.empty_like(self._below)
        for start in range(0, len(x), block):
            part = x[start : start + block]
            below, above = self._below[: len(part)], self._above[: len(part)]
            with np.errstate(invalid="ignore"):  # NaN (missing) compares False
                np.less(part, lo, out=below)
                np.greater(part, hi, out=above)
            np.logical_or(below, above, out=below)
            flat = np.flatnonzero(below)  # (1-D: much cheaper than a 2-D nonzero), row-major
            if not len(flat):
                continue
            rows, colidx = np.divmod(flat, below.shape[1])
            vals = part[rows, colidx]
            # DCGM "no value" sentinels (and >= 2**63) are missing, as the windows read them
            keep = ~_is_blank(vals)
            for i, j, v in zip(
                (rows[keep] + start).tolist(), colidx[keep].tolist(), vals[keep].tolist(), strict=True
            ):
                if i not in reasons:
                    reasons[i] = self._bounds_reason(self._fields[j], v)

    _BLOCK = 4096  # rows compared at a time (~100 KB of metrics: in L2)

    # -- event time -------------------------------------------------------------------------
    def _slots(self, cols: SampleColumns) -> tuple[np.ndarray, _Fresh | None]:
        """Windows slot of each sample (-1 for a GPU the windows have not seen), and what the
        checks need of the rows of unseen GPUs (None when there are none). One dict lookup
        per sample, in C, the one the windows would do."""
        w = self.windows
        by_gpu = w._slot_by_gpu
        found = map(by_gpu.get, zip(cols.node, cols.gpu, strict=True), repeat(-1))
        slots = np.fromiter(found, np.int64, len(cols))
        unknown = np.flatnonzero(slots < 0)
        if not len(unknown):
            return slots, None
        idx = unknown.tolist()
        nodes = list(map(cols.node.__getitem__, idx))
        gpus = list(map(cols.gpu.__getitem__, idx))
        keys = list(zip(nodes, gpus, strict=True))
        # Restored state: known by its "node/gpu" key only (once per GPU, not per row).
        by_key = {key: w._slot.get(f"{key[0]}/{key[1]}", -1) for key in dict.fromkeys(keys)}
        found = np.fromiter(map(by_key.__getitem__, keys), np.int64, len(keys))
        if not (found < 0).any():
            slots[unknown] = found
            by_gpu.update(by_key)
            return slots, None
        if (found >= 0).any():
            slots[unknown] = found
            by_gpu.update((key, s) for key, s in by_key.items() if s >= 0)
            left = np.flatnonzero(found < 0)
            unknown = unknown[left]
            nodes, gpus = [nodes[k] for k in left.tolist()], [gpus[k] for k in left.tolist()]
        return slots, _Fresh(unknown, nodes, gpus)

    def _partition_of_node(self, node: str) -> int:
        p = self._node_part.get(node)
        if p is None:
            p = self._node_part[node] = node_partition(node, self.partitions)
        return p

    def _watermarks(self) -> np.ndarray:
        """Per partition: the newest accepted sample of its GPUs (-inf: none yet). From the
        windows' `last_ts` each call (so restored, forgotten and evicted GPUs count as they
        are now): one gather and one `maximum.reduceat` over the slots in partition order."""
        w = self.windows
        n = len(w._meta)
        if len(self._slot_part) < n:
            extra = [self._partition_of_node(m["node"]) for m in w._meta[len(self._slot_part) : n]]
            self._slot_part = np.concatenate([self._slot_part, np.array(extra, dtype=np.int64)])
        if self._by_part_n != n:
            order = np.argsort(self._slot_part[:n], kind="stable")
            parts = self._slot_part[order]
            starts = np.flatnonzero(np.r_[True, parts[1:] != parts[:-1]]) if n else np.empty(0, np.int64)
            self._by_part, self._part_starts, self._part_ids = order, starts, parts[starts]
            self._by_part_n = n
        marks = np.full(self.partitions, -np.inf)
        if n:
            marks[self._part_ids] = np.maximum.reduceat(w.last_ts[self._by_part], self._part_starts)
        return marks

    def _skew(
        self, cols: SampleColumns, slots: np.ndarray, fresh: _Fresh | None, reasons: dict[int, str]
    ) -> None:
        lim = self.limits
        marks = self._watermarks()
        ts = cols.ts
        if fresh is None and len(self._part_ids):
            # Every GPU seen before: if the call's whole time range is within the limits of
            # every partition that has GPUs, no sample is odd (the verdict below finds none).
            have = marks[self._part_ids]
            with np.errstate(invalid="ignore"):
                if (np.isfinite(have).all() and ts.max() <= (have + lim.max_ahead_s).min()
                        and ts.min() >= (have - lim.max_behind_s).max()):
                    return
        if fresh is None:
            part = self._slot_part[slots]
        else:
            part = np.empty(len(ts), np.int64)
            known = slots >= 0
            part[known] = self._slot_part[slots[known]]
            part[fresh.rows] = fresh.partitions(self)
        ref = marks[part]
        # Fast verdict against the reference before the call; exact (arrival order, each
        # accepted sample moving its partition's reference on) only for partitions where
        # that found something or that had no reference yet.
        with np.errstate(invalid="ignore"):
            odd = ~np.isfinite(ref) | (ts > ref + lim.max_ahead_s) | (ts < ref - lim.max_behind_s)
        if not odd.any():
            return
        for p in np.unique(part[odd]).tolist():
            rows = np.flatnonzero(part == p)
            w0 = float(marks[p])
            done = np.fromiter(reasons, np.int64, len(reasons))  # refused already: not judged
            judged = rows[~np.isin(rows, done)] if len(done) else rows
            if len(judged):
                # If every sample were accepted, the reference before each would be the
                # running max of those before it: when that refuses none, none is refused.
                t = ts[judged]
                before = np.maximum.accumulate(np.r_[w0, t[:-1]])
                with np.errstate(invalid="ignore"):
                    refused = np.isfinite(before) & (
                        (t > before + lim.max_ahead_s) | (t < before - lim.max_behind_s)
                    )
                if np.isfinite(t).all() and not refused.any():
                    continue
            w = w0
            for i in rows.tolist():
                if i in reasons:
                    continue
                t = float(ts[i])
                if math.isfinite(w) and t > w + lim.max_ahead_s:
                    reasons[i] = (
                        f"ts: {t!r} is {(t - w) / 3600:.1f} h ahead of the stream's event time "
                        f"({w!r}, limit {lim.max_ahead_s / 3600:g} h): clock skew"
                    )
                elif math.isfinite(w) and t < w - lim.max_behind_s:
                    reasons[i] = (
                        f"ts: {t!r} is {(w - t) / 86400:.1f} days behind the stream's event time "
                        f"({w!r}, limit {lim.max_behind_s / 86400:g} days): clock skew"
                    )
                else:
                    w = t if not math.isfinite(w) else max(w, t)

    # -- rate -------------------------------------------------------------------------------
    def _per_hop(self) -> int:
        return max(1, int(self.limits.max_rate_hz * self.windows.hop_s))

    def _rate(
        self, cols: SampleColumns, slots: np.ndarray, fresh: _Fresh | None, reasons: dict[int, str]
    ) -> dict[tuple[str, int], tuple[int, int]]:
        """(node, gpu) -> (first refused row, rows refused) for GPUs over the per-hop limit."""
        self._rate_rows: list[np.ndarray] = []
        n = len(slots)
        cap = self._per_hop()
        w = self.windows
        # Unseen GPUs get ids after the slots (one per GPU) and count from 0.
        ids = slots
        if fresh is not None:
            ids = slots.copy()
            ids[fresh.rows] = fresh.ids(len(w._meta))
        # No GPU can pass the cap in this call: the common case, decided in O(n). A sample's
        # count before the call is its GPU's open-hop count or 0, so at most the largest.
        per_id = np.bincount(ids)
        most = w.acc[: len(w._meta), A_NSAMPLE].max() if len(w._meta) else 0.0
        if most + per_id.max() <= cap:
            return {}
        known = slots >= 0
        phase = np.zeros(n)
        phase[known] = w.phase[slots[known]]
        if fresh is not None:
            phase[fresh.rows] = fresh.phases(w)
        hop = np.floor((cols.ts - phase) / w.hop_s)
        before = np.zeros(n)
        open_now = known.copy()
        open_now[known] = w.open_hop[slots[known]] == hop[known]
        before[open_now] = w.acc[slots[open_now], A_NSAMPLE]
        if not (before + per_id[ids] > cap).any():
            return {}
        # Rank of each row among its (GPU, hop) rows in arrival order.
        code = np.unique(ids, return_inverse=True)[1].astype(np.int64) * n + np.unique(
            hop, return_inverse=True
        )[1].astype(np.int64)
        order = np.argsort(code, kind="stable")
        sc = code[order]
        starts = np.flatnonzero(np.r_[True, sc[1:] != sc[:-1]])
        rank = np.empty(n, np.int64)
        rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
        over = before + rank >= cap
        if reasons:
            over[list(reasons)] = False  # refused already, for another reason
        if not over.any():
            return {}
        rows = np.flatnonzero(over)
        self._rate_rows.append(rows)
        self.rate_limited += len(rows)
        out: dict[tuple[str, int], tuple[int, int]] = {}
        for i in rows.tolist():
            key = (cols.node[i], int(cols.gpu[i]))
            first, count = out.get(key, (i, 0))
            out[key] = (first, count + 1)
        return out

    # -- dead letters ---------------------------------------------------------------------------
    def _bounds_reason(self, name: str, value: float) -> str:
        lo, hi, unit, hint = self.limits.bounds.get(name, _LEVEL_OR_COUNTER)
        why = f" ({hint})" if value > hi else ""
        return f"metrics.{name}: {value!r} {unit} is outside the plausible range [{lo:g}, {hi:g}]{why}"

    @staticmethod
    def _source(cols: SampleColumns, i: int) -> str:
        return f"{TELEMETRY_GPU.name}#{cols.node[i]}/{cols.gpu[i]}@{float(cols.ts[i])!r}"

    def _raw(self, cols: SampleColumns, i: int) -> str:
        """The sample as the gate saw it (its read metrics; the original bytes are not kept
        past decoding)."""
        metrics = {
            name: v
            for name, v in zip(self._fields, cols.metrics[i].tolist(), strict=True)
            if not math.isnan(v)
        }
        sample: dict[str, Any] = {
            "ts": float(cols.ts[i]),
            "node": cols.node[i],
            "gpu": int(cols.gpu[i]),
            "model": cols.model[i],
            "metrics": metrics,
        }
        return json.dumps(sample, allow_nan=True)


class _Fresh:
    """The rows of a call whose GPU the windows have not seen: their (node, gpu), and per
    row its partition, an id per GPU (first seen first) and its hop phase, each worked out
    once per GPU, not per row."""

    def __init__(self, rows: np.ndarray, nodes: list[str], gpus: list[int]) -> None:
        self.rows, self.nodes, self.gpus = rows, nodes, gpus
        self.keys = list(zip(nodes, gpus, strict=True))
        self.first = {key: k for k, key in enumerate(dict.fromkeys(self.keys))}

    def partitions(self, gate: SampleGate) -> list[int]:
        part_of = {node: gate._partition_of_node(node) for node in dict.fromkeys(self.nodes)}
        return list(map(part_of.__getitem__, self.nodes))

    def ids(self, base: int) -> np.ndarray:
        return np.fromiter(map(self.first.__getitem__, self.keys), np.int64, len(self.keys)) + base

    def phases(self, windows: GpuFeatureWindows) -> list[float]:
        phase = {key: windows.hop_phase(f"{key[0]}/{key[1]}") for key in self.first}
        return list(map(phase.__getitem__, self.keys))


def _take(cols: SampleColumns, keep: np.ndarray) -> SampleColumns:
    """The rows where `keep` of columns (lists, lazy attribute views or arrays)."""
    mask = keep.tolist()
    lists = {
        name: list(compress(getattr(cols, name), mask))
        for name in SampleColumns.__slots__
        if name not in SampleColumns.ARRAYS
    }
    return SampleColumns(**lists, **{name: getattr(cols, name)[keep] for name in SampleColumns.ARRAYS})


def evict_idle(control: Any, keep: int) -> list[str]:
    """Evict the feature-window GPUs idle longest in event time (oldest last sample) until
    `keep` remain, with the failure predictor's alert state of the same GPUs; returns the
    evicted keys ("node/gpu"). The windows' per-GPU arrays are compacted (memory is bounded,
    not just zeroed), slots renumbered in their old order. A worker's state bound: a GPU
    that comes back after eviction starts over, as a new one."""
    w: GpuFeatureWindows = control.features
    n = len(w._meta)
    if n <= keep:
        return []
    order = np.argsort(w.last_ts[:n], kind="stable")  # -inf (restored, never seen since) first
    gone = np.sort(order[: n - keep])
    kept = np.setdiff1d(np.arange(n), gone)
    keys = w.slot_keys()
    evicted = [keys[i] for i in gone.tolist()]
    w.keep_slots(kept)
    # The straggler detector has learned the models of the first `_models_taught` slots.
    taught = getattr(control, "_models_taught", None)
    if taught is not None:
        control._models_taught = int((kept < taught).sum())
    for name in ("failure", "thermal"):  # per-GPU state beside the windows
        processor = getattr(control, name, None)
        if processor is not None:
            for key in evicted:
                processor.forget(key)
    gate = getattr(control, "gate", None)
    if gate is not None:
        gate._slot_part = np.empty(0, np.int64)  # slots renumbered
        gate._by_part_n = -1
    return evicted
