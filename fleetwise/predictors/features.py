"""Per-GPU windowed features over event-time hops (the telemetry issue, part 2).

`GpuFeatureWindows` turns GPU samples into one feature vector per GPU per closed hop.
Design for throughput: every GPU gets a slot index into preallocated numpy arrays;
a batch of samples becomes one float matrix, sorted by (slot, ts), and every update
(gauge sums, counter deltas with reset handling, XID changes, throttle-bit duty
cycles) is a handful of vectorised `reduceat` calls per batch, so Python overhead
is per batch, not per sample. Longer context (1 h, 6 h, 24 h, 7 d) is kept as
exponentially weighted sums of hop aggregates, decayed by the event-time gap, so a
closed hop costs O(features) regardless of the window length.

Semantics (event time only):
- hop k covers [k*hop_s, (k+1)*hop_s) (shifted by the GPU's phase when hops are staggered,
  see `hop_phase`); a GPU's open hop closes when that GPU sends a
  sample of a later hop (or at `flush`); the feature vector's `ts` is the hop end.
- samples older than the GPU's open hop are dropped and counted (`dropped_late`);
  exact duplicates (same GPU and ts) are dropped and counted (`dropped_duplicate`);
  out-of-order samples inside the open hop count for gauges only (a cumulative
  counter's later reading already includes what an older one saw).
- a counter that goes down was reset (reboot): its new value becomes the base and the
  delta is 0, never negative; resets are counted as a feature.
- DCGM_FI_DEV_XID_ERRORS holds the last XID, so an event is a change to a new non-zero
  value; events are counted by class.
- a GPU's history (every EW sum) starts afresh on a new board (its sample names another
  uuid than the slot's last, or a persistent counter went down: its counters are re-based)
  and when the GPU comes back from a failure: a failure-class XID, then an hour or
  more without a sample (`RETURN_SILENCE_S`).
- node-peer columns (`node_*`) count the other GPUs of the node with recent link errors or
  single-bit ECC errors, or running warm against their own power fit, as of the hops closed
  before this one in arrival order (`_peer_context`).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.special import gammainc

from fleetwise.schemas import FeatureVector, GpuSample, NodeBatch
from fleetwise.schemas._base import DCGM_BLANKS, DCGM_INT32_BLANK, DCGM_INT64_BLANK
from fleetwise.schemas.fast import FastGpuSample, SampleColumns, SampleDecoder, board_id

# ---- input fields ---------------------------------------------------------------------------
# DCGM field names (REFERENCE.md "Telemetry"; ../shared/data/dcgm/default-counters.csv).
F_TEMP = "DCGM_FI_DEV_GPU_TEMP"
F_MEMTEMP = "DCGM_FI_DEV_MEMORY_TEMP"
F_POWER = "DCGM_FI_DEV_POWER_USAGE"
F_SMCLK = "DCGM_FI_DEV_SM_CLOCK"
F_UTIL = "DCGM_FI_DEV_GPU_UTIL"
F_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
F_REASONS_OLD = "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"  # pre-DCGM-3.3 name of field 112
F_XID = "DCGM_FI_DEV_XID_ERRORS"

GAUGE_FIELDS = [F_TEMP, F_MEMTEMP, F_POWER, F_SMCLK, F_UTIL]
LEVEL_FIELDS = [  # gauges where the worst value in a hop matters
    "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "DCGM_FI_DEV_ROW_REMAP_PENDING",
    "DCGM_FI_DEV_RETIRED_PENDING",
]
# Cumulative counters (reset on reboot) -> short name used in feature names.
COUNTER_FIELDS = {
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": "sbe_vol",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": "dbe_vol",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": "sbe_agg",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL": "dbe_agg",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "remap_corr",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "remap_uncorr",
    "DCGM_FI_DEV_RETIRED_SBE": "retired_sbe",
    "DCGM_FI_DEV_RETIRED_DBE": "retired_dbe",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "pcie_replay",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL": "nvl_crc_flit",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL": "nvl_crc_data",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL": "nvl_replay",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL": "nvl_recovery",
    # Cumulative throttled time in microseconds (DCGM fields 240/241).
    "DCGM_FI_DEV_POWER_VIOLATION": "power_violation_us",
    "DCGM_FI_DEV_THERMAL_VIOLATION": "thermal_violation_us",
}
INPUT_FIELDS = GAUGE_FIELDS + [F_REASONS, F_XID] + LEVEL_FIELDS + list(COUNTER_FIELDS)
N_GAUGE, N_LEVEL, N_COUNTER = len(GAUGE_FIELDS), len(LEVEL_FIELDS), len(COUNTER_FIELDS)
COL_TEMP, COL_MEMTEMP, COL_POWER, COL_SMCLK, COL_UTIL = range(5)
COL_REASONS, COL_XID = 5, 6
COL_LEVEL = 7
COL_COUNTER = COL_LEVEL + N_LEVEL
N_INPUT = len(INPUT_FIELDS)
# A row `ingest` takes: the INPUT_FIELDS values, then the sample's board (`board_id` of its
# uuid; NaN: not named). Rows without the board column are read as naming none.
COL_BOARD = N_INPUT
N_ROW = N_INPUT + 1
# Validates sample lines and node batches straight into these columns (the replay and
# worker hot path); the last column is field 112 under its pre-DCGM-3.3 name.
SAMPLE_DECODER = SampleDecoder([*INPUT_FIELDS, F_REASONS_OLD])

# Clock-event reason bits (REFERENCE.md: DCGM field 112 / nvmlClocksEventReasons).
THROTTLE_BITS = {
    "power_cap": 0x4,  # SW power cap
    "hw_slowdown": 0x8,
    "sw_thermal": 0x20,
    "hw_thermal": 0x40,
    "power_brake": 0x80,
}
N_BITS = len(THROTTLE_BITS)
_BIT_VALUES = np.array(list(THROTTLE_BITS.values()), dtype=np.int64)

# XID classes (https://docs.nvidia.com/deploy/xid-errors/, REFERENCE.md "XIDs").
XID_CLASSES = {
    "mem_fatal": (48, 64, 95, 140),  # double-bit ECC, remap failure, uncontained, ECC unrecovered
    "mem_remap": (63,),  # a row remap / page retirement was recorded: benign alone
    "mem_warn": (92, 94),  # high single-bit error rate; contained ECC error
    "nvlink": (74,),
    "bus": (79,),  # fell off the bus
    "gsp": (119, 120),
    "app": (13, 31, 43, 45),  # application faults; 45 follows another error
}
XID_CLASS_NAMES = list(XID_CLASSES) + ["other"]
N_XID = len(XID_CLASS_NAMES)
_XID_LUT = np.full(1024, N_XID - 1, dtype=np.int64)
for _i, _codes in enumerate(XID_CLASSES.values()):
    _XID_LUT[list(_codes)] = _i

# Error groups whose persistence (share of recent hops with any new error) and acceleration
# (recent rate against the GPU's own week) are features: a degrading part errs hop after
# hop at a climbing rate, a benign burst or a lemon's steady background does not.
ACTIVE_GROUPS = {
    "sbe": ("sbe_vol", "sbe_agg"),
    "nvl": ("nvl_crc_flit", "nvl_crc_data", "nvl_replay", "nvl_recovery"),
    "pcie": ("pcie_replay",),
}
ACTIVE_TAUS = {"1h": 3600.0, "6h": 6 * 3600.0, "24h": 24 * 3600.0, "7d": 7 * 24 * 3600.0}
SURPRISE_FLOOR_PER_H = 0.01  # baseline error rate assumed for a GPU with none in its week
SURPRISE_MAX = 30.0
# Node-peer context: a GPU's link errors against the other GPUs of its node. A failing link
# errs hop after hop on one GPU (its peers log a sympathetic XID 74 now and then); a node-wide
# cause (a switch, a riser, a node-level event) makes several GPUs err together.
PEER_GROUPS = ("nvl", "pcie")
PEER_WINDOW_S = 3600.0  # a peer counts when its last erring hop ended within this before
PEER_STREAK_HOPS = 3  # ... and as streaking when that hop ended a run of >= this many
# Thermal node-peer context: a GPU whose 6 h temperature residual (against its own power fit)
# is at least this runs warm. Heat a node shares (a coolant excursion in its row, a chiller trip
# in its hall, a node fan) warms several GPUs of it at once; one GPU's own cooling fault warms
# it alone. 3 C: the 6 h residual stays under 1.3 C in 99% of hops (all GPUs) and under 3 C in
# >= 99.67% on the training family's tuning members (val-dr; docs/benchmarks.md, "Shared heat").
WARM_RESIDUAL_C = 3.0
# The same context at the level a GPU's own day-long residual raises rule 19 (2.0 C): a node peer
# whose 6 h residual reached 2.5 C within the hour runs about as warm for its power as the GPU
# being judged, so the heat is the node's, not one GPU's cooling (`node_heat_peers_1h`). At
# WARM_RESIDUAL_C, three GPUs of one node warming together to 2.8 C each read as alone.
HEAT_PEER_RESIDUAL_C = 2.5
# Memory node-peer context: other GPUs of the node with new single-bit ECC errors in the last
# 6 h (the window of the GPU's own recent SBE rate, `sbe_accel`, `sbe_active_6h`). One GPU's
# HBM degrading errs alone; a cause the node shares (heat, power, a host event) raises several.
PEER_SBE_WINDOW_S = 6 * 3600.0
# Power brakes beyond the node's: the GPU's own count of power-braked hops over about 6 h (an
# EW count, `brake_hops_6h`) against the highest such count among its node peers
# (`node_brake_hops_max_6h`). A PSU or shelf browning out, or a facility cap, brakes the GPUs it
# feeds about equally often; one GPU's failing supply or regulator brakes it more often than any
# peer. The peer maximum is read for closes whose own count is at least PEER_BRAKE_MIN_HOPS (0
# elsewhere): only those can be beyond their peers, and most hops of most fleets never brake.
PEER_BRAKE_MIN_HOPS = 1.0
# Power-brake node-peer context: other GPUs of the node whose hops had the HW power-brake clock
# event reason set within the hour. A power shelf, a PSU or the facility's power capping
# brakes every GPU it feeds; one GPU's own voltage regulator failing brakes it alone.
# The node-peer columns in `peer_end`'s column order (what each close marks: erring and
# streaking per PEER_GROUPS group, warm, erring single-bit, power-braked, warm at rule 19's
# level), and how long a mark counts.
PEER_COLUMNS = (
    *(f"node_{g}_peers_1h" for g in PEER_GROUPS), *(f"node_{g}_streak_peers_1h" for g in PEER_GROUPS),
    "node_warm_peers_1h", "node_sbe_peers_6h", "node_brake_peers_1h", "node_heat_peers_1h")
PEER_WINDOWS_S = np.array([PEER_SBE_WINDOW_S if c == "node_sbe_peers_6h" else PEER_WINDOW_S
                           for c in PEER_COLUMNS])
# Memory repair events: row remaps (Ampere and newer) and page retirements (Volta/Turing) are
# the same mechanism (HBM/GDDR sparing), so the model sees them merged.
REPAIR_COUNTERS = ("remap_corr", "remap_uncorr", "retired_sbe", "retired_dbe")

# Time constants of the exponentially weighted context (seconds).
TAU_TEMP_FAST, TAU_TEMP_SLOW = 1800.0, 7200.0  # difference of EMAs -> temperature slope
TAU_1H, TAU_6H, TAU_24H, TAU_7D = 3600.0, 6 * 3600.0, 24 * 3600.0, 7 * 24 * 3600.0
TAU_THERMAL_FAST, TAU_THERMAL_SLOW = 6 * 3600.0, 72 * 3600.0  # thermal-resistance fits
DRIFT_MIN_LAG_GAP_H = 12.0  # the fits' lags apart before their difference gives a drift
COUNT_TAUS = {"1h": TAU_1H, "6h": TAU_6H, "24h": TAU_24H, "7d": TAU_7D}
LOAD_UTIL_PCT = 50.0  # clock under load: samples with utilisation >= this
# Prior for the temperature-on-power fit: ~0.06 C/W is what datacenter GPUs show
# between idle (~35 C, ~15% TDP) and full load (~75 C at TDP for 700 W H100 SXM:
# (75-35)/(0.85*700) ~ 0.067 C/W); stated per unit of power/TDP so all models share it.
PRIOR_RTH_PER_TDP = 45.0  # C per (power/TDP), i.e. 45 C rise from idle to TDP
PRIOR_WEIGHT = 30.0  # pseudo-samples behind the prior (regularises flat-power periods)
PRIOR_SPREAD_VAR = 0.01  # each pseudo-sample carries a power/TDP spread of 0.1

# ---- accumulator layout (per slot, current hop) ----------------------------------------------
# gauge sums, gauge counts, temp max, regression sums (n, p, t, pp, pt) over power/TDP,
# clock-under-load sum and count, throttle bit counts, reason count, counter deltas,
# resets, level max, XID class counts.
A_GSUM = 0
A_GCNT = A_GSUM + N_GAUGE
A_TMAX = A_GCNT + N_GAUGE
A_REG = A_TMAX + 1  # n, sum p, sum t, sum pp, sum pt
A_CLK = A_REG + 5  # sum clock under load, count
A_BITS = A_CLK + 2
A_NREASON = A_BITS + N_BITS
A_DELTA = A_NREASON + 1
A_RESET = A_DELTA + N_COUNTER
A_LEVEL = A_RESET + 1
A_XID = A_LEVEL + N_LEVEL
A_NSAMPLE = A_XID + N_XID
A_REPLACED = A_NSAMPLE + 1  # another uuid, or a persistent counter went down: a new board in this slot
N_ACC = A_REPLACED + 1

# EW state layout (per slot).
E_TFAST = 0  # num, den
E_TSLOW = 2
E_REG_FAST = 4  # n, p, t, pp, pt
E_REG_SLOW = 9
E_RESID = 14  # num, den (6 h)
E_CLK_FAST = 16  # num, den (6 h)
E_CLK_SLOW = 18  # num, den (7 d)
E_THERMDUTY = 20  # num, den (6 h)
E_COUNT = 22  # counters then xid classes then resets, x 4 time scales
N_EVENT = N_COUNTER + N_XID + 1
E_ACTIVE = E_COUNT + len(COUNT_TAUS) * N_EVENT  # active-hop shares: (groups + 1 den) per scale
E_RESID24 = E_ACTIVE + len(ACTIVE_TAUS) * (len(ACTIVE_GROUPS) + 1)  # num, den (24 h)
E_RESID_COOL = E_RESID24 + 2  # num, den (24 h, hops without thermal throttling)
E_STREAK = E_RESID_COOL + 2  # consecutive hops with new errors, per active group
E_BRAKE = E_STREAK + len(ACTIVE_GROUPS)  # power-brake duty of the last closed hop
E_REPORTING = E_BRAKE + 1  # hours reported since the GPU's last silence of RETURN_SILENCE_S or more
E_BRAKE_6H = E_REPORTING + 1  # power-braked hops, EW count over 6 h
N_EW = E_BRAKE_6H + 1
# A GPU back from a failure starts its history afresh, as a replaced board does: the failure
# consumed the evidence before it, and a model fed that history raises the repaired GPU again
# for days on the XIDs of the failure itself. "Back from a failure": a failure-class XID
# (REFERENCE.md "XIDs": fatal memory, off the bus, GSP) counted within ~4 h of the GPU's last
# hop (6 h EW count >= 0.5), then at least an hour without a sample (the shortest window:
# a reset in place or a scrape gap is shorter; a repair is longer).
FAILURE_XID_CLASSES = ("mem_fatal", "bus", "gsp")
RETURN_SILENCE_S = 3600.0


def _ew_count(scale: str, event: int) -> int:
    """The EW slot counting event column `event` (counters, then XID classes, then resets) over
    the COUNT_TAUS time scale `scale`."""
    return E_COUNT + list(COUNT_TAUS).index(scale) * N_EVENT + event


_E_FAILURE_XID_6H = np.array([_ew_count("6h", N_COUNTER + XID_CLASS_NAMES.index(c))
                              for c in FAILURE_XID_CLASSES])

_BLANK_VALUES = np.array(sorted(DCGM_BLANKS))


def _max_of_earlier(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per element, the largest of `values` over the earlier elements (in array order) of
    the same group; -inf where there is none."""
    n = len(values)
    out = np.full(n, -np.inf)
    if n < 2:
        return out
    order = np.argsort(groups, kind="stable")  # groups contiguous, array order kept inside
    g, v = groups[order], values[order]
    first = np.r_[True, g[1:] != g[:-1]]
    if np.all(first[1:] | (v[1:] >= v[:-1])):  # nondecreasing inside every group (the usual case)
        earlier = np.r_[-np.inf, v[:-1]]
    else:
        # Running max per group in one pass: rank the values, offset each group's ranks above
        # every earlier group's, and take the running max of the combined integer keys.
        levels, rank = np.unique(v, return_inverse=True)
        seg = np.cumsum(first) - 1
        run = np.maximum.accumulate(seg * len(levels) + rank.reshape(-1))
        earlier = np.r_[-np.inf, levels[run[:-1] - seg[1:] * len(levels)]]
    earlier[first] = -np.inf
    out[order] = earlier
    return out


