"""cloud_fleet: a seeded generator of public-cloud GPU-fleet telemetry with labelled failures and traps.

What it is
    A stand-alone synthetic-data tool that writes dcgm-exporter-style GPU samples for a rented,
    multi-tenant cloud region, together with ground-truth labels: hardware failures (with or without
    a precursor) and "traps" (events that look alarming but are not failures).  It exists to test a GPU
    failure predictor on data unlike the data it was built from.

Independence
    It was written without reading the project's own simulator, predictors, feature code, tests or
    other benchmark generators.  The only project material consulted was docs/DESIGN.md (the "GPU
    sample" record contract), docs/REFERENCE.md (DCGM fields, XID meanings, failure statistics) and
    the shared reference data (GPU catalog, dcgm-exporter counter lists).  Shapes, rates, noise levels
    and traps are this tool's own choices, from public knowledge of DCGM/NVML and real fleets.
    Dependencies: numpy and the Python standard library.

What it models
    * One cloud region with several datacenter halls.  Each hall has its own HVAC (inlet temperature,
      an outside-air diurnal swing, occasional chiller trips), its own exporter configuration (which
      counters are enabled) and its own scrape interval (0.5x .. 5x the base interval, with jitter).
    * Air-cooled 8-GPU servers of several generations: A100 SXM4 40/80GB, H100 SXM and PCIe, H200,
      L4, L40S, A10G.  NVLink counters only on SXM parts; row remapping on HBM parts, page retirement
      on GDDR parts; rack position sets inlet temperature (top of rack runs hotter).
    * Tenancy: bare-metal (whole server) or VM (1/2/4/8-GPU slices) tenants that come and go every few
      hours to days; idle gaps between them; inference tenants with strong diurnal load, training,
      batch and dev tenants; spot instances that get preempted; tenant-set power caps.  Every tenant
      change is a driver reload: volatile counters (volatile ECC, PCIe replay, NVLink errors, energy,
      violation times) and the sticky last XID reset, and the exporter is sometimes down for minutes.
      Aggregate ECC and row-remap / retired-page counters persist until the board is replaced.
    * A noisy fleet: steady low background of correctable errors on many GPUs, PCIe replay chatter on
      one server SKU, NVLink CRC noise on some SXM boards, tenant application XIDs.
    * Failures: memory (HBM/GDDR), NVLink, thermal (fan/heatsink), PCIe/riser, GSP/driver hang and
      power supply, each with its own abrupt share and precursor shape.  A precursor has a log-normal
      length (~30 min .. 4 days) and a strength spread over two decades, so some are nearly invisible.
      After a failure the GPU stops reporting for a repair window, then returns with reset counters
      (a new uuid and zeroed aggregate counters if the board was replaced).

Output (in DIR)
    trace.jsonl.gz  one GPU sample per line, in event-time order across the fleet:
                    {"ts", "node", "gpu", "uuid", "model", "rack", "site", ["job", "rank"], "metrics": {...}}
                    metrics keys are DCGM field names; missing keys are missing data; DCGM blank
                    sentinels (9223372036854775794 for integer fields) appear occasionally.  gzip mtime=0
                    so the bytes are deterministic for a seed.
    labels.jsonl    failures first ({"kind": "failure", "ts", "node", "gpu", "class", "abrupt",
                    "precursor_start_ts", "precursor_h", ...}), then traps ({"kind": "trap", "type",
                    "node", "gpu", "ts", "end_ts", ...}).  Trap types: hot_healthy, chiller_trip,
                    benign_sbe_burst, ecc_lemon, tenant_app_xid, tenant_churn, spot_preemption,
                    sympathetic_xid74, pcie_replay_chatter, nvlink_crc_noise, power_cap, scrape_gap,
                    exporter_restart.  Every counter reset is covered by a tenant_churn record (driver
                    reload) or by a failure's repair_end_ts.

Usage
    python bench/cloud_fleet.py --out DIR --seed N [--gpus 256] [--days 14] [--interval 60]
        [--failures-per-1000-gpu-days 30]
    or from Python: generate(out_dir, seed, gpus=256, days=14.0, interval_s=60.0, failure_rate=30.0)
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
import time

import numpy as np

T0 = 1772323200.0  # 2026-03-01T00:00:00Z: fixed start, no wall clock
TZ_OFFSET_H = 1.0  # region local time (UTC+1) drives the diurnal cycles
INT_BLANK = 9223372036854775794  # DCGM int64 "not supported" blank, as dcgm-exporter prints it
REGION = "euw4"

# NVML name, framebuffer MiB, TDP W, idle W, max / idle SM clock MHz, memory clock (busy, idle) MHz,
# thermal resistance (degC per W at the die, air-cooled), SW thermal slowdown threshold degC, memory kind,
# SXM (NVLink) flag, NVLink bandwidth GB/s, fleet share.
# fmt: off
SKUS = {
    "a100_40": ("NVIDIA A100-SXM4-40GB", 40960, 400, 55, 1410, 210, 1215, 1215, 0.095, 88,
                "HBM", True, 600, 0.12),
    "a100_80": ("NVIDIA A100-SXM4-80GB", 81920, 400, 60, 1410, 210, 1593, 1593, 0.095, 88,
                "HBM", True, 600, 0.14),
    "h100_sxm": ("NVIDIA H100 80GB HBM3", 81559, 700, 70, 1980, 345, 2619, 2619, 0.068, 87,
                 "HBM", True, 900, 0.18),
    "h100_pcie": ("NVIDIA H100 PCIe", 81559, 350, 45, 1755, 345, 1593, 1593, 0.13, 87, "HBM", False, 0, 0.08),
    "h200": ("NVIDIA H200", 143771, 700, 75, 1980, 345, 3201, 3201, 0.066, 87, "HBM", True, 900, 0.10),
    "l4": ("NVIDIA L4", 23034, 72, 16, 2040, 210, 6251, 405, 0.62, 85, "GDDR", False, 0, 0.13),
    "l40s": ("NVIDIA L40S", 46068, 350, 35, 2520, 210, 9001, 405, 0.135, 85, "GDDR", False, 0, 0.13),
    "a10g": ("NVIDIA A10G", 23028, 300, 25, 1710, 210, 6251, 405, 0.15, 85, "GDDR", False, 0, 0.12),
}
# fmt: on
SKU_KEYS = list(SKUS)

# Halls: name, scrape multiplier of the base interval, base inlet degC, exporter profile, node share.
# Profiles: "full" = profiling + clock events + violations, "dcp" = profiling only, "basic" = neither.
HALLS = [
    ("dh1", 0.5, 22.5, "full", 0.15),
    ("dh2", 1.0, 24.0, "full", 0.35),
    ("dh3", 2.0, 23.0, "dcp", 0.30),
    ("dh4", 5.0, 25.5, "basic", 0.20),
]

# Chassis variants per SKU; "pcie-4u-b" and "hgx-a100-r1" have marginal risers: PCIe replay chatter.
CHASSIS = {True: ["hgx-a100-r1", "hgx-r2", "hgx-r3"], False: ["pcie-4u-a", "pcie-4u-b", "pcie-2u-c"]}
CHATTER_CHASSIS = {"pcie-4u-b", "hgx-a100-r1"}

# Failure classes: weight, abrupt share, precursor median hours, replacement probability.
# GSP hangs and bus drops rarely warn; memory and thermal wear out slowly.
CLASSES = {
    "memory": (0.28, 0.40, 20.0, 0.70),
    "nvlink": (0.15, 0.35, 10.0, 0.40),
    "thermal": (0.13, 0.20, 36.0, 0.30),
    "pcie": (0.15, 0.60, 6.0, 0.30),
    "gsp_hang": (0.16, 0.85, 2.0, 0.05),
    "power_supply": (0.13, 0.60, 4.0, 0.20),
}

# Tenant workload kinds: weight; inference dominates a rented region.
WORKLOADS = {"inference": 0.50, "training": 0.18, "batch": 0.16, "dev": 0.16}
APP_XIDS = ([13, 31, 43, 45], [0.40, 0.30, 0.20, 0.10])  # tenant-caused XIDs and their shares

# Bits of DCGM_FI_DEV_CLOCKS_EVENT_REASONS
B_IDLE, B_SWPOWER, B_HWSLOW, B_SWTHERM, B_HWTHERM, B_BRAKE = 0x1, 0x4, 0x8, 0x20, 0x40, 0x80

M = "DCGM_FI_DEV_"
P = "DCGM_FI_PROF_"


def _uuid(rng: np.random.Generator) -> str:
    h = rng.integers(0, 16, 32)
    s = "".join("0123456789abcdef"[int(x)] for x in h)
    return f"GPU-{s[:8]}-{s[8:12]}-{s[12:16]}-{s[16:20]}-{s[20:]}"


def _seg_cumsum(inc: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Cumulative sum of inc that restarts wherever seg changes (a counter reset)."""
    cs = np.cumsum(inc)
    starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
    base = cs[starts] - inc[starts]
    return cs - np.repeat(base, np.diff(np.r_[starts, len(inc)]))


