"""Domain randomisation of the simulator (issue 16): new knobs, defaults unchanged."""

from __future__ import annotations

import hashlib
import json

import pytest

from fleetwise.sim import FleetSimulator, SimConfig, SimConfigError
from fleetwise.sim.randomize import FAMILIES, family_config

P = "DCGM_FI_DEV_"
BLANK = 9223372036854775794


def _digest(cfg: SimConfig) -> str:
    sim = FleetSimulator(cfg)
    h = hashlib.sha256()
    for t in sim.ticks():
        h.update(json.dumps(t.samples, sort_keys=True).encode())
        h.update(json.dumps(t.steps, sort_keys=True).encode())
    h.update(json.dumps(sim.labels(), sort_keys=True, default=str).encode())
    return h.hexdigest()


def test_default_knobs_leave_traces_identical() -> None:
    # Digests of traces made by the simulator before the randomisation knobs existed: a default
    # configuration must still give these exact bytes (existing traces and tests stay valid).
    cfg = SimConfig(gpus="h100-sxm:16,a100-sxm-80gb:8", days=0.5, seed=7, failure_rate_per_1000_gpu_days=200,
                    sample_interval_s=120)
    assert _digest(cfg) == "bdb4cf194172eebcc4a5e191cd495744ff627cb33158ce361b664525d8774411"
    cfg = SimConfig(gpus="v100-sxm2-32gb:8,b200:8", days=0.3, seed=3, failure_rate_per_1000_gpu_days=300)
    assert _digest(cfg) == "fa4a170b4ea6be5ff17043ff2377c79b05bf63f3201a60ae6c6a122dd67bef67"


def _samples(cfg: SimConfig) -> list[dict]:
    return [s for t in FleetSimulator(cfg).ticks() for s in t.samples]


def test_knobs_change_what_they_name() -> None:
    base = dict(gpus="h100-sxm:16", days=0.5, seed=5, sample_interval_s=300,
                failure_rate_per_1000_gpu_days=0.0)
    plain = _samples(SimConfig(**base))
    blanks = _samples(SimConfig(**base, dcgm_blank_prob=0.2))
    n_blank = sum(v == BLANK for s in blanks for v in s["metrics"].values())
    assert n_blank > 0.1 * len(blanks)
    missing = _samples(SimConfig(**base, missing_counter_prob=0.5))
    assert sum(P + "ECC_SBE_VOL_TOTAL" not in s["metrics"] for s in missing) > 0.1 * len(missing)
    # Background single-bit rates per GPU: a 200x rate shows many more errors over the trace.
    def sbe_growth(samples: list[dict]) -> int:
        first, last = {}, {}
        for s in samples:
            v = s["metrics"].get(P + "ECC_SBE_AGG_TOTAL")
            if v is not None and v != BLANK:
                first.setdefault((s["node"], s["gpu"]), v)
                last[(s["node"], s["gpu"])] = v
        return sum(last[k] - first[k] for k in last)
    noisy = _samples(SimConfig(**base, bg_sbe_per_day=(10.0, 10.0), bg_rate_sd=0.5))
    assert sbe_growth(noisy) > 5 * max(1, sbe_growth(plain))
    # Hotter rooms read hotter.
    hot = _samples(SimConfig(**base, site_inlet_c=(32.0,)))
    mean = lambda xs: sum(s["metrics"][P + "GPU_TEMP"] for s in xs) / len(xs)  # noqa: E731
    assert mean(hot) > mean(plain) + 5.0


def test_families_are_reproducible_and_distinct() -> None:
    a, b = family_config("shifted", 3), family_config("shifted", 3)
    assert a == b
    assert family_config("train", 3) != a
    assert set(FAMILIES["shifted"].intervals_s) == {300.0}
    # The shifted family is not a subset of the training family's mixes.
    assert not set(FAMILIES["shifted"].mixes) & set(FAMILIES["train"].mixes)
    with pytest.raises(ValueError, match="unknown configuration family"):
        family_config("nope", 0)


def test_wide_spans_train_and_shifted_and_far_lies_beyond() -> None:
    from fleetwise.catalog import parse_gpu_counts

    train, shifted, wide, far = (FAMILIES[n] for n in ("train", "shifted", "wide", "far"))
    for name, (lo, hi) in wide.ranges.items():
        assert lo <= min(train.ranges[name][0], shifted.ranges[name][0])
        assert hi >= max(train.ranges[name][1], shifted.ranges[name][1])
        # "far" is the held-out family of a model trained on "wide": beyond it on every range.
        assert far.ranges[name][1] > hi, name
    assert set(far.ranges) == set(wide.ranges)

    def models(family) -> set[str]:  # noqa: ANN001
        return {g.id for mix in family.mixes for g, _ in parse_gpu_counts(mix)}

    assert not models(far) & models(wide)
    cfg = family_config("far", 2)
    assert cfg.class_mix == far.class_mix and cfg.sample_interval_s == 300.0
    assert family_config("wide", 0).class_mix == SimConfig().class_mix


def test_bad_knob_names_the_field() -> None:
    with pytest.raises(SimConfigError, match="dcgm_blank_prob"):
        SimConfig(dcgm_blank_prob=2.0).validate()
    with pytest.raises(SimConfigError, match="bg_sbe_per_day"):
        SimConfig(bg_sbe_per_day=(2.0, 1.0)).validate()