def _is_blank(values: np.ndarray) -> np.ndarray:
    return np.isin(values, _BLANK_VALUES) | (values >= float(DCGM_INT64_BLANK))


HOP_PHASES = 60  # staggered hops: phases are multiples of hop_s / 60 (10 s for 600 s hops)
DEDUP_RING = 64  # recent timestamps per GPU kept to drop redelivered samples inside a hop


def _feature_names() -> list[str]:
    names = [
        "samples", "temp_mean", "temp_max", "temp_slope_c_per_h", "mem_temp_mean", "mem_minus_gpu_temp",
        "power_frac_tdp", "util_mean", "inlet_est_c", "rth_fast", "rth_slow", "rth_ratio",
        "temp_residual", "temp_residual_6h", "clock_ratio", "clock_ratio_6h", "thermal_duty_6h",
    ]
    names += [f"thr_{b}" for b in THROTTLE_BITS]
    for scale in COUNT_TAUS:
        names += [f"{c}_{scale}" for c in COUNTER_FIELDS.values()]
        names += [f"xid_{x}_{scale}" for x in XID_CLASS_NAMES]
        names += [f"resets_{scale}"]
    names += [f"{c}_hop" for c in ("sbe_vol", "dbe_vol", "remap_corr", "remap_uncorr", "pcie_replay")]
    names += [f"xid_{x}_hop" for x in XID_CLASS_NAMES]
    names += ["remap_failure", "remap_pending", "retired_pending"]
    names += ["remap_corr_total", "remap_uncorr_total", "retired_total", "sbe_agg_total", "dbe_agg_total"]
    names += ["sbe_trend", "nvl_trend", "pcie_trend"]
    names += [f"{g}_active_{scale}" for scale in ACTIVE_TAUS for g in ACTIVE_GROUPS]
    names += [f"{g}_accel" for g in ACTIVE_GROUPS]
    names += [f"{g}_streak_h" for g in ACTIVE_GROUPS]
    names += [f"{g}_surprise" for g in ACTIVE_GROUPS]
    names += ["mem_repairs_6h", "mem_repairs_24h", "mem_repairs_7d", "mem_repair_pending"]
    names += ["temp_residual_24h", "temp_residual_cool_24h"]
    names += [f"node_{g}_{kind}_1h" for g in PEER_GROUPS for kind in ("peers", "streak_peers")]
    names += ["node_warm_peers_1h", "node_sbe_peers_6h"]  # running warm; erring single-bit
    # How hot the GPU would run at full power now (its 6 h temperature-on-power fit at power =
    # TDP, carried over the fit's lag) and how fast that rises (the 6 h fit against the 72 h
    # fit): the thermal headroom's load-independent part and its drift (predictors.trends).
    names += ["temp_at_tdp_c", "temp_at_tdp_drift_c_per_h"]
    # After the fitted columns (a model reads its own by name): node peers power-braked, and the
    # GPU's power-brake duty in its previous hop.
    names += ["node_brake_peers_1h", "thr_power_brake_prev"]
    # Hours the GPU has reported since its last silence of an hour or more (a repair, a reboot, a
    # new board): how long its own baselines have described the board as it is now.
    names += ["hours_reporting"]
    # Node peers warm for their power at rule 19's level (HEAT_PEER_RESIDUAL_C) within the hour.
    names += ["node_heat_peers_1h"]
    # The GPU's power-braked hops over about 6 h and the most of any node peer (PEER_BRAKE_MIN_HOPS).
    names += ["brake_hops_6h", "node_brake_hops_max_6h"]
    return names


