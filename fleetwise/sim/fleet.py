"""The simulated fleet: nodes in racks and sites, GPUs with their static physical parameters."""

from __future__ import annotations

import math
import uuid as uuidlib
from dataclasses import dataclass

import numpy as np

from fleetwise.catalog import GpuSpec
from fleetwise.sim.config import SimConfig, nvml_name, parse_gpu_spec

# Max SM / memory clocks (MHz) per family as `nvidia-smi -q` "Max Clocks" reports them for the
# reference part: V100-SXM2 1530/877, T4 1590/5001, A100-SXM4 1410/1593, L40S 2520/9001,
# H100 SXM 1980/2619 (matches ../shared/data/dcgm/sample-metrics.prom). Blackwell and Rubin are
# estimates (no published nvidia-smi dump at hand).
FAMILY_CLOCKS_MHZ: dict[str, tuple[int, int]] = {
    "volta": (1530, 877),
    "turing": (1590, 5001),
    "ampere": (1410, 1593),
    "ada": (2520, 9001),
    "hopper": (1980, 2619),
    "blackwell": (1965, 3996),  # estimate
    "rubin": (2000, 4000),  # estimate
}
IDLE_SM_CLOCK_MHZ = 345  # idle H100 in sample-metrics.prom
# `nvidia-smi -q` Temperature section of A100/H100 SXM: "GPU Max Operating Temp 87 C" (the software
# thermal target, SwThermal) and "GPU Slowdown Temp 89-90 C" (HW slowdown). Used for all families
# (approximation: V100 lists 87 C slowdown too).
SW_THERMAL_C = 87.0
HW_SLOWDOWN_C = 89.5
# Design temperature rise die-over-inlet at TDP for air-cooled SXM boards (H100 at 700 W runs at
# ~65-75 C with 25 C inlet): our calibration, not a datasheet figure.
NOMINAL_RISE_C = 42.0  # SimConfig.cooling_rise_c default
# Idle power as a share of TDP (H100: ~70 W of 700 W, sample-metrics.prom shows 71 W idle).
IDLE_POWER_SHARE = 0.10
# ASHRAE A1 recommended inlet 18-27 C; room set points in that band.
SITE_INLET_C = (22.0, 24.0, 23.0, 25.0)
DIURNAL_AMPLITUDE_C = 1.5  # Llama 3 saw a 1-2% diurnal throughput swing from heat
HOT_SPOT_C = (3.0, 6.0)  # extra inlet at a hot-spot rack (recirculation)
# PCIe x16 bandwidth per direction by generation, GB/s (PCI-SIG: 16 / 32 / 64 / 128 GT/s lanes).
PCIE_GBS = {3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}


@dataclass
class Node:
    index: int
    name: str
    rack: str
    site: str
    rack_index: int
    site_index: int
    model: GpuSpec
    gpus: list[int]  # global GPU indexes, local index = position


def new_uuid(rng: np.random.Generator) -> str:
    """A GPU UUID in NVML's format, drawn from the seeded generator (deterministic)."""
    raw = bytes(rng.integers(0, 256, size=16, dtype=np.uint8).tolist())
    return "GPU-" + str(uuidlib.UUID(bytes=raw, version=4))


