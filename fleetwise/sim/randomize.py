"""Families of simulator configurations for domain randomisation (issue 16).

A family is a set of parameter ranges; `family_config(family, index)` draws one `SimConfig`
from them with a seed of its own, so a family is reproducible member by member. Two families
matter to the failure predictor:

- "train": wide ranges around the simulator's calibration (sites, cooling, sensor noise,
  background error rates of healthy GPUs and lemons, link-replay noise, scrape defects,
  counter resets, trap rates and shapes, sample intervals of 10 s to 5 min). The packaged
  model is fitted on members of it, and its alert policy is tuned on other members of it.
- "shifted": never used for training or tuning. Ranges outside "train"'s or at its edges
  (hotter rooms, worse cooling, noisier sensors, more lemons with higher backgrounds,
  longer and larger benign single-bit bursts, more sympathetic XID 74, more replay noise and
  scrape defects, neighbour heating), another trap mix, GPU mixes of other models, and
  5-minute samples only. It is the evaluation that can fail.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fleetwise.sim.config import SimConfig


@dataclass(frozen=True)
class Family:
    """Parameter ranges (low, high) of one configuration family; a value drawn uniformly."""

    name: str
    mixes: tuple[str, ...]
    intervals_s: tuple[float, ...]
    ranges: dict[str, tuple[float, float]]
    seed_base: int
    class_mix: dict[str, float] | None = None  # failure classes' shares (None: the simulator's)


TRAIN = Family(
    name="train",
    mixes=(
        "h100-sxm:64,a100-sxm-80gb:64",
        "h200:64,a100-sxm-80gb:32,h100-sxm:32",
        "a100-sxm-80gb:96,h200:32",
    ),
    intervals_s=(10.0, 30.0, 60.0, 120.0, 300.0),
    ranges={
        "site_inlet": (19.0, 27.0),
        "rack_inlet_sd_c": (0.5, 2.0),
        "cooling_rise_c": (36.0, 48.0),
        "board_r_sd": (0.04, 0.12),
        "temp_noise_c": (0.2, 1.0),
        "temp_offset_sd_c": (0.0, 2.0),
        "power_noise": (0.005, 0.03),
        "neighbour_heat_c": (0.0, 4.0),
        "bg_sbe_healthy": (0.02, 0.3),
        "bg_sbe_lemon": (1.0, 8.0),
        "bg_pcie_healthy": (0.1, 1.0),
        "bg_pcie_lemon": (2.0, 10.0),
        "bg_nvl_healthy": (0.1, 1.0),
        "bg_nvl_lemon": (2.0, 10.0),
        "bg_rate_sd": (0.0, 1.0),
        "pcie_burst_rate_per_gpu_day": (0.0, 0.1),
        "nvl_burst_rate_per_gpu_day": (0.0, 0.1),
        "link_burst_size": (5.0, 40.0),
        "dcgm_blank_prob": (0.0, 0.003),
        "missing_counter_prob": (0.0, 0.003),
        "gpu_reset_rate_per_gpu_day": (0.0, 0.05),
        "lemon_share": (0.02, 0.06),
        "hot_healthy_share": (0.01, 0.04),
        "hot_excess_lo": (6.0, 9.0),
        "app_xid_rate": (30.0, 200.0),
        "benign_sbe_rate": (20.0, 120.0),
        "benign_total_hi": (40.0, 200.0),
        "benign_minutes_hi": (40.0, 180.0),
        "transient_xid74_rate": (2.0, 20.0),
        "xid74_peer_prob": (0.2, 0.7),
        "reboot_rate": (10.0, 80.0),
        "scrape_gap_rate": (0.5, 6.0),
        "missing_key_prob": (0.0, 0.01),
    },
    seed_base=1600,
)

SHIFTED = Family(
    name="shifted",
    mixes=(
        "b200:64,h100-sxm:32,v100-sxm2-32gb:32",
        "b300:64,h20:32,a100-sxm-40gb:32",
        "h200:32,b100:64,a100-sxm-80gb:32",
    ),
    intervals_s=(300.0,),
    ranges={
        "site_inlet": (25.0, 30.0),
        "rack_inlet_sd_c": (1.5, 3.0),
        "cooling_rise_c": (44.0, 52.0),
        "board_r_sd": (0.10, 0.16),
        "temp_noise_c": (0.8, 1.5),
        "temp_offset_sd_c": (1.5, 3.0),
        "power_noise": (0.02, 0.05),
        "neighbour_heat_c": (3.0, 6.0),
        "bg_sbe_healthy": (0.2, 0.6),
        "bg_sbe_lemon": (6.0, 15.0),
        "bg_pcie_healthy": (0.5, 2.0),
        "bg_pcie_lemon": (8.0, 20.0),
        "bg_nvl_healthy": (0.5, 2.0),
        "bg_nvl_lemon": (8.0, 20.0),
        "bg_rate_sd": (0.8, 1.5),
        "pcie_burst_rate_per_gpu_day": (0.08, 0.2),
        "nvl_burst_rate_per_gpu_day": (0.08, 0.2),
        "link_burst_size": (20.0, 60.0),
        "dcgm_blank_prob": (0.003, 0.01),
        "missing_counter_prob": (0.003, 0.01),
        "gpu_reset_rate_per_gpu_day": (0.03, 0.1),
        "lemon_share": (0.05, 0.10),
        "hot_healthy_share": (0.04, 0.08),
        "hot_excess_lo": (8.0, 11.0),
        "app_xid_rate": (150.0, 400.0),
        "benign_sbe_rate": (100.0, 250.0),
        "benign_total_hi": (150.0, 400.0),
        "benign_minutes_hi": (120.0, 360.0),
        "transient_xid74_rate": (15.0, 40.0),
        "xid74_peer_prob": (0.6, 0.9),
        "reboot_rate": (60.0, 150.0),
        "scrape_gap_rate": (4.0, 10.0),
        "missing_key_prob": (0.01, 0.02),
    },
    seed_base=2600,
)

# Training across the union of both: from "train"'s quiet end to "shifted"'s noisy one, on
# "train"'s GPU mixes (so GPU models stay a shift). Trained on, it makes the shifted family's
# parameter ranges in-distribution; "far" is then the evaluation that can fail.
WIDE = Family(
    name="wide",
    mixes=TRAIN.mixes,
    intervals_s=TRAIN.intervals_s,
    ranges={name: (min(lo, SHIFTED.ranges[name][0]), max(hi, SHIFTED.ranges[name][1]))
            for name, (lo, hi) in TRAIN.ranges.items()},
    seed_base=3600,
)

# Beyond "wide" on every noise and trap range (hotter rooms, worse cooling, noisier sensors,
# more and worse lemons, longer benign bursts, more scrape defects), another failure-class mix
# (more NVLink and thermal-interface failures), GPU models no training mix has, 5-minute samples.
FAR = Family(
    name="far",
    mixes=(
        "b200:64,h20:32,v100-sxm2-32gb:32",
        "b300:64,a100-sxm-40gb:32,b100:32",
        "b100:32,b200:32,v100-sxm2-32gb:32,h20:32",
    ),
    intervals_s=(300.0,),
    ranges={
        "site_inlet": (28.0, 32.0),
        "rack_inlet_sd_c": (2.5, 4.0),
        "cooling_rise_c": (50.0, 56.0),
        "board_r_sd": (0.14, 0.20),
        "temp_noise_c": (1.3, 2.0),
        "temp_offset_sd_c": (2.5, 4.0),
        "power_noise": (0.04, 0.07),
        "neighbour_heat_c": (5.0, 8.0),
        "bg_sbe_healthy": (0.5, 1.0),
        "bg_sbe_lemon": (12.0, 25.0),
        "bg_pcie_healthy": (1.5, 3.0),
        "bg_pcie_lemon": (15.0, 30.0),
        "bg_nvl_healthy": (1.5, 3.0),
        "bg_nvl_lemon": (15.0, 30.0),
        "bg_rate_sd": (1.2, 1.8),
        "pcie_burst_rate_per_gpu_day": (0.15, 0.3),
        "nvl_burst_rate_per_gpu_day": (0.15, 0.3),
        "link_burst_size": (40.0, 90.0),
        "dcgm_blank_prob": (0.008, 0.02),
        "missing_counter_prob": (0.008, 0.02),
        "gpu_reset_rate_per_gpu_day": (0.08, 0.15),
        "lemon_share": (0.08, 0.14),
        "hot_healthy_share": (0.06, 0.12),
        "hot_excess_lo": (10.0, 13.0),
        "app_xid_rate": (300.0, 600.0),
        "benign_sbe_rate": (200.0, 400.0),
        "benign_total_hi": (300.0, 600.0),
        "benign_minutes_hi": (300.0, 600.0),
        "transient_xid74_rate": (30.0, 60.0),
        "xid74_peer_prob": (0.8, 1.0),
        "reboot_rate": (120.0, 200.0),
        "scrape_gap_rate": (8.0, 14.0),
        "missing_key_prob": (0.015, 0.03),
    },
    seed_base=4600,
    class_mix={"hbm_ecc": 0.24, "nvlink": 0.22, "off_bus": 0.14, "gsp": 0.10,
               "thermal_interface": 0.18, "silent": 0.12},
)

FAMILIES = {f.name: f for f in (TRAIN, SHIFTED, WIDE, FAR)}


def family_config(family: str, index: int, *, days: float = 10.0, failure_rate: float = 40.0,
                  gpus: str | None = None, interval_s: float | None = None, **overrides: Any) -> SimConfig:
    """Member `index` of a configuration family (its seed: the family's base + index; mix and
    sample interval round-robin unless given). Overrides set SimConfig fields last."""
    fam = FAMILIES.get(family)
    if fam is None:
        raise ValueError(f"unknown configuration family {family!r}; known: {sorted(FAMILIES)}")
    seed = fam.seed_base + index
    rng = np.random.default_rng([seed, 1616])

    def draw(name: str) -> float:
        lo, hi = fam.ranges[name]
        return float(rng.uniform(lo, hi))

    sites = (draw("site_inlet"), draw("site_inlet"), draw("site_inlet"), draw("site_inlet"))
    values: dict[str, Any] = {
        "gpus": gpus or fam.mixes[index % len(fam.mixes)],
        "days": days,
        "seed": seed,
        "sample_interval_s": interval_s or fam.intervals_s[index % len(fam.intervals_s)],
        "failure_rate_per_1000_gpu_days": failure_rate,
        "site_inlet_c": tuple(round(v, 2) for v in sites),
        "bg_sbe_per_day": (draw("bg_sbe_healthy"), draw("bg_sbe_lemon")),
        "bg_pcie_per_day": (draw("bg_pcie_healthy"), draw("bg_pcie_lemon")),
        "bg_nvl_per_day": (draw("bg_nvl_healthy"), draw("bg_nvl_lemon")),
        "benign_sbe_total": (5, int(draw("benign_total_hi"))),
        "benign_sbe_minutes": (10.0, draw("benign_minutes_hi")),
        "hot_healthy_excess_c": (lambda lo: (lo, lo + 5.0))(draw("hot_excess_lo")),
        "app_xid_rate_per_1000_gpu_days": draw("app_xid_rate"),
        "benign_sbe_burst_rate_per_1000_gpu_days": draw("benign_sbe_rate"),
        "transient_xid74_rate_per_1000_gpu_days": draw("transient_xid74_rate"),
        "reboot_rate_per_1000_node_days": draw("reboot_rate"),
        "scrape_gap_rate_per_node_day": draw("scrape_gap_rate"),
    }
    for name in ("rack_inlet_sd_c", "cooling_rise_c", "board_r_sd", "temp_noise_c", "temp_offset_sd_c",
                 "power_noise", "neighbour_heat_c", "bg_rate_sd", "pcie_burst_rate_per_gpu_day",
                 "nvl_burst_rate_per_gpu_day", "link_burst_size", "dcgm_blank_prob", "missing_counter_prob",
                 "gpu_reset_rate_per_gpu_day", "lemon_share", "hot_healthy_share", "xid74_peer_prob",
                 "missing_key_prob"):
        values[name] = draw(name)
    if fam.class_mix is not None:
        values["class_mix"] = dict(fam.class_mix)
    values.update(overrides)
    config = SimConfig(**values)
    config.validate()
    return config


def family_key(family: str, index: int, mix: str, days: float, rate: float, interval: float) -> str:
    """Cache name of a family member's trace (`fleetwise predictor train --cache`, and
    bench/failure_eval.py: the same member is simulated once)."""
    mix = mix.replace(":", "x").replace(",", "_")
    return f"fam-{family}-{index}-{mix or 'default'}-d{days:g}-r{rate:g}-i{interval:g}"