FEATURE_NAMES: list[str] = _feature_names()
_FI = {name: i for i, name in enumerate(FEATURE_NAMES)}
_CI = {short: i for i, short in enumerate(COUNTER_FIELDS.values())}
# Counters kept by the board across reboots (InfoROM): one going down means the board was
# replaced, and the slot's history (baselines, error rates) belongs to the old board.
_PERSISTENT_COLS = np.array([_CI[c] for c in ("sbe_agg", "dbe_agg", "remap_corr", "remap_uncorr",
                                              "retired_sbe", "retired_dbe")])


@lru_cache(maxsize=256)
def resolve_model(model: str) -> tuple[str, float]:
    """Catalog id and TDP (W) for a model name as NVML/dcgm-exporter report it."""
    from fleetwise.catalog import lookup

    spec = lookup(model)
    return spec.id, float(spec.tdp_w)


def sample_row(sample: dict[str, Any]) -> list[Any]:
    """One sample dict's row for `ingest`: its metrics in INPUT_FIELDS order (None = missing),
    then its board id."""
    metrics = sample["metrics"]
    row = list(map(metrics.get, INPUT_FIELDS))
    if row[COL_REASONS] is None and F_REASONS_OLD in metrics:
        row[COL_REASONS] = metrics[F_REASONS_OLD]
    row.append(board_id(sample.get("uuid")))
    return row


