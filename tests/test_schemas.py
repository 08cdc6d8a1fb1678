"""Schemas: bad records are rejected with the field named; every record type round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from fleetwise.schemas import (
    TOPICS,
    Command,
    DeadLetter,
    FeatureVector,
    GpuSample,
    JobIntent,
    ModelShape,
    NodeBatch,
    NodeInventory,
    Plan,
    Prediction,
    RankPlan,
    TrainingStep,
    describe_error,
    parse_timestamp,
    topic,
)
from fleetwise.schemas.export import RECORD_TYPES, write_json_schemas

SAMPLE = {
    "ts": 1764489600.0, "node": "node-017", "gpu": 3, "uuid": "GPU-1",
    "model": "NVIDIA H100 80GB HBM3",
    "metrics": {"DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": 512.3},
}


def error_of(model, data) -> str:
    with pytest.raises(ValidationError) as info:
        model.model_validate(data)
    return describe_error(info.value)


def test_design_sample_parses_and_rfc3339_ts():
    s = GpuSample.model_validate({**SAMPLE, "ts": "2025-11-30T08:00:00Z"})
    assert s.ts == 1764489600.0
    assert s.metrics["DCGM_FI_DEV_GPU_TEMP"] == 61.0


def test_parse_timestamp_is_the_records_rule():
    assert parse_timestamp("2025-11-30T08:00:00+00:00") == 1764489600.0
    assert parse_timestamp(" 1764489600.5 ") == 1764489600.5
    assert parse_timestamp(1764489600) == 1764489600.0
    for bad, says in [(None, "not None"), (True, "boolean"), ([1], r"not \[1\]"), ("nan", "finite"),
                      (float("inf"), "finite"), ("30 Nov", "RFC 3339")]:
        with pytest.raises(ValueError, match=says):
            parse_timestamp(bad)


@pytest.mark.parametrize(
    ("patch", "field", "bad"),
    [
        ({"gpu": -1}, "gpu", "-1"),
        ({"node": ""}, "node", "''"),
        ({"ts": "yesterday"}, "ts", "yesterday"),
        ({"ts": "2025-11-30T08:00:00"}, "ts", "UTC offset"),
        ({"ts": "nan"}, "ts", "finite"),
        ({"ts": " inf"}, "ts", "finite"),
        ({"metrics": {"DCGM_FI_DEV_GPU_TEMP": "hot"}}, "metrics.DCGM_FI_DEV_GPU_TEMP", "hot"),
        ({"metrics": {"DCGM_FI_DEV_GPU_TEMP": float("inf")}}, "metrics.DCGM_FI_DEV_GPU_TEMP", "inf"),
    ],
)
def test_bad_sample_names_field_and_value(patch, field, bad):
    message = error_of(GpuSample, {**SAMPLE, **patch})
    assert message.startswith(field), message
    assert bad in message


def test_nan_literal_in_json_is_rejected_naming_metric():
    raw = json.dumps(SAMPLE).replace("61", "NaN")
    with pytest.raises(ValidationError) as info:
        GpuSample.model_validate_json(raw)
    assert "metrics.DCGM_FI_DEV_GPU_TEMP" in describe_error(info.value)


def test_dcgm_blank_sentinels_become_missing():
    s = GpuSample.model_validate({**SAMPLE, "metrics": {"A": 9223372036854775794, "B": 2147483632, "C": 5}})
    assert s.metrics == {"A": None, "B": None, "C": 5.0}
    fp64 = GpuSample.model_validate({**SAMPLE, "metrics": {"X": 140737488355328.0}})
    assert fp64.metrics == {"X": None}


def test_large_counters_are_not_blanks():
    # Energy in mJ and violation time in ns pass 2**31 and 2**47 on long-running GPUs.
    big = {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 2147483650, "DCGM_FI_DEV_POWER_VIOLATION": 2.0e14}
    s = GpuSample.model_validate({**SAMPLE, "metrics": big})
    assert s.metrics == {k: float(v) for k, v in big.items()}


def test_batch_rejects_foreign_node():
    other = {**SAMPLE, "node": "node-999"}
    message = error_of(NodeBatch, {"ts": 1.0, "node": "node-017", "samples": [SAMPLE, other]})
    assert "samples.1.node" in message


def test_step_compute_bounded_by_step_time():
    step = {"ts": 1.0, "job": "j", "rank": 0, "node": "n", "gpu": 0, "step": 1,
            "step_time_s": 1.0, "compute_s": 9.0}
    assert "compute_s" in error_of(TrainingStep, step)


def test_model_shape_divisibility_and_inventory_topology():
    assert "heads" in error_of(ModelShape, {"name": "m", "layers": 2, "hidden": 100, "heads": 3})
    inv = {"ts": 1.0, "node": "n", "gpus": [{"index": 0, "model": "b200"}], "nvlink_groups": [[0, 1]]}
    assert "nvlink_groups.0" in error_of(NodeInventory, inv)


def test_topic_registry():
    names = [t.name for t in TOPICS]
    assert len(names) == len(set(names))
    assert topic("fleetwise.telemetry.gpu").key == "node"
    assert topic("fleetwise.inventory").compacted
    with pytest.raises(KeyError, match="known: fleetwise.inventory"):
        topic("fleetwise.nope")


def test_json_schema_export(tmp_path):
    paths = write_json_schemas(tmp_path)
    assert {p.name for p in paths} == {f"{n}.schema.json" for n in RECORD_TYPES}
    schema = json.loads((tmp_path / "gpu_sample.schema.json").read_text())
    assert {"ts", "node", "gpu", "model"} <= set(schema["required"])


# ---- property tests: every record type survives a JSON round trip -------------------------------
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e12, max_value=1e12)
ts = st.floats(min_value=0, max_value=4e9, allow_nan=False)
metric_values = st.one_of(st.none(), st.floats(min_value=-1e9, max_value=1e9, allow_nan=False))

samples = st.builds(
    GpuSample, ts=ts, node=names, gpu=st.integers(0, 1023), uuid=st.one_of(st.none(), names), model=names,
    metrics=st.dictionaries(names, metric_values, max_size=6), rack=st.one_of(st.none(), names),
    job=st.one_of(st.none(), names), rank=st.one_of(st.none(), st.integers(0, 10_000)),
)
steps = st.builds(
    lambda t, job, rank, step, st_s, frac: TrainingStep(
        ts=t, job=job, rank=rank, node="n", gpu=0, step=step, step_time_s=st_s, compute_s=st_s * frac),
    ts, names, st.integers(0, 4096), st.integers(0, 10**7),
    st.floats(min_value=1e-3, max_value=1e4), st.floats(min_value=0, max_value=1),
)
inventories = st.builds(
    lambda t, node, n: NodeInventory(
        ts=t, node=node, gpus=[{"index": i, "model": "h100-sxm", "nvlink_peers": []} for i in range(n)],
        nvlink_groups=[list(range(n))], nics=[{"name": "ib0", "speed_gbps": 400, "kind": "infiniband"}]),
    ts, names, st.integers(1, 8),
)
intents = st.builds(
    lambda job, layers, heads, gb: JobIntent(
        job=job, model=ModelShape(name="m", layers=layers, hidden=heads * 64, heads=heads), global_batch=gb),
    names, st.integers(1, 200), st.integers(1, 128), st.integers(1, 10**5),
)
plans = st.builds(
    lambda dp, mb: Plan(
        dp=dp, tp=1, pp=1, zero_stage=1, global_batch=dp * mb, seq_len=2048, predicted_step_s=1.0,
        tokens_per_s=1.0, mfu=0.4,
        ranks=[RankPlan(rank=r, node="n", gpu=r % 8, model="h100-sxm", capability_tflops=400.0,
                        micro_batch=mb,
                        stage=0, layers=(0, 31), memory_gb=10.0, memory_capacity_gb=80.0, dp_rank=r)
               for r in range(dp)]),
    st.integers(1, 16), st.integers(1, 8),
)
predictions = st.builds(
    Prediction, id=names, type=st.sampled_from(["failure", "straggler"]), ts=ts, node=names,
    gpu=st.integers(0, 7), probability=st.floats(0, 1), horizon_h=st.floats(0, 100), alert=st.booleans(),
    signals=st.lists(st.builds(dict, name=names, value=finite), max_size=3),
)
commands = st.builds(
    Command, id=names, type=st.sampled_from(["drain", "rebalance", "checkpoint"]), ts=ts, reason=names,
    evidence=st.lists(names, max_size=3), params=st.dictionaries(names, finite, max_size=3),
)
features = st.builds(
    FeatureVector, scope=st.sampled_from(["gpu", "rank"]), ts=ts, window_s=st.floats(1, 1e5), node=names,
    gpu=st.integers(0, 7), values=st.dictionaries(names, metric_values, max_size=5),
)
deadletters = st.builds(DeadLetter, ts=ts, source=names, reason=names, original=st.text(max_size=50))


@settings(max_examples=60, deadline=None)
@given(st.one_of(samples, steps, inventories, intents, plans, predictions, commands, features, deadletters))
def test_round_trip_json(record):
    again = type(record).model_validate_json(record.model_dump_json())
    assert again == record


def test_committed_json_schemas_are_current(tmp_path):
    """docs/schemas is what `fleetwise schemas export` writes today (rerun it after a change)."""
    committed = Path(__file__).resolve().parents[1] / "docs" / "schemas"
    for path in write_json_schemas(tmp_path):
        assert (committed / path.name).read_text() == path.read_text(), path.name


def test_trusted_feature_vector_is_what_model_construct_gives():
    from fleetwise.schemas import FeatureVector

    fields = dict(scope="gpu", ts=1.0, window_s=600.0, node="n1", gpu=3, model="h100-sxm", job="j",
                  rank=None, rack="r", site="s", values={"temp_mean": 61.5, "rth_slow": None})
    given = {k: v for k, v in fields.items() if v is not None}
    fast, ref = FeatureVector.trusted(**fields), FeatureVector.model_construct(**given)
    assert type(fast) is FeatureVector and fast == ref
    assert fast.__dict__ == ref.__dict__ and list(fast.__dict__) == list(ref.__dict__)
    assert fast.model_fields_set == ref.model_fields_set
    assert fast.model_extra == ref.model_extra and fast.__pydantic_private__ == ref.__pydantic_private__
    assert fast.to_json() == ref.to_json()
    assert FeatureVector.model_validate_json(fast.to_json()) == fast  # and it is a valid record
    fast.rack = "r2"  # still an ordinary mutable record
    assert fast.rack == "r2" and ref.rack == "r"


def test_feature_vector_json_bytes_are_pydantics():
    from fleetwise.schemas import FeatureVector

    values = {"temp_mean": 57.7, "rth_slow": None, "tiny": 1e-7, "big": 12345678901234.5, "sum": 0.1 + 0.2,
              "neg": -3.0, "zero": 0.0}
    for fv in (FeatureVector.trusted(scope="gpu", ts=1764547800.0, window_s=600.0, node="n-1", gpu=1,
                                     model="h100-sxm", job="j\\u00e9", rank=0, values=values),
               FeatureVector(scope="rank", ts="2025-12-01T00:10:00Z", window_s=300, node="n", gpu=0,
                             values={}),
               FeatureVector(scope="gpu", ts=1.0, window_s=600, node="n", gpu=0, values={},
                             extra_key=[1, 2])):
        assert fv.to_json_bytes() == fv.model_dump_json(exclude_none=True).encode()
