"""The C line splitter (`_trace_text.split`, behind `SampleDecoder.trace_lines`) against the
msgspec path it stands in front of: whatever both accept they decode to the same values, bit for
bit; what msgspec refuses and the splitter accepts (RFC 3339 times, metrics as numeric strings)
the records (pydantic) accept, with the same values; the plain lines the simulator writes and
the line shapes other writers use (any key order, whitespace, optional fields in or out,
escapes, nested extra keys) it accepts."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fleetwise.predictors.features import SAMPLE_DECODER
from fleetwise.schemas import GpuSample, TrainingStep
from fleetwise.schemas.fast import FastTrainingStep, SampleDecoder, TraceBlock, board_id
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
    assert plain.samples.board.tobytes() == any_.samples.board.tobytes()
    assert plain.samples.metrics.shape == any_.samples.metrics.shape
    assert plain.samples.metrics.tobytes() == any_.samples.metrics.tobytes()
    # Steps: every field the step record has, of the same type (a float step time stays a float).
    got = [[getattr(s, f) for f in FastTrainingStep.__struct_fields__] for s in plain.steps]
    want = [[getattr(s, f) for f in FastTrainingStep.__struct_fields__] for s in any_.steps]
    assert got == want
    assert [list(map(type, row)) for row in got] == [list(map(type, row)) for row in want]


def both_paths(decoder: SampleDecoder, text: bytes) -> tuple[TraceBlock | None, TraceBlock | None]:
    return decoder._plain_trace_lines(text), decoder._any_trace_lines(text)


def assert_as_the_records_read(plain: TraceBlock, text: bytes, fields: list[str]) -> None:
    """`plain` holds what the records (pydantic) make of each line of `text`: every line valid
    by `GpuSample` or `TrainingStep` (of the metrics, those `fields` the decoder reads: the fast
    path skips the others unread, by design), and the same values (`uuid` as its `board_id`). A DCGM blank
    the records make None is the reading itself on the fast path (the windows treat it)."""
    lines = text.splitlines()
    assert len(plain.is_sample) == len(lines)
    samples, steps = [], []
    for raw in lines:
        obj = json.loads(raw)
        if "metrics" in obj:
            read = {k: v for k, v in obj["metrics"].items() if k in fields}
            record = GpuSample.model_validate({**obj, "metrics": read})
            row = [float(read[k]) if record.metrics.get(k) is None and read.get(k) is not None
                   else math.nan if record.metrics.get(k) is None else record.metrics[k] for k in fields]
            samples.append((record, row))
        else:
            steps.append(TrainingStep.model_validate(obj))
    assert plain.is_sample == ["metrics" in json.loads(raw) for raw in lines]
    cols = plain.samples
    for name in ("node", "gpu", "model", "rack", "site", "job", "rank"):
        got, want = getattr(cols, name), [getattr(record, name) for record, _ in samples]
        assert got == want, name
        assert [type(v) for v in got] == [type(v) for v in want], name
    assert cols.ts.tobytes() == np.array([r.ts for r, _ in samples], np.float64).tobytes()
    assert cols.board.tobytes() == np.array([board_id(r.uuid) for r, _ in samples], np.float64).tobytes()
    want_rows = np.array([row for _, row in samples], np.float64).reshape(len(samples), len(fields))
    assert cols.metrics.tobytes() == want_rows.tobytes()
    got = [[getattr(s, f) for f in FastTrainingStep.__struct_fields__] for s in plain.steps]
    want = [[getattr(s, f) for f in FastTrainingStep.__struct_fields__] for s in steps]
    assert got == want
    assert [list(map(type, row)) for row in got] == [list(map(type, row)) for row in want]


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
    "uuid": one_of_json("GPU-1", "GPU-\u00e9", "", None), "extra": one_of_json(1.5, "x", None, False),
}, ["ts", "node", "gpu", "model", "metrics"])
step_line = json_object({
    **{k: st.just(json.dumps(v)) for k, v in STEP.items()},
    "step_time_s": st.one_of(st.floats(0, 10).map(repr), st.sampled_from(["1", "0", "1e-320"])),
    "compute_s": st.one_of(st.floats(0, 12).map(repr), st.sampled_from(["0", "-0.0", "1.8"])),
    "job": one_of_json("j", "job-7", ""), "node": one_of_json("n1", ""),
    "gpu": st.sampled_from(["0", "7", "1024", "-1"]), "rank": st.sampled_from(["0", "3", "-1", "null"]),
    "micro_batch": st.sampled_from(["0", "8", "-1", "null"]),
    "samples": st.sampled_from(["0", "8", "-1", "null"]), "model": one_of_json("b200", "", None),
    "rack": text_or_null, "site": text_or_null, "uuid": one_of_json("GPU-1", None),
}, list(STEP))


@settings(max_examples=1000, deadline=None, derandomize=True)
@given(st.lists(st.one_of(sample_line, step_line), min_size=1, max_size=6), st.sampled_from(["\n", "\r\n"]))
def test_what_the_c_splitter_accepts_msgspec_decodes_to_the_same_values(lines, newline):
    assert_agree(newline.join(lines).encode())


def assert_agree(text: bytes, decoder: SampleDecoder = DECODER) -> TraceBlock | None:
    """The C splitter's answer for `text`, checked against msgspec's: the same values where both
    accept; where only the splitter does, the records accept every line, with the same values."""
    plain, any_ = both_paths(decoder, text)
    if plain is not None and any_ is not None:
        assert_same_block(plain, any_)
    elif plain is not None:
        assert_as_the_records_read(plain, text, list(decoder.metric_fields))
    return plain


GOOD = json.dumps({"ts": 1.5, "node": "n1", "gpu": 2, "model": "b200", "rack": "r", "rank": 3,
                   "metrics": {"DCGM_FI_DEV_GPU_TEMP": 61, "DCGM_FI_DEV_POWER_USAGE": -0.0}})


# Of the edges below, those the C splitter must read itself (the rest both refuse).
READ = {('"gpu": 2', '"gpu": 1023'), ('"rank": 3', '"rank": null'), ('"r"', '""'), ('"r"', "null"),
        ("1.5", "17"), ("1.5", "1e-400"), ("61", "1E2"), ("61", "9223372036854775807"),
        ("61", "-9223372036854775808"), ("61", "null"), ('{"ts"', '{ "ts"'), ("61", "65778491027943236e8"),
        ("61", '"61"'), ("61", '"-0"'), ("61", '"1e3"'), ("1.5", '"2025-12-01T00:00:00Z"')}


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
                     ("61", '"-0"'), ("61", '"1e3"'), ("61", '" 61"'), ("61", '"0x10"'), ("61", '"NaN"'),
                     ("61", '"1e400"'), ("61", '""'), ("61", '"6\\u0031"'), ("1.5", '"2025-12-01T00:00:00Z"'),
                     ("1.5", '"2025-12-01T00:00:60Z"'), ("1.5", '"1.5"'),
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
    # What msgspec reads but the C splitter leaves to it: raw non-ASCII, a nested value in
    # metrics or where a field is read, a step's field on a sample line.
    for old, new in [('"r"', '"r\xc3\xa9"'), ('"rack"', '"step": 1, "rack"'),
                     ('"DCGM_FI_DEV_GPU_TEMP"', '"OTHER": [1], "DCGM_FI_DEV_GPU_TEMP"')]:
        text = GOOD.replace(old, new, 1).encode()
        assert assert_agree(text) is None and DECODER.trace_lines(text) is not None, new
    # Escapes (in values and keys) and nested values of keys not read: read in C, as msgspec does.
    for old, new, read in [('"n1"', '"n\\u0031"', ("node", "n1")),
                           ('"r"', '"\\/r\\u00e9\\ud83d\\ude00\\t"', ("rack", "/r\u00e9\U0001f600\t")),
                           ('"rack"', '"r\\u0061ck"', ("rack", "r")),
                           ('"rack"', '"extra": {"a": [1, {}]}, "rack"', ("rack", "r"))]:
        plain = assert_agree(GOOD.replace(old, new, 1).encode())
        assert plain is not None and getattr(plain.samples, read[0]) == [read[1]], new
    for bad in ('"n\\ud800"', '"n\\udc00x"', '"n\\x"', '"n\\u12"', '"n\\ud83d\\u0041"'):
        text = GOOD.replace('"n1"', bad).encode()
        assert assert_agree(text) is None and DECODER._any_trace_lines(text) is None, bad  # msgspec too
    deep = GOOD.replace('"rack"', '"extra": ' + "[" * 40 + "]" * 40 + ', "rack"')
    assert assert_agree(deep.encode()) is None  # deeper than the splitter goes: msgspec decides


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


def test_a_samples_uuid_is_read_as_its_board_on_every_path():
    # The board id is the CRC-32 of the uuid's text (escapes decoded), NaN where the sample names
    # no board; the C splitter, msgspec and the records agree. A uuid that is not a string is
    # refused by the fast paths (the records dead-letter it).
    import zlib

    def line(uuid: str | None) -> bytes:
        named = f'"uuid": {uuid}, ' if uuid else ""
        return ('{"ts": 1.0, "node": "n1", "gpu": 0, ' + named + '"model": "b200", "metrics": {}}').encode()

    text = b"\n".join(line(u) for u in ['"GPU-1a2b"', '"GPU-caf\\u00e9"', "null", '""', None])
    plain = assert_agree(text)
    assert plain is not None
    want = [zlib.crc32(b"GPU-1a2b"), zlib.crc32("GPU-caf\u00e9".encode()), math.nan, math.nan, math.nan]
    assert np.array_equal(plain.samples.board, np.array(want, np.float64), equal_nan=True)
    for bad in ["5", '{"id": "GPU-1"}', "true"]:
        assert both_paths(DECODER, line(bad)) == (None, None)
        assert DECODER.sample(line(bad)) is None


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


# --- Line shapes other writers use (issue 16 item 5): all taken by the C splitter. ---

JSON_SPACE = st.sampled_from(["", "", " ", "  ", "\t", " \t"])  # JSON's whitespace, less the newline
UNREAD = ["DCGM_FI_DEV_NVML_INDEX", "DCGM_FI_DEV_FAN_SPEED", "DCGM_FI_DEV_ENC_UTIL"]


@st.composite
def json_string(draw: st.DrawFn, text: str) -> str:
    """`text` as a JSON string, each character written as itself or escaped as JSON allows
    (\\uXXXX, a surrogate pair beyond the BMP, \\/ for /, \\n and the like); non-ASCII always
    escaped (raw UTF-8 takes the msgspec path)."""
    out = []
    for ch in text:
        short = {'"': '\\"', "\\": "\\\\", "/": "\\/", "\n": "\\n", "\t": "\\t", "\b": "\\b", "\f": "\\f",
                 "\r": "\\r"}.get(ch)
        code = ord(ch)
        high, low = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
        unit = f"\\u{code:04x}" if code < 0x10000 else f"\\u{high:04x}\\u{low:04x}"
        if code < 0x20 or code >= 0x7F or ch in '"\\':
            out.append(draw(st.sampled_from([unit, short] if short else [unit])))
        else:
            out.append(draw(st.sampled_from([ch, ch, ch, unit.upper().replace("\\U", "\\u"), short or ch])))
    return '"' + "".join(out) + '"'


def name_text(alphabet: str = "abz09-/_. ") -> st.SearchStrategy[str]:
    return st.text(st.sampled_from([*alphabet, "é", "\U0001f600", "\t"]), min_size=1, max_size=12)


@st.composite
def rfc3339(draw: st.DrawFn) -> str:
    """A date-time as RFC 3339 writes it: a separator T, t or space, 0-9 fraction digits,
    Z, z or an offset."""
    when = draw(st.datetimes(min_value=__import__("datetime").datetime(1980, 1, 1),
                             max_value=__import__("datetime").datetime(2200, 12, 31)))
    digits = draw(st.integers(0, 9))
    fraction = "." + (f"{when.microsecond:06d}" + "7" * 3)[:digits] if digits else ""
    zone = draw(st.one_of(st.sampled_from(["Z", "z", "+00:00", "-00:00"]),
                          st.tuples(st.sampled_from("+-"), st.integers(0, 23), st.integers(0, 59))
                          .map(lambda t: f"{t[0]}{t[1]:02d}:{t[2]:02d}")))
    sep = draw(st.sampled_from("Tt "))
    return when.strftime(f"%Y-%m-%d{sep}%H:%M:%S") + fraction + zone


@st.composite
def foreign_object(draw: st.DrawFn, members: dict[str, str]) -> str:
    """`members` (key -> raw JSON value) as one object: keys in any order, escaped or not,
    whitespace around every token."""
    parts = []
    for key in draw(st.permutations(list(members))):
        parts.append(f"{draw(JSON_SPACE)}{draw(json_string(key))}{draw(JSON_SPACE)}:{draw(JSON_SPACE)}"
                     f"{members[key]}{draw(JSON_SPACE)}")
    return "{" + ",".join(parts) + "}" if parts else "{" + draw(JSON_SPACE) + "}"


foreign_ts = st.one_of(st.floats(0, 4e9).map(repr), st.integers(0, 2**53).map(str),
                       rfc3339().flatmap(json_string))
# A reading: an int64, a float, null, a DCGM blank, or any of those numbers as a JSON string.
reading = st.one_of(st.integers(-(2**63), 2**63 - 1).map(str), st.floats(-1e300, 1e300).map(repr),
                    st.floats(0, 1000).map(lambda v: f"{v:.3f}"),
                    st.sampled_from(["null", "9223372036854775794"]),
                    st.one_of(st.integers(-(2**63), 2**63 - 1).map(str), st.floats(-1e300, 1e300).map(repr),
                              st.sampled_from(["-0", "1E5", "2.5e-3", "0.1"])).map(lambda v: f'"{v}"'))
nested_extra = st.sampled_from(['{"Hostname": "n1", "pci": ["00:01.0", {}], "x": [[null, true, 1.5e3]]}',
                                "[]", '{"a": {"b": {"c": []}}}', '"plain"', "12"])


@st.composite
def foreign_sample(draw: st.DrawFn) -> str:
    """A GPU sample line valid by `GpuSample`, as some writer other than the simulator has it."""
    members = {"ts": draw(foreign_ts), "node": draw(name_text().flatmap(json_string)),
               "gpu": str(draw(st.integers(0, 1023))),
               "model": draw(st.sampled_from(["NVIDIA H100 80GB HBM3", "b200", "A/é"]).flatmap(json_string))}
    for key in ("uuid", "rack", "site", "job"):
        choice = draw(st.integers(0, 2))  # absent, null, a string
        if choice:
            members[key] = "null" if choice == 1 else draw(name_text().flatmap(json_string))
    rank = draw(st.integers(-1, 3))
    if rank >= 0:
        members["rank"] = "null" if rank == 0 else str(draw(st.integers(0, 4096)))
    for extra in draw(st.lists(st.sampled_from(["labels", "driver", "hostname"]), unique=True, max_size=2)):
        members[extra] = draw(nested_extra)
    metrics = {k: draw(reading) for k in draw(st.lists(st.sampled_from(FIELDS + UNREAD), unique=True))}
    members["metrics"] = draw(foreign_object(metrics))
    return draw(foreign_object(members))


@st.composite
def foreign_step(draw: st.DrawFn) -> str:
    """A training step line valid by `TrainingStep`, in another writer's shape."""
    step_time = draw(st.floats(0.001, 100))
    members = {"ts": draw(foreign_ts), "job": draw(name_text().flatmap(json_string)),
               "rank": str(draw(st.integers(0, 4096))), "node": draw(name_text().flatmap(json_string)),
               "gpu": str(draw(st.integers(0, 1023))), "step": str(draw(st.integers(0, 10**9))),
               "step_time_s": repr(step_time), "compute_s": repr(draw(st.floats(0, step_time * 1.5)))}
    for key in ("micro_batch", "samples", "model"):
        choice = draw(st.integers(0, 2))
        if choice:
            value = name_text().flatmap(json_string) if key == "model" else st.integers(0, 64).map(str)
            members[key] = "null" if choice == 1 else draw(value)
    if draw(st.booleans()):
        members["extra"] = draw(nested_extra)
    return draw(foreign_object(members))


