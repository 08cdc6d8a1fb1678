"""Backtest scoring: episodes, precision, recall by lead time, false-alarm rate, base-rate precision."""

from __future__ import annotations

import numpy as np
import pytest

from fleetwise.predictors.backtest import alert_episodes, score_failures
from fleetwise.schemas import Prediction, Signal

H = 3600.0
T0 = 1764547200.0


def pred(node: str, gpu: int, t_h: float, alert: bool, source: str = "model") -> Prediction:
    ts = T0 + t_h * H
    return Prediction(id=f"failure:{node}/{gpu}:{int(ts)}", type="failure", ts=ts, node=node, gpu=gpu,
                      probability=0.9 if alert else 0.1, horizon_h=48, alert=alert,
                      signals=[Signal(name="source", value=source)])


def failure(node: str, gpu: int, t_h: float, cls: str = "hbm_ecc", precursor_h: float | None = 24.0) -> dict:
    return {"kind": "failure", "node": node, "gpu": gpu, "ts": T0 + t_h * H, "class": cls,
            "abrupt": precursor_h is None,
            "precursor_start_ts": None if precursor_h is None else T0 + (t_h - precursor_h) * H}


def test_repeated_alerts_are_one_episode() -> None:
    preds = [pred("a", 0, h, True) for h in (1, 1.2, 1.4)] + [pred("a", 0, 2, False), pred("a", 0, 3, True)]
    eps = alert_episodes(preds)
    assert [(e.raised_ts, e.end_ts) for e in eps] == [(T0 + H, T0 + 2 * H), (T0 + 3 * H, None)]


def test_precision_recall_lead_and_false_alarm_rate() -> None:
    preds = [
        pred("a", 0, 10, True),  # raised 20 h before a's failure at 30 h: caught, lead 20 h
        pred("b", 1, 49.5, True),  # raised 30 min before b's failure at 50 h: caught at >= 30 min only
        pred("c", 2, 5, True), pred("c", 2, 8, False),  # c never fails: a false alarm
        pred("d", 3, 12, True, source="rule:xid79_off_bus"),  # abrupt failure, alert after it
    ]
    labels = [failure("a", 0, 30), failure("b", 1, 50, cls="nvlink", precursor_h=2),
              failure("d", 3, 11.9, cls="off_bus", precursor_h=None),
              {"kind": "trap", "type": "hot_healthy", "node": "c", "gpu": 2},
              {"kind": "trap", "type": "hot_healthy", "node": "e", "gpu": 0}]
    m = score_failures(preds, labels, gpu_days=2000.0, horizon_h=48.0)
    assert m["precision"] == pytest.approx(2 / 3)  # d's alert is in its repair window: not counted
    assert m["recall_with_precursor_30min"]["recall"] == 1.0
    assert m["recall_long_precursor_12h"] == {"n": 1, "caught": 1, "recall": 1.0}
    assert m["recall_abrupt_30min"]["recall"] == 0.0
    assert m["recall_by_class_12h"]["nvlink"]["recall"] == 0.0
    assert m["false_alarms_per_1000_gpu_days"] == pytest.approx(0.5)
    assert m["hot_healthy_flagged_share"] == pytest.approx(0.5)
    assert sorted(m["lead_time_h"]["values"]) == [0.5, 20.0]
    # at 0.5 failures / 1,000 GPU-days: recall 2/3 of all failures, 0.5 false alarms per 1,000 GPU-days
    rec = 2 / 3
    assert m["precision_at_base_rate"] == pytest.approx(0.5 * rec / (0.5 * rec + 0.5))


def test_alert_long_before_failure_counts_only_if_still_open_within_horizon() -> None:
    early_closed = [pred("a", 0, 0, True), pred("a", 0, 1, False)]
    m = score_failures(early_closed, [failure("a", 0, 100)], gpu_days=100.0, horizon_h=48.0)
    assert m["recall_all_30min"]["recall"] == 0.0 and m["false_alerts"] == 1
    still_open = [pred("a", 0, 0, True)]
    m = score_failures(still_open, [failure("a", 0, 100)], gpu_days=100.0, horizon_h=48.0)
    assert m["recall_all_30min"]["recall"] == 1.0 and m["false_alerts"] == 0