class GpuFeatureWindows:
    """Event-time hopping windows per GPU (key "node/gpu"); see the module docstring."""

    def __init__(
        self, hop_s: float = 600.0, capacity: int = 1024, tdp_lookup: Any = None, stagger: bool = False
    ) -> None:
        if hop_s <= 0:
            raise ValueError("hop_s must be positive")
        self.hop_s = float(hop_s)
        # Staggered hops: each GPU's hop grid is shifted by a fixed phase from its key, so a
        # fleet's hops close spread over the hop instead of all in one tick (a stream worker
        # then emits a steady trickle of feature records, not a burst of one per GPU).
        self.stagger = stagger
        self._tdp_lookup = tdp_lookup or resolve_model
        self._slot: dict[str, int] = {}
        # The same slots by (node, gpu), filled by `ingest_samples`: its per-sample lookup then
        # builds no "node/gpu" string.
        self._slot_by_gpu: dict[tuple[str, int], int] = {}
        self._meta: list[dict[str, Any]] = []  # node, gpu, model id, rack, site per slot
        self._job: list[str | None] = []  # job and rank of the GPU's last sample in its hop
        self._rank: list[int | None] = []
        # Node-peer context: each slot's node index, each node's slots, and per node and
        # PEER_COLUMNS mark the end of the latest hop of any of its GPUs so marked (which
        # closes need a look).
        self._node_index: dict[str, int] = {}
        self._node_slots: list[list[int]] = []
        self._node_mark_end = np.full((16, len(PEER_COLUMNS)), -np.inf)
        self._cap = 0
        self._grow(capacity)
        self.dropped_late = 0
        # (job, rank) per row of the last ingest/flush result, as of each hop's close (two
        # lists: the failure predictor reads only the rows it emits)
        self.closed_job_ranks = _JobRanks([], [])
        self.dropped_duplicate = 0
        self.samples_in = 0

    # ---- state arrays ----
    def _grow(self, capacity: int) -> None:
        old = self._cap
        def grow(arr: np.ndarray | None, shape: tuple[int, ...], fill: float) -> np.ndarray:
            new = np.full((capacity, *shape), fill, dtype=np.float64)
            if arr is not None:
                new[:old] = arr
            return new
        # acc, ew, base (last counter reading), last_xid, open/closed hop, last_ts, ts_ring
        for name, (shape, fill) in _FRESH_STATE.items():
            setattr(self, name, grow(getattr(self, name, None), shape, fill))
        self.tdp = grow(getattr(self, "tdp", None), (), np.nan)
        self.phase = grow(getattr(self, "phase", None), (), 0.0)  # hop grid offset, s (from the key)
        node_of = np.full(capacity, -1, dtype=np.int64)
        node_of[:old] = getattr(self, "node_of", node_of)[:old]
        self.node_of = node_of
        self._cap = capacity

    def _join_node(self, slot: int, node: str) -> None:
        nid = self._node_index.setdefault(node, len(self._node_index))
        if nid == len(self._node_slots):
            self._node_slots.append([])
            if nid >= len(self._node_mark_end):
                grown = np.full_like(self._node_mark_end, -np.inf)
                self._node_mark_end = np.vstack([self._node_mark_end, grown])
        self._node_slots[nid].append(slot)
        self.node_of[slot] = nid

    def _slot_of(self, node: str, gpu: int, model: str, rack: str | None, site: str | None) -> int:
        key = f"{node}/{gpu}"
        slot = self._slot.get(key)
        if slot is None:
            slot = len(self._meta)
            if slot >= self._cap:
                self._grow(self._cap * 2)
            model_id, tdp = self._tdp_lookup(model)
            self._slot[key] = slot
            self._meta.append({"node": node, "gpu": gpu, "model": model_id, "rack": rack, "site": site})
            self._job.append(None)
            self._rank.append(None)
            self.tdp[slot] = tdp
            self.phase[slot] = self.hop_phase(key)
            self._join_node(slot, node)
        return slot

    def hop_phase(self, key: str) -> float:
        """Offset of a GPU's hop grid (s): 0 unless staggered, else one of 60 steps of the hop
        chosen by the key's CRC-32 (stable across processes and restarts)."""
        if not self.stagger:
            return 0.0
        return (zlib.crc32(key.encode()) % HOP_PHASES) * self.hop_s / HOP_PHASES

    def register(
        self, node: str, gpu: int, model: str, rack: str | None = None, site: str | None = None
    ) -> int:
        """Slot index of a GPU (created on first sight); for callers that ingest arrays."""
        return self._slot_of(node, gpu, model, rack, site)

    def job_ranks(self, slots: Iterable[int]) -> list[tuple[str | None, int | None]]:
        """(job, rank) of each slot's last sample in its last closed or open hop (None: idle)."""
        return [(self._job[i], self._rank[i]) for i in slots]

    # ---- public processor contract ----
    def process(self, records: Sequence[NodeBatch | GpuSample]) -> list[FeatureVector]:
        """Feed samples (or node batches) in event-time order; return features of closed hops."""
        return self.to_records(*self.ingest_samples(records))

    def ingest_samples(
        self, samples: SampleColumns | Sequence[GpuSample | FastGpuSample | NodeBatch | SampleColumns],
        slots: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validated samples (pydantic records, `SAMPLE_DECODER`'s structs or columns, node
        batches) -> closed hops as arrays; per sample only a slot lookup, the rest is one matrix
        per call. `slots`: each sample's slot as the caller looked it up in `_slot_by_gpu`
        (-1: not there), e.g. `SampleGate.screen`'s, so it is not looked up twice."""
        cols = samples if isinstance(samples, SampleColumns) else sample_columns(samples)
        slot_by_gpu = self._slot_by_gpu
        found: Any = slots
        if found is None:
            found = list(map(slot_by_gpu.get, zip(cols.node, cols.gpu, strict=True)))
            new = [i for i, slot in enumerate(found) if slot is None] if None in found else []
        else:
            new = np.flatnonzero(found < 0).tolist()
        for i in new:  # GPUs not looked up this way before
            node, gpu = cols.node[i], cols.gpu[i]
            slot = self._slot_of(node, gpu, cols.model[i], cols.rack[i], cols.site[i])
            found[i] = slot_by_gpu[node, gpu] = slot
        # The rows: the metrics (the columns are the caller's: one copy, ours), then the board.
        metrics = cols.metrics
        x = np.empty((len(metrics), N_ROW))
        x[:, :N_INPUT] = metrics[:, :N_INPUT]
        x[:, COL_BOARD] = cols.board
        # Field 112 under its pre-DCGM-3.3 name fills in where the new name is missing.
        old = metrics[:, N_INPUT]
        fill = np.isnan(x[:, COL_REASONS]) & ~np.isnan(old)
        if fill.any():
            x[fill, COL_REASONS] = old[fill]
        return self.ingest(found, cols.ts, x, job_ranks=_JobRanks(cols.job, cols.rank), copy=False)

    def process_dicts(self, samples: Iterable[dict[str, Any]]) -> list[FeatureVector]:
        """Fast path for already-validated plain dicts (keys as in DESIGN.md; ts in Unix seconds)."""
        return self.to_records(*self.ingest_dicts(samples))

    def ingest_dicts(self, samples: Iterable[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Like `process_dicts` but returns the closed hops as arrays (slots, hop ends, features)."""
        slots, ts, rows = [], [], []
        slot_of, slot_map = self._slot_of, self._slot
        jrs = []
        for s in samples:
            slot = slot_map.get(f"{s['node']}/{s['gpu']}")
            if slot is None:
                slot = slot_of(s["node"], s["gpu"], s["model"], s.get("rack"), s.get("site"))
            slots.append(slot)
            ts.append(s["ts"])
            jrs.append((s.get("job"), s.get("rank")))
            rows.append(sample_row(s))
        return self.ingest(slots, ts, rows, job_ranks=jrs)

    def flush(self) -> list[FeatureVector]:
        """Close every open hop (end of a replay)."""
        return self.to_records(*self.flush_arrays())

    def flush_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = len(self._meta)
        open_slots = np.flatnonzero(self.open_hop[:n] >= 0)
        self.closed_job_ranks = _JobRanks([], [])
        out = self._close(open_slots)
        self.open_hop[open_slots] = -1.0
        self._peer_context(*out, np.full(len(open_slots), np.inf))  # closed together: none first
        return out

    def keys(self) -> list[str]:
        return list(self._slot)

    def state(self, key: str) -> dict:
        slot = self._slot[key]
        arrays = {name: getattr(self, name)[slot] for name in STATE_ARRAYS}
        return {"meta": dict(self._meta[slot]), "job": self._job[slot], "rank": self._rank[slot],
                **{k: _to_json(v) for k, v in arrays.items()}}

    def restore(self, key: str, state: dict) -> None:
        slot = self._restore_slot(key, state["meta"], state.get("job"), state.get("rank"))
        for name in STATE_ARRAYS:
            getattr(self, name)[slot] = _restored_state(name, state, _from_json)
        self._note_node_marks([slot])

    def forget(self, key: str) -> None:
        """Back to the state of a GPU never seen (its slot, model and TDP stay): for a worker
        whose memory of it is newer than the saved state it restores, before the messages
        after that save come again."""
        slot = self._slot.get(key)
        if slot is None:
            return
        for name, (_shape, fill) in _FRESH_STATE.items():
            getattr(self, name)[slot] = fill
        self._job[slot] = self._rank[slot] = None

    def export_state(self, keys: Sequence[str]) -> tuple[list[dict], list[tuple], dict[str, np.ndarray]]:
        """`state()` of many keys at once, as arrays: (meta per key, (job, rank) per key,
        {name: rows} for each of STATE_ARRAYS). For a worker saving thousands of GPUs per
        checkpoint (one numpy gather per array instead of JSON lists per key)."""
        slots = np.fromiter(map(self._slot.__getitem__, keys), dtype=np.int64, count=len(keys))
        listed = slots.tolist()
        metas = [dict(self._meta[s]) for s in listed]
        return metas, self.job_ranks(listed), {name: getattr(self, name)[slots] for name in STATE_ARRAYS}

    def import_state(self, keys: Sequence[str], metas: Sequence[dict], job_ranks: Sequence[tuple],
                     arrays: dict[str, np.ndarray]) -> None:
        """`restore()` of many keys at once, from what `export_state` gave."""
        if not set(STATE_ARRAYS) - set(_ADDED_STATE_ARRAYS) <= set(arrays) <= set(STATE_ARRAYS):
            # state saved by another layout of this code
            raise ValueError(
                f"feature state arrays {sorted(arrays)} differ from this code's {sorted(STATE_ARRAYS)}")
        slots = [self._restore_slot(k, m, j, r) for k, m, (j, r) in zip(keys, metas, job_ranks, strict=True)]
        for name in STATE_ARRAYS:
            getattr(self, name)[slots] = _restored_state(name, arrays)
        self._note_node_marks(slots)

    def _note_node_marks(self, slots: Sequence[int]) -> None:
        """Restored slots' latest marked hops into their nodes' (a superset is harmless: it
        only decides which closes are looked at)."""
        if len(slots):
            idx = np.asarray(slots, dtype=np.int64)
            np.maximum.at(self._node_mark_end, self.node_of[idx], self.peer_end[idx])

    def _restore_slot(self, key: str, meta: dict, job: str | None, rank: int | None) -> int:
        slot = self._slot.get(key)
        if slot is None:
            slot = len(self._meta)
            if slot >= self._cap:
                self._grow(self._cap * 2)
            self._slot[key] = slot
            self._meta.append(dict(meta))
            self._job.append(None)
            self._rank.append(None)
            self.phase[slot] = self.hop_phase(key)
            self._join_node(slot, meta["node"])
        else:
            self._meta[slot] = dict(meta)
        self._job[slot], self._rank[slot] = job, rank
        return slot

    def keep_slots(self, kept: np.ndarray) -> None:
        """Drop every slot but `kept` (sorted slot indices), renumbering those in their order;
        the arrays keep their capacity (a worker's state bound, `streams.limits.evict_idle`)."""
        fills = {**{name: fill for name, (_shape, fill) in _FRESH_STATE.items()}, "tdp": np.nan, "phase": 0.0}
        for name, fill in fills.items():
            arr = getattr(self, name)
            new = np.full_like(arr, fill)
            new[: len(kept)] = arr[kept]
            setattr(self, name, new)
        idx = kept.tolist()
        self._meta = [self._meta[i] for i in idx]
        self._job = [self._job[i] for i in idx]
        self._rank = [self._rank[i] for i in idx]
        self._slot = {f"{m['node']}/{m['gpu']}": i for i, m in enumerate(self._meta)}
        self._slot_by_gpu = {(m["node"], m["gpu"]): i for i, m in enumerate(self._meta)}
        self._node_index, self._node_slots = {}, []
        self._node_mark_end = np.full((16, len(PEER_COLUMNS)), -np.inf)
        self.node_of[:] = -1
        for slot, m in enumerate(self._meta):
            self._join_node(slot, m["node"])
        self._note_node_marks(range(len(self._meta)))

    def slot_meta(self, slot: int) -> dict[str, Any]:
        return self._meta[slot]

    def slot_keys(self) -> list[str]:
        """Key per slot index (node/gpu)."""
        return [f"{m['node']}/{m['gpu']}" for m in self._meta]

    # ---- core: vectorised ingest ----
    def ingest(
        self, slots: Sequence[int], ts: Sequence[float], rows: Sequence[Sequence[Any]],
        job_ranks: Sequence[tuple[str | None, int | None]] | None = None, copy: bool = True,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Ingest samples given as slot indices, timestamps and rows (INPUT_FIELDS, then the board:
        `sample_row`; N_INPUT columns: no board named). `copy=False`: `rows` is a float64 array
        of the caller's that the windows may change (its own scratch), not copied.

        `job_ranks` (optional, one (job, rank) per sample) gives each closed hop the job and
        rank of the GPU's last sample in that hop (`job_ranks()`, the records' job/rank), so
        the result does not depend on how samples were batched.
        Returns (slots, hop end ts, feature matrix) for every hop this closed; the (job, rank)
        of those rows is in `closed_job_ranks` (for `FailurePredictor.process_arrays`)."""
        n = len(slots)
        empty = (np.empty(0, np.int64), np.empty(0), np.empty((0, len(FEATURE_NAMES))))
        self.closed_job_ranks = _JobRanks([], [])
        if n == 0:
            return empty
        self.samples_in += n
        s = np.asarray(slots, dtype=np.int64)
        t = np.asarray(ts, dtype=np.float64)
        x = np.array(rows, dtype=np.float64, copy=copy)
        if x.shape[1] == N_INPUT:
            x = np.column_stack([x, np.full(n, np.nan)])
        # DCGM blank sentinels ("no value") are missing readings, not huge ones; matched
        # exactly, like the schema does (a large legitimate counter is not a blank).
        big = x[:, :N_INPUT] >= DCGM_INT32_BLANK
        if big.any():
            idx = np.nonzero(big)
            vals = x[idx]
            x[idx[0][_is_blank(vals)], idx[1][_is_blank(vals)]] = np.nan
        hop = np.floor((t - self.phase[s]) / self.hop_s)
        # Late and in-order are decided in arrival order, as if the samples came one at a time:
        # a sample is late when an earlier one of its GPU (before this call or earlier in it)
        # had already moved the GPU on to a later hop. Deciding after sorting by time would let
        # a late sample into a hop that a call of its own would have found closed, and the
        # features would depend on how the samples were batched (replay vs Kafka fetches).
        open_h = np.maximum(self.open_hop[s], _max_of_earlier(s, hop))
        seen_ts = np.fmax(self.last_ts[s], _max_of_earlier(s, t))  # -inf: none yet
        order = np.lexsort((t, s))
        s, t, x, hop = s[order], t[order], x[order], hop[order]
        open_h, seen_ts = open_h[order], seen_ts[order]
        # Each row's arrival index (into job_ranks), carried through the sorting and filtering:
        # the last row of each GPU's hop gives its job (`_note_jobs`); the first row after a hop
        # is the one that closed it, which orders the closes for node-peer context.
        pos = order

        # Exact duplicates inside the batch, and against the last accepted sample.
        dup = np.zeros(n, dtype=bool)
        dup[1:] = (s[1:] == s[:-1]) & (t[1:] == t[:-1])
        dup |= t == self.last_ts[s]
        # Late: older than the GPU's open hop when it arrived.
        late = (open_h >= 0) & (hop < open_h) & ~dup
        # Out of order inside the open hop: check the recent-timestamp ring for a redelivery.
        ooo = ~dup & ~late & (t < seen_ts)
        if ooo.any():
            idx = np.flatnonzero(ooo)
            dup[idx] = (self.ts_ring[s[idx]] == t[idx, None]).any(axis=1)
        self.dropped_duplicate += int(dup.sum())
        self.dropped_late += int(late.sum())
        keep = ~(dup | late)
        in_order = t > seen_ts  # newer than every earlier arrival: may update counters and XID state
        if not keep.all():
            s, t, x, hop, in_order, pos = s[keep], t[keep], x[keep], hop[keep], in_order[keep], pos[keep]
        if len(s) == 0:
            return empty

        # New GPUs open at their first hop.
        fresh = self.open_hop[s] < 0
        if fresh.any():
            first = np.flatnonzero(fresh)
            # rows are sorted by ts inside a slot: assign in reverse so the earliest wins
            self.open_hop[s[first[::-1]]] = hop[first[::-1]]

        # Step i accumulates each GPU's i-th hop of this call (0: the hop open before it) and
        # closes it where the GPU has rows in a later hop. A row's step is the count of hop
        # changes before it in its GPU's rows (sorted by slot, ts: hops non-decreasing).
        gpu_start = np.r_[True, s[1:] != s[:-1]]
        change = np.where(gpu_start, hop != self.open_hop[s], np.r_[False, hop[1:] != hop[:-1]])
        total = np.cumsum(change)
        seg = np.cumsum(gpu_start) - 1  # each row's GPU, numbered in slot order
        step = total - (total - change)[np.flatnonzero(gpu_start)][seg]
        # The sample that closed a hop: the GPU's earliest arrival among its rows of later hops.
        # A running min from the last row back; the offset puts each GPU's rows below every
        # later GPU's, so the min starts afresh at each GPU's last row.
        big = np.int64(pos.max()) + 1
        later_min = np.minimum.accumulate((pos + seg * big)[::-1])[::-1] - seg * big
        by_step = np.argsort(step, kind="stable")  # each step's rows stay sorted by slot, ts
        bounds = np.searchsorted(step[by_step], np.arange(int(step.max()) + 2))
        out_slots, out_ts, out_feat, out_by = [], [], [], []
        for i in range(len(bounds) - 1):
            rows = by_step[bounds[i]:bounds[i + 1]]
            if len(rows):
                self._accumulate(s[rows], t[rows], x[rows], in_order[rows])
                if job_ranks is not None:
                    self._note_jobs(s[rows], pos[rows], job_ranks)
            nxt = by_step[bounds[i + 1]:bounds[i + 2]] if i + 2 < len(bounds) else by_step[:0]
            if len(nxt) == 0:
                break
            ns = s[nxt]
            starts = nxt[np.r_[True, ns[1:] != ns[:-1]]]  # each closing GPU's first row
            cs, cts, cf = self._close(s[starts])
            out_slots.append(cs)
            out_ts.append(cts)
            out_feat.append(cf)
            out_by.append(later_min[starts].astype(np.float64))
            self.open_hop[s[starts]] = hop[starts]
        if not out_slots:
            return empty
        del x, t  # the sorted copies go before the hops are stacked (the call's peak memory)
        out = np.concatenate(out_slots), np.concatenate(out_ts), np.vstack(out_feat)
        self._peer_context(*out, np.concatenate(out_by))
        return out

    def _accumulate(self, s: np.ndarray, t: np.ndarray, x: np.ndarray, in_order: np.ndarray) -> None:
        """Add rows (sorted by slot, ts; all in their slot's open hop) to the hop accumulators."""
        n = len(s)
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        us = s[starts]
        acc = self.acc
        g = x[:, :N_GAUGE]
        gvalid = ~np.isnan(g)
        acc[us, A_GSUM:A_GSUM + N_GAUGE] += np.add.reduceat(np.where(gvalid, g, 0.0), starts, axis=0)
        acc[us, A_GCNT:A_GCNT + N_GAUGE] += np.add.reduceat(gvalid.astype(np.float64), starts, axis=0)
        acc[us, A_TMAX] = np.fmax(acc[us, A_TMAX], np.fmax.reduceat(g[:, COL_TEMP], starts))
        # Regression sums of temperature on power/TDP.
        p = g[:, COL_POWER] / self.tdp[s]
        temp = g[:, COL_TEMP]
        ok = ~(np.isnan(p) | np.isnan(temp))
        p0, t0 = np.where(ok, p, 0.0), np.where(ok, temp, 0.0)
        reg = np.stack([ok.astype(np.float64), p0, t0, p0 * p0, p0 * t0], axis=1)
        acc[us, A_REG:A_REG + 5] += np.add.reduceat(reg, starts, axis=0)
        # Clock under load.
        load = (g[:, COL_UTIL] >= LOAD_UTIL_PCT) & ~np.isnan(g[:, COL_SMCLK])
        clk = np.stack([np.where(load, g[:, COL_SMCLK], 0.0), load.astype(np.float64)], axis=1)
        acc[us, A_CLK:A_CLK + 2] += np.add.reduceat(clk, starts, axis=0)
        # Throttle reasons: share of samples with each bit set.
        reasons = x[:, COL_REASONS]
        rvalid = ~np.isnan(reasons)
        rbits = (np.where(rvalid, reasons, 0).astype(np.int64)[:, None] & _BIT_VALUES) != 0
        acc[us, A_BITS:A_BITS + N_BITS] += np.add.reduceat(rbits.astype(np.float64), starts, axis=0)
        acc[us, A_NREASON] += np.add.reduceat(rvalid.astype(np.float64), starts)
        # Levels: worst in the hop.
        lv = x[:, COL_LEVEL:COL_LEVEL + N_LEVEL]
        acc[us, A_LEVEL:A_LEVEL + N_LEVEL] = np.fmax(
            acc[us, A_LEVEL:A_LEVEL + N_LEVEL], np.fmax.reduceat(lv, starts, axis=0)
        )
        counts = np.diff(np.r_[starts, n])
        acc[us, A_NSAMPLE] += counts

        # Counters and XID: sequential per GPU, over in-order rows only.
        if in_order.any():
            if not in_order.all():
                s2, x2 = s[in_order], x[in_order]
                starts2 = np.flatnonzero(np.r_[True, s2[1:] != s2[:-1]])
            else:
                s2, x2, starts2 = s, x, starts
            self._counters(s2, x2, starts2)
        # Timestamps: last accepted and a ring of recent ones (redelivery check).
        last_idx = np.r_[starts[1:], n] - 1
        self.last_ts[us] = np.fmax(self.last_ts[us], t[last_idx])
        # Ring positions follow the hop's sample count before this call, so the ring holds the
        # GPU's last DEDUP_RING accepted timestamps however the samples were split into calls
        # (counting from the count after the call skipped positions and overwrote recent ones
        # early: a redelivery then passed as new in a Kafka fetch but not in a replay).
        rank = np.arange(n) - np.repeat(starts, counts)
        pos = (acc[s, A_NSAMPLE].astype(np.int64) - np.repeat(counts, counts) + rank) % DEDUP_RING
        self.ts_ring[s, pos] = t

    def _peer_context(
        self, slots: np.ndarray, ends: np.ndarray, f: np.ndarray, closed_by: np.ndarray
    ) -> None:
        """Fill the node-peer columns of closed hops (`slots`, hop `ends`, features `f`, each
        closed by the sample of arrival index `closed_by`; inf: at a flush) and note each
        hop's marks (link and single-bit errors, warmth) for its peers.

        A hop sees a peer's hops that were closed before it, in arrival order: a node's samples
        arrive in one order whether replayed or read from its Kafka partition, so the result
        does not depend on how they were split into calls (closes of one call are taken in
        arrival order, not in the order this code closed them). Only closes on a node with a
        marked hop in its column's window are looked at; the rest read 0."""
        cols = [_FI[c] for c in PEER_COLUMNS]
        f[:, cols] = 0.0
        if len(slots) == 0:
            return
        order_key = np.unique(closed_by, return_inverse=True)[1].reshape(-1).astype(np.int64)
        self._peer_brake_max(slots, ends, f, order_key)
        hops = np.stack([f[:, _FI[f"{g}_streak_h"]] for g in PEER_GROUPS], axis=1) * (3600.0 / self.hop_s)
        # What each close tells its peers, in PEER_COLUMNS order.
        warm = f[:, _FI["temp_residual_6h"]] >= WARM_RESIDUAL_C  # NaN: not warm
        sbe = f[:, _FI["sbe_streak_h"]] > 0  # new single-bit errors in this hop
        brake = f[:, _FI["thr_power_brake"]] > 0  # a sample of the hop had the power brake on
        heat = f[:, _FI["temp_residual_6h"]] >= HEAT_PEER_RESIDUAL_C
        marks = np.concatenate([hops > 0.5, hops >= PEER_STREAK_HOPS - 0.5, warm[:, None], sbe[:, None],
                                brake[:, None], heat[:, None]], axis=1)
        nodes = self.node_of[slots]
        look = (self._node_mark_end[nodes] >= ends[:, None] - PEER_WINDOWS_S).any(axis=1)
        marked = marks.any(axis=1)
        if marked.any():
            look |= np.isin(nodes, nodes[marked])
        if not look.any():
            return
        idx = np.flatnonzero(look)
        pair_c, pair_p = self._node_pairs(slots, idx)
        # A peer's latest marked hop as of each close: from its state before this call, or the
        # last of its marked closes in this call that arrived before this close did (a GPU's
        # closes come in hop order, so the last to arrive has the latest end).
        latest = self.peer_end[pair_p].copy()
        for j in range(marks.shape[1]):
            rows = np.flatnonzero(marks[:, j])
            if len(rows) == 0:
                continue
            hit, rows_q = _arrived_before(slots, order_key, rows, pair_c, pair_p)
            latest[hit, j] = np.maximum(latest[hit, j], ends[rows_q])
        recent = latest >= ends[pair_c][:, None] - PEER_WINDOWS_S
        counts = np.zeros((len(slots), marks.shape[1]))
        np.add.at(counts, pair_c, recent.astype(np.float64))
        f[idx[:, None], cols] = counts[idx]
        # What the peers of later closes see of these.
        rows, cols_j = np.nonzero(marks)
        np.maximum.at(self.peer_end, (slots[rows], cols_j), ends[rows])
        np.maximum.at(self._node_mark_end, (nodes[rows], cols_j), ends[rows])

    def _node_pairs(self, slots: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(close, peer slot) pairs: each close of `idx` (indices into `slots`) with every other
        GPU of its node."""
        nodes = self.node_of[slots[idx]]
        uniq, inv = np.unique(nodes, return_inverse=True)
        members = [self._node_slots[n] for n in uniq.tolist()]
        sizes = np.array([len(m) for m in members])
        flat = np.fromiter(itertools.chain.from_iterable(members), dtype=np.int64, count=int(sizes.sum()))
        start = np.r_[0, np.cumsum(sizes)[:-1]]
        reps = sizes[inv]
        pair_c = np.repeat(idx, reps)
        within = np.arange(len(pair_c)) - np.repeat(np.cumsum(reps) - reps, reps)
        pair_p = flat[np.repeat(start[inv], reps) + within]
        other = pair_p != slots[pair_c]
        return pair_c[other], pair_p[other]

    def _peer_brake_max(self, slots: np.ndarray, ends: np.ndarray, f: np.ndarray,
                        order_key: np.ndarray) -> None:
        """`node_brake_hops_max_6h` of the closes whose own `brake_hops_6h` is at least
        PEER_BRAKE_MIN_HOPS: the highest count among the node's other GPUs, each as of its latest
        close that arrived before this one (in this call, else from the state), decayed to this
        close's end as the count itself decays. Then each GPU's last close of the call becomes
        its state (what later closes of its peers read)."""
        own = f[:, _FI["brake_hops_6h"]]
        col = _FI["node_brake_hops_max_6h"]
        f[:, col] = 0.0
        ask = np.flatnonzero(own >= PEER_BRAKE_MIN_HOPS)
        if len(ask):
            pair_c, pair_p = self._node_pairs(slots, ask)
            value = self.peer_brake_hops[pair_p].copy()
            end = self.peer_brake_end[pair_p].copy()
            hit, rows_q = _arrived_before(slots, order_key, np.arange(len(slots)), pair_c, pair_p)
            value[hit], end[hit] = own[rows_q], ends[rows_q]
            with np.errstate(invalid="ignore"):  # a peer never closed: end -inf, value 0
                now = value * np.exp(-np.maximum(ends[pair_c] - end, 0.0) / TAU_6H)
            peak = np.zeros(len(slots))
            np.maximum.at(peak, pair_c, np.nan_to_num(now))
            f[ask, col] = peak[ask]
        last = np.lexsort((order_key, slots))  # by slot, then arrival: each slot's last close last
        last = last[np.r_[slots[last][1:] != slots[last][:-1], True]]
        self.peer_brake_hops[slots[last]] = own[last]
        self.peer_brake_end[slots[last]] = ends[last]

    def _note_jobs(self, s: np.ndarray, pos: np.ndarray,
                   job_ranks: Sequence[tuple[str | None, int | None]]) -> None:
        """Job and rank of each slot's last row (rows sorted by slot, ts; `pos`: their indices
        into `job_ranks`) in its open hop."""
        last = np.flatnonzero(np.r_[s[1:] != s[:-1], True])
        for slot, i in zip(s[last].tolist(), pos[last].tolist(), strict=True):
            self._job[slot], self._rank[slot] = job_ranks[i]

    def _counters(self, s: np.ndarray, x: np.ndarray, starts: np.ndarray) -> None:
        n = len(s)
        us = s[starts]
        group_start = np.repeat(starts, np.diff(np.r_[starts, n]))
        # counters, board (`base`'s columns), then the last XID
        cols = np.r_[COL_COUNTER:COL_COUNTER + N_COUNTER, COL_BOARD, COL_XID]
        v = x[:, cols]
        base = np.concatenate([self.base[s], self.last_xid[s][:, None]], axis=1)
        valid = ~np.isnan(v)
        # previous valid reading in the same GPU's rows, else the stored base
        idx = np.where(valid, np.arange(n)[:, None], -1)
        ff = np.maximum.accumulate(idx, axis=0)
        prev_idx = np.vstack([np.full((1, v.shape[1]), -1), ff[:-1]])
        in_group = prev_idx >= group_start[:, None]
        prev = np.where(in_group, np.take_along_axis(v, np.maximum(prev_idx, 0), axis=0), base)
        has_prev = valid & ~np.isnan(prev)
        cv, cp, ch = v[:, :N_COUNTER], prev[:, :N_COUNTER], has_prev[:, :N_COUNTER]
        delta = np.where(ch, cv - cp, 0.0)
        reset = delta < 0
        delta[reset] = 0.0  # reset: the new reading is the base, never a negative delta
        # Another board named (a uuid other than the last): its readings are the new bases.
        new_board = has_prev[:, N_COUNTER] & (v[:, N_COUNTER] != prev[:, N_COUNTER])
        delta[new_board] = 0.0
        self.acc[us, A_DELTA:A_DELTA + N_COUNTER] += np.add.reduceat(delta, starts, axis=0)
        self.acc[us, A_RESET] += np.add.reduceat(reset.any(axis=1).astype(np.float64), starts)
        replaced = reset[:, _PERSISTENT_COLS].any(axis=1) | new_board
        if replaced.any():
            self.acc[us, A_REPLACED] += np.add.reduceat(replaced.astype(np.float64), starts)
        # XID: a change to a new non-zero value is one event of that XID's class
        xv, xp = v[:, -1], prev[:, -1]
        event = has_prev[:, -1] & (xv != xp) & (xv > 0)
        if event.any():
            cls = _XID_LUT[np.clip(np.where(event, xv, 0), 0, 1023).astype(np.int64)]
            onehot = np.zeros((n, N_XID))
            onehot[np.flatnonzero(event), cls[event]] = 1.0
            self.acc[us, A_XID:A_XID + N_XID] += np.add.reduceat(onehot, starts, axis=0)
        # new bases: last valid reading per GPU (unchanged where none)
        last_valid = ff[np.r_[starts[1:], n] - 1]  # (groups, cols)
        has = last_valid >= starts[:, None]
        newv = np.take_along_axis(v, np.maximum(last_valid, 0), axis=0)
        newbase = np.where(has, newv, base[starts])
        self.base[us] = newbase[:, :N_COUNTER + 1]
        self.last_xid[us] = newbase[:, -1]

    def _close(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Close the open hop of `slots`: fold it into the EW context, return features, reset."""
        k = len(slots)
        if k == 0:
            return np.empty(0, np.int64), np.empty(0), np.empty((0, len(FEATURE_NAMES)))
        listed = slots.tolist()
        self.closed_job_ranks.jobs += map(self._job.__getitem__, listed)
        self.closed_job_ranks.ranks += map(self._rank.__getitem__, listed)
        a = self.acc[slots]
        ew = self.ew[slots]
        hop = self.open_hop[slots]
        prev = self.closed_hop[slots]
        # back after an hour or more without a sample (whole hops without one before this hop)
        silent = (prev >= 0) & ((hop - prev - 1) * self.hop_s >= RETURN_SILENCE_S)
        returned = silent & (ew[:, _E_FAILURE_XID_6H].sum(axis=1) >= 0.5)
        fresh = (a[:, A_REPLACED] > 0) | returned
        gap = np.where((prev >= 0) & ~fresh, (hop - prev) * self.hop_s, np.inf)
        ew[fresh] = 0.0  # a replaced board, or one back from its failure, starts without history

        def decay(tau: float) -> np.ndarray:
            return np.exp(-gap / tau)[:, None]

        f = np.full((k, len(FEATURE_NAMES)), np.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            gmean = a[:, A_GSUM:A_GSUM + N_GAUGE] / a[:, A_GCNT:A_GCNT + N_GAUGE]
            temp = gmean[:, COL_TEMP]
            tdp = self.tdp[slots]
            f[:, _FI["samples"]] = a[:, A_NSAMPLE]
            f[:, _FI["temp_mean"]] = temp
            f[:, _FI["temp_max"]] = np.where(a[:, A_GCNT + COL_TEMP] > 0, a[:, A_TMAX], np.nan)
            f[:, _FI["mem_temp_mean"]] = gmean[:, COL_MEMTEMP]
            f[:, _FI["mem_minus_gpu_temp"]] = gmean[:, COL_MEMTEMP] - temp
            f[:, _FI["power_frac_tdp"]] = gmean[:, COL_POWER] / tdp
            f[:, _FI["util_mean"]] = gmean[:, COL_UTIL]

            # Temperature slope: difference of a fast and a slow EMA of the hop mean (C/h).
            tcnt = a[:, A_GCNT + COL_TEMP]
            tsum = a[:, A_GSUM + COL_TEMP]
            for col, tau in ((E_TFAST, TAU_TEMP_FAST), (E_TSLOW, TAU_TEMP_SLOW)):
                d = decay(tau)[:, 0]
                ew[:, col] = ew[:, col] * d + tsum
                ew[:, col + 1] = ew[:, col + 1] * d + tcnt
            ema_fast = ew[:, E_TFAST] / ew[:, E_TFAST + 1]
            ema_slow = ew[:, E_TSLOW] / ew[:, E_TSLOW + 1]
            # For a linear ramp, EMA lag = tau, so fast - slow = slope * (tau_slow - tau_fast).
            f[:, _FI["temp_slope_c_per_h"]] = (ema_fast - ema_slow) / ((TAU_TEMP_SLOW - TAU_TEMP_FAST) / 3600)

            # Thermal resistance: ridge fit of temp on power/TDP; the slow fit is the GPU's
            # own baseline (fitted before this hop is folded in, so a fresh rise shows).
            reg = a[:, A_REG:A_REG + 5]
            inlet_s, rth_s = _ridge_fit(ew[:, E_REG_SLOW:E_REG_SLOW + 5])
            fast, slow = slice(E_REG_FAST, E_REG_FAST + 5), slice(E_REG_SLOW, E_REG_SLOW + 5)
            ew[:, fast] = ew[:, fast] * decay(TAU_THERMAL_FAST) + reg
            ew[:, slow] = ew[:, slow] * decay(TAU_THERMAL_SLOW) + reg
            inlet_f, rth_f = _ridge_fit(ew[:, E_REG_FAST:E_REG_FAST + 5])
            p_mean = reg[:, 1] / reg[:, 0]
            t_mean = reg[:, 2] / reg[:, 0]
            resid = t_mean - (inlet_s + rth_s * p_mean)
            f[:, _FI["inlet_est_c"]] = inlet_s
            f[:, _FI["rth_fast"]] = rth_f
            f[:, _FI["rth_slow"]] = rth_s
            f[:, _FI["rth_ratio"]] = rth_f / rth_s
            inlet_s_now, rth_s_now = _ridge_fit(ew[:, slow])  # the 72 h fit with this hop
            drift, lag_fast = _drift_per_h(inlet_f + rth_f, inlet_s_now + rth_s_now, ew[:, E_REG_FAST],
                                           ew[:, E_REG_SLOW])
            f[:, _FI["temp_at_tdp_c"]] = inlet_f + rth_f + np.where(np.isnan(drift), 0.0, drift * lag_fast)
            f[:, _FI["temp_at_tdp_drift_c_per_h"]] = drift
            f[:, _FI["temp_residual"]] = resid
            have = ~np.isnan(resid)
            d6 = decay(TAU_6H)[:, 0]
            ew[:, E_RESID] = ew[:, E_RESID] * d6 + np.where(have, resid, 0.0)
            ew[:, E_RESID + 1] = ew[:, E_RESID + 1] * d6 + have
            f[:, _FI["temp_residual_6h"]] = ew[:, E_RESID] / ew[:, E_RESID + 1]

            # Clock under load against the GPU's own typical (7 d) clock under load.
            csum, ccnt = a[:, A_CLK], a[:, A_CLK + 1]
            clk_ref = ew[:, E_CLK_SLOW] / ew[:, E_CLK_SLOW + 1]
            f[:, _FI["clock_ratio"]] = (csum / ccnt) / clk_ref
            ew[:, E_CLK_FAST] = ew[:, E_CLK_FAST] * d6 + csum
            ew[:, E_CLK_FAST + 1] = ew[:, E_CLK_FAST + 1] * d6 + ccnt
            f[:, _FI["clock_ratio_6h"]] = (ew[:, E_CLK_FAST] / ew[:, E_CLK_FAST + 1]) / clk_ref
            d7 = decay(TAU_7D)[:, 0]
            ew[:, E_CLK_SLOW] = ew[:, E_CLK_SLOW] * d7 + csum
            ew[:, E_CLK_SLOW + 1] = ew[:, E_CLK_SLOW + 1] * d7 + ccnt

            # Throttle duty cycles.
            nreason = a[:, A_NREASON]
            duty = a[:, A_BITS:A_BITS + N_BITS] / nreason[:, None]
            for i, b in enumerate(THROTTLE_BITS):
                f[:, _FI[f"thr_{b}"]] = duty[:, i]
            thermal_bits = [list(THROTTLE_BITS).index(b) for b in ("hw_slowdown", "sw_thermal", "hw_thermal")]
            therm = a[:, A_BITS + np.array(thermal_bits)].max(axis=1)
            ew[:, E_THERMDUTY] = ew[:, E_THERMDUTY] * d6 + therm
            ew[:, E_THERMDUTY + 1] = ew[:, E_THERMDUTY + 1] * d6 + nreason
            f[:, _FI["thermal_duty_6h"]] = ew[:, E_THERMDUTY] / ew[:, E_THERMDUTY + 1]

            # Event counts (counter deltas, XID classes, resets) as EW sums ~ counts per window.
            events = np.concatenate([
                a[:, A_DELTA:A_DELTA + N_COUNTER], a[:, A_XID:A_XID + N_XID], a[:, A_RESET:A_RESET + 1],
            ], axis=1)
            col = _FI[f"{next(iter(COUNTER_FIELDS.values()))}_1h"]
            for j, (scale, tau) in enumerate(COUNT_TAUS.items()):
                lo = _ew_count(scale, 0)
                ew[:, lo:lo + N_EVENT] = ew[:, lo:lo + N_EVENT] * decay(tau) + events
                f[:, col + j * N_EVENT: col + (j + 1) * N_EVENT] = ew[:, lo:lo + N_EVENT]
            for c in ("sbe_vol", "dbe_vol", "remap_corr", "remap_uncorr", "pcie_replay"):
                f[:, _FI[f"{c}_hop"]] = a[:, A_DELTA + _CI[c]]
            for i, xname in enumerate(XID_CLASS_NAMES):
                f[:, _FI[f"xid_{xname}_hop"]] = a[:, A_XID + i]
            levels = a[:, A_LEVEL:A_LEVEL + N_LEVEL]
            seen = a[:, A_NSAMPLE] > 0
            f[:, _FI["remap_failure"]] = levels[:, 0]
            f[:, _FI["remap_pending"]] = levels[:, 1]
            f[:, _FI["retired_pending"]] = levels[:, 2]
            base = np.where(np.isnan(self.base[slots]), 0.0, self.base[slots])
            f[:, _FI["remap_corr_total"]] = base[:, _CI["remap_corr"]]
            f[:, _FI["remap_uncorr_total"]] = base[:, _CI["remap_uncorr"]]
            f[:, _FI["retired_total"]] = base[:, _CI["retired_sbe"]] + base[:, _CI["retired_dbe"]]
            f[:, _FI["sbe_agg_total"]] = base[:, _CI["sbe_agg"]]
            f[:, _FI["dbe_agg_total"]] = base[:, _CI["dbe_agg"]]
            # Trends: share of the week's events that came in the last day (1/7 when steady);
            # +1 pseudo-count keeps one stray event from reading as a trend.
            for name, cs in (("sbe_trend", ("sbe_vol", "sbe_agg")),
                             ("nvl_trend", ("nvl_crc_flit", "nvl_crc_data", "nvl_replay", "nvl_recovery")),
                             ("pcie_trend", ("pcie_replay",))):
                day = sum(f[:, _FI[f"{c}_24h"]] for c in cs)
                week = sum(f[:, _FI[f"{c}_7d"]] for c in cs)
                f[:, _FI[name]] = day / (week + 1.0)

            # Persistence: EW share of hops with any new error in the group; acceleration:
            # log of the recent rate (6 h for SBE, 1 h for links) over the GPU's own 7-day
            # rate, +0.1/h so a quiet GPU reads 0; surprise: -log10 of the Poisson chance of
            # at least the recent count at the GPU's own weekly rate. Rates divide the EW
            # sums by the EW hop count of the same time constant, i.e. by the time actually
            # observed: a GPU seen for an hour has no week of baseline to be surprised by.
            deltas = a[:, A_DELTA:A_DELTA + N_COUNTER]
            n_groups = len(ACTIVE_GROUPS)
            for j, tau in enumerate(ACTIVE_TAUS.values()):
                lo = E_ACTIVE + j * (n_groups + 1)
                dj = decay(tau)[:, 0]
                ew[:, lo + n_groups] = ew[:, lo + n_groups] * dj + 1.0
                for i, cs in enumerate(ACTIVE_GROUPS.values()):
                    active = (deltas[:, [_CI[c] for c in cs]] > 0).any(axis=1)
                    ew[:, lo + i] = ew[:, lo + i] * dj + active
            # Streak: hours of consecutive hops with new errors (a gap in the data restarts it).
            contiguous = gap <= self.hop_s
            for i, (g, cs) in enumerate(ACTIVE_GROUPS.items()):
                active = (deltas[:, [_CI[c] for c in cs]] > 0).any(axis=1)
                streak = np.where(active, np.where(contiguous, ew[:, E_STREAK + i], 0.0) + 1.0, 0.0)
                ew[:, E_STREAK + i] = streak
                f[:, _FI[f"{g}_streak_h"]] = streak * self.hop_s / 3600.0
            # The previous hop's power-brake duty, read beside this hop's node-peer counts: by
            # the time this hop closes, every peer's hop of that time has closed too, so "no
            # peer braked within the hour" is known for it whichever GPU's hop closed first.
            f[:, _FI["thr_power_brake_prev"]] = np.where(contiguous, ew[:, E_BRAKE], 0.0)
            ew[:, E_BRAKE] = np.nan_to_num(f[:, _FI["thr_power_brake"]])
            ew[:, E_BRAKE_6H] = ew[:, E_BRAKE_6H] * d6 + (ew[:, E_BRAKE] > 0)
            f[:, _FI["brake_hops_6h"]] = ew[:, E_BRAKE_6H]
            reporting = (prev >= 0) & ~fresh & ~silent
            since_prev_h = (hop - prev) * self.hop_s / 3600.0
            ew[:, E_REPORTING] = np.where(reporting, ew[:, E_REPORTING] + since_prev_h, 0.0)
            f[:, _FI["hours_reporting"]] = ew[:, E_REPORTING]
            for j, scale in enumerate(ACTIVE_TAUS):
                lo = E_ACTIVE + j * (n_groups + 1)
                for i, g in enumerate(ACTIVE_GROUPS):
                    f[:, _FI[f"{g}_active_{scale}"]] = ew[:, lo + i] / ew[:, lo + n_groups]

            def group_count(cs: tuple[str, ...], scale: str) -> np.ndarray:
                vals = [f[:, _FI[f"{c}_{scale}"]] for c in cs]
                return np.maximum.reduce(vals) if cs == ACTIVE_GROUPS["sbe"] else sum(vals)

            def observed_h(scale: str) -> np.ndarray:
                j = list(ACTIVE_TAUS).index(scale)
                return ew[:, E_ACTIVE + j * (n_groups + 1) + n_groups] * (self.hop_s / 3600.0)

            for g, cs, recent in (("sbe", ACTIVE_GROUPS["sbe"], "6h"), ("nvl", ACTIVE_GROUPS["nvl"], "1h"),
                                  ("pcie", ACTIVE_GROUPS["pcie"], "1h")):
                n_recent = group_count(cs, recent)
                window_h = observed_h(recent)
                rate_recent = n_recent / window_h
                rate_week = group_count(cs, "7d") / observed_h("7d")
                f[:, _FI[f"{g}_accel"]] = np.log((rate_recent + 0.1) / (rate_week + 0.1))
                lam = np.maximum(rate_week, SURPRISE_FLOOR_PER_H) * window_h
                tail = gammainc(np.maximum(n_recent, 1e-9), lam)  # P(N >= n) for Poisson(lam)
                surprise = np.where(n_recent > 0, -np.log10(np.maximum(tail, 1e-300)), 0.0)
                f[:, _FI[f"{g}_surprise"]] = np.minimum(surprise, SURPRISE_MAX)
            for scale in ("6h", "24h", "7d"):
                f[:, _FI[f"mem_repairs_{scale}"]] = sum(f[:, _FI[f"{c}_{scale}"]] for c in REPAIR_COUNTERS)
            f[:, _FI["mem_repair_pending"]] = np.fmax(levels[:, 1], levels[:, 2])

            # Thermal residual over a day, and over the hops without thermal throttling (a
            # throttled GPU is pinned at its target, which hides how hot per watt it runs).
            d24 = decay(TAU_24H)[:, 0]
            ew[:, E_RESID24] = ew[:, E_RESID24] * d24 + np.where(have, resid, 0.0)
            ew[:, E_RESID24 + 1] = ew[:, E_RESID24 + 1] * d24 + have
            f[:, _FI["temp_residual_24h"]] = ew[:, E_RESID24] / ew[:, E_RESID24 + 1]
            cool = have & (therm == 0)
            ew[:, E_RESID_COOL] = ew[:, E_RESID_COOL] * d24 + np.where(cool, resid, 0.0)
            ew[:, E_RESID_COOL + 1] = ew[:, E_RESID_COOL + 1] * d24 + cool
            f[:, _FI["temp_residual_cool_24h"]] = ew[:, E_RESID_COOL] / ew[:, E_RESID_COOL + 1]
            f[~seen, _FI["samples"]] = 0.0

        self.ew[slots] = ew
        self.closed_hop[slots] = hop
        self.acc[slots] = 0.0  # temperatures and levels are >= 0, so 0 is a neutral start for fmax
        return slots.astype(np.int64), (hop + 1) * self.hop_s + self.phase[slots], f

    # ---- output ----
    def to_records(
        self, slots: np.ndarray, ts: np.ndarray, feats: np.ndarray,
        job_ranks: Sequence[tuple[str | None, int | None]] | None = None,
    ) -> list[FeatureVector]:
        """FeatureVector records (missing values as None), in (ts, node, gpu) order."""
        if len(slots) == 0:
            return []
        meta = self._meta
        if job_ranks is None:  # the rows of the last ingest/flush, else each slot's latest
            same = len(self.closed_job_ranks) == len(slots)
            job_ranks = self.closed_job_ranks if same else self.job_ranks(slots.tolist())
        order = sorted(
            range(len(slots)), key=lambda i: (ts[i], meta[slots[i]]["node"], meta[slots[i]]["gpu"])
        )
        out = []
        names = FEATURE_NAMES
        # Missing values become None in one numpy pass (no Python loop over a row's values).
        cells = feats.astype(object)
        cells[np.isnan(feats)] = None
        rows = cells.tolist()
        for i in order:
            m = meta[slots[i]]
            vals = dict(zip(names, rows[i], strict=True))
            out.append(FeatureVector.trusted(  # our own, already-consistent output
                scope="gpu", ts=float(ts[i]), window_s=self.hop_s, node=m["node"], gpu=m["gpu"],
                model=m["model"], rack=m["rack"], site=m["site"], values=vals,
                job=job_ranks[i][0], rank=job_ranks[i][1],
            ))
        return out


def sample_columns(
    records: Sequence[NodeBatch | GpuSample | FastGpuSample | SampleColumns],
) -> SampleColumns:
    """The samples of GPU telemetry records (samples, node batches, `SampleColumns`) as one
    `SampleColumns`, in order; the types present are found in one C-level pass, so a call of
    columns only (a replay) or of samples only (a Kafka fetch) has no loop per record."""
    types = set(map(type, records))
    if SampleColumns not in types and not any(issubclass(kind, NodeBatch) for kind in types):
        return SAMPLE_DECODER.columns(records)
    if types == {SampleColumns}:
        return SampleColumns.concat(records)  # type: ignore[arg-type]
    parts: list[SampleColumns] = []
    run: list[GpuSample | FastGpuSample] = []  # samples since the last columns
    for rec in records:
        if isinstance(rec, SampleColumns):
            if run:
                parts.append(SAMPLE_DECODER.columns(run))
                run = []
            parts.append(rec)
        elif isinstance(rec, NodeBatch):
            run.extend(rec.samples)
        else:
            run.append(rec)
    if run or not parts:
        parts.append(SAMPLE_DECODER.columns(run))
    return SampleColumns.concat(parts)


class _JobRanks(Sequence[tuple[str | None, int | None]]):
    """(job, rank) pairs held as two lists (samples' columns, closed hops), each pair made only
    when asked for: readers want few rows (a hop's last sample, the predictions emitted)."""

    def __init__(self, jobs: list[str | None], ranks: list[int | None]) -> None:
        self.jobs, self.ranks = jobs, ranks

    def __len__(self) -> int:
        return len(self.jobs)

    def __getitem__(self, i: int) -> tuple[str | None, int | None]:  # type: ignore[override]
        return self.jobs[i], self.ranks[i]


def _to_json(value: Any) -> Any:
    """numpy scalar/array -> JSON-safe lists (non-finite as strings, so strict JSON holds)."""
    def one(v: float) -> Any:
        return v if math.isfinite(v) else str(v)
    if np.ndim(value):
        return [one(v) for v in np.asarray(value).tolist()]
    return one(float(value))


def _from_json(value: Any) -> np.ndarray:
    if isinstance(value, list):
        return np.array([float(v) for v in value], dtype=np.float64)
    return np.float64(float(value))


# The per-slot arrays (first axis: slot) that hold a GPU's window state besides its meta and job.
STATE_ARRAYS = ("acc", "ew", "base", "last_xid", "open_hop", "closed_hop", "last_ts", "tdp", "ts_ring",
                "peer_end", "peer_brake_hops", "peer_brake_end")
# State arrays added after checkpoints were first written: a checkpoint without one restores it
# as a fresh GPU's (`_FRESH_STATE`).
_ADDED_STATE_ARRAYS = ("peer_brake_hops", "peer_brake_end")
# The state arrays a GPU starts with (shape per GPU, fill value); `tdp` comes from its model.
_FRESH_STATE: dict[str, tuple[tuple[int, ...], float]] = {
    "acc": ((N_ACC,), 0.0), "ew": ((N_EW,), 0.0), "base": ((N_COUNTER + 1,), np.nan),
    "last_xid": ((), np.nan), "open_hop": ((), -1.0), "closed_hop": ((), -1.0),
    "last_ts": ((), -np.inf), "ts_ring": ((DEDUP_RING,), np.nan),
    # end of the GPU's latest hop with each PEER_COLUMNS mark (what its node's peers see of it)
    "peer_end": ((len(PEER_COLUMNS),), -np.inf),
    # its `brake_hops_6h` at the end of its last closed hop, and that end (what its peers read)
    "peer_brake_hops": ((), 0.0), "peer_brake_end": ((), -np.inf),
}


def _arrived_before(slots: np.ndarray, order_key: np.ndarray, rows: np.ndarray, pair_c: np.ndarray,
                    pair_p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each (close, peer) pair, whether one of the closes `rows` is the peer's and arrived
    before the close did (`order_key`: arrival rank), and the latest such (a GPU's closes come in
    hop order, so the last to arrive has the latest end): (hit mask, its row for each hit)."""
    span = int(order_key.max()) + 1
    key = slots[rows] * span + order_key[rows]
    sort = np.argsort(key, kind="stable")
    key, rows = key[sort], rows[sort]
    q = np.searchsorted(key, pair_p * span + order_key[pair_c], side="left") - 1
    hit = q >= 0
    hit[hit] = slots[rows[q[hit]]] == pair_p[hit]
    return hit, rows[q[hit]]


def _restored_state(name: str, saved: Mapping[str, Any],
                    convert: Callable[[Any], np.ndarray] = np.asarray) -> np.ndarray | float:
    """State array `name` from a save (`convert`ed): in this code's width (`_fit_state`), or a
    fresh GPU's fill where the save predates the array (`_ADDED_STATE_ARRAYS`)."""
    if name not in saved and name in _ADDED_STATE_ARRAYS:
        return _FRESH_STATE[name][1]
    return _fit_state(name, convert(saved[name]))


def _fit_state(name: str, value: np.ndarray) -> np.ndarray:
    """A saved state array in this code's width: `peer_end` saved before the warm and single-bit
    columns (2026-12-05) or the power-brake and heat ones (2026-12-06) gains them as never marked, and
    `ew` saved before the last hop's power-brake duty or the hours reported (2026-12-06) as not
    braked and just back (0 h), and `base` saved before the board column (2026-12-06) as no
    board named yet, so a worker's checkpoints outlive the upgrade."""
    shape, fill = _FRESH_STATE.get(name, ((), 0.0))  # a fresh GPU's width and fill
    missing = shape[-1] - value.shape[-1] if shape else 0
    if missing > 0:
        return np.concatenate([value, np.full((*value.shape[:-1], missing), fill)], axis=-1)
    return value


def _ew_lag_h(age_s: np.ndarray, tau_s: float) -> np.ndarray:
    """Mean age (h) of exponentially weighted samples (time constant tau) taken evenly over the
    last `age_s`: tau once the window is full, half the age while it fills."""
    x = np.maximum(age_s, 1e-9) / tau_s
    return tau_s * (1.0 - x * np.exp(-x) / -np.expm1(-x)) / 3600.0


def _drift_per_h(fast: np.ndarray, slow: np.ndarray, n_fast: np.ndarray, n_slow: np.ndarray,
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Rise per hour of a quantity from its fast (TAU_THERMAL_FAST) and slow (TAU_THERMAL_SLOW)
    EW estimates, and the fast one's lag (h). Each lags a linear drift by its weights' mean age,
    which depends on how long the GPU has been seen: the weights' sums say that (their ratio
    is the slow window's filled share, whatever the sampling interval). NaN until the two lags
    differ by DRIFT_MIN_LAG_GAP_H (~36 h seen): over a shorter gap the fits' noise (a degree or
    two as the load changes) reads as a steep drift."""
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = (n_slow / TAU_THERMAL_SLOW) / (n_fast / TAU_THERMAL_FAST)  # slow filled / fast filled
        filled = np.clip(ratio, 0.0, 1.0 - 1e-12)
        for _ in range(2):  # the fast window's own filled share, from the age found so far
            age = -TAU_THERMAL_SLOW * np.log1p(-filled)
            filled = np.clip(ratio * -np.expm1(-age / TAU_THERMAL_FAST), 0.0, 1.0 - 1e-12)
        age = -TAU_THERMAL_SLOW * np.log1p(-filled)
        lag_fast, lag_slow = _ew_lag_h(age, TAU_THERMAL_FAST), _ew_lag_h(age, TAU_THERMAL_SLOW)
        drift = (fast - slow) / (lag_slow - lag_fast)
    return np.where(lag_slow - lag_fast >= DRIFT_MIN_LAG_GAP_H, drift, np.nan), lag_fast


def _ridge_fit(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Intercept (inlet estimate, C) and slope (C per power/TDP) of temp on power/TDP from
    sums (n, p, t, pp, pt), with the slope pulled toward PRIOR_RTH_PER_TDP."""
    n, sp, st, spp, spt = sums.T
    with np.errstate(invalid="ignore", divide="ignore"):
        pm = sp / n
        tm = st / n
        var = spp - n * pm * pm
        cov = spt - n * pm * tm
        prior = PRIOR_WEIGHT * PRIOR_SPREAD_VAR
        slope = (cov + prior * PRIOR_RTH_PER_TDP) / (var + prior)
        intercept = tm - slope * pm
    empty = n <= 0
    return np.where(empty, np.nan, intercept), np.where(empty, np.nan, slope)


def feature_matrix(vectors: Sequence[FeatureVector], names: Sequence[str] = FEATURE_NAMES) -> np.ndarray:
    """Stack FeatureVector values into a float matrix (None -> NaN) in `names` order."""
    out = np.full((len(vectors), len(names)), np.nan)
    for i, v in enumerate(vectors):
        vals = v.values
        for j, name in enumerate(names):
            val = vals.get(name)
            if val is not None:
                out[i, j] = val
    return out
