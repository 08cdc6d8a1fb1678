"""Independent GPU-fleet telemetry generator with labelled failures and traps.

What this is
------------
A stand-alone generator of dcgm-exporter-style GPU samples for a mixed fleet, with a
ground-truth label file, for checking a failure predictor against data it has never
seen the like of. It was written from the "GPU sample" record contract in the design
document, the DCGM field / XID / failure-statistics notes in the shared reference, the
dcgm-exporter counter lists and the public GPU catalog, plus public knowledge of how
DCGM and NVML report things. It was deliberately written *without* reading the
project's own simulator or predictor, and imports nothing from the project: numpy and
the standard library only. Every shape, rate and noise level below is its own choice
(module-level constants, each with a comment).

What it models
--------------
* Fleet: 8-GPU HGX nodes (H100 80GB HBM3, H200, A100-SXM4-80GB, V100-SXM2), 8-GPU
  PCIe L40S nodes and older 4-GPU A100 80GB PCIe nodes; racks of 4 nodes, aisles of
  6 racks, one site. ``model`` is the NVML name (``--catalog-names`` writes the
  catalog's row names instead).
* Workload: per-node job phases -- training (util ~97 %, near-TDP power demand, some
  jobs with a power cap), inference (diurnal, bursty per GPU), idle gaps, checkpoint
  dips. Power follows util; clocks drop under SwPowerCap when demand exceeds the
  limit. GPU temperature = rack inlet (aisle base + rack offset + daily cycle + slow
  drift + slot height) + per-GPU thermal resistance x power; HBM temperature above
  that. SwThermal / HwThermal slowdown above the model's limits (clock and power fall,
  temperature is held), with the DCGM violation counters (ns) accumulating.
* Counters (SBE/DBE volatile ECC, PCIe replays, NVLink CRC/replay, energy, violation
  times) are cumulative and restart from 0 on a reboot or GPU reset; row-remap counts
  (Ampere+) and retired pages (V100) persist across reboots and reset only when the
  GPU is replaced. DCGM_FI_DEV_XID_ERRORS is the last XID seen and is sticky until a
  reboot/GPU reset or an exporter restart (as dcgm-exporter behaves).
* Six failure classes (hbm_ecc, nvlink, thermal_interface, off_bus, gsp, power), each
  abrupt with a class-specific probability, otherwise preceded by a precursor of
  log-normal length (1 h .. 3 d) with its own signal; after the failure the GPU
  reports for 0-4 more samples, disappears for a repair window, then returns with
  reset counters (a new UUID when it was replaced).
* Traps (labelled): hot-but-healthy GPUs and nodes, benign SBE bursts, lemon GPUs
  with a steady SBE rate, application XIDs (13/31/43 + 45 on job peers), sympathetic
  XID 74 on node peers of an NVLink failure, XID 45 on peers of any failed GPU, node
  reboots, scrape gaps (node and fleet-wide; some are exporter restarts that clear
  the XID gauge), PCIe replay noise, NVLink CRC noise, power-capped jobs, node-wide
  power-brake events (PSU/facility) that are not failures. Unlabelled noise: DCGM
  blank sentinels in a small fraction of samples and missing keys.

* Counters do not start at zero: each node has been up 1-60 days at trace start, so
  energy, violation times and background error counts start from what that uptime
  would hold; a precursor that began before the trace has its earlier counts already
  in the counter at the first sample.

Output: ``DIR/trace.jsonl.gz`` (samples in event-time order across the fleet) and
``DIR/labels.jsonl``: failures first (``kind: failure``; ``ts`` is the sample that
first shows the failure, ``precursor_start_ts`` may precede the trace; extra keys
``uuid``, ``model``, ``fatal_xid``, ``precursor_h``, ``repair_end_ts``, ``replaced``),
then traps (``kind: trap``; windowed traps carry ``end_ts``, the last affected
sample). The number of failures is the expectation (rate x GPU-days) rounded at
random. Deterministic for a given seed: one numpy Generator, no clock, a gzip header
with mtime 0.

Usage::

    python bench/independent_fleet.py --out /tmp/fleet --seed 0 [--gpus 256] [--days 14]
        [--interval 300] [--failures-per-1000-gpu-days 3] [--catalog-names]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

# ----------------------------------------------------------------------------------
# Time and DCGM conventions
# ----------------------------------------------------------------------------------
START_TS = datetime(2026, 3, 2, tzinfo=UTC).timestamp()  # trace start, 2026-03-02T00:00:00Z
HOUR = 3600.0
DAY = 86400.0

# DCGM "no value" sentinels: int64 blank / not-found / not-supported, int64 max (seen
# from some exporter builds), and DCGM's FP64 blank for float fields such as power.
DCGM_INT64_BLANK = 9223372036854775792
DCGM_INT64_NOT_FOUND = 9223372036854775793
DCGM_INT64_NOT_SUPPORTED = 9223372036854775794
INT64_MAX = 9223372036854775807
DCGM_FP64_BLANK = 140737488355328.0
INT_SENTINELS = (DCGM_INT64_NOT_SUPPORTED, DCGM_INT64_BLANK, DCGM_INT64_NOT_FOUND, INT64_MAX)
INT_SENTINEL_P = (0.55, 0.2, 0.1, 0.15)  # how often each int sentinel is the one written

# NVML clocks-event-reason bits (DCGM_FI_DEV_CLOCKS_EVENT_REASONS).
CE_GPU_IDLE = 0x1  # NVML sets it whenever nothing runs; real traces have it
CE_SW_POWER_CAP = 0x4
CE_HW_SLOWDOWN = 0x8  # umbrella bit, asserted with HW thermal and power-brake slowdown
CE_SW_THERMAL = 0x20
CE_HW_THERMAL = 0x40
CE_HW_POWER_BRAKE = 0x80

F_GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
F_MEM_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
F_POWER = "DCGM_FI_DEV_POWER_USAGE"
F_ENERGY = "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"
F_SM_CLOCK = "DCGM_FI_DEV_SM_CLOCK"
F_UTIL = "DCGM_FI_DEV_GPU_UTIL"
F_MEM_UTIL = "DCGM_FI_DEV_MEM_COPY_UTIL"
F_CLK_EV = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
F_PWR_VIOL = "DCGM_FI_DEV_POWER_VIOLATION"
F_THR_VIOL = "DCGM_FI_DEV_THERMAL_VIOLATION"
F_SBE = "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"
F_DBE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
F_CORR_REMAP = "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"
F_UNCORR_REMAP = "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"
F_REMAP_FAIL = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
F_RET_SBE = "DCGM_FI_DEV_RETIRED_SBE"
F_RET_DBE = "DCGM_FI_DEV_RETIRED_DBE"
F_XID = "DCGM_FI_DEV_XID_ERRORS"
F_PCIE = "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"
F_NVL_CRC = "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"
F_NVL_REPLAY = "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"


# ----------------------------------------------------------------------------------
# GPU models
# ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuModel:
    key: str
    nvml_name: str  # what NVML / dcgm-exporter modelName reports
    catalog_name: str  # the row name in the shared GPU catalog
    tdp_w: float  # catalog TDP
    idle_w: float  # typical idle draw
    max_clock: int  # max boost SM clock (MHz)
    idle_clock: int  # idle SM clock (MHz)
    gpus_per_node: int
    share: float  # fraction of fleet GPUs of this model
    rise_c: float  # steady core temperature rise over inlet at TDP, nominal cooling
    mem_rise_c: float  # extra memory temperature over core at TDP (0: not reported)
    max_op_c: float  # SwThermal (boost backs off) threshold
    hw_slow_c: float  # HwThermal slowdown threshold
    shutdown_c: float  # thermal shutdown
    nvlink: bool  # NVLink error counters reported (SXM, or bridged PCIe pairs)
    mem_temp: bool  # DCGM_FI_DEV_MEMORY_TEMP supported
    row_remap: bool  # Ampere+ row remapping (else V100 page retirement)
    hbm_fail_weight: float  # relative rate of uncorrectable memory failures
    fatal_mem_xids: tuple[int, ...]  # XIDs a fatal memory error shows on this model


MODELS: tuple[GpuModel, ...] = (
    GpuModel("h100", "NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 700, 72, 1980, 345, 8, 0.36,
             44, 6, 87, 90, 92, True, True, True, 3.0, (94, 95, 48)),
    GpuModel("h200", "NVIDIA H200", "NVIDIA H200 SXM", 700, 78, 1980, 345, 8, 0.18,
             45, 7, 87, 90, 92, True, True, True, 3.0, (94, 95, 48)),
    GpuModel("a100", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM4", 400, 55, 1410, 210, 8, 0.20,
             38, 5, 85, 89, 92, True, True, True, 1.0, (48,)),
    GpuModel("l40s", "NVIDIA L40S", "NVIDIA L40S", 350, 34, 2520, 210, 8, 0.10,
             48, 0, 87, 90, 93, False, False, True, 0.4, (48,)),
    GpuModel("a100pcie", "NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe", 300, 45, 1410, 210, 4, 0.09,
             46, 5, 85, 89, 92, True, True, True, 1.0, (48,)),
    GpuModel("v100", "Tesla V100-SXM2-32GB", "NVIDIA V100 SXM2 32GB", 300, 40, 1530, 135, 8, 0.07,
             40, 4, 83, 87, 90, True, True, False, 1.2, (48,)),
)
CLOCK_STEP_MHZ = 15  # SM clocks are reported in ~15 MHz steps

# ----------------------------------------------------------------------------------
# Fleet layout and environment
# ----------------------------------------------------------------------------------
NODES_PER_RACK = 4  # power density limit: 4 HGX (or 4-GPU) servers per rack
RACKS_PER_AISLE = 6
SITE = "dc1"
AISLE_INLET_MEAN_C = 24.0  # cold-aisle supply target
AISLE_INLET_SD_C = 1.2  # aisle-to-aisle spread of the supply temperature
RACK_INLET_SD_C = 0.8  # rack-to-rack spread within an aisle
SLOT_INLET_STEP_C = 0.5  # each slot higher in the rack is this much warmer (recirculation)
DAILY_AMP_C = (0.8, 2.5)  # uniform range of the daily inlet swing (half amplitude)
DAILY_PEAK_HOUR = 15.0  # inlet peaks mid-afternoon (UTC = site local here)
DRIFT_STEP_C_PER_SQRT_H = 0.12  # site-wide slow weather drift (random walk, clipped +-3 C)
INLET_NOISE_C = 0.3  # per-sample inlet sensor/airflow noise
GPU_RTH_SIGMA = 0.06  # log-normal spread of per-GPU thermal resistance (TIM, fan wall)
REAR_SLOT_EXTRA_C = 2.5  # GPUs in the rear row of the baseboard run warmer
TEMP_NOISE_C = 0.5  # per-sample core temperature noise
THERMAL_TAU_S = 90.0  # first-order thermal lag (matters only for short intervals)
UPTIME_AT_START_D = (1.0, 60.0)  # uniform: node uptime at trace start; counters start from that
START_ENERGY_TDP_FRAC = (0.3, 0.6)  # mean power over the uptime before the trace, x TDP
START_PWR_VIOL_FRAC = (0.0, 0.15)  # share of the uptime spent power-throttled
START_THR_VIOL_FRAC = (0.0, 0.01)  # ... thermally throttled (hot-but-healthy GPUs: x10)

# ----------------------------------------------------------------------------------
# Workload
# ----------------------------------------------------------------------------------
TRAIN_DUR_H = (12.0, 0.9, 1.0, 120.0)  # log-normal median, sigma, clip low, clip high
INFER_DUR_H = (8.0, 0.8, 1.0, 72.0)
IDLE_DUR_H = (1.5, 1.0, 0.1, 48.0)
IDLE_BETWEEN_JOBS_P = 0.6  # a job is followed by an idle gap with this probability
TRAIN_P = {"default": 0.65, "l40s": 0.15}  # chance the next job is training (else inference)
TRAIN_LEVEL = (0.82, 1.08)  # uniform: training power demand at full util, x TDP
TRAIN_UTIL_SD = 0.015  # per-sample util noise in training
TRAIN_DIP_P = 0.06  # chance a training sample lands in a checkpoint/eval/data stall dip
INFER_BASE = (0.15, 0.6)  # uniform: mean inference util of a serving phase
INFER_DIURNAL = (0.2, 0.5)  # uniform: diurnal modulation of inference load
INFER_PEAK_HOUR = 14.0
INFER_GPU_SIGMA = 0.25  # per-GPU per-sample log-normal load spread in inference
INFER_LEVEL = (0.55, 0.85)  # inference power demand at full util, x TDP (memory-bound)
POWER_CAP_JOB_P = 0.12  # training jobs launched with a power limit
POWER_CAP_FRAC = (0.6, 0.8)  # uniform: the power limit, x TDP
POWER_NOISE_FRAC = 0.012  # per-sample power noise, x TDP
GPU_EFF_SIGMA = 0.03  # per-GPU power efficiency spread (silicon lottery)

# ----------------------------------------------------------------------------------
# Failures
# ----------------------------------------------------------------------------------
DEFAULT_FAILURE_RATE = 3.0  # failures per 1,000 GPU-days
# class -> (share of failures, probability abrupt, precursor log-normal median h,
# sigma, clip low h, clip high h, repair window median h, replacement probability)
FAILURE_CLASSES: dict[str, tuple[float, float, float, float, float, float, float, float]] = {
    "hbm_ecc": (0.27, 0.25, 18.0, 0.9, 1.0, 72.0, 20.0, 0.8),
    "nvlink": (0.17, 0.30, 6.0, 0.9, 1.0, 48.0, 14.0, 0.3),
    "thermal_interface": (0.10, 0.0, 36.0, 0.5, 8.0, 72.0, 24.0, 0.7),
    "off_bus": (0.18, 0.70, 3.0, 0.8, 1.0, 24.0, 12.0, 0.4),
    "gsp": (0.15, 0.85, 2.0, 0.7, 1.0, 12.0, 6.0, 0.1),
    "power": (0.13, 0.50, 8.0, 0.8, 1.0, 48.0, 18.0, 0.6),
}
REPAIR_SIGMA = 0.7  # log-normal sigma of the repair window
REPAIR_CLIP_H = (2.0, 48.0)
FAIL_EARLIEST_H = 1.0  # no fatal event in the first hour of the trace
HBM_SPARSE_P = 0.35  # HBM precursors that are a handful of SBEs rather than a ramp
HBM_R0_PER_H = (0.2, 2.0)  # log-uniform: SBE rate at precursor start
HBM_R1_PER_H = (20.0, 500.0)  # log-uniform: SBE rate just before the DBE
SBE_GAMMA_SHAPE = 0.6  # overdispersion of SBE counts (gamma-Poisson)
SBE_PER_REMAP = 40.0  # SBEs per new correctable row remap (on average)
HBM_REMAP_FAIL_P = 0.25  # fatal HBM events that exhaust the spare rows (XID 64)
NVL_R0_PER_H = (2.0, 20.0)  # log-uniform: NVLink CRC flit error rate at precursor start
NVL_R1_PER_H = (500.0, 20000.0)  # ... and just before failure
NVL_REPLAY_FRAC = (0.05, 0.3)  # replays per CRC error
NVL_PRE_XID74_MEAN = 1.2  # Poisson mean of XID 74s on the degrading GPU during the precursor
THERMAL_DELTA = (0.45, 1.0)  # thermal resistance grows by this fraction over the precursor
THERMAL_SHAPE = 1.6  # convex creep: most of the rise is late
PCIE_R0_PER_H = (5.0, 50.0)  # off-bus precursor: PCIe replay rate at start
PCIE_R1_PER_H = (500.0, 5000.0)  # ... and before the GPU falls off
GSP_BLANK_P = (0.01, 0.15)  # GSP precursor: chance a sample has blank fields, start -> end
POWER_BRAKE_P = (0.01, 0.3)  # power precursor: chance per sample of a brake, start -> end
POWER_SPIKE_P = (0.01, 0.15)  # ... of a power reading spike above TDP
POWER_SPIKE_X = (1.05, 1.35)  # spike size, x TDP
ZOMBIE_SAMPLES = {"hbm_ecc": (0, 2), "nvlink": (0, 2), "thermal_interface": (0, 0), "off_bus": (1, 3),
                  "gsp": (1, 4), "power": (0, 1)}  # samples still reported after the fatal one
PEER_XID45_P = 0.5  # chance each node peer logs XID 45 when its job dies with the failed GPU

# ----------------------------------------------------------------------------------
# Traps and noise (healthy GPUs that look bad)
# ----------------------------------------------------------------------------------
HOT_NODE_FRACTION = 0.04  # nodes with recirculation/blocked airflow (min 1): inlet +6..10 C
HOT_NODE_EXTRA_C = (6.0, 10.0)
HOT_GPU_FRACTION = 0.02  # single GPUs with poor airflow: thermal resistance x1.3..1.5
HOT_GPU_RTH = (1.3, 1.5)
LEMON_FRACTION = 0.015  # GPUs with a steady SBE rate that never fail (min 1)
LEMON_RATE_PER_H = (0.3, 3.0)  # log-uniform
LEMON_STATIC_REMAPS = (1, 4)  # correctable remaps already on the lemon at trace start
SBE_BURST_PER_GPU_DAY = 0.004  # benign SBE bursts (stop by themselves)
SBE_BURST_DUR_H = (3.0, 0.6, 1.0, 10.0)  # log-normal median, sigma, clip
SBE_BURST_RATE_PER_H = (5.0, 80.0)  # log-uniform peak rate
SBE_BURST_REMAP_P = 0.3  # a burst leaves one correctable remap (+ benign XID 63)
BACKGROUND_SBE_FRACTION = 0.08  # healthy GPUs with a very low SBE rate
BACKGROUND_SBE_PER_H = (0.005, 0.05)
PCIE_NOISE_FRACTION = 0.04  # healthy GPUs with steady PCIe replays (riser, retimer)
PCIE_NOISE_PER_H = (1.0, 60.0)
NVLINK_NOISE_FRACTION = 0.03  # healthy NVLink GPUs with a steady CRC rate
NVLINK_NOISE_PER_H = (1.0, 10.0)
NVLINK_BACKGROUND_PER_H = (0.001, 0.05)  # every NVLink GPU: near-zero CRC rate
APP_XID_PER_NODE_DAY = 0.08  # user-code faults on busy nodes
APP_XIDS = (13, 31, 43)  # graphics exception, MMU fault, stopped processing
APP_XID_PEER_45_P = 0.6  # peers of the job log XID 45 when it is torn down
APP_IDLE_AFTER_H = (0.1, 1.0)  # the node idles this long after the job dies
REBOOT_PER_NODE_DAY = 0.02
REBOOT_GAP_MIN = (5.0, 40.0)  # uniform: how long a rebooting node is silent
REBOOT_DRAIN_H = (0.0, 1.0)  # uniform: node idles before the reboot
SCRAPE_GAP_PER_NODE_DAY = 0.06
SCRAPE_GAP_MIN = (20.0, 1.2, 5.0, 480.0)  # log-normal median, sigma, clip (minutes)
EXPORTER_RESTART_P = 0.5  # a scrape gap that was an exporter restart clears the XID gauge
FLEET_GAP_PER_DAY = 1.0 / 7.0  # collector outages hitting every node
FLEET_GAP_MIN = (10.0, 40.0)
NODE_BRAKE_PER_NODE_DAY = 0.004  # PSU fail-over / facility power event: node-wide brake
NODE_BRAKE_MIN = (10.0, 60.0)
SENTINEL_SAMPLE_P = 0.002  # samples with 1-3 fields blanked by a DCGM sentinel
FP64_SENTINEL_P = 0.2  # share of blanked float fields that carry the FP64 blank (else dropped)
MISSING_KEY_SAMPLE_P = 0.001  # samples lacking 1-2 keys
DROPPED_SAMPLE_P = 0.0005  # single samples lost in transport

WRITE_BLOCK_SAMPLES = 100_000  # samples sorted and written per block (bounds memory)


# ----------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------
def _lognorm_h(rng: np.random.Generator, spec: tuple[float, float, float, float]) -> float:
    """Draw hours from (median, sigma, clip_low, clip_high)."""
    med, sig, lo, hi = spec
    return float(np.clip(med * math.exp(sig * rng.standard_normal()), lo, hi))


def _logu(rng: np.random.Generator, lo: float, hi: float) -> float:
    return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))


def _uuid(rng: np.random.Generator) -> str:
    h = rng.bytes(16).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _seg_cumsum(inc: np.ndarray, resets: list[int]) -> np.ndarray:
    """Cumulative sum of ``inc`` restarting at each tick in ``resets``."""
    c = np.cumsum(inc)
    r = np.array(sorted({x for x in resets if 0 < x < len(inc)}), dtype=np.int64)
    if r.size == 0:
        return c
    offs = np.zeros(r.size + 1)
    offs[1:] = c[r - 1]
    seg = np.searchsorted(r, np.arange(len(inc)), side="right")
    return c - offs[seg]


def _sticky(n: int, events: list[tuple[int, int]], clears: list[int]) -> np.ndarray:
    """Last-value gauge: value of the latest event, 0 after a clear (events win ties)."""
    items = [(k, 0, i, 0) for i, k in enumerate(clears) if 0 <= k < n]
    items += [(k, 1, i, v) for i, (k, v) in enumerate(events) if 0 <= k < n]  # insertion order breaks ties
    out = np.zeros(n)
    if not items:
        return out
    items.sort()
    ks = np.array([i[0] for i in items])
    vs = np.array([i[3] for i in items], dtype=float)
    idx = np.searchsorted(ks, np.arange(n), side="right") - 1
    ok = idx >= 0
    out[ok] = vs[idx[ok]]
    return out


def _ramp(rng: np.random.Generator, frac: np.ndarray, r0: float, r1: float, dt_h: float,
          shape: float | None = SBE_GAMMA_SHAPE) -> np.ndarray:
    """Counts per tick with a rate rising geometrically from r0 to r1 (per hour) over frac 0..1."""
    rate = r0 * (r1 / r0) ** frac * dt_h
    if shape:
        rate = rng.gamma(shape, 1.0 / shape, size=rate.size) * rate
    return rng.poisson(rate).astype(float)


# ----------------------------------------------------------------------------------
# Fleet structures
# ----------------------------------------------------------------------------------
@dataclass
class Node:
    idx: int
    name: str
    model: GpuModel
    n_gpus: int
    rack: str
    rack_idx: int
    aisle_idx: int
    slot: int
    offset_s: float  # scrape phase within the interval
    uptime_s: float = 0.0  # time since the last boot at trace start (counters hold that much)
    util: np.ndarray | None = None
    level: np.ndarray | None = None
    cap: np.ndarray | None = None
    kind: np.ndarray | None = None  # 0 idle, 1 train, 2 inference
    inlet: np.ndarray | None = None
    ts: np.ndarray | None = None
    absent: np.ndarray | None = None
    resets: list[int] = field(default_factory=list)  # reboot returns (counters restart)
    xid_clears: list[int] = field(default_factory=list)  # exporter restarts
    brake: np.ndarray | None = None
    busy_windows: list[tuple[int, int]] = field(default_factory=list)  # no reboot/brake here
    gpus: list[int] = field(default_factory=list)


@dataclass
class Gpu:
    idx: int
    node: Node
    local: int
    model: GpuModel
    uuids: list[str]
    rth_mult: float
    eff: float
    pos_c: float
    trap: set[str] = field(default_factory=set)
    failing: bool = False
    # per-tick arrays, filled lazily
    arr: dict[str, np.ndarray] = field(default_factory=dict)
    xids: list[tuple[int, int]] = field(default_factory=list)
    resets: list[int] = field(default_factory=list)  # GPU-level resets (repair return)
    replace_at: list[int] = field(default_factory=list)
    absent: np.ndarray | None = None
    force_util: dict[int, float] = field(default_factory=dict)
    force_temp: dict[int, float] = field(default_factory=dict)
    force_power: dict[int, float] = field(default_factory=dict)
    force_bits: dict[int, int] = field(default_factory=dict)
    force_clock_x: dict[int, float] = field(default_factory=dict)
    blank_all: set[int] = field(default_factory=set)  # samples with every field blanked (but XID)
    blank_some: dict[int, int] = field(default_factory=dict)  # tick -> number of fields blanked
    remap_fail_at: int | None = None
    static_remaps: int = 0
    lemon_rate: float = 0.0
    background_sbe: bool = False
    fatal_k: int | None = None

    def a(self, name: str, n: int) -> np.ndarray:
        if name not in self.arr:
            self.arr[name] = np.zeros(n)
        return self.arr[name]


def _build_fleet(rng: np.random.Generator, n_gpus: int, interval: float) -> list[Node]:
    target = {m.key: m.share * n_gpus for m in MODELS}
    count = dict.fromkeys(target, 0)
    plan: list[tuple[GpuModel, int]] = []
    remaining = n_gpus
    while remaining > 0:
        fits = [m for m in MODELS if m.gpus_per_node <= remaining]
        if not fits:  # a partially populated 4-GPU node closes the count
            m = next(x for x in MODELS if x.gpus_per_node == min(y.gpus_per_node for y in MODELS))
            plan.append((m, remaining))
            break
        m = max(fits, key=lambda x: (target[x.key] - count[x.key]) / x.gpus_per_node)
        plan.append((m, m.gpus_per_node))
        count[m.key] += m.gpus_per_node
        remaining -= m.gpus_per_node
    order = {m.key: i for i, m in enumerate(MODELS)}
    plan.sort(key=lambda p: order[p[0].key])  # racks are homogeneous
    nodes: list[Node] = []
    for i, (m, n) in enumerate(plan):
        r = i // NODES_PER_RACK
        aisle = chr(ord("a") + (r // RACKS_PER_AISLE) % 26)
        nodes.append(Node(idx=i, name=f"node-{i:03d}", model=m, n_gpus=n,
                          rack=f"rack-{aisle}{r % RACKS_PER_AISLE + 1:02d}",
                          rack_idx=r, aisle_idx=r // RACKS_PER_AISLE, slot=i % NODES_PER_RACK,
                          offset_s=float(rng.uniform(0.02, 0.86) * interval)))
    return nodes


# ----------------------------------------------------------------------------------
# Environment and workload
# ----------------------------------------------------------------------------------
def _inlets(rng: np.random.Generator, nodes: list[Node], T: int, interval: float, hod: np.ndarray,
            hot_nodes: dict[int, float]) -> None:
    n_aisles = max(n.aisle_idx for n in nodes) + 1
    n_racks = max(n.rack_idx for n in nodes) + 1
    aisle_base = np.clip(rng.normal(AISLE_INLET_MEAN_C, AISLE_INLET_SD_C, n_aisles), 20.0, 28.0)
    aisle_amp = rng.uniform(*DAILY_AMP_C, n_aisles)
    aisle_peak = DAILY_PEAK_HOUR + rng.normal(0, 1.0, n_aisles)
    rack_off = rng.normal(0, RACK_INLET_SD_C, n_racks)
    steps = rng.normal(0, DRIFT_STEP_C_PER_SQRT_H * math.sqrt(interval / HOUR), T)
    drift = np.clip(np.cumsum(steps), -3.0, 3.0)
    for n in nodes:
        a = n.aisle_idx
        cyc = aisle_amp[a] * np.cos(2 * np.pi * (hod - aisle_peak[a]) / 24.0)
        n.inlet = (aisle_base[a] + rack_off[n.rack_idx] + SLOT_INLET_STEP_C * n.slot + cyc + drift
                   + hot_nodes.get(n.idx, 0.0) + rng.normal(0, INLET_NOISE_C, T))


def _workload(rng: np.random.Generator, node: Node, T: int, interval: float, hod: np.ndarray,
              cap_events: list[dict]) -> None:
    util = np.zeros(T)
    level = np.full(T, 0.3)
    cap = np.ones(T)
    kind = np.zeros(T, dtype=np.int8)
    p_train = TRAIN_P.get(node.model.key, TRAIN_P["default"])
    k = 0
    first = True
    last_job = True
    while k < T:
        if not last_job or rng.random() >= IDLE_BETWEEN_JOBS_P or (first and rng.random() < 0.8):
            job = "train" if rng.random() < p_train else "infer"
        else:
            job = "idle"
        spec = {"train": TRAIN_DUR_H, "infer": INFER_DUR_H, "idle": IDLE_DUR_H}[job]
        dur = max(1, round(_lognorm_h(rng, spec) * HOUR / interval))
        if first:  # the trace starts in the middle of a phase
            dur = max(1, int(dur * rng.uniform(0.05, 1.0)))
            first = False
        e = min(T, k + dur)
        n = e - k
        if job == "train":
            kind[k:e] = 1
            level[k:e] = rng.uniform(*TRAIN_LEVEL)
            u = np.clip(rng.normal(0.97, TRAIN_UTIL_SD, n), 0.0, 1.0)
            dips = rng.random(n) < TRAIN_DIP_P
            u[dips] = rng.uniform(0.15, 0.7, int(dips.sum()))
            util[k:e] = u
            if rng.random() < POWER_CAP_JOB_P:
                c = rng.uniform(*POWER_CAP_FRAC)
                cap[k:e] = c
                cap_events.append({"node": node.idx, "k0": k, "k1": e, "cap": c})
            last_job = True
        elif job == "infer":
            kind[k:e] = 2
            level[k:e] = rng.uniform(*INFER_LEVEL)
            base = rng.uniform(*INFER_BASE)
            amp = rng.uniform(*INFER_DIURNAL)
            util[k:e] = np.clip(base * (1 + amp * np.cos(2 * np.pi * (hod[k:e] - INFER_PEAK_HOUR) / 24.0)),
                                0.0, 1.0)
            last_job = True
        else:
            last_job = False
        k = e
    node.util, node.level, node.cap, node.kind = util, level, cap, kind


def _idle_node(node: Node, k0: int, k1: int) -> None:
    k0, k1 = max(0, k0), min(len(node.util), k1)
    if k1 > k0:
        node.util[k0:k1] = 0.0
        node.kind[k0:k1] = 0
        node.cap[k0:k1] = 1.0


# ----------------------------------------------------------------------------------
# Generator
# ----------------------------------------------------------------------------------
class _Fleet:
    def __init__(self, rng: np.random.Generator, n_gpus: int, days: float, interval: float,
                 failure_rate: float, catalog_names: bool) -> None:
        self.rng = rng
        self.interval = float(interval)
        self.dt_h = self.interval / HOUR
        self.T = max(1, int(round(days * DAY / self.interval)))
        self.days = days
        self.failure_rate = failure_rate
        self.catalog_names = catalog_names
        self.t_rel = np.arange(self.T) * self.interval
        self.hod = ((START_TS + self.t_rel) / HOUR) % 24.0
        self.nodes = _build_fleet(rng, n_gpus, self.interval)
        self.gpus: list[Gpu] = []
        for n in self.nodes:
            for j in range(n.n_gpus):
                g = Gpu(idx=len(self.gpus), node=n, local=j, model=n.model, uuids=[_uuid(rng)],
                        rth_mult=float(math.exp(GPU_RTH_SIGMA * rng.standard_normal())),
                        eff=float(math.exp(GPU_EFF_SIGMA * rng.standard_normal())),
                        pos_c=float(rng.uniform(0, 1.5) + (REAR_SLOT_EXTRA_C if j >= n.n_gpus // 2 else 0.0)))
                n.gpus.append(g.idx)
                self.gpus.append(g)
        self.labels: list[dict] = []
        self.failures: list[dict] = []
        self.cap_events: list[dict] = []
        self.n_sentinel = 0
        self.n_missing = 0

    # -- helpers ------------------------------------------------------------------
    def k_of_h(self, h: float) -> int:
        return max(1, int(round(h * HOUR / self.interval)))

    def ts(self, node: Node, k: int) -> float:
        return round(float(node.ts[k]), 3)

    def trap(self, typ: str, node: Node, gpu: Gpu | None, k: int | None, k_end: int | None = None,
             **extra: object) -> None:
        rec: dict = {"kind": "trap", "type": typ, "node": node.name, "gpu": gpu.local if gpu else None}
        if k is not None:
            rec["ts"] = self.ts(node, min(max(k, 0), self.T - 1))
        if k_end is not None:
            rec["end_ts"] = self.ts(node, min(max(k_end, 0), self.T - 1))
        rec.update(extra)
        self.labels.append(rec)

    # -- plan ---------------------------------------------------------------------
    def plan(self) -> None:
        rng, T = self.rng, self.T
        for n in self.nodes:
            n.uptime_s = float(rng.uniform(*UPTIME_AT_START_D) * DAY)
            n.ts = (START_TS + self.t_rel + n.offset_s
                    + np.clip(rng.normal(0, min(0.3, 0.005 * self.interval), T),
                              -0.04 * self.interval, 0.04 * self.interval))
            n.absent = np.zeros(T, dtype=bool)
            n.brake = np.zeros(T, dtype=bool)
            _workload(rng, n, T, self.interval, self.hod, self.cap_events)
        # hot-but-healthy nodes and GPUs
        n_hot = max(1, int(round(HOT_NODE_FRACTION * len(self.nodes))))
        hot_nodes = {int(i): float(rng.uniform(*HOT_NODE_EXTRA_C))
                     for i in rng.choice(len(self.nodes), size=min(n_hot, len(self.nodes)), replace=False)}
        _inlets(rng, self.nodes, T, self.interval, self.hod, hot_nodes)
        for i in hot_nodes:
            for gi in self.nodes[i].gpus:
                self.gpus[gi].trap.add("hot_healthy")
        n_hot_g = int(round(HOT_GPU_FRACTION * len(self.gpus)))
        for gi in self._pick(n_hot_g):
            g = self.gpus[gi]
            g.rth_mult *= rng.uniform(*HOT_GPU_RTH)
            g.trap.add("hot_healthy")
        for g in self.gpus:
            if "hot_healthy" in g.trap:
                self.trap("hot_healthy", g.node, g, None,
                          cause="node_inlet" if g.node.idx in hot_nodes else "gpu_airflow")
        # lemons, PCIe noise, NVLink noise (whole-trace traps)
        for gi in self._pick(max(1, int(round(LEMON_FRACTION * len(self.gpus))))):
            g = self.gpus[gi]
            g.trap.add("lemon")
            g.lemon_rate = _logu(rng, *LEMON_RATE_PER_H)
            g.static_remaps = int(rng.integers(LEMON_STATIC_REMAPS[0], LEMON_STATIC_REMAPS[1] + 1))
        for gi in self._pick(int(round(PCIE_NOISE_FRACTION * len(self.gpus)))):
            self.gpus[gi].trap.add("pcie_noise")
        nvl = [g.idx for g in self.gpus if g.model.nvlink and not g.trap]
        for gi in self._pick(int(round(NVLINK_NOISE_FRACTION * len(nvl))), pool=nvl):
            self.gpus[gi].trap.add("nvlink_noise")
        # failures first, so later traps can keep out of their windows
        self._plan_failures()
        for g in self.gpus:
            g.background_sbe = bool(not g.trap and not g.failing and rng.random() < BACKGROUND_SBE_FRACTION)
        self._plan_node_events()

    def _pick(self, n: int, pool: list[int] | None = None) -> list[int]:
        cand = pool if pool is not None else [g.idx for g in self.gpus if not g.trap and not g.failing]
        n = min(n, len(cand))
        if n <= 0:
            return []
        return [int(x) for x in self.rng.choice(cand, size=n, replace=False)]

    def _plan_failures(self) -> None:
        rng, T = self.rng, self.T
        expected = self.failure_rate / 1000.0 * len(self.gpus) * self.days
        # the count is the expectation, rounded at random (not Poisson): runs at one rate stay comparable
        n_fail = int(expected) + int(rng.random() < expected - int(expected))
        classes = list(FAILURE_CLASSES)
        shares = np.array([FAILURE_CLASSES[c][0] for c in classes])
        shares /= shares.sum()
        k_lo = min(T - 1, self.k_of_h(FAIL_EARLIEST_H))
        for _ in range(n_fail):
            cls = classes[int(rng.choice(len(classes), p=shares))]
            cand = [g for g in self.gpus
                    if not g.trap and not g.failing and (cls != "nvlink" or g.model.nvlink)]
            if not cand:
                continue
            w = np.array([g.model.hbm_fail_weight if cls == "hbm_ecc" else 1.0 for g in cand])
            g = cand[int(rng.choice(len(cand), p=w / w.sum()))]
            g.failing = True
            k_f = int(rng.integers(k_lo, T))
            self._apply_failure(g, cls, k_f)

    def _apply_failure(self, g: Gpu, cls: str, k_f: int) -> None:
        rng, T, dt_h = self.rng, self.T, self.dt_h
        _, p_abrupt, med, sig, lo, hi, rep_med, p_replace = FAILURE_CLASSES[cls]
        abrupt = bool(rng.random() < p_abrupt)
        node = g.node
        L_h = 0.0 if abrupt else _lognorm_h(rng, (med, sig, lo, hi))
        Lk = int(round(L_h * HOUR / self.interval))
        k_p0 = max(0, k_f - Lk)
        # The precursor may have begun before the trace: counts from before tick 0 are
        # folded onto tick 0 (the counters already hold them), gauges only use ticks >= 0.
        ka = np.arange(k_f - Lk, k_f)  # every precursor tick, possibly negative
        fa = (ka - (k_f - Lk) + 1) / max(Lk, 1)
        kc = np.maximum(ka, 0)
        vis = ka >= 0
        ks, frac = ka[vis], fa[vis]
        m = g.model
        fatal_xid = 0
        z_lo, z_hi = ZOMBIE_SAMPLES[cls]
        zombies = int(rng.integers(z_lo, z_hi + 1))
        replace = bool(rng.random() < p_replace)
        k_gone = min(T, k_f + 1 + zombies)
        rep_h = float(np.clip(rep_med * math.exp(REPAIR_SIGMA * rng.standard_normal()), *REPAIR_CLIP_H))
        k_back = k_gone + self.k_of_h(rep_h)
        g.fatal_k = k_f
        if cls == "hbm_ecc":
            sbe = g.a("sbe", T)
            remap_name = "corr_remap" if m.row_remap else "ret_sbe"
            remap = g.a(remap_name, T)
            if Lk:
                if rng.random() < HBM_SPARSE_P:  # a handful of SBEs, late-skewed
                    c = np.zeros(Lk)
                    np.add.at(c, (rng.beta(2.0, 1.0, int(rng.integers(2, 9))) * Lk).astype(int), 1.0)
                    p_remap = np.where(c > 0, 0.3, 0.0)
                else:
                    c = _ramp(rng, fa, _logu(rng, *HBM_R0_PER_H), _logu(rng, *HBM_R1_PER_H), dt_h)
                    p_remap = 1.0 - np.exp(-c / SBE_PER_REMAP)
                    hi_rate = np.nonzero(c / dt_h > 100)[0]
                    if hi_rate.size and rng.random() < 0.5:
                        g.xids.append((int(kc[hi_rate[0]]), 92))
                np.add.at(sbe, kc, c)
                ev = rng.random(Lk) < p_remap
                for j in np.nonzero(ev)[0][:10]:
                    remap[kc[j]] += 1
                    if rng.random() < 0.5:
                        g.xids.append((int(kc[j]), 63))
            g.a("dbe", T)[k_f] += int(rng.integers(1, 4))
            if m.row_remap:
                g.a("uncorr_remap", T)[k_f] += 1
                if rng.random() < HBM_REMAP_FAIL_P:
                    g.remap_fail_at = k_f
                    g.xids.append((k_f, 64))
                    replace = True
            else:
                g.a("ret_dbe", T)[k_f] += 1
            fatal_xid = int(rng.choice(m.fatal_mem_xids))
            g.xids.append((k_f, fatal_xid))
            if k_f + 1 < T:
                g.force_util.update({k: 0.0 for k in range(k_f + 1, min(T, k_f + 1 + zombies))})
        elif cls == "nvlink":
            crc = g.a("crc", T)
            rep = g.a("nvl_replay", T)
            if Lk:
                c = _ramp(rng, fa, _logu(rng, *NVL_R0_PER_H), _logu(rng, *NVL_R1_PER_H), dt_h)
                np.add.at(crc, kc, c)
                np.add.at(rep, kc, rng.poisson(c * rng.uniform(*NVL_REPLAY_FRAC)))
                for _ in range(int(rng.poisson(NVL_PRE_XID74_MEAN))):
                    k = min(max(0, int(k_f - Lk + rng.uniform(0.5, 1.0) * Lk)), k_f - 1)
                    g.xids.append((k, 74))
                    if rng.random() < 0.4:
                        self._sympathetic(g, k, 1)
            crc[k_f] += float(rng.integers(1_000, 100_000))
            rep[k_f] += float(rng.integers(100, 5_000))
            fatal_xid = 74
            g.xids.append((k_f, 74))
            self._sympathetic(g, k_f, int(rng.integers(1, 4)))
            g.force_util.update({k: 0.0 for k in range(k_f + 1, min(T, k_f + 1 + zombies))})
        elif cls == "thermal_interface":
            rm = g.a("rth_extra", T)
            delta = rng.uniform(*THERMAL_DELTA)
            if Lk and ks.size:
                rm[ks] = delta * frac ** THERMAL_SHAPE
            rm[k_f:k_back] = delta  # fixed (or replaced) at the repair
            g.force_temp[k_f] = m.shutdown_c + rng.uniform(0.0, 3.0)
            g.force_util[k_f] = max(0.9, float(node.util[k_f]))
            g.force_bits[k_f] = CE_HW_THERMAL | CE_HW_SLOWDOWN | CE_SW_THERMAL
            g.force_clock_x[k_f] = 0.3
            if rng.random() < 0.5:
                fatal_xid = 79
                g.xids.append((k_f, 79))
        elif cls == "off_bus":
            if Lk:
                np.add.at(g.a("pcie", T), kc, _ramp(rng, fa, _logu(rng, *PCIE_R0_PER_H),
                                                    _logu(rng, *PCIE_R1_PER_H), dt_h))
            fatal_xid = 79
            g.xids.append((k_f, 79))
            g.blank_all.update(range(k_f, min(T, k_f + 1 + zombies)))
        elif cls == "gsp":
            if Lk:
                for _ in range(int(rng.integers(1, 3))):
                    g.xids.append((max(0, int(k_f - Lk + rng.uniform(0.2, 0.9) * Lk)), 119))
                pb = GSP_BLANK_P[0] + (GSP_BLANK_P[1] - GSP_BLANK_P[0]) * frac
                for j in np.nonzero(rng.random(ks.size) < pb)[0]:
                    g.blank_some[int(ks[j])] = int(rng.integers(1, 5))
            fatal_xid = 119 if rng.random() < 0.6 else 120
            g.xids.append((k_f, fatal_xid))
            for k in range(k_f, min(T, k_f + 1 + zombies)):
                g.force_util[k] = 0.0
                g.force_power[k] = m.idle_w * rng.uniform(1.2, 1.6)
        elif cls == "power":
            brake = g.a("brake", T)
            spike = g.a("spike", T)
            if Lk and ks.size:
                pb = POWER_BRAKE_P[0] + (POWER_BRAKE_P[1] - POWER_BRAKE_P[0]) * frac
                brake[ks] = rng.random(ks.size) < pb
                ps = POWER_SPIKE_P[0] + (POWER_SPIKE_P[1] - POWER_SPIKE_P[0]) * frac
                sp = rng.random(ks.size) < ps
                spike[ks[sp]] = rng.uniform(*POWER_SPIKE_X, int(sp.sum()))
            brake[k_f] = 1.0
            g.force_power[k_f] = float(rng.uniform(0.0, 25.0))
            g.force_clock_x[k_f] = 0.2
            if rng.random() < 0.6:
                fatal_xid = 79
                g.xids.append((k_f, 79))
        # repair window
        if g.absent is None:
            g.absent = np.zeros(T, dtype=bool)
        g.absent[k_gone:min(T, k_back)] = True
        _idle_node(node, k_f + 1, k_back)  # the job dies; the node is drained for the repair
        for pi in node.gpus:  # job peers log XID 45 as the job is torn down
            if pi != g.idx and k_f + 1 < T and self.rng.random() < PEER_XID45_P:
                p = self.gpus[pi]
                p.xids.append((k_f + 1, 45))
                self.trap("app_xid", node, p, k_f + 1, xid=45, cause="peer_failure")
        if k_back < T:
            g.resets.append(k_back)
            if replace:
                g.replace_at.append(k_back)
                g.uuids.append(_uuid(rng))
        node.busy_windows.append((k_p0 - self.k_of_h(1.0), k_back + 1))
        self.failures.append({
            "kind": "failure", "node": node.name, "gpu": g.local,
            "ts": self.ts(node, k_f), "class": cls,
            "precursor_start_ts": None if abrupt else round(float(node.ts[k_f]) - L_h * HOUR, 3),
            "abrupt": abrupt, "uuid": g.uuids[0] if not g.replace_at else g.uuids[-2],
            "model": m.nvml_name, "fatal_xid": fatal_xid or None,
            "precursor_h": None if abrupt else round(L_h, 2),
            "repair_end_ts": round(START_TS + k_back * self.interval + node.offset_s, 3),
            "replaced": replace and k_back < T,
        })

    def _sympathetic(self, g: Gpu, k: int, n: int) -> None:
        node = g.node
        if g.model.gpus_per_node == 4 and g.model.key == "a100pcie":
            peers = [pi for pi in node.gpus if self.gpus[pi].local == (g.local ^ 1)]  # bridge partner
        else:
            peers = [pi for pi in node.gpus if pi != g.idx]
        if not peers:
            return
        for pi in self.rng.choice(peers, size=min(n, len(peers)), replace=False):
            p = self.gpus[int(pi)]
            kk = min(self.T - 1, k + int(self.rng.integers(0, 2)))
            p.xids.append((kk, 74))
            p.a("nvl_replay", self.T)[kk] += float(self.rng.integers(1, 20))
            self.trap("sympathetic_xid74", node, p, kk, xid=74, source_gpu=g.local)

    def _free(self, node: Node, k0: int, k1: int) -> bool:
        return all(k1 <= a or k0 >= b for a, b in node.busy_windows)

    def _plan_node_events(self) -> None:
        rng, T, days = self.rng, self.T, self.days
        for node in self.nodes:
            # reboots: drain, silent gap, every counter restarts
            for _ in range(int(rng.poisson(REBOOT_PER_NODE_DAY * days))):
                for _try in range(5):
                    k0 = int(rng.integers(1, T))
                    gap = max(1, int(round(rng.uniform(*REBOOT_GAP_MIN) * 60 / self.interval)))
                    drain = int(round(rng.uniform(*REBOOT_DRAIN_H) * HOUR / self.interval))
                    if self._free(node, k0 - drain, k0 + gap + 1):
                        break
                else:
                    continue
                node.busy_windows.append((k0 - drain, k0 + gap + 1))
                node.absent[k0:k0 + gap] = True
                _idle_node(node, k0 - drain, k0 + gap + self.k_of_h(0.25))
                if k0 + gap < T:
                    node.resets.append(k0 + gap)
                self.trap("reboot", node, None, k0, k0 + gap - 1)  # end_ts: last silent tick
            # node-wide power brake (PSU fail-over): not a GPU failure
            for _ in range(int(rng.poisson(NODE_BRAKE_PER_NODE_DAY * days))):
                k0 = int(rng.integers(0, T))
                n = max(1, int(round(rng.uniform(*NODE_BRAKE_MIN) * 60 / self.interval)))
                if not self._free(node, k0, k0 + n):
                    continue
                node.brake[k0:k0 + n] = True
                self.trap("node_power_brake", node, None, k0, k0 + n)
            # app XIDs on busy nodes
            for _ in range(int(rng.poisson(APP_XID_PER_NODE_DAY * days))):
                busy = np.nonzero(node.kind > 0)[0]
                if busy.size == 0:
                    continue
                k = int(busy[rng.integers(0, busy.size)])
                if node.absent[k]:
                    continue
                gs = [self.gpus[i] for i in node.gpus]
                culprit = gs[int(rng.integers(0, len(gs)))]
                xid = int(rng.choice(APP_XIDS))
                culprit.xids.append((k, xid))
                self.trap("app_xid", node, culprit, k, xid=xid, cause="user_code")
                for p in gs:
                    if p is not culprit and k + 1 < T and rng.random() < APP_XID_PEER_45_P:
                        p.xids.append((k + 1, 45))
                        self.trap("app_xid", node, p, k + 1, xid=45, cause="job_teardown")
                _idle_node(node, k + 1, k + 1 + self.k_of_h(rng.uniform(*APP_IDLE_AFTER_H)))
            # scrape gaps: node is silent, counters run on
            for _ in range(int(rng.poisson(SCRAPE_GAP_PER_NODE_DAY * days))):
                self._scrape_gap(node, int(rng.integers(0, T)),
                                 max(1, int(round(_lognorm_h(rng, SCRAPE_GAP_MIN) * 60 / self.interval))))
        for _ in range(int(rng.poisson(FLEET_GAP_PER_DAY * days))):
            k0 = int(rng.integers(0, T))
            n = max(1, int(round(rng.uniform(*FLEET_GAP_MIN) * 60 / self.interval)))
            for node in self.nodes:
                self._scrape_gap(node, k0, n, fleet=True)
        # per-cap-job labels
        for ev in self.cap_events:
            node = self.nodes[ev["node"]]
            self.trap("power_cap", node, None, ev["k0"], ev["k1"] - 1,
                      cap_w=round(ev["cap"] * node.model.tdp_w))
        # benign SBE bursts on healthy GPUs
        n_burst = int(self.rng.poisson(SBE_BURST_PER_GPU_DAY * len(self.gpus) * days))
        for gi in self._pick(n_burst):
            g = self.gpus[gi]
            g.trap.add("sbe_burst")
            dur_k = self.k_of_h(_lognorm_h(rng, SBE_BURST_DUR_H))
            k0 = int(rng.integers(0, max(1, T - 1)))
            k1 = min(T, k0 + dur_k)
            n = k1 - k0
            shape = np.sin(np.pi * (np.arange(n) + 0.5) / n)  # rises and fades away
            c = rng.poisson(_logu(rng, *SBE_BURST_RATE_PER_H) * self.dt_h * shape
                            * rng.gamma(SBE_GAMMA_SHAPE, 1 / SBE_GAMMA_SHAPE, n))
            g.a("sbe", T)[k0:k1] += c
            if rng.random() < SBE_BURST_REMAP_P:
                kr = k0 + int(np.argmax(c))
                g.a("corr_remap" if g.model.row_remap else "ret_sbe", T)[kr] += 1
                g.xids.append((kr, 63))
            self.trap("sbe_burst", node=g.node, gpu=g, k=k0, k_end=k1 - 1, sbe=int(c.sum()))
        for g in self.gpus:
            if "lemon" in g.trap:
                self.trap("lemon", g.node, g, 0, rate_per_h=round(g.lemon_rate, 2))
            if "pcie_noise" in g.trap:
                self.trap("pcie_noise", g.node, g, 0)
            if "nvlink_noise" in g.trap:
                self.trap("nvlink_noise", g.node, g, 0)

    def _scrape_gap(self, node: Node, k0: int, n: int, fleet: bool = False) -> None:
        k1 = min(self.T, k0 + n)
        fatal = [f for f in self.failures if f["node"] == node.name]
        for f in fatal:  # a gap never hides the fatal sample itself
            kf = int(round((f["ts"] - START_TS - node.offset_s) / self.interval))
            if k0 <= kf < k1:
                k1 = kf
        if k1 <= k0:
            return
        node.absent[k0:k1] = True
        restart = bool(self.rng.random() < EXPORTER_RESTART_P)
        if restart and k1 < self.T:
            node.xid_clears.append(k1)
        self.trap("scrape_gap", node, None, k0, k1 - 1, exporter_restart=restart, fleet_wide=fleet)

    # -- physics -------------------------------------------------------------------
    def simulate_gpu(self, g: Gpu) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
        """Metric matrix (T x fields), field names, present mask, uuid index per tick."""
        rng, T, m, node = self.rng, self.T, g.model, g.node
        dt_h, dt = self.dt_h, self.interval
        resets = sorted(set(node.resets + g.resets))
        # utilisation per GPU
        u = node.util.copy()
        infer = node.kind == 2
        if infer.any():
            spread = np.exp(INFER_GPU_SIGMA * rng.standard_normal(int(infer.sum())))
            u[infer] = np.clip(u[infer] * spread, 0, 1)
        train = node.kind == 1
        u[train] = np.clip(u[train] + rng.normal(0, 0.01, int(train.sum())), 0, 1)
        idle = node.kind == 0
        blip = idle & (rng.random(T) < 0.03)
        u[blip] = rng.uniform(0.01, 0.08, int(blip.sum()))
        for k, v in g.force_util.items():
            u[k] = v
        # power
        tdp = m.tdp_w
        demand = m.idle_w + (tdp * node.level - m.idle_w) * np.power(u, 0.85) * g.eff
        demand = np.maximum(demand + rng.normal(0, POWER_NOISE_FRAC * tdp, T), m.idle_w * 0.8)
        cap_w = node.cap * tdp
        pcap = demand > cap_w
        power = np.where(pcap, cap_w * (1 - np.abs(rng.normal(0, 0.006, T))), demand)
        clk = np.ones(T)
        clk[pcap] = np.clip((cap_w[pcap] / demand[pcap]) ** 0.7, 0.6, 1.0)
        bits = np.zeros(T, dtype=np.int64)
        bits[pcap] |= CE_SW_POWER_CAP
        bits[u < 0.01] |= CE_GPU_IDLE
        # power brake (node event or the GPU's own power-delivery trouble)
        brake = node.brake | (g.arr["brake"] > 0 if "brake" in g.arr else False)
        if brake.any():
            nb = int(brake.sum())
            clk[brake] *= rng.uniform(0.25, 0.5, nb)
            power[brake] = m.idle_w + 0.35 * (power[brake] - m.idle_w)
            bits[brake] |= CE_HW_POWER_BRAKE | CE_HW_SLOWDOWN
        # temperature
        rth = (m.rise_c / tdp) * g.rth_mult * (1.0 + g.arr.get("rth_extra", 0.0))
        target = node.inlet + rth * power + g.pos_c + rng.normal(0, TEMP_NOISE_C, T)
        a = math.exp(-dt / THERMAL_TAU_S)
        if a > 0.05:
            temp = target.copy()
            for k in range(1, T):
                temp[k] = a * temp[k - 1] + (1 - a) * target[k]
        else:
            temp = target
        over = temp - m.max_op_c
        sw = over > 0
        if sw.any():
            temp = np.where(sw, m.max_op_c + 0.3 * over, temp)
            clk[sw] *= np.clip(1 - 0.035 * over[sw], 0.55, 1.0)
            power[sw] *= np.clip(1 - 0.015 * over[sw], 0.7, 1.0)
            bits[sw] |= CE_SW_THERMAL
        hw = temp > m.hw_slow_c
        if hw.any():
            clk[hw] *= 0.5
            power[hw] *= 0.8
            temp = np.where(hw, m.hw_slow_c + 0.3 * (temp - m.hw_slow_c), temp)
            bits[hw] |= CE_HW_THERMAL | CE_HW_SLOWDOWN
        for k, v in g.force_temp.items():
            temp[k] = v
        for k, v in g.force_bits.items():
            bits[k] |= v
        for k, v in g.force_clock_x.items():
            clk[k] *= v
        for k, v in g.force_power.items():
            power[k] = v
        if "spike" in g.arr:
            sp = g.arr["spike"] > 0
            power[sp] = tdp * g.arr["spike"][sp]
        busy = u >= 0.01
        sm = np.round(m.max_clock * clk / CLOCK_STEP_MHZ) * CLOCK_STEP_MHZ
        # idle GPUs sit at the idle clock, some hold boost clocks with a context open
        sm[~busy] = np.where(rng.random(int((~busy).sum())) < 0.1, m.max_clock, m.idle_clock)
        # violation counters and energy (ns / mJ since boot)
        pv = dt * 1e9 * (((bits & CE_SW_POWER_CAP) > 0) * rng.uniform(0.4, 1.0, T)
                         + ((bits & CE_HW_POWER_BRAKE) > 0) * rng.uniform(0.2, 0.8, T))
        tv = dt * 1e9 * (((bits & CE_SW_THERMAL) > 0) * rng.uniform(0.3, 1.0, T)
                         + ((bits & CE_HW_THERMAL) > 0))
        energy = power * dt * 1000.0
        up = node.uptime_s  # what the counters already held at trace start (until the first reset)
        energy[0] += up * m.tdp_w * rng.uniform(*START_ENERGY_TDP_FRAC) * 1000.0
        pv[0] += up * 1e9 * rng.uniform(*START_PWR_VIOL_FRAC)
        tv[0] += up * 1e9 * rng.uniform(*START_THR_VIOL_FRAC) * (10.0 if "hot_healthy" in g.trap else 1.0)
        up_h = up / HOUR
        # error counters
        sbe = g.a("sbe", T)
        if "lemon" in g.trap:
            sbe += rng.poisson(g.lemon_rate * dt_h * rng.gamma(2.0, 0.5, T))
            sbe[0] += rng.poisson(g.lemon_rate * up_h)
        elif g.background_sbe:
            r = _logu(rng, *BACKGROUND_SBE_PER_H)
            sbe += rng.poisson(r * dt_h, T)
            sbe[0] += rng.poisson(r * up_h)
        pcie = g.a("pcie", T)
        if "pcie_noise" in g.trap:
            burst = np.repeat(rng.gamma(0.5, 2.0, T // 12 + 1), 12)[:T]  # hour-scale bursts
            r = _logu(rng, *PCIE_NOISE_PER_H)
            pcie += rng.poisson(r * dt_h * burst)
            pcie[0] += rng.poisson(r * up_h)
        out: dict[str, np.ndarray] = {}
        out[F_GPU_TEMP] = np.round(temp)
        if m.mem_temp:
            creep = 1 + 0.6 * g.arr.get("rth_extra", 0.0)  # a failing cold plate heats the HBM too
            out[F_MEM_TEMP] = np.round(temp + m.mem_rise_c * power / tdp * creep + rng.normal(0, 0.5, T))
        out[F_POWER] = np.round(power, 3)
        out[F_ENERGY] = np.round(_seg_cumsum(energy, resets))
        out[F_SM_CLOCK] = sm
        out[F_UTIL] = np.round(u * 100)
        mem_factor = np.where(node.kind == 1, 0.4, 0.6)
        out[F_MEM_UTIL] = np.round(np.clip(u * mem_factor * 100 + rng.normal(0, 2, T), 0, 100) * busy)
        out[F_CLK_EV] = bits.astype(float)
        out[F_PWR_VIOL] = np.round(_seg_cumsum(pv, resets))
        out[F_THR_VIOL] = np.round(_seg_cumsum(tv, resets))
        out[F_SBE] = _seg_cumsum(sbe, resets)
        out[F_DBE] = _seg_cumsum(g.a("dbe", T), resets)
        replaced = sorted(g.replace_at)
        if m.row_remap:
            base = np.zeros(T)
            base[: replaced[0] if replaced else T] = g.static_remaps
            out[F_CORR_REMAP] = _seg_cumsum(g.a("corr_remap", T), replaced) + base
            out[F_UNCORR_REMAP] = _seg_cumsum(g.a("uncorr_remap", T), replaced)
            rf = np.zeros(T)
            if g.remap_fail_at is not None:
                rf[g.remap_fail_at: replaced[0] if replaced else T] = 1
            out[F_REMAP_FAIL] = rf
        else:
            base = np.zeros(T)
            base[: replaced[0] if replaced else T] = g.static_remaps
            out[F_RET_SBE] = _seg_cumsum(g.a("ret_sbe", T), replaced) + base
            out[F_RET_DBE] = _seg_cumsum(g.a("ret_dbe", T), replaced)
        out[F_XID] = _sticky(T, g.xids, resets + node.xid_clears)
        out[F_PCIE] = _seg_cumsum(pcie, resets)
        if m.nvlink:
            crc = g.a("crc", T)
            nrate = (_logu(rng, *NVLINK_NOISE_PER_H) if "nvlink_noise" in g.trap
                     else _logu(rng, *NVLINK_BACKGROUND_PER_H))
            bg = rng.poisson(nrate * dt_h, T).astype(float)
            bg[0] += rng.poisson(nrate * up_h)
            crc += bg
            rep = g.a("nvl_replay", T) + rng.binomial(bg.astype(np.int64), 0.2)
            out[F_NVL_CRC] = _seg_cumsum(crc, resets)
            out[F_NVL_REPLAY] = _seg_cumsum(rep, resets)
        names = list(out)
        mat = np.stack([out[n] for n in names], axis=1)
        present = ~node.absent
        if g.absent is not None:
            present &= ~g.absent
        present &= rng.random(T) >= DROPPED_SAMPLE_P
        if g.fatal_k is not None:
            present[g.fatal_k] = True  # the fatal sample always reaches the collector
        for k in g.blank_all:  # still reported, but everything blank
            present[k] = True
        uidx = np.searchsorted(np.array(replaced, dtype=np.int64), np.arange(T), side="right")
        g.arr.clear()
        return mat, names, present, uidx

    # -- output --------------------------------------------------------------------
    def write(self, out_dir: Path) -> int:
        T, rng = self.T, self.rng
        sims = []
        for g in self.gpus:
            mat, names, present, uidx = self.simulate_gpu(g)
            m = g.model
            name = m.catalog_name if self.catalog_names else m.nvml_name
            int_f = [n != F_POWER for n in names]
            body = ", ".join(f'"{n}": ' + ("%d" if i else "%.3f") for n, i in zip(names, int_f, strict=True))
            head = (f'{{"ts": %.3f, "node": "{g.node.name}", "gpu": {g.local}, "uuid": "%s", '
                    f'"model": "{name}", "rack": "{g.node.rack}", "site": "{SITE}", "metrics": {{')
            tmpl = head + body + "}}"  # names, racks and models hold no '%'
            # odd samples: blank sentinels, missing keys, the GPU's own blank-field precursors
            odd: dict[int, dict[str, object]] = {}
            pk = np.nonzero(present)[0]
            for k in pk[rng.random(pk.size) < SENTINEL_SAMPLE_P]:
                odd.setdefault(int(k), {}).update(self._blank_fields(names, int(rng.integers(1, 4))))
                self.n_sentinel += 1
            for k, n in g.blank_some.items():
                if present[k]:
                    odd.setdefault(int(k), {}).update(self._blank_fields(names, n))
                    self.n_sentinel += 1
            for k in pk[rng.random(pk.size) < MISSING_KEY_SAMPLE_P]:
                d = odd.setdefault(int(k), {})
                for j in rng.choice(len(names), size=int(rng.integers(1, 3)), replace=False):
                    d[names[int(j)]] = None
                self.n_missing += 1
            for k in g.blank_all:
                d = odd.setdefault(int(k), {})
                for n in names:
                    if n != F_XID:
                        d[n] = DCGM_FP64_BLANK if n == F_POWER else DCGM_INT64_BLANK
                self.n_sentinel += 1
            sims.append((g, mat, names, present, uidx, tmpl, int_f, odd))
        out_dir.mkdir(parents=True, exist_ok=True)
        block = max(1, WRITE_BLOCK_SAMPLES // max(1, len(self.gpus)))  # ticks per sorted block
        n_lines = 0
        # mtime=0 and a fixed inner name keep the .gz byte-identical for a given seed
        with open(out_dir / "trace.jsonl.gz", "wb") as raw, \
                gzip.GzipFile("trace.jsonl", "wb", compresslevel=2, fileobj=raw, mtime=0) as fh:
            for b0 in range(0, T, block):
                b1 = min(T, b0 + block)
                ts_parts: list[np.ndarray] = []
                lines: list[str] = []
                for g, mat, names, present, uidx, tmpl, int_f, odd in sims:
                    ks = np.nonzero(present[b0:b1])[0] + b0
                    if ks.size == 0:
                        continue
                    tsv = np.round(g.node.ts[ks], 3)
                    ts_parts.append(tsv)
                    rows = mat[ks].tolist()
                    uu = uidx[ks].tolist()
                    for k, t, row, ui in zip(ks.tolist(), tsv.tolist(), rows, uu, strict=True):
                        if k in odd:
                            lines.append(self._odd_line(g, t, g.uuids[ui], names, int_f, row, odd[k]))
                        else:
                            lines.append(tmpl % (t, g.uuids[ui], *row))
                if not lines:
                    continue
                order = np.argsort(np.concatenate(ts_parts), kind="stable")
                fh.write(("\n".join([lines[i] for i in order]) + "\n").encode())
                n_lines += len(lines)
        return n_lines

    def _blank_fields(self, names: list[str], n: int) -> dict[str, object]:
        rng = self.rng
        d: dict[str, object] = {}
        for j in rng.choice(len(names), size=min(n, len(names)), replace=False):
            f = names[int(j)]
            if f == F_POWER:
                d[f] = DCGM_FP64_BLANK if rng.random() < FP64_SENTINEL_P else None
            else:
                d[f] = int(INT_SENTINELS[int(rng.choice(len(INT_SENTINELS), p=INT_SENTINEL_P))])
        return d

    def _odd_line(self, g: Gpu, t: float, uuid: str, names: list[str], int_f: list[bool], row: list[float],
                  over: dict[str, object]) -> str:
        metrics: dict[str, object] = {}
        for n, isint, v in zip(names, int_f, row, strict=True):
            if n in over:
                if over[n] is not None:
                    metrics[n] = over[n]
            else:
                metrics[n] = int(v) if isint else round(v, 3)
        name = g.model.catalog_name if self.catalog_names else g.model.nvml_name
        return json.dumps({"ts": t, "node": g.node.name, "gpu": g.local, "uuid": uuid, "model": name,
                           "rack": g.node.rack, "site": SITE, "metrics": metrics})


def generate(out_dir: Path, seed: int, gpus: int = 256, days: float = 14.0, interval_s: float = 300.0,
             failure_rate: float = DEFAULT_FAILURE_RATE, *, catalog_names: bool = False) -> dict:
    """Write ``trace.jsonl.gz`` and ``labels.jsonl`` under ``out_dir``; return a summary."""
    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    fleet = _Fleet(rng, int(gpus), float(days), float(interval_s), float(failure_rate), catalog_names)
    fleet.plan()
    n_samples = fleet.write(out_dir)
    labels = sorted(fleet.failures, key=lambda r: r["ts"])
    traps = sorted(fleet.labels, key=lambda r: (r.get("ts", START_TS), r["type"], r["node"], r["gpu"] or 0))
    with open(out_dir / "labels.jsonl", "w") as fh:
        for rec in labels + traps:
            fh.write(json.dumps(rec) + "\n")
    by_class: dict[str, int] = {}
    abrupt: dict[str, int] = {}
    for f in labels:
        by_class[f["class"]] = by_class.get(f["class"], 0) + 1
        if f["abrupt"]:
            abrupt[f["class"]] = abrupt.get(f["class"], 0) + 1
    trap_counts: dict[str, int] = {}
    for t in traps:
        trap_counts[t["type"]] = trap_counts.get(t["type"], 0) + 1
    models: dict[str, int] = {}
    for g in fleet.gpus:
        models[g.model.nvml_name] = models.get(g.model.nvml_name, 0) + 1
    return {
        "seed": seed, "gpus": len(fleet.gpus), "nodes": len(fleet.nodes), "days": days,
        "interval_s": interval_s, "ticks": fleet.T, "samples": n_samples,
        "start_ts": START_TS, "end_ts": START_TS + fleet.T * fleet.interval,
        "models": models, "failure_rate_per_1000_gpu_days": failure_rate,
        "failures": dict(sorted(by_class.items())), "failures_total": len(labels),
        "failures_abrupt": dict(sorted(abrupt.items())), "traps": dict(sorted(trap_counts.items())),
        "sentinel_samples": fleet.n_sentinel, "missing_key_samples": fleet.n_missing,
        "trace": str(out_dir / "trace.jsonl.gz"), "labels": str(out_dir / "labels.jsonl"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--interval", type=float, default=300.0, help="sample interval in seconds")
    ap.add_argument("--failures-per-1000-gpu-days", type=float, default=DEFAULT_FAILURE_RATE)
    ap.add_argument("--catalog-names", action="store_true",
                    help="write the catalog's model names instead of the NVML names")
    args = ap.parse_args(argv)
    summary = generate(args.out, args.seed, args.gpus, args.days, args.interval,
                       args.failures_per_1000_gpu_days, catalog_names=args.catalog_names)
    json.dump(summary, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