def test_auprc_from_hop_probabilities() -> None:
    y = np.array([0, 0, 1, 1, 0], dtype=bool)
    perfect = score_failures([], [], gpu_days=1.0, horizon_h=48.0, hop_labels=y, hop_probs=y * 0.9 + 0.05)
    assert perfect["auprc"] == pytest.approx(1.0)
    inverted = score_failures([], [], gpu_days=1.0, horizon_h=48.0, hop_labels=y, hop_probs=1.0 - y * 0.9)
    assert inverted["auprc"] < 0.5


def test_long_precursor_bucket_uses_the_visible_part_of_the_precursor() -> None:
    # a's 30 h precursor began 27 h before the GPU's first sample: 3 h of it are visible, so a
    # 12 h lead is impossible and a does not count in the ">= 18 h" bucket; b's is all visible
    labels = [failure("a", 0, 3, precursor_h=30), failure("b", 0, 40, precursor_h=30)]
    preds = [pred("a", 0, 1, True), pred("b", 0, 20, True)]
    first_seen = {("a", 0): T0, ("b", 0): T0}
    m = score_failures(preds, labels, gpu_days=100.0, horizon_h=48.0, first_seen=first_seen)
    assert m["recall_long_precursor_12h"] == {"n": 1, "caught": 1, "recall": 1.0}
    assert m["long_precursor_not_visible"] == 1
    assert m["recall_with_precursor_30min"]["n"] == 2  # both still count as warned failures
    raw = score_failures(preds, labels, gpu_days=100.0, horizon_h=48.0)
    assert raw["recall_long_precursor_12h"] == {"n": 2, "caught": 1, "recall": 0.5}


def _simulated_trace(tmp_path, days: float, seed: int, rate: float):  # noqa: ANN202
    """A 16-GPU simulated trace and its labels, written as files: (trace, labels, simulator)."""
    from fleetwise.sim import FleetSimulator, SimConfig, write_labels, write_trace

    config = SimConfig(gpus="h100-sxm:16", days=days, seed=seed, failure_rate_per_1000_gpu_days=rate)
    sim = FleetSimulator(config)
    trace, labels = tmp_path / "t.jsonl.gz", tmp_path / "l.jsonl"
    write_trace(sim, trace)
    write_labels(sim, labels)
    return trace, labels, sim


