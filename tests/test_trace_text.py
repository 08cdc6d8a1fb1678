"""The C line splitter (`_trace_text.split`, behind `SampleDecoder.trace_lines`) against the
msgspec path it stands in front of: whatever it accepts it decodes to the same values, bit for
bit; what msgspec refuses it refuses; and the plain lines the simulator writes it accepts."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetwise.predictors.features import SAMPLE_DECODER
from fleetwise.schemas.fast import FastTrainingStep, SampleDecoder, TraceBlock
from fleetwise.sim import FleetSimulator, SimConfig

FIELDS = ["DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_XID_ERRORS"]
DECODER = SampleDecoder(FIELDS)
STEP = {"ts": 1.0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 3, "step_time_s": 1.2,
        "compute_s": 1.0}


def assert_same_block(plain: TraceBlock, any_: TraceBlock) -> None:
    assert plain.is_sample == any_.is_sample
    for name in ("node", "gpu", "model", "rack", "site", "job", "rank"):
        got, want = getattr(plain.samples, name), list(getattr(any_.samples, name))
        assert got == want, name
        assert [type(v) for v in got] == [type(v) for v in want], name
    assert plain.samples.ts.tobytes() == any_.samples.ts.tobytes()  # -0.0 and NaN included
    assert plain.samples.metrics.shape == any_.samples.metrics.shape
    assert plain.samples.metrics.tobytes() == any_.samples.metrics.tobytes()
    # Steps: every field the step record has, of the same type (a float step time stays a float).
    got = [[getattr(s, f) for f in FastTrainingStep.__struct_fields__] for s in plain.steps]
    want = [[getattr(s, f) for f in FastTrainingStep.__struct_fields__] for s in any_.steps]
    assert got == want
    assert [list(map(type, row)) for row in got] == [list(map(type, row)) for row in want]


def both_paths(decoder: SampleDecoder, text: bytes) -> tuple[TraceBlock | None, TraceBlock | None]:
    return decoder._plain_trace_lines(text), decoder._any_trace_lines(text)


def test_simulated_lines_are_all_split_in_c_to_the_values_msgspec_gives():
    cfg = SimConfig(gpus="h100-sxm:16,a100-sxm-80gb:8,b200:8", days=0.05, seed=3)
    lines = []
    for tick in FleetSimulator(cfg).ticks():
        lines.extend(json.dumps(s, separators=(",", ":")).encode() for s in tick.samples)
        lines.extend(json.dumps(s).encode() for s in tick.steps)  # with json's default spaces
    assert any(b"step_time_s" in raw for raw in lines) and any(b"metrics" in raw for raw in lines)
    for first in range(0, len(lines), 500):
        text = b"\n".join(lines[first:first + 500]) + b"\n"
        plain, any_ = both_paths(SAMPLE_DECODER, text)
        assert plain is not None and any_ is not None
        assert_same_block(plain, any_)


# Raw JSON for a value: Python values as json writes them, and number and string spellings it
# never writes (exponents, "-0", leading zeros, escapes, non-ASCII, beyond float and int64).
RAW_NUMBERS = ["0", "-0", "-0.0", "1E5", "1e+2", "2.5e-3", "1e400", "-1e400", "1e-400", "01", "1.", ".5",
               "-", "9223372036854775807", "9223372036854775808", "-9223372036854775808",
               "-9223372036854775809", "18446744073709551617", "-18446744073709551617",
               "123456789012345678901234", "9007199254740993",
               "1.7976931348623157e308",
               "0.1000000000000000055511151231257827", "4.9e-324", "NaN", "Infinity", "+1", "0x10", "1_0"]
RAW_STRINGS = ['"a\\u0041"', '"\\"q"', '"caf\xc3\xa9"', '"tab\\t"', '"\x01"', '"del\x7f"', '""', '"h100-sxm"']
json_value = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.floats(-1e6, 1e6).map(lambda v: f"{v:.4f}"),
    st.sampled_from(RAW_NUMBERS + RAW_STRINGS + ["null", "true", "false", "[]", "{}", '{"a":1}', "[1,2]"]),
    st.text("abN\\\"é\x01 -_", max_size=4).map(json.dumps),
)
space = st.sampled_from(["", "", "", " ", "\t", "  "])


@st.composite
def json_object(draw: st.DrawFn, values: dict[str, st.SearchStrategy[str]], required: list[str]) -> str:
    """An object of the `required` keys and some of the others, in any order, each value a
    plain one for its key or now and then any JSON value (or none), sometimes a key twice,
    with whitespace between tokens."""
    optional = [k for k in values if k not in required]
    keys = required + draw(st.lists(st.sampled_from(optional), max_size=len(optional), unique=True))
    if keys and draw(st.integers(0, 7)) == 0:
        keys.append(draw(st.sampled_from(keys)))  # a key twice
    parts = []
    for key in draw(st.permutations(keys)):
        value = draw(json_value) if draw(st.integers(0, 9)) == 0 else draw(values[key])
        parts.append(f'{draw(space)}"{key}"{draw(space)}:{draw(space)}{value}{draw(space)}')
    return "{" + ",".join(parts) + "}"


def one_of_json(*values: object) -> st.SearchStrategy[str]:
    return st.sampled_from([json.dumps(v) for v in values])


metric_value = st.one_of(st.integers(-(2**63), 2**63 - 1).map(str),
                         st.floats(allow_nan=False, allow_infinity=False).map(repr),
                         st.floats(0, 1000).map(lambda v: f"{v:.3f}"), st.just("null"),
                         st.sampled_from(RAW_NUMBERS))
metrics_object = json_object({**{f: metric_value for f in FIELDS}, "DCGM_FI_DEV_GPU_TEMP_2": metric_value,
                              "x": one_of_json("a", None, True)}, [])
text_or_null = one_of_json("r1", "site-0", "job-7", "", None)
sample_line = json_object({
    "ts": st.one_of(st.floats(0, 2e9).map(repr), st.integers(-(2**60), 2**60).map(str)),
    "node": one_of_json("n1", "node-007"),
    "gpu": st.one_of(st.integers(0, 1023), st.sampled_from([-1, 1024])).map(str),
    "model": one_of_json("NVIDIA H100 80GB HBM3", "b200"), "metrics": metrics_object,
    "rack": text_or_null, "site": text_or_null, "job": text_or_null,
    "rank": st.one_of(st.integers(0, 4096), st.just(-1)).map(str) | st.just("null"),
    "uuid": one_of_json("GPU-1"), "extra": one_of_json(1.5, "x", None, False),
}, ["ts", "node", "gpu", "model", "metrics"])
step_line = json_object({
    **{k: st.just(json.dumps(v)) for k, v in STEP.items()},
    "step_time_s": st.one_of(st.floats(0, 10).map(repr), st.sampled_from(["1", "0", "1e-320"])),
    "compute_s": st.one_of(st.floats(0, 12).map(repr), st.sampled_from(["0", "-0.0", "1.8"])),
    "job": one_of_json("j", "job-7", ""), "node": one_of_json("n1", ""),
    "gpu": st.sampled_from(["0", "7", "1024", "-1"]), "rank": st.sampled_from(["0", "3", "-1", "null"]),
    "micro_batch": st.sampled_from(["0", "8", "-1", "null"]),
    "samples": st.sampled_from(["0", "8", "-1", "null"]), "model": one_of_json("b200", "", None),
    "rack": text_or_null, "site": text_or_null, "uuid": one_of_json("GPU-1"),
}, list(STEP))


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(st.lists(st.one_of(sample_line, step_line), min_size=1, max_size=6), st.sampled_from(["\n", "\r\n"]))
def test_what_the_c_splitter_accepts_msgspec_decodes_to_the_same_values(lines, newline):
    text = newline.join(lines).encode()
    plain, any_ = both_paths(DECODER, text)
    if any_ is None:
        assert plain is None
    elif plain is not None:
        assert_same_block(plain, any_)


def assert_agree(text: bytes) -> TraceBlock | None:
    """The C splitter's answer for `text`, checked against msgspec's: refused where msgspec
    refuses, the same values where it accepts."""
    plain, any_ = both_paths(DECODER, text)
    if any_ is None:
        assert plain is None, text
    elif plain is not None:
        assert_same_block(plain, any_)
    return plain


GOOD = json.dumps({"ts": 1.5, "node": "n1", "gpu": 2, "model": "b200", "rack": "r", "rank": 3,
                   "metrics": {"DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": -0.0}})


# Of the edges below, those the C splitter must read itself (the rest both refuse).
READ = {('"gpu": 2', '"gpu": 1023'), ('"rank": 3', '"rank": null'), ('"r"', '""'), ('"r"', "null"),
        ("1.5", "17"), ("1.5", "1e-400"), ("61", "1E2"), ("61", "9223372036854775807"),
        ("61", "-9223372036854775808"), ("61", "null"), ('{"ts"', '{ "ts"'), ("61", "65778491027943236e8")}


def test_the_c_splitter_reads_plain_lines_and_agrees_with_msgspec_at_each_rule():
    plain = assert_agree(GOOD.encode())
    assert plain is not None and plain.samples.node == ["n1"] and plain.samples.rank == [3]
    assert np.signbit(plain.samples.metrics[0, 1]) and np.isnan(plain.samples.metrics[0, 2])
    # Each rule's edge, one change at a time: refused by both, or read alike.
    for old, new in [('"gpu": 2', '"gpu": 1023'), ('"gpu": 2', '"gpu": 1024'), ('"gpu": 2', '"gpu": -1'),
                     ('"gpu": 2', '"gpu": 2.0'), ('"rank": 3', '"rank": -1'), ('"rank": 3', '"rank": null'),
                     ('"n1"', '""'), ('"b200"', '""'), ('"b200"', "null"), ('"r"', '""'), ('"r"', "null"),
                     ('"r"', "1"), ("1.5", "-1e400"), ("1.5", "1e-400"), ("1.5", "17"), ("1.5", "true"),
                     ("61", "1e400"), ("61", "1E2"), ("61", "9223372036854775807"),
                     ("61", "-9223372036854775808"), ("61", "9223372036854775808"),
                     ("61", "18446744073709551617"), ("61", "-18446744073709551617"),
                     ("61", "01"), ("61", "1."), ("61", "-"), ("61", "NaN"), ("61", '"61"'), ("61", "null"),
                     ("61", "65778491027943236e8"),  # 17 digits: m * 1e8 in doubles rounds twice
                     ("}}", "}} " + GOOD), ("}}", "}}}"), ('{"ts"', '{ "ts"'), ('"ts"', '"ts":2,"ts"')]:
        plain = assert_agree(GOOD.replace(old, new, 1).encode())
        if (old, new) in READ:
            assert plain is not None, new
    # Metric keys are looked for where the line before had them: a key that only starts like
    # that one, or a different one there, is read for what it is.
    temp = '"DCGM_FI_DEV_GPU_TEMP"'
    for old, new in [(temp, '"DCGM_FI_DEV_GPU_TEMP_2"'), (temp, '"DCGM_FI_DEV_GPU"'),
                     ('"DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": -0.0',
                      '"DCGM_FI_DEV_POWER_USAGE": -0.0, "DCGM_FI_DEV_GPU_TEMP": 61')]:
        plain = assert_agree((GOOD + "\n" + GOOD.replace(old, new)).encode())
        assert plain is not None and len(plain.samples) == 2, new
    # What msgspec reads but the C splitter leaves to it: escapes, non-ASCII, nested values,
    # a step's field on a sample line.
    for old, new in [('"n1"', '"n\\u0031"'), ('"r"', '"r\xc3\xa9"'),
                     ('"DCGM_FI_DEV_GPU_TEMP"', '"OTHER": [1], "DCGM_FI_DEV_GPU_TEMP"'),
                     ('"rack"', '"extra": {"a": 1}, "rack"'), ('"rack"', '"step": 1, "rack"')]:
        text = GOOD.replace(old, new, 1).encode()
        assert assert_agree(text) is None and DECODER.trace_lines(text) is not None, new
    escaped = DECODER.trace_lines(GOOD.replace('"n1"', '"n\\u0031"').encode())
    assert escaped.samples.node == ["n1"]


GOOD_STEP = json.dumps({**STEP, "micro_batch": 2, "samples": 4, "model": "b200", "rack": "r1"})


def test_the_c_splitter_checks_step_lines_by_the_step_rules():
    plain = assert_agree(GOOD_STEP.encode())
    assert plain is not None and plain.is_sample == [False] and plain.steps[0].job == "j"
    for old, new in [('"job": "j"', '"job": ""'), ('"node": "n1"', '"node": ""'), ('"rank": 0', '"rank": -1'),
                     ('"rank": 0', '"rank": null'), ('"gpu": 0', '"gpu": 2048'), ('"gpu": 0', '"gpu": -1'),
                     ('"step": 3', '"step": 3.0'), ('"step_time_s": 1.2', '"step_time_s": 0'),
                     ('"step_time_s": 1.2', '"step_time_s": 2'), ('"compute_s": 1.0', '"compute_s": 1.8'),
                     ('"compute_s": 1.0', '"compute_s": 1.81'), ('"compute_s": 1.0', '"compute_s": -0.0'),
                     ('"compute_s": 1.0', '"compute_s": -1'), ('"micro_batch": 2', '"micro_batch": -2'),
                     ('"micro_batch": 2', '"micro_batch": null'), ('"samples": 4', '"samples": 4.0'),
                     ('"model": "b200"', '"model": ""'), ('"model": "b200"', '"model": 1'),
                     ('"rack": "r1"', '"rack": 1'), ('"rack": "r1"', '"site": 2'),
                     ('"ts": 1.0', '"ts": 1e400'), ('"ts": 1.0, ', ""), ('"job": "j", ', ""),
                     ('"step": 3, ', ""), ('"compute_s": 1.0, ', ""),
                     ('"step_time_s": 1.2, "compute_s": 1.0', '"step_time_s": 0, "compute_s": 0')]:
        text = GOOD_STEP.replace(old, new, 1).encode()
        assert new in text.decode() or not new, new
        assert_agree(text)
        assert_agree(GOOD.encode() + b"\n" + text)


def test_the_c_splitter_shares_strings_across_blocks():
    sample = {"ts": 1.0, "node": "node-1", "gpu": 0, "model": "b200", "job": "job-1", "metrics": {}}
    text = (json.dumps(sample) + "\n").encode()
    first, second = DECODER.trace_lines(text), DECODER.trace_lines(text)
    assert first.samples.node[0] is second.samples.node[0] and first.samples.job[0] is second.samples.job[0]


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(st.integers(0, 10**17), st.integers(0, 18),
       st.one_of(st.just(""), st.integers(-40, 40).map(lambda e: f"e{e}")), st.booleans())
def test_decimal_metrics_read_as_python_reads_them(digits, point, exponent, negative):
    # Short decimals (<= 15 digits, power within 1e+-22) are read exactly in C, the rest by
    # Python's own parser: either way the double `float(text)` gives.
    padded = str(digits).rjust(point + 1, "0")
    whole, fraction = (padded[:-point], padded[-point:]) if point else (padded, "0")
    text = f"{'-' if negative else ''}{whole}{'.' + fraction if point or not exponent else ''}{exponent}"
    raw = GOOD.replace("61", text).encode()
    plain = assert_agree(raw)
    if abs(float(text)) < 1.7976931348623157e308:
        assert plain is not None, text
        assert plain.samples.metrics[0, 0].tobytes() == np.float64(float(text)).tobytes(), text
