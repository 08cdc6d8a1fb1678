"""Blind GPU-fleet telemetry generator: a never-trained-on test set for failure predictors.

What it is
----------
A self-contained simulator of dcgm-exporter telemetry for a mixed NVIDIA fleet, with labelled
failures and labelled "traps" (things that look alarming but never end in a failure). It was
written blind of the rest of this repository: it imports nothing from it and shares no code,
constants or modelling choices with any other generator here. Its only contracts are the GPU
sample record of DESIGN.md ("Records") and the DCGM field names shipped with dcgm-exporter.
Numbers come from public material (NVIDIA XID catalogue and datasheets, Meta's Llama 3 report,
the NCSA Delta GPU-resilience study, the OLCF Titan GPU-life data) and from judgement.

What it models
--------------
* Fleet: 8-GPU HGX nodes (H100 SXM, H200, B200, A100 SXM4) and 4-GPU PCIe servers (H100 PCIe,
  L40S, A10) in racks across two sites with different time zones. Each node is scraped on its
  own clock (own phase, a slightly off nominal period, per-scrape jitter; a few nodes scrape at
  half rate), so nodes are not aligned in time.
* Physics per GPU: a workload (multi-hour training jobs with checkpoint dips, diurnal
  inference, batch jobs, idle) drives power through tensor/DRAM activity; power drives
  temperature through a per-GPU thermal resistance on top of a rack inlet temperature with a
  diurnal cycle and a slow random walk; power capping (SwPowerCap), thermal slowdown
  (SwThermal, then HwThermal + HwSlowdown), HW power brake and idle are reported in
  DCGM_FI_DEV_CLOCKS_EVENT_REASONS and feed the power/thermal violation counters.
* Counters: volatile ECC, PCIe replay, NVLink CRC/replay/recovery, energy and violation
  counters are cumulative since boot and reset on every node reboot or GPU reset; aggregate
  ECC and remapped-row counts persist across reboots and only start over on a replaced board,
  which also gets a new UUID. The XID gauge holds the last XID until the driver reloads.
  Row remapping exists on HBM parts only; GDDR parts (L40S, A10) report the memory temperature
  as DCGM's blank sentinel. Some nodes run without the DCP profiling module (no DCGM_FI_PROF_*
  keys at all). Random missing keys, blank sentinels and dropped scrapes at small rates.
* Failures (rate per 1000 GPU-days, drawn towards "frail" and warm GPUs), six classes, each
  with its own precursor shape and a share of abrupt cases with no precursor:
    memory_wearout   SBEs accelerating (gamma-Poisson, exponential ramp) with correctable row
                     remaps + XID 63, late XID 92; ends in DBE, uncorrectable remap, XID 95/48,
                     sometimes remap failure.                         ~4-120 h, 30 % abrupt
    nvlink_flap      bursty CRC flit/data, replay and recovery episodes that get denser,
                     collective slow-down of the whole node, late XID 74; peers log XID 74 at
                     the end.                                         ~1-48 h, 20 % abrupt
    cooling_loss     thermal resistance creeps up (power-law in time): temperature per watt,
                     SwThermal time and clocks degrade; a neighbour warms a little; thermal
                     trip at the end.                                 ~8-120 h, 10 % abrupt
    bus_dropout      PCIe replay bursts, a link down-train (halved PCIe throughput), rising
                     blank reads; falls off the bus (XID 79).         ~0.5-24 h, 55 % abrupt
    gsp_hang         firmware (GSP) RPC time-outs: blanks on slow fields, brief "100 % util at
                     idle power" hangs, a recovered XID 119; ends in XID 119/120 with a hang.
                                                                      ~0.25-6 h, 75 % abrupt
    power_brownout   node PSU trouble: HW power-brake episodes (shared in part by the node's
                     other GPUs), noisy power readings and spikes; ends with XID 79 or silence.
                                                                      ~1-48 h, 30 % abrupt
  A failed GPU stops reporting for a repair window (sometimes with its whole node drained),
  then comes back after a reset or as a replaced board, runs a DCGM diagnostic, and idles.
* Traps: hot_healthy GPUs (badly placed, hot all the time, never fail), ecc_lemon (steady
  SBE trickle), noisy_link (steady NVLink CRC), pcie_chatter (steady replays), benign_sbe_burst
  (one-off burst, often with a row remap + XID 63 and a pending remap that lingers), app_xid
  (13/31/43 on the faulting rank, 45 on the others), stale_xid (a last-XID left from before
  the trace), sympathetic_xid74 / sympathetic_power_brake / sympathetic_heat (neighbours of a
  failing GPU), reboot (single and rolling), scrape_gap (node and site collector outages),
  repair_drain (healthy GPUs silent while a node is repaired), thermal_excursion (rack inlet
  event), power_cap (operator power limit), dcp_blank (profiling fields blank while someone
  profiles).

Output: DIR/trace.jsonl.gz (one GPU sample per line, event-time order, gzip mtime 0) and
DIR/labels.jsonl. Deterministic per seed: one numpy default_rng(seed), no wall clock.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

START_TS = datetime(2026, 5, 4, tzinfo=UTC).timestamp()
BLANK = 9223372036854775794  # DCGM_INT64_BLANK as dcgm-exporter prints it
HOUR = 3600.0
BOARD_C = 6.0  # die-above-inlet offset that does not scale with power (idle GPUs sit ~30 C)
DAY = 86400.0

# --------------------------------------------------------------------------------------------
# Hardware


@dataclass(frozen=True)
class GpuModel:
    name: str  # NVML / dcgm-exporter modelName
    tdp: float
    idle_w: float
    sm_max: int
    sm_idle: int
    mem_clk: int
    mem_clk_idle: int
    mem_mib: int
    reserved_mib: int
    nvlink: bool
    hbm: bool
    per_node: int
    t_load: float  # GPU temperature at TDP with a ~24 C inlet
    t_sw: float  # software thermal slowdown
    t_hw: float  # hardware slowdown
    tens_ref: float  # tensor-pipe activity of a heavy job
    share: float  # share of the fleet's GPUs

    @property
    def r_th(self) -> float:
        return (self.t_load - 24.0 - BOARD_C) / self.tdp


MODELS: tuple[GpuModel, ...] = (
    GpuModel("NVIDIA H100 80GB HBM3", 700, 72, 1980, 345, 2619, 2619, 81559, 613, True, True, 8,
             67, 87, 89, 0.50, 0.31),
    GpuModel("NVIDIA H200", 700, 78, 1980, 345, 3201, 3201, 143771, 621, True, True, 8,
             66, 87, 89, 0.50, 0.15),
    GpuModel("NVIDIA B200", 1000, 140, 1965, 420, 3996, 3996, 183359, 812, True, True, 8,
             63, 85, 88, 0.50, 0.10),
    GpuModel("NVIDIA A100-SXM4-80GB", 400, 58, 1410, 210, 1593, 1593, 81920, 571, True, True, 8,
             63, 85, 88, 0.50, 0.20),
    GpuModel("NVIDIA H100 PCIe", 350, 48, 1755, 345, 1593, 1593, 81559, 613, False, True, 4,
             70, 87, 90, 0.50, 0.07),
    GpuModel("NVIDIA L40S", 350, 36, 2520, 210, 9001, 405, 46068, 567, False, False, 4,
             72, 89, 93, 0.45, 0.10),
    GpuModel("NVIDIA A10", 150, 17, 1695, 210, 6251, 405, 23028, 300, False, False, 4,
             74, 92, 95, 0.40, 0.07),
)

# Slot position -> extra degrees C from airflow order inside a chassis.
SLOT_HEAT = {8: (0.0, 0.6, 1.4, 2.1, 2.9, 3.6, 4.4, 5.3), 4: (0.0, 2.2, 4.1, 6.0)}

SITES = (("dfw1", -5.0, 23.0), ("ams2", 2.0, 21.0))  # name, UTC offset (h), inlet base (C)

# --------------------------------------------------------------------------------------------
# Metric fields: (dcgm field, integer?, group). Groups decide which GPUs report the key.

FIELDS: tuple[tuple[str, bool, str], ...] = (
    ("DCGM_FI_DEV_GPU_TEMP", True, "core"),
    ("DCGM_FI_DEV_MEMORY_TEMP", True, "memtemp"),
    ("DCGM_FI_DEV_POWER_USAGE", False, "core"),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", True, "core"),
    ("DCGM_FI_DEV_SM_CLOCK", True, "core"),
    ("DCGM_FI_DEV_MEM_CLOCK", True, "core"),
    ("DCGM_FI_DEV_GPU_UTIL", True, "core"),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", True, "core"),
    ("DCGM_FI_DEV_FB_USED", True, "core"),
    ("DCGM_FI_DEV_FB_FREE", True, "core"),
    ("DCGM_FI_DEV_FB_RESERVED", True, "core"),
    ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", True, "core"),
    ("DCGM_FI_DEV_POWER_VIOLATION", True, "core"),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", True, "core"),
    ("DCGM_FI_DEV_XID_ERRORS", True, "core"),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", True, "core"),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", True, "core"),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", True, "core"),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", True, "core"),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", True, "core"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", True, "remap"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", True, "remap"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", True, "remap"),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", True, "remap"),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", True, "nvl"),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", True, "nvl"),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", True, "nvl"),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", True, "nvl"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", False, "prof"),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", False, "prof"),
    ("DCGM_FI_PROF_DRAM_ACTIVE", False, "prof"),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", True, "prof"),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", True, "prof"),
)
NF = len(FIELDS)
FI = {name.removeprefix("DCGM_FI_"): i for i, (name, _, _) in enumerate(FIELDS)}
IS_INT = tuple(f[1] for f in FIELDS)
_GAUGE_BLANK = np.array([0.0 if name.endswith(("TOTAL", "COUNTER", "ROWS", "VIOLATION", "CONSUMPTION"))
                         else 1.0 for name, _, _ in FIELDS])
_SLOW_FIELDS = np.array([g == "prof" or n.endswith(("POWER_USAGE", "MEMORY_TEMP", "FB_USED", "FB_FREE"))
                         for n, _, g in FIELDS])
P_MISSING = 0.00018  # per field and sample: key absent from the scrape
P_BLANK = 0.0005  # per gauge field and sample: blank sentinel
P_DROP = 0.0025  # per node scrape: whole scrape lost
GZIP_LEVEL = 3

# --------------------------------------------------------------------------------------------
# Failure classes: precursor median (h), log-sigma, clip low/high (h), share abrupt, replace p

CLASSES: dict[str, tuple[float, float, float, float, float, float]] = {
    "memory_wearout": (30.0, 0.7, 4.0, 120.0, 0.30, 0.7),
    "nvlink_flap": (8.0, 0.8, 1.0, 48.0, 0.20, 0.4),
    "cooling_loss": (36.0, 0.6, 8.0, 120.0, 0.10, 0.3),
    "bus_dropout": (3.0, 0.9, 0.5, 24.0, 0.55, 0.5),
    "gsp_hang": (1.5, 0.7, 0.25, 6.0, 0.75, 0.05),
    "power_brownout": (10.0, 0.8, 1.0, 48.0, 0.30, 0.5),
}
CLASS_MIX = {"memory_wearout": 0.26, "nvlink_flap": 0.16, "cooling_loss": 0.14, "bus_dropout": 0.16,
             "gsp_hang": 0.14, "power_brownout": 0.14}

# --------------------------------------------------------------------------------------------
# Plan structures


@dataclass
class Rack:
    name: str
    site: str
    tz: float
    base: float
    amp: float
    walk_t: np.ndarray
    walk_v: np.ndarray
    excursions: list[tuple[float, float, float]] = field(default_factory=list)

    def inlet(self, ts: np.ndarray) -> np.ndarray:
        local_h = ((ts + self.tz * HOUR) % DAY) / HOUR
        v = self.base + self.amp * np.sin(2 * np.pi * (local_h - 9.0) / 24.0)
        v = v + np.interp(ts, self.walk_t, self.walk_v)
        for t0, t1, d in self.excursions:
            v = v + d * np.clip((ts - t0) / 1200.0, 0, 1) * np.clip((t1 + 2400.0 - ts) / 2400.0, 0, 1)
        return v


@dataclass
class Node:
    idx: int
    name: str
    rack: Rack
    model: GpuModel
    n: int
    gpu0: int
    interval: float
    ts: np.ndarray
    has_prof: bool
    boot_age: float
    reboots: list[tuple[float, float]] = field(default_factory=list)
    gaps: list[tuple[float, float, str]] = field(default_factory=list)
    caps: list[tuple[float, float, float]] = field(default_factory=list)
    dcp: list[tuple[float, float]] = field(default_factory=list)


@dataclass
class Failure:
    gpu: int
    cls: str
    t_fail: float
    t_pre: float | None
    amp: float
    repair: float
    replaced: bool
    drain: bool
    drain_delay: float


@dataclass
class Plan:
    nodes: list[Node]
    gpu_node: np.ndarray
    gpu_local: np.ndarray
    uuids: list[list[str]]
    failures: list[Failure]
    hot: dict[int, float]
    lemon: dict[int, float]
    noisy: dict[int, float]
    chatter: dict[int, float]
    stale: dict[int, int]
    bursts: list[tuple[int, float, bool]]
    t_end: float


# --------------------------------------------------------------------------------------------
# Small helpers


def _uuid(rng: np.random.Generator) -> str:
    h = rng.bytes(16).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _lognorm_s(rng: np.random.Generator, median_h: float, sigma: float, lo_h: float, hi_h: float) -> float:
    return float(np.clip(median_h * math.exp(sigma * rng.standard_normal()), lo_h, hi_h)) * HOUR


def _cum_reset(inc: np.ndarray, reset: np.ndarray, init: np.ndarray) -> np.ndarray:
    """Cumulative sum along the last axis that restarts at each True in reset (row-wise)."""
    out = np.empty(inc.shape, dtype=np.float64)
    for j in range(inc.shape[0]):
        c = np.cumsum(inc[j], dtype=np.float64)
        starts = np.flatnonzero(reset[j])
        seg = np.cumsum(reset[j])
        base = np.concatenate(([0.0], c[starts] - inc[j, starts]))
        o = c - base[seg]
        o[seg == 0] += init[j]
        out[j] = o
    return out


def _hold(mark: np.ndarray, val: np.ndarray, init: np.ndarray) -> np.ndarray:
    """Value at the latest mark at or before each slot (row-wise), init before the first mark."""
    n, t = mark.shape
    idx = np.where(mark, np.arange(t)[None, :], -1)
    last = np.maximum.accumulate(idx, axis=1)
    got = np.take_along_axis(val, np.maximum(last, 0), axis=1)
    return np.where(last >= 0, got, init[:, None]).astype(np.float64)


def _episodes(rng: np.random.Generator, p: np.ndarray, max_len: int) -> np.ndarray:
    """Boolean activity from episode starts with probability p per slot, each 1..max_len slots."""
    starts = rng.random(p.size) < p
    d = int(rng.integers(1, max_len + 1))
    if not starts.any():
        return starts
    return np.convolve(starts.astype(np.float64), np.ones(d))[: p.size] > 0.5


# --------------------------------------------------------------------------------------------
# Planning


def _pick_layout(rng: np.random.Generator, gpus: int) -> list[tuple[GpuModel, int]]:
    shares = np.array([m.share for m in MODELS])
    # A node type's draw probability so that GPU shares come out roughly as intended.
    w = shares / np.array([m.per_node for m in MODELS])
    w = w / w.sum()
    first = list(rng.choice(len(MODELS), size=3, replace=False, p=w))
    out: list[tuple[GpuModel, int]] = []
    left = gpus
    while left > 0:
        k = first.pop(0) if first else int(rng.choice(len(MODELS), p=w))
        m = MODELS[k]
        take = min(m.per_node, left)
        out.append((m, take))
        left -= take
    return out


def _plan(rng: np.random.Generator, gpus: int, days: float, interval: float, rate: float) -> Plan:
    t0 = START_TS
    t1 = START_TS + days * DAY
    layout = _pick_layout(rng, gpus)
    layout.sort(key=lambda x: (MODELS.index(x[0]), -x[1]))
    # Racks: homogeneous, 4 HGX nodes or 8 PCIe servers per rack; racks spread over two sites.
    racks: list[Rack] = []
    nodes: list[Node] = []
    rack_fill = 0
    rack_cap = 0
    cur_model: GpuModel | None = None
    rack_no = {s[0]: 0 for s in SITES}
    grid = np.arange(t0 - HOUR, t1 + 2 * HOUR, 900.0)
    rho = math.exp(-900.0 / (4 * HOUR))
    gpu0 = 0
    for m, take in layout:
        if cur_model is not m or rack_fill >= rack_cap:
            site, tz, base = SITES[len(racks) % 2] if rng.random() < 0.8 else SITES[rng.integers(2)]
            rack_no[site] += 1 + int(rng.integers(0, 3))
            walk = np.empty(grid.size)
            walk[0] = rng.normal(0, 0.6)
            eps = rng.normal(0, 0.6 * math.sqrt(1 - rho * rho), grid.size)
            for i in range(1, grid.size):
                walk[i] = rho * walk[i - 1] + eps[i]
            racks.append(Rack(f"{site}-r{rack_no[site]:02d}", site, tz, base + rng.normal(0, 1.3),
                              rng.uniform(0.8, 2.2), grid, walk))
            cur_model = m
            rack_fill = 0
            rack_cap = 4 if m.per_node == 8 else 8
        rack = racks[-1]
        unit = 3 + rack_fill * (5 if m.per_node == 8 else 2)
        rack_fill += 1
        ivl = interval * (1.0 + rng.uniform(-0.004, 0.004))
        if rng.random() < 0.06:
            ivl *= 2.0  # a node scraped at half rate
        phase = rng.uniform(0, ivl)
        nmax = int((t1 - t0 - phase) / ivl) + 2
        k = np.arange(nmax)
        jit = np.clip(rng.normal(0, 0.004 * ivl + 0.25, nmax), -0.2 * ivl, 0.2 * ivl)
        ts = t0 + phase + k * ivl + jit
        ts = np.round(ts[(ts >= t0) & (ts < t1)], 3)
        nodes.append(Node(len(nodes), f"{rack.name}u{unit:02d}", rack, m, take, gpu0, ivl, ts,
                          bool(rng.random() > 0.1), rng.uniform(2, 90) * DAY))
        gpu0 += take
    G = gpu0
    gpu_node = np.concatenate([np.full(nd.n, nd.idx) for nd in nodes])
    gpu_local = np.concatenate([np.arange(nd.n) for nd in nodes])
    uuids = [[_uuid(rng)] for _ in range(G)]
    heat = np.array([SLOT_HEAT[8 if nodes[gpu_node[g]].model.per_node == 8 else 4][gpu_local[g]]
                     for g in range(G)])
    nvl = np.array([nodes[gpu_node[g]].model.nvlink for g in range(G)])

    # Persistent traps (these GPUs never fail).
    taken: set[int] = set()

    def pick(count: int, weights: np.ndarray) -> list[int]:
        w = weights.astype(np.float64).copy()
        w[list(taken)] = 0.0
        count = min(count, int((w > 0).sum()))
        if count <= 0:
            return []
        sel = rng.choice(G, size=count, replace=False, p=w / w.sum())
        taken.update(int(s) for s in sel)
        return [int(s) for s in sel]

    hot = {g: rng.uniform(10.0, 17.0) for g in pick(max(2, round(0.035 * G)), 0.5 + heat)}
    lemon = {g: rng.uniform(3.0, 40.0) for g in pick(max(1, round(0.015 * G)), np.ones(G))}
    noisy = {g: float(np.clip(60.0 * math.exp(0.8 * rng.standard_normal()), 8, 600))
             for g in pick(max(1, round(0.025 * nvl.sum())) if nvl.any() else 0, nvl.astype(float))}
    chatter = {g: rng.uniform(2.0, 30.0) for g in pick(max(1, round(0.015 * G)), np.ones(G))}

    # Failures.
    frailty = rng.lognormal(0.0, 0.7, G) * (1.0 + 0.06 * heat)
    frailty[list(taken)] = 0.0
    busy: dict[int, list[tuple[float, float]]] = {}
    node_block: dict[int, list[tuple[float, float]]] = {}
    failures: list[Failure] = []
    n_fail = int(rng.poisson(rate * G * days / 1000.0))
    names = list(CLASS_MIX)

    def overlaps(iv: list[tuple[float, float]], a: float, b: float) -> bool:
        return any(a < y and x < b for x, y in iv)

    for _ in range(n_fail if frailty.sum() > 0 else 0):
        for _attempt in range(80):
            g = int(rng.choice(G, p=frailty / frailty.sum()))
            nd = nodes[gpu_node[g]]
            m = nd.model
            cw = np.array([CLASS_MIX[c] for c in names])
            mult = {"memory_wearout": 1.4 if m.name in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA B200")
                    else (0.9 if m.hbm else 0.6),
                    "nvlink_flap": 1.0 if m.nvlink else 0.0,
                    "cooling_loss": 1.3 if not m.hbm else (0.8 if m.name == "NVIDIA B200" else 1.0)}
            cw = cw * np.array([mult.get(c, 1.0) for c in names])
            cls = names[int(rng.choice(len(names), p=cw / cw.sum()))]
            med, sig, lo, hi, p_abrupt, p_repl = CLASSES[cls]
            abrupt = bool(rng.random() < p_abrupt)
            t_fail = float(rng.uniform(t0 + HOUR, t1 - 2 * interval))
            t_pre = None if abrupt else t_fail - _lognorm_s(rng, med, sig, lo, hi)
            repair = _lognorm_s(rng, 20.0, 0.8, 2.0, 168.0)
            w0 = (t_pre if t_pre is not None else t_fail) - 6 * HOUR
            w1 = t_fail + repair + 6 * HOUR
            if overlaps(busy.get(g, []), w0, w1) or overlaps(node_block.get(nd.idx, []), w0, w1):
                continue
            drain = bool(rng.random() < 0.4)
            peers = range(nd.gpu0, nd.gpu0 + nd.n)
            if drain and any(overlaps(busy.get(p, []), t_fail - 6 * HOUR, w1) for p in peers if p != g):
                drain = False
            busy.setdefault(g, []).append((w0, w1))
            if drain:
                node_block.setdefault(nd.idx, []).append((t_fail, w1))
            failures.append(Failure(g, cls, t_fail, t_pre, float(np.clip(rng.lognormal(0, 0.7), 0.12, 3.0)),
                                    repair, bool(rng.random() < p_repl), drain,
                                    float(rng.uniform(0.2, 2.0)) * HOUR))
            break
    failures.sort(key=lambda f: f.t_fail)
    failing = {f.gpu for f in failures}

    # Event traps.
    ok = np.array([g not in failing and g not in taken for g in range(G)], dtype=float)
    stale = {}
    for g in np.flatnonzero(ok):
        if rng.random() < 0.07:
            stale[int(g)] = int(rng.choice([13, 31, 43, 45, 63, 94], p=[0.25, 0.25, 0.15, 0.2, 0.1, 0.05]))
    bursts = []
    for _ in range(int(rng.poisson(8.0 * G * days / 1000.0))):
        if ok.sum() == 0:
            break
        g = int(rng.choice(G, p=ok / ok.sum()))
        bursts.append((g, float(rng.uniform(t0, t1)), bool(rng.random() < 0.45)))
    for nd in nodes:
        for _ in range(int(rng.poisson(days / 12.0))):
            nd.reboots.append((float(rng.uniform(t0, t1)), rng.uniform(4, 20) * 60))
        for _ in range(int(rng.poisson(days / 8.0))):
            a = float(rng.uniform(t0, t1))
            nd.gaps.append((a, a + _lognorm_s(rng, 0.6, 0.9, 0.1, 6.0), "node"))
        for _ in range(int(rng.poisson(days / 40.0))):
            a = float(rng.uniform(t0, t1))
            nd.caps.append((a, a + rng.uniform(2, 24) * HOUR, rng.uniform(0.55, 0.8)))
        if nd.has_prof:
            for _ in range(int(rng.poisson(days / 15.0))):
                a = float(rng.uniform(t0, t1))
                nd.dcp.append((a, a + rng.uniform(5, 60) * 60))
    if days >= 2 and rng.random() < 0.6:  # rolling driver-update reboot wave
        tw = t0 + rng.uniform(0.3, 0.9) * days * DAY
        for i, k in enumerate(rng.permutation(len(nodes))):
            nodes[k].reboots.append((tw + i * rng.uniform(8, 15) * 60, rng.uniform(6, 14) * 60))
    if rng.random() < 0.5:  # collector outage at one site
        site = SITES[int(rng.integers(2))][0]
        a = float(rng.uniform(t0, t1))
        b = a + rng.uniform(15, 60) * 60
        for nd in nodes:
            if nd.rack.site == site:
                nd.gaps.append((a, b, "site"))
    for r in racks:
        for _ in range(int(rng.poisson(days / 25.0))):
            a = float(rng.uniform(t0, t1))
            r.excursions.append((a, a + rng.uniform(1, 4) * HOUR, rng.uniform(5, 11)))
    return Plan(nodes, gpu_node, gpu_local, uuids, failures, hot, lemon, noisy, chatter, stale, bursts, t1)


# --------------------------------------------------------------------------------------------
# Workload

_IDLE, _TRAIN, _INFER, _BATCH, _SPLIT = range(5)
_SXM_TABLE = ((_TRAIN, 0.55, 9.0, 0.9), (_INFER, 0.12, 6.0, 0.8), (_IDLE, 0.20, 1.2, 1.0),
              (_SPLIT, 0.13, 4.0, 0.8))
_GPU_TABLE = ((_INFER, 0.45, 5.0, 0.9), (_BATCH, 0.25, 2.0, 0.9), (_IDLE, 0.30, 1.5, 1.0))


@dataclass
class Work:
    u: np.ndarray
    tens: np.ndarray
    dram: np.ndarray
    fbf: np.ndarray
    rx: np.ndarray
    crashes: list[tuple[int, int, int]]  # slot, local gpu, xid
    idle_after: list[tuple[int, int, int]]  # local gpu (-1 all), slot from, slot to


def _schedule(rng: np.random.Generator, ts: np.ndarray, tz: float, table: tuple) -> dict[str, np.ndarray]:
    kinds = np.array([r[0] for r in table])
    probs = np.array([r[1] for r in table])
    probs = probs / probs.sum()
    starts: list[float] = []
    ks: list[int] = []
    t = ts[0] - rng.uniform(0, 8) * HOUR
    prev = -1
    while t <= ts[-1]:
        i = int(rng.choice(len(table), p=probs))
        if kinds[i] == prev == _IDLE:
            continue
        starts.append(t)
        ks.append(int(kinds[i]))
        t += _lognorm_s(rng, table[i][2], table[i][3], 0.2, 72.0)
        prev = kinds[i]
    st = np.array(starts)
    kd = np.array(ks)
    ends = np.append(st[1:], t)
    S = st.size
    lvl = np.select([kd == _TRAIN, kd == _INFER, kd == _BATCH],
                    [rng.uniform(0.94, 0.995, S), rng.uniform(0.25, 0.65, S), rng.uniform(0.6, 0.95, S)], 0.0)
    tf = np.select([kd == _TRAIN, kd == _INFER, kd == _BATCH],
                   [rng.uniform(0.3, 0.62, S), rng.uniform(0.08, 0.35, S), rng.uniform(0.15, 0.45, S)], 0.0)
    df = np.select([kd == _TRAIN, kd == _INFER, kd == _BATCH],
                   [rng.uniform(0.25, 0.6, S), rng.uniform(0.15, 0.45, S), rng.uniform(0.2, 0.6, S)], 0.0)
    fb = np.select([kd == _TRAIN, kd == _INFER, kd == _BATCH],
                   [rng.uniform(0.7, 0.97, S), rng.uniform(0.35, 0.9, S), rng.uniform(0.4, 0.9, S)], 0.0)
    rxm = np.select([kd == _TRAIN, kd == _INFER, kd == _BATCH], [8e8, 1.5e8, 1.2e9], 2e4)
    rxm = rxm * rng.lognormal(0, 0.6, S)
    period = rng.uniform(1800, 7200, S)
    dip = rng.uniform(60, 400, S)
    amp = rng.uniform(0.2, 0.6, S)
    crash_p = np.select([kd == _TRAIN, kd == _INFER, kd == _BATCH], [0.12, 0.03, 0.06], 0.0)
    crash = rng.random(S) < crash_p

    seg = np.searchsorted(st, ts, side="right") - 1
    kind = kd[seg]
    off = ts - st[seg]
    T = ts.size
    u = lvl[seg].copy()
    tens = tf[seg].copy()
    dram = df[seg].copy()
    tr = kind == _TRAIN
    dipm = tr & ((off % period[seg]) < dip[seg])
    ramp = tr & (off < 300)
    u[dipm] *= rng.uniform(0.05, 0.3, int(dipm.sum()))
    tens[dipm] *= 0.05
    dram[dipm] *= 0.3
    u[ramp] *= 0.35
    tens[ramp] *= 0.2
    inf = kind == _INFER
    local_h = ((ts + tz * HOUR) % DAY) / HOUR
    d = 1.0 + amp[seg] * np.sin(2 * np.pi * (local_h - 14.0) / 24.0)
    jit = rng.lognormal(0, 0.25, T)
    u = np.where(inf, np.clip(lvl[seg] * d * jit, 0.0, 1.0), u)
    tens = np.where(inf, tf[seg] * u, tens)
    dram = np.where(inf, df[seg] * u, dram)
    bt = kind == _BATCH
    u = np.where(bt, lvl[seg] * rng.uniform(0.85, 1.0, T), u)
    rx = rxm[seg] * np.maximum(u, 0.01) * rng.lognormal(0, 0.3, T)
    fbf = fb[seg] * np.where(kind == _IDLE, 0.0, 1.0)
    # Crash at the last slot of a crashing segment.
    crash_slots = []
    for i in np.flatnonzero(crash):
        k = int(np.searchsorted(ts, ends[i])) - 1
        if 0 <= k < T and ts[k] >= st[i]:
            crash_slots.append((k, int(np.searchsorted(ts, ends[i] + rng.uniform(10, 60) * 60))))
    return {"u": u, "tens": tens, "dram": dram, "fbf": fbf, "rx": rx, "kind": kind, "crash": crash_slots}


def _workload(rng: np.random.Generator, nd: Node) -> Work:
    ts = nd.ts
    n, T = nd.n, ts.size
    tz = nd.rack.tz
    per = [_schedule(rng, ts, tz, _GPU_TABLE) for _ in range(n)]
    crashes: list[tuple[int, int, int]] = []
    idle_after: list[tuple[int, int, int]] = []
    app = [13, 31, 43]
    app_p = [0.35, 0.35, 0.3]
    if nd.model.per_node == 8:
        base = _schedule(rng, ts, tz, _SXM_TABLE)
        split = base["kind"] == _SPLIT
        stage = rng.uniform(0.9, 1.06, (n, 1))

        def mix(key: str, noise: float) -> np.ndarray:
            shared = base[key][None, :] * (stage if key == "tens" else 1.0)
            shared = shared + rng.normal(0, noise, (n, T)) * (shared > 0)
            own = np.stack([p[key] for p in per])
            return np.where(split[None, :], own, shared)

        u, tens, dram = mix("u", 0.006), mix("tens", 0.01), mix("dram", 0.01)
        fbf, rx = mix("fbf", 0.002), mix("rx", 0.0)
        for k, k_end in base["crash"]:
            if split[k]:
                continue
            bad = int(rng.integers(n))
            crashes.append((k, bad, int(rng.choice(app, p=app_p))))
            for j in range(n):
                if j != bad and rng.random() < 0.6:
                    crashes.append((k, j, 45))
            idle_after.append((-1, k + 1, k_end))
        for j, p in enumerate(per):
            for k, k_end in p["crash"]:
                if split[k]:
                    crashes.append((k, j, int(rng.choice(app, p=app_p))))
                    idle_after.append((j, k + 1, k_end))
    else:
        u = np.stack([p["u"] for p in per])
        tens = np.stack([p["tens"] for p in per])
        dram = np.stack([p["dram"] for p in per])
        fbf = np.stack([p["fbf"] for p in per])
        rx = np.stack([p["rx"] for p in per])
        for j, p in enumerate(per):
            for k, k_end in p["crash"]:
                crashes.append((k, j, int(rng.choice(app, p=app_p))))
                idle_after.append((j, k + 1, k_end))
    clip = (np.clip(u, 0, 1), np.clip(tens, 0, 1), np.clip(dram, 0, 1), np.clip(fbf, 0, 0.99))
    return Work(*clip, np.maximum(rx, 0), crashes, idle_after)


# --------------------------------------------------------------------------------------------
# Per-node simulation


@dataclass
class State:
    """(n, T) arrays of one node: workload, modifiers, counter increments, events."""

    n: int
    T: int

    def __post_init__(self) -> None:
        z = (self.n, self.T)
        self.rmult = np.ones(z)
        self.tadd = np.zeros(z)
        self.umult = np.ones(z)
        self.pcie_mult = np.ones(z)
        self.psd = np.zeros(z)
        self.blankp = np.zeros(z)
        self.limit_f = np.ones(z)
        self.brake = np.zeros(z, bool)
        self.hang = np.zeros(z, bool)
        self.pspike = np.zeros(z, bool)
        self.blank_all = np.zeros(z, bool)
        self.present = np.ones(z, bool)
        self.reset = np.zeros(z, bool)
        self.replace = np.zeros(z, bool)
        self.epoch = np.zeros(z, np.int64)
        self.xid = np.zeros(z, np.int64)
        self.pend = np.zeros(z, bool)
        self.rfail = np.zeros(z, bool)
        for c in ("sbe", "dbe", "flit", "crcd", "rply", "recov", "pcie", "corr", "unc"):
            setattr(self, c, np.zeros(z))

    def idle(self, w: Work, j: int | slice, a: int, b: int) -> None:
        for arr in (w.u, w.tens, w.dram, w.fbf):
            arr[j, a:b] = 0.0
        w.rx[j, a:b] = 2e4

    def diag(self, w: Work, j: int, a: int, b: int) -> None:
        w.u[j, a:b] = 1.0
        w.tens[j, a:b] = 0.85
        w.dram[j, a:b] = 0.75
        w.fbf[j, a:b] = 0.9
        w.rx[j, a:b] = 3e9


def _simulate_node(rng: np.random.Generator, plan: Plan, nd: Node) -> tuple[dict[str, Any], list[dict]]:
    m = nd.model
    ts = nd.ts
    n, T = nd.n, ts.size
    dt = np.empty(T)
    dt[0] = nd.interval
    dt[1:] = np.diff(ts)
    labels: list[dict] = []
    st = State(n, T)
    w = _workload(rng, nd)
    gl = list(range(nd.gpu0, nd.gpu0 + n))
    node_fails = [f for f in plan.failures if plan.gpu_node[f.gpu] == nd.idx]

    def slot(t: float) -> int:
        return int(np.searchsorted(ts, t))

    def tsr(k: int) -> float:
        return round(float(ts[min(max(k, 0), T - 1)]), 3)

    def trap(kind: str, gpu: int | None, k: int) -> None:
        labels.append({"kind": "trap", "type": kind, "node": nd.name, "gpu": gpu, "ts": tsr(k)})

    def fails_soon(j: int, k: int, horizon: float = 48 * HOUR) -> bool:
        t = ts[min(k, T - 1)]
        return any(f.gpu == gl[j] and t - 6 * HOUR <= f.t_fail <= t + horizon for f in node_fails)

    # Node-level operations.
    st.present[:, rng.random(T) < P_DROP] = False
    for t, dur in nd.reboots:
        k0, k1 = slot(t), slot(t + dur)
        if k0 >= T:
            continue
        st.present[:, k0:k1] = False
        if k1 < T:
            st.reset[:, k1] = True
            st.idle(w, slice(None), k1, slot(t + dur + rng.uniform(5, 40) * 60))
        trap("reboot", None, k0)
    for a, b, _why in nd.gaps:
        k0, k1 = slot(a), slot(b)
        if k0 < T and k1 > k0:
            st.present[:, k0:k1] = False
            trap("scrape_gap", None, k0)
    for a, b, f in nd.caps:
        k0, k1 = slot(a), slot(b)
        if k0 < T:
            st.limit_f[:, k0:k1] = f
            trap("power_cap", None, k0)
    dcp = np.zeros(T, bool)
    for a, b in nd.dcp:
        k0, k1 = slot(a), slot(b)
        if k0 < T:
            dcp[k0:k1] = True
            trap("dcp_blank", None, k0)
    for a, _b, _d in nd.rack.excursions:
        k0 = slot(a)
        if k0 < T:
            trap("thermal_excursion", None, k0)
    for j, k0, k1 in w.idle_after:
        st.idle(w, slice(None) if j < 0 else j, k0, k1)

    # Background error processes and persistent traps.
    hrs = dt / HOUR
    for j, g in enumerate(gl):
        if rng.random() < (0.12 if m.hbm else 0.05):
            st.sbe[j] += rng.poisson(rng.lognormal(math.log(0.05), 1.0) * hrs)
        if m.nvlink and rng.random() < 0.25:
            st.flit[j] += rng.poisson(rng.lognormal(math.log(0.2), 1.0) * hrs)
        if rng.random() < 0.2:
            st.pcie[j] += rng.poisson(rng.lognormal(math.log(0.05), 1.0) * hrs)
        if g in plan.lemon:
            lam = plan.lemon[g] * hrs
            st.sbe[j] += rng.poisson(rng.gamma(2.0, lam / 2.0))
            trap("ecc_lemon", j, 0)
        if g in plan.noisy:
            lam = plan.noisy[g] * hrs * rng.lognormal(0, 0.5, T)
            fl = rng.poisson(lam)
            st.flit[j] += fl
            st.crcd[j] += rng.binomial(fl, 0.05)
            st.rply[j] += rng.binomial(fl, 0.1)
            trap("noisy_link", j, 0)
        if g in plan.chatter:
            st.pcie[j] += rng.poisson(plan.chatter[g] * hrs)
            trap("pcie_chatter", j, 0)
        if g in plan.stale:
            trap("stale_xid", j, 0)
        if g in plan.hot:
            labels.append({"kind": "trap", "type": "hot_healthy", "node": nd.name, "gpu": j})
    for k, j, x in w.crashes:
        if not fails_soon(j, k):
            st.xid[j, k] = x
            trap("app_xid", j, k)
    for g, t, remap in plan.bursts:
        if g not in gl:
            continue
        j, k = g - nd.gpu0, slot(t)
        if k >= T:
            continue
        st.sbe[j, k] += int(rng.integers(20, 400))
        if k + 1 < T:
            st.sbe[j, k + 1] += int(rng.integers(0, 30))
        if remap and m.hbm:
            st.corr[j, k] += 1
            st.pend[j, k] = True
            st.xid[j, k] = 63
        trap("benign_sbe_burst", j, k)

    # Failures.
    inlet = nd.rack.inlet(ts)
    off = np.array([SLOT_HEAT[8 if m.per_node == 8 else 4][j] for j in range(n)]) + rng.normal(0, 1.0, n)
    for j, g in enumerate(gl):
        off[j] += plan.hot.get(g, 0.0)
    r_gpu = m.r_th * rng.lognormal(0, 0.05, n)
    for f in node_fails:
        j = f.gpu - nd.gpu0
        kf = min(slot(f.t_fail), T - 1)
        kp = kf if f.t_pre is None else min(slot(f.t_pre), kf)
        L = kf - kp
        s = (ts[kp:kf] - ts[kp]) / max(ts[kf] - ts[kp], 1.0)
        vanish = _inject(rng, f, nd, st, w, j, kp, kf, s, dt, inlet, off, r_gpu, labels, fails_soon, trap)
        labels.append({"kind": "failure", "node": nd.name, "gpu": j, "ts": tsr(kf), "class": f.cls,
                       "precursor_start_ts": None if f.t_pre is None or L == 0 else tsr(kp),
                       "abrupt": f.t_pre is None or L == 0})
        k_ret = slot(f.t_fail + f.repair)
        gone = kf if vanish else kf + 1
        st.present[j, gone:k_ret] = False
        for q in range(n):  # the job on the node dies with the GPU
            if q != j:
                st.idle(w, q, kf + 1, slot(f.t_fail + rng.uniform(15, 120) * 60))
        if f.drain:
            kd = slot(f.t_fail + f.drain_delay)
            if kd < min(k_ret, T):
                st.present[:, kd:k_ret] = False
                if k_ret < T:
                    st.reset[:, k_ret] = True
                trap("repair_drain", None, kd)
        if k_ret < T:
            st.reset[j, k_ret] = True
            if f.replaced:
                st.replace[j, k_ret] = True
                st.epoch[j, k_ret:] += 1
                plan.uuids[f.gpu].append(_uuid(rng))
            kd = slot(f.t_fail + f.repair + rng.uniform(20, 45) * 60)
            st.diag(w, j, k_ret, kd)
            st.idle(w, j, kd, slot(f.t_fail + f.repair + rng.uniform(1, 4) * HOUR))
    vals = _physics(rng, plan, nd, st, w, dt, inlet, off, r_gpu)
    out = _masks(rng, st, vals, dcp)
    return out, labels


def _inject(rng: np.random.Generator, f: Failure, nd: Node, st: State, w: Work, j: int, kp: int, kf: int,
            s: np.ndarray, dt: np.ndarray, inlet: np.ndarray, off: np.ndarray, r_gpu: np.ndarray,
            labels: list[dict], fails_soon: Any, trap: Any) -> bool:
    """Write one failure's precursor and end into the node state. Returns True if the GPU
    vanishes without a final sample."""
    m = nd.model
    a = f.amp
    L = kf - kp
    hrs = dt[kp:kf] / HOUR
    peers = [q for q in range(nd.n) if q != j and not fails_soon(q, kf)]
    vanish = False
    if f.cls == "memory_wearout":
        if L > 0:
            g = rng.uniform(2.0, 5.0)
            lam_h = a * rng.uniform(8, 60) * np.expm1(g * s) / math.expm1(g) + 0.3 * a
            st.sbe[j, kp:kf] += rng.poisson(rng.gamma(0.5, lam_h * hrs / 0.5))
            if m.hbm:
                for k in kp + (rng.beta(2.2, 1.0, 1 + rng.poisson(1.5 * a)) * (L - 1)).astype(int):
                    st.corr[j, k] += 1
                    st.pend[j, k] = True
                    st.xid[j, k] = 63
            if lam_h[-1] > 25 and rng.random() < 0.6:
                st.xid[j, kp + int(rng.uniform(0.75, 0.98) * (L - 1))] = 92
        st.sbe[j, kf] += rng.poisson(20 * a)
        st.dbe[j, kf] += 1 + rng.poisson(0.7)
        xid = 48
        if m.hbm:
            st.unc[j, kf] += 1
            st.pend[j, kf] = True
            xid = int(rng.choice([95, 48], p=[0.6, 0.4]))
            if rng.random() < 0.25:
                st.rfail[j, kf] = True
                xid = 64 if rng.random() < 0.5 else xid
        st.xid[j, kf] = xid
    elif f.cls == "nvlink_flap":
        if L > 0:
            act = _episodes(rng, np.clip(a * 0.025 * (1 + 14 * s**2), 0, 0.6), 4)
            na = int(act.sum())
            fl = rng.poisson(np.exp(rng.normal(4.0, 1.0, na)))
            incs = ((st.flit, fl), (st.crcd, rng.binomial(fl, 0.07)), (st.rply, rng.binomial(fl, 0.2)),
                    (st.recov, rng.random(na) < 0.03 + 0.35 * s[act]))
            for arr, vals in incs:
                v = arr[j, kp:kf]
                v[act] += vals
            slow = st.umult[:, kp:kf]
            slow[:, act] *= rng.uniform(0.75, 0.95, na)[None, :]
            late = np.flatnonzero(act & (s > 0.7) & (rng.random(L) < 0.25))
            st.xid[j, kp + late] = 74
        st.xid[j, kf] = 74
        st.recov[j, kf] += int(rng.integers(1, 4))
        st.flit[j, kf] += rng.poisson(500)
        if peers:
            for q in rng.choice(peers, size=min(len(peers), int(rng.integers(1, 4))), replace=False):
                st.xid[q, kf] = 74
                st.flit[q, kf] += rng.poisson(40)
                st.recov[q, kf] += int(rng.random() < 0.3)
                trap("sympathetic_xid74", int(q), kf)
    elif f.cls == "cooling_loss":
        if L > 0:
            target = m.t_hw + rng.uniform(2, 7)
            d = (target - float(inlet[kp:kf].mean()) - BOARD_C - off[j]) / (r_gpu[j] * 0.9 * m.tdp) - 1.0
            d = max(0.15, d) * float(np.clip(a, 0.4, 1.2))
            curve = d * np.append(s, 1.0) ** rng.uniform(1.0, 3.0)
            st.rmult[j, kp:kf + 1] *= 1 + curve
            nb = j + 1 if j + 1 < nd.n else j - 1
            if 0 <= nb != j and nb in peers:
                st.rmult[nb, kp:kf + 1] *= 1 + 0.15 * curve
                trap("sympathetic_heat", nb, kp + L // 2)
        else:
            st.rmult[j, max(kf - 1, 0):kf + 1] *= 2.2
        st.tadd[j, kf] += rng.uniform(4, 10)
        if rng.random() < 0.45:
            st.xid[j, kf] = 79
    elif f.cls == "bus_dropout":
        if L > 0:
            b = rng.random(L) < np.clip(a * 0.03 * (1 + 10 * s**1.5), 0, 0.7)
            v = st.pcie[j, kp:kf]
            v[b] += rng.poisson(np.exp(rng.normal(2.5, 1.0, int(b.sum())))) + 1
            st.pcie_mult[j, kp + int(rng.uniform(0.3, 0.9) * L):kf + 1] *= 0.5
            st.blankp[j, kp:kf] += 0.002 + 0.04 * s**3 * a
        st.xid[j, kf] = 79
        if rng.random() < 0.5:
            st.blank_all[j, kf] = True
        else:
            vanish = True
    elif f.cls == "gsp_hang":
        if L > 0:
            st.blankp[j, kp:kf] += (0.01 + 0.25 * s**2) * a
            st.hang[j, kp:kf] |= rng.random(L) < (0.01 + 0.06 * s) * a
            if rng.random() < 0.5:
                st.xid[j, kp + int(rng.uniform(0.2, 0.8) * L)] = 119
            if rng.random() < 0.5:
                st.hang[j, max(kf - 1, 0)] = True
        st.hang[j, kf] = True
        st.xid[j, kf] = int(rng.choice([119, 120], p=[0.7, 0.3]))
        vanish = L == 0 and rng.random() < 0.3
    elif f.cls == "power_brownout":
        if L > 0:
            act = _episodes(rng, np.clip(a * 0.015 * (1 + 12 * s**2), 0, 0.5), 3)
            st.brake[j, kp:kf] |= act
            st.psd[j, kp:kf] += 0.05 * s * a
            st.pspike[j, kp:kf] |= rng.random(L) < 0.03 * s
            for q in peers:
                share = act & (rng.random(L) < 0.35)
                if share.any():
                    st.brake[q, kp:kf] |= share
                    trap("sympathetic_power_brake", q, kp + int(np.argmax(share)))
        st.brake[j, kf] = True
        if rng.random() < 0.6:
            st.xid[j, kf] = 79
        else:
            vanish = True
    return vanish


def _physics(rng: np.random.Generator, plan: Plan, nd: Node, st: State, w: Work, dt: np.ndarray,
             inlet: np.ndarray, off: np.ndarray, r_gpu: np.ndarray) -> np.ndarray:
    """Turn workload + modifiers into the (F, n, T) metric values."""
    m = nd.model
    n, T = st.n, st.T
    gl = list(range(nd.gpu0, nd.gpu0 + n))
    u = w.u * st.umult
    tens = w.tens * st.umult
    dram = w.dram * st.umult
    hang = st.hang
    u = np.where(hang, 1.0, u)
    tens = np.where(hang, 0.0, tens)
    dram = np.where(hang, 0.0, dram)
    idle_w = m.idle_w * rng.uniform(0.92, 1.08, (n, 1))
    eff = rng.lognormal(0, 0.03, (n, 1))
    load = np.clip(0.18 * u + 0.62 * tens / m.tens_ref + 0.2 * dram, 0, 1.25)
    pd = idle_w + (m.tdp - idle_w) * load * eff
    pd = pd * (1 + rng.standard_normal((n, T)) * (0.012 + st.psd))
    pd = np.where(hang, idle_w * rng.uniform(1.15, 1.35, (n, T)), pd)
    limit = m.tdp * st.limit_f
    over = pd > limit
    p = np.where(over, limit * rng.uniform(0.965, 0.995, (n, T)), pd)
    idle = u < 0.03
    clk = np.where(over, m.sm_max * (limit / np.maximum(pd, 1)) ** 0.8, float(m.sm_max))
    clk = np.where(idle & ~hang, m.sm_idle, clk)
    reasons = np.where(idle & ~hang, 0x1, 0) | np.where(over, 0x4, 0)
    p_lag = p.copy()
    p_lag[:, 1:] = 0.7 * p[:, 1:] + 0.3 * p[:, :-1]
    r_eff = r_gpu[:, None] * st.rmult
    t_d = inlet[None, :] + BOARD_C + off[:, None] + r_eff * p_lag + rng.normal(0, 0.45, (n, T)) + st.tadd
    ex = t_d - m.t_sw
    thr = ex > 0
    t_g = np.where(thr, m.t_sw + 0.45 * ex, t_d)
    frac = np.where(thr, np.clip(1 - 0.6 * ex / np.maximum(r_eff * p_lag, 1e-3), 0.35, 1.0), 1.0)
    p = p * frac
    clk = clk * frac**0.7
    hw = t_g >= m.t_hw
    clk = np.where(hw, clk * 0.6, clk)
    reasons = reasons | np.where(thr, 0x20, 0) | np.where(hw, 0x48, 0)
    br = st.brake
    nb = int(br.sum())
    if nb:
        p[br] *= rng.uniform(0.35, 0.55, nb)
        clk[br] *= rng.uniform(0.25, 0.5, nb)
    reasons = reasons | np.where(br, 0x88, 0)
    clk = np.round(clk / 15.0) * 15.0
    p_read = np.where(st.pspike, p * rng.uniform(1.1, 1.25, (n, T)), p)
    t_mem = t_g + 1.0 + 9.0 * dram + rng.normal(0, 0.5, (n, T))

    vals = np.zeros((NF, n, T))
    vals[FI["DEV_GPU_TEMP"]] = np.round(t_g)
    vals[FI["DEV_MEMORY_TEMP"]] = np.round(t_mem)
    vals[FI["DEV_POWER_USAGE"]] = np.round(p_read, 3)
    vals[FI["DEV_SM_CLOCK"]] = clk
    mclk = m.mem_clk if m.hbm else np.where(idle, m.mem_clk_idle, m.mem_clk)
    vals[FI["DEV_MEM_CLOCK"]] = mclk
    vals[FI["DEV_GPU_UTIL"]] = np.round(100 * np.clip(u + rng.normal(0, 0.008, (n, T)) * (u > 0.03), 0, 1))
    busy = (u > 0.03).astype(float)
    copy = 0.95 * dram + rng.normal(0, 0.015, (n, T)) * (dram > 0)
    vals[FI["DEV_MEM_COPY_UTIL"]] = np.round(100 * np.clip(copy, 0, 1))
    used = np.round(w.fbf * m.mem_mib * (1 + rng.normal(0, 0.002, (n, T))))
    used = np.where(used > 0, used, rng.integers(0, 3, (n, T)))
    vals[FI["DEV_FB_USED"]] = used
    vals[FI["DEV_FB_RESERVED"]] = m.reserved_mib
    vals[FI["DEV_FB_FREE"]] = m.mem_mib - m.reserved_mib - used
    vals[FI["DEV_CLOCKS_EVENT_REASONS"]] = reasons
    gr = 0.985 * u + rng.normal(0, 0.006, (n, T)) * busy
    vals[FI["PROF_GR_ENGINE_ACTIVE"]] = np.round(np.clip(gr, 0, 1), 4)
    vals[FI["PROF_PIPE_TENSOR_ACTIVE"]] = np.round(tens, 4)
    vals[FI["PROF_DRAM_ACTIVE"]] = np.round(dram, 4)
    rx = w.rx * st.pcie_mult * rng.lognormal(0, 0.25, (n, T))
    vals[FI["PROF_PCIE_RX_BYTES"]] = np.round(rx)
    vals[FI["PROF_PCIE_TX_BYTES"]] = np.round(rx * 0.35 * rng.lognormal(0, 0.2, (n, T)))

    # Counters since boot (reset on reboot / GPU reset), persistent ones reset on replacement.
    ages = nd.boot_age
    mean_w = m.idle_w + 0.45 * (m.tdp - m.idle_w)
    reset = st.reset
    vals[FI["DEV_TOTAL_ENERGY_CONSUMPTION"]] = np.round(_cum_reset(
        p * dt * 1000.0, reset, ages * mean_w * 1000.0 * rng.uniform(0.8, 1.2, n)))
    pv = dt * 1e9 * (over | br) * rng.uniform(0.3, 1.0, (n, T))
    tv = dt * 1e9 * thr * rng.uniform(0.2, 1.0, (n, T))
    vals[FI["DEV_POWER_VIOLATION"]] = np.round(_cum_reset(pv, reset, ages * 1e9 * rng.uniform(0, 0.04, n)))
    vals[FI["DEV_THERMAL_VIOLATION"]] = np.round(_cum_reset(tv, reset, ages * 1e9 * rng.uniform(0, 0.002, n)))
    age_h = ages / HOUR
    bg = rng.random(n) < 0.15
    sbe0 = np.where(bg, rng.poisson(0.02 * age_h, n), 0).astype(float)
    for j, g in enumerate(gl):
        if g in plan.lemon:
            sbe0[j] = rng.poisson(plan.lemon[g] * age_h)
    vals[FI["DEV_ECC_SBE_VOL_TOTAL"]] = _cum_reset(st.sbe, reset, sbe0)
    vals[FI["DEV_ECC_DBE_VOL_TOTAL"]] = _cum_reset(st.dbe, reset, np.zeros(n))
    hist = rng.geometric(0.08, n) * (rng.random(n) < 0.2)
    vals[FI["DEV_ECC_SBE_AGG_TOTAL"]] = _cum_reset(st.sbe, st.replace, sbe0 + hist)
    vals[FI["DEV_ECC_DBE_AGG_TOTAL"]] = _cum_reset(st.dbe, st.replace, (rng.random(n) < 0.01).astype(float))
    corr0 = np.where(rng.random(n) < 0.05, rng.integers(1, 3, n), 0).astype(float)
    for j, g in enumerate(gl):
        if g in plan.lemon:
            corr0[j] = rng.integers(2, 6)
    vals[FI["DEV_CORRECTABLE_REMAPPED_ROWS"]] = _cum_reset(st.corr, st.replace, corr0)
    vals[FI["DEV_UNCORRECTABLE_REMAPPED_ROWS"]] = _cum_reset(st.unc, st.replace, np.zeros(n))
    vals[FI["DEV_ROW_REMAP_FAILURE"]] = _hold(st.rfail | st.replace, st.rfail.astype(float), np.zeros(n))
    vals[FI["DEV_ROW_REMAP_PENDING"]] = _hold(st.pend | reset, st.pend.astype(float), np.zeros(n))
    vals[FI["DEV_PCIE_REPLAY_COUNTER"]] = _cum_reset(st.pcie, reset, np.where(
        rng.random(n) < 0.3, rng.poisson(0.01 * age_h, n), 0).astype(float))
    flit0 = np.where(rng.random(n) < 0.3, rng.poisson(0.05 * age_h, n), 0).astype(float)
    for j, g in enumerate(gl):
        if g in plan.noisy:
            flit0[j] = rng.poisson(plan.noisy[g] * age_h)
    vals[FI["DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"]] = _cum_reset(st.flit, reset, flit0)
    vals[FI["DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"]] = _cum_reset(st.crcd, reset, np.round(flit0 * 0.05))
    vals[FI["DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL"]] = _cum_reset(st.rply, reset, np.round(flit0 * 0.1))
    vals[FI["DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL"]] = _cum_reset(st.recov, reset, np.zeros(n))
    xid0 = np.array([plan.stale.get(g, 0) for g in gl], dtype=float)
    vals[FI["DEV_XID_ERRORS"]] = _hold((st.xid != 0) | reset, st.xid.astype(float), xid0)
    return vals


def _masks(rng: np.random.Generator, st: State, vals: np.ndarray, dcp: np.ndarray) -> dict[str, Any]:
    n, T = st.n, st.T
    r = rng.random((NF, n, T))
    missing = r < P_MISSING
    pb = P_BLANK * _GAUGE_BLANK[:, None, None] + 0.0001 + _SLOW_FIELDS[:, None, None] * st.blankp[None]
    blank = (r >= P_MISSING) & (r < P_MISSING + pb)
    blank |= st.blank_all[None] & (np.arange(NF) != FI["DEV_XID_ERRORS"])[:, None, None]
    if dcp.any():
        prof = np.array([g == "prof" for _, _, g in FIELDS])
        blank[prof] |= dcp[None, None, :]
    return {"vals": vals, "present": st.present, "missing": missing, "blank": blank, "epoch": st.epoch}


# --------------------------------------------------------------------------------------------
# Output


def _template(nd: Node, j: int, uuid: str) -> tuple[str, list[int], dict[str, Any]]:
    m = nd.model
    keep = []
    for i, (_, _, grp) in enumerate(FIELDS):
        skip = {"remap": not m.hbm, "nvl": not m.nvlink, "prof": not nd.has_prof}
        if skip.get(grp, False):
            continue
        keep.append(i)
    head = {"node": nd.name, "gpu": j, "uuid": uuid, "model": m.name,
            "rack": nd.rack.name, "site": nd.rack.site}
    parts = []
    for i in keep:
        name = FIELDS[i][0]
        v = str(BLANK) if (i == FI["DEV_MEMORY_TEMP"] and not m.hbm) else f"{{{i + 1}}}"
        parts.append(f'"{name}": {v}')
    hs = json.dumps(head)[1:-1].replace("{", "{{").replace("}", "}}")
    fmt = '{{"ts": {0}, ' + hs + ', "metrics": {{' + ", ".join(parts) + "}}}}"
    return fmt, keep, head


def generate(out_dir: Path, seed: int, gpus: int = 256, days: float = 14.0, interval_s: float = 120.0,
             failure_rate: float = 30.0) -> dict:
    """Write DIR/trace.jsonl.gz and DIR/labels.jsonl for a simulated fleet; return a summary."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if gpus < 1 or days <= 0 or interval_s <= 0:
        raise ValueError("gpus, days and interval must be positive")
    rng = np.random.default_rng(seed)
    plan = _plan(rng, gpus, days, interval_s, failure_rate)
    n_max = sum(nd.n * nd.ts.size for nd in plan.nodes)
    cols = np.empty((NF, n_max))
    ts_all = np.empty(n_max)
    gidx = np.empty(n_max, np.int32)
    tid = np.empty(n_max, np.int32)
    irr_flag = np.zeros(n_max, bool)
    irr: dict[int, tuple[set[int], set[int]]] = {}
    templates: list[tuple[str, list[int], dict[str, Any]]] = []
    labels: list[dict] = []
    pos = 0
    for nd in plan.nodes:
        out, lab = _simulate_node(rng, plan, nd)
        labels.extend(lab)
        vals, present, missing, blank = out["vals"], out["present"], out["missing"], out["blank"]
        epoch = out["epoch"]
        for j in range(nd.n):
            g = nd.gpu0 + j
            tids = []
            for u in plan.uuids[g]:
                tids.append(len(templates))
                templates.append(_template(nd, j, u))
            mk = present[j]
            cnt = int(mk.sum())
            sl = slice(pos, pos + cnt)
            cols[:, sl] = vals[:, j, mk]
            ts_all[sl] = nd.ts[mk]
            gidx[sl] = g
            ep = np.minimum(epoch[j, mk], len(tids) - 1)
            tid[sl] = np.array(tids)[ep]
            keep = set(templates[tids[0]][1])
            mm = missing[:, j, mk]
            bb = blank[:, j, mk]
            for r in np.flatnonzero((mm | bb).any(axis=0)):
                mis = {int(i) for i in np.flatnonzero(mm[:, r])} & keep
                bl = {int(i) for i in np.flatnonzero(bb[:, r])} & keep
                if mis or bl:
                    irr[pos + int(r)] = (mis, bl)
                    irr_flag[pos + int(r)] = True
            pos += cnt
    N = pos
    assert np.isfinite(cols[:, :N]).all()
    order = np.lexsort((gidx[:N], ts_all[:N]))
    trace = out_dir / "trace.jsonl.gz"
    chunk = 131072
    with open(trace, "wb") as raw, gzip.GzipFile("trace.jsonl", "wb", GZIP_LEVEL, raw, mtime=0) as gz:
        for c0 in range(0, N, chunk):
            idx = order[c0:c0 + chunk]
            lists = [ts_all[idx].tolist()]
            for i in range(NF):
                v = cols[i, idx]
                lists.append(v.astype(np.int64).tolist() if IS_INT[i] else v.tolist())
            tl = tid[idx].tolist()
            fl = irr_flag[idx].tolist()
            lines = []
            for row, t, f, oi in zip(zip(*lists, strict=True), tl, fl, idx.tolist(), strict=True):
                fmt, keep, head = templates[t]
                if not f:
                    lines.append(fmt.format(*row))
                    continue
                mis, bl = irr[oi]
                metrics = {}
                for i in keep:
                    if i in mis:
                        continue
                    blank_mt = i == FI["DEV_MEMORY_TEMP"] and head["model"] in _GDDR
                    metrics[FIELDS[i][0]] = BLANK if (i in bl or blank_mt) else row[i + 1]
                lines.append(json.dumps({"ts": row[0], **head, "metrics": metrics}))
            gz.write(("\n".join(lines) + "\n").encode())
    labels.sort(key=lambda r: (r.get("ts") or 0.0, r["kind"], r["node"], -1 if r["gpu"] is None else r["gpu"],
                               r.get("type", r.get("class", ""))))
    with open(out_dir / "labels.jsonl", "w") as fh:
        for r in labels:
            fh.write(json.dumps(r) + "\n")
    fails: dict[str, int] = {}
    traps: dict[str, int] = {}
    for r in labels:
        if r["kind"] == "failure":
            fails[r["class"]] = fails.get(r["class"], 0) + 1
        else:
            traps[r["type"]] = traps.get(r["type"], 0) + 1
    models: dict[str, int] = {}
    for nd in plan.nodes:
        models[nd.model.name] = models.get(nd.model.name, 0) + nd.n
    return {"samples": N, "gpus": int(plan.gpu_node.size), "nodes": len(plan.nodes), "models": models,
            "failures": dict(sorted(fails.items())), "failures_total": sum(fails.values()),
            "abrupt": sum(1 for r in labels if r["kind"] == "failure" and r["abrupt"]),
            "traps": dict(sorted(traps.items())), "trace": str(trace),
            "labels": str(out_dir / "labels.jsonl")}


_GDDR = {m.name for m in MODELS if not m.hbm}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--seed", required=True, type=int)
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument("--interval", type=float, default=120.0)
    ap.add_argument("--failures-per-1000-gpu-days", type=float, default=30.0, dest="rate")
    a = ap.parse_args(argv)
    summary = generate(a.out, a.seed, a.gpus, a.days, a.interval, a.rate)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
