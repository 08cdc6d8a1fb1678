"""`fleetwise job start`: a job's plan, with its intent's constraints, for the control plane; and
a replay in which the job grows to its intent's maximum when a node joins."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from fleetwise.cli import app
from fleetwise.schemas import Command, GpuInventory, NodeInventory, Plan
from fleetwise.streams.pipeline import ControlPlane

T0 = 1764547200.0
H100 = "NVIDIA H100 80GB HBM3"


def cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    if code:
        assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
        return " ".join(result.stderr.split())
    return result.stdout


def inventory(node: str, ts: float, gpus: int = 4) -> NodeInventory:
    return NodeInventory(ts=ts, node=node, gpus=[GpuInventory(index=g, model=H100) for g in range(gpus)])


def test_a_started_job_grows_to_its_intents_maximum_in_a_replay(tmp_path):
    inv = tmp_path / "n1.jsonl"
    inv.write_text(inventory("n1", T0).to_json() + "\n")
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(cli("plan", "--model", "llama-7b", "--gpus", str(inv), "--global-batch", "64",
                             "--job", "llm", "--max-gpus", "8", "--format", "json"))
    (line,) = cli("job", "start", "--plan", str(plan_json)).strip().splitlines()
    (plan,) = ControlPlane().decode_obj(None, json.loads(line), source="line 1")
    assert isinstance(plan, Plan) and plan.job == "llm" and len(plan.ranks) == 4
    assert plan.constraints is not None and plan.constraints.max_gpus == 8

    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join([inventory("n1", T0).to_json(), line,
                                inventory("n2", T0 + 3600).to_json()]) + "\n")
    out = tmp_path / "decisions.jsonl"
    cli("replay", str(trace), "--out", str(out))
    decided = [json.loads(x) for x in out.read_text().splitlines()]
    (grow,) = [Command.model_validate(d) for d in decided if d["kind"] == "command"]
    assert (grow.type, grow.job, grow.ts) == ("resize", "llm", T0 + 3600)
    assert grow.params["join"] == [["n2", g] for g in range(4)] and grow.params["world_size"] == 8
    assert "llm grows from 4 to 8 GPUs (its intent allows 8)" in grow.reason


def test_an_intent_is_planned_and_its_constraints_carried(tmp_path):
    intent = tmp_path / "job.yaml"
    intent.write_text("job: pretrain\nmodel: llama-7b\nglobal_batch: 64\n"
                      "constraints: {max_gpus: 16, gpu_types: [h100-sxm], sites: [eu]}\n")
    (line,) = cli("job", "start", "--intent", str(intent), "--gpus", "h100-sxm:8").strip().splitlines()
    plan = Plan.model_validate_json(line)
    assert plan.job == "pretrain" and len(plan.ranks) == 8
    assert plan.constraints is not None
    c = plan.constraints
    assert (c.max_gpus, c.gpu_types, c.sites) == (16, ["h100-sxm"], ["eu"])
    renamed = Plan.model_validate_json(cli("job", "start", "--intent", str(intent), "--gpus", "h100-sxm:8",
                                           "--job", "pretrain-2"))
    assert renamed.job == "pretrain-2"


def test_bad_job_start_and_max_gpus_input_fails_cleanly(tmp_path):
    assert "give exactly one of --plan PLAN.json or --intent JOB.yaml" in cli("job", "start", code=2)
    assert "--intent needs --gpus" in cli("job", "start", "--intent", "x.yaml", code=2)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"job": "x", "dp": 1}))
    assert "--plan: " in cli("job", "start", "--plan", str(bad), code=2)
    assert "is not a plan" in cli("job", "start", "--plan", str(bad), code=2)
    assert "--max-gpus: 2 is below the 4 GPUs the plan uses" in cli(
        "plan", "--model", "llama-7b", "--gpus", "h100-sxm:4", "--global-batch", "64", "--max-gpus", "2",
        code=2)
