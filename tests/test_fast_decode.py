"""The telemetry fast path (msgspec, many lines per call) against the pydantic records: it
refuses what it cannot vouch for, and whatever path a line takes, the features are the same."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fleetwise.predictors.features import SAMPLE_DECODER, GpuFeatureWindows, feature_matrix
from fleetwise.schemas import DeadLetter, GpuSample
from fleetwise.schemas import topics as T
from fleetwise.schemas.fast import FastGpuSample, SampleDecoder
from fleetwise.sim import FleetSimulator, SimConfig
from fleetwise.streams.embedded import EmbeddedRuntime
from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

GPU = T.TELEMETRY_GPU.name
FEATURES_ONLY = ControlPlaneConfig(failure_predictor=False, straggler_detector=False)
GOOD = {"ts": 1764547200.0, "node": "n1", "gpu": 0, "model": "NVIDIA H100 80GB HBM3",
        "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 500.0}}


def line(**changes: object) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def test_decoder_reads_its_fields_and_refuses_what_the_records_might_coerce_or_reject():
    dec = SampleDecoder(["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK"])
    s = dec.sample(line(rack="r1", job="j", rank=3))
    assert isinstance(s, FastGpuSample) and (s.node, s.gpu, s.rack, s.job, s.rank) == ("n1", 0, "r1", "j", 3)
    rows = dec.metric_rows([s, GpuSample.model_validate(GOOD)])
    assert rows.shape == (2, 3)
    assert rows[0, :2].tolist() == [60.0, 500.0] and np.isnan(rows[0, 2])  # missing -> NaN
    assert np.array_equal(rows[0], rows[1], equal_nan=True)  # pydantic records give the same row
    refused = [
        line(ts="2025-12-01T00:00:00Z"),  # RFC 3339: the records parse it, this path does not
        line(gpu=3.0), line(gpu=1024), line(gpu=-1), line(node=""), line(ts=True), line(rank=-1),
        line(metrics={"DCGM_FI_DEV_GPU_TEMP": "61"}),
        line(metrics={"DCGM_FI_DEV_GPU_TEMP": True}),
        line().replace(b"60", b"NaN"),
        line().replace(b"60", b"1e999"),
        b"{not json",
    ]
    for raw in refused:
        assert dec.sample(raw) is None, raw
    assert dec.samples([line(), line(gpu=1)]) is not None
    assert dec.samples([line(), refused[0]]) is None  # one refusal refuses the chunk


def test_integer_metrics_give_the_float_rows_and_beyond_int64_take_the_records_path():
    dec = SampleDecoder(["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK"])
    ints = {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 2**63 - 1, "DCGM_FI_DEV_SM_CLOCK": -3}
    floats = {name: float(value) for name, value in ints.items()}
    rows = dec.metric_rows([dec.sample(line(metrics=ints)), dec.sample(line(metrics=floats))])
    assert rows.dtype == np.float64 and rows[0].tolist() == rows[1].tolist() == list(floats.values())
    for too_large in (2**63, -(2**63) - 1, 10**400):
        raw = line(metrics={"DCGM_FI_DEV_GPU_TEMP": too_large})
        assert dec.sample(raw) is None  # the records decide: a float as large, or not finite
    big = EmbeddedRuntime(ControlPlane(FEATURES_ONLY))
    big.feed_lines([line(metrics={"DCGM_FI_DEV_GPU_TEMP": value}) for value in (2**63, 10**400)], "t.jsonl")
    (source, reason), = big.finish().bad_lines  # 2**63 is a finite float; 10**400 is not
    assert source == "t.jsonl:2" and reason.startswith("metrics.DCGM_FI_DEV_GPU_TEMP: ")
    assert big.summary.samples == 1


def test_a_chunk_decodes_one_value_per_line_or_is_refused():
    # Malformed lines that would read as other values once joined into one JSON array.
    whole = line()
    cut = whole.index(b', "gpu"')
    split_object = [whole[:cut], whole[cut + 1:]]  # one object over two lines, less the comma
    assert SAMPLE_DECODER.sample(split_object[0]) is None and SAMPLE_DECODER.sample(split_object[1]) is None
    two_in_one = whole + b"," + line(gpu=1)
    open_string = [whole[:cut] + b', "rack": "x', b'y"' + whole[cut:]]  # a string left open runs on
    for lines in ([whole, *split_object], [two_in_one, whole], open_string):
        assert SAMPLE_DECODER.samples(lines) is None, lines
    assert len(SAMPLE_DECODER.samples([whole, line(gpu=1)])) == 2
    batch = json.dumps({"ts": 1.0, "node": "n1", "samples": [GOOD]}).encode()
    assert SAMPLE_DECODER.batches([batch, batch]) is not None
    assert SAMPLE_DECODER.batches([batch + b"," + batch]) is None
    from fleetwise.schemas.fast import training_steps

    step = json.dumps({"ts": 1.0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 3,
                       "step_time_s": 1.2, "compute_s": 1.0}).encode()
    cut = step.index(b', "rank"')
    assert training_steps([step, step[:cut], step[cut + 1:]]) is None
    assert training_steps([step, step]) is not None


def test_batches_must_hold_one_node():
    batch = {"ts": 1.0, "node": "n1", "samples": [GOOD, {**GOOD, "gpu": 1}]}
    assert len(SAMPLE_DECODER.batch(json.dumps(batch).encode())) == 2
    other = {**batch, "samples": [GOOD, {**GOOD, "node": "n2"}]}
    assert SAMPLE_DECODER.batch(json.dumps(other).encode()) is None
    assert SAMPLE_DECODER.batches([json.dumps(batch).encode(), json.dumps(other).encode()]) is None


def test_one_bad_message_does_not_cost_the_good_ones_beside_it():
    control = ControlPlane(FEATURES_ONLY)
    good = {"ts": 1.0, "node": "n1", "samples": [GOOD, {**GOOD, "gpu": 1}]}
    bad = {"ts": 1.0, "node": "n2", "samples": [{**GOOD, "node": "n2"}, {**GOOD, "node": "n2", "gpu": -5}]}
    unknown = {"ts": 1.0, "node": "n3", "samples": [{**GOOD, "node": "n3", "model": "NVIDIA Z9000"}]}
    raws = [json.dumps(m).encode() for m in (good, bad, unknown)] + [None]
    out = control.decode_messages(GPU, raws, ["t:0:1", "t:0:2", "t:0:3", "t:0:4"])
    assert len(out[0]) == 2 and all(isinstance(x, FastGpuSample) for x in out[0])
    assert [isinstance(x, DeadLetter) for x in out[1]] == [False, True]
    assert out[1][1].source == "t:0:2#samples.1" and "gpu" in out[1][1].reason
    assert isinstance(out[2][0], DeadLetter) and "unknown GPU" in out[2][0].reason
    assert isinstance(out[3][0], DeadLetter) and "empty message" in out[3][0].reason
    # The clean batches alone take the one-call path and give the same samples.
    fast = control.decode_messages(GPU, raws[:1], ["t:0:1"])
    assert [(s.node, s.gpu) for s in fast[0]] == [(s.node, s.gpu) for s in out[0]]


@pytest.fixture(scope="module")
def trace_lines() -> list[bytes]:
    """A simulated trace with odd but valid lines mixed in (each takes the pydantic path) and bad
    ones (dead letters)."""
    sim = FleetSimulator(SimConfig(gpus="h100-sxm:8,a100-sxm-80gb:8", days=0.3, seed=5,
                                   failure_rate_per_1000_gpu_days=200))
    lines = [json.dumps(s).encode() for tick in sim.ticks() for s in tick.samples]
    odd = []
    for i in range(0, len(lines), 97):
        obj = json.loads(lines[i])
        k = (i // 97) % 5
        if k == 0:  # RFC 3339 timestamp
            from datetime import UTC, datetime
            obj["ts"] = datetime.fromtimestamp(obj["ts"], UTC).isoformat()
        elif k == 1:  # numbers as the records coerce them
            obj["gpu"] = float(obj["gpu"])
        elif k == 2:  # a DCGM blank: missing, not a huge reading
            obj["metrics"]["DCGM_FI_DEV_POWER_USAGE"] = 140737488355328.0
        elif k == 3:  # field 112 under its pre-DCGM-3.3 name
            obj["metrics"]["DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"] = obj["metrics"].pop(
                "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", 0) or 0x40
        else:  # bad: NaN reading (dead letter)
            obj["metrics"]["DCGM_FI_DEV_GPU_TEMP"] = float("nan")
        odd.append((i, json.dumps(obj).encode()))
    for i, raw in odd:
        lines[i] = raw
    return lines


def test_fast_path_and_record_path_give_the_same_features(trace_lines):
    fast = EmbeddedRuntime(ControlPlane(FEATURES_ONLY))
    fast.feed_lines(trace_lines, "trace")
    fast.finish()
    # Reference: every line through the pydantic records, one by one.
    slow = EmbeddedRuntime(ControlPlane(FEATURES_ONLY))
    for i, raw in enumerate(trace_lines):
        slow.feed(GPU, slow.control.decode_obj(GPU, json.loads(raw), source=f"trace:{i + 1}", raw=raw))
    slow.finish()
    # Emission order follows the chunks (a hop closes when a later sample arrives): compare by key.
    def by_key(vectors: list) -> list:
        return sorted(vectors, key=lambda v: (v.ts, v.node, v.gpu))

    got, want = by_key(fast.bus.records(T.FEATURES.name)), by_key(slow.bus.records(T.FEATURES.name))
    assert len(got) == len(want) > 0
    def keys(vectors: list) -> list[tuple]:
        return [(v.ts, v.node, v.gpu, v.job, v.rank) for v in vectors]

    assert keys(got) == keys(want)
    a, b = feature_matrix(got), feature_matrix(want)
    # Equal up to float rounding: a hop split across chunks sums its samples in another order.
    assert np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)
    assert fast.summary.samples == slow.control.counts["samples_in"]
    dead = fast.bus.records(T.DEADLETTER.name)
    assert len(dead) == len(range(0, len(trace_lines), 97)[4::5])
    assert all("finite number" in d.reason for d in dead)


def test_windows_take_structs_and_records_alike(trace_lines):
    clean = [raw for raw in trace_lines if b"NaN" not in raw and b'"ts": "' not in raw]
    records = [GpuSample.model_validate_json(raw) for raw in clean[:2000]]
    a, b = GpuFeatureWindows(), GpuFeatureWindows()
    mixed = [SAMPLE_DECODER.sample(r) or GpuSample.model_validate_json(r) for r in clean[:2000]]
    ra = a.ingest_samples(mixed)
    rb = b.ingest_samples(records)
    for x, y in zip(ra, rb, strict=True):
        assert np.array_equal(x, y, equal_nan=True)


def test_step_lines_take_the_fast_path_and_keep_the_records_rules():
    from fleetwise.schemas.fast import FastTrainingStep, training_step, training_steps

    good = {"ts": 1.0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 3,
            "step_time_s": 1.2, "compute_s": 1.0, "samples": 8, "model": "h100-sxm"}
    raw = json.dumps(good).encode()
    step = training_step(raw)
    assert isinstance(step, FastTrainingStep) and (step.job, step.step, step.samples) == ("j", 3, 8)
    refused = [{**good, "compute_s": 2.0}, {**good, "step_time_s": 0}, {**good, "rank": -1},
               {**good, "ts": "2025-12-01T00:00:00Z"}, {**good, "job": ""}]
    for bad in refused:
        assert training_step(json.dumps(bad).encode()) is None, bad
    assert training_steps([raw, json.dumps(refused[0]).encode()]) is None
    # Through the control plane: the refused ones get the records' verdict and reason.
    control = ControlPlane(FEATURES_ONLY)
    out = control.decode_lines(T.TELEMETRY_STEPS.name, [raw] + [json.dumps(b).encode() for b in refused],
                               [f"s:{i}" for i in range(6)])
    assert isinstance(out[0], FastTrainingStep)
    kinds = [type(x).__name__ for x in out]
    assert kinds[1:4] == ["DeadLetter"] * 3 and kinds[5] == "DeadLetter"
    assert "compute_s" in out[1].reason and out[1].source == "s:1"
    assert kinds[4] == "TrainingStep"  # RFC 3339 time: the records parse it


def test_replay_lines_may_be_node_batches():
    batch = {"ts": 1.0, "node": "n1", "samples": [GOOD, {**GOOD, "gpu": 1}]}
    bad = {**batch, "samples": [GOOD, {**GOOD, "gpu": -5}]}
    runtime = EmbeddedRuntime(ControlPlane(FEATURES_ONLY))
    runtime.feed_lines([json.dumps(batch).encode() + b"\n", json.dumps(bad).encode() + b"\n"], "t")
    runtime.finish()
    assert runtime.summary.samples == 3
    assert [source for source, _ in runtime.summary.bad_lines] == ["t:2#samples.1"]


def test_trace_text_decodes_one_record_per_line_as_the_sample_and_step_paths_do():
    from msgspec.structs import asdict

    from fleetwise.schemas.fast import training_step

    step = {"ts": 1.0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 3,
            "step_time_s": 1.2, "compute_s": 1.0, "samples": 8, "model": "h100-sxm"}
    gpu_lines = [line(), line(gpu=5, rack="r1", job="j", rank=2),
                 line(metrics={"DCGM_FI_DEV_XID_ERRORS": 79})]
    step_lines = [json.dumps(step).encode(), json.dumps({**step, "rank": 1, "micro_batch": 2}).encode()]
    lines = [gpu_lines[0], step_lines[0], gpu_lines[1], step_lines[1], gpu_lines[2]]
    want_samples = SAMPLE_DECODER.columns([SAMPLE_DECODER.sample(raw) for raw in gpu_lines])
    for text in (b"\n".join(lines), b"\n".join(lines) + b"\n", b"\r\n".join(lines)):
        samples, steps, is_gpu = SAMPLE_DECODER.trace_lines(text)
        assert is_gpu == [True, False, True, False, True]
        for name in ("node", "gpu", "model", "rack", "site", "job", "rank"):
            assert getattr(samples, name) == list(getattr(want_samples, name)), name
        assert samples.rack == [None, "r1", None] and samples.job == [None, "j", None]
        assert np.array_equal(samples.ts, want_samples.ts)
        assert np.array_equal(samples.metrics, want_samples.metrics, equal_nan=True)
        for record, raw in zip(steps, step_lines, strict=True):
            want = asdict(training_step(raw))
            assert {f: getattr(record, f) for f in want} == want
    empty = SAMPLE_DECODER.trace_lines(b"")
    assert (len(empty.samples), empty.steps, empty.is_sample) == (0, [], [])


def test_sample_columns_slice_and_join_in_order():
    from fleetwise.schemas.fast import SampleColumns

    raws = [line(gpu=g, job=f"j{g % 2}", rank=g) for g in range(5)]
    cols = SAMPLE_DECODER.columns([SAMPLE_DECODER.sample(raw) for raw in raws], intern=True)
    assert cols.gpu == [0, 1, 2, 3, 4] and cols.job == ["j0", "j1", "j0", "j1", "j0"]
    assert cols.job[0] is cols.job[2]  # interned: one string for all its samples
    joined = SampleColumns.concat([cols[:2], cols[2:3], cols[3:]])
    for name in ("node", "gpu", "model", "rack", "site", "job", "rank"):
        assert getattr(joined, name) == getattr(cols, name), name
    assert np.array_equal(joined.ts, cols.ts)
    assert np.array_equal(joined.metrics, cols.metrics, equal_nan=True)
    # Without interning the columns read the records (pydantic ones here) when asked: the same
    # values, sliced and joined with interned ones alike.
    records = SAMPLE_DECODER.columns([GpuSample.model_validate_json(raw) for raw in raws])
    mixed = SampleColumns.concat([records[:2], cols[2:4], records[4:]])
    for name in ("node", "gpu", "model", "rack", "site", "job", "rank"):
        assert list(getattr(records, name)) == getattr(cols, name), name
        assert getattr(mixed, name) == getattr(cols, name), name
        assert getattr(records, name)[3] == getattr(cols, name)[3], name
    assert np.array_equal(records.metrics, cols.metrics, equal_nan=True)


def test_trace_text_is_refused_unless_every_line_is_one_sample_or_step_the_fast_paths_take():
    step = {"ts": 1.0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 3,
            "step_time_s": 1.2, "compute_s": 1.0}
    good = [line(), json.dumps(step).encode()]

    def text(*extra: bytes) -> bytes:
        return b"\n".join([*good, *extra])

    assert SAMPLE_DECODER.trace_lines(text(line(gpu=1))) is not None
    refused = {
        # two values on one line, a blank line to even the count
        "two on a line": text(line() + b" " + line(), b""),
        "blank line": text(b"", line()),
        "space line": text(b"   ", line()),
        "indented": text(b" " + line()),
        "trailing space": text(line() + b" "),
        # A value running on into the next line, whose own value makes up the count: each
        # line alone is not JSON (the line path dead-letters both).
        "value across lines": text(line()[:-1] + b', "metrics":', line() + b"} " + line()),
        "neither": text(json.dumps({"ts": 1.0, "node": "n1", "gpu": 0}).encode()),
        "gpu 1024": text(line(gpu=1024)),
        "no model": text(json.dumps({k: v for k, v in GOOD.items() if k != "model"}).encode()),
        "empty model": text(line(model="")),
        "rfc3339 ts, no offset": text(line(ts="2025-12-01T00:00:00")),
        "non-numeric string metric": text(line(metrics={"DCGM_FI_DEV_GPU_TEMP": "hot"})),
        "node batch": text(json.dumps({"ts": 1.0, "node": "n1", "samples": [GOOD]}).encode()),
        "inventory": text(json.dumps({"ts": 1.0, "node": "n1", "gpus": []}).encode()),
        "not json": text(b"{not json"),
        **{f"step without {k}": text(json.dumps({f: v for f, v in step.items() if f != k}).encode())
           for k in ("job", "rank", "step", "compute_s", "step_time_s")},
        "step empty job": text(json.dumps({**step, "job": ""}).encode()),
        "step compute > 1.5x": text(json.dumps({**step, "compute_s": 2.0}).encode()),
        "step time 0": text(json.dumps({**step, "step_time_s": 0}).encode()),
        "metrics null": text(json.dumps({**step, "metrics": None}).encode()),
    }
    for name, raw in refused.items():
        assert SAMPLE_DECODER.trace_lines(raw) is None, name
    # What the records accept and the C splitter reads as they do (issue 16 item 5): RFC 3339
    # times and metrics written as numeric strings.
    rfc, stringly = (SAMPLE_DECODER.trace_lines(text(raw)) for raw in (
        line(ts="2025-12-01T00:00:00.25+01:00"), line(metrics={"DCGM_FI_DEV_GPU_TEMP": "61.5"})))
    assert rfc.samples.ts[-1] == GpuSample.model_validate_json(line(ts="2025-12-01T00:00:00.25+01:00")).ts
    temp = SAMPLE_DECODER.metric_fields.index("DCGM_FI_DEV_GPU_TEMP")
    assert stringly.samples.metrics[-1, temp] == 61.5
    # Through the control plane, an unknown GPU model refuses the text too (the line path
    # dead-letters that line and keeps the others).
    control = ControlPlane(FEATURES_ONLY)
    assert control.decode_trace_text(text(line(gpu=1))) is not None
    assert control.decode_trace_text(text(line(model="NVIDIA Nonexistent 9000"))) is None
