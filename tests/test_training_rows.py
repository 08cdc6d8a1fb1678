"""`training_rows`: the rows a fit reads, built chunk by chunk, are those of labelling the whole
feature table (so `fleetwise predictor train` reproduces the packaged model without holding a
trace's samples or its feature table)."""

from __future__ import annotations

import numpy as np
import pytest

from fleetwise.predictors.training import (
    compute_features,
    gpu_groups,
    label_rows,
    model_matrix,
    raw_samples,
    training_rows,
)
from fleetwise.sim import FleetSimulator, SimConfig


@pytest.fixture(scope="module")
def trace() -> tuple[list[dict], list[dict]]:
    sim = FleetSimulator(SimConfig(gpus="h100-sxm:8,a100-sxm-80gb:8", days=2, seed=6,
                                   failure_rate_per_1000_gpu_days=400, sample_interval_s=120))
    return [s for tick in sim.ticks() for s in tick.samples], sim.labels()


@pytest.mark.parametrize("source", ["dicts", "arrays"])
def test_rows_equal_those_of_the_whole_feature_table(trace: tuple[list, list], source: str) -> None:
    samples, labels = trace
    table = compute_features(iter(samples))
    lab = label_rows(table, labels)
    m = lab.train_mask
    assert (~m).any() and lab.y[m].any()  # some hops left out, some positives kept
    # The default chunk, as compute_features's: other chunk boundaries change sums in the last
    # bits (1e-14), which an exact comparison would count.
    rows = training_rows(iter(samples) if source == "dicts" else raw_samples(samples), labels)
    assert np.array_equal(rows.x, model_matrix(table)[m], equal_nan=True)
    assert np.array_equal(rows.y, lab.y[m])
    assert np.array_equal(rows.hours_to_failure, lab.hours_to_failure[m], equal_nan=True)
    assert np.array_equal(rows.groups, gpu_groups(table.keys)[m])
    assert (rows.hops, rows.gpus, rows.samples) == (len(table), len(set(table.keys)), table.samples)
