"""Embedded runtime and `fleetwise replay`: bad lines reported and skipped, good lines never lost,
decision output in the DESIGN.md contract, deterministic."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleetwise.cli import app
from fleetwise.schemas import Command, DeadLetter, FeatureVector, Prediction
from fleetwise.schemas import topics as T
from fleetwise.schemas.fast import SampleColumns
from fleetwise.sim import FleetSimulator, SimConfig, write_labels, write_trace
from fleetwise.streams.embedded import EmbeddedRuntime, EventBus, read_text_blocks, replay
from fleetwise.streams.pipeline import ControlPlane

GOOD = {"ts": 1764547200.0, "node": "n1", "gpu": 0, "model": "NVIDIA H100 80GB HBM3",
        "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 500.0}}


def sample(ts: float, gpu: int = 0, **metrics: float) -> dict:
    return {**GOOD, "ts": ts, "gpu": gpu, "metrics": {**GOOD["metrics"], **metrics}}


@pytest.fixture(scope="module")
def small_trace(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("trace")
    sim = FleetSimulator(SimConfig(gpus="h100-sxm:8,a100-sxm-80gb:8", days=0.25, seed=11))
    write_trace(sim, d / "t.jsonl.gz")
    write_labels(sim, d / "labels.jsonl")
    return d / "t.jsonl.gz", d / "labels.jsonl"


def test_bad_lines_are_reported_with_line_numbers_and_good_lines_kept(tmp_path):
    lines = [
        json.dumps(sample(1764547200.0 + 60 * i)) for i in range(30)
    ]
    lines.insert(3, "{not json")
    lines.insert(7, json.dumps({**GOOD, "model": "NVIDIA Z9000"}))
    lines.insert(11, json.dumps(GOOD).replace("60", "NaN", 1))
    lines.insert(15, json.dumps({"hello": "world"}))
    lines.insert(19, "")  # blank lines are not records
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    runtime = replay([path], tmp_path / "out.jsonl")
    bad = dict(runtime.summary.bad_lines)
    assert set(bad) == {f"{path}:4", f"{path}:8", f"{path}:12", f"{path}:16"}
    assert "not valid JSON" in bad[f"{path}:4"]
    assert "closest known ids" in bad[f"{path}:8"]
    assert "metrics.DCGM_FI_DEV_GPU_TEMP" in bad[f"{path}:12"]
    assert "not a GPU sample" in bad[f"{path}:16"]
    assert runtime.summary.samples == 30  # every good line processed
    dead = runtime.bus.records(T.DEADLETTER.name)
    assert all(isinstance(d, DeadLetter) for d in dead) and len(dead) == 4
    assert dead[0].original == "{not json"


STEP = {"ts": 1764547200.0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 1,
        "step_time_s": 1.2, "compute_s": 1.0, "samples": 8, "model": "h100-sxm"}


def mixed_lines() -> list[bytes]:
    """GPU and step lines with bad ones of each kind, blank lines and lines of no topic."""
    out: list[bytes] = []
    for i in range(60):
        out.append(json.dumps(sample(1764547200.0 + 60 * i, gpu=i % 3)).encode())
        out.append(json.dumps({**STEP, "ts": 1764547200.0 + 60 * i, "step": i}).encode())
        if i % 11 == 4:
            out.append(json.dumps(GOOD).replace("60", "NaN", 1).encode())  # bad GPU line
        if i % 13 == 6:
            out.append(json.dumps({**STEP, "compute_s": 9.0}).encode())  # bad step line
        if i % 17 == 8:
            out.append(b"   ")
        if i % 19 == 9:
            out.append(b'{"hello": "world"}' if i % 2 else b"{not json")
    return out


def decode_calls_by_rule(lines: list[bytes], chunk: int) -> list[tuple[str, list[int]]]:
    """The replay's chunking rule, line by line: each decode call's topic and line numbers.
    GPU and step lines are held per topic until CHUNK of them (both topics together) or a
    line of neither (not blank) arrives; then the GPU lines go first."""
    calls: list[tuple[str, list[int]]] = []
    held: dict[str, list[int]] = {T.TELEMETRY_GPU.name: [], T.TELEMETRY_STEPS.name: []}

    def flush() -> None:
        for topic, linenos in held.items():
            if linenos:
                calls.append((topic, linenos[:]))
                linenos.clear()

    for lineno, line in enumerate(lines, start=1):
        topic = (T.TELEMETRY_GPU.name if b'"metrics"' in line
                 else T.TELEMETRY_STEPS.name if b'"step_time_s"' in line else None)
        if topic is not None:
            held[topic].append(lineno)
            if sum(map(len, held.values())) >= chunk:
                flush()
        elif line.strip():
            flush()
    flush()
    return calls


@pytest.mark.parametrize("block_lines", [1, 4, 7, 8192])
def test_chunks_and_line_numbers_do_not_depend_on_how_lines_are_read(tmp_path, monkeypatch, block_lines):
    import fleetwise.streams.embedded as embedded

    lines = mixed_lines()
    path = tmp_path / "t.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(b"\n".join(lines))  # the last line without a newline
    monkeypatch.setattr(embedded, "CHUNK", 5)
    monkeypatch.setattr(embedded, "BLOCK_LINES", block_lines)
    runtime = EmbeddedRuntime()
    calls: list[tuple[str, list[int]]] = []
    decode_lines = runtime.control.decode_lines

    def recorded(topic, held, sources):
        calls.append((topic, [int(s.rsplit(":", 1)[1]) for s in sources]))
        assert [lines[n - 1] for n in calls[-1][1]] == [h.rstrip(b"\n") for h in held]
        return decode_lines(topic, held, sources)

    monkeypatch.setattr(runtime.control, "decode_lines", recorded)
    # The line path (what a block of other lines than GPU samples and steps takes).
    runtime.feed_lines(b"".join(read_text_blocks(path)).split(b"\n"), str(path))
    runtime.finish()
    assert calls == decode_calls_by_rule(lines, 5)
    bad = {int(source.rsplit(":", 1)[1]): reason for source, reason in runtime.summary.bad_lines}
    want = {n for n, line in enumerate(lines, start=1)
            if b"NaN" in line or b"9.0" in line or b"hello" in line or b"not json" in line}
    assert set(bad) == want and len(runtime.summary.bad_lines) == len(want)
    assert all("compute_s" in bad[n] for n in want if b"9.0" in lines[n - 1])
    assert runtime.summary.lines == sum(1 for line in lines if line.strip())
    assert runtime.summary.samples == 60 and runtime.summary.steps == 60


def fed_calls(runtime: EmbeddedRuntime) -> list[tuple[str, list[tuple]]]:
    """Record what `runtime.feed` is handed: each call's topic and its items, read by value
    (records of either fast path, samples as columns, and dead letters alike)."""
    calls: list[tuple[str, list[tuple]]] = []
    feed = runtime.feed

    def by_value(item) -> list[tuple]:
        if isinstance(item, SampleColumns):
            return list(zip(item.ts.tolist(), item.node, item.gpu, [None] * len(item), item.job, strict=True))
        if isinstance(item, DeadLetter):
            return [("dead", item.source, item.reason)]
        return [(item.ts, item.node, item.gpu, getattr(item, "step", None), getattr(item, "job", None))]

    def recorded(topic, items):
        calls.append((topic, [value for item in items for value in by_value(item)]))
        feed(topic, items)

    runtime.feed = recorded  # type: ignore[method-assign]
    return calls


@pytest.mark.parametrize("clean", [True, False])
@pytest.mark.parametrize("read_bytes", [1, 700, 1 << 22])
def test_text_blocks_decoded_whole_hand_over_what_the_line_path_does(tmp_path, monkeypatch, clean,
                                                                    read_bytes):
    import fleetwise.streams.embedded as embedded

    lines = [line for line in mixed_lines() if not clean or b"hello" not in line and b"NaN" not in line
             and b"9.0" not in line and b"not json" not in line and line.strip()]
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    monkeypatch.setattr(embedded, "CHUNK", 5)
    monkeypatch.setattr(embedded, "READ_BYTES", read_bytes)
    by_line, by_text = EmbeddedRuntime(), EmbeddedRuntime()
    line_calls, text_calls = fed_calls(by_line), fed_calls(by_text)
    decoded_by_lines: list[int] = []
    decode_lines = by_text.control.decode_lines
    monkeypatch.setattr(by_text.control, "decode_lines",
                        lambda topic, held, sources: decoded_by_lines.append(len(held)) or
                        decode_lines(topic, held, sources))
    by_line.feed_lines(lines, str(path))
    by_text.feed_text_blocks(read_text_blocks(path), str(path))
    assert text_calls == line_calls and len(line_calls) > 10
    assert (by_text.finish(), by_text.decisions()) == (by_line.finish(), by_line.decisions())
    if clean:  # every block went whole through the fast path, no line alone
        assert decoded_by_lines == []
        return
    # blocks with a bad line went line by line, the others (if the file is read in several) whole
    telemetry_lines = sum(b'"metrics"' in line or b'"step_time_s"' in line for line in lines)
    assert 0 < sum(decoded_by_lines) <= telemetry_lines
    assert (sum(decoded_by_lines) < telemetry_lines) == (read_bytes < path.stat().st_size)
    # dead letters name their lines
    want = {n for n, line in enumerate(lines, start=1)
            if b"NaN" in line or b"9.0" in line or b"hello" in line or b"not json" in line}
    assert {int(source.rsplit(":", 1)[1]) for source, _ in by_text.summary.bad_lines} == want


def test_node_batch_keeps_good_samples_beside_a_bad_one():
    control = ControlPlane()
    batch = {"ts": 1764547200.0, "node": "n1", "samples": [
        sample(1764547200.0, 0), {**sample(1764547200.0, 1), "gpu": -5}, sample(1764547200.0, 2)]}
    records = control.decode(T.TELEMETRY_GPU.name, json.dumps(batch).encode(), source="topic:0@7")
    kinds = [type(r).__name__ for r in records]
    assert kinds == ["GpuSample", "DeadLetter", "GpuSample"]
    assert records[1].source == "topic:0@7#samples.1" and "gpu" in records[1].reason


def test_handle_takes_node_batches_and_dead_letters_beside_samples():
    # As the worker hands them over: node batches, lone samples and dead letters in one call.
    from fleetwise.schemas import GpuSample, NodeBatch

    mixed, mixed_out, flat, flat_out = ControlPlane(), [], ControlPlane(), []
    for i in range(180):
        ts = 1764547200.0 + 60 * i
        pair = [GpuSample.model_validate(sample(ts, gpu=g)) for g in (0, 1)]
        batch = NodeBatch(ts=ts, node="n1", samples=pair)
        lone = GpuSample.model_validate(sample(ts, gpu=2))
        dead = DeadLetter(ts=ts, source=f"t:{i}", reason="r", original="")
        routed = mixed.handle(T.TELEMETRY_GPU.name, [batch, dead, lone])
        assert routed[0] == (T.DEADLETTER.name, f"t:{i}", dead)
        mixed_out += routed[1:]
        flat_out += flat.handle(T.TELEMETRY_GPU.name, [*batch.samples, lone])
    assert mixed.counts["samples_in"] == flat.counts["samples_in"] == 540
    assert [(t, k, r.to_json()) for t, k, r in mixed_out] == [(t, k, r.to_json()) for t, k, r in flat_out]
    assert any(t == T.FEATURES.name for t, _, _ in mixed_out)


def test_features_are_emitted_per_gpu_hop_in_event_time():
    runtime = EmbeddedRuntime()
    # 3 hours of one GPU at 60 s: hops close as later samples arrive.
    runtime.feed_lines((json.dumps(sample(1764547200.0 + 60 * i)).encode() for i in range(180)), "mem")
    runtime.finish()
    vectors = runtime.bus.records(T.FEATURES.name)
    assert vectors and all(isinstance(v, FeatureVector) and v.scope == "gpu" for v in vectors)
    ts = [v.ts for v in vectors]
    assert ts == sorted(ts) and len(set(ts)) == len(ts)
    assert vectors[0].model == "h100-sxm"


def test_replay_output_contract_and_determinism(small_trace, tmp_path):
    trace, _ = small_trace
    out1, out2 = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    r1 = replay([trace], out1)
    replay([trace], out2)
    assert out1.read_bytes() == out2.read_bytes()
    assert r1.summary.samples > 0 and r1.summary.steps > 0 and not r1.summary.bad_lines
    for line in out1.read_text().splitlines():
        obj = json.loads(line)
        assert obj["kind"] in ("prediction", "command")
        if obj["kind"] == "prediction":
            p = Prediction.model_validate(obj)
            assert {"type", "ts", "node", "probability", "horizon_h", "alert", "signals"} <= obj.keys()
            assert 0 <= p.probability <= 1
        else:
            c = Command.model_validate(obj)
            assert c.id and c.reason and c.signature.startswith("hmac-sha256:")


def test_event_bus_rejects_unknown_topics():
    bus = EventBus()
    with pytest.raises(KeyError, match="unknown topic"):
        bus.publish("fleetwise.nope", "k", DeadLetter(ts=0, source="s", reason="r", original=""))


def test_gzip_and_plain_read_the_same(tmp_path, monkeypatch):
    import fleetwise.streams.embedded as embedded

    monkeypatch.setattr(embedded, "READ_BYTES", 100)
    text = "\n".join(json.dumps(sample(1764547200.0 + i)) for i in range(5)) + "\n"
    (tmp_path / "a.jsonl").write_text(text)
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as fh:
        fh.write(text)
    assert list(read_text_blocks(tmp_path / "a.jsonl")) == list(read_text_blocks(tmp_path / "a.jsonl.gz"))


def test_replay_cli(small_trace, tmp_path):
    trace, _ = small_trace
    result = CliRunner().invoke(app, ["replay", str(trace), "--out", str(tmp_path / "d.jsonl"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["samples"] > 0 and data["bad_lines"] == 0
    missing = CliRunner().invoke(app, ["replay", str(tmp_path / "nope.jsonl"), "--out", "x.jsonl"])
    assert missing.exit_code == 2 and "trace not found" in missing.output


def test_replay_cli_warns_when_step_records_are_not_in_time_order(tmp_path):
    # 4 ranks x 40 steps a minute apart; written step by step, then rank by rank.
    steps = [{"ts": 1764547200.0 + 60 * i, "job": "j", "rank": r, "node": "n0", "gpu": r, "step": i,
              "step_time_s": 2.0, "compute_s": 1.5, "micro_batch": 4, "samples": 32}
             for i in range(40) for r in range(4)]
    runner = CliRunner()
    found = {}
    for name, records in (("time", steps), ("rank", sorted(steps, key=lambda s: (s["rank"], s["ts"])))):
        trace = tmp_path / f"{name}.jsonl"
        trace.write_text("".join(json.dumps(s) + "\n" for s in records))
        args = ["replay", str(trace), "--out", str(tmp_path / "d.jsonl")]
        data = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
        found[name] = (data["steps"], data["step_groups_back_in_time"], runner.invoke(app, args).output)
    assert found["time"][:2] == (160, 0) and "not in event-time order" not in found["time"][2]
    # ranks 1-3: every step more than 900 s (15 steps) older than rank 0's last, 24 each
    assert found["rank"][:2] == (160, 3 * 24)
    assert "not in event-time order" in " ".join(found["rank"][2].split())


def test_replay_cli_writes_features_with_staggered_hops_unless_aligned_asked(small_trace, tmp_path):
    trace, _ = small_trace
    runner = CliRunner()
    ends = {}
    for flag in (["--aligned-hops"], []):
        feats = tmp_path / f"f{len(flag)}.jsonl"
        res = runner.invoke(app, ["replay", str(trace), "--out", str(tmp_path / "d.jsonl"),
                                  "--features", str(feats), *flag])
        assert res.exit_code == 0, res.output
        vectors = [json.loads(line) for line in feats.read_text().splitlines()]
        gpu = [v for v in vectors if v["scope"] == "gpu"]
        assert gpu and all(FeatureVector.model_validate(v) for v in gpu[:50])
        ends[bool(flag)] = {v["ts"] % 600 for v in gpu}
    assert ends[True] == {0.0}  # aligned: every GPU's hop ends on the 600 s grid
    assert len(ends[False]) > 3  # staggered (default): hop ends spread over the hop


def test_step_records_go_in_calls_of_step_chunk_until_another_line_flushes_them(monkeypatch):
    # GPU records are handed over at every CHUNK of lines; step records wait for STEP_CHUNK of
    # them (the straggler detector judges a call's step groups together), except where a line
    # of neither topic or the end of the input flushes both. Each topic keeps its file order.
    import fleetwise.streams.embedded as embedded

    monkeypatch.setattr(embedded, "CHUNK", 5)
    monkeypatch.setattr(embedded, "STEP_CHUNK", 12)
    lines = [line for line in mixed_lines() if b"hello" not in line and b"not json" not in line]
    other = len(lines) // 2
    lines.insert(other, json.dumps({"kind": "inventory", "node": "n1", "gpus": []}).encode())
    runtime = EmbeddedRuntime()
    calls = fed_calls(runtime)
    runtime.feed_lines(lines, "t")
    runtime.finish()
    steps = [items for topic, items in calls if topic == T.TELEMETRY_STEPS.name]
    gpu = [items for topic, items in calls if topic == T.TELEMETRY_GPU.name]
    assert all(len(items) <= 5 for items in gpu) and len(gpu) > 10
    # Step calls: at least 12 each but the one flushed by the inventory line and the last.
    assert sum(len(items) < 12 for items in steps) <= 2 and len(steps) >= 4
    numbers = [i[3] for items in steps for i in items if i[0] != "dead"]
    assert numbers == sorted(numbers) and len(numbers) == 60
