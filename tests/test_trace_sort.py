"""`fleetwise trace sort`: recordings merged into event-time order, so a replay reads them as
the workers would have (the straggler detector compares ranks step by step as records come)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from typer.testing import CliRunner

from fleetwise.cli import app
from fleetwise.sim import FleetSimulator, SimConfig, write_trace
from fleetwise.streams.trace_sort import MergedLineNames, line_ts, sort_traces

T0 = 1764547200.0


def _line(ts: object, tag: str) -> str:
    return json.dumps({"ts": ts, "node": "n", "gpu": 0, "tag": tag}) + "\n"


def test_lines_are_merged_by_ts_with_ties_in_input_order_through_spilled_runs(tmp_path) -> None:
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl.gz"
    a.write_text(_line(T0 + 30, "a0") + _line(T0 + 10, "a1") + "{not json\n" + _line(T0 + 50, "a3")
                 + _line("2025-12-01T00:00:20Z", "a4"))
    with gzip.open(b, "wt") as fh:
        fh.write(_line(T0 + 10, "b0") + _line(T0 + 40, "b1") + _line(int(T0) + 20, "b2"))
    for run_lines in (1, 2, 100):  # spilled to 8, 4 and no temporary files
        out = tmp_path / f"out{run_lines}.jsonl.gz"
        summary = sort_traces([a, b], out, run_lines=run_lines)
        with gzip.open(out, "rt") as fh:
            lines = fh.read().splitlines(keepends=True)
        tags = [json.loads(x)["tag"] if x.startswith("{\"") else x.strip() for x in lines]
        # ties (10 s: a1 then b0; 20 s: a4 then b2) in input order; the unreadable line stays
        # right after a1, the line before it in its file
        assert tags == ["a1", "{not json", "b0", "a4", "b2", "a0", "b1", "a3"], run_lines
        assert (summary.lines, summary.files, summary.unreadable_ts) == (8, 2, 1)
        assert summary.unreadable_first == [f"{a}:3"]
        assert summary.out_of_order == 5  # a1, a4, b0, b1, b2: each older than a line before it
        assert summary.runs == {1: 8, 2: 4, 100: 0}[run_lines]


def test_a_trace_in_order_comes_out_byte_for_byte(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(_line(T0 + i // 3, str(i)) for i in range(50)))
    summary = sort_traces([trace], tmp_path / "o.jsonl", run_lines=7)
    assert (tmp_path / "o.jsonl").read_bytes() == trace.read_bytes() and summary.out_of_order == 0


def test_line_ts_reads_what_the_records_read() -> None:
    assert line_ts(b'{"ts": 1764547200}') == 1764547200.0
    assert line_ts(b'{"node": "n", "ts": "2025-12-01T00:00:00+00:00"}') == 1764547200.0
    assert line_ts(b'{"ts": "1764547200.5"}') == 1764547200.5
    for bad in (b'{"ts": true}', b'{"ts": "yesterday"}', b'{"ts": "2025-12-01T00:00:00"}', b"[1]",
                b'{"node": "n"}', b"nope"):
        assert line_ts(bad) is None, bad


def test_recordings_per_node_and_per_rank_sorted_replay_like_the_recording_in_order(tmp_path) -> None:
    # A simulated fleet split as recorders write it: each node's GPU samples in a file, each
    # rank's step records in a file. Replayed one file after another, the step records go back in
    # time and the straggler findings differ; merged with `trace sort` (or `replay --sort`), the
    # decisions are the original's.
    sim = FleetSimulator(SimConfig(gpus="h100-sxm:16,a100-sxm-80gb:16", days=0.5, seed=5,
                                   straggler_rate_per_1000_gpu_days=2000.0))
    original = tmp_path / "t.jsonl"
    write_trace(sim, original)
    files: dict[str, list[str]] = {}
    for line in original.read_text().splitlines(keepends=True):
        record = json.loads(line)
        name = f"{record['job']}-{record['rank']}" if "step_time_s" in record else record["node"]
        files.setdefault(name, []).append(line)
    nodes = []
    for name, lines in sorted(files.items(), reverse=True):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(lines))
        nodes.append(path)
    runner = CliRunner()

    def replay(*traces: Path, order: str = "--file-order") -> tuple[dict, str]:
        out = tmp_path / "d.jsonl"
        result = runner.invoke(app, ["replay", *map(str, traces), "--out", str(out), "--json", order])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout), out.read_text()

    want, decisions = replay(original)
    assert want["step_groups_back_in_time"] == 0 and want["alerts"] > 0
    unsorted, unsorted_decisions = replay(*nodes)
    assert unsorted["step_groups_back_in_time"] > 0 and unsorted_decisions != decisions
    merged = tmp_path / "merged.jsonl.gz"
    sorted_ = runner.invoke(app, ["trace", "sort", *map(str, nodes), "--out", str(merged), "--json",
                                  "--run-lines", "5000"])
    assert sorted_.exit_code == 0, sorted_.output
    assert json.loads(sorted_.stdout)["lines"] == want["lines"]
    got, merged_decisions = replay(merged)
    assert got["step_groups_back_in_time"] == 0 and merged_decisions == decisions
    # The same merge inside the replay (`--sort`): no file written, the same decisions.
    inline, inline_decisions = replay(*nodes, order="--sort")
    assert inline["lines"] == want["lines"] and inline["step_groups_back_in_time"] == 0
    assert inline_decisions == decisions


def test_trace_sort_names_the_first_lines_without_a_readable_ts(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    bad = "".join(f"{{not json {i}\n" for i in range(7))
    trace.write_text(_line(T0, "x") + "\n" + bad + _line(T0 + 1, "y"))
    out = CliRunner().invoke(app, ["trace", "sort", str(trace), "--out", str(tmp_path / "o.jsonl")])
    assert out.exit_code == 0, out.output
    named = ", ".join(f"{trace}:{n}" for n in range(3, 8))  # line 2 is blank
    assert f"without a readable ts: {named} and 2 more" in out.output
    as_json = CliRunner().invoke(app, ["trace", "sort", str(trace), "--out", str(tmp_path / "o.jsonl"),
                                       "--json"])
    data = json.loads(as_json.stdout)
    assert data["unreadable_ts"] == 7 and data["unreadable_first"] == [f"{trace}:{n}" for n in range(3, 8)]


def test_trace_sort_refuses_to_overwrite_its_input_and_names_missing_files(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(_line(T0, "x"))
    same = CliRunner().invoke(app, ["trace", "sort", str(trace), "--out", str(trace)])
    assert same.exit_code == 2 and "is one of the traces" in " ".join(same.output.split())
    assert trace.read_text() == _line(T0, "x")
    missing = CliRunner().invoke(app, ["trace", "sort", str(tmp_path / "nope.jsonl"), "--out", "o.jsonl"])
    assert missing.exit_code == 2 and "trace not found" in missing.output
    unwritable = str(tmp_path / "no" / "o.jsonl")
    nowhere = CliRunner().invoke(app, ["trace", "sort", str(trace), "--out", unwritable])
    assert nowhere.exit_code == 2 and "does not exist" in " ".join(nowhere.output.split())
    replay = CliRunner().invoke(app, ["replay", str(trace), "--out", unwritable])  # before the work
    assert replay.exit_code == 2 and "does not exist" in " ".join(replay.output.split())


def test_merged_text_blocks_join_whole_lines_and_name_them_until_released() -> None:
    lines = [b"%d\n" % i for i in range(1000)]
    names = MergedLineNames(["a.jsonl", "b.jsonl"])
    origins = [(i % 2) << 40 | (i // 2 + 1) for i in range(1000)]  # alternate files, as merged
    blocks = list(names.text_blocks(zip(origins, lines, strict=True), block_bytes=100))
    assert b"".join(blocks) == b"".join(lines)
    assert all(b.endswith(b"\n") for b in blocks)
    # each block closes at the first line that takes it to 100 bytes (lines here are <= 4 bytes)
    assert all(100 <= len(b) < 104 for b in blocks[:-1]) and 0 < len(blocks[-1]) < 104
    assert [names.name(n) for n in (1, 2, 3, 1000)] == ["a.jsonl:1", "b.jsonl:1", "a.jsonl:2", "b.jsonl:500"]
    names.release(500)
    assert names.name(500) == "b.jsonl:250" and names.name(499) == "<traces in time order>:499"
    names.release(2000)
    assert names.name(1000) == "<traces in time order>:1000"
    assert list(MergedLineNames([]).text_blocks([])) == []


def test_replay_sort_names_a_bad_line_by_its_file_and_line(tmp_path) -> None:
    from fleetwise.streams.embedded import replay

    sample = {"node": "n", "gpu": 0, "model": "NVIDIA H100 80GB HBM3",
              "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60}}
    late, early = tmp_path / "late.jsonl", tmp_path / "early.jsonl"
    late.write_text(json.dumps({**sample, "ts": T0 + 120}) + "\n")
    early.write_text(json.dumps({**sample, "ts": T0}) + "\n\n" + "{not json\n"
                     + json.dumps({**sample, "ts": T0 + 60, "gpu": "x"}) + "\n")
    runtime = replay([late, early], in_time_order=True)
    # merged: T0, the bad JSON (after the line before it in its file), T0 + 60 (a bad gpu), T0 + 120
    assert [s for s, _ in runtime.summary.bad_lines] == [f"{early}:3", f"{early}:4"]
    assert runtime.summary.samples == 2
    in_files = replay([late, early])
    assert [s for s, _ in in_files.summary.bad_lines] == [f"{early}:3", f"{early}:4"]


def test_replay_sort_names_bad_lines_in_their_files_across_spilled_runs(tmp_path, monkeypatch) -> None:
    """Many files written per GPU, merged through runs on disk and replayed in blocks and
    chunks smaller than the stream: every bad line is named by its own file and line."""
    from fleetwise.streams import embedded, trace_sort

    monkeypatch.setattr(trace_sort, "RUN_LINES", 97)
    monkeypatch.setattr(embedded, "CHUNK", 64)
    spilled = []
    write_run = trace_sort._write_run
    monkeypatch.setattr(trace_sort, "_write_run", lambda run, d: spilled.append(1) or write_run(run, d))
    files, bad = [], []
    for gpu in range(4):
        path = tmp_path / f"gpu{gpu}.jsonl"
        lines = []
        for i in range(300):
            sample = {"ts": T0 + 60 * i, "node": "n0", "gpu": gpu, "model": "NVIDIA H100 80GB HBM3",
                      "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60 + i % 5}}
            if (i + gpu) % 41 == 0:
                sample["metrics"]["DCGM_FI_DEV_GPU_TEMP"] = "hot"
                bad.append(f"{path}:{len(lines) + 1}")
            lines.append(json.dumps(sample))
            if i % 50 == 7:
                lines.append("")  # blank lines count in the numbering, as in the file
        path.write_text("\n".join(lines) + "\n")
        files.append(path)
    sorted_run = embedded.replay(files, in_time_order=True)
    named = [s for s, _ in sorted_run.summary.bad_lines]
    assert sorted(named) == sorted(bad) and len(bad) > 20 and len(spilled) > 10
    assert sorted_run.summary.samples == 4 * 300 - len(bad)
    assert sorted(s for s, _ in embedded.replay(files).summary.bad_lines) == sorted(bad)