def test_backtest_cli_scores_a_simulated_trace(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from fleetwise.cli import app

    trace, labels, sim = _simulated_trace(tmp_path, days=0.5, seed=5, rate=300.0)
    injected = sum(1 for r in sim.labels() if r["kind"] == "failure")
    runner = CliRunner()
    out = runner.invoke(app, ["backtest", "--trace", str(trace), "--labels", str(labels), "--json",
                              "--report", str(tmp_path / "r.html")])
    assert out.exit_code == 0, out.output
    metrics = json.loads(out.stdout[out.stdout.index("{"):])
    assert metrics["failure"]["failures"] == injected > 0
    assert 0 < metrics["failure"]["gpu_days"] <= 16 * 0.5 + 1e-6
    html = (tmp_path / "r.html").read_text()
    assert html.startswith("<html") and "data:image/png;base64," in html  # plots embedded
    missing = runner.invoke(app, ["backtest", "--trace", str(tmp_path / "no.jsonl"), "--labels", str(labels)])
    assert missing.exit_code == 2 and "not found" in missing.output


def test_backtest_rules_only_leaves_the_model_out(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from fleetwise.cli import app

    trace, labels, _ = _simulated_trace(tmp_path, days=1.0, seed=4, rate=400.0)
    runner = CliRunner()
    base = ["backtest", "--trace", str(trace), "--labels", str(labels), "--json"]

    def metrics(*extra: str) -> dict:
        out = runner.invoke(app, [*base, *extra])
        assert out.exit_code == 0, out.output
        return json.loads(out.stdout[out.stdout.index("{"):])["failure"]

    default, model, rules = metrics(), metrics("--model-alerts"), metrics("--rules-only")
    assert default == model  # the packaged policy: the model's alerts beside the rules
    assert rules["alert_episodes"] == rules["rule_only_alerts"] > 0
    # A loose threshold makes the model raise GPUs no rule does (with the packaged one, the
    # rules reach this short trace's failing GPUs first).
    loose = metrics("--policy", "0.3,1,1")
    assert loose["alert_episodes"] > loose["rule_only_alerts"] > 0
    assert loose["alert_episodes"] > model["alert_episodes"]
    for extra, why in ((["--policy", "0.3,1,1", "--rules-only"], "give one"),
                       (["--choose-policy", "--rules-only"], "--choose-policy replays")):
        out = runner.invoke(app, [*base, *extra])
        assert out.exit_code == 2 and why in " ".join(out.output.split()), out.output


def test_backtest_learns_each_rank_gpu_model_from_the_samples(tmp_path) -> None:
    """Step records as DESIGN.md specifies them carry no GPU model: the backtest learns it from
    the trace's GPU samples, as the control plane does, so a rank slow from its first record
    (only a catalog speed can tell it) is found, and found as with `model` in every record."""
    import json

    from typer.testing import CliRunner

    from fleetwise.cli import app

    slow_rank, n_ranks, steps, h100 = 3, 8, 240, "NVIDIA H100 80GB HBM3"
    records: list[dict] = []
    for i in range(steps):
        ts = T0 + i * 2.0
        if i % 30 == 0:
            records += [{"ts": ts, "node": "n1", "gpu": g, "uuid": f"GPU-{g}", "model": h100,
                         "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 500.0}}
                        for g in range(n_ranks)]
        jitter = 1.0 + 0.01 * ((i * 7) % 5 - 2) / 2
        compute = [1.5 * jitter * (1.25 if r == slow_rank else 1.0) for r in range(n_ranks)]
        records += [{"ts": ts + 1.9, "job": "j", "rank": r, "node": "n1", "gpu": r, "step": i,
                     "step_time_s": max(compute) + 0.1, "compute_s": compute[r], "micro_batch": 4,
                     "samples": 32}
                    for r in range(n_ranks)]
    labels = tmp_path / "l.jsonl"
    labels.write_text(json.dumps({"kind": "straggler", "job": "j", "rank": slow_rank, "start_ts": T0,
                                  "end_ts": T0 + steps * 2.0, "factor": 0.8}) + "\n")
    runner = CliRunner()
    found = []
    for with_model in (False, True):
        trace = tmp_path / f"t{with_model}.jsonl"
        trace.write_text("".join(json.dumps(r | ({"model": h100} if with_model and "job" in r else {})) + "\n"
                                 for r in records))
        out = runner.invoke(app, ["backtest", "--trace", str(trace), "--labels", str(labels), "--json"])
        assert out.exit_code == 0, out.output
        metrics = json.loads(out.stdout[out.stdout.index("{"):])["straggler"]
        found.append((metrics["detected"], metrics["detected_on_time"], metrics["false_flags"]))
    assert found[0] == found[1] == (1, 1, 0)


def test_backtest_scores_what_the_stream_processors_emit() -> None:
    """backtest_trace scores hops chunk by chunk, replays the policy over their probabilities and
    runs the straggler detector on step records as they are read (StepStream); the metrics must
    be those of the processors run over the whole trace at once."""
    from fleetwise.predictors.backtest import StepStream, backtest_trace, job_hours, score_all
    from fleetwise.predictors.failure import FailurePredictor
    from fleetwise.predictors.stragglers import StragglerDetector
    from fleetwise.predictors.training import compute_features, label_rows
    from fleetwise.sim import FleetSimulator, SimConfig

    sim = FleetSimulator(SimConfig(gpus="h100-sxm:16,a100-sxm-80gb:8", days=1, seed=5,
                                   failure_rate_per_1000_gpu_days=300.0,
                                   straggler_rate_per_1000_gpu_days=3000.0))
    ticks = list(sim.ticks())
    samples = [s for t in ticks for s in t.samples]
    steps = [s for t in ticks for s in t.steps]
    labels = sim.labels()
    predictor = FailurePredictor.load()

    stream = StepStream(chunk=1000)

    def read():  # noqa: ANN202 - one pass, as the CLI reads a file: steps go to the stream as met
        for t in ticks:
            yield from t.samples
            for s in t.steps:
                stream.append(s)

    run = backtest_trace(read(), stream, labels, predictor)

    table = compute_features(iter(samples))
    fresh = FailurePredictor(predictor.model, predictor.policy)
    preds, probs = fresh.process_arrays(table.keys, table.ts, table.features)
    detector = StragglerDetector()
    strag = [p for k in range(0, len(steps), 1000) for p in detector.process(steps[k:k + 1000])
             if isinstance(p, Prediction)]
    strag += [p for p in detector.flush() if isinstance(p, Prediction)]
    lab = label_rows(table, labels, predictor.model.horizon_h)
    m = lab.score_mask
    want = score_all(preds + strag, labels, gpu_days=table.gpu_days, horizon_h=predictor.model.horizon_h,
                     job_hours=job_hours(steps), steps=steps, hop_labels=lab.y[m], hop_probs=probs[m],
                     first_seen=table.first_seen())
    got = run.metrics
    assert got["failure"]["failures"] > 0 and got["failure"]["alert_episodes"] > 0
    assert got["straggler"]["injected"] > 0 and len(stream) == len(steps)
    for key in ("failure", "straggler"):
        assert got[key] == want[key], key
    # The report's rows: every hop of the failing GPUs, with the stream's probabilities.
    failing = {(f["node"], f["gpu"]) for f in labels if f["kind"] == "failure"}
    rows = [i for i, k in enumerate(table.keys) if k in failing]
    assert sorted(zip(run.table.keys, run.table.ts.tolist(), run.probs.tolist(), strict=True)) == sorted(
        (table.keys[i], float(table.ts[i]), float(probs[i])) for i in rows)


def test_only_failures_the_trace_watched_are_scored() -> None:
    """An operator's records name GPUs and months a trace does not cover: those failures are
    not misses, and a failure just after the trace still makes an alert raised before it true."""
    first_seen = {("n1", 0): T0, ("n1", 1): T0 + 100 * H}
    end = T0 + 200 * H
    labels = [
        failure("n1", 0, 50),  # watched: scored
        failure("n1", 1, 20),  # before its GPU's first hop in the trace
        failure("n9", 0, 60),  # a GPU the trace never saw
        failure("n1", 1, 205),  # after the trace: not scored, but the alert at 199 h is true
    ]
    preds = [pred("n1", 0, 40, True), pred("n1", 1, 199, True)]
    m = score_failures(preds, labels, gpu_days=10.0, horizon_h=48, first_seen=first_seen, trace_end=end)
    assert (m["failures"], m["failures_outside_trace"]) == (1, 3)
    assert m["recall_all_30min"] == {"n": 1, "caught": 1, "recall": 1.0}
    assert (m["true_alerts"], m["false_alerts"]) == (2, 0)
    # Without the trace's span every labelled failure counts (the simulator's labels are all inside).
    m = score_failures(preds, labels, gpu_days=10.0, horizon_h=48)
    assert (m["failures"], m["failures_outside_trace"]) == (4, 0)


def test_a_bad_record_is_a_clear_error_not_a_traceback(tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from fleetwise.cli import app

    sample = {"ts": T0, "node": "n1", "gpu": 0, "uuid": "GPU-1", "model": "h100-sxm",
              "metrics": {"DCGM_FI_DEV_GPU_TEMP": 50}}
    step = {"ts": T0, "job": "j", "rank": 0, "node": "n1", "gpu": 0, "step": 1, "step_time_s": 1.0,
            "compute_s": 0.9}
    labels = tmp_path / "l.jsonl"
    labels.write_text("")
    runner = CliRunner()
    new_gpu = {k: v for k, v in sample.items() if k != "model"} | {"gpu": 1}  # its model is needed
    cases = [
        ([sample, new_gpu], "GPU sample 2 (n1/1 at ts", "no 'model' field"),
        ([sample, {**sample, "ts": "soon"}], "GPU sample 2", "could not convert string to float"),
        ([sample, {**sample, "gpu": 1, "model": "NVIDIA A10G"}], "GPU sample 2 (n1/1 at ts",
         "model: unknown GPU 'NVIDIA A10G': closest known ids: a10, a40, a30 (a site adds a catalog row: "
         "FLEETWISE_CATALOG_EXTRA"),
        ([sample, {k: v for k, v in step.items() if k != "job"}], "step record 1 (?/0 at ts",
         "no 'job' field"),
    ]
    for records, where, why in cases:
        trace = tmp_path / "t.jsonl"
        trace.write_text("".join(json.dumps(r) + "\n" for r in records))
        for args in (["backtest", "--trace", str(trace), "--labels", str(labels)],
                     ["predictor", "train", "--trace", str(trace), "--labels", str(labels),
                      "--out-dir", str(tmp_path / "m")]):
            if args[0] == "predictor" and "step record" in where:
                continue  # training reads GPU samples only
            out = runner.invoke(app, args)
            text = " ".join(out.output.split())  # the console wraps at 80 columns
            assert out.exit_code == 2 and where in text and why in text, (args[0], out.output)
            assert "Traceback" not in text
