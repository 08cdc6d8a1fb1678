"""Failure predictor: packaged scikit-learn model + rules layer + alert policy with hysteresis.

Per closed feature hop of a GPU, the model gives the probability that the GPU fails within
`horizon_h`; a lead-time estimate and the top signals come with it. The alert policy turns
probabilities into `alert: true` predictions without flapping. The rules layer covers what
no trend shows (a row-remap failure, XID 79 off the bus, fatal memory XIDs 48/64/95/140);
rule alerts carry a `source=rule:<name>` signal, model alerts `source=model`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from fleetwise.predictors.features import FEATURE_NAMES
from fleetwise.schemas import FeatureVector, Prediction, Signal

MODEL_FILE = "failure_model.joblib"
META_FILE = "failure_model.json"

# Features the model sees. Absolute temperatures and the inlet estimate are left out on
# purpose: they mostly encode *where* a GPU sits (hot aisle, top of rack), and a model
# that learns "hot -> fails" flags hot-but-healthy GPUs. It sees self-relative thermal
# signals instead (residual against its own power fit, thermal-resistance drift, clock
# loss against its own typical clock, throttle duty).
# Throttle-violation counters are left out too: their unit differs between DCGM versions and
# exporters (us vs ns), and the throttle-reason duty cycles carry the same information.
# Lifetime totals (aggregate ECC, remapped rows) are left out too: they say how old and how
# error-prone a board has been (a "lemon"), and a model trained at a raised failure rate
# learns "lemon -> fails within days", which at the real base rate is a false alarm; the
# recent rates and their trend against the GPU's own week carry the degradation.
# Row remaps and page retirements enter merged (`mem_repairs_*`, `mem_repair_pending`): the
# same sparing mechanism on Ampere+ and on Volta/Turing.
EXCLUDED = {"samples", "temp_mean", "temp_max", "mem_temp_mean", "inlet_est_c", "rth_fast", "rth_slow",
            "remap_pending", "retired_pending", "remap_corr_total", "remap_uncorr_total", "retired_total",
            "sbe_agg_total", "dbe_agg_total", "temp_at_tdp_c", "temp_at_tdp_drift_c_per_h",
            "hours_reporting"}
# (`hours_reporting` says when the GPU was last away, not how it is: a rule waits on it.)
# Node-peer counts (`node_*`) are left out too: a model trained with them made 3 or more false
# alarms on the tuning set at every policy swept (the packaged model 1; docs/benchmarks.md,
# "node-peer context"), so the candidates, and `predictor train`'s defaults, stay as packaged.
_EXCLUDED_PREFIXES = ("remap_corr_", "remap_uncorr_", "retired_sbe_", "retired_dbe_", "node_")
MODEL_FEATURES: list[str] = [
    n for n in FEATURE_NAMES
    if n not in EXCLUDED and "_violation_us" not in n and not n.startswith(_EXCLUDED_PREFIXES)
]
# Feature families whose contributions mark a risk as memory-driven (AlertPolicy.hi_memory).
MEMORY_PREFIXES = ("sbe_", "dbe_", "mem_repair", "xid_mem_", "remap_")
# ... as thermal (AlertPolicy.shared_heat_peers): how hot the GPU runs for its power; and as
# single-bit driven (AlertPolicy.shared_sbe_peers).
THERMAL_PREFIXES = ("temp_", "rth_", "mem_minus_gpu_temp", "thermal_duty", "thr_sw_thermal", "thr_hw_thermal")
SBE_PREFIXES = ("sbe_",)
# Single-bit errors the node shares: this many other GPUs of the node or more logged new ones
# within 6 h (`node_sbe_peers_6h`). A heat, power or host event makes several GPUs of a node
# err; one HBM stack degrading errs alone, beside a neighbour's stray error now and then. Rule
# 20 counts a hop below it; the model's single-bit-driven risk is held back at it
# (AlertPolicy.shared_sbe_peers, whose default it is).
SHARED_SBE_PEERS = 2
# Why a hop's risk is held back (`FailurePredictor.risk_drivers`): the node shares its cause, or
# it rests on trends over a near-empty week (AlertPolicy.sparse_trend_by_removal).
HELD_NONE, HELD_SHARED_HEAT, HELD_SHARED_SBE, HELD_SPARSE_TREND = 0, 1, 2, 3
# The trend columns (the last day's share of the week's errors, per link) and the week's counts
# below which a trend is a handful of events, not evidence: fewer than 3 single-bit errors,
# 30 PCIe replays and 30 NVLink CRC errors in the GPU's week.
TREND_FEATURES = ("sbe_trend", "nvl_trend", "pcie_trend")
SPARSE_WEEK = (("sbe_vol_7d", 3.0), ("pcie_replay_7d", 30.0), ("nvl_crc_flit_7d", 30.0))
# What drives a hop's risk, as bits (`FailurePredictor.risk_drivers`): a streak with such a hop
# among its last `k_raise` needs the cause's longer hold (AlertPolicy.k_raise_thermal, k_raise_sbe).
DRIVEN_THERMAL, DRIVEN_SBE = 1, 2
# Per driver: its bit, its name in a held watch's reason, the _GpuAlert counter of hops since its
# last driven hop, and its AlertPolicy hold (`_held` and the reason read this one table).
_DRIVEN_HOLDS = ((DRIVEN_THERMAL, "heat", "no_thermal", "k_raise_thermal"),
                 (DRIVEN_SBE, "single-bit", "no_sbe", "k_raise_sbe"))
_SHARED_REASON = {HELD_SHARED_HEAT: "heat", HELD_SHARED_SBE: "single-bit errors"}
_SPARSE_TREND_REASON = "rests on trends over a near-empty week"
_FEATURE_INDEX = {n: i for i, n in enumerate(FEATURE_NAMES)}


@dataclass(frozen=True)
class AlertRule:
    """A rule: a GPU whose `feature` stays above `level` for a hold of consecutive hops (the
    AlertPolicy field named by `hold`) is raised as rule `name`. An event rule (level 0, a hold
    of one hop) raises in the hop with the event; an error surge holds for hours. With
    `unshared` (a node-peer count feature) a hop counts only while that count is at most
    `peers_allowed` (0: no other GPU of the node erred).
    With `within_h`, the hops above the level need not be consecutive: `hold` of them within
    the last `within_h` hours of event time raise (an intermittent sign that recurs). With
    `settled_h`, a hop counts only once the GPU has reported for that many hours since its last
    silence of an hour or more (`hours_reporting`): a feature measured against the GPU's own
    history describes the board before a repair or a replacement until the history has moved
    on. With `streak` (an error group's `*_streak_h` feature), a hop counts only while that
    group has erred in every hop of the last `streak_h` hours. With `above_peers` (a node-peer
    maximum of the same feature), a hop counts only while the GPU's value is at least
    `peer_ratio` times that maximum: beyond every other GPU of its node. With `active` (an error
    group's `*_active_1h` share of erring hops), a hop counts only while that share is at least
    `active_level`: errors still arriving, not the decaying tail of one burst."""

    feature: str
    level: float
    name: str
    hold: str = "surge_hold_hops"
    unshared: str = ""
    peers_allowed: int = 0
    within_h: float = 0.0
    settled_h: float = 0.0
    streak: str = ""
    streak_h: float = 0.0
    above_peers: str = ""
    peer_ratio: float = 0.0
    active: str = ""
    active_level: float = 0.0


# `nvl_accel` / `pcie_accel` are the log of the last hour's NVLink error rate (CRC, replay,
# recovery) / PCIe replay rate against the GPU's own week (+0.1/h each): 3.8 is ~45x its own
# rate, a link wearing out, not its background. Each level is ~1.1x the highest level that any
# GPU which did not fail held for the surge's hold on the development traces (the simulator's
# tuning members and one to two seeds of each telemetry generator written apart from it;
# `bench/surge_levels.py`). Held 2 h, PCIe replays (2.8) raised 45 healthy GPUs on the
# simulator's shifted and far families, whose replay noise comes in bursts of hours; held 6 h
# (the sustained tier) no healthy GPU's rose above 1.03 (docs/benchmarks.md, "Error surges as
# rules").
ALERT_RULES = (
    AlertRule("nvl_accel", 3.8, "nvlink_error_surge"),
    AlertRule("nvl_accel", 1.25, "nvlink_error_rise", hold="rise_hold_hops"),
    AlertRule("pcie_accel", 1.15, "pcie_replay_rise", hold="rise_hold_hops"),
    # `sbe_accel`: the last 6 h's single-bit error rate against the GPU's week (+0.1/h), held a
    # day: a benign burst or a lemon's background does not keep rising for 24 h.
    AlertRule("sbe_accel", 1.3, "single_bit_error_rise", hold="sbe_rise_hold_hops"),
    # A link surge the node does not share (rule 14): held 2 h while no other GPU of the node
    # logged errors of that link within the hour (`node_*_peers_1h`). One GPU's link wearing out
    # errs alone; a switch, a riser or a host event makes several err. Counting only such hops,
    # no never-failing GPU of the development traces held its NVLink / PCIe acceleration above
    # 2.74 / 2.90 for 2 h (3.44 / 3.17 counting every hop); levels ~1.1x those.
    # The NVLink one counts a hop only while the link erred in at least a fifth of the last
    # hour's hops (`nvl_active_1h` >= 0.2, EW: two erring hops within about an hour): its 1 h
    # error count decays over hours, so one hop's burst of a few hundred errors held `nvl_accel`
    # above 3.0 for the 2 h by itself (judge34's shifted-117: three healthy GPUs; on the
    # development traces the gate cost one call's reach of 35).
    AlertRule("nvl_accel", 3.0, "nvlink_surge_unshared", unshared="node_nvl_peers_1h", active="nvl_active_1h",
              active_level=0.2),
    AlertRule("pcie_accel", 3.2, "pcie_surge_unshared", unshared="node_pcie_peers_1h"),
    # Power-brake episodes the node does not share (rule 15): hops with the HW power-brake clock
    # event reason set while no other GPU of the node braked within the hour (read one hop
    # later, when every peer's hop of that time has closed), recurring (`brake_unshared_hops` of
    # them within 24 h). A power shelf, PSU or facility cap brakes all the GPUs it feeds; one
    # GPU's failing voltage regulator brakes it alone, more often as it nears failure. Why this
    # count: docs/benchmarks.md ("Power brakes the node does not share").
    AlertRule("thr_power_brake_prev", 0.0, "power_brake_unshared", hold="brake_unshared_hops",
              unshared="node_brake_peers_1h", within_h=24.0),
    # A thermal residual the node does not share (rule 16): the GPU's day-long temperature
    # residual against its own temperature-on-power fit, over hops without thermal throttling,
    # held >= 2.0 C for `heat_residual_hold_hops` while no other GPU of the node ran about as warm
    # within the hour (a 6 h residual >= 2.5 C, `node_heat_peers_1h`). A failing fan, heat sink,
    # cold plate or thermal interface makes its GPU alone hotter per watt, rising for days; a
    # coolant or chiller excursion warms the node's GPUs together. Counted only after a day of
    # reporting since the GPU's last silence: a board repaired in place (the same uuid) is
    # measured against its fit from before the failure.
    # 2.0 C (rule 19): ~1.15x the highest any never-failing GPU of the development traces held
    # for 2 h once a replaced board started afresh (rule 18); docs/benchmarks.md ("A thermal
    # residual the node does not share", "Rule 16 at 2.0 C for 2 h: rule 19").
    AlertRule("temp_residual_cool_24h", 2.0, "heat_residual_unshared", hold="heat_residual_hold_hops",
              unshared="node_heat_peers_1h", settled_h=24.0),
    # Memory repairs the node does not share (rule 20): the GPU's row remaps and retired pages
    # over about a day (`mem_repairs_24h`, an EW count) above 3.8 (four repairs within a few
    # hours, five within a day) while at most one other GPU of the node logged single-bit errors
    # within 6 h, once the GPU has reported for a day since its last silence. An HBM stack wearing
    # out repairs row after row; a healthy board repairs one now and then, a lemon two at once, and
    # a burst of single-bit errors that several GPUs of a node share (heat, power, a host event)
    # ends in a repair on each. Counted only when settled: a board repaired in place reports the
    # repairs made while it was away in its first hop back. 3.8: ~1.1x the highest level any
    # never-failing GPU of the development traces reached (3.46, the simulator's far members,
    # whose benign bursts each end in a remap); docs/benchmarks.md ("Memory repairs the node
    # does not share").
    # One peer erring is allowed (judge37): a heat, power or host event makes several GPUs of a
    # node err, where one neighbour's stray error (its own background) hid a stack repairing 5-8
    # rows a day (gen A fleet-134 `node-020`/1). With one allowed, the highest never-failing
    # level on the development traces rose to 3.66 (simulator far-71), under 3.8;
    # docs/benchmarks.md ("Rule 20 with one node peer erring allowed").
    AlertRule("mem_repairs_24h", 3.8, "memory_repairs_unshared", hold="repair_unshared_hops",
              unshared="node_sbe_peers_6h", peers_allowed=SHARED_SBE_PEERS - 1, settled_h=24.0),
    # A GSP error (rule 21): XID 119 (GSP RPC timeout) or 120 (GSP error) logged in the hop, a
    # change to it rather than a repeat (`xid_gsp_hop`): the GPU System Processor's firmware
    # stopped answering the driver, which NVIDIA's XID catalog answers with a GPU reset. One that
    # the GPU survives is a precursor of a hang: on the generators' development seeds no
    # never-failing GPU logged one, and 6 of 25 GSP hangs with a precursor logged one at least
    # 30 min before the hang (docs/benchmarks.md, "A GSP error: rule 21").
    AlertRule("xid_gsp_hop", 0.0, "xid_gsp_error", hold="gsp_error_hops"),
    # NVLink errors hop after hop at a climbing rate (rule 22): the last hour's NVLink error rate
    # above ~33x the GPU's own week (`nvl_accel` > 3.5) while the link has erred in every hop of
    # the last hour (`nvl_streak_h` >= 1). A link wearing out errs in every hop, faster and
    # faster, often for less than the 2 h the surges above hold; a burst (a reset, a reseat)
    # lifts the rate for an hour from one or two hops, a lemon errs steadily at its own rate. On
    # the development traces no never-failing GPU met both; on fresh ones one did (judge26).
    # On since its second judgement (`nvl_streak_hops`; docs/benchmarks.md, "NVLink errors hop
    # after hop: rule 22", "Rule 22 again").
    AlertRule("nvl_accel", 3.5, "nvlink_errors_streaking", hold="nvl_streak_hops", streak="nvl_streak_h",
              streak_h=1.0),
    # Events that end a GPU's usefulness now or soon raise in the hop they are logged in: a row
    # remap that failed (the bank is out of spare rows), XID 79 (fallen off the bus), and the
    # fatal memory XIDs (48 double-bit ECC, 64 remap failure, 95 uncontained, 140 ECC
    # unrecovered). Last in this table so that a checkpoint's per-rule streaks (by position)
    # keep their rules.
    AlertRule("remap_failure", 0.0, "remap_failure", hold="remap_failure_hops"),
    AlertRule("xid_bus_hop", 0.0, "xid79_off_bus", hold="xid_bus_hops"),
    AlertRule("xid_mem_fatal_hop", 0.0, "xid_fatal_memory", hold="xid_mem_fatal_hops"),
    # A memory warning XID (rule 23): XID 92 (the driver saw a high single-bit error rate) or 94
    # (a contained uncorrectable error) logged in the hop, a change rather than a repeat. The
    # driver's own threshold on the rate, where the feature windows see counts that a benign
    # burst and a wearing bank share: on the development traces (the simulator's shifted and far
    # members, the generators' 22 development seeds) no never-failing GPU logged either, and
    # most memory failures with a precursor logged one >= 30 min ahead (docs/benchmarks.md,
    # "A memory warning XID: rule 23"). Appended so that checkpoints keep their streaks.
    AlertRule("xid_mem_warn_hop", 0.0, "xid_memory_warning", hold="xid_mem_warn_hops"),
    # Power brakes beyond the node's (rule 24): more than 4 power-braked hops over about 6 h (an
    # EW count, `brake_hops_6h`) and at least 1.5x as many as any other GPU of the node
    # (`node_brake_hops_max_6h`). A PSU or shelf browning out, or a facility cap, brakes the
    # GPUs it feeds about equally often (rule 15 reads only hops no peer shares, and a brownout
    # brakes the peers too); the GPU whose own supply or regulator is failing brakes more often
    # than any of them. On the generators' development seeds no never-failing GPU above 4 held
    # more than 1.32x its peers' most (1.5: ~1.1x that); the simulator brakes no GPU
    # (docs/benchmarks.md, "Power brakes beyond the node's: rule 24"). Appended: checkpoints
    # keep their streaks.
    AlertRule("brake_hops_6h", 4.0, "power_brake_beyond_peers", hold="brake_beyond_peers_hops",
              above_peers="node_brake_hops_max_6h", peer_ratio=1.5),
    # PCIe replays hop after hop (rule 25), rule 22 for the PCIe link: the last hour's replay
    # rate above ~12x the GPU's own week (`pcie_accel` > 2.5) while the link has replayed in every
    # hop of the last hour (`pcie_streak_h` >= 1). A link (riser, retimer, slot) wearing out
    # replays in every hop, faster and faster, in the hours before the GPU falls off the bus,
    # often for less than the 2 h rule 14 holds; a noisy riser replays steadily at its own rate,
    # a burst lifts the rate from one or two hops. On the development traces no never-failing
    # GPU streaking for an hour rose above 2.27 (2.5: ~1.1x; docs/benchmarks.md, "PCIe replays
    # hop after hop: rule 25"). Off by its two judgements (`pcie_streak_hops`): the simulator's
    # far family has healthy links whose replay bursts streak an hour. Appended: checkpoints keep
    # their streaks.
    AlertRule("pcie_accel", 2.5, "pcie_replays_streaking", hold="pcie_streak_hops", streak="pcie_streak_h",
              streak_h=1.0),
    # A double-bit ECC error counted (rule 26): the volatile DBE counter rose in the hop
    # (`dbe_vol_hop`), an uncorrectable error whose XID 48 the fatal-memory rule above may not see:
    # the XID gauge shows one XID per scrape (the last), a scrape can miss it, and the counter
    # keeps the count. On the development traces (the generators' ten seeds, six simulator
    # members) no never-failing GPU counted one; 9 of 754 failures with a precursor did 30 min to
    # 48 h before failing; on judge34 it called none more (off, `dbe_hops`; docs/benchmarks.md,
    # "A double-bit error counted: rule 26"). Appended: checkpoints keep their streaks.
    AlertRule("dbe_vol_hop", 0.0, "double_bit_error", hold="dbe_hops"),
    # A single-bit error rise the node does not share (rule 27): rule 13's acceleration above 1.0
    # held 18 h (`sbe_rise_unshared_hops`) while no other GPU of the node logged a single-bit error
    # within 6 h (`node_sbe_peers_6h`). An HBM stack wearing out errs alone, faster than its own
    # week, for days; heat, power or a host event makes several GPUs of a node err at once, and a
    # benign burst or a lemon's background does not stay above its week for 18 h. Rule 13 waits
    # 24 h at 1.3 with no peer test; this one calls such a GPU hours sooner. 1.0: ~1.1x the
    # highest any never-failing GPU of the development traces held for 18 h with no peer erring
    # (0.905; docs/benchmarks.md, "A single-bit error rise the node does not share: rule 27").
    # One peer allowed, as rule 20 allows, raised three never-failing simulator GPUs on judge38
    # (docs/benchmarks.md, "Rule 27 with one node peer erring allowed"): no peer here.
    # Appended: checkpoints keep their streaks.
    AlertRule("sbe_accel", 1.0, "single_bit_error_rise_unshared", hold="sbe_rise_unshared_hops",
              unshared="node_sbe_peers_6h"),
)
RULE_NAMES: list[str] = [rule.name for rule in ALERT_RULES]
RULE_BY_NAME: dict[str, AlertRule] = {rule.name: rule for rule in ALERT_RULES}
if len(RULE_NAMES) > 32:  # rule_hits packs one bit per rule into a uint32 (stored with hop scores)
    raise RuntimeError(f"{len(RULE_NAMES)} rules do not fit rule_hits' 32 bits")


def feature_schema_hash(names: Sequence[str]) -> str:
    """Short hash of the ordered feature names: a model fits exactly one schema."""
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:16]


class FeatureSchemaError(RuntimeError):
    """The packaged model was fitted on a different feature schema than this code computes."""


@dataclass
class AlertPolicy:
    """Raise at p >= hi for k consecutive hops (or, for memory-driven risk, at p >= hi_memory for
    k_raise_memory hops); clear at p < lo for m consecutive hops."""

    # The model raises a GPU only after its probability has stayed >= hi for k_raise hops (36
    # hops: 6 h). Noise that lifts a healthy GPU's probability (a benign single-bit burst, a
    # lemon's background, a link or thermal episode) does so for minutes to a few hours; a
    # degrading board stays at risk for hours to days. Chosen on the shifted family's tuning
    # members by the rule used throughout (fewest false alarms, then long-precursor, then
    # any-precursor recall) and judged on members drawn after the choice; the figures, and the
    # 1-hour policy it replaced, are in docs/benchmarks.md ("Long persistence", "A second
    # judgement").
    hi: float = 0.97
    lo: float = 0.485
    k_raise: int = 36
    # A separate tier for memory-driven risk (single-bit errors, remaps, memory XIDs carry >= half
    # of the hop's signal): raise after `k_raise_memory` hops at p >= `hi_memory`. Here the same
    # as the general rule (no tier of its own): each lower tier swept (0.5-0.7 for 36-72 hops)
    # raised one or two healthy GPUs on the tuning sets.
    hi_memory: float = 0.97
    k_raise_memory: int = 36
    m_clear: int = 6
    # Heat the node shares: a hop whose risk is thermal-driven (thermal features carry >= half
    # of its signal) does not count toward raising while >= this many other GPUs of the node ran
    # warm within the hour (`node_warm_peers_1h`): a coolant excursion in a row or a chiller trip
    # warms them all, one GPU's own cooling fault warms it alone. 0: off. Why, and what it
    # costs: docs/benchmarks.md ("Shared heat").
    shared_heat_peers: int = 2
    # The same for single-bit ECC errors: a hop whose risk is driven by them (sbe_* features
    # carry >= half of its signal) does not count toward either tier while >= this many other
    # GPUs of the node logged new ones within 6 h (`node_sbe_peers_6h`): one GPU's HBM degrading
    # errs alone. 0: off. Judged on fresh members of every family (docs/benchmarks.md, "Shared
    # single-bit errors").
    shared_sbe_peers: int = SHARED_SBE_PEERS
    # Longer holds for the causes that lift a healthy GPU for hours: a streak with a thermal-driven
    # hop among its last k hops (k_raise; k_raise_memory for the memory tier) raises only after
    # `k_raise_thermal` hops (12 h), one with a single-bit-driven hop after `k_raise_sbe` (12 h),
    # whichever is longer where both are (`_held`). A warm spell, a load change against a GPU's
    # own history or a lemon's trickle of single-bit errors lasts hours; a failing interface or
    # HBM stack keeps rising for days. On the development traces of the
    # four generators written apart from the project the 6-hour hold alone let the model raise
    # 18 healthy GPUs (10 on heat, 6 on single-bit errors); with these holds 1 (docs/benchmarks.md,
    # "The model's alerts with longer holds for heat and single-bit errors"). 0 (or <= k_raise): off.
    # The heat hold is 12 h since judge39 (18 h before): the node-shared heat holds, the fresh
    # start after a repair and the sparse-trend hold came after the 18 h were chosen. At 12 h the
    # model raised no more never-failing GPUs on judge39's fresh sets and called one failure more;
    # at 6 h it raised two GPUs of one node warmed together (docs/benchmarks.md, "The model's
    # heat-driven raises held 12 h").
    k_raise_thermal: int = 72
    k_raise_sbe: int = 72
    # A hop's risk rests on heat the node shares where thermal features carry at least half of
    # its signal or, with this on, where its probability with them at the healthy baseline falls
    # below the raise threshold (`FailureModel.rests_on`): several weak signs and some heat
    # make a risk that rests on the heat though the heat carries a small share of the signal
    # (judge26's gen D: a hall warming, read as each GPU's own risk while the node's warm peers
    # went unheeded). Not for single-bit errors: on the simulator's development sets that cost
    # a tenth of the model's calls (memory failures whose node peers log them too). The longer
    # holds above still read the share. Why, and what it did: docs/benchmarks.md ("Heat the
    # node shares, by removal").
    shared_heat_by_removal: bool = True
    # A hop's risk rests on trends over a near-empty week, and does not count toward raising,
    # where the GPU's week holds only a handful of errors (SPARSE_WEEK) and its probability with
    # the trend columns (TREND_FEATURES) at the healthy baseline falls below the raise threshold:
    # one single-bit error in the day is "all of the week's" (judge32's gen D: a hot-but-healthy
    # GPU raised on one single-bit error, a few replays and two resets; 0.09 without the trends).
    sparse_trend_by_removal: bool = True
    rule_hold_hops: int = 144  # a rule's raise keeps the alert ~24 h (10-min hops)
    # The event rules raise on an event in this many consecutive hops (one: the event is the
    # evidence). 0: off.
    remap_failure_hops: int = 1
    xid_bus_hops: int = 1
    xid_mem_fatal_hops: int = 1
    # An error surge (ALERT_RULES) raises after this many consecutive hops above its level (2 h):
    # a burst of link errors during a reset or a cable reseat lasts minutes. 0: surges off.
    surge_hold_hops: int = 12
    # The sustained link-error rises (lower levels) after this many (9 h), the single-bit error
    # rise after `sbe_rise_hold_hops` (24 h). 0: off. 54 since rule 17 (2026-12-06): held 6 h, the
    # rises raised healthy GPUs on the simulator's fresh members (judge20: 5 of its 7 false alarms,
    # 0.26 per 1,000 GPU-days); held 9 h, a few of the generators' link failures are called later
    # or not at all (docs/benchmarks.md, "Rule 12's rises held 9 h, rule 16 on: rule 17").
    rise_hold_hops: int = 54
    sbe_rise_hold_hops: int = 144
    # Rule 15 raises at this many power-braked hops the node does not share within 24 h. 0: off.
    brake_unshared_hops: int = 2
    # Rule 16 raises after this many consecutive hops (2 h) of a thermal residual the node does
    # not share. 0: off. On since rule 17 (judged with the 9-hour rises above; 3 h at 2.5 C until
    # rule 19).
    heat_residual_hold_hops: int = 12
    # Rule 20 raises after this many consecutive hops of memory repairs the node does not share
    # (one: the count itself is the evidence, and it decays over hours). 0: off. On since its
    # judgement on judge24 and sixteen fresh generator seeds (docs/benchmarks.md, "Memory repairs
    # the node does not share").
    repair_unshared_hops: int = 1
    # Rule 21 raises on a GSP XID (119/120) in this many consecutive hops (one: the event is the
    # evidence). 0: off. On since its judgement on judge25 and sixteen fresh generator seeds
    # (docs/benchmarks.md, "A GSP error: rule 21").
    gsp_error_hops: int = 1
    # Rule 23 raises on a memory warning XID (92/94) in this many consecutive hops (one: the event
    # is the evidence). 0: off. Off after its first judgement (judge29: calls added, no false alarm
    # added, but gen A's set over the budget in both arms, by rule 19's shared heat); on since its
    # second (judge30; docs/benchmarks.md, "A memory warning XID: rule 23").
    xid_mem_warn_hops: int = 1
    # Rule 22 raises after this many consecutive hops of NVLink errors streaking at a climbing
    # rate (one: the hour-long streak is the hold). 0: off. Judged twice: on judge26 it called
    # 26 more failures at 30 min and added a false alarm on the simulator, and gen D's seeds
    # were over the budget in both arms (the model's raises on a hall's heat, since held back by
    # `shared_heat_by_removal`); on judge28 it called 22 more and added none, every set within
    # the budget. On since (docs/benchmarks.md, "Rule 22 again").
    nvl_streak_hops: int = 1
    # Rule 24 raises after this many consecutive hops of power brakes beyond the node's (one: the
    # 6 h count is the hold). 0: off.
    brake_beyond_peers_hops: int = 1
    # Rule 25 raises after this many consecutive hops of PCIe replays streaking at a climbing rate
    # (one: the hour-long streak is the hold). 0: off. Off by both its judgements: on judge32 it
    # called 18 more failures at 30 min and added no false alarm, but gen D's set flagged one of
    # its 32 hot-but-healthy GPUs in both arms (a model raise, since held back by
    # `sparse_trend_by_removal`); on judge33 it added three false alarms on the simulator's
    # far-105, whose replay bursts streaked an hour (docs/benchmarks.md, "PCIe replays hop after
    # hop: rule 25", "Trends over a near-empty week, and rule 25 again").
    pcie_streak_hops: int = 0
    # Rule 26 raises on a double-bit ECC error counted in this many consecutive hops (one: the
    # error is the evidence). 0: off. Off by its judgement (judge34): it called no failure more on
    # any set (docs/benchmarks.md, "A double-bit error counted: rule 26").
    dbe_hops: int = 0
    # Rule 27 raises after this many consecutive hops (18 h) of a single-bit error rise the node
    # does not share. 0: off.
    sbe_rise_unshared_hops: int = 108
    # Re-raising for the same evidence: for `rearm_hops` after a model alert clears, the model
    # raises that GPU again only at a probability above the cleared episode's peak + margin
    # (new, stronger evidence), so a decaying burst that hovers around hi is one alert, not many.
    # Rules are not held back.
    rearm_hops: int = 144
    rearm_margin: float = 0.05
    # The model's alerts beside the rules: on by default again since 2026-12-06, with the longer
    # holds for heat and single-bit errors above. Off from 2026-12-05: with the 6-hour hold alone
    # the packaged model raised healthy GPUs on fleets it was never built from (up to 1.05 false
    # alarms per 1,000 GPU-days on one generator written apart from the project; row- and
    # hall-wide heat read as each GPU's own rise, lemons' single-bit trickles). With the holds,
    # judged on fresh simulator members and fresh seeds of all four generators: at most 0.15 false
    # alarms per 1,000 GPU-days on any set (the rules' own), failures with a precursor called at
    # 30 min 0.22 -> 0.27 (docs/benchmarks.md, "The model's alerts with longer holds for heat and
    # single-bit errors"). False (`--rules-only` on replay / worker / backtest / predictor train)
    # leaves the rules alone; the model's probabilities and signals go to the watch list either way.
    model_alerts: bool = True
    emit_floor: float = 0.2  # also emit non-alert predictions with p >= this (watch list)


# A rule names its hold (an AlertPolicy field) and its features as strings: a misspelt
# one fails here, at import, not at the first hop.
_UNKNOWN = [rule.name for rule in ALERT_RULES
            if rule.hold not in AlertPolicy.__dataclass_fields__
            or any(f and f not in _FEATURE_INDEX for f in (rule.feature, rule.unshared, rule.streak,
                                                           rule.above_peers, rule.active))]
if _UNKNOWN:
    raise RuntimeError(f"rules naming an unknown hold or feature: {_UNKNOWN}")


def policy_from_spec(text: str, base: AlertPolicy | None = None) -> AlertPolicy:
    """`base` (default `AlertPolicy()`) with the thresholds of 'hi,k,k_memory[,hi_memory]'
    (lo = hi / 2; hi_memory defaults to hi, which leaves the memory tier as the general rule
    held k_memory hops) and the model's alerts on: a threshold is the model's. The one reader of
    the `--policy` spec (CLI and benches). Raises ValueError saying what is wrong."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if len(values) not in (3, 4):
        raise ValueError(f"a policy is 'hi,k,k_memory[,hi_memory]' (e.g. 0.97,6,18,0.7), got {text!r}")
    hi, k, km = values[:3]
    hi_memory = values[3] if len(values) == 4 else hi
    if not 0 < hi <= 1 or not 0 < hi_memory <= 1 or k < 1 or km < 1:
        raise ValueError(f"in a policy, hi and hi_memory are in (0, 1], k and k_memory >= 1; got {text!r}")
    return replace(base or AlertPolicy(), hi=hi, lo=hi / 2, k_raise=int(k), k_raise_memory=int(km),
                   hi_memory=hi_memory, model_alerts=True)


@dataclass
class FailureModel:
    """The fitted bundle: calibrated classifier, lead-time regressor, healthy baseline."""

    classifier: Any
    calibrator: Any
    lead_regressor: Any
    feature_names: list[str]
    baseline_median: np.ndarray
    baseline_scale: np.ndarray
    importance: np.ndarray
    horizon_h: float
    policy: AlertPolicy = field(default_factory=AlertPolicy)
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A model reads the feature columns it was fitted on (a subset of FEATURE_NAMES), so a
        # model fitted before features were added keeps working, to the bit.
        unknown = [n for n in self.feature_names if n not in _FEATURE_INDEX]
        if unknown:
            raise FeatureSchemaError(f"model features {unknown[:5]} are not computed by this code; "
                                     "retrain with `fleetwise predictor train`")
        self.cols = np.array([_FEATURE_INDEX[n] for n in self.feature_names], dtype=np.int64)
        self.memory_mask = np.array([n.startswith(MEMORY_PREFIXES) for n in self.feature_names], dtype=bool)
        self.thermal_mask = np.array([n.startswith(THERMAL_PREFIXES) for n in self.feature_names], dtype=bool)
        self.sbe_mask = np.array([n.startswith(SBE_PREFIXES) for n in self.feature_names], dtype=bool)
        self.trend_mask = np.array([n in TREND_FEATURES for n in self.feature_names], dtype=bool)

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """Calibrated probability of failing within horizon_h, per row of `feature_names`."""
        if len(x) == 0:
            return np.empty(0)
        raw = self.classifier.predict_proba(x)[:, 1]
        return np.clip(self.calibrator.predict(raw), 0.0, 1.0)

    def lead_time_h(self, x: np.ndarray) -> np.ndarray:
        if len(x) == 0 or self.lead_regressor is None:
            return np.full(len(x), np.nan)
        return np.expm1(np.clip(self.lead_regressor.predict(x), 0.0, np.log1p(self.horizon_h)))

    def contributions(self, x: np.ndarray) -> np.ndarray:
        """Cheap per-feature contribution: deviation from the healthy baseline x importance."""
        z = np.abs(x - self.baseline_median) / self.baseline_scale
        return np.nan_to_num(z, nan=0.0) * self.importance

    def memory_share(self, x: np.ndarray) -> np.ndarray:
        """Share of each row's contribution that comes from memory-error features."""
        return self.family_shares(x)[0]

    def rests_on(self, x: np.ndarray, mask: np.ndarray, threshold: float) -> np.ndarray:
        """Per row: whether its risk rests on the features of `mask` - at or above `threshold`
        with them, below it with them at the healthy baseline. Both read from `x`, so a row whose
        stored probability came from elsewhere is not read as resting on anything."""
        both = self.predict_proba(np.vstack([x, np.where(mask, self.baseline_median, x)]))
        return (both[:len(x)] >= threshold) & (both[len(x):] < threshold)

    def family_shares(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Shares of each row's contribution from memory-error, thermal and single-bit features."""
        c = self.contributions(x)
        total = c.sum(axis=1)
        denom = np.where(total > 0, total, 1.0)
        return tuple(np.where(total > 0, c[:, mask].sum(axis=1) / denom, 0.0)  # type: ignore[return-value]
                     for mask in (self.memory_mask, self.thermal_mask, self.sbe_mask))

    # ---- persistence ----
    def save(self, directory: Path, extra_metadata: dict[str, Any] | None = None) -> tuple[Path, Path]:
        import joblib
        import sklearn

        directory.mkdir(parents=True, exist_ok=True)
        meta = {
            **self.metadata,
            **(extra_metadata or {}),
            "feature_names": self.feature_names,
            "feature_schema_hash": feature_schema_hash(self.feature_names),
            "horizon_h": self.horizon_h,
            "policy": asdict(self.policy),
            "sklearn_version": sklearn.__version__,
        }
        bundle = {k: getattr(self, k) for k in (
            "classifier", "calibrator", "lead_regressor", "baseline_median", "baseline_scale", "importance")}
        joblib.dump(bundle, directory / MODEL_FILE, compress=3)
        (directory / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
        return directory / MODEL_FILE, directory / META_FILE

    @classmethod
    def load(cls, directory: Path | None = None) -> FailureModel:
        """Load the packaged model (or one from `directory`); checks the feature schema."""
        import joblib

        base = Path(directory) if directory else Path(str(resources.files("fleetwise.predictors") / "models"))
        meta_path, model_path = base / META_FILE, base / MODEL_FILE
        if not meta_path.exists() or not model_path.exists():
            raise FileNotFoundError(
                f"no failure model in {base}: run `fleetwise predictor train` to create one"
            )
        meta = json.loads(meta_path.read_text())
        names = meta.get("feature_names")
        if (not isinstance(names, list) or meta.get("feature_schema_hash") != feature_schema_hash(names)
                or any(n not in _FEATURE_INDEX for n in names)):
            raise FeatureSchemaError(
                f"failure model in {base} was fitted on feature schema {meta.get('feature_schema_hash')}, "
                "which this code does not compute; retrain with `fleetwise predictor train`"
            )
        bundle = joblib.load(model_path)
        policy = dict(meta.get("policy", {}))
        if "k_raise_memory" in policy and "hi_memory" not in policy:
            # Stored before the memory tier had its own threshold: its k_raise_memory counted hops
            # at hi. Loaded as a tier at hi; where it was longer than k_raise it used to hold
            # memory-driven risk back and no longer does (the general rule raises first).
            policy["hi_memory"] = policy.get("hi", AlertPolicy.hi)
        return cls(feature_names=list(names), horizon_h=float(meta["horizon_h"]),
                   policy=AlertPolicy(**policy), metadata=meta, **bundle)


def rule_values(features: np.ndarray, rule: AlertRule) -> np.ndarray:
    """Per row of a FEATURE_NAMES matrix, the value `rule` compares with its level: its feature,
    missing (NaN: holds nothing) where node peers share the hop (`rule.unshared` above
    `rule.peers_allowed`), the GPU has not yet reported for `rule.settled_h` since its last
    silence, or its error group has not erred for `rule.streak_h`, or its value is below
    `rule.peer_ratio` times its node peers' most (`rule.above_peers`), or its error group's share
    of erring hops is under `rule.active_level` (`rule.active`)."""
    x = features[:, _FEATURE_INDEX[rule.feature]]
    if rule.unshared:  # a missing peer count is not within the allowance: the hop counts for nothing
        x = np.where(features[:, _FEATURE_INDEX[rule.unshared]] <= rule.peers_allowed, x, np.nan)
    if rule.settled_h:
        x = np.where(features[:, _FEATURE_INDEX["hours_reporting"]] >= rule.settled_h, x, np.nan)
    if rule.streak:  # hours in whole hops: 1e-9 so that six 10-minute hops make 1 h
        x = np.where(features[:, _FEATURE_INDEX[rule.streak]] >= rule.streak_h - 1e-9, x, np.nan)
    if rule.above_peers:  # a missing peer maximum is not 0: the hop counts for nothing
        x = np.where(x >= rule.peer_ratio * features[:, _FEATURE_INDEX[rule.above_peers]], x, np.nan)
    if rule.active:  # a missing share is not at the level: the hop counts for nothing
        x = np.where(features[:, _FEATURE_INDEX[rule.active]] >= rule.active_level, x, np.nan)
    return x


def rule_hits(features: np.ndarray) -> np.ndarray:
    """Which rules each row of a FEATURE_NAMES matrix hits: bit r set for RULE_NAMES[r] (its
    `rule_values` above its level; a missing value hits nothing)."""
    hits = [rule_values(features, rule) > rule.level for rule in ALERT_RULES]
    bits = np.zeros(len(features), dtype=np.uint32)
    for r, hit in enumerate(hits):
        bits |= hit.astype(np.uint32) << r
    return bits


def rule_names_of(bits: int) -> list[str]:
    """The names of the rules set in `bits` (`rule_hits`)."""
    return [name for r, name in enumerate(RULE_NAMES) if bits >> r & 1]


@dataclass
class _GpuAlert:
    alerting: bool = False
    high: int = 0
    high_memory: int = 0  # consecutive memory-driven hops at p >= hi_memory
    no_thermal: int = 0  # hops since the last thermal-driven one (DRIVEN_THERMAL)
    no_sbe: int = 0  # ... single-bit-driven one (DRIVEN_SBE)
    low: int = 0
    rule_left: int = 0
    source: str = ""
    raised_ts: float = 0.0
    peak: float = 0.0  # highest probability of the open (or last) model episode
    rearm_left: int = 0  # hops left in which a model re-raise needs p > peak + margin
    surge: tuple[int, ...] = ()  # per ALERT_RULES entry: consecutive hops above its level (() all 0)
    # per ALERT_RULES entry with `within_h` (by name): event times of its recent hops above its level
    recent: dict[str, list[float]] = field(default_factory=dict)


class FailurePredictor:
    """Stream processor: FeatureVector(scope="gpu") -> Prediction(type="failure")."""

    def __init__(self, model: FailureModel, policy: AlertPolicy | None = None) -> None:
        self.model = model
        self.policy = policy or model.policy
        self._gpu: dict[str, _GpuAlert] = {}

    @classmethod
    def load(cls, directory: Path | None = None) -> FailurePredictor:
        return cls(FailureModel.load(directory))

    def process(self, records: Sequence[FeatureVector]) -> list[Prediction]:
        vectors = [r for r in records if isinstance(r, FeatureVector) and r.scope == "gpu"]
        if not vectors:
            return []
        f = np.full((len(vectors), len(FEATURE_NAMES)), np.nan)
        for i, v in enumerate(vectors):
            vals = v.values
            f[i] = [np.nan if (x := vals.get(n)) is None else x for n in FEATURE_NAMES]
        keys = [(v.node, v.gpu) for v in vectors]
        ts = np.array([v.ts for v in vectors])
        return self.process_arrays(keys, ts, f, job_ranks=[(v.job, v.rank) for v in vectors])[0]

    def process_arrays(
        self, keys: Sequence[tuple[str, int]], ts: np.ndarray, features: np.ndarray,
        job_ranks: Sequence[tuple[str | None, int | None]] | None = None,
    ) -> tuple[list[Prediction], np.ndarray]:
        """Score rows of the full FEATURE_NAMES matrix (event-time order); returns the emitted
        predictions and every row's probability (for backtests).

        `job_ranks` (optional, one (job, rank) per row: the GPU's current job, e.g. from
        `GpuFeatureWindows.job_ranks(slots)`) is copied into the predictions, so an actuator
        can cap drains per job."""
        x = features[:, self.model.cols]
        prob = self.model.predict_proba(x)
        bits = rule_hits(features)
        rule_hit = [rule_names_of(b) for b in bits.tolist()]
        memory_driven, held_back, driven = self.risk_drivers(features, prob)
        emit_rows, states = self.advance_policy(keys, ts, prob, memory_driven, rule_hit, held_back, driven)
        if not emit_rows:
            return [], prob
        return self._emit(keys, ts, x, prob, emit_rows, states, rule_hit, job_ranks, held_back, driven), prob

    def risk_drivers(self, features: np.ndarray,
                     prob: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row of a FEATURE_NAMES matrix (or of its rows kept at a watch floor) and its
        probability: whether its risk is memory-driven (AlertPolicy.hi_memory); why it is held
        back: its cause is one the node shares (HELD_SHARED_HEAT, HELD_SHARED_SBE;
        AlertPolicy.shared_heat_peers, shared_sbe_peers), it rests on trends over a near-empty
        week (HELD_SPARSE_TREND; AlertPolicy.sparse_trend_by_removal) or neither (HELD_NONE); and
        whether heat or single-bit errors drive it (DRIVEN_THERMAL | DRIVEN_SBE bits;
        AlertPolicy.k_raise_thermal, k_raise_sbe). Only rows that could raise
        (p >= min(hi, hi_memory)) are looked at; the rest read False / HELD_NONE / 0."""
        pol = self.policy
        raise_at = min(pol.hi, pol.hi_memory)
        memory_driven = np.zeros(len(prob), dtype=bool)
        held_back = np.full(len(prob), HELD_NONE, dtype=np.int8)
        driven = np.zeros(len(prob), dtype=np.int8)
        high = np.flatnonzero(prob >= raise_at)
        if len(high):
            x = features[high][:, self.model.cols].astype(np.float64)
            memory, thermal, sbe = self.model.family_shares(x)
            memory_driven[high] = (memory >= 0.5) & (prob[high] >= pol.hi_memory)
            driven[high] = np.where(thermal >= 0.5, DRIVEN_THERMAL, 0) | np.where(sbe >= 0.5, DRIVEN_SBE, 0)
            # per cause: its share, the features whose removal is also read (None: the share
            # alone), the node-peer count and how many peers share it
            heat_removal = self.model.thermal_mask if pol.shared_heat_by_removal else None
            for kind, share, removal, column, peers in (
                    (HELD_SHARED_HEAT, thermal, heat_removal, "node_warm_peers_1h", pol.shared_heat_peers),
                    (HELD_SHARED_SBE, sbe, None, "node_sbe_peers_6h", pol.shared_sbe_peers)):
                if peers > 0:
                    hit = np.nan_to_num(features[high, _FEATURE_INDEX[column]]) >= peers
                    rests = share >= 0.5
                    if removal is not None and hit.any():
                        rests[hit] |= self.model.rests_on(x[hit], removal, raise_at)
                    held_back[high[hit & rests]] = kind
            if pol.sparse_trend_by_removal:
                own = np.flatnonzero(held_back[high] == HELD_NONE)
                sparse = np.ones(len(own), dtype=bool)
                for column, below in SPARSE_WEEK:  # a missing count (a board without NVLink): none
                    sparse &= np.nan_to_num(features[high[own], _FEATURE_INDEX[column]]) < below
                if sparse.any():
                    rows = own[sparse]
                    rests = self.model.rests_on(x[rows], self.model.trend_mask, raise_at)
                    held_back[high[rows[rests]]] = HELD_SPARSE_TREND
        return memory_driven, held_back, driven

    def advance_policy(
        self, keys: Sequence[tuple[str, int]], ts: np.ndarray, prob: np.ndarray,
        memory_driven: np.ndarray, rule_hit: Sequence[Sequence[str]], held_back: np.ndarray | None = None,
        driven: np.ndarray | None = None,
    ) -> tuple[list[int], list[tuple[bool, str, bool]]]:
        """Advance the alert policy over scored rows (event-time order per GPU); rows held back
        (`held_back` != HELD_NONE, from `risk_drivers`) do not count toward raising,
        and a streak with thermal- or single-bit-driven rows (`driven`) needs that cause's hold.

        Returns the rows to emit and, per emitted row, (alert, source, was alerting before).
        Public so a policy sweep can replay stored probabilities without the features."""
        pol = self.policy
        if held_back is None:
            held_back = np.zeros(len(keys), dtype=np.int8)
        if driven is None:
            driven = np.zeros(len(keys), dtype=np.int8)
        emit_rows: list[int] = []
        states: list[tuple[bool, str, bool]] = []
        for i, (node, gpu) in enumerate(keys):
            key = f"{node}/{gpu}"
            st = self._gpu.get(key)
            if st is None:
                st = self._gpu[key] = _GpuAlert()
            p = prob[i]
            was = st.alerting
            own = held_back[i] == HELD_NONE
            st.high = st.high + 1 if (p >= pol.hi and own) else 0
            st.high_memory = st.high_memory + 1 if (memory_driven[i] and p >= pol.hi_memory and own) else 0
            st.no_thermal = 0 if driven[i] & DRIVEN_THERMAL else st.no_thermal + 1
            st.no_sbe = 0 if driven[i] & DRIVEN_SBE else st.no_sbe + 1
            st.low = st.low + 1 if p < pol.lo else 0
            fired = _fired_rules(st, rule_hit[i], pol, float(ts[i]))
            if fired:
                st.rule_left = pol.rule_hold_hops
            elif st.rule_left > 0:
                st.rule_left -= 1
            if not st.alerting:
                if st.rearm_left > 0:
                    st.rearm_left -= 1
                if fired:
                    st.alerting, st.source, st.raised_ts = True, "rule:" + ",".join(fired), float(ts[i])
                    st.peak = 0.0
                elif (pol.model_alerts
                      and (_held(st, st.high, pol.k_raise, pol)
                           or _held(st, st.high_memory, pol.k_raise_memory, pol))
                      and (st.rearm_left == 0 or p >= st.peak + pol.rearm_margin)):
                    st.alerting, st.source, st.raised_ts = True, "model", float(ts[i])
                    st.peak = float(p)
            elif st.rule_left == 0 and st.low >= pol.m_clear:
                st.alerting = False
                st.rearm_left = pol.rearm_hops if st.source == "model" else 0
            elif st.source == "model" and p > st.peak:
                st.peak = float(p)
            if st.alerting or was or p >= pol.emit_floor:
                emit_rows.append(i)
                states.append((st.alerting, st.source if (st.alerting or was) else "model", was))
        return emit_rows, states

    def _emit(
        self, keys: Sequence[tuple[str, int]], ts: np.ndarray, x: np.ndarray, prob: np.ndarray,
        emit_rows: list[int], states: list[tuple[bool, str, bool]], rule_hit: Sequence[Sequence[str]],
        job_ranks: Sequence[tuple[str | None, int | None]] | None, held_back: np.ndarray, driven: np.ndarray,
    ) -> list[Prediction]:
        """Predictions for the emitted rows: lead time, top signals, job and rank; a watch row's
        reason says why it is not raised yet where a hold-back or a longer hold is why."""
        rows = np.array(emit_rows)
        lead = self.model.lead_time_h(x[rows])
        contrib = self.model.contributions(x[rows])
        names = self.model.feature_names
        pol = self.policy
        out = []
        for j, i in enumerate(emit_rows):
            node, gpu = keys[i]
            job, rank = job_ranks[i] if job_ranks is not None else (None, None)
            alert, source, was = states[j]
            top = np.argsort(-contrib[j])[:4]
            signals = [Signal(name="source", value=source)]
            signals += [
                Signal(name=names[c], value=_num(x[i, c]), weight=round(float(contrib[j, c]), 4))
                for c in top if contrib[j, c] > 0
            ]
            for name in rule_hit[i]:  # a surge hop is evidence; it raised only if `source` names it
                hold = getattr(pol, RULE_BY_NAME[name].hold)
                if hold > 0:  # a rule turned off shows nothing
                    kind = "surge" if hold > 1 else "rule"
                    signals.append(Signal(name=f"{kind}:{name}", value=1.0, weight=None))
            reason = f"{source}: p={prob[i]:.2f}" if alert else ("cleared" if was else "watch")
            if held_back[i] == HELD_SPARSE_TREND and not alert:
                reason += f": {_SPARSE_TREND_REASON}"
            elif held_back[i] != HELD_NONE and not alert:
                peers = pol.shared_heat_peers if held_back[i] == HELD_SHARED_HEAT else pol.shared_sbe_peers
                reason += f": {_SHARED_REASON[int(held_back[i])]} shared with >= {peers} GPUs of the node"
            elif pol.model_alerts and not alert and not was and driven[i]:  # driven: p >= min(hi, hi_memory)
                held = [f"{cause}-driven, raises after {getattr(pol, hold)} hops at risk"
                        for bit, cause, _since, hold in _DRIVEN_HOLDS
                        if driven[i] & bit and getattr(pol, hold) > pol.k_raise]
                if held:
                    reason += ": " + "; ".join(held)
            out.append(Prediction(
                id=f"failure:{node}/{gpu}:{int(ts[i])}", type="failure", ts=float(ts[i]),
                node=node, gpu=int(gpu), job=job, rank=rank,
                probability=float(prob[i]), horizon_h=self.model.horizon_h, alert=alert, signals=signals,
                lead_time_h=None if np.isnan(lead[j]) else round(float(lead[j]), 2), reason=reason,
            ))
        return out

    def flush(self) -> list[Prediction]:
        return []

    def keys(self) -> list[str]:
        return list(self._gpu)

    def state(self, key: str) -> dict:
        # Flat fields only: a copy of the instance dict (dataclasses.asdict recurses and
        # deep-copies; the worker saves thousands of these per checkpoint).
        return dict(vars(self._gpu[key]))

    def restore(self, key: str, state: dict) -> None:
        surge = state.get("surge", ())
        if isinstance(surge, int):  # a checkpoint from before the sustained tier: the 2 h surge's streak
            surge = (surge,) if surge else ()
        self._gpu[key] = _GpuAlert(**{**state, "surge": tuple(surge)})

    def forget(self, key: str) -> None:
        self._gpu.pop(key, None)


def _held(st: _GpuAlert, streak: int, k: int, pol: AlertPolicy) -> bool:
    """Whether a streak of `streak` hops raises under a hold of `k`: a thermal- or single-bit-
    driven hop among its last k hops lengthens the hold to that cause's (AlertPolicy.k_raise_thermal,
    k_raise_sbe)."""
    return streak >= k and all(getattr(st, since) >= k or streak >= getattr(pol, hold)
                               for _bit, _cause, since, hold in _DRIVEN_HOLDS)


def _fired_rules(st: _GpuAlert, hits: Sequence[str], pol: AlertPolicy, ts: float) -> list[str]:
    """The rules that raise in this hop (event time `ts`): each rule hit once the GPU's hops
    have stayed above its level for its hold, or (`within_h`) once `hold` hops above it fell
    within that window (advances the GPU's per-rule streaks)."""
    if not hits:
        st.surge = ()
        return []
    fired: list[str] = []
    before = st.surge
    streaks = tuple((before[r] if r < len(before) else 0) + 1 if rule.name in hits else 0
                    for r, rule in enumerate(ALERT_RULES))
    st.surge = streaks if any(streaks) else ()
    for rule, streak in zip(ALERT_RULES, streaks, strict=True):
        hold = getattr(pol, rule.hold)
        if hold <= 0 or not streak:
            continue
        if rule.within_h:
            # A new list each time: a checkpoint holds the GPU's state dict shallowly copied.
            kept = [t for t in st.recent.get(rule.name, ()) if t > ts - rule.within_h * 3600.0]
            st.recent = {**st.recent, rule.name: [*kept[-(hold - 1):], ts] if hold > 1 else [ts]}
            streak = len(st.recent[rule.name])
        if hold <= streak:
            fired.append(rule.name)
    return fired


def _num(value: float) -> float | None:
    return None if np.isnan(value) else round(float(value), 4)
