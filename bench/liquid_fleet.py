"""Liquid-cooled GPU fleet: seeded DCGM telemetry with labelled failures and traps.

``liquid_fleet`` writes a synthetic but physically motivated telemetry trace for a large, mostly
liquid-cooled Hopper/Blackwell fleet, together with ground-truth labels for the GPU failures in it
and for the healthy behaviour that merely *looks* like trouble ("traps"). It exists to test a GPU
failure predictor on data unlike anything the predictor was built from.

Provenance
----------
This tool was written without reading the project's own fleet simulator, feature code, predictors,
tests or other benchmark generators. Its only project inputs were ``shared/docs/DESIGN.md`` (the
"GPU sample" record contract), ``shared/docs/REFERENCE.md`` (DCGM fields, XIDs, failure statistics)
and ``shared/data`` (the GPU catalog and the dcgm-exporter counter lists). Every shape, rate, noise
level and trap below is this tool's own choice, made from those documents and from public knowledge
of how DCGM/NVML report and how real fleets fail (NVIDIA's XID catalog, the Llama 3 and Meta RSC
reliability reports, NCSA Delta's A100/H100 memory-error study, Titan's "lemon" GPUs).

What it models
--------------
* Fleet: H100 SXM, H200 and B200 HGX nodes (8 GPUs), GB200 NVL72-style compute trays (4 GPUs, up to
  18 trays per rack) and a minority of air-cooled A100-SXM4-80GB nodes, over three sites in
  different time zones (phx1, dfw2, osl1). Racks sit in rows; each liquid row is fed by one CDU.
* Thermal physics: GPU temperature = coolant supply temperature of the row (+ a manifold offset per
  node) + per-GPU die-to-coolant resistance x power + sensor noise. The supply follows a diurnal
  swing in local time (dry coolers track outdoor air), day-to-day weather, slow AR(1) drift, the
  row's own heat load, short CDU maintenance spikes and multi-hour coolant excursions. Air-cooled
  rows use the cold-aisle temperature instead. Above the slowdown temperature the GPU sheds power
  (SW thermal slowdown); power above the enforced limit is clipped (SW power cap).
* Work: large multi-node training jobs per (site, model) pool with job-synchronous dips
  (checkpoints, evaluation passes, crash restarts, NCCL hangs after a hardware fault), smaller
  fine-tuning / RL / eval jobs, diurnal inference services, idle nodes.
* Operations: firmware/driver rollouts that drain and reboot nodes in waves (volatile counters reset),
  maintenance drains (some ending in a reboot), scheduler power caps, scrape gaps (per node and one
  site-wide Prometheus outage), dcgm-exporter restarts (blank fields while DCGM re-warms its watches).
* Counters are cumulative as DCGM reports them: volatile ECC, PCIe replay, NVLink CRC/replay/recovery,
  energy since boot and violation times reset at a reboot or GPU reset; aggregate ECC and the
  remapped-row counts persist across reboots and restart only with a new board (new UUID).
  DCGM_FI_DEV_XID_ERRORS is the last XID and sticks until the next reset. A small fraction of values
  are DCGM blank sentinels; a small fraction of samples miss some keys. Which fields a GPU exports
  depends on its site's exporter profile (not every site enables ECC aggregates, NVLink data CRC,
  violation counters or DCP profiling metrics).

Failure classes (each with its own abrupt share; otherwise a log-normal precursor of 0.5 h - 4 days
whose strength varies widely, some barely visible):
``hbm_memory`` (SBE rate growth, correctable row remaps, remap pending, XID 63/92, then DBE with XID
48/94/95/140 or remap failure with XID 64), ``nvlink`` (CRC/replay/recovery growth, then XID 74 with
sympathetic XID 74 on peers), ``thermal_cooling`` (cold-plate/TIM degradation: temperature per watt
creeps up, throttling under load only; then a thermal trip), ``pcie_bus`` (replays, dropped samples,
then XID 79 with blank fields and silence), ``gsp_firmware`` (mostly abrupt; XID 119/120, NVML
timeouts) and ``power_vr`` (intermittent HW power-brake slowdowns, then XID 62 or 79). After a
failure the GPU stops reporting for a repair window (hours to days), its node is drained, and the
node reboots when the GPU returns, possibly as a replaced board with a new UUID. The number of
failures is round(rate x GPU-days); failure-prone GPUs are drawn with weight on model, rack and
thermal resistance (hotter parts fail more, as on Titan), excluding the trap GPUs below.

Traps (labelled healthy behaviour that looks like trouble): ``hot_healthy`` (high cold-plate
resistance, stable, 10-20 C hotter under load and sometimes at SW thermal slowdown; never fails),
``coolant_excursion`` / ``cdu_maintenance`` (a whole row warmer for hours / minutes), ``sbe_burst``
(an SBE burst that stops, sometimes with one benign XID 63 remap), ``ecc_lemon`` (steady background
SBE rate; never fails), ``app_xid`` (XID 13/31/43, and 45 on neighbours, at software crashes; sticky),
``sympathetic_xid74`` (peers of a failing NVLink port), ``reboot_wave``, ``maintenance_drain``,
``peer_repair_drain`` (node-mates idle, then rebooted, while a GPU is in repair), ``scrape_gap``,
``exporter_restart``, ``pcie_replay_chatter``, ``nvlink_crc_noise`` and ``power_cap``.

Output
------
``DIR/trace.jsonl.gz`` (gzip, mtime 0, byte-deterministic for a seed): one GPU sample per line in
event-time order, exactly the DESIGN.md "GPU sample" record::

    {"ts": 1772409641.218, "node": "dfw2-gpu0003", "gpu": 5, "uuid": "GPU-...",
     "model": "NVIDIA H100 80GB HBM3", "rack": "...", "site": "dfw2",
     "metrics": {"DCGM_FI_DEV_GPU_TEMP": 63, ...}, "job": "pretrain-405b-002", "rank": 37}

``DIR/labels.jsonl``: failures first (``kind`` = "failure": ``ts`` of the first sample that shows the
failure, ``node``, ``gpu``, ``class``, ``abrupt``, ``precursor_start_ts``, ``precursor_h`` and extras
such as ``uuid``, ``fatal_xid``, ``replaced``, ``reset_ts``), then traps (``kind`` = "trap", ``type``,
``node``, ``gpu`` or null for the whole node, ``ts``, ``end_ts``). GPUs labelled ``hot_healthy`` or
``ecc_lemon`` never fail. Every counter reset is explained by a record carrying ``reset_ts``
(``reboot_wave``, ``maintenance_drain`` with a reboot, ``peer_repair_drain``, or the failure itself).

Usage
-----
::

    python bench/liquid_fleet.py --out DIR --seed N [--gpus 256] [--days 14] [--interval 60]
        [--failures-per-1000-gpu-days 30]

numpy and the standard library only; one ``numpy.random.Generator`` per run, no wall clock. Work is
vectorised over chunks of time steps x GPUs; lines are printf-formatted from per-GPU templates and
compressed on a second thread (256 GPUs x 14 days at --interval 120, ~2.5 M lines: ~30 s, ~0.6 GB).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import queue
import sys
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

# --------------------------------------------------------------------------------------------------------
# Time and DCGM sentinels

T0 = datetime(2026, 3, 2, tzinfo=UTC).timestamp()  # Monday 2026-03-02 00:00 UTC; fixed, never the wall clock
INT_BLANK = 9223372036854775794  # DCGM_INT64_NOT_SUPPORTED, the blank dcgm-exporter prints for int64 fields
FP_BLANK = "140737488355328.0"  # DCGM_FP64_BLANK (2**47), the blank for double fields

# --------------------------------------------------------------------------------------------------------
# Metric columns (dcgm-exporter / DCGM field names) and their print formats

FIELDS: tuple[tuple[str, str], ...] = (
    ("DCGM_FI_DEV_GPU_TEMP", "%d"),
    ("DCGM_FI_DEV_MEMORY_TEMP", "%d"),
    ("DCGM_FI_DEV_POWER_USAGE", "%.3f"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "%d"),
    ("DCGM_FI_DEV_SM_CLOCK", "%d"),
    ("DCGM_FI_DEV_MEM_CLOCK", "%d"),
    ("DCGM_FI_DEV_GPU_UTIL", "%d"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "%d"),
    ("DCGM_FI_DEV_FB_USED", "%d"),
    ("DCGM_FI_DEV_FB_FREE", "%d"),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "%d"),
    ("DCGM_FI_DEV_XID_ERRORS", "%d"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "%d"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "%d"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "%d"),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "%d"),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "%d"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "%d"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "%d"),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "%d"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "%d"),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "%d"),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "%d"),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "%d"),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "%d"),
    ("DCGM_FI_DEV_POWER_VIOLATION", "%d"),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "%d"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "%.3f"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "%.3f"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "%.3f"),
)
NF = len(FIELDS)
(TEMP, MTEMP, POWER, ENERGY, SMCLK, MEMCLK, UTIL, MCU, FBU, FBF, REASONS, XID, PCIE, SBE_V, DBE_V, SBE_A,
 DBE_A, CROW, UROW, PEND, RFAIL, FLIT, DATA, REPLAY, RECOV, PVIOL, TVIOL, GR, TENSOR, DRAM) = range(NF)


def _bits(cols) -> int:
    out = 0
    for c in cols:
        out |= 1 << c
    return out


_CORE = (TEMP, MTEMP, POWER, ENERGY, SMCLK, MEMCLK, UTIL, MCU, FBU, FBF, REASONS, XID, PCIE,
         CROW, UROW, RFAIL)
# Exporter profiles differ per site, as they do when each site owns its dcgm-exporter counters file.
SITE_FIELDS = {
    "phx1": _CORE + (SBE_V, DBE_V, SBE_A, DBE_A, PEND, FLIT, DATA, REPLAY, RECOV, PVIOL, TVIOL,
                     GR, TENSOR, DRAM),
    "dfw2": _CORE + (SBE_V, DBE_V, PEND, FLIT, REPLAY, RECOV, GR, TENSOR),
    "osl1": _CORE + (SBE_V, DBE_V, SBE_A, DBE_A, PEND, FLIT, DATA, REPLAY, RECOV, PVIOL, TVIOL),
}
# Fields DCGM leaves blank right after an exporter restart (watches not yet sampled).
WARMUP_BLANK = _bits((SBE_V, DBE_V, SBE_A, DBE_A, FLIT, DATA, REPLAY, RECOV, GR, TENSOR, DRAM))
# NVML calls that time out when the GSP is wedged.
GSP_BLANK = _bits((TEMP, MTEMP, POWER, SMCLK, MEMCLK, UTIL, MCU, FBU, FBF, GR, TENSOR, DRAM))
# A GPU that fell off the bus: only the XID survives in the last sample.
OFFBUS_BLANK = _bits(c for c in range(NF) if c != XID)

# Clock event reason bits (NVML nvmlClocksEventReason*)
R_IDLE, R_SWPOWER, R_HWSLOW, R_SWTHERM, R_HWTHERM, R_BRAKE = 0x1, 0x4, 0x8, 0x20, 0x40, 0x80

# --------------------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class Model:
    nvml: str  # NVML / dcgm-exporter modelName
    gpn: int  # GPUs per node (HGX) or per compute tray (GB200)
    per_rack: int  # nodes per rack
    tdp: float  # W, catalog TDP (default enforced power limit)
    idle: float  # W at idle
    sm_max: int  # MHz, max boost
    sm_idle: int  # MHz, idle SM clock
    mem_clk: int  # MHz, approximate
    fb: int  # MiB of framebuffer visible to NVML
    fb_res: int  # MiB reserved by the driver
    r_cp: float  # C/W, median die-to-coolant (or die-to-inlet-air) thermal resistance
    r_mem: float  # C/W, median HBM-to-coolant resistance
    t_sw: float  # C, SW thermal slowdown ("max operating")
    t_hw: float  # C, HW slowdown
    t_shut: float  # C, shutdown
    liquid: bool
    hazard: float  # relative per-GPU failure hazard (newer parts: infant mortality)
    cls_mult: tuple[float, ...]  # multipliers on the class shares, CLASSES order


# Resistances are chosen so that a fully loaded GPU sits in the 60s-low 70s C on ~30 C warm water,
# which is what liquid-cooled HGX/NVL72 deployments report; air-cooled A100s run on ~24 C inlet air.
MODELS = {
    "a100": Model("NVIDIA A100-SXM4-80GB", 8, 4, 400, 58, 1410, 210, 1593, 81920, 480,
                  0.085, 0.090, 85, 89, 92, False, 0.9, (0.6, 0.8, 1.4, 1.2, 0.3, 1.0)),
    "h100": Model("NVIDIA H100 80GB HBM3", 8, 4, 700, 72, 1980, 345, 2619, 81559, 562,
                  0.046, 0.050, 87, 90, 92, True, 1.0, (1.3, 1.0, 1.0, 1.0, 0.9, 1.0)),
    "h200": Model("NVIDIA H200", 8, 4, 700, 78, 1980, 345, 3201, 143771, 640,
                  0.045, 0.049, 87, 90, 92, True, 1.0, (1.2, 1.0, 1.0, 1.0, 1.0, 1.0)),
    "b200": Model("NVIDIA B200", 8, 4, 1000, 140, 1965, 390, 3996, 183359, 760,
                  0.036, 0.040, 87, 90, 94, True, 1.2, (1.0, 1.1, 1.0, 1.0, 1.4, 1.1)),
    "gb200": Model("NVIDIA GB200", 4, 18, 1200, 165, 2062, 390, 3996, 189471, 780,
                   0.031, 0.035, 87, 90, 94, True, 1.4, (1.0, 1.4, 1.2, 0.8, 1.2, 1.1)),
}
MODEL_ORDER = ("a100", "h100", "h200", "b200", "gb200")
FLEET_MIX = {"a100": 0.10, "h100": 0.20, "h200": 0.20, "b200": 0.20}  # by GPUs; GB200 takes the rest
MODEL_SITES = {"a100": ("dfw2",), "h100": ("dfw2", "osl1"), "h200": ("osl1", "dfw2"),
               "b200": ("phx1", "osl1"), "gb200": ("phx1", "dfw2")}


@dataclass(frozen=True)
class Site:
    utc: float  # h, standard-time offset (DST ignored)
    supply: float  # C, CDU secondary supply setpoint (warm-water cooling)
    swing: float  # C, diurnal amplitude of the supply (facility water follows outdoor air)
    inlet: float  # C, cold-aisle air for the air-cooled rows


SITES = {
    "phx1": Site(-7, 32.0, 2.2, 24.5),  # desert: warm facility water, large daily swing
    "dfw2": Site(-6, 30.0, 1.3, 23.5),
    "osl1": Site(1, 27.0, 0.5, 22.0),  # cool climate, nearly flat
}


@dataclass(frozen=True)
class FailClass:
    name: str
    share: float  # share of failures before the per-model multipliers
    abrupt: float  # probability that the failure gives no numeric warning
    pre_median_h: float  # precursor length, log-normal median (h)
    pre_sigma: float  # precursor length, log-normal sigma
    replace_p: float  # probability the board is swapped (new UUID) during repair
    tail_min: tuple[float, float]  # minutes the GPU keeps reporting after the failure sample


# Shares follow the published breakdowns loosely (Llama 3: faulty GPU ~30%, HBM3 ~17% of interruptions;
# off-the-bus and GSP faults give no numeric warning, hence their high abrupt shares).
CLASSES = (
    FailClass("hbm_memory", 0.26, 0.30, 18.0, 1.0, 0.70, (2.0, 20.0)),
    FailClass("nvlink", 0.17, 0.40, 8.0, 1.0, 0.30, (2.0, 25.0)),
    FailClass("thermal_cooling", 0.13, 0.25, 30.0, 0.8, 0.45, (0.0, 3.0)),
    FailClass("pcie_bus", 0.16, 0.65, 5.0, 1.0, 0.35, (0.0, 0.0)),
    FailClass("gsp_firmware", 0.14, 0.85, 2.0, 0.9, 0.10, (0.0, 4.0)),
    FailClass("power_vr", 0.14, 0.45, 6.0, 1.0, 0.60, (0.0, 3.0)),
)
HBM, NVL, THERM, PCIEC, GSP, PWR = range(len(CLASSES))
SIGNALS = (  # what a precursor of each class can show, for the labels
    ("ecc_sbe_rate", "row_remap", "xid63", "remap_pending"),
    ("nvlink_crc", "nvlink_replay", "nvlink_recovery"),
    ("temp_per_watt", "thermal_throttle"),
    ("pcie_replay", "missing_samples"),
    ("blank_fields",),
    ("power_brake", "power_noise"),
)

# Background error rates of healthy parts, per hour (most healthy GPUs show zero over two weeks).
BASE_SBE_H = 4e-4
BASE_PCIE_H = 3e-3
BASE_FLIT_H = 4e-3
# Peak precursor rates at strength 1, per hour, at the moment of failure.
HBM_SBE_PEAK_H = 25.0
NVL_FLIT_PEAK_H = 50.0
NVL_REPLAY_PEAK_H = 12.0
NVL_RECOV_PEAK_H = 0.3
PCIE_PEAK_H = 30.0

# --------------------------------------------------------------------------------------------------------
# Planning records


@dataclass
class Node:
    name: str
    site: str
    row: int
    rack: str
    model: str
    gpus: list[int]


@dataclass
class Row:
    name: str
    site: str
    liquid: bool
    nodes: list[int] = field(default_factory=list)


@dataclass
class Job:
    name: str
    flavour: str
    site: str
    nodes: list[int]
    gpus: np.ndarray
    t0: float  # s relative to T0 (may be negative: already running at the start)
    t1: float
    k0: int
    k1: int
    intensity: float  # fraction of the dynamic power range drawn at full activity
    tensor: float
    dram: float
    memcp: float
    fbfrac: float
    ckpt_period: float
    ckpt_dur: float
    eval_period: float
    eval_dur: float
    restarts: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Failure:
    gpu: int
    node: int
    cls: int
    abrupt: bool
    k_fail: int
    k_pre: int | None
    strength: float
    k_stop: int
    k_return: int
    replaced: bool
    fatal_xid: int
    remap_fail: bool
    remaps: list[int] = field(default_factory=list)
    xid92: int | None = None
    sym: list[tuple[int, int]] = field(default_factory=list)
    uuid: str = ""
    new_uuid: str | None = None
    ts: float | None = None


# --------------------------------------------------------------------------------------------------------


class LiquidFleet:
    """Plans a fleet, its operations, failures and traps, then streams the trace chunk by chunk."""

    def __init__(self, seed: int, n_gpus: int, days: float, interval: float, rate: float):
        if n_gpus < 4:
            raise SystemExit("--gpus must be at least 4")
        if interval <= 0 or days <= 0:
            raise SystemExit("--days and --interval must be positive")
        self.rng = np.random.default_rng(seed)
        self.G = n_gpus
        self.days = float(days)
        self.dt = float(interval)
        self.K = int(self.days * 86400 // self.dt)
        if self.K < 10:
            raise SystemExit("trace too short: fewer than 10 sample steps")
        self.rate = rate
        self.t_end = T0 + self.K * self.dt
        self.traps: list[dict] = []
        # node-level intervals (node, a, b[, value]) in steps, [a, b)
        self.iv: dict[str, list] = {k: [] for k in ("down", "gap", "drain", "burn", "cap", "warm")}
        self.node_iv: dict[int, list] = {}
        # GPU-level intervals / points
        self.giv: dict[str, list] = {k: [] for k in ("down", "tail")}
        self.gpt: dict[str, list] = {k: [] for k in ("reset", "replace", "force")}
        self.xid_events: list[tuple[int, int, int]] = []  # (gpu, k, xid)
        self.remap_events: list[tuple[int, int]] = []  # (gpu, k): correctable row remap, sets pending
        self.sbe_windows: list[tuple[int, int, int, float]] = []  # (gpu, a, b, SBE per step)
        self.board_changes: list[tuple[int, int]] = []  # (k, gpu)
        self._build_fleet()
        self._gpu_traits()
        self._plan_coolant()
        self._plan_campaigns()
        self._plan_node_events()
        self._plan_jobs()
        self._plan_failures()
        self._plan_gpu_traps()
        self._plan_job_activity()
        self._plan_app_xids()
        self._initial_state()

    # ---------------------------------------------------------------------------------------------- helpers
    def _k(self, t: float) -> int:
        """Seconds after T0 -> the first step at or after it."""
        return int(math.ceil(t / self.dt - 1e-9))

    def _ts(self, k: int) -> float:
        return round(T0 + k * self.dt, 3)

    def _add_iv(self, kind: str, n: int, a: int, b: int, val: float | None = None) -> None:
        a, b = max(a, 0), min(b, self.K + 1)
        if b <= a:
            return
        self.iv[kind].append((n, a, b) if val is None else (n, a, b, val))
        self.node_iv.setdefault(n, []).append((a, b, kind))

    def _node_busy(self, n: int, k: int, kinds=("down", "gap", "drain", "warm")) -> bool:
        return any(a <= k < b and kind in kinds for a, b, kind in self.node_iv.get(n, ()))

    def _gpu_down(self, g: int, k: int) -> bool:
        return any(gg == g and a <= k < b for gg, a, b in self.giv["down"])

    def _next_reset(self, n: int, k: int) -> int:
        ends = [b for nn, _, b in self.iv["down"] if nn == n and b > k]
        return min(ends) if ends else self.K

    def _uuid(self) -> str:
        h = self.rng.integers(0, 256, 16, dtype=np.uint8).tobytes().hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def _trap(self, kind: str, n: int, g: int | None, a: int, b: int | None = None, **extra) -> None:
        rec = {"kind": "trap", "type": kind, "node": self.nodes[n].name,
               "gpu": None if g is None else int(self.local[g]), "ts": self._ts(a),
               "end_ts": self._ts(min(b if b is not None else a, self.K))}
        rec.update(extra)
        self.traps.append(rec)

    # ---------------------------------------------------------------------------------------------- fleet
    def _build_fleet(self) -> None:
        counts, rem = {}, self.G
        for key in ("a100", "h100", "h200", "b200"):
            c = min(8 * int(round(FLEET_MIX[key] * self.G / 8)), rem)
            counts[key] = c
            rem -= c
        counts["gb200"] = rem
        racks = []  # (site, model, [gpus per node])
        for key in MODEL_ORDER:
            m, c = MODELS[key], counts[key]
            if c <= 0:
                continue
            sizes = [m.gpn] * (c // m.gpn) + ([c % m.gpn] if c % m.gpn else [])
            n_racks = -(-len(sizes) // m.per_rack)
            for i, part in enumerate(np.array_split(np.arange(len(sizes)), n_racks)):
                racks.append((MODEL_SITES[key][i % len(MODEL_SITES[key])], key, [sizes[j] for j in part]))
        self.rows: list[Row] = []
        placed = []
        for site in SITES:
            for liquid in (True, False):
                rs = [r for r in racks if r[0] == site and MODELS[r[1]].liquid == liquid]
                for i in range(0, len(rs), 3):  # three racks per CDU row
                    local = sum(1 for x in self.rows if x.site == site) + 1
                    self.rows.append(Row(f"{site}-row{local:02d}", site, liquid))
                    placed += [(rk, len(self.rows) - 1, j) for j, rk in enumerate(rs[i:i + 3])]
        self.nodes: list[Node] = []
        node_of, local = [], []
        hgx_count: dict[str, int] = {}
        nvl_count: dict[str, int] = {}
        for (site, key, sizes), row, j in placed:
            rack = f"{self.rows[row].name}-rk{j + 1}"
            if key == "gb200":
                nvl_count[site] = nvl_count.get(site, 0) + 1
            for slot, size in enumerate(sizes):
                if key == "gb200":
                    name = f"{site}-nvl{nvl_count[site]:02d}-t{slot + 1:02d}"
                else:
                    hgx_count[site] = hgx_count.get(site, 0) + 1
                    name = f"{site}-gpu{hgx_count[site]:04d}"
                g0 = len(node_of)
                n = len(self.nodes)
                self.nodes.append(Node(name, site, row, rack, key, list(range(g0, g0 + size))))
                self.rows[row].nodes.append(n)
                node_of += [n] * size
                local += list(range(size))
        self.node_of = np.array(node_of)
        self.local = np.array(local)
        mdl = [self.nodes[n].model for n in node_of]
        self.model_of = mdl

        def arr(attr):
            return np.array([getattr(MODELS[m], attr) for m in mdl], dtype=float)

        self.tdp, self.idle = arr("tdp"), arr("idle")
        self.sm_max, self.sm_idle = arr("sm_max"), arr("sm_idle")
        self.mem_clk, self.fb, self.fb_res = arr("mem_clk"), arr("fb"), arr("fb_res")
        self.t_sw, self.t_hw, self.t_shut = arr("t_sw"), arr("t_hw"), arr("t_shut")
        self.liquid = np.array([MODELS[m].liquid for m in mdl])
        self.row_of = np.array([self.nodes[n].row for n in node_of])
        self.present = [_bits(SITE_FIELDS[self.nodes[n].site]) for n in node_of]
        self.rack_nodes: dict[str, list[int]] = {}
        for i, nd in enumerate(self.nodes):
            self.rack_nodes.setdefault(nd.rack, []).append(i)

    def _board(self, g: int, hot: float = 1.0, new_uuid: bool = True) -> None:
        """Draw the per-board physical traits of GPU slot g (also used when a board is replaced)."""
        m = MODELS[self.model_of[g]]
        rng = self.rng
        self.R0[g] = m.r_cp * math.exp(0.07 * rng.standard_normal()) * hot
        self.Rm0[g] = m.r_mem * math.exp(0.08 * rng.standard_normal()) * (1 + 0.6 * (hot - 1))
        self.toff[g] = rng.normal(1.5, 1.2)  # sensor/die hot-spot offset
        self.moff[g] = rng.normal(3.0, 1.5)  # HBM runs a few C above the die
        self.leak[g] = math.exp(0.025 * rng.standard_normal())  # silicon power spread
        if new_uuid:
            self.uuid[g] = self._uuid()

    def _gpu_traits(self) -> None:
        G, rng = self.G, self.rng
        self.R0, self.Rm0, self.toff, self.moff, self.leak = (np.zeros(G) for _ in range(5))
        self.uuid = [""] * G
        for g in range(G):
            self._board(g)
        self.eff = rng.normal(1.0, 0.015, G)  # per-rank work share (pipeline stage imbalance)
        self.node_soff = rng.normal(0.0, 0.35, len(self.nodes))  # manifold position within the row
        self.node_phase = rng.uniform(0.02, 0.85, len(self.nodes)) * self.dt  # scrape phase within a step
        # Exclusive trap GPU sets: these GPUs never fail.
        liquid_ids = [g for g in rng.permutation(G).tolist() if self.liquid[g]]
        n_hot = max(1, round(0.04 * len(liquid_ids))) if liquid_ids else 0
        self.hot = sorted(liquid_ids[:n_hot])
        rest = [g for g in rng.permutation(G).tolist() if g not in set(self.hot)]
        n_lemon = max(1, round(0.015 * self.G))
        n_burst = max(1, round(0.04 * self.G * min(self.days, 28) / 14))
        n_crc = max(1, round(0.03 * self.G))
        self.lemons = sorted(rest[:n_lemon])
        self.burst_gpus = sorted(rest[n_lemon:n_lemon + n_burst])
        self.crc_gpus = sorted(rest[n_lemon + n_burst:n_lemon + n_burst + n_crc])
        self.no_fail = set(self.hot) | set(self.lemons) | set(self.burst_gpus) | set(self.crc_gpus)
        for g in self.hot:  # poor cold-plate contact / TIM, stable for the whole trace
            f = rng.uniform(1.30, 1.55)
            self.R0[g] *= f
            self.Rm0[g] *= 1 + 0.6 * (f - 1)
        self.lemon_rate = np.zeros(G)  # SBE per hour
        for g in self.lemons:
            self.lemon_rate[g] = float(np.clip(rng.lognormal(math.log(12), 0.8), 3, 60))
        self.crc_rate = np.zeros(G)  # CRC flits per hour on a noisy but healthy link
        for g in self.crc_gpus:
            self.crc_rate[g] = float(np.clip(rng.lognormal(math.log(4), 0.9), 0.5, 40))
        self.chatter = np.zeros(G)  # PCIe replays per hour behind a marginal retimer
        n_chat = max(1, round(0.06 * len(self.nodes)))
        self.chatter_nodes = sorted(rng.choice(len(self.nodes), n_chat, replace=False).tolist())
        for n in self.chatter_nodes:
            gl = self.nodes[n].gpus
            if len(gl) >= 4 and rng.random() < 0.6:  # one PCIe switch: 2-4 GPUs
                start = int(rng.integers(0, len(gl) // 2)) * 2
                gl = gl[start:start + int(rng.choice([2, 4]))]
            for g in gl:
                self.chatter[g] = float(np.clip(rng.lognormal(math.log(6), 0.9), 0.5, 40))

    # ---------------------------------------------------------------------------------------------- cooling
    def _plan_coolant(self) -> None:
        rng, K, dt = self.rng, self.K, self.dt
        R = len(self.rows)
        t = np.arange(K + 1) * dt
        phi = math.exp(-dt / 5400.0)  # AR(1) drift with a 90-minute memory
        e = rng.standard_normal((K + 1, R)) * math.sqrt(1 - phi * phi)
        ar = np.empty((K + 1, R))
        x = rng.standard_normal(R)
        for k in range(K + 1):
            x = phi * x + e[k]
            ar[k] = x
        n_days = int(math.ceil(self.days)) + 3
        weather = {s: rng.normal(0, 0.5 * SITES[s].swing + 0.2, n_days) for s in SITES}
        day_mid = (np.arange(n_days) - 1 + 0.5) * 86400
        self.supply = np.empty((R, K + 1), np.float32)
        for r, row in enumerate(self.rows):
            s = SITES[row.site]
            local_h = ((T0 + t) / 3600 + s.utc) % 24
            diurnal = np.cos(2 * np.pi * (local_h - 15.5) / 24)  # peak mid-afternoon local time
            wx = np.interp(t, day_mid, weather[row.site])
            if row.liquid:
                base = s.supply + rng.normal(0, 0.6)
                self.supply[r] = base + s.swing * diurnal + 0.6 * wx + 0.3 * ar[:, r]
            else:
                base = s.inlet + rng.normal(0, 0.5)
                self.supply[r] = base + 0.25 * s.swing * diurnal + 0.15 * wx + 0.4 * ar[:, r]
        liquid_rows = [r for r, row in enumerate(self.rows) if row.liquid]
        # CDU maintenance: pump switchover / filter change -> short supply spike
        for r in liquid_rows:
            for _ in range(rng.poisson(self.days / 8)):
                a = rng.uniform(0, K * dt)
                dur = rng.uniform(15, 50) * 60
                peak = rng.uniform(1.5, 3.5)
                self._bump(r, a, dur, peak, ramp=min(600.0, dur / 3))
                for n in self.rows[r].nodes:
                    self._trap("cdu_maintenance", n, None, self._k(a), self._k(a + dur),
                               row=self.rows[r].name, peak_c=round(peak, 2))
        # Coolant excursions: facility-water trim loss, heat wave -> a whole row hot for hours
        if liquid_rows:
            n_exc = max(1, rng.poisson(self.days * len(liquid_rows) / 60))
            for _ in range(n_exc):
                r = int(rng.choice(liquid_rows))
                a = rng.uniform(0, max(1.0, K * dt - 3600))
                dur = rng.uniform(2, 8) * 3600
                peak = rng.uniform(4.0, 8.5)
                self._bump(r, a, dur, peak, ramp=rng.uniform(20, 45) * 60)
                for n in self.rows[r].nodes:
                    self._trap("coolant_excursion", n, None, self._k(a), self._k(a + dur),
                               row=self.rows[r].name, peak_c=round(peak, 2))
        self.row_onehot = np.zeros((self.G, R))
        self.row_onehot[np.arange(self.G), self.row_of] = 1.0
        self.row_count = np.maximum(self.row_onehot.sum(axis=0), 1)
        self.row_ema = np.full(R, 0.5)

    def _bump(self, r: int, a: float, dur: float, peak: float, ramp: float) -> None:
        t = np.arange(self.K + 1) * self.dt
        up = np.clip((t - a) / ramp, 0, 1)
        down = np.clip((a + dur - t) / ramp, 0, 1)
        self.supply[r] += (peak * np.minimum(up, down)).astype(np.float32)

    # ---------------------------------------------------------------------------------------------- ops
    def _plan_campaigns(self) -> None:
        rng, D = self.rng, self.days
        by_site = {s: [i for i, n in enumerate(self.nodes) if n.site == s] for s in SITES}
        big = max(SITES, key=lambda s: (len(by_site[s]), s))
        camps = [("driver-580.95.05", by_site[big], 0.12, 0.45)]
        gb = [i for i, n in enumerate(self.nodes) if n.model == "gb200"]
        if gb:
            camps.append(("gb200-tray-fw-1.3.2", gb, 0.55, 0.85))
        for name, nodes, fa, fb in camps:
            if not nodes:
                continue
            n_waves = int(min(4, max(1, len(nodes) // 2)))
            fracs = np.array([0.1, 0.2, 0.3, 0.4][:n_waves])
            sizes = np.maximum(1, np.round(fracs / fracs.sum() * len(nodes))).astype(int)
            sizes[-1] = len(nodes) - sizes[:-1].sum()
            days_w = np.floor(np.linspace(fa * D, fb * D, n_waves))
            pos = 0
            for w in range(n_waves):
                for n in nodes[pos:pos + max(0, sizes[w])]:
                    utc = SITES[self.nodes[n].site].utc
                    t_rb = days_w[w] * 86400 + ((1.5 - utc) % 24) * 3600 + rng.uniform(0, 100) * 60
                    t_dr = t_rb - rng.uniform(20, 75) * 60
                    t_up = t_rb + rng.uniform(6, 18) * 60
                    t_end = t_up + rng.uniform(5, 30) * 60
                    if t_end > self.K * self.dt - 600 or t_dr < 0:
                        continue
                    a, rb, up, e = self._k(t_dr), self._k(t_rb), self._k(t_up), self._k(t_end)
                    up = max(up, rb + 1)
                    self._add_iv("drain", n, a, max(e, up + 1))
                    self._add_iv("down", n, rb, up)
                    self._trap("reboot_wave", n, None, a, max(e, up + 1), campaign=name, wave=w + 1,
                               reboot_ts=self._ts(rb), reset_ts=self._ts(up))
                pos += max(0, sizes[w])

    def _plan_node_events(self) -> None:
        rng, K, dt, D = self.rng, self.K, self.dt, self.days
        horizon = K * dt
        for n in range(len(self.nodes)):
            # maintenance drain (idle for hours), half of them end in a reboot
            if rng.random() < min(0.9, 0.2 * D / 14):
                a = rng.uniform(0, horizon - 3600)
                dur = float(np.clip(rng.lognormal(math.log(5 * 3600), 0.5), 2 * 3600, 12 * 3600))
                ka, kb = self._k(a), self._k(a + dur)
                reboot = rng.random() < 0.5
                extra = {}
                if reboot:
                    rb = self._k(a + dur - rng.uniform(10, 20) * 60)
                    up = max(rb + 1, self._k(a + dur - rng.uniform(1, 5) * 60))
                    if up < K and rb > ka:
                        self._add_iv("down", n, rb, up)
                        extra = {"reboot_ts": self._ts(rb), "reset_ts": self._ts(up)}
                self._add_iv("drain", n, ka, kb)
                self._trap("maintenance_drain", n, None, ka, kb, reboot=bool(extra), **extra)
            # scrape gaps
            for _ in range(rng.poisson(0.35 * D / 14)):
                a = rng.uniform(0, horizon)
                dur = float(np.clip(rng.lognormal(math.log(15 * 60), 0.9), 5 * 60, 7200))
                ka, kb = self._k(a), max(self._k(a) + 1, self._k(a + dur))
                self._add_iv("gap", n, ka, kb)
                self._trap("scrape_gap", n, None, ka, kb, scope="node")
            # dcgm-exporter restarts: 1-2 missed scrapes, then one sample with blank watches
            for _ in range(rng.poisson(0.5 * D / 14)):
                ka = int(rng.integers(1, K - 3))
                miss = max(1, int(round(rng.uniform(30, 150) / dt)))
                self._add_iv("gap", n, ka, ka + miss)
                self._add_iv("warm", n, ka + miss, ka + miss + 1)
                self._trap("exporter_restart", n, None, ka, ka + miss + 1)
        # one site-wide Prometheus outage
        site = list(SITES)[int(rng.integers(0, len(SITES)))]
        a = rng.uniform(0.1, 0.9) * horizon
        dur = rng.uniform(20, 50) * 60
        ka, kb = self._k(a), max(self._k(a) + 1, self._k(a + dur))
        for n, nd in enumerate(self.nodes):
            if nd.site == site:
                self._add_iv("gap", n, ka, kb)
                self._trap("scrape_gap", n, None, ka, kb, scope="site")
        # scheduler power caps on a rack (demand response / facility power budget)
        racks = sorted(self.rack_nodes)
        for _ in range(max(1, rng.poisson(max(1.0, D / 4)))):
            rk = racks[int(rng.integers(0, len(racks)))]
            a = rng.uniform(0, horizon - 3600)
            dur = rng.uniform(2, 10) * 3600
            frac = rng.uniform(0.60, 0.82)
            ka, kb = self._k(a), self._k(a + dur)
            for n in self.rack_nodes[rk]:
                self._add_iv("cap", n, ka, kb, frac)
                limit = round(frac * MODELS[self.nodes[n].model].tdp, 1)
                self._trap("power_cap", n, None, ka, kb, limit_w=limit)

    # ---------------------------------------------------------------------------------------------- jobs
    def _plan_jobs(self) -> None:
        rng, dt = self.rng, self.dt
        horizon = self.K * dt
        pools: dict[tuple[str, str], list[int]] = {}
        for i, nd in enumerate(self.nodes):
            pools.setdefault((nd.site, nd.model), []).append(i)
        self.jobs: list[Job] = []
        serial = 0
        sizes = {"pretrain": ("405b", "moe-1t", "70b"), "sft": ("70b", "8b", "32b"), "rl": ("32b", "70b"),
                 "eval": ("70b", "405b"), "serve": ("chat", "code", "embed")}
        for key in sorted(pools):
            nids = [int(x) for x in rng.permutation(pools[key])]
            nb = int(round(0.7 * len(nids))) if len(nids) >= 3 else len(nids)
            blocks = [("big", nids[:nb])] if nb else []
            rest = nids[nb:]
            while rest:
                s = int(rng.integers(1, 4))
                blocks.append(("small", rest[:s]))
                rest = rest[s:]
            for kind, blk in blocks:
                t = -rng.uniform(0, 2.5) * 86400
                while t < horizon:
                    if kind == "big":
                        flav = "pretrain"
                        dur = rng.lognormal(math.log(4 * 86400), 0.45)
                        gap = rng.lognormal(math.log(2 * 3600), 0.9)
                    else:
                        flav = str(rng.choice(["sft", "rl", "eval", "serve"], p=[0.35, 0.25, 0.15, 0.25]))
                        dur = rng.lognormal(math.log(3 * 86400 if flav == "serve" else 9 * 3600), 0.5)
                        gap = rng.lognormal(math.log(3 * 3600), 1.0)
                    if t + dur > 0:
                        serial += 1
                        gpus = np.array([g for n in blk for g in self.nodes[n].gpus])
                        pre = flav in ("pretrain", "rl")
                        job = Job(
                            name=f"{flav}-{rng.choice(sizes[flav])}-{serial:03d}", flavour=flav, site=key[0],
                            nodes=list(blk), gpus=gpus, t0=t, t1=t + dur,
                            k0=max(0, self._k(t)), k1=min(self.K, self._k(t + dur)),
                            intensity=rng.uniform(0.84, 1.04) if pre else rng.uniform(0.6, 0.9),
                            tensor=rng.uniform(0.35, 0.75), dram=rng.uniform(0.25, 0.6),
                            memcp=rng.uniform(0.15, 0.45), fbfrac=rng.uniform(0.72, 0.96),
                            ckpt_period=rng.uniform(20, 90) * 60, ckpt_dur=rng.uniform(60, 420),
                            eval_period=rng.uniform(2, 6) * 3600, eval_dur=rng.uniform(6, 25) * 60)
                        if job.k1 > job.k0:
                            crash_rate = 0.35 if flav == "pretrain" else 0.25  # software crashes per day
                            for _ in range(rng.poisson(crash_rate * (job.k1 - job.k0) * dt / 86400)):
                                job.restarts.append((int(rng.integers(job.k0, job.k1)), "crash"))
                            self.jobs.append(job)
                    t += dur + gap

    def _job_at(self, n: int, k: int) -> Job | None:
        for job in self.jobs:
            if job.k0 <= k < job.k1 and n in job.nodes:
                return job
        return None

    # ---------------------------------------------------------------------------------------------- failures
    def _plan_failures(self) -> None:
        rng, K, dt = self.rng, self.K, self.dt
        n_fail = int(round(self.rate * self.G * self.days / 1000))
        eligible = [g for g in range(self.G) if g not in self.no_fail]
        rack_f = {rk: math.exp(0.3 * rng.standard_normal()) for rk in sorted(self.rack_nodes)}
        w = np.array([MODELS[self.model_of[g]].hazard * (self.R0[g] / MODELS[self.model_of[g]].r_cp) ** 2
                      * rack_f[self.nodes[self.node_of[g]].rack] for g in eligible])
        w /= w.sum()
        base_share = np.array([c.share for c in CLASSES])
        self.failures: list[Failure] = []
        blocks: dict[int, list[tuple[int, int]]] = {}
        last_return: dict[int, int] = {}
        for _ in range(n_fail):
            for _attempt in range(80):
                g = int(eligible[int(rng.choice(len(eligible), p=w))])
                n = int(self.node_of[g])
                share = base_share * np.array(MODELS[self.model_of[g]].cls_mult)
                ci = int(rng.choice(len(CLASSES), p=share / share.sum()))
                c = CLASSES[ci]
                abrupt = bool(rng.random() < c.abrupt)
                k_fail = int(rng.integers(3, K - 1))
                pre_h = None
                k_pre = None
                if not abrupt:
                    pre_h = float(np.clip(rng.lognormal(math.log(c.pre_median_h), c.pre_sigma), 0.5, 96.0))
                    k_pre = k_fail - max(2, int(round(pre_h * 3600 / dt)))
                tail = int(round(rng.uniform(*c.tail_min) * 60 / dt))
                repair_h = float(np.clip(rng.lognormal(math.log(20), 0.8), 2, 144))
                k_stop = k_fail + 1 + tail
                k_return = k_stop + max(1, int(round(repair_h * 3600 / dt)))
                diag = int(round(rng.uniform(10, 25) * 60 / dt)) if rng.random() < 0.6 else 0
                start = k_pre if k_pre is not None else k_fail
                if self._node_busy(n, k_fail, ("down", "gap", "warm")):
                    continue
                if any(not (k_return + diag + 2 < a or b < start - 2) for a, b in blocks.get(n, ())):
                    continue
                if last_return.get(g, -(10**9)) > start:
                    continue
                break
            else:
                continue
            blocks.setdefault(n, []).append((start, k_return + diag))
            last_return[g] = k_return
            replaced = bool(rng.random() < c.replace_p)
            s = float(np.clip(rng.lognormal(0.0, 1.0), 0.05, 8.0)) if not abrupt else 0.0
            f = Failure(gpu=g, node=n, cls=ci, abrupt=abrupt, k_fail=k_fail, k_pre=k_pre, strength=s,
                        k_stop=k_stop, k_return=k_return, replaced=replaced, fatal_xid=0, remap_fail=False)
            if ci == HBM:
                f.fatal_xid = int(rng.choice([48, 94, 95, 140, 64], p=[0.15, 0.35, 0.2, 0.15, 0.15]))
                f.remap_fail = f.fatal_xid == 64
                if not abrupt:
                    for _r in range(rng.poisson(0.6 + 1.2 * math.sqrt(s))):
                        p = rng.random() ** (1 / 3)  # density ~ p^2: remaps cluster near the end
                        f.remaps.append(int(k_pre + p * (k_fail - k_pre)))
                    if s > 1.2:
                        f.xid92 = int(k_pre + rng.uniform(0.75, 0.97) * (k_fail - k_pre))
            elif ci == NVL:
                f.fatal_xid = 74
                self._sympathetic(f)
            elif ci == THERM:
                f.fatal_xid = 79 if rng.random() < 0.35 else 0
            elif ci == PCIEC:
                f.fatal_xid = 79
            elif ci == GSP:
                f.fatal_xid = 119 if rng.random() < 0.7 else 120
            else:
                f.fatal_xid = 62 if rng.random() < 0.55 else 79
            if f.fatal_xid == 79 and f.k_stop > k_fail + 1:  # off the bus: no sample after the XID
                shift = f.k_stop - (k_fail + 1)
                f.k_stop -= shift
                f.k_return -= shift
                k_stop, k_return = f.k_stop, f.k_return
            self.failures.append(f)
            # GPU silent for repair; node drained; node reboots when the GPU returns; optional diag burn-in
            self.giv["tail"].append((g, k_fail + 1, k_stop))
            self.giv["down"].append((g, k_stop, k_return))
            self.gpt["force"].append((g, k_fail))
            rb = max(1, int(round(rng.uniform(3, 12) * 60 / dt)))
            if k_return <= K:
                self.gpt["reset"].append((g, k_return))
                if replaced:
                    self.gpt["replace"].append((g, k_return))
                    self.board_changes.append((k_return, g))
            self._add_iv("drain", n, k_fail + 1, k_return + diag)
            self._add_iv("down", n, k_return - rb, k_return)
            if diag:
                self._add_iv("burn", n, k_return, k_return + diag)
            peers = [p for p in self.nodes[n].gpus if p != g]
            if peers and k_fail + 1 < K:
                self._trap("peer_repair_drain", n, None, k_fail + 1, k_return + diag,
                           failed_gpu=int(self.local[g]),
                           reboot_ts=self._ts(k_return - rb) if k_return - rb < K else None,
                           reset_ts=self._ts(k_return) if k_return < K else None)
            job = self._job_at(n, k_fail)
            if job is not None:
                job.restarts.append((k_fail, "hw"))
        self.failures.sort(key=lambda f: (f.k_fail, f.gpu))
        # uuid at failure time (boards replaced earlier in the trace change it)
        cur = list(self.uuid)
        changes = sorted(self.board_changes)
        new_ids = {}
        for k, g in changes:
            new_ids[(k, g)] = self._uuid()
        self.new_ids = new_ids
        for f in self.failures:
            u = cur[f.gpu]
            for k, g in changes:
                if g == f.gpu and k <= f.k_fail:
                    u = new_ids[(k, g)]
            f.uuid = u
            if f.replaced and (f.k_return, f.gpu) in new_ids:
                f.new_uuid = new_ids[(f.k_return, f.gpu)]

    def _sympathetic(self, f: Failure) -> None:
        """Peers of a failing NVLink port log XID 74 too (same node; for NVL72, other trays of the rack)."""
        rng = self.rng
        nd = self.nodes[f.node]
        peers = [p for p in nd.gpus if p != f.gpu]
        cands = list(rng.permutation(peers)[: int(rng.integers(1, 4))]) if peers else []
        if nd.model == "gb200":
            others = [g for m in self.rack_nodes[nd.rack] if m != f.node for g in self.nodes[m].gpus]
            if others:
                cands += list(rng.permutation(others)[: int(rng.integers(0, 4))])
        for p in cands:
            p = int(p)
            k = f.k_fail + int(rng.integers(0, 2))
            m = int(self.node_of[p])
            if k >= self.K or self._node_busy(m, k) or self._gpu_down(p, k):
                continue
            f.sym.append((p, k))
            self.xid_events.append((p, k, 74))

    # ---------------------------------------------------------------------------------------------- GPU traps
    def _plan_gpu_traps(self) -> None:
        rng, K, dt = self.rng, self.K, self.dt
        for g in self.hot:
            self._trap("hot_healthy", int(self.node_of[g]), g, 0, K, r_factor=round(
                float(self.R0[g] / MODELS[self.model_of[g]].r_cp), 3))
        for g in self.lemons:
            self._trap("ecc_lemon", int(self.node_of[g]), g, 0, K,
                       sbe_per_h=round(float(self.lemon_rate[g]), 2))
        for g in self.crc_gpus:
            self._trap("nvlink_crc_noise", int(self.node_of[g]), g, 0, K,
                       flit_per_h=round(float(self.crc_rate[g]), 2))
        for g in np.flatnonzero(self.chatter).tolist():
            self._trap("pcie_replay_chatter", int(self.node_of[g]), g, 0, K,
                       replay_per_h=round(float(self.chatter[g]), 2))
        for g in self.burst_gpus:
            for _ in range(1 + int(rng.random() < 0.3)):
                a = int(rng.integers(0, K - 2))
                n_steps = max(1, int(round(rng.uniform(10, 90) * 60 / dt)))
                total = float(np.clip(rng.lognormal(math.log(250), 1.0), 20, 8000))
                self.sbe_windows.append((g, a, min(K, a + n_steps), total / n_steps))
                remap = bool(rng.random() < 0.4)
                if remap:
                    km = a + n_steps // 2
                    self.remap_events.append((g, km))
                    self.xid_events.append((g, km, 63))
                self._trap("sbe_burst", int(self.node_of[g]), g, a, a + n_steps,
                           sbe_total=int(total), row_remap=remap)

    # ---------------------------------------------------------------------------------------------- activity
    def _plan_job_activity(self) -> None:
        rng, K, dt = self.rng, self.K, self.dt
        J = max(1, len(self.jobs))
        self.job_act = np.zeros((J, K), np.float32)
        self.job_hang = np.zeros((J, K), bool)
        self.job_int = np.array([j.intensity for j in self.jobs] or [0.0])
        self.job_tensor = np.array([j.tensor for j in self.jobs] or [0.0])
        self.job_dram = np.array([j.dram for j in self.jobs] or [0.0])
        self.job_memcp = np.array([j.memcp for j in self.jobs] or [0.0])
        self.job_fb = np.array([j.fbfrac for j in self.jobs] or [0.0])
        for j, job in enumerate(self.jobs):
            a, b = job.k0, job.k1
            t = np.arange(a, b) * dt
            n = b - a
            if job.flavour == "serve":
                utc = SITES[job.site].utc
                local_h = ((T0 + t) / 3600 + utc) % 24
                d = 0.5 - 0.5 * np.cos(2 * np.pi * (local_h - 4) / 24)  # trough 04:00, peak 16:00 local
                wn = rng.standard_normal(n + 8)
                noise = np.convolve(wn, np.ones(8) / 8, mode="valid")[:n] * 0.12
                act = 0.18 + 0.62 * d + noise
            else:
                act = 0.975 + 0.006 * rng.standard_normal(n)
                rel = t - job.t0
                ck = (rel % job.ckpt_period) < job.ckpt_dur
                act[ck] = rng.uniform(0.03, 0.2, int(ck.sum()))
                ev = ((rel + 0.37 * job.eval_period) % job.eval_period) < job.eval_dur
                act[ev] = 0.55 + 0.05 * rng.standard_normal(int(ev.sum()))
                stall = rng.random(n) < 0.004  # data-loader stalls
                act[stall] *= rng.uniform(0.4, 0.8, int(stall.sum()))
                warm = (rel >= 0) & (rel < rng.uniform(300, 900))
                act[warm] = 0.3
            hang = np.zeros(n, bool)
            for k, kind in sorted(job.restarts):
                tr = k * dt
                if kind == "hw":  # NCCL waits for its timeout: 100% util, no useful work
                    h1 = tr + rng.uniform(5, 30) * 60
                    sl = slice(np.searchsorted(t, tr), np.searchsorted(t, h1))
                    hang[sl] = True
                    act[sl] = 0.0
                    tr = h1
                d1 = tr + rng.uniform(5, 25) * 60
                d2 = d1 + rng.uniform(3, 10) * 60
                act[np.searchsorted(t, tr):np.searchsorted(t, d1)] = 0.0
                act[np.searchsorted(t, d1):np.searchsorted(t, d2)] = 0.3
            self.job_act[j, a:b] = np.clip(act, 0.0, 1.0)
            self.job_hang[j, a:b] = hang
        self.job_frag = [[""] * self.G for _ in range(len(self.jobs) + 1)]
        for j, job in enumerate(self.jobs):
            for rank, g in enumerate(job.gpus.tolist()):
                self.job_frag[j + 1][g] = f',"job":"{job.name}","rank":{rank}'

    def _plan_app_xids(self) -> None:
        rng, K = self.rng, self.K
        for job in self.jobs:
            for k, kind in job.restarts:
                if kind != "crash" or k >= K:
                    continue
                ok = [g for g in job.gpus.tolist()
                      if not self._node_busy(int(self.node_of[g]), k) and not self._gpu_down(g, k)
                      and not any(a <= k < b for gg, a, b in self.giv["tail"] if gg == g)]
                if not ok:
                    continue
                g = int(ok[int(rng.integers(0, len(ok)))])
                xid = int(rng.choice([13, 31, 43], p=[0.45, 0.35, 0.2]))
                self._app_xid(g, k, xid, job.name)
                if rng.random() < 0.5:  # preemptive cleanup on a neighbour of the faulting rank
                    nb = [p for p in self.nodes[int(self.node_of[g])].gpus if p != g and p in ok]
                    for p in rng.permutation(nb)[: int(rng.integers(1, 3))].tolist() if nb else []:
                        self._app_xid(int(p), k, 45, job.name)
        # stale application XIDs left from before the trace started (sticky until the next reboot)
        self.xid0 = np.zeros(self.G)
        for n in range(len(self.nodes)):
            if rng.random() < 0.05:
                g = int(rng.choice(self.nodes[n].gpus))
                xid = int(rng.choice([13, 31, 43, 45]))
                self.xid0[g] = xid
                self._trap("app_xid", n, g, 0, self._next_reset(n, 0), xid=xid, preexisting=True)
        # sympathetic XID 74 traps (known only now that all reboots are planned)
        for f in self.failures:
            for p, k in f.sym:
                n = int(self.node_of[p])
                self._trap("sympathetic_xid74", n, p, k, self._next_reset(n, k),
                           failing_node=self.nodes[f.node].name, failing_gpu=int(self.local[f.gpu]))

    def _app_xid(self, g: int, k: int, xid: int, job: str) -> None:
        n = int(self.node_of[g])
        self.xid_events.append((g, k, xid))
        self._trap("app_xid", n, g, k, self._next_reset(n, k), xid=xid, job=job)

    # ---------------------------------------------------------------------------------------------- t = 0
    def _initial_state(self) -> None:
        rng, G, dt = self.rng, self.G, self.dt
        uptime = np.repeat(rng.uniform(0.5, 45, len(self.nodes)), [len(n.gpus) for n in self.nodes]) * 86400
        agg_sbe = np.where(rng.random(G) < 0.15, rng.poisson(3, G), 0).astype(float)
        agg_sbe += self.lemon_rate * rng.uniform(800, 4000, G)  # lemons have been at it for months
        since_boot = np.round(agg_sbe * rng.uniform(0, 0.3, G)) + self.lemon_rate * uptime / 3600
        vol_sbe = np.minimum(agg_sbe, since_boot)
        agg_sbe = np.maximum(agg_sbe, vol_sbe)
        agg_dbe = np.where(rng.random(G) < 0.01, 1.0, 0.0)
        crow = np.where(rng.random(G) < 0.05, 1.0, 0.0)
        crow += np.where(self.lemon_rate > 0, rng.integers(1, 5, G), 0)
        urow = agg_dbe.copy()
        pcie0 = rng.poisson(BASE_PCIE_H * uptime / 3600) + np.round(self.chatter * uptime / 3600 * 0.8)
        flit0 = rng.poisson(BASE_FLIT_H * uptime / 3600) + np.round(self.crc_rate * uptime / 3600 * 0.8)
        energy0 = uptime * self.tdp * rng.uniform(0.35, 0.7, G) * 1000
        pv0 = np.round(uptime * 1e9 * rng.uniform(0, 0.06, G))
        tv0 = np.round(uptime * 1e9 * rng.uniform(0, 0.002, G))
        pend0 = np.zeros(G)
        # precursors already under way at t = 0 left marks before the trace
        for f in self.failures:
            if f.abrupt or f.k_pre >= 0:
                continue
            g, span = f.gpu, f.k_fail - f.k_pre
            p0 = min(1.0, -f.k_pre / span)
            pp = np.linspace(0, p0, 64)
            hours = -min(f.k_pre, 0) * dt / 3600
            if f.cls == HBM:
                mean = f.strength * HBM_SBE_PEAK_H * hours * np.mean(np.expm1(4 * pp) / math.expm1(4))
                c = rng.poisson(mean)
                vol_sbe[g] += c
                agg_sbe[g] += c
                early = [k for k in f.remaps if k < 0]
                crow[g] += len(early)
                if early:
                    pend0[g] = 1
                    if not self.xid0[g]:
                        self.xid0[g] = 63
            elif f.cls == NVL:
                flit0[g] += rng.poisson(f.strength * NVL_FLIT_PEAK_H * hours * np.mean(pp**2))
            elif f.cls == PCIEC:
                pcie0[g] += rng.poisson(f.strength * PCIE_PEAK_H * hours * np.mean(pp**2))
        self.pend0, self.rfail0 = pend0, np.zeros(G)
        z = np.zeros(G)
        # counter state: [running total, total at last boot, total at board install]
        self.cnt = {
            "energy": [energy0, z.copy(), z.copy()],
            "sbe": [agg_sbe, agg_sbe - vol_sbe, z.copy()],
            "dbe": [agg_dbe, agg_dbe.copy(), z.copy()],
            "pcie": [pcie0.astype(float), z.copy(), z.copy()],
            "flit": [flit0.astype(float), z.copy(), z.copy()],
            "data": [np.round(flit0 * 0.2), z.copy(), z.copy()],
            "replay": [np.round(flit0 * 0.4), z.copy(), z.copy()],
            "recov": [z.copy(), z.copy(), z.copy()],
            "pviol": [pv0, z.copy(), z.copy()],
            "tviol": [tv0, z.copy(), z.copy()],
            "crow": [crow.astype(float), z.copy(), z.copy()],
            "urow": [urow, z.copy(), z.copy()],
        }
        self.R_cur = self.R0.copy()
        self.Rm_cur = self.Rm0.copy()
        self.tmpl = [self._template(g) for g in range(G)]
        self.special: dict[tuple, str] = {}
        self.gen = [0] * G

    # ---------------------------------------------------------------------------------------------- output
    def _template(self, g: int, miss: int = 0, blank: int = 0) -> str:
        nd = self.nodes[int(self.node_of[g])]
        head = (f'{{"ts":%.3f,"node":"{nd.name}","gpu":{int(self.local[g])},"uuid":"{self.uuid[g]}",'
                f'"model":"{MODELS[nd.model].nvml}","rack":"{nd.rack}","site":"{nd.site}","metrics":{{')
        parts, first = [], True
        present = self.present[g] & ~miss
        for i, (name, fmt) in enumerate(FIELDS):
            bit = 1 << i
            if not present & bit:
                parts.append("%.0s")  # consumes the value, prints nothing
                continue
            sep = "" if first else ","
            first = False
            if blank & bit:
                parts.append(f'{sep}"{name}":{FP_BLANK if fmt != "%d" else INT_BLANK}%.0s')
            else:
                parts.append(f'{sep}"{name}":{fmt}')
        return head + "".join(parts) + "}%s}"

    @staticmethod
    def _overlap(items, k0: int, k1: int):
        return [x for x in items if x[2] > k0 and x[1] < k1]

    def generate(self, out_dir: str) -> dict:
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "trace.jsonl.gz")
        q: queue.Queue = queue.Queue(maxsize=6)
        err: list[BaseException] = []

        def writer():  # zlib releases the GIL: compression overlaps with formatting on a second core
            try:
                with open(path, "wb") as fh, gzip.GzipFile(filename="", mode="wb", fileobj=fh, mtime=0,
                                                          compresslevel=5) as gz:
                    while True:
                        item = q.get()
                        if item is None:
                            return
                        gz.write(item)
            except BaseException as e:  # re-raised in the main thread
                err.append(e)
                while q.get() is not None:
                    pass

        th = threading.Thread(target=writer, daemon=True)
        th.start()
        self.n_lines = 0
        C = int(max(16, min(1440, 200_000 // self.G)))
        try:
            for k0 in range(0, self.K, C):
                for blob in self._chunk(k0, min(self.K, k0 + C)):
                    q.put(blob)
                if err:
                    break
        finally:
            q.put(None)
            th.join()
        if err:
            raise err[0]
        self._write_labels(os.path.join(out_dir, "labels.jsonl"))
        return self._summary()

    # ---------------------------------------------------------------------------------------------- chunk
    def _chunk(self, k0: int, k1: int):
        rng, dt = self.rng, self.dt
        C, G, N = k1 - k0, self.G, len(self.nodes)
        ks = np.arange(k0, k1)
        no = self.node_of
        # node rasters
        nr = {k: np.zeros((C, N), bool) for k in ("down", "gap", "drain", "burn", "warm", "reset")}
        ncap = np.ones((C, N))
        for kind in ("down", "gap", "drain", "burn", "warm"):
            for n, a, b, *_ in self._overlap(self.iv[kind], k0, k1):
                nr[kind][max(a, k0) - k0:min(b, k1) - k0, n] = True
        for n, a, b, frac in self._overlap(self.iv["cap"], k0, k1):
            sl = slice(max(a, k0) - k0, min(b, k1) - k0)
            ncap[sl, n] = np.minimum(ncap[sl, n], frac)
        for n, _a, b in self.iv["down"]:
            if k0 <= b < k1:
                nr["reset"][b - k0, n] = True
        gdown = np.zeros((C, G), bool)
        gtail = np.zeros((C, G), bool)
        for name, arr in (("down", gdown), ("tail", gtail)):
            for g, a, b in self._overlap(self.giv[name], k0, k1):
                arr[max(a, k0) - k0:min(b, k1) - k0, g] = True
        gpt = {k: np.zeros((C, G), bool) for k in ("reset", "replace", "force")}
        for kind, pts in self.gpt.items():
            for g, k in pts:
                if k0 <= k < k1:
                    gpt[kind][k - k0, g] = True
        alive = ~(nr["down"][:, no] | gdown)
        reset = (nr["reset"][:, no] | gpt["reset"]) & alive
        replace = gpt["replace"] & alive
        # board swaps inside this chunk: per-row resistances
        R = np.broadcast_to(self.R_cur, (C, G)).copy()
        Rm = np.broadcast_to(self.Rm_cur, (C, G)).copy()
        changes = sorted((k, g) for k, g in self.board_changes if k0 <= k < k1)
        for k, g in changes:
            self._board(g, new_uuid=False)
            R[k - k0:, g] = self.R0[g]
            Rm[k - k0:, g] = self.Rm0[g]
        self.R_cur, self.Rm_cur = R[-1].copy(), Rm[-1].copy()
        # jobs and activity
        jidx = np.full((C, G), -1, np.int32)
        for j, job in enumerate(self.jobs):
            if job.k1 > k0 and job.k0 < k1:
                jidx[max(job.k0, k0) - k0:min(job.k1, k1) - k0, job.gpus] = j
        jidx[nr["drain"][:, no] | gtail | ~alive] = -1
        inj = jidx >= 0
        jc = np.maximum(jidx, 0)
        kk = ks[:, None]
        act = np.where(inj, self.job_act[jc, kk], 0.0)
        hang = inj & self.job_hang[jc, kk]
        act = act * self.eff[None, :] * (1 + 0.01 * rng.standard_normal((C, G)))
        burn = nr["burn"][:, no] & alive & ~gtail
        act = np.clip(np.where(burn, 0.93, act), 0.0, 1.0)
        inten = np.where(inj, self.job_int[jc], 0.95)
        # row heat load nudges the CDU supply (imperfect control loop, ~20 min lag)
        ract = act @ self.row_onehot / self.row_count
        alpha = 1 - math.exp(-dt / 1200)
        ema = np.empty_like(ract)
        x = self.row_ema
        for r in range(C):
            x = x + alpha * (ract[r] - x)
            ema[r] = x
        self.row_ema = x
        liquid_row = np.array([row.liquid for row in self.rows])
        sup = self.supply[:, k0:k1].T + np.where(liquid_row, 1.5, 0.8) * (ema - 0.5)
        S = sup[:, self.row_of] + self.node_soff[no][None, :]
        # counter rates per step
        h = dt / 3600
        busy = 0.3 + 0.7 * act
        sbe_r = (BASE_SBE_H + self.lemon_rate)[None, :] * h * busy
        pcie_r = (BASE_PCIE_H + self.chatter)[None, :] * h * busy
        flit_r = (BASE_FLIT_H + self.crc_rate)[None, :] * h * busy
        replay_r = flit_r * 0.4
        data_r = flit_r * 0.2
        recov_r = np.zeros((C, G))
        for g, a, b, per_step in self.sbe_windows:
            if b > k0 and a < k1:
                sbe_r[max(a, k0) - k0:min(b, k1) - k0, g] += per_step
        brake = np.zeros((C, G), bool)
        pnoise = np.zeros((C, G))
        gmiss = np.zeros((C, G), bool)
        blank = np.zeros((C, G), np.int64)
        active = [f for f in self.failures
                  if (f.k_pre if f.k_pre is not None else f.k_fail) < k1 and f.k_stop > k0]
        for f in active:
            if f.abrupt or f.k_pre >= k1:
                continue
            a, b = max(k0, f.k_pre), min(k1, f.k_fail)
            if a >= b:
                continue
            g, s, sl = f.gpu, f.strength, slice(a - k0, b - k0)
            p = (np.arange(a, b) - f.k_pre) / (f.k_fail - f.k_pre)
            m = len(p)
            if f.cls == HBM:
                shape = np.expm1(4 * p) / math.expm1(4)
                sbe_r[sl, g] += s * HBM_SBE_PEAK_H * h * shape * rng.gamma(0.6, 1 / 0.6, m)
            elif f.cls == NVL:
                flit_r[sl, g] += s * NVL_FLIT_PEAK_H * h * p**2
                data_r[sl, g] += 0.25 * s * NVL_FLIT_PEAK_H * h * p**2
                replay_r[sl, g] += s * NVL_REPLAY_PEAK_H * h * p**2.5
                recov_r[sl, g] += s * NVL_RECOV_PEAK_H * h * p**4
            elif f.cls == THERM:
                s_th = float(np.clip(0.3 * s, 0.05, 1.2))
                R[sl, g] *= 1 + s_th * p**1.6
                Rm[sl, g] *= 1 + 0.5 * s_th * p**1.6
            elif f.cls == PCIEC:
                pcie_r[sl, g] += s * PCIE_PEAK_H * h * p**2
                gmiss[sl, g] = rng.random(m) < np.minimum(0.35, 0.12 * s * p**3)
            elif f.cls == GSP:
                hit = rng.random(m) < np.minimum(0.25, 0.03 * s * p**2)
                for i in np.flatnonzero(hit).tolist():
                    n_cols = int(rng.integers(2, 6))
                    cols = rng.choice([TEMP, MTEMP, POWER, SMCLK, UTIL, FBU, GR], n_cols, replace=False)
                    blank[a - k0 + i, g] |= _bits(cols.tolist())
            elif f.cls == PWR:
                brake[sl, g] = (rng.random(m) < np.minimum(0.4, 0.05 * s * p**2)) & (act[sl, g] > 0.4)
                pnoise[sl, g] = s * 15.0 * p
        # power, thermal, clocks
        idle, tdp = self.idle[None, :], self.tdp[None, :]
        running = (act > 0.01) | hang
        pd = idle + (tdp - idle) * act**0.85 * inten * self.leak[None, :]
        pd = pd * (1 + 0.025 * rng.standard_normal((C, G))) + pnoise * rng.standard_normal((C, G))
        pd = np.where(hang, idle + 0.15 * (tdp - idle), pd)
        pd = np.where(running, pd, idle * (1 + 0.03 * rng.standard_normal((C, G))))
        plim = tdp * ncap[:, no]
        capped = pd > plim * 0.98
        p1 = np.where(capped, plim * (0.975 + 0.02 * rng.random((C, G))), pd)
        toff = self.toff[None, :]
        t_sw = self.t_sw[None, :]
        over = S + R * p1 + toff > t_sw
        p2 = (t_sw + 0.7 - S - toff) / R
        pw = np.where(over, np.maximum(np.minimum(p1, p2), 0.9 * idle), p1)
        pw = np.where(brake, pw * rng.uniform(0.35, 0.7, (C, G)), pw)
        pw = np.maximum(pw, 0.5 * idle)
        temp = S + R * pw + toff + 0.5 * rng.standard_normal((C, G))
        hwt = temp > self.t_hw[None, :]
        dram = np.where(hang, 0.0, np.where(inj, self.job_dram[jc], 0.35) * act)
        mtemp = S + Rm * pw + self.moff[None, :] + 4 * dram + 0.6 * rng.standard_normal((C, G))
        smax = self.sm_max[None, :]
        ratio = np.clip((pw - idle) / np.maximum(pd - idle, 1.0), 0.2, 1.0)
        thr = capped | over | hwt
        clk = np.where(thr, smax * ratio**0.45, smax)
        clk = np.where(brake, clk * 0.55, clk)
        clk = np.where(running, clk, self.sm_idle[None, :])
        clk = smax - 15 * np.round((smax - clk) / 15)
        reasons = (np.where(running, 0, R_IDLE) | np.where(capped, R_SWPOWER, 0)
                   | np.where(over, R_SWTHERM, 0) | np.where(hwt, R_HWTHERM | R_HWSLOW, 0)
                   | np.where(brake, R_BRAKE | R_HWSLOW, 0))
        util = np.where(running, np.clip(np.rint(act * 103 + rng.standard_normal((C, G))), 0, 100), 0)
        util = np.where(hang, 100, util)
        mcu = np.where(util > 0, np.clip(np.rint(util * np.where(inj, self.job_memcp[jc], 0.3)
                                                 + 2 * rng.standard_normal((C, G))), 0, 100), 0)
        fbu = np.where(running, np.where(inj, self.job_fb[jc], 0.6) * self.fb[None, :], 0.0)
        fbu = np.where(running, fbu * (1 + 0.004 * rng.standard_normal((C, G))), 0.0)
        fbf = self.fb[None, :] - self.fb_res[None, :] - fbu
        gr = np.where(hang, 1.0, np.clip(act * 0.99 + 0.01 * rng.standard_normal((C, G)), 0, 1))
        gr = np.where(running, gr, 0.0)
        tensor = np.where(hang, 0.0, np.clip(np.where(inj, self.job_tensor[jc], 0.5) * act
                                              + 0.01 * rng.standard_normal((C, G)), 0, 1))
        tensor = np.where(running, tensor, 0.0)
        dram = np.where(running, np.clip(dram + 0.01 * rng.standard_normal((C, G)), 0, 1), 0.0)
        pv_inc = np.where(capped | brake, dt * 1e9 * rng.uniform(0.4, 1.0, (C, G)), 0.0)
        tv_inc = np.where(over | hwt, dt * 1e9 * rng.uniform(0.3, 1.0, (C, G)), 0.0)
        # events: counters
        inc = {
            "sbe": rng.poisson(sbe_r).astype(float), "pcie": rng.poisson(pcie_r).astype(float),
            "flit": rng.poisson(flit_r).astype(float), "data": rng.poisson(data_r).astype(float),
            "replay": rng.poisson(replay_r).astype(float), "recov": rng.poisson(recov_r).astype(float),
            "dbe": np.zeros((C, G)), "crow": np.zeros((C, G)), "urow": np.zeros((C, G)),
        }
        xev = np.where(reset, -1, 0).astype(np.int64)
        pev = np.where(reset, -1, 0).astype(np.int64)
        rfev = np.where(replace, -1, 0).astype(np.int64)
        for g, k, xid in self.xid_events:
            if k0 <= k < k1:
                xev[k - k0, g] = xid
        for g, k in self.remap_events:
            if k0 <= k < k1:
                inc["crow"][k - k0, g] += 1
                pev[k - k0, g] = 1
        force = gpt["force"] & alive
        for f in active:
            g = f.gpu
            for k in f.remaps:
                if k0 <= k < k1 and k < f.k_fail:
                    inc["crow"][k - k0, g] += 1
                    pev[k - k0, g] = 1
                    xev[k - k0, g] = 63
            if f.xid92 is not None and k0 <= f.xid92 < k1:
                xev[f.xid92 - k0, g] = 92
            if not k0 <= f.k_fail < k1:
                if f.cls == GSP and f.k_fail < k0:
                    tl = slice(max(f.k_fail + 1, k0) - k0, min(f.k_stop, k1) - k0)
                    blank[tl, g] |= GSP_BLANK
                continue
            r = f.k_fail - k0
            xev[r, g] = f.fatal_xid if f.fatal_xid else xev[r, g]
            tl = slice(r + 1, min(f.k_stop, k1) - k0)
            if f.cls == HBM:
                inc["dbe"][r, g] += int(rng.integers(1, 5))
                inc["urow"][r, g] += 1
                pev[r, g] = 1
                if f.remap_fail:
                    rfev[r, g] = 1
            elif f.cls == NVL:
                inc["recov"][r, g] += int(rng.integers(1, 6))
                inc["replay"][r, g] += int(rng.integers(20, 400))
                inc["flit"][r, g] += int(rng.integers(50, 2000))
            elif f.cls == THERM:
                temp[r, g] = self.t_shut[g] - int(rng.integers(0, 3))
                mtemp[r, g] = self.t_shut[g] + int(rng.integers(0, 4))
                reasons[r, g] |= R_SWTHERM | R_HWTHERM | R_HWSLOW
                clk[r, g] = self.sm_max[g] - 15 * round(0.6 * self.sm_max[g] / 15)
                pw[r, g] *= rng.uniform(0.3, 0.6)
                tv_inc[r, g] = dt * 1e9
            elif f.cls == PCIEC:
                blank[r, g] |= OFFBUS_BLANK
            elif f.cls == GSP:
                blank[r, g] |= GSP_BLANK
                blank[tl, g] |= GSP_BLANK
            elif f.cls == PWR:
                pw[r, g] = self.idle[g] * rng.uniform(0.4, 0.8)
                reasons[r, g] |= R_BRAKE | R_HWSLOW
                clk[r, g] = self.sm_idle[g]
                if f.fatal_xid == 79:
                    blank[r, g] |= OFFBUS_BLANK
        # cumulative counters
        en_inc = np.where(alive, pw * dt * 1000, 0.0)
        inc["energy"] = en_inc
        inc["pviol"] = np.where(alive, pv_inc, 0.0)
        inc["tviol"] = np.where(alive, tv_inc, 0.0)
        for key in ("sbe", "pcie", "flit", "data", "replay", "recov", "dbe", "crow", "urow"):
            inc[key] = np.where(alive, inc[key], 0.0)
        vol, agg = {}, {}
        for key, a in inc.items():
            st = self.cnt[key]
            tot = st[0][None, :] + np.cumsum(a, axis=0)
            before = tot - a
            boot = np.maximum.accumulate(np.where(reset, before, st[1][None, :]), axis=0)
            board = np.maximum.accumulate(np.where(replace, before, st[2][None, :]), axis=0)
            st[0], st[1], st[2] = tot[-1].copy(), boot[-1].copy(), board[-1].copy()
            vol[key], agg[key] = tot - boot, tot - board
        xid = self._ffill(xev, self.xid0)
        self.xid0 = xid[-1].astype(float)
        pend = self._ffill(pev, self.pend0)
        self.pend0 = pend[-1].astype(float)
        rfail = self._ffill(rfev, self.rfail0)
        self.rfail0 = rfail[-1].astype(float)
        # what is emitted
        emit = (alive & ~nr["gap"][:, no] & ~gmiss) | force
        blank |= np.where(nr["warm"][:, no], WARMUP_BLANK, 0)
        miss = np.zeros((C, G), np.int64)
        rm = rng.random((C, G)) < 0.0015  # a few samples miss a key or two
        miss[rm] = (1 << rng.integers(0, NF, int(rm.sum()))) | (1 << rng.integers(0, NF, int(rm.sum())))
        rb = (rng.random((C, G)) < 0.002) & ~force  # and a few values come back as DCGM blanks
        blank[rb] |= 1 << rng.integers(0, NF, int(rb.sum()))
        miss = np.where(force, 0, miss)
        jit = rng.uniform(0, min(0.35, 0.1 * dt), (C, N))
        ts = (T0 + ks * dt)[:, None] + (self.node_phase[None, :] + jit)[:, no]
        vals = np.empty((C, G, NF + 1))
        vals[:, :, 0] = ts
        cols = {TEMP: np.rint(temp), MTEMP: np.rint(mtemp), POWER: pw, ENERGY: vol["energy"], SMCLK: clk,
                MEMCLK: np.broadcast_to(self.mem_clk, (C, G)), UTIL: util, MCU: mcu, FBU: np.rint(fbu),
                FBF: np.rint(fbf), REASONS: reasons, XID: xid, PCIE: vol["pcie"], SBE_V: vol["sbe"],
                DBE_V: vol["dbe"], SBE_A: agg["sbe"], DBE_A: agg["dbe"], CROW: agg["crow"], UROW: agg["urow"],
                PEND: pend, RFAIL: rfail, FLIT: vol["flit"], DATA: vol["data"], REPLAY: vol["replay"],
                RECOV: vol["recov"], PVIOL: vol["pviol"], TVIOL: vol["tviol"], GR: gr, TENSOR: tensor,
                DRAM: dram}
        for c, v in cols.items():
            vals[:, :, 1 + c] = v
        for f in active:
            if k0 <= f.k_fail < k1:
                f.ts = round(float(ts[f.k_fail - k0, f.gpu]), 3)
        order = np.argsort(ts, axis=1, kind="stable")
        # format
        lines: list[str] = []
        change_rows: dict[int, list[int]] = {}
        for k, g in changes:
            change_rows.setdefault(k - k0, []).append(g)
        special = (miss | blank) != 0
        jf = self.job_frag
        tm = self.tmpl
        for r in range(C):
            for g in change_rows.get(r, ()):
                self.uuid[g] = self.new_ids[(r + k0, g)]
                tm[g] = self._template(g)
                self.gen[g] += 1
            o = order[r]
            sel = o[emit[r, o]].tolist()
            rows = vals[r].tolist()
            jr = (jidx[r] + 1).tolist()
            sp = special[r]
            if sp.any():
                spl = sp.tolist()
                mr, br = miss[r].tolist(), blank[r].tolist()
                for g in sel:
                    row = rows[g]
                    row.append(jf[jr[g]][g])
                    if spl[g]:
                        key = (g, self.gen[g], mr[g], br[g])
                        t = self.special.get(key)
                        if t is None:
                            t = self.special[key] = self._template(g, mr[g], br[g])
                        lines.append(t % tuple(row))
                    else:
                        lines.append(tm[g] % tuple(row))
            else:
                for g in sel:
                    row = rows[g]
                    row.append(jf[jr[g]][g])
                    lines.append(tm[g] % tuple(row))
            if len(lines) >= 20000 or r == C - 1:
                self.n_lines += len(lines)
                yield ("\n".join(lines) + "\n").encode() if lines else b""
                lines = []

    @staticmethod
    def _ffill(ev: np.ndarray, carry: np.ndarray) -> np.ndarray:
        """Sticky value: ev > 0 sets, ev == -1 clears, 0 keeps (carried across chunks)."""
        C = ev.shape[0]
        idx = np.maximum.accumulate(np.where(ev != 0, np.arange(C)[:, None], -1), axis=0)
        got = np.take_along_axis(ev, np.maximum(idx, 0), axis=0)
        val = np.where(idx >= 0, got, carry[None, :])
        return np.where(val < 0, 0, val)

    # ---------------------------------------------------------------------------------------------- labels
    def _write_labels(self, path: str) -> None:
        out = []
        self.fail_records = []
        for f in self.failures:
            if f.ts is None:  # never observed (should not happen: the sample is forced)
                continue
            nd = self.nodes[f.node]
            pre_ts = None if f.abrupt else round(T0 + f.k_pre * self.dt, 3)
            rec = {"kind": "failure", "ts": f.ts, "node": nd.name, "gpu": int(self.local[f.gpu]),
                   "class": CLASSES[f.cls].name, "abrupt": f.abrupt, "precursor_start_ts": pre_ts,
                   "precursor_h": None if f.abrupt else round((f.ts - pre_ts) / 3600, 4),
                   "uuid": f.uuid, "model": MODELS[nd.model].nvml, "site": nd.site, "rack": nd.rack,
                   "fatal_xid": f.fatal_xid or None, "replaced": f.replaced, "new_uuid": f.new_uuid,
                   "precursor_strength": None if f.abrupt else round(f.strength, 3),
                   "signals": [] if f.abrupt else list(SIGNALS[f.cls]),
                   "stop_ts": self._ts(min(f.k_stop, self.K)),
                   "reset_ts": self._ts(f.k_return) if f.k_return < self.K else None,
                   "repair_h": round((f.k_return - f.k_stop) * self.dt / 3600, 2)}
            if f.cls == HBM:
                rec["remap_failure"] = f.remap_fail
            out.append(rec)
            self.fail_records.append(rec)
        out.sort(key=lambda r: (r["ts"], r["node"], r["gpu"]))
        traps = sorted(self.traps, key=lambda r: (r["ts"], r["node"], -1 if r["gpu"] is None else r["gpu"],
                                                  r["type"]))
        with open(path, "w") as fh:
            for rec in out + traps:
                fh.write(json.dumps(rec) + "\n")

    def _summary(self) -> dict:
        by_cls: dict[str, list[int]] = {}
        for rec in self.fail_records:
            c = by_cls.setdefault(rec["class"], [0, 0])
            c[0 if rec["abrupt"] else 1] += 1
        by_trap: dict[str, int] = {}
        for t in self.traps:
            by_trap[t["type"]] = by_trap.get(t["type"], 0) + 1
        return {"lines": self.n_lines, "gpus": self.G, "nodes": len(self.nodes), "steps": self.K,
                "failures": len(self.fail_records),
                "failures_by_class": {k: {"abrupt": v[0], "precursor": v[1]}
                                      for k, v in sorted(by_cls.items())},
                "traps_by_type": dict(sorted(by_trap.items())), "jobs": len(self.jobs)}


def generate(out_dir: Path | str, seed: int, gpus: int = 256, days: float = 14.0, interval_s: float = 60.0,
             failure_rate: float = 30.0) -> dict:
    """Write ``trace.jsonl.gz`` and ``labels.jsonl`` under ``out_dir``; return a summary."""
    return LiquidFleet(seed, gpus, days, interval_s, failure_rate).generate(str(out_dir))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (trace.jsonl.gz, labels.jsonl)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--interval", type=float, default=60.0, help="scrape interval, seconds")
    ap.add_argument("--failures-per-1000-gpu-days", type=float, default=30.0, dest="rate")
    args = ap.parse_args(argv)
    summary = generate(args.out, args.seed, args.gpus, args.days, args.interval, args.rate)
    json.dump(summary, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
