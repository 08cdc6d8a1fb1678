"""The bundled demo fleet: small, mixed, with a few failures and a straggler to look at."""

from __future__ import annotations

from fleetwise.sim.config import SimConfig


def demo_config() -> SimConfig:
    """~64 GPUs of four generations for two days at 60 s, seed 7.

    The failure rate is raised far above a real fleet's (~0.5 per 1,000 GPU-days) so that two
    days of 64 GPUs show every kind of failure: with seed 7, ten failures (HBM with 10-66 h
    precursors, a thermal interface, NVLink, GSP, abrupt off-the-bus and silent ones) and three
    stragglers (the straggler rate is raised too).
    """
    return SimConfig(
        gpus="h100-sxm:24,a100-sxm-80gb:16,b200:16,v100-sxm2-32gb:8",
        days=2.0,
        seed=7,
        sample_interval_s=60.0,
        failure_rate_per_1000_gpu_days=80.0,
        straggler_rate_per_1000_gpu_days=60.0,
        sites=2,
    )
