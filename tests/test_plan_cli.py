"""`fleetwise plan`: output formats, files it writes, and clean errors (exit 2, no traceback)."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from fleetwise.catalog import lookup
from fleetwise.cli import app
from fleetwise.planner.exports import check_megatron_rules

H8 = ["--model", "gpt-1.3b", "--gpus", "h100-sxm:8"]
SMALL = ["--model", "gpt-1.3b", "--gpus", "h100-sxm:4,b200:4", "--global-batch", "128"]


def run(*args: str):
    return CliRunner().invoke(app, ["plan", *args])


def ok(*args: str):
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result


def fails(*args: str, message: str) -> str:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # a clean exit, not a traceback
    assert "Traceback" not in result.output
    assert message in " ".join(result.stderr.split()), result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def small_json() -> dict:
    return json.loads(ok(*SMALL, "--format", "json").stdout)


def test_table_prints_summary_and_rows():
    out = ok(*SMALL).stdout
    assert "DP=" in out and "TP=" in out and "PP=" in out and "ZeRO=" in out
    assert "speedup" in out and "tokens/s" in out
    assert "b200" in out and "h100-sxm" in out


def test_json_has_the_documented_keys(small_json):
    plan = small_json
    for key in ("dp", "tp", "pp", "zero_stage", "global_batch", "predicted_step_s", "uniform_step_s",
                "tokens_per_s", "mfu", "ranks", "speedup"):  # fmt: skip
        assert key in plan, key
    assert len(plan["ranks"]) == plan["dp"] * plan["tp"] * plan["pp"] == 8
    for rank in plan["ranks"]:
        for key in ("rank", "node", "gpu", "model", "capability_tflops", "micro_batch", "stage", "layers",
                    "memory_gb", "memory_capacity_gb"):  # fmt: skip
            assert key in rank, key
        assert len(rank["layers"]) == 2 and rank["layers"][0] <= rank["layers"][1]
        assert rank["memory_gb"] <= rank["memory_capacity_gb"]
    assert plan["speedup"] == pytest.approx(plan["uniform_step_s"] / plan["predicted_step_s"])
    # Every replica's samples add up to the global batch.
    per_replica = {r["dp_rank"]: r["micro_batch"] * r["num_micro_batches"] for r in plan["ranks"]}
    assert sum(per_replica.values()) == plan["global_batch"] == 128


def test_megatron_format_matches_the_json_plan(small_json):
    args = shlex.split(ok(*SMALL, "--format", "megatron").stdout)
    value = {flag: args[i + 1] for i, flag in enumerate(args[:-1]) if not args[i + 1].startswith("--")}
    assert int(value["--tensor-model-parallel-size"]) == small_json["tp"]
    assert int(value["--pipeline-model-parallel-size"]) == small_json["pp"]
    assert int(value["--global-batch-size"]) == 128
    assert int(value["--num-layers"]) == 24 and int(value["--hidden-size"]) == 2048
    rules = {
        "world_size": 8,
        **{flag[2:].replace("-", "_"): int(v) if v.isdigit() else v for flag, v in value.items()},
        **{flag[2:].replace("-", "_"): True for flag in args if flag.startswith("--") and flag not in value},
    }
    assert check_megatron_rules(rules) == []


def test_deepspeed_ray_kai_formats(small_json):
    ds = json.loads(ok(*SMALL, "--format", "deepspeed").stdout)
    assert ds["train_batch_size"] == 128
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * small_json["dp"] == 128
    ray = json.loads(ok(*SMALL, "--format", "ray").stdout)
    assert ray["num_workers"] == 8
    assert {g["accelerator_type"] for g in ray["worker_groups"]} == {"H100", "B200"}
    kai = json.loads(ok(*SMALL, "--format", "kai-json", "--job", "my-job", "--queue", "research").stdout)
    from fleetwise.kube.crds import validate_manifest

    assert validate_manifest(kai["pod_group"]) == []
    assert kai["pod_group"]["spec"]["queue"] == "research"
    products = {g["gpu_product"] for g in kai["node_groups"]}
    assert {lookup(p).id for p in products} == {"h100-sxm", "b200"}


def test_fixed_strategy_and_zero():
    plan = json.loads(ok(*SMALL, "--strategy", "tp=2,pp=2", "--zero", "1", "--format", "json").stdout)
    assert (plan["tp"], plan["pp"], plan["dp"], plan["zero_stage"]) == (2, 2, 2, 1)


def test_writes_microbatch_map_and_plot(tmp_path):
    mb_path, png = tmp_path / "mb.json", tmp_path / "plan.png"
    ok(*SMALL, "--format", "json", "--microbatch-map", str(mb_path), "--plot", str(png))
    mb = json.loads(mb_path.read_text())
    assert sum(r["grad_weight"] for r in mb["replicas"]) == pytest.approx(1.0)
    assert len(mb["ranks"]) == 8
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_model_file_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "m.yaml"
    yaml_file.write_text("name: tiny\nlayers: 8\nhidden: 1024\nheads: 16\nseq_len: 1024\nvocab: 32000\n")
    plan = json.loads(ok("--model", str(yaml_file), "--gpus", "a100-sxm-80gb:4", "--format", "json").stdout)
    assert plan["model"] == "tiny" and plan["seq_len"] == 1024
    json_file = tmp_path / "m.json"
    json_file.write_text(json.dumps({"name": "gqa", "layers": 8, "hidden": 1024, "heads": 16, "kv_heads": 4}))
    args = shlex.split(ok("--model", str(json_file), "--gpus", "h100-sxm:2", "--format", "megatron").stdout)
    assert args[args.index("--num-query-groups") + 1] == "4"


def _inventory(node: str, model: str, count: int) -> dict:
    return {"ts": 1764489600.0, "node": node, "gpus": [{"index": i, "model": model} for i in range(count)]}


def test_inventory_files(tmp_path):
    jsonl = tmp_path / "fleet.jsonl"
    jsonl.write_text(
        json.dumps(_inventory("node-a", "NVIDIA H100 80GB HBM3", 4))
        + "\n\n"
        + json.dumps(_inventory("node-b", "NVIDIA B200", 4))
        + "\n"
    )
    plan = json.loads(ok("--model", "gpt-1.3b", "--gpus", str(jsonl), "--format", "json").stdout)
    assert {r["node"] for r in plan["ranks"]} == {"node-a", "node-b"}
    single = tmp_path / "one.json"
    single.write_text(json.dumps(_inventory("node-c", "NVIDIA A100-SXM4-80GB", 2)))
    plan = json.loads(ok("--model", "gpt-1.3b", "--gpus", str(single), "--format", "json").stdout)
    assert {r["model"] for r in plan["ranks"]} == {"a100-sxm-80gb"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "gpt-1.3b", "--gpus", "h900:8"], "unknown GPU 'h900'"),
        (["--model", "gpt-1.3b", "--gpus", "h100-sxm:two"], "is not a whole number"),
        ([*H8, "--strategy", "tp=two"], "tp='two' is not a whole number"),
        ([*H8, "--strategy", "tq=2"], "--strategy: bad entry 'tq=2'"),
        ([*H8, "--strategy", "tp=2,tp=4"], "tp is given twice"),
        ([*H8, "--strategy", "tp=3"], "not divisible by tp x pp = 3"),
        ([*H8, "--strategy", "tp=4,pp=2,dp=2"], "needs more GPUs"),
        (["--model", "gpt-9z", "--gpus", "h100-sxm:8"], "unknown model 'gpt-9z'"),
        (["--model", "missing/m.yaml", "--gpus", "h100-sxm:8"], "model file 'missing/m.yaml' does not exist"),
        (["--model", "gpt-1.3b", "--gpus", "nowhere.jsonl"], "inventory file 'nowhere.jsonl' does not exist"),
        ([*H8, "--format", "xml"], "unknown format 'xml'"),
        (["--model", "gpt-1t", "--gpus", "t4:1", "--dtype", "fp16"], "no plan fits"),
        ([*H8, "--recompute", "some"], "--recompute: expected"),
    ],
)
def test_bad_input_fails_cleanly(args, message):
    fails(*args, message=message)


def test_bad_model_and_inventory_files(tmp_path):
    bad_model = tmp_path / "bad.yaml"
    bad_model.write_text("name: x\nlayers: 4\nhidden: 1000\nheads: 16\n")
    fails("--model", str(bad_model), "--gpus", "h100-sxm:8", message="not divisible by heads 16")
    bad_inv = tmp_path / "inv.jsonl"
    good_line = json.dumps(_inventory("n1", "NVIDIA B200", 2))
    bad_inv.write_text(good_line + "\n" + json.dumps({"node": "n2"}) + "\n")
    fails("--model", "gpt-1.3b", "--gpus", str(bad_inv), message="line 2 is not a node inventory")
    garbled = tmp_path / "inv.json"
    garbled.write_text("{not json")
    fails("--model", "gpt-1.3b", "--gpus", str(garbled), message="is not valid JSON")
    unknown_gpu = tmp_path / "unknown.json"
    unknown_gpu.write_text(json.dumps([_inventory("n1", "NVIDIA Z999", 2)]))
    fails("--model", "gpt-1.3b", "--gpus", str(unknown_gpu), message="Z999")


def test_unwritable_output_paths_fail_cleanly(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    fails(*SMALL, "--plot", str(blocker / "p.png"), message="--plot: cannot write")
    fails(*SMALL, "--microbatch-map", str(blocker / "mb.json"), message="cannot write micro-batch map")
