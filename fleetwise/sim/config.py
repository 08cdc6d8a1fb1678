"""Simulator configuration and the GPU-spec parser it shares with the CLI."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetwise.catalog import CatalogError, GpuSpec, parse_gpu_counts

# Classes of GPU hardware failure the simulator injects, and their share of failures.
# Llama 3 (REFERENCE.md: 419 interruptions on 16,384 H100 over 54 days) attributes ~30% to
# faulty GPUs incl. NVLink and ~17% to HBM3, i.e. HBM is ~1/3 of GPU-attributed failures; the
# split of the remainder (bus, GSP, thermal interface, silent) is our assumption.
DEFAULT_CLASS_MIX: dict[str, float] = {
    "hbm_ecc": 0.32,
    "nvlink": 0.16,
    "off_bus": 0.18,
    "gsp": 0.12,
    "thermal_interface": 0.10,
    "silent": 0.12,
}
FAILURE_CLASSES: tuple[str, ...] = tuple(DEFAULT_CLASS_MIX)


class SimConfigError(ValueError):
    """A simulator configuration that cannot be built (message says which field and why)."""


@dataclass
class SimConfig:
    """Everything that shapes a synthetic trace; the seed fixes every random choice."""

    gpus: str = "h100-sxm:32,a100-sxm-80gb:32,b200:16"  # catalog spec like the planner's
    days: float = 1.0
    seed: int = 0
    start_ts: float = 1764547200.0  # 2025-12-01T00:00Z
    sample_interval_s: float = 60.0
    # Llama 3: 419 interruptions / (16,384 GPUs x 54 days) = 0.47 per 1,000 GPU-days (all causes);
    # Meta RSC (arXiv 2410.21680): 2.34-6.50 per 1,000 node-days = 0.3-0.8 per 1,000 GPU-days.
    # Evaluation traces raise this (20-50) to get enough failures to score.
    failure_rate_per_1000_gpu_days: float = 0.5
    # Fail-slow compute and single-GPU thermal throttling on ranks of running jobs. ByteDance
    # (arXiv 2505.05713) sees 42.5% of jobs straggle, so slowdowns are far more common than failures.
    straggler_rate_per_1000_gpu_days: float = 20.0
    gpus_per_node: int = 8
    nodes_per_rack: int = 4
    sites: int = 2
    # Each rank's step record is emitted about once per this interval (one sampled step), not
    # every step, so long traces stay small.
    step_record_interval_s: float = 60.0
    # --- job mix ---
    job_hours_median: float = 8.0  # lognormal job length: hours to days
    job_max_nodes: int = 4
    idle_gap_mean_min: float = 30.0  # mean idle time of a node between jobs
    checkpoint_interval_min: tuple[float, float] = (30.0, 60.0)
    checkpoint_duration_min: tuple[float, float] = (1.0, 4.0)
    job_slowdown_rate_per_1000_job_hours: float = 20.0  # network / input-pipeline, job-wide
    util_drop_rate_per_1000_job_hours: float = 40.0  # evaluation pauses: job-wide utilisation drops
    # --- locations and GPUs ---
    hot_rack_share: float = 0.1  # racks with a hot spot (inlet several degrees above the room)
    hot_healthy_share: float = 0.02  # GPUs that run hot from airflow position but never fail
    lemon_share: float = 0.03
    lemon_hazard_mult: float = 15.0  # Titan (TitanGPULife): lemons carry a large share of failures
    # --- traps and noise (None = scale with the failure rate, see FleetSimulator) ---
    app_xid_rate_per_1000_gpu_days: float | None = None
    benign_sbe_burst_rate_per_1000_gpu_days: float | None = None
    transient_xid74_rate_per_1000_gpu_days: float = 4.0
    reboot_rate_per_1000_node_days: float = 30.0  # maintenance reboots (counter resets)
    scrape_gap_rate_per_node_day: float = 2.0  # windows of a few minutes with no samples
    missing_key_prob: float = 0.002  # a sample lacks some metrics
    repair_hours: tuple[float, float] = (4.0, 24.0)  # silent time before a replacement GPU
    # DCGM_FI_DEV_XID_ERRORS semantics: "last" = the last XID seen since boot, as DCGM's field
    # cache and dcgm-exporter report it (sticky; 0 = none yet); "interval" = the XID logged since
    # the previous sample, else 0. Generate both to check a predictor does not depend on one.
    xid_field: str = "last"
    class_mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_CLASS_MIX))
    # --- domain randomisation (issue 16; defaults reproduce the traces above exactly) ---
    # Draws for these knobs come from their own generator (seeded from `seed`), so turning one
    # on changes what it is about and nothing else. `fleetwise.sim.randomize` draws whole
    # families of configurations from ranges of them.
    site_inlet_c: tuple[float, ...] | None = None  # room set point per site (None: 22/24/23/25 C)
    rack_inlet_sd_c: float = 1.0  # rack-to-rack inlet spread
    cooling_rise_c: float = 42.0  # die-over-inlet rise at TDP of a typical board (cooling design)
    board_r_sd: float = 0.07  # board-to-board thermal-resistance spread (log sd)
    temp_noise_c: float = 0.3  # die-temperature sensor noise per sample
    temp_offset_sd_c: float = 0.0  # per-GPU constant temperature-sensor offset
    power_noise: float = 0.01  # relative power-reading noise
    # Inlet rise of a GPU when the other GPUs of its node run at TDP (hot air from neighbours:
    # a GPU's temperature then moves with its peers' power, not only its own).
    neighbour_heat_c: float = 0.0
    # Background error rates per GPU-day (healthy, lemon); None: the simulator's calibration.
    bg_sbe_per_day: tuple[float, float] | None = None
    bg_pcie_per_day: tuple[float, float] | None = None
    bg_nvl_per_day: tuple[float, float] | None = None
    bg_rate_sd: float = 0.0  # per-GPU log-normal spread of the background rates
    # Benign replay bursts on healthy GPUs (a marginal riser or cable that never fails): bursts
    # per GPU-day and the mean replays per burst.
    pcie_burst_rate_per_gpu_day: float = 0.0
    nvl_burst_rate_per_gpu_day: float = 0.0
    link_burst_size: float = 20.0
    # Scrape defects: a sample whose counter or gauge reads DCGM's blank sentinel, one that
    # lacks an error counter (the ECC / PCIe / NVLink fields drop out too).
    dcgm_blank_prob: float = 0.0
    missing_counter_prob: float = 0.0
    gpu_reset_rate_per_gpu_day: float = 0.0  # one GPU's volatile counters restart (GPU reset)
    # Trap shapes.
    benign_sbe_total: tuple[int, int] = (5, 60)  # single-bit errors per benign burst
    benign_sbe_minutes: tuple[float, float] = (10.0, 60.0)  # burst length
    xid74_peer_prob: float = 0.4  # each NVLink peer logs a sympathetic XID 74
    hot_healthy_excess_c: tuple[float, float] = (7.0, 12.0)  # hotter than its node at 70% TDP

    def validate(self) -> None:
        """Raise SimConfigError naming the first bad field."""
        if not self.days > 0:
            raise SimConfigError(f"days must be > 0, got {self.days}")
        if not self.sample_interval_s > 0:
            raise SimConfigError(f"sample interval must be > 0 s, got {self.sample_interval_s}")
        if not self.step_record_interval_s > 0:
            raise SimConfigError(f"step record interval must be > 0 s, got {self.step_record_interval_s}")
        if self.days * 86400.0 / self.sample_interval_s > 50_000_000:
            raise SimConfigError("too many ticks: raise the sample interval or shorten the trace")
        for name in (
            "failure_rate_per_1000_gpu_days",
            "straggler_rate_per_1000_gpu_days",
            "job_slowdown_rate_per_1000_job_hours",
            "util_drop_rate_per_1000_job_hours",
            "transient_xid74_rate_per_1000_gpu_days",
            "reboot_rate_per_1000_node_days",
            "scrape_gap_rate_per_node_day",
        ):
            if getattr(self, name) < 0:
                raise SimConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("app_xid_rate_per_1000_gpu_days", "benign_sbe_burst_rate_per_1000_gpu_days"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise SimConfigError(f"{name} must be >= 0, got {value}")
        if self.gpus_per_node < 1 or self.nodes_per_rack < 1 or self.sites < 1:
            raise SimConfigError("gpus_per_node, nodes_per_rack and sites must be >= 1")
        if self.job_max_nodes < 1:
            raise SimConfigError(f"job_max_nodes must be >= 1, got {self.job_max_nodes}")
        for name in ("hot_rack_share", "hot_healthy_share", "lemon_share", "missing_key_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SimConfigError(f"{name} must be within [0, 1], got {value}")
        if self.xid_field not in ("last", "interval"):
            raise SimConfigError(f"xid_field must be 'last' or 'interval', got {self.xid_field!r}")
        unknown = set(self.class_mix) - set(FAILURE_CLASSES)
        if unknown:
            raise SimConfigError(f"unknown failure classes {sorted(unknown)}; known: {list(FAILURE_CLASSES)}")
        if any(v < 0 for v in self.class_mix.values()) or sum(self.class_mix.values()) <= 0:
            raise SimConfigError("class_mix weights must be >= 0 and not all zero")
        for name in ("rack_inlet_sd_c", "cooling_rise_c", "board_r_sd", "temp_noise_c", "temp_offset_sd_c",
                     "power_noise", "neighbour_heat_c", "bg_rate_sd", "pcie_burst_rate_per_gpu_day",
                     "nvl_burst_rate_per_gpu_day", "link_burst_size", "gpu_reset_rate_per_gpu_day"):
            if not getattr(self, name) >= 0:
                raise SimConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.cooling_rise_c > 0:
            raise SimConfigError(f"cooling_rise_c must be > 0, got {self.cooling_rise_c}")
        for name in ("dcgm_blank_prob", "missing_counter_prob", "xid74_peer_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise SimConfigError(f"{name} must be within [0, 1], got {value}")
        if self.site_inlet_c is not None and not self.site_inlet_c:
            raise SimConfigError("site_inlet_c must name at least one set point (or be None)")
        for name in ("bg_sbe_per_day", "bg_pcie_per_day", "bg_nvl_per_day", "benign_sbe_total",
                     "benign_sbe_minutes", "hot_healthy_excess_c"):
            pair = getattr(self, name)
            if pair is not None and (len(pair) != 2 or not 0 <= pair[0] <= pair[1]):
                raise SimConfigError(f"{name} must be (low, high) with 0 <= low <= high, got {pair}")
        if self.benign_sbe_total[0] < 1 or self.benign_sbe_total[0] >= self.benign_sbe_total[1] \
                or self.benign_sbe_minutes[0] <= 0:
            raise SimConfigError("benign_sbe_total must be (low, high) with 1 <= low < high, "
                                 "benign_sbe_minutes > 0")
        parse_gpu_spec(self.gpus)


def nvml_name(spec: GpuSpec) -> str:
    """The model string NVML / dcgm-exporter reports (catalog name for unreleased parts)."""
    return spec.nvml_names[0] if spec.nvml_names else spec.name


def parse_gpu_spec(spec: str) -> list[tuple[GpuSpec, int]]:
    """Parse "h100-sxm:32,b200:16" with the catalog's parser; NVIDIA GPUs only (the simulator
    writes DCGM fields). Raises SimConfigError naming the offending entry."""
    try:
        parts = parse_gpu_counts(spec)
    except CatalogError as exc:
        raise SimConfigError(str(exc)) from None
    for gpu, _ in parts:
        if gpu.vendor != "NVIDIA":
            raise SimConfigError(
                f"GPU {gpu.id!r} is {gpu.vendor}, without DCGM telemetry; the simulator writes DCGM fields "
                "(NVIDIA only)"
            )
    return parts