def _sticky(ev: np.ndarray, seg: np.ndarray) -> np.ndarray:
    """Last non-zero event within each segment (DCGM's last-XID field, cleared by a reset)."""
    idx = np.arange(len(ev))
    start = np.r_[True, seg[1:] != seg[:-1]]
    last = np.maximum.accumulate(np.where((ev > 0) | start, idx, 0))
    return ev[last]


def _trapezoid(ts, s, ramp, e, rec):
    return np.interp(ts, [s, s + ramp, e, e + rec], [0.0, 1.0, 1.0, 0.0], left=0.0, right=0.0)


def _lognormal_h(rng, median_h, sigma, lo, hi):
    return float(np.clip(rng.lognormal(math.log(median_h), sigma), lo, hi))


def _diurnal(ts: np.ndarray, peak_h: float) -> np.ndarray:
    """0..1 daily cycle peaking at peak_h local time, with quieter weekends."""
    hour = ((ts / 3600.0) + TZ_OFFSET_H) % 24.0
    d = 0.5 + 0.5 * np.cos(2 * np.pi * (hour - peak_h) / 24.0)
    dow = ((ts + TZ_OFFSET_H * 3600) // 86400 + 3) % 7  # 1970-01-01 was a Thursday: 0 = Monday
    return d * np.where(dow >= 5, 0.75, 1.0)


class _Fleet:
    """Static layout: halls, racks, servers, GPUs, tenancy units, hall/node events."""

    def __init__(self, rng, gpus, days, interval_s):
        self.t_end = T0 + days * 86400.0
        n_nodes = max(1, math.ceil(gpus / 8))
        n_h = min(len(HALLS), n_nodes)
        w = np.array([h[4] for h in HALLS[:n_h]])
        hall = rng.choice(n_h, n_nodes, p=w / w.sum())
        hall[:n_h] = np.arange(n_h)
        hall = np.sort(hall)
        skw = np.array([SKUS[k][13] for k in SKU_KEYS])
        sku = rng.choice(len(SKU_KEYS), n_nodes, p=skw / skw.sum())
        self.nodes = []
        rack_count = {}
        gid = 0
        for i in range(n_nodes):
            h = int(hall[i])
            key = SKU_KEYS[int(sku[i])]
            spec = SKUS[key]
            per_rack = 2 if spec[2] >= 400 else 4  # power budget per air-cooled rack
            rc = rack_count.setdefault(h, [0, 0])
            if rc[1] >= per_rack:
                rc[0] += 1
                rc[1] = 0
            slot = rc[1]
            rc[1] += 1
            n_g = min(8, gpus - gid)
            chassis = str(rng.choice(CHASSIS[spec[11]]))
            self.nodes.append(
                {
                    "name": f"{REGION}-{HALLS[h][0]}-{i:04d}",
                    "hall": h,
                    "sku": key,
                    "slot": slot,
                    "per_rack": per_rack,
                    "rack": f"{REGION}-{HALLS[h][0]}-r{rc[0]:02d}",
                    "chassis": chassis,
                    "gpus": list(range(gid, gid + n_g)),
                }
            )
            gid += n_g
        self.n_gpus = gid
        # hall-level events
        self.chiller = {h: [] for h in range(n_h)}
        self.scrape_gaps = {h: [] for h in range(n_h)}
        for h in range(n_h):
            for _ in range(rng.poisson(days / 6.0)):
                s = T0 + rng.uniform(0, days * 86400.0)
                self.chiller[h].append(
                    (
                        s,
                        rng.uniform(1200, 3600),
                        s + rng.uniform(3600, 6 * 3600),
                        rng.uniform(1800, 5400),
                        rng.uniform(4.0, 9.0),
                    )
                )
            for _ in range(rng.poisson(days * 0.3)):
                s = T0 + rng.uniform(0, days * 86400.0)
                self.scrape_gaps[h].append((s, s + rng.uniform(300, 2400)))
        if days >= 2 and not any(self.chiller.values()):
            h = int(rng.integers(n_h))
            s = T0 + rng.uniform(0.2, 0.8) * days * 86400.0
            self.chiller[h].append((s, 1800.0, s + 3 * 3600.0, 3600.0, 7.0))
        self.exporter_restarts = {}
        for nd in self.nodes:
            ev = []
            for _ in range(rng.poisson(days * 0.1)):
                s = T0 + rng.uniform(0, days * 86400.0)
                ev.append((s, s + rng.uniform(60, 600)))
            self.exporter_restarts[nd["name"]] = ev
        self.interval = {h: interval_s * HALLS[h][1] for h in range(n_h)}


def _partition_units(rng, n):
    """Split a server into tenancy units: bare metal (one unit) or VM slices of 1/2/4/8 GPUs."""
    if rng.random() < 0.45:
        return [n]
    out, left = [], n
    while left:
        sizes = [s for s in (1, 2, 4, 8) if s <= left]
        p = np.array([0.35, 0.3, 0.25, 0.1][: len(sizes)])
        s = int(rng.choice(sizes, p=p / p.sum()))
        out.append(s)
        left -= s
    return out


def _sessions(rng, t_end, tag):
    """Tenant sessions of one unit: list of dicts; the first starts before the trace."""
    out = []
    t = T0 - rng.uniform(0, 36 * 3600.0)
    k = 0
    kinds, kw = list(WORKLOADS), np.array(list(WORKLOADS.values()))
    while t < t_end:
        dur = _lognormal_h(rng, 9.0, 1.1, 0.3, 144.0) * 3600.0
        kind = str(rng.choice(kinds, p=kw))
        spot = rng.random() < 0.3
        preempt = spot and rng.random() < 0.35
        if preempt:
            dur *= rng.uniform(0.05, 0.9)
        s = {
            "start": t,
            "end": t + dur,
            "kind": kind,
            "spot": spot,
            "preempted": preempt,
            "job": f"tnt-{tag}-{k:03d}-{kind[:3]}",
            "lvl": rng.uniform(0.4, 1.0) if kind != "dev" else rng.uniform(0.05, 0.4),
            "mem": rng.uniform(0.25, 0.95),
            "tensor": rng.uniform(0.15, 0.8),
            "dram": rng.uniform(0.2, 0.8),
            "pint": rng.uniform(0.75, 1.0),
            "nvl": rng.uniform(0.0, 0.35),
            "period": rng.uniform(1200, 5400),
            "cap": rng.uniform(0.55, 0.8) if rng.random() < 0.08 else 0.0,
            "down": rng.uniform(60, 480) if rng.random() < 0.4 else 0.0,  # exporter down at driver reload
        }
        out.append(s)
        k += 1
        t = s["end"] + _lognormal_h(rng, 1.2, 1.0, 0.08, 48.0) * 3600.0
    return out


def _metric_keys(sku, profile):
    spec = SKUS[sku]
    keys = [
        M + "SM_CLOCK",
        M + "MEM_CLOCK",
        M + "MEMORY_TEMP",
        M + "GPU_TEMP",
        M + "POWER_USAGE",
        M + "TOTAL_ENERGY_CONSUMPTION",
        M + "PCIE_REPLAY_COUNTER",
        M + "GPU_UTIL",
        M + "MEM_COPY_UTIL",
    ]
    if spec[10] == "GDDR":
        keys += [M + "ENC_UTIL", M + "DEC_UTIL"]
    keys += [M + "XID_ERRORS", M + "FB_FREE", M + "FB_USED"]
    if profile == "full":
        keys += [M + "CLOCKS_EVENT_REASONS", M + "POWER_VIOLATION", M + "THERMAL_VIOLATION"]
    keys += [
        M + "ECC_SBE_VOL_TOTAL",
        M + "ECC_DBE_VOL_TOTAL",
        M + "ECC_SBE_AGG_TOTAL",
        M + "ECC_DBE_AGG_TOTAL",
    ]
    if spec[10] == "HBM":
        keys += [
            M + "UNCORRECTABLE_REMAPPED_ROWS",
            M + "CORRECTABLE_REMAPPED_ROWS",
            M + "ROW_REMAP_FAILURE",
            M + "ROW_REMAP_PENDING",
        ]
    else:
        keys += [M + "RETIRED_SBE", M + "RETIRED_DBE", M + "RETIRED_PENDING"]
    if spec[11]:
        keys += [
            M + "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
            M + "NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
            M + "NVLINK_REPLAY_ERROR_COUNT_TOTAL",
            M + "NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
            M + "NVLINK_BANDWIDTH_TOTAL",
        ]
    if profile in ("full", "dcp"):
        keys += [P + "GR_ENGINE_ACTIVE", P + "PIPE_TENSOR_ACTIVE", P + "DRAM_ACTIVE"]
    return keys


FLOAT_KEYS = {M + "POWER_USAGE", P + "GR_ENGINE_ACTIVE", P + "PIPE_TENSOR_ACTIVE", P + "DRAM_ACTIVE"}
FMT = {
    M + "POWER_USAGE": "%.3f",
    P + "GR_ENGINE_ACTIVE": "%.4f",
    P + "PIPE_TENSOR_ACTIVE": "%.4f",
    P + "DRAM_ACTIVE": "%.4f",
}


class _Gen:
    def __init__(self, seed, gpus, days, interval_s, failure_rate):
        self.rng = np.random.default_rng(seed)  # the one source of randomness
        self.days = days
        self.failure_rate = failure_rate
        self.fleet = _Fleet(self.rng, gpus, days, interval_s)
        self.failures = []
        self.traps = []
        self._plan()

    # ------------------------------------------------------------------ planning
    def _trap(self, typ, node, gpu, ts, end_ts, **extra):
        rec = {
            "kind": "trap",
            "type": typ,
            "node": node,
            "gpu": gpu,
            "ts": round(float(ts), 3),
            "end_ts": round(float(end_ts), 3),
        }
        rec.update(extra)
        self.traps.append(rec)

    def _plan(self):
        rng, fl = self.rng, self.fleet
        t_end = fl.t_end
        self.g = []  # per-GPU plan dicts
        for nd in fl.nodes:
            spec = SKUS[nd["sku"]]
            top = nd["slot"] == nd["per_rack"] - 1
            units = _partition_units(rng, len(nd["gpus"]))
            pos = 0
            for ui, usz in enumerate(units):
                sess = _sessions(rng, t_end, f"{nd['name'][-4:]}{ui}")
                members = nd["gpus"][pos : pos + usz]
                pos += usz
                gpu_field = (members[0] - nd["gpus"][0]) if usz == 1 else None
                ids = [m - nd["gpus"][0] for m in members]
                for s in sess[1:]:
                    if T0 <= s["start"] < t_end:
                        self._trap(
                            "tenant_churn",
                            nd["name"],
                            gpu_field,
                            s["start"],
                            s["start"] + s["down"],
                            gpus=ids,
                            reset=True,
                        )
                for j, s in enumerate(sess):
                    if s["preempted"] and s["end"] < t_end and s["end"] >= T0:
                        nxt = sess[j + 1]["start"] if j + 1 < len(sess) else t_end
                        self._trap(
                            "spot_preemption", nd["name"], gpu_field, s["end"], min(nxt, t_end), gpus=ids
                        )
                    if s["cap"] and s["end"] > T0 and s["start"] < t_end:
                        self._trap(
                            "power_cap",
                            nd["name"],
                            gpu_field,
                            max(s["start"], T0),
                            min(s["end"], t_end),
                            gpus=ids,
                            cap_w=round(s["cap"] * spec[2], 1),
                        )
                for r, gi in enumerate(members):
                    self.g.append(
                        {
                            "gid": gi,
                            "node": nd,
                            "idx": gi - nd["gpus"][0],
                            "rank": r,
                            "sess": sess,
                            "usz": usz,
                            "uuid": [_uuid(rng)],
                            "inlet_off": 1.2 * nd["slot"] + rng.normal(0, 0.6) + (1.5 if top else 0),
                            "rth": spec[8] * rng.lognormal(0, 0.05),
                            "sbe_bg": 0.0,
                            "hot": False,
                            "lemon": False,
                            "bursts": [],
                            "nvl_noise": False,
                            "fail": None,
                            "app_xids": [],
                            "sym74": [],
                            "pcie_chatter": 0.0,
                            "agg0": int(rng.poisson(3) if rng.random() < 0.3 else 0),
                            "rows0": 0,
                        }
                    )
        self.g.sort(key=lambda d: d["gid"])
        n = len(self.g)
        # fleet noise: a steady low background of correctable errors on a quarter of the boards
        for d in self.g:
            if rng.random() < 0.25:
                d["sbe_bg"] = rng.lognormal(math.log(0.05), 1.0)
        # hot-but-healthy: top-of-rack boards running hot but stable
        tops = [d for d in self.g if d["node"]["slot"] == d["node"]["per_rack"] - 1]
        n_hot = max(1, round(0.03 * n)) if n >= 16 else 0
        for i in rng.permutation(len(tops))[:n_hot]:
            d = tops[int(i)]
            d["hot"] = True
            d["inlet_off"] += rng.uniform(3.5, 6.0)
            d["rth"] *= rng.uniform(1.05, 1.15)
            self._trap("hot_healthy", d["node"]["name"], d["idx"], T0, fl.t_end)
        free = [d for d in self.g if not d["hot"]]
        # ECC lemons: steady background SBE for the whole trace, never fail
        n_lemon = max(1, round(0.04 * n)) if n >= 16 else 0
        for i in rng.permutation(len(free))[:n_lemon]:
            d = free[int(i)]
            d["lemon"] = True
            d["sbe_bg"] = rng.lognormal(math.log(8.0), 0.9)
            d["agg0"] = int(rng.integers(800, 90000))
            d["rows0"] = int(rng.integers(1, 6))
            self._trap(
                "ecc_lemon", d["node"]["name"], d["idx"], T0, fl.t_end, sbe_per_h=round(d["sbe_bg"], 2)
            )
        # PCIe replay chatter on one server SKU, per node
        for nd in fl.nodes:
            if nd["chassis"] in CHATTER_CHASSIS:
                for gi in nd["gpus"]:
                    self.g[gi]["pcie_chatter"] = rng.lognormal(math.log(6.0), 0.8)
                self._trap("pcie_replay_chatter", nd["name"], None, T0, fl.t_end, server_sku=nd["chassis"])
        # NVLink CRC noise on some SXM boards
        for d in self.g:
            if SKUS[d["node"]["sku"]][11] and rng.random() < 0.10:
                d["nvl_noise"] = True
                self._trap("nvlink_crc_noise", d["node"]["name"], d["idx"], T0, fl.t_end)
        # failures
        rate = self.failure_rate
        n_fail = int(rng.poisson(rate * n * self.days / 1000.0))
        eligible = [d for d in self.g if not d["hot"] and not d["lemon"]]
        order = rng.permutation(len(eligible))[: min(n_fail, len(eligible))]
        for i in order:
            d = eligible[int(i)]
            sxm = SKUS[d["node"]["sku"]][11]
            names = [c for c in CLASSES if sxm or c != "nvlink"]
            w = np.array([CLASSES[c][0] for c in names])
            cls = str(rng.choice(names, p=w / w.sum()))
            _, ab_share, med_h, p_repl = CLASSES[cls]
            abrupt = bool(rng.random() < ab_share)
            ft = T0 + rng.uniform(2 * 3600.0, self.days * 86400.0 - 600.0)
            pre_h = None if abrupt else _lognormal_h(rng, med_h, 0.9, 0.5, 96.0)
            d["fail"] = {
                "cls": cls,
                "abrupt": abrupt,
                "ft": ft,
                "pre_h": pre_h,
                "ps": None if abrupt else ft - pre_h * 3600.0,
                "s": float(10 ** rng.uniform(-1.7, 0.0)),
                "repair_h": _lognormal_h(rng, 40.0, 0.7, 6.0, 240.0),
                "replaced": bool(rng.random() < p_repl),
                "dead": int(rng.integers(1, 5)) if cls == "gsp_hang" else int(rng.integers(0, 2)),
            }
        # benign SBE bursts on healthy, non-lemon boards
        healthy = [d for d in eligible if d["fail"] is None]
        for _ in range(int(rng.poisson(n * self.days / 250.0)) if healthy else 0):
            d = healthy[int(rng.integers(len(healthy)))]
            s = T0 + rng.uniform(0, self.days * 86400.0 - 3600.0)
            d["bursts"].append(
                (s, s + rng.uniform(120, 1800), int(rng.integers(20, 500)), rng.random() < 0.5)
            )
        # tenant application XIDs
        for d in self.g:
            for s in d["sess"]:
                if s["end"] < T0 or s["start"] > fl.t_end or rng.random() > 0.15 / d["usz"]:
                    continue
                for _ in range(int(rng.integers(1, 4))):
                    t = rng.uniform(max(s["start"], T0), min(s["end"], fl.t_end))
                    x = int(rng.choice(APP_XIDS[0], p=APP_XIDS[1]))
                    d["app_xids"].append((t, x, s))

    # ------------------------------------------------------------------ per-GPU simulation
    def _simulate(self, d):
        rng, fl = self.rng, self.fleet
        nd = d["node"]
        h = nd["hall"]
        spec = SKUS[nd["sku"]]
        name, fb, tdp, idle_w, sm_max, sm_idle, mclk, mclk_idle, _, slow, memk, sxm, nvbw, _ = spec
        profile = HALLS[h][3]
        base = fl.interval[h]
        t_end = fl.t_end
        # sample grid with jitter and the odd late scrape
        n_est = int((t_end - T0) / base * 1.08) + 16
        dt = base * (1.0 + 0.03 * rng.standard_normal(n_est))
        late = rng.random(n_est) < 0.004
        dt[late] += base * rng.uniform(0.2, 1.0, late.sum())
        ts = T0 + rng.uniform(0, base) + np.cumsum(np.clip(dt, 0.3 * base, None))
        ts = np.round(ts[ts < t_end], 3)
        n = len(ts)
        dts = np.diff(ts, prepend=ts[0] - base)
        keep = np.ones(n, bool)
        # tenancy
        sess = d["sess"]
        st = np.array([s["start"] for s in sess])
        en = np.array([s["end"] for s in sess])
        si = np.clip(np.searchsorted(st, ts, "right") - 1, 0, len(sess) - 1)
        active = (ts >= st[si]) & (ts < en[si])
        resets = [s["start"] for s in sess[1:] if T0 <= s["start"] < t_end]
        for s in sess[1:]:
            if s["down"] and T0 <= s["start"] < t_end:
                keep &= ~((ts >= s["start"]) & (ts < s["start"] + s["down"]))
        for a, b in fl.scrape_gaps[h]:
            keep &= ~((ts >= a) & (ts < b))
        for a, b in fl.exporter_restarts[nd["name"]]:
            keep &= ~((ts >= a) & (ts < b))
        # failure plan on the grid
        f = d["fail"]
        replace_t = []
        fi = -1
        if f is not None:
            fi = int(np.searchsorted(ts, f["ft"]))
            if fi >= n:
                d["fail"] = f = None
                fi = -1
        if f is not None:
            ftt = float(ts[fi])
            f["ts"] = ftt
            rt = ftt + f["repair_h"] * 3600.0
            last_dead = min(n - 1, fi + f["dead"])
            keep[fi : last_dead + 1] = True
            keep &= ~((ts > ts[last_dead]) & (ts < rt))
            resets.append(rt)
            if f["replaced"]:
                replace_t.append(rt)
                d["uuid"].append(_uuid(rng))
        resets = np.sort(np.array(resets, float))
        ep = np.searchsorted(resets, ts, "right")
        bd = np.searchsorted(np.array(replace_t, float), ts, "right")
        # precursor progress 0..1
        prog = np.zeros(n)
        pre = np.zeros(n, bool)
        if f is not None and not f["abrupt"]:
            pre = (ts >= f["ps"]) & (ts < f["ts"])
            prog[pre] = (ts[pre] - f["ps"]) / (f["ts"] - f["ps"])
        cls = f["cls"] if f is not None else None
        s_str = f["s"] if f is not None else 0.0
        # ---------------- load
        lvl = np.array([s["lvl"] for s in sess])[si]
        kind = np.array([list(WORKLOADS).index(s["kind"]) for s in sess])[si]
        noise = rng.standard_normal(n)
        diur = _diurnal(ts, 15.0)
        u = np.select(
            [kind == 0, kind == 1, kind == 2],
            [
                lvl * (0.15 + 0.85 * diur) * (1 + 0.12 * noise),
                lvl
                * (0.95 + 0.03 * noise)
                * np.where((ts % np.array([s["period"] for s in sess])[si]) < 90, 0.1, 1),
                lvl
                * (np.sin(2 * np.pi * ts / np.array([s["period"] * 3 for s in sess])[si]) > -0.2)
                * (0.9 + 0.08 * noise),
            ],
            lvl * rng.exponential(0.5, n),
        )
        u = np.where(active, np.clip(u, 0.0, 1.0), 0.0)
        busy = u > 0.02
        # ---------------- power
        cap_frac = np.array([s["cap"] for s in sess])[si]
        cap = np.where(active & (cap_frac > 0), cap_frac * tdp, tdp)
        pint = np.array([s["pint"] for s in sess])[si]
        demand = idle_w + (tdp - idle_w) * u**0.85 * pint * (1 + 0.015 * rng.standard_normal(n))
        capped = busy & (demand > cap * 0.98)
        power = np.minimum(demand, cap * (1 + 0.004 * rng.standard_normal(n)))
        power = np.where(busy, power, idle_w * (1 + 0.03 * rng.standard_normal(n)))
        brake = np.zeros(n, bool)
        if cls == "power_supply" and pre.any():
            rate = s_str * 6.0 * prog**2  # brief power-brake events per hour, rising to the failure
            brake = pre & (rng.random(n) < rate * dts / 3600.0)
            power = power * (1 + s_str * 0.06 * prog * rng.standard_normal(n))
            power[brake] *= rng.uniform(0.3, 0.6, brake.sum())
        # ---------------- temperature
        inlet = HALLS[h][2] + d["inlet_off"] + 1.0 * _diurnal(ts, 16.0) + 0.2 * rng.standard_normal(n)
        for a, ramp, b, rec, amp in fl.chiller[h]:
            inlet += amp * _trapezoid(ts, a, ramp, b, rec)
        rth = np.full(n, d["rth"])
        if cls == "thermal":
            rth = rth * (1 + s_str * 0.6 * prog**1.5)  # degC per W creeps up: fan or heatsink wear
        temp = inlet + rth * power + 0.7 * rng.standard_normal(n)
        sw_therm = temp > slow
        hw_therm = temp > slow + 5
        # ---------------- clocks
        sm = np.where(busy, sm_max * (1 - 0.22 * np.clip((demand - cap) / cap, 0, 1)), sm_idle)
        sm = np.where(sw_therm, sm * 0.86, sm)
        sm = np.where(hw_therm | brake, sm * 0.55, sm)
        sm = (np.round(sm / 15.0) * 15).astype(np.int64)
        memclk = np.where(busy | (memk == "HBM"), mclk, mclk_idle).astype(np.int64)
        reasons = (
            np.where(~busy, B_IDLE, 0)
            | np.where(capped, B_SWPOWER, 0)
            | np.where(sw_therm, B_SWTHERM, 0)
            | np.where(hw_therm, B_HWTHERM | B_HWSLOW, 0)
            | np.where(brake, B_BRAKE | B_HWSLOW, 0)
        )
        # ---------------- utilisation and memory
        util = np.clip(np.round(100 * (u * 1.04 + 0.02 * rng.standard_normal(n) * busy)), 0, 100).astype(
            np.int64
        )
        dram = np.array([s["dram"] for s in sess])[si] * u
        mcu = np.clip(np.round(100 * dram * (1 + 0.05 * noise)), 0, 100).astype(np.int64)
        tensor = np.array([s["tensor"] for s in sess])[si] * u
        gr = np.clip(u * 0.98 + 0.01 * rng.standard_normal(n), 0, 1) * busy
        reserved = int(fb * 0.012)
        used = np.where(active, np.array([s["mem"] for s in sess])[si] * (fb - reserved), 0.0)
        used = np.where(active, used + 40 * rng.standard_normal(n), 0).clip(0, fb - reserved).astype(np.int64)
        used = np.maximum(used, 3)
        free = fb - reserved - used
        # ---------------- counters (increments per sample)
        energy = _seg_cumsum(np.round(power * dts * 1000.0).astype(np.int64), ep)
        pviol = _seg_cumsum(np.where(capped | brake, np.round(dts * 1e9 * 0.8), 0).astype(np.int64), ep)
        tviol = _seg_cumsum(
            np.where(sw_therm, np.round(dts * 1e9 * np.clip((temp - slow) / 4, 0.1, 1)), 0).astype(np.int64),
            ep,
        )
        load_f = 0.3 + 0.7 * u
        sbe_rate = d["sbe_bg"] * load_f
        if cls == "memory":
            sbe_rate = sbe_rate + pre * (s_str * (3.0 + 400.0 * prog**3)) * load_f
        sbe_inc = rng.poisson(sbe_rate * dts / 3600.0).astype(np.int64)
        remap_ev = np.zeros(n, np.int64)
        xid_ev = np.zeros(n, np.int64)
        # benign bursts
        for a, b, cnt, remap in d["bursts"]:
            w = np.flatnonzero((ts >= a) & (ts < b))
            if len(w) == 0:
                continue
            sbe_inc[w] += rng.multinomial(cnt, np.full(len(w), 1.0 / len(w)))
            if remap:
                remap_ev[w[-1]] += 1
                xid_ev[w[-1]] = 63
            self._trap("benign_sbe_burst", nd["name"], d["idx"], ts[w[0]], ts[w[-1]], count=int(cnt))
        if d["lemon"]:
            for t in rng.uniform(T0, t_end, rng.poisson(self.days / 10.0)):
                j = min(n - 1, int(np.searchsorted(ts, t)))
                remap_ev[j] += 1
                xid_ev[j] = 63
        if cls == "memory" and pre.any():
            pi = np.flatnonzero(pre)
            for _ in range(int(rng.poisson(0.5 + 4 * s_str))):
                j = pi[min(len(pi) - 1, int(len(pi) * math.sqrt(rng.random())))]
                remap_ev[j] += 1
                xid_ev[j] = 63
            hi = pre & (sbe_inc >= 25) & (rng.random(n) < 0.3)
            xid_ev[hi] = 92  # high single-bit error rate
        dbe_inc = np.zeros(n, np.int64)
        unc_ev = np.zeros(n, np.int64)
        remap_fail = np.zeros(n, np.int64)
        # NVLink
        crc = np.zeros(n)
        if sxm:
            crc = crc + 0.02 * busy
            if d["nvl_noise"]:
                crc = crc + np.where(rng.random(n) < 0.2 * dts / 3600.0, rng.uniform(50, 3000, n), 0.0)
            if cls == "nvlink":
                crc = crc + pre * s_str * 2000.0 * prog**2
        crc_inc = rng.poisson(crc * dts / 3600.0).astype(np.int64)
        crcd_inc = rng.binomial(crc_inc, 0.2).astype(np.int64)
        rep_inc = rng.binomial(crc_inc, 0.5).astype(np.int64)
        rec_inc = np.zeros(n, np.int64)
        if cls == "nvlink" and pre.any():
            rec_inc += rng.poisson(pre * s_str * 3.0 * prog**3 * dts / 3600.0).astype(np.int64)
        # PCIe
        prate = 0.01 + d["pcie_chatter"] * load_f
        if cls == "pcie":
            prate = prate + pre * s_str * 3000.0 * prog**3
        pcie_inc = rng.poisson(prate * dts / 3600.0).astype(np.int64)
        irregular = {}
        if cls in ("pcie", "gsp_hang") and pre.any():
            flaky = pre & (rng.random(n) < s_str * 0.25 * prog)  # slow or failed scrapes before a hang
            keep &= ~flaky
        gsp_blank = np.zeros(n, bool)
        if cls == "gsp_hang" and pre.any():
            gsp_blank = pre & (rng.random(n) < s_str * 0.15 * prog)
        # app XIDs
        for t, x, s in d["app_xids"]:
            j = int(np.searchsorted(ts, t))
            if j >= n or (fi >= 0 and j >= fi):
                continue
            xid_ev[j] = x
            if x == 45 and j > 0:
                xid_ev[j - 1] = 43
            nxt = resets[resets > ts[j]]
            self._trap(
                "tenant_app_xid",
                nd["name"],
                d["idx"],
                ts[j],
                nxt[0] if len(nxt) else t_end,
                xid=x,
                job=s["job"],
            )
        # sympathetic 74 from a failing peer
        for t in d["sym74"]:
            j = int(np.searchsorted(ts, t))
            if j < n and (fi < 0 or j < fi):
                xid_ev[j] = 74
                crc_inc[j] += int(rng.integers(5, 200))
                rep_inc[j] += int(rng.integers(1, 30))
                keep[j] = True
        # ---------------- failure sample
        fail_over = {}
        if f is not None:
            x = 0
            if cls == "memory":
                dbe_inc[fi] += int(rng.integers(1, 4))
                unc_ev[fi] += 1
                x = int(rng.choice([48, 94, 95], p=[0.35, 0.35, 0.3]))
                if memk == "HBM" and rng.random() < 0.25:
                    remap_fail[fi:] = 1
                    x = 64
            elif cls == "nvlink":
                crc_inc[fi] += int(rng.integers(500, 50000))
                rep_inc[fi] += int(rng.integers(100, 5000))
                rec_inc[fi] += int(rng.integers(1, 6))
                x = 74
            elif cls == "thermal":
                temp[fi] = slow + rng.uniform(8, 14)
                reasons[fi] |= B_HWTHERM | B_HWSLOW
                sm[fi] = int(sm_max * 0.3)
                x = 79 if rng.random() < 0.5 else 0
            elif cls == "pcie":
                pcie_inc[fi] += int(rng.integers(50, 5000))
                x = 79
                fail_over = {"blank": True}
            elif cls == "gsp_hang":
                x = int(rng.choice([119, 120]))
                fail_over = {"blank": True}
            elif cls == "power_supply":
                x = int(rng.choice([79, 62], p=[0.6, 0.4]))
                reasons[fi] |= B_BRAKE | B_HWSLOW
                power[fi] = idle_w * rng.uniform(0.2, 0.8)
            xid_ev[fi] = x
            f["xid"] = x
            f["uuid"] = d["uuid"][0]
        # ---------------- ECC / remap bookkeeping
        sbe_vol = _seg_cumsum(sbe_inc, ep)
        dbe_vol = _seg_cumsum(dbe_inc, ep)
        agg0 = np.array([d["agg0"]] + [0] * len(replace_t), np.int64)[bd]
        sbe_agg = agg0 + _seg_cumsum(sbe_inc, bd)
        dbe_agg = _seg_cumsum(dbe_inc, bd)
        n_ep = int(ep.max()) + 2

        def applied(ev):
            """Remaps/retirements become effective at the next reset on the same board."""
            per_ep = np.bincount(ep, weights=ev, minlength=n_ep).astype(np.int64)
            starts = np.flatnonzero(np.r_[True, ep[1:] != ep[:-1]])
            inc = np.zeros(n, np.int64)
            for k in starts[1:]:
                if bd[k] == bd[k - 1]:
                    inc[k] = per_ep[ep[k - 1]]
            return _seg_cumsum(inc, bd)

        pending = (_seg_cumsum(remap_ev + unc_ev, ep) > 0).astype(np.int64)
        rows0 = np.array([d["rows0"]] + [0] * len(replace_t), np.int64)[bd]
        corr_rows = rows0 + applied(remap_ev)
        unc_rows = applied(unc_ev)
        remap_fail = np.where(bd > 0, 0, remap_fail)  # a replacement board starts clean
        xid = _sticky(xid_ev, ep)
        if f is not None and f["xid"]:
            xid[fi : min(n, fi + f["dead"] + 1)] = f["xid"]
        cols = {
            M + "SM_CLOCK": sm,
            M + "MEM_CLOCK": memclk,
            M + "MEMORY_TEMP": (
                np.round(temp + 3 + 9 * dram).astype(np.int64)
                if nd["sku"] not in ("a10g", "l4")
                else np.full(n, INT_BLANK, np.int64)
            ),
            M + "GPU_TEMP": np.round(temp).astype(np.int64),
            M + "POWER_USAGE": power,
            M + "TOTAL_ENERGY_CONSUMPTION": energy,
            M + "PCIE_REPLAY_COUNTER": _seg_cumsum(pcie_inc, ep),
            M + "GPU_UTIL": util,
            M + "MEM_COPY_UTIL": mcu,
            M + "XID_ERRORS": xid,
            M + "FB_FREE": free,
            M + "FB_USED": used,
            M + "CLOCKS_EVENT_REASONS": reasons.astype(np.int64),
            M + "POWER_VIOLATION": pviol,
            M + "THERMAL_VIOLATION": tviol,
            M + "ECC_SBE_VOL_TOTAL": sbe_vol,
            M + "ECC_DBE_VOL_TOTAL": dbe_vol,
            M + "ECC_SBE_AGG_TOTAL": sbe_agg,
            M + "ECC_DBE_AGG_TOTAL": dbe_agg,
            P + "GR_ENGINE_ACTIVE": gr,
            P + "PIPE_TENSOR_ACTIVE": tensor,
            P + "DRAM_ACTIVE": dram,
        }
        if memk == "HBM":
            cols[M + "UNCORRECTABLE_REMAPPED_ROWS"] = unc_rows
            cols[M + "CORRECTABLE_REMAPPED_ROWS"] = corr_rows
            cols[M + "ROW_REMAP_FAILURE"] = remap_fail
            cols[M + "ROW_REMAP_PENDING"] = pending
        else:
            enc = (
                np.array([s["kind"] == "inference" and (hash_small(s["job"]) % 3 == 0) for s in sess])[si] * u
            )
            cols[M + "ENC_UTIL"] = np.round(40 * enc).astype(np.int64)
            cols[M + "DEC_UTIL"] = np.round(70 * enc).astype(np.int64)
            cols[M + "RETIRED_SBE"] = corr_rows
            cols[M + "RETIRED_DBE"] = unc_rows
            cols[M + "RETIRED_PENDING"] = pending
        if sxm:
            cols[M + "NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"] = _seg_cumsum(crc_inc, ep)
            cols[M + "NVLINK_CRC_DATA_ERROR_COUNT_TOTAL"] = _seg_cumsum(crcd_inc, ep)
            cols[M + "NVLINK_REPLAY_ERROR_COUNT_TOTAL"] = _seg_cumsum(rep_inc, ep)
            cols[M + "NVLINK_RECOVERY_ERROR_COUNT_TOTAL"] = _seg_cumsum(rec_inc, ep)
            nvl = np.array([s["nvl"] for s in sess])[si] * u * nvbw * 1e3 * dts  # MB moved per sample
            cols[M + "NVLINK_BANDWIDTH_TOTAL"] = _seg_cumsum(np.round(nvl).astype(np.int64), ep)
        # occasional blank readings (sensor read timeouts), more during a GSP precursor
        blank_t = gsp_blank | (rng.random(n) < 0.0015)
        cols[M + "GPU_TEMP"] = np.where(gsp_blank, INT_BLANK, cols[M + "GPU_TEMP"])
        cols[M + "MEMORY_TEMP"] = np.where(blank_t, INT_BLANK, cols[M + "MEMORY_TEMP"])
        keys = _metric_keys(nd["sku"], profile)
        # irregular rows: partial scrapes (a field group missing), failure and dead rows
        part = np.flatnonzero(keep & (rng.random(n) < 0.002))
        groups = [
            [k for k in keys if k.startswith(P)],
            [k for k in keys if "NVLINK" in k],
            [k for k in keys if "ECC" in k or "REMAP" in k or "RETIRED" in k],
            [M + "POWER_USAGE"],
        ]
        groups = [g for g in groups if g]
        for j in part.tolist():
            irregular[j] = {"drop": groups[int(rng.integers(len(groups)))]}
        if f is not None:
            last = min(n - 1, fi + f["dead"])
            for j in range(fi, last + 1):
                if fail_over.get("blank") or j > fi:
                    drop = [k for k in keys if k.startswith(P) or k in (M + "ENC_UTIL", M + "DEC_UTIL")]
                    irregular[j] = {
                        "drop": drop,
                        "blank": [
                            M + "GPU_TEMP",
                            M + "MEMORY_TEMP",
                            M + "SM_CLOCK",
                            M + "MEM_CLOCK",
                            M + "GPU_UTIL",
                            M + "MEM_COPY_UTIL",
                            M + "FB_FREE",
                            M + "FB_USED",
                        ],
                    }
        # compact to kept rows
        kidx = np.flatnonzero(keep)
        remap_idx = -np.ones(n, np.int64)
        remap_idx[kidx] = np.arange(len(kidx))
        irr = {int(remap_idx[j]): v for j, v in irregular.items() if keep[j]}
        jobidx = np.where(active, si, -1)
        out = {
            "ts": ts[kidx],
            "board": bd[kidx].astype(np.int8),
            "job": jobidx[kidx].astype(np.int32),
            "keys": keys,
            "irr": irr,
            "cols": [
                (
                    cols[k][kidx].astype(np.float32)
                    if k in FLOAT_KEYS and k != M + "POWER_USAGE"
                    else cols[k][kidx]
                )
                for k in keys
            ],
        }
        return out

    # ------------------------------------------------------------------ orchestration
    def run(self, out_dir):
        fl = self.fleet
        # sympathetic XID 74 for NVLink failures: peers on the same board log it too
        for d in self.g:
            f = d["fail"]
            if f is not None and f["cls"] == "nvlink":
                peers = [self.g[gi] for gi in d["node"]["gpus"] if gi != d["gid"]]
                k = min(len(peers), int(self.rng.integers(1, 4)))
                for i in self.rng.permutation(len(peers))[:k]:
                    p = peers[int(i)]
                    t = f["ft"] + float(self.rng.uniform(0, 90))
                    p["sym74"].append(t)
                    self._trap(
                        "sympathetic_xid74", p["node"]["name"], p["idx"], t, t + 300.0, peer_gpu=d["idx"]
                    )
        sims = [self._simulate(d) for d in self.g]
        # hall-level trap records, one per node
        for nd in fl.nodes:
            for a, _ramp, b, rec, amp in fl.chiller[nd["hall"]]:
                self._trap(
                    "chiller_trip",
                    nd["name"],
                    None,
                    a,
                    b + rec,
                    hall=HALLS[nd["hall"]][0],
                    amp_c=round(amp, 1),
                )
            for a, b in fl.scrape_gaps[nd["hall"]]:
                self._trap("scrape_gap", nd["name"], None, a, b, hall=HALLS[nd["hall"]][0])
            for a, b in fl.exporter_restarts[nd["name"]]:
                self._trap("exporter_restart", nd["name"], None, a, b)
        rows = self._write_trace(os.path.join(out_dir, "trace.jsonl.gz"), sims)
        fails = []
        for d in self.g:
            f = d["fail"]
            if f is None:
                continue
            rec = {
                "kind": "failure",
                "ts": f["ts"],
                "node": d["node"]["name"],
                "gpu": d["idx"],
                "class": f["cls"],
                "abrupt": f["abrupt"],
                "precursor_start_ts": None if f["abrupt"] else round(f["ps"], 3),
                "precursor_h": None if f["abrupt"] else round(f["pre_h"], 3),
                "model": SKUS[d["node"]["sku"]][0],
                "uuid": f["uuid"],
                "xid": f["xid"] or None,
                "strength": None if f["abrupt"] else round(f["s"], 4),
                "repair_end_ts": round(f["ts"] + f["repair_h"] * 3600.0, 3),
                "replaced": f["replaced"],
                "new_uuid": d["uuid"][1] if f["replaced"] else None,
            }
            fails.append(rec)
        fails.sort(key=lambda r: (r["ts"], r["node"], r["gpu"]))
        self.traps.sort(key=lambda r: (r["ts"], r["type"], r["node"], -1 if r["gpu"] is None else r["gpu"]))
        with open(os.path.join(out_dir, "labels.jsonl"), "w") as fh:
            for r in fails + self.traps:
                fh.write(json.dumps(r) + "\n")
        by_cls, traps = {}, {}
        for r in fails:
            k = r["class"]
            by_cls.setdefault(k, {"abrupt": 0, "precursor": 0})
            by_cls[k]["abrupt" if r["abrupt"] else "precursor"] += 1
        for r in self.traps:
            traps[r["type"]] = traps.get(r["type"], 0) + 1
        return {
            "rows": rows,
            "gpus": fl.n_gpus,
            "nodes": len(fl.nodes),
            "failures": len(fails),
            "with_precursor": sum(not r["abrupt"] for r in fails),
            "failures_by_class": by_cls,
            "traps": traps,
            "start_ts": T0,
            "end_ts": fl.t_end,
        }

    def _write_trace(self, path, sims):
        fl = self.fleet
        tmpl = []
        for d, sm in zip(self.g, sims, strict=True):
            nd = d["node"]
            head = (
                f'{{"ts": %.3f, "node": "{nd["name"]}", "gpu": {d["idx"]}, "uuid": "%s", '
                f'"model": "{SKUS[nd["sku"]][0]}", "rack": "{nd["rack"]}", '
                f'"site": "{REGION}-{HALLS[nd["hall"]][0]}"'
            )
            body = ', "metrics": {' + ", ".join(f'"{k}": {FMT.get(k, "%d")}' for k in sm["keys"]) + "}}"
            tmpl.append((head + ', "job": "%s", "rank": %d' + body, head + body))
        chunk = 6 * 3600.0
        rows = 0
        with (
            open(path, "wb") as raw,
            gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=3) as gz,
        ):
            t = T0
            while t < fl.t_end:
                t2 = t + chunk
                all_ts, all_gid, lines = [], [], []
                for d, sm, (ta, tb) in zip(self.g, sims, tmpl, strict=True):
                    lo, hi = np.searchsorted(sm["ts"], [t, t2])
                    if hi <= lo:
                        continue
                    seg_ts = sm["ts"][lo:hi]
                    job = sm["job"][lo:hi]
                    bd = sm["board"][lo:hi]
                    cols = [c[lo:hi] for c in sm["cols"]]
                    out = [None] * (hi - lo)
                    uu = d["uuid"]
                    sess = d["sess"]
                    act = job >= 0
                    for mask, tm, with_job in ((act, ta, True), (~act, tb, False)):
                        ii = np.flatnonzero(mask)
                        if not len(ii):
                            continue
                        parts = [seg_ts[ii].tolist(), [uu[b] for b in bd[ii].tolist()]]
                        if with_job:
                            parts += [[sess[j]["job"] for j in job[ii].tolist()], [d["rank"]] * len(ii)]
                        parts += [c[ii].tolist() for c in cols]
                        for k, row in zip(ii.tolist(), zip(*parts, strict=True), strict=True):
                            out[k] = tm % row
                    for j, spec in sm["irr"].items():
                        if lo <= j < hi:
                            out[j - lo] = self._irregular(d, sm, j, spec)
                    all_ts.append(seg_ts)
                    all_gid.append(np.full(hi - lo, d["gid"], np.int32))
                    lines.extend(out)
                if lines:
                    tsa = np.concatenate(all_ts)
                    order = np.lexsort((np.concatenate(all_gid), tsa))
                    gz.write(("\n".join([lines[i] for i in order.tolist()]) + "\n").encode())
                    rows += len(lines)
                t = t2
        return rows

    def _irregular(self, d, sm, j, spec):
        nd = d["node"]
        metrics = {}
        for k, c in zip(sm["keys"], sm["cols"], strict=True):
            v = c[j].item()
            if k in FLOAT_KEYS:
                v = round(float(v), 4 if k.startswith(P) else 3)
            metrics[k] = v
        for k in spec.get("drop", []):
            metrics.pop(k, None)
        for k in spec.get("blank", []):
            if k in metrics:
                metrics[k] = INT_BLANK
        rec = {
            "ts": round(float(sm["ts"][j]), 3),
            "node": nd["name"],
            "gpu": d["idx"],
            "uuid": d["uuid"][int(sm["board"][j])],
            "model": SKUS[nd["sku"]][0],
            "rack": nd["rack"],
            "site": f"{REGION}-{HALLS[nd['hall']][0]}",
        }
        if sm["job"][j] >= 0:
            rec["job"] = d["sess"][int(sm["job"][j])]["job"]
            rec["rank"] = d["rank"]
        rec["metrics"] = metrics
        return json.dumps(rec)