@settings(max_examples=250, deadline=None, derandomize=True)
@given(st.lists(st.one_of(foreign_sample(), foreign_step()), min_size=1, max_size=4),
       st.sampled_from(["\n", "\r\n"]))
def test_other_writers_line_shapes_are_all_split_in_c_as_the_records_read_them(lines, newline):
    text = newline.join(lines).encode()
    plain = assert_agree(text)
    assert plain is not None, text
    assert_as_the_records_read(plain, text, FIELDS)  # (also where msgspec reads them alike)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(st.one_of(foreign_sample(), foreign_step()), st.integers(0, 10**6), st.integers(0, 2),
       st.sampled_from(list('{}[],:"\\ -.0e+u/tTZnl') + ["\\u", '""', "[", "01", ":00"]))
def test_mutated_foreign_lines_are_refused_or_read_as_msgspec_and_the_records_read_them(line, at, how, piece):
    # One change anywhere (a character cut, put in or replaced): what the splitter still takes
    # is valid and read as the other paths read it.
    k = at % (len(line) + 1)
    mutated = [line[:k] + line[k + 1:], line[:k] + piece + line[k:], line[:k] + piece + line[k + 1:]][how]
    assert_agree(mutated.encode())


def _bench_replay():  # bench/replay.py, whose `foreign_lines` writes the benchmark's foreign trace
    path = Path(__file__).parents[1] / "bench" / "replay.py"
    spec = importlib.util.spec_from_file_location("bench_replay", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_line_of_the_benchmarks_foreign_trace_takes_the_c_path():
    # The lines `bench/replay.py --shape foreign` writes (other key orders, RFC 3339 times,
    # escapes, nested extras, metrics as strings, 5-minute samples): each one alone is taken by
    # the C splitter (so no block falls back to msgspec), and read as the records read it.
    lines = _bench_replay().foreign_lines(gpus=64, hours=0.5, interval_s=300, seed=5)
    assert sum(b'"metrics"' in raw for raw in lines) >= 64 * 6 and len(lines) > 64 * 6
    refused = [raw for raw in lines if SAMPLE_DECODER._plain_trace_lines(raw) is None]
    assert refused == []
    text = b"".join(lines)
    plain = SAMPLE_DECODER._plain_trace_lines(text)
    assert plain is not None and plain.is_sample.count(True) == sum(b'"metrics"' in raw for raw in lines)
    assert_as_the_records_read(plain, text, list(SAMPLE_DECODER.metric_fields))
    times = {type(json.loads(raw)["ts"]).__name__ + ("Z" if raw.count(b'Z"') else "") for raw in lines}
    shapes = {"times": times >= {"float", "int", "strZ", "str"},
              "escape": b"\\u002d" in text and b"\\/" in text, "nested": b'"labels"' in text,
              "string metric": b'_UTIL":"' in text.replace(b" ", b""),
              "blank": b"9223372036854775794" in text,
              "spaces": b'", "' in text, "compact": b'","' in text}
    assert all(shapes.values()), shapes