class Fleet:
    """Static layout and per-GPU parameters, as numpy arrays indexed by global GPU number."""

    def __init__(self, config: SimConfig, rng: np.random.Generator) -> None:
        self.config = config
        parts = parse_gpu_spec(config.gpus)
        self.models: list[GpuSpec] = []
        for spec, _ in parts:
            if spec not in self.models:
                self.models.append(spec)
        per_node = config.gpus_per_node
        self.nodes: list[Node] = []
        gpu_model: list[int] = []
        gpu_node: list[int] = []
        gpu_local: list[int] = []
        for spec, count in parts:
            remaining = count
            while remaining > 0:
                n = min(per_node, remaining)
                remaining -= n
                idx = len(self.nodes)
                first = len(gpu_model)
                self.nodes.append(
                    Node(idx, f"node-{idx:03d}", "", "", 0, 0, spec, list(range(first, first + n)))
                )
                gpu_model += [self.models.index(spec)] * n
                gpu_node += [idx] * n
                gpu_local += list(range(n))
        n_racks = max(1, math.ceil(len(self.nodes) / config.nodes_per_rack))
        sites = min(config.sites, n_racks)
        racks_per_site = math.ceil(n_racks / sites)
        for node in self.nodes:
            rack = node.index // config.nodes_per_rack
            node.rack_index = rack
            node.site_index = min(rack // racks_per_site, sites - 1)
            node.site = f"site-{node.site_index}"
            node.rack = f"{node.site}-rack-{rack:02d}"
        self.n_racks = n_racks
        self.n_sites = sites
        g = len(gpu_model)
        self.n_gpus = g
        self.gpu_model = np.array(gpu_model, dtype=np.int64)
        self.gpu_node = np.array(gpu_node, dtype=np.int64)
        self.gpu_local = np.array(gpu_local, dtype=np.int64)
        self.gpu_rack = np.array([self.nodes[n].rack_index for n in gpu_node], dtype=np.int64)
        self.gpu_site = np.array([self.nodes[n].site_index for n in gpu_node], dtype=np.int64)
        specs = [self.models[m] for m in gpu_model]
        self.tdp_w = np.array([s.tdp_w for s in specs], dtype=float)
        self.idle_w = self.tdp_w * IDLE_POWER_SHARE * rng.uniform(0.9, 1.1, g)
        self.max_sm_clock = np.array([FAMILY_CLOCKS_MHZ.get(s.family, (1500, 2000))[0] for s in specs], float)
        self.mem_clock = np.array([FAMILY_CLOCKS_MHZ.get(s.family, (1500, 2000))[1] for s in specs], float)
        self.memory_mib = np.array([s.memory_gb * 1e9 / 2**20 for s in specs], dtype=float)
        # Row remapping exists from Ampere on; Volta/Turing retire pages instead.
        self.has_remap = np.array([s.family not in ("volta", "turing") for s in specs], dtype=bool)
        self.has_nvlink = np.array([s.nvlink_gbs > 0 and s.nvlink_domain > 1 for s in specs], dtype=bool)

        # Inlet temperature: site set point + rack offset + hot-spot racks + node position.
        set_points = config.site_inlet_c or SITE_INLET_C
        self.site_inlet = np.array([set_points[i % len(set_points)] for i in range(sites)], dtype=float)
        # Sites in different time zones peak at different UTC hours.
        self.site_phase_h = np.array([15.0 - 6.0 * i for i in range(sites)])
        rack_off = rng.normal(0.0, config.rack_inlet_sd_c, n_racks)
        n_hot = int(round(config.hot_rack_share * n_racks))
        self.hot_racks = (
            np.sort(rng.choice(n_racks, size=n_hot, replace=False)) if n_hot else np.array([], int)
        )
        rack_off[self.hot_racks] += rng.uniform(*HOT_SPOT_C, size=len(self.hot_racks))
        self.rack_offset = rack_off
        node_off = rng.uniform(0.0, 2.0, len(self.nodes))  # higher in the rack runs warmer
        self.static_inlet = self.site_inlet[self.gpu_site] + rack_off[self.gpu_rack] + node_off[self.gpu_node]
        # Thermal resistance die-to-inlet, C/W: design rise over TDP, lognormal spread per board.
        lim = 0.18 * (config.board_r_sd / 0.07)  # +-2.6 sd
        spread = np.clip(rng.normal(0.0, config.board_r_sd, g), -lim, lim)
        self.r_base = config.cooling_rise_c / self.tdp_w * np.exp(spread)

        # Lemons and hot-but-healthy GPUs (disjoint).
        order = rng.permutation(g)
        n_lemon = int(round(config.lemon_share * g))
        self.lemon = np.zeros(g, dtype=bool)
        self.lemon[order[:n_lemon]] = True
        n_hot_h = int(round(config.hot_healthy_share * g))
        cool_rack = ~np.isin(self.gpu_rack, self.hot_racks)
        candidates = [i for i in order[n_lemon:] if cool_rack[i]]
        self.hot_healthy = np.zeros(g, dtype=bool)
        self.hot_healthy_excess_c = np.zeros(g)
        node_median_r = {n.index: float(np.median(self.r_base[n.gpus])) for n in self.nodes}
        for i in candidates[:n_hot_h]:
            # Poor airflow position: 7-12 C hotter than its node's typical board at 70% of TDP,
            # but kept below the thermal target at full TDP and the warmest inlet of the day, so
            # it never throttles.
            want_full = rng.uniform(*config.hot_healthy_excess_c) / 0.7
            ref_r = node_median_r[int(self.gpu_node[i])]
            hottest = self.static_inlet[i] + DIURNAL_AMPLITUDE_C + 1.0
            room = SW_THERMAL_C - 4.0 - hottest - self.tdp_w[i] * ref_r
            excess = max(5.0, min(want_full, room))
            self.r_base[i] = ref_r + excess / self.tdp_w[i]
            self.hot_healthy[i] = True
            self.hot_healthy_excess_c[i] = excess
        self.uuids: list[str] = [new_uuid(rng) for _ in range(g)]

        # Relative failure hazard: lemons x lemon_hazard_mult; hotter locations fail more (x2 per
        # 10 C of typical operating temperature, an Arrhenius-style rule of thumb; Titan ties
        # failures to heat and location). Hot-but-healthy GPUs are the trap: weight 0.
        typical_temp = self.static_inlet + 0.75 * self.tdp_w * self.r_base
        self.hazard = np.where(self.lemon, config.lemon_hazard_mult, 1.0) * 2.0 ** (
            (typical_temp - np.median(typical_temp)) / 10.0
        )
        self.hazard[self.hot_healthy] = 0.0

        # Domain randomisation (SimConfig knobs; all off by default): drawn from a generator of
        # their own so that the draws above, and the traces of default configs, do not change.
        xrng = np.random.default_rng([config.seed, 16])
        self.temp_offset = (xrng.normal(0.0, config.temp_offset_sd_c, g) if config.temp_offset_sd_c > 0
                            else np.zeros(g))
        # Per-GPU background error rates per day (healthy, lemon), each GPU's own multiple.
        self.bg_per_day: dict[str, np.ndarray] = {}
        for key, knob, default in (("sbe", config.bg_sbe_per_day, (0.05, 1.5)),
                                   ("pcie", config.bg_pcie_per_day, (0.2, 4.0)),
                                   ("nvl_flit", config.bg_nvl_per_day, (0.3, 6.0))):
            lo, hi = knob if knob is not None else default
            rate = np.where(self.lemon, hi, lo)
            if config.bg_rate_sd > 0:
                rate = rate * np.exp(xrng.normal(0.0, config.bg_rate_sd, g))
            self.bg_per_day[key] = rate

    # --- helpers ---------------------------------------------------------------------------
    def spec(self, gpu: int) -> GpuSpec:
        return self.models[int(self.gpu_model[gpu])]

    def node_of(self, gpu: int) -> Node:
        return self.nodes[int(self.gpu_node[gpu])]

    def nvlink_peers(self, gpu: int) -> list[int]:
        """Global indexes of the GPUs sharing gpu's NVLink domain inside its node."""
        if not self.has_nvlink[gpu]:
            return []
        node = self.node_of(gpu)
        domain = max(1, node.model.nvlink_domain)
        local = int(self.gpu_local[gpu])
        group = local // domain
        return [g for i, g in enumerate(node.gpus) if i // domain == group and g != gpu]

    def inventory(self, ts: float) -> list[dict]:
        """NodeInventory dicts (fleetwise.schemas.NodeInventory) at ts."""
        out = []
        for node in self.nodes:
            spec = node.model
            n = len(node.gpus)
            domain = max(1, spec.nvlink_domain)
            groups = (
                [list(range(s, min(n, s + domain))) for s in range(0, n, domain)]
                if spec.nvlink_gbs > 0 and domain > 1
                else []
            )
            gpus = []
            for local, g in enumerate(node.gpus):
                peers = [p for grp in groups if local in grp for p in grp if p != local]
                gpus.append(
                    {
                        "index": local,
                        "uuid": self.uuids[g],
                        "model": nvml_name(spec),
                        "memory_gb": spec.memory_gb,
                        "pci_bus_id": f"00000000:{0x18 + 0x10 * local:02X}:00.0",
                        "nvlink_peers": peers,
                    }
                )
            # One NIC per GPU (rail-optimised), speed by generation: NDR 400 Gb/s for Hopper and
            # newer, HDR 200 for Ampere, EDR 100 before (typical DGX/HGX builds).
            nic_gbps = {"hopper": 400.0, "blackwell": 400.0, "rubin": 800.0, "ampere": 200.0}.get(
                spec.family, 100.0
            )
            out.append(
                {
                    "ts": ts,
                    "node": node.name,
                    "rack": node.rack,
                    "site": node.site,
                    # Rack budget: its GPUs at TDP plus ~40% for CPUs, fans, NICs (our assumption).
                    "rack_power_budget_w": round(
                        1.4
                        * sum(self.tdp_w[g] for nd in self.nodes if nd.rack == node.rack for g in nd.gpus),
                        1,
                    ),
                    "gpus": gpus,
                    "nvlink_groups": groups,
                    "nvlink_gbs": spec.nvlink_gbs or None,
                    "pcie_gbs": PCIE_GBS.get(spec.pcie_gen, 32.0),
                    "nics": [
                        {"name": f"mlx5_{i}", "speed_gbps": nic_gbps, "kind": "infiniband", "rdma": True}
                        for i in range(n)
                    ],
                    "labels": {
                        "nvidia.com/gpu.product": spec.gfd_labels[0] if spec.gfd_labels else spec.id,
                        "nvidia.com/gpu.count": str(n),
                        "nvidia.com/gpu.memory": str(int(spec.memory_gb * 1e9 / 2**20)),
                        "nvidia.com/gpu.family": spec.family,
                        "fleetwise.io/catalog-id": spec.id,
                    },
                }
            )
        return out