def hash_small(s: str) -> int:
    """Stable small hash (Python's hash() is salted per process)."""
    v = 0
    for ch in s:
        v = (v * 131 + ord(ch)) % 1000003
    return v


def generate(
    out_dir,
    seed: int,
    gpus: int = 256,
    days: float = 14.0,
    interval_s: float = 60.0,
    failure_rate: float = 30.0,
) -> dict:
    """Write trace.jsonl.gz and labels.jsonl into out_dir; return a summary dict."""
    os.makedirs(out_dir, exist_ok=True)
    gen = _Gen(int(seed), int(gpus), float(days), float(interval_s), float(failure_rate))
    summary = gen.run(out_dir)
    summary.update(
        {
            "seed": int(seed),
            "days": float(days),
            "interval_s": float(interval_s),
            "failure_rate_per_1000_gpu_days": float(failure_rate),
            "out_dir": str(out_dir),
        }
    )
    return summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Seeded public-cloud GPU fleet telemetry with labelled failures."
    )
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--gpus", type=int, default=256)
    ap.add_argument("--days", type=float, default=14.0)
    ap.add_argument(
        "--interval", type=float, default=60.0, help="base scrape interval (s); halls vary around it"
    )
    ap.add_argument("--failures-per-1000-gpu-days", type=float, default=30.0, dest="rate")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    s = generate(a.out, a.seed, a.gpus, a.days, a.interval, a.rate)
    s["elapsed_s"] = round(time.perf_counter() - t, 2)
    print(json.dumps(s, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
