"""Traces from the generators written apart from the simulator (bench/independent_*.py,
blind_fleet.py, liquid_fleet.py, cloud_fleet.py) go through `replay` and `backtest` as any operator's would:
every line read, nothing refused, every labelled failure and straggler scored."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from typer.testing import CliRunner

from fleetwise.cli import app

BENCH = Path(__file__).parents[1] / "bench"


def _bench(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # type: ignore[union-attr]  # its dataclasses look it up
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _json(output: str) -> dict:
    return json.loads(output[output.index("{"):])


@pytest.mark.parametrize(("generator", "interval_s"), [("independent_fleet", 300.0), ("blind_fleet", 120.0),
                                                         ("liquid_fleet", 60.0), ("cloud_fleet", 60.0)])
def test_an_independent_fleet_trace_replays_and_backtests(tmp_path: Path, generator: str,
                                                           interval_s: float) -> None:
    _bench(generator).generate(tmp_path, seed=5, gpus=24, days=2.0, interval_s=interval_s, failure_rate=150.0)
    trace, labels = tmp_path / "trace.jsonl.gz", tmp_path / "labels.jsonl"
    with gzip.open(trace, "rt") as fh:
        lines = sum(1 for line in fh if line.strip())
    failures = [r for r in map(json.loads, labels.read_text().splitlines()) if r["kind"] == "failure"]
    assert failures
    runner = CliRunner()
    res = runner.invoke(app, ["replay", str(trace), "--out", str(tmp_path / "d.jsonl"), "--json"])
    assert res.exit_code == 0, res.output
    summary = _json(res.stdout)
    assert summary["samples"] == lines and summary["bad_lines"] == 0  # blanks and gaps are data
    res = runner.invoke(app, ["backtest", "--trace", str(trace), "--labels", str(labels), "--json"])
    assert res.exit_code == 0, res.output
    f = _json(res.stdout)["failure"]
    assert f["failures"] + f["failures_outside_trace"] == len(failures)
    assert 24 * 2.0 * 0.5 < f["gpu_days"] <= 24 * 2.0 + 1e-6  # less the repair windows and gaps


def test_independent_step_records_score_the_same_with_or_without_model(tmp_path: Path) -> None:
    steps = _bench("independent_steps")
    runner = CliRunner()
    scored = []
    for with_model in (False, True):
        out = tmp_path / str(with_model)
        steps.generate(out, seed=3, jobs=2, hours=1.5, with_model=with_model)
        res = runner.invoke(app, ["backtest", "--trace", str(out / "trace.jsonl.gz"), "--labels",
                                  str(out / "labels.jsonl"), "--json"])
        assert res.exit_code == 0, res.output
        s = _json(res.stdout)["straggler"]
        scored.append({k: s[k] for k in ("injected", "detected", "false_flags", "job_slowdowns_found")})
    assert scored[0]["injected"] > 0
    assert scored[0] == scored[1]  # the model learned from the GPU samples, as the records' own
