"""The `fleetwise` command: thin typer adapter over the core packages.

Each verb parses arguments, calls core functions, and prints. Errors in user input
become a one-line message and exit code 2 (`fail`), never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fleetwise: parallelism planning, telemetry and failure/straggler prediction for mixed GPU fleets.",
)
console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print a clear error (no traceback) and exit."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


CATALOG_EXTRA_ENV = "FLEETWISE_CATALOG_EXTRA"


@app.callback()
def load_site_catalog() -> None:
    """Before any verb: a site's GPU rows, from the CSV files in FLEETWISE_CATALOG_EXTRA
    (`os.pathsep`-separated; docs/deploy.md), join the catalog, so telemetry of GPUs the
    package lacks is read rather than dead-lettered as an unknown model."""
    import os

    from fleetwise.catalog import CatalogError, add_gpus

    for path in filter(None, os.environ.get(CATALOG_EXTRA_ENV, "").split(os.pathsep)):
        try:
            add_gpus(Path(path).read_text("utf-8"), path)
        except OSError as exc:
            fail(f"{CATALOG_EXTRA_ENV}: cannot read {path}: {exc.strerror or exc}")
        except CatalogError as exc:
            fail(f"{CATALOG_EXTRA_ENV}: {exc}")


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


def _save_figure(fig: Any, path: Path) -> None:
    """Write a matplotlib figure as PNG (the core builds figures; adapters write them)."""
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- catalog ---------------------------------------------------------------------------------
@app.command()
def catalog(
    as_json: bool = typer.Option(False, "--json", help="Print the catalog as JSON."),
    dtype: str = typer.Option("bf16", help="Dtype for the capability column (bf16, fp16, fp8, fp32)."),
) -> None:
    """The GPU generations table: memory, bandwidth, dense TFLOP/s per dtype, efficiency, source."""
    from fleetwise.catalog import catalog_rows, catalog_table

    try:
        rows = catalog_rows(dtype)
    except ValueError as exc:  # unknown dtype
        fail(str(exc))
    if as_json:
        print_json(rows)
    else:
        console.print(catalog_table(rows))


# ---- schemas ---------------------------------------------------------------------------------
schemas_app = typer.Typer(help="Record schemas (JSON Schema export).", no_args_is_help=True)
app.add_typer(schemas_app, name="schemas")


@schemas_app.command("export")
def schemas_export(directory: Path = typer.Argument(Path("docs/schemas"), help="Output folder.")) -> None:
    """Write JSON Schema for every record type into DIRECTORY."""
    from fleetwise.schemas.export import write_json_schemas

    for path in write_json_schemas(directory):
        console.print(str(path))


# ---- plan ------------------------------------------------------------------------------------
PLAN_FORMATS = ("table", "json", "megatron", "deepspeed", "ray", "kai", "kai-json")
_MODEL_FILE_SUFFIXES = (".yaml", ".yml", ".json")
_INVENTORY_SUFFIXES = (".json", ".jsonl")


def _plan_model(value: str):  # -> ModelShape
    """A preset name, or a YAML/JSON model file."""
    from fleetwise.planner import load_model

    path = Path(value)
    looks_like_file = path.suffix.lower() in _MODEL_FILE_SUFFIXES or "/" in value or "\\" in value
    if looks_like_file or path.is_file():
        if not path.is_file():
            fail(f"--model: model file {value!r} does not exist")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"--model: cannot read model file {value!r}: {exc}")
        try:
            return load_model(value, text)
        except ValueError as exc:
            fail(f"--model {value}: {exc}")
    try:
        return load_model(value)
    except ValueError as exc:
        fail(f"--model: {exc}")


def _plan_inventory(path: Path, option: str = "--gpus") -> list:  # -> list[NodeInventory]
    """NodeInventory records from a .json (one object or a list) or .jsonl file."""
    from pydantic import ValidationError

    from fleetwise.schemas import NodeInventory, describe_error

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{option}: cannot read inventory file {str(path)!r}: {exc}")
    items: list[tuple[str, object]] = []
    if path.suffix.lower() == ".jsonl":
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                items.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                fail(f"{option}: {path} line {number} is not valid JSON: {exc.msg}")
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            fail(f"{option}: {path} is not valid JSON: {exc.msg} (line {exc.lineno})")
        records = data if isinstance(data, list) else [data]
        items = [(f"item {i}", record) for i, record in enumerate(records)]
    if not items:
        fail(f"{option}: inventory file {str(path)!r} holds no node records")
    inventories = []
    for where, record in items:
        try:
            inventories.append(NodeInventory.model_validate(record))
        except ValidationError as exc:
            fail(f"{option}: {path} {where} is not a node inventory: {describe_error(exc)}")
    return inventories


def _plan_cluster(spec: str):  # -> Cluster
    """A GPU spec like 'h100-sxm:16,b200:16', or an inventory file."""
    from fleetwise.planner import cluster_from_inventory, parse_gpu_spec

    path = Path(spec)
    if path.suffix.lower() in _INVENTORY_SUFFIXES or path.is_file():
        if not path.is_file():
            fail(f"--gpus: inventory file {spec!r} does not exist")
        try:
            return cluster_from_inventory(_plan_inventory(path))
        except ValueError as exc:
            fail(f"--gpus {spec}: {exc}")
    try:
        return parse_gpu_spec(spec)
    except ValueError as exc:
        fail(f"--gpus: {exc}")


def _plan_strategy(text: str | None, gpus: int) -> tuple[int, int, int] | None:
    """'tp=2,pp=4,dp=4' -> (2, 4, 4); dp may be left out (then GPUs / (tp x pp))."""
    if text is None:
        return None
    values: dict[str, int] = {}
    for raw in text.split(","):
        part = raw.strip()
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in ("tp", "pp", "dp"):
            fail(f"--strategy: bad entry {part!r}; expected tp=N,pp=N[,dp=N], e.g. tp=2,pp=4,dp=4")
        if key in values:
            fail(f"--strategy: {key} is given twice")
        try:
            number = int(value.strip())
        except ValueError:
            fail(f"--strategy: {key}={value.strip()!r} is not a whole number")
        if number < 1:
            fail(f"--strategy: {key} must be at least 1, got {number}")
        values[key] = number
    tp, pp = values.get("tp", 1), values.get("pp", 1)
    if "dp" not in values:
        if gpus % (tp * pp):
            fail(f"--strategy: {gpus} GPUs are not divisible by tp x pp = {tp * pp}; give dp explicitly")
        values["dp"] = gpus // (tp * pp)
    dp = values["dp"]
    if tp * pp * dp > gpus:
        fail(f"--strategy: tp x pp x dp = {tp * pp * dp} needs more GPUs than the {gpus} given")
    return (tp, pp, dp)


def _write_output(path: Path, text: str, what: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as exc:
        fail(f"cannot write {what} to {str(path)!r}: {exc.strerror or exc}")
    sys.stdout.flush()  # keep stdout (the plan) and this stderr note in order on a terminal
    err_console.print(f"wrote {what} to {path}", highlight=False)


@app.command("plan")
def plan_cmd(
    model: str = typer.Option(..., "--model", "-m", help="Model preset (e.g. llama-7b) or a YAML/JSON file."),
    gpus: str = typer.Option(
        ..., "--gpus", "-g", help="GPUs: 'h100-sxm:16,b200:16' (catalog names) or an inventory .json/.jsonl."
    ),
    global_batch: int = typer.Option(256, "--global-batch", min=1, help="Sequences per optimizer step."),
    seq_len: int | None = typer.Option(None, "--seq-len", min=1, help="Sequence length (default: model's)."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16, fp8 or fp32."),
    strategy: str | None = typer.Option(
        None, "--strategy", help="Fix the parallelism instead of searching: tp=N,pp=N[,dp=N]."
    ),
    zero: int | None = typer.Option(None, "--zero", min=0, max=3, help="Fix the ZeRO stage (0-3)."),
    recompute: str = typer.Option("auto", "--recompute", help="auto, none, selective or full."),
    output_format: str = typer.Option(
        "table", "--format", "-f",
        help="table, json, megatron, deepspeed, ray, kai (KAI objects as YAML) or kai-json (the envelope).",
    ),
    plot: Path | None = typer.Option(None, "--plot", help="Write a PNG of per-GPU work and the pipeline."),
    job: str | None = typer.Option(None, "--job", help="Job name (default: the model name)."),
    queue: str = typer.Option("default", "--queue", help="KAI queue for --format kai."),
    gpus_per_pod: int | None = typer.Option(
        None, "--gpus-per-pod", min=1, help="--format kai: GPUs per pod (default: one pod per node)."
    ),
    microbatch_map_file: Path | None = typer.Option(
        None, "--microbatch-map", help="Write the per-rank micro-batch map (JSON) for the training plugin."
    ),
    exhaustive: bool = typer.Option(False, "--exhaustive", help="Search every candidate (slower)."),
    max_gpus: int | None = typer.Option(
        None, "--max-gpus", min=1, help="The most GPUs the job may grow to when GPUs free up (carried "
        "in the plan as constraints.max_gpus; default: it keeps its planned size)."),
) -> None:
    """Plan a training job over a (mixed) set of GPUs and print or export the plan."""
    import shlex

    from fleetwise.planner import InfeasiblePlanError, PlanRequest, plan_job, plan_timeline
    from fleetwise.planner.exports import (
        ExportError,
        deepspeed_config,
        kai_envelope,
        megatron_args,
        microbatch_map,
        ray_scaling_config,
    )
    from fleetwise.planner.render import plan_figure, plan_summary, plan_table
    from fleetwise.schemas import JobConstraints

    fmt = output_format.strip().lower()
    if fmt not in PLAN_FORMATS:
        fail(f"--format: unknown format {output_format!r}; expected one of {', '.join(PLAN_FORMATS)}")
    if recompute not in ("auto", "none", "selective", "full"):
        fail(f"--recompute: expected auto, none, selective or full, got {recompute!r}")
    shape = _plan_model(model)
    cluster = _plan_cluster(gpus)
    request = PlanRequest(
        model=shape,
        global_batch=global_batch,
        seq_len=seq_len,
        dtype=dtype,
        strategy=_plan_strategy(strategy, len(cluster)),
        zero_stages=(zero,) if zero is not None else (0, 1, 2, 3),
        recompute=recompute,
        job=job or shape.name,
        exhaustive=exhaustive,
        constraints=JobConstraints(max_gpus=max_gpus) if max_gpus is not None else None,
    )
    try:
        plan = plan_job(request, cluster)
    except InfeasiblePlanError as exc:
        fail(f"no plan fits: {exc}")
    except ValueError as exc:
        fail(str(exc))
    if max_gpus is not None and max_gpus < len(plan.ranks):
        fail(f"--max-gpus: {max_gpus} is below the {len(plan.ranks)} GPUs the plan uses")

    try:
        if fmt == "table":
            console.print(plan_summary(plan), highlight=False)
            console.print(plan_table(plan))
        elif fmt == "json":
            print_json({**plan.model_dump(mode="json"), "speedup": plan.speedup})
        elif fmt == "megatron":
            sys.stdout.write(" ".join(shlex.quote(arg) for arg in megatron_args(plan, shape)) + "\n")
        elif fmt == "deepspeed":
            print_json(deepspeed_config(plan))
        elif fmt == "ray":
            print_json(ray_scaling_config(plan))
        elif fmt == "kai-json":
            print_json(kai_envelope(plan, job or shape.name, queue, gpus_per_pod=gpus_per_pod))
        else:
            from fleetwise.kube.render import dump_yaml, render_plan

            objects = render_plan(plan, job or shape.name, queue, gpus_per_pod=gpus_per_pod)
            sys.stdout.write(dump_yaml(objects))
    except ExportError as exc:
        fail(f"--format {fmt}: {exc}")
    if microbatch_map_file is not None:
        try:
            text = json.dumps(microbatch_map(plan), indent=2) + "\n"
        except ExportError as exc:
            fail(f"--microbatch-map: {exc}")
        _write_output(microbatch_map_file, text, "micro-batch map")
    if plot is not None:
        try:
            _save_figure(plan_figure(plan, plan_timeline(plan, request, cluster)), plot)
        except OSError as exc:
            fail(f"--plot: cannot write {str(plot)!r}: {exc.strerror or exc}")
        sys.stdout.flush()
        err_console.print(f"wrote plot to {plot}", highlight=False)


# ---- place -----------------------------------------------------------------------------------


def _read_mapping(path: Path, option: str, what: str) -> dict:
    """A YAML/JSON file holding one mapping; errors name the option and the file."""
    import yaml

    if not path.is_file():
        fail(f"{option}: {what} file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # JSON is YAML too
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"{option}: cannot read {str(path)!r}: {exc}")
    except yaml.YAMLError as exc:
        fail(f"{option}: {path} is not valid YAML/JSON: {exc}")
    if not isinstance(data, dict):
        fail(f"{option}: {path} must hold a {what} mapping, got {type(data).__name__}")
    return data


def _place_intent(path: Path, option: str = "JOB"):  # -> JobIntent
    """A job intent from a YAML/JSON file; errors name the file and the field."""
    from pydantic import ValidationError

    from fleetwise.schemas import JobIntent, describe_error

    data = _read_mapping(path, option, "job intent (job, model, global_batch, ...)")
    if isinstance(data.get("model"), str):  # a preset name is accepted for the model
        data["model"] = _plan_model(data["model"]).model_dump()
    try:
        return JobIntent.model_validate(data)
    except ValidationError as exc:
        fail(f"{option}: {path} is not a job intent: {describe_error(exc)}")


def _place_telemetry(path: Path, job: str) -> tuple[dict, list, float | None]:
    """Latest GPU state per GPU from a trace (.jsonl/.jsonl.gz of GPU samples or node batches;
    step records are skipped; GPU feature records, as `replay --features` writes them, give each
    GPU's temperature at full power), the GPUs that run ``job`` now, and the latest timestamp."""
    import gzip

    from pydantic import ValidationError

    from fleetwise.planner.placement import telemetry_from_samples, with_full_power
    from fleetwise.schemas import FeatureVector, GpuSample, NodeBatch, describe_error

    if not path.is_file():
        fail(f"--telemetry: trace file {str(path)!r} does not exist")
    samples: list = []
    features: list = []
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    fail(f"--telemetry: {path} line {lineno} is not valid JSON: {exc.msg}")
                if not isinstance(obj, dict):
                    fail(f"--telemetry: {path} line {lineno} is not a JSON object")
                try:
                    if obj.get("kind") == "features":
                        features.append(FeatureVector.model_validate(obj))
                    elif "samples" in obj:
                        samples.extend(NodeBatch.model_validate(obj).samples)
                    elif "step" not in obj:
                        samples.append(GpuSample.model_validate(obj))
                except ValidationError as exc:
                    fail(f"--telemetry: {path} line {lineno} is not a GPU sample: {describe_error(exc)}")
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        fail(f"--telemetry: cannot read {str(path)!r}: {exc}")
    state = with_full_power(telemetry_from_samples(samples), features)
    current = sorted(key for key, st in state.items() if st.job == job)
    latest = max((st.ts for st in state.values()), default=None)
    return state, current, latest


def _place_carbon(text: str | None, path: Path | None) -> dict:
    """'site-a=120,site-b=450' and/or a JSON file {site: g | [[ts, g], ...]}."""
    out: dict = {}
    if path is not None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"--carbon-file: cannot read {str(path)!r}: {exc}")
        except json.JSONDecodeError as exc:
            fail(f"--carbon-file: {path} is not valid JSON: {exc.msg} (line {exc.lineno})")
        if not isinstance(data, dict):
            fail(f"--carbon-file: {path} must map site -> gCO2/kWh or [[ts, g], ...]")
        for site, value in data.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[site] = float(value)
            elif isinstance(value, list) and all(
                isinstance(p, list) and len(p) == 2 and all(isinstance(x, int | float) for x in p)
                for p in value
            ):
                out[site] = [(float(t), float(g)) for t, g in value]
            else:
                fail(f"--carbon-file: {path} site {site!r}: expected a number or [[ts, g], ...], "
                     f"got {value!r}")
    for raw in (text or "").split(","):
        part = raw.strip()
        if not part:
            continue
        site, sep, value = part.partition("=")
        if not sep or not site.strip():
            fail(f"--carbon: bad entry {part!r}; expected SITE=GRAMS_PER_KWH, e.g. eu-north=30")
        try:
            out[site.strip()] = float(value)
        except ValueError:
            fail(f"--carbon: {site.strip()}={value.strip()!r} is not a number")
    return out


@app.command("place")
def place_cmd(
    job: Path = typer.Argument(
        ..., help="Job intent file (YAML/JSON): job, model (fields or a preset name), global_batch, "
        "dtype, workload, constraints (max_gpus/min_gpus, gpu_types, sites)."),
    fleet: Path = typer.Option(..., "--fleet", help="Node inventories (.jsonl or .json): rack, site, "
                               "rack_power_budget_w, GPUs, NVLink groups, NICs; labels.power_domain."),
    telemetry: Path | None = typer.Option(
        None, "--telemetry", help="Trace of GPU samples (.jsonl/.jsonl.gz): the latest utilisation, "
        "temperature, power and job per GPU. GPUs running other jobs are busy; GPUs running JOB are its "
        "current place. GPU feature records in it (`fleetwise replay --features`) give each GPU's "
        "temperature at full power, which the thermal term then weighs instead of the temperature now."),
    weights: str | None = typer.Option(
        None, "--weights", help="Preset (bandwidth-hungry, compute-dense, latency-bound) and/or term=W "
        "overrides, e.g. 'compute-dense,carbon=2'. Terms: compute, memory, load, comm, latency, thermal, "
        "carbon, move. Default: the job's workload preset."),
    gpus: int | None = typer.Option(
        None, "--gpus", min=1, help="GPUs to place (default: constraints.max_gpus, else min_gpus)."),
    top: int = typer.Option(10, "--top", min=1, help="Options to show."),
    max_rack_share: float = typer.Option(0.5, "--max-rack-share", help="At most this share of the job's GPUs "
                                         "in one rack (failure domain), in (0, 1]."),
    max_domain_share: float | None = typer.Option(
        None, "--max-domain-share", help="At most this share in one power domain "
        "(default: --max-rack-share)."),
    min_tokens_per_s: float | None = typer.Option(
        None, "--min-tokens-per-s", help="Throughput floor (default: constraints.min_tokens_per_s if set)."),
    carbon: str | None = typer.Option(
        None, "--carbon", help="Grid gCO2/kWh per site: SITE=G,... (others: 480)."),
    carbon_file: Path | None = typer.Option(
        None, "--carbon-file", help="JSON object: site -> gCO2/kWh, or a list of (unix_ts, g) pairs "
        "(a series is averaged over the job's remaining time)."),
    remaining_hours: float = typer.Option(24.0, "--remaining-hours", min=0.0, help="The job's remaining run "
                                          "time (move and cross-site decisions)."),
    current_step_s: float | None = typer.Option(
        None, "--current-step-s", help="The job's step time now (default: planned on its current GPUs)."),
    as_json: bool = typer.Option(False, "--json", help="Print the ranked options as JSON."),
    kai: bool = typer.Option(False, "--kai", help="Print the KAI envelope of the best option (JSON)."),
    queue: str | None = typer.Option(None, "--queue", help="KAI queue for --kai (default: the intent's)."),
) -> None:
    """Rank destinations for a job over a fleet by explicit cost terms (docs/placement.md)."""
    import time

    from fleetwise.planner.placement import (
        FleetIndex,
        PlacementError,
        PlacementSettings,
        parse_weights,
        place_job,
        placement_envelope,
        placement_table,
    )

    intent = _place_intent(job)
    if not fleet.is_file():
        fail(f"--fleet: inventory file {str(fleet)!r} does not exist")
    inventories = _plan_inventory(fleet, "--fleet")
    state, current, latest = ({}, [], None)
    if telemetry is not None:
        state, current, latest = _place_telemetry(telemetry, intent.job)
    try:
        preset, weight_map = parse_weights(weights, intent.workload)
        settings = PlacementSettings(
            gpus=gpus, weights=weight_map, preset=preset, max_rack_share=max_rack_share,
            max_domain_share=max_domain_share, min_tokens_per_s=min_tokens_per_s, current=current,
            current_step_s=current_step_s, remaining_s=remaining_hours * 3600.0,
            carbon=_place_carbon(carbon, carbon_file), now_ts=latest if latest is not None else time.time(),
        )
        result = place_job(intent, FleetIndex(inventories), state, settings)
    except PlacementError as exc:
        fail(str(exc))
    if not result.options and not as_json:
        fail("no option can hold the job: " + "; ".join(
            f"{r['site']}/{r['gpu_type']}: {r['reason']}" for r in result.rejected))
    if kai:
        try:
            print_json(placement_envelope(result.options[0], intent.job, queue or intent.queue))
        except ValueError as exc:
            fail(f"--kai: {exc}")
        return
    if as_json:
        data = result.to_dict()
        data["options"] = data["options"][:top]
        print_json(data)
        return
    console.print(placement_table(result, top=top))
    best = result.options[0]
    plan = best.plan
    how = f"tp={plan.tp} pp={plan.pp} dp={plan.dp}" if plan is not None else "estimated"
    proof = "optimal over all pools" if result.optimal else "planner budget reached: not proved optimal"
    console.print(
        f"best: {best.site} / {best.gpu_type}: {len(best.gpus)} GPUs on {best.nodes} nodes in "
        f"{len(best.racks)} racks ({how}); step {best.step_s:.3g} s; {proof}. "
        "Columns are weighted terms; * = lower-bound step estimate (not planned).", highlight=False)
    for r in result.rejected:
        console.print(f"rejected {r['site']} / {r['gpu_type']}: {r['reason']}", highlight=False)

# ---- kube (KAI Scheduler objects, the KAI-side consumer) -------------------------------------
kube_app = typer.Typer(help="Kubernetes / KAI Scheduler: render objects, run the command consumer.",
                       no_args_is_help=True)
app.add_typer(kube_app, name="kube")


def _plan_file(path: Path):  # -> Plan
    """A plan as `fleetwise plan --format json` prints it."""
    from pydantic import ValidationError

    from fleetwise.schemas import Plan, describe_error

    data = _read_mapping(path, "--plan", "plan (fleetwise plan --format json)")
    data.pop("speedup", None)
    try:
        return Plan.model_validate(data)
    except ValidationError as exc:
        fail(f"--plan: {path} is not a plan: {describe_error(exc)}")


def _plan_or_intent(plan_file: Path | None, intent_file: Path | None, gpus: str | None,
                    job: str | None):  # -> tuple[Plan, str, str]
    """The plan of `--plan`, or `--intent` planned over `--gpus` (exactly one of the two); with
    the job's name (`--job`, else the plan's / intent's) and its KAI queue."""
    from fleetwise.planner import InfeasiblePlanError, plan_job, request_for_intent

    if (plan_file is None) == (intent_file is None):
        fail("give exactly one of --plan PLAN.json or --intent JOB.yaml")
    if job is not None and not job.strip():
        fail("--job must not be empty")
    if intent_file is not None:
        if gpus is None:
            fail("--intent needs --gpus (the GPUs to plan the job over)")
        intent = _place_intent(intent_file, "--intent")
        try:
            plan = plan_job(request_for_intent(intent), _plan_cluster(gpus))
        except (InfeasiblePlanError, ValueError) as exc:
            fail(f"--intent {intent_file}: no plan fits: {exc}")
        return plan, job or intent.job, intent.queue
    assert plan_file is not None
    plan = _plan_file(plan_file)
    return plan, job or plan.job, "default"


@kube_app.command("render")
def kube_render_cmd(
    plan_file: Path | None = typer.Option(None, "--plan", help="A plan (fleetwise plan --format json)."),
    intent_file: Path | None = typer.Option(
        None, "--intent", help="A job intent (YAML/JSON, as for `fleetwise place`); planned over --gpus."),
    gpus: str | None = typer.Option(
        None, "--gpus", help="With --intent: 'h100-sxm:16,b200:16' or an inventory."),
    job: str | None = typer.Option(None, "--job", help="Job name (default: the plan's / intent's)."),
    queue: str | None = typer.Option(
        None, "--queue", help="KAI queue (default: the intent's, else 'default')."),
    namespace: str = typer.Option("default", "--namespace", "-n", help="Namespace of the job's objects."),
    workload: str = typer.Option("pods", "--workload", help="pods, jobset or pytorchjob (one GPU type)."),
    image: str | None = typer.Option(None, "--image", help="Trainer container image."),
    gpus_per_pod: int | None = typer.Option(
        None, "--gpus-per-pod", min=1, help="Default: one pod per node."),
    priority_class: str | None = typer.Option(
        None, "--priority-class", help="PodGroup/pod priorityClassName."),
    preemptible: bool | None = typer.Option(
        None, "--preemptible/--non-preemptible", help="PodGroup preemptibility."),
    topology: str = typer.Option("fleetwise", "--topology", help="KAI Topology the constraints refer to."),
    no_topology: bool = typer.Option(False, "--no-topology", help="No topologyConstraint even where the plan "
                                     "needs one NVLink or rack domain."),
    with_topology_object: bool = typer.Option(
        False, "--with-topology-object", help="Also print the Topology."),
    team_queues: list[str] = typer.Option([], "--team-queue", help="TEAM=GPUS: a Queue per team (repeat)."),
    command: str | None = typer.Option(
        None, "--command", help="The trainer's command line, e.g. a torchrun with a c10d rendezvous "
        "whose --nnodes range allows resizes (pods a resize or a migration adds are copies: same command)."),
) -> None:
    """KAI objects for a job (multi-document YAML for `kubectl apply -f -`)."""
    import shlex

    from fleetwise.kube.render import (
        DEFAULT_IMAGE,
        RenderError,
        dump_yaml,
        render_plan,
        render_queues,
        render_topology,
    )
    from fleetwise.planner.exports import ExportError

    argv: list[str] | None = None
    if command is not None:
        try:
            argv = shlex.split(command)
        except ValueError as exc:
            fail(f"--command: {exc}")
        if not argv:
            fail("--command is empty")
    plan, name, default_queue = _plan_or_intent(plan_file, intent_file, gpus, job)
    quotas: dict[str, float] = {}
    for item in team_queues:
        team, sep, value = item.partition("=")
        try:
            quotas[team.strip()] = float(value)
        except ValueError:
            fail(f"--team-queue: {item!r} is not TEAM=GPUS")
        if not sep or not team.strip():
            fail(f"--team-queue: {item!r} is not TEAM=GPUS")
    try:
        objects = []
        if quotas:
            objects += render_queues(quotas)
        if with_topology_object:
            objects.append(render_topology(topology))
        objects += render_plan(
            plan, name, queue or default_queue, gpus_per_pod=gpus_per_pod, namespace=namespace,
            workload=workload, image=image or DEFAULT_IMAGE, priority_class=priority_class,
            preemptible=preemptible, topology_name=topology, with_topology=not no_topology, command=argv,
        )
    except RenderError as exc:
        fail(str(exc))
    except ExportError as exc:
        fail(f"cannot render the plan: {exc}")
    sys.stdout.write(dump_yaml(objects))


@kube_app.command("consumer")
def kube_consumer_cmd(
    bootstrap: str = typer.Option(..., "--bootstrap", help="Kafka bootstrap servers (host:port[,...])."),
    kubeconfig: Path | None = typer.Option(
        None, "--kubeconfig", help="Cluster credentials (default: in-cluster account, else ~/.kube)."),
    namespace: str = typer.Option("default", "--namespace", "-n", help="Namespace of the jobs' pods."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the API calls, change nothing."),
    prefix: str = typer.Option("", "--topic-prefix", envvar="FLEETWISE_TOPIC_PREFIX",
                               help="Prefix of every topic name (Helm: kafka.topicPrefix; tests)."),
    from_beginning: bool = typer.Option(
        True, "--from-beginning/--from-now", help="Read the topics from their start (commands already done "
        "on the cluster are acked as duplicates) or only what arrives from now."),
    max_seconds: float | None = typer.Option(None, "--max-seconds", help="Stop after this long."),
    policy: Path | None = typer.Option(
        None, "--policy", envvar="FLEETWISE_POLICY",
        help="The workers' policy file (YAML): its rails' fleet drain cap is enforced on the cluster."),
) -> None:
    """Carry out `fleetwise.commands.kube` on the cluster; ack each on `fleetwise.acks`."""
    import signal
    import threading

    from fleetwise.kube.consumer import ClientApi, DryRunApi, KubeConsumer
    from fleetwise.training.transport import KafkaTransport

    keyring = _keyring()
    rails = _load_policy(policy).rails
    if kubeconfig is not None and not kubeconfig.is_file():
        fail(f"--kubeconfig: {str(kubeconfig)!r} does not exist")
    try:
        live = None if (dry_run and kubeconfig is None) else ClientApi(
            kubeconfig=str(kubeconfig) if kubeconfig else None)
    except Exception as exc:  # noqa: BLE001 - no credentials: say so, no traceback
        fail(f"cannot load cluster credentials: {exc}")
    api = DryRunApi(reader=live, out=lambda line: console.print(line, highlight=False, soft_wrap=True)) \
        if dry_run else live
    consumer = KubeConsumer(api, keyring, namespace=namespace, operator_keys=_operator_keys(), rails=rails)
    transport = KafkaTransport(bootstrap, prefix=prefix, from_beginning=from_beginning)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    err_console.print(f"kube consumer: {bootstrap} -> {'dry run' if dry_run else 'cluster'} "
                      f"(namespace {namespace})", highlight=False)
    try:
        consumer.run(transport, stop, max_s=max_seconds)
    except KeyboardInterrupt:
        pass
    finally:
        transport.close()


# ---- trace -----------------------------------------------------------------------------------
trace_app = typer.Typer(help="Recorded telemetry files.", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@trace_app.command("sort")
def trace_sort(
    traces: list[Path] = typer.Argument(..., help="Trace files (.jsonl or .jsonl.gz), in any order."),
    out: Path = typer.Option(..., "--out", help="The merged trace, in event-time order (.gz: compressed)."),
    run_lines: int = typer.Option(500_000, help="Lines sorted in memory at a time (the rest spill "
                                  "to compressed temporary files in $TMPDIR, ~10% of the text's "
                                  "size: ~0.8 GB of memory for 1.3 KB lines)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Merge trace files into one in event-time order (per-node recordings, a trace written rank
    by rank), so that a replay reads them as the workers would have."""
    from fleetwise.streams.trace_sort import sort_traces

    _existing(traces, "trace")
    _writable(out, "--out")
    if run_lines < 1:
        fail(f"--run-lines must be at least 1, got {run_lines}")
    if any(out.resolve() == t.resolve() for t in traces):
        fail(f"--out {out} is one of the traces: write the sorted trace to a new file")
    try:
        summary = sort_traces(traces, out, run_lines=run_lines)
    except OSError as exc:  # an unwritable --out, a full disk, an unreadable trace
        fail(f"trace sort: {exc.strerror or exc}: {exc.filename or out}")
    data = {"lines": summary.lines, "files": summary.files, "out_of_order": summary.out_of_order,
            "unreadable_ts": summary.unreadable_ts, "unreadable_first": summary.unreadable_first,
            "runs": summary.runs, "out": str(out)}
    if as_json:
        print_json(data)
        return
    console.print(f"sorted {data['lines']} lines from {data['files']} files ({data['out_of_order']} were "
                  f"older than a line before them; {data['unreadable_ts']} without a readable ts kept in "
                  f"place) -> {out}", soft_wrap=True)
    if summary.unreadable_first:
        more = summary.unreadable_ts - len(summary.unreadable_first)
        console.print("without a readable ts: " + ", ".join(summary.unreadable_first)
                      + (f" and {more} more" if more else ""), soft_wrap=True)


# ---- sim -------------------------------------------------------------------------------------
@app.command("sim")
def sim_cmd(
    gpus: str = typer.Option(
        "h100-sxm:32,a100-sxm-80gb:32,b200:16", "--gpus", help="GPU spec, e.g. h100-sxm:16,b200:16."
    ),
    days: float = typer.Option(1.0, "--days", help="Trace length in days."),
    seed: int = typer.Option(0, "--seed", help="Seed: same seed, same trace."),
    out: Path = typer.Option(..., "--out", help="Trace file (.jsonl or .jsonl.gz)."),
    labels: Path | None = typer.Option(None, "--labels", help="Ground-truth labels file (.jsonl)."),
    interval: float = typer.Option(60.0, "--interval", help="Sample interval in seconds."),
    failure_rate: float | None = typer.Option(
        None, "--failure-rate", help="Failures per 1,000 GPU-days (default 0.5, a real fleet's rate)."
    ),
    straggler_rate: float | None = typer.Option(
        None, "--straggler-rate", help="Stragglers per 1,000 GPU-days."
    ),
    inventory: Path | None = typer.Option(
        None, "--inventory", help="Also write node inventories (.jsonl)."
    ),
    xid_field: str = typer.Option(
        "last", "--xid-field", help="XID_ERRORS semantics: 'last' (sticky, as DCGM) or 'interval'."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Write a synthetic fleet trace (DCGM samples + step records) and its ground-truth labels."""
    from fleetwise.sim import (
        FleetSimulator,
        SimConfig,
        SimConfigError,
        summarize_labels,
        write_labels,
        write_trace,
    )

    if not str(out).endswith((".jsonl", ".jsonl.gz")):
        fail(f"--out must end in .jsonl or .jsonl.gz, got {str(out)!r}")
    for name, value in (("--days", days), ("--interval", interval)):
        if not value > 0:
            fail(f"{name} must be > 0, got {value}")
    for name, value in (("--failure-rate", failure_rate), ("--straggler-rate", straggler_rate)):
        if value is not None and value < 0:
            fail(f"{name} must be >= 0, got {value}")
    for path in (out, labels, inventory):
        if path is not None and not path.parent.exists():
            fail(f"folder {str(path.parent)!r} for {str(path)!r} does not exist")
    if xid_field not in ("last", "interval"):
        fail(f"--xid-field must be 'last' or 'interval', got {xid_field!r}")
    config = SimConfig(gpus=gpus, days=days, seed=seed, sample_interval_s=interval, xid_field=xid_field)
    if failure_rate is not None:
        config.failure_rate_per_1000_gpu_days = failure_rate
    if straggler_rate is not None:
        config.straggler_rate_per_1000_gpu_days = straggler_rate
    try:
        sim = FleetSimulator(config)
    except SimConfigError as exc:
        fail(str(exc))
    counts = write_trace(sim, out)
    label_rows = sim.labels()
    if labels is not None:
        write_labels(sim, labels)
    if inventory is not None:
        with open(inventory, "w", encoding="utf-8") as fh:
            for row in sim.inventory():
                fh.write(json.dumps(row, separators=(",", ":")) + "\n")
    summary = {
        "gpus": sim.n_gpus,
        "nodes": len(sim.fleet.nodes),
        "days": days,
        "seed": seed,
        "samples": counts["samples"],
        "steps": counts["steps"],
        "jobs": len(sim.schedule.jobs),
        **summarize_labels(label_rows),
        "out": str(out),
        "labels": str(labels) if labels else None,
    }
    if as_json:
        print_json(summary)
        return
    console.print(
        f"{summary['gpus']} GPUs on {summary['nodes']} nodes, {days:g} days, seed {seed}: "
        f"{summary['samples']:,} samples, {summary['steps']:,} step records, {summary['jobs']} jobs -> {out}"
    )
    fails = ", ".join(f"{k} {v}" for k, v in sorted(summary["failures"].items())) or "none"
    console.print(f"failures: {fails} ({summary['failures_warned']} with precursors)")
    strag = ", ".join(f"{k} {v}" for k, v in sorted(summary["stragglers"].items())) or "none"
    console.print(f"stragglers: {strag}; job slowdowns: {sum(summary['job_slowdowns'].values())}")
    traps = ", ".join(f"{k} {v}" for k, v in sorted(summary["traps"].items())) or "none"
    console.print(f"traps: {traps}; lemons: {summary['lemons']}")
    if labels:
        console.print(f"labels -> {labels}")


# ---- replay / demo / backtest ----------------------------------------------------------------
def _existing(paths: list[Path], what: str) -> list[Path]:
    for path in paths:
        if not path.is_file():
            fail(f"{what} not found: {path}")
    return paths


def _writable(path: Path | None, what: str) -> None:
    """Refuse an output whose folder does not exist before the work, not after it."""
    if path is not None and not path.parent.is_dir():
        fail(f"{what} {path}: folder {path.parent} does not exist")


@app.command()
def replay(
    traces: list[Path] = typer.Argument(..., help="Recorded telemetry: .jsonl or .jsonl.gz files."),
    out: Path = typer.Option(..., "--out", help="Decision output (JSON lines: predictions and commands)."),
    inventory: Path | None = typer.Option(None, help="Node inventories (.jsonl) to load first."),
    report: Path | None = typer.Option(None, help="Write an HTML report of the predictions."),
    labels: Path | None = typer.Option(None, help="Simulator labels, to mark failures in the report."),
    features: Path | None = typer.Option(
        None, help="Also write the per-GPU feature vectors (JSON lines; kept in memory until the end)."),
    stagger_hops: bool = typer.Option(
        True, "--stagger-hops/--aligned-hops",
        help="Hop phases per GPU (default) or one hop grid for all, as `fleetwise worker`."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    max_bad_lines: int = typer.Option(20, help="How many bad lines to list (all are counted)."),
    policy: Path | None = typer.Option(None, "--policy", help="Operator policy file (YAML; "
                                       "`fleetwise policy show` prints every field with its default)."),
    acks: str = typer.Option("simulated", "--acks", help="simulated: consumers answer every command "
                             "(what the system would do if carried out); none: only acks recorded in "
                             "the trace, other commands expire and are reported."),
    audit: Path | None = typer.Option(None, "--audit", help="Also write the audit events (rails that "
                                      "held a command back, expiries, approvals) as JSON lines."),
    in_time_order: bool = typer.Option(False, "--sort/--file-order", help="Merge the traces' lines "
                                       "into event-time order first (as `fleetwise trace sort`, spilling "
                                       "to temporary files), for recordings written per node or per rank; "
                                       "bad lines are still named by their file and line. "
                                       "Default: each file in turn, line by line."),
    model_alerts: bool | None = typer.Option(None, "--model-alerts/--rules-only", help="Failure alerts "
                                             "from the model beside the rules, or the rules alone (default: "
                                             "as the model's policy says; the packaged model's: both, the "
                                             "model's after 6 h at p >= 0.97, 12 h where single-bit errors "
                                             "drive the risk, 18 h where heat does)."),
    trends: Path | None = typer.Option(None, "--trends", help="Also write thermal headroom and "
                                       "utilisation per rack and site, per event-time hour (JSON lines; "
                                       "the report shows them whenever --report is given)."),
) -> None:
    """Run the whole control plane, embedded, over recorded telemetry; write its decisions."""
    from fleetwise.streams.embedded import replay as run_replay
    from fleetwise.streams.embedded import replay_process

    _existing(traces, "trace")
    if inventory is not None:
        _existing([inventory], "inventory")
    for path, what in ((out, "--out"), (features, "--features"), (report, "--report"), (audit, "--audit"),
                       (trends, "--trends")):
        _writable(path, what)
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    if acks not in ("simulated", "none"):
        fail(f"--acks must be simulated or none, got {acks!r}")
    config = ControlPlaneConfig(publish_features=features is not None, stagger_hops=stagger_hops,
                                policy=_load_policy(policy), keyring=_keyring(signs=True),
                                operator_keys=_operator_keys(), model_alerts=model_alerts,
                                fleet_trends=trends is not None or report is not None)
    control = ControlPlane(config)
    with replay_process():
        runtime = run_replay(traces, out, inventory=inventory, features=features, control=control,
                             simulate_acks=acks == "simulated", audit=audit, in_time_order=in_time_order,
                             trends=trends)
    summary = runtime.summary
    decisions = runtime.decisions()
    if report is not None:
        _write_report(report, decisions, labels, control.trend_rows)
    data = {
        "lines": summary.lines, "samples": summary.samples, "steps": summary.steps,
        "bad_lines": len(summary.bad_lines),
        "predictions": sum(1 for d in decisions if d.kind == "prediction"),
        "alerts": sum(1 for d in decisions if d.kind == "prediction" and d.alert),
        "commands": sum(1 for d in decisions if d.kind == "command"),
        "outputs": dict(summary.outputs), "out": str(out),
        "step_groups_back_in_time": summary.step_groups_back_in_time,
    }
    if as_json:
        print_json(data)
        return
    for source, reason in summary.bad_lines[:max_bad_lines]:
        err_console.print(f"[yellow]skipped[/] {source}: {reason}", highlight=False)
    if len(summary.bad_lines) > max_bad_lines:
        err_console.print(f"... and {len(summary.bad_lines) - max_bad_lines} more bad lines")
    if data["step_groups_back_in_time"]:
        err_console.print(
            f"[yellow]warning:[/] {data['step_groups_back_in_time']} step groups began more than "
            f"{control.stragglers.config.stale_s:g} s before their job's newest step record: the step "
            "records are not in event-time order (a trace written rank by rank?). The straggler detector "
            "compares a job's ranks step by step as the records come, so its findings on this trace are not "
            "reliable: give the step records in time order (`--sort`, or `fleetwise trace sort`).",
            highlight=False)
    console.print(
        f"replayed {data['lines']} lines: {data['samples']} GPU samples, {data['steps']} step records, "
        f"{data['bad_lines']} bad lines skipped; {data['predictions']} predictions "
        f"({data['alerts']} alerts), {data['commands']} commands -> {out}"
    )


@app.command()
def demo(
    out_dir: Path = typer.Option(Path("out/demo"), help="Where the trace, decisions and report go."),
    model: str = typer.Option("llama-13b", help="The main job's model (preset name)."),
    global_batch: int = typer.Option(512, help="The main job's global batch (sequences)."),
    no_training: bool = typer.Option(False, "--no-training",
                                     help="Skip the live rebalance of real torch processes (needs torch)."),
) -> None:
    """The main job on the embedded default: a bundled mixed fleet, its trace, the plan,
    predictions and decisions, and a report to look at."""
    from rich.table import Table

    from fleetwise.planner import PlanRequest, cluster_from_inventory, plan_job, resolve_model
    from fleetwise.planner.render import plan_figure, plan_summary
    from fleetwise.predictors.backtest import metrics_rows, score_all
    from fleetwise.schemas import NodeInventory
    from fleetwise.schemas import topics as T
    from fleetwise.sim import FleetSimulator, summarize_labels, write_labels, write_trace
    from fleetwise.sim.bundled import demo_config
    from fleetwise.streams.embedded import replay as run_replay

    out_dir.mkdir(parents=True, exist_ok=True)
    config = demo_config()
    sim = FleetSimulator(config)
    inventories = [NodeInventory.model_validate(d) for d in sim.inventory()]

    # 1. The fleet.
    console.rule("[bold]1. The fleet")
    fleet = Table("GPU model", "GPUs", "nodes", "racks", "sites")
    by_model: dict[str, dict[str, set]] = {}
    for inv in inventories:
        for g in inv.gpus:
            entry = by_model.setdefault(g.model, {k: set() for k in ("gpus", "nodes", "racks", "sites")})
            entry["gpus"].add((inv.node, g.index))
            entry["nodes"].add(inv.node)
            entry["racks"].add(inv.rack)
            entry["sites"].add(inv.site)
    for name, e in sorted(by_model.items()):
        fleet.add_row(name, *(str(len(e[k])) for k in ("gpus", "nodes", "racks", "sites")))
    console.print(fleet)
    console.print(f"{config.days:g} days sampled every {config.sample_interval_s:g} s, seed {config.seed}")

    # 2. The main job's plan on that fleet.
    console.rule(f"[bold]2. Plan: {model} on the fleet")
    shape = resolve_model(model)
    request = PlanRequest(model=shape, global_batch=global_batch, seq_len=shape.seq_len, job="demo-main")
    cluster = cluster_from_inventory(inventories)
    try:
        plan = plan_job(request, cluster)
    except ValueError as exc:
        fail(str(exc))
    console.print(plan_summary(plan))
    plan_png = out_dir / "plan.png"
    from fleetwise.planner import plan_timeline

    _save_figure(plan_figure(plan, plan_timeline(plan, request, cluster)), plan_png)

    # 3. Telemetry: the bundled trace (generated from the seed, so it is the same every run).
    console.rule("[bold]3. Telemetry trace")
    trace, labels_path = out_dir / "trace.jsonl.gz", out_dir / "labels.jsonl"
    inventory_path = out_dir / "inventory.jsonl"
    counts = write_trace(sim, trace)
    write_labels(sim, labels_path)
    inventory_path.write_text("".join(inv.to_json() + "\n" for inv in inventories))
    labels = [json.loads(line) for line in labels_path.read_text().splitlines() if line.strip()]
    console.print(f"{trace}: {counts}")
    console.print(f"injected (ground truth, {labels_path}): {summarize_labels(labels)}")

    # 4. The control plane, embedded, over the trace.
    console.rule("[bold]4. Replay through the control plane (embedded, event time)")
    decisions_path, trends_path = out_dir / "decisions.jsonl", out_dir / "trends.jsonl"
    runtime = run_replay([trace], decisions_path, inventory=inventory_path, trends=trends_path)
    decisions = runtime.decisions()
    summary = runtime.summary
    console.print(
        f"{summary.samples} GPU samples and {summary.steps} step records processed, "
        f"{len(summary.bad_lines)} bad lines; outputs per topic: {dict(summary.outputs)}"
    )
    alerts = Table("raised (UTC)", "type", "node/gpu", "job/rank", "p / factor", "top signals",
                   title="Alerts (when raised; each stays up until cleared)")
    from datetime import UTC, datetime

    def when(ts: float) -> str:
        return datetime.fromtimestamp(ts, UTC).strftime("%m-%d %H:%M")

    raised: set[tuple] = set()
    for d in decisions:
        if d.kind != "prediction":
            continue
        who = (d.type, d.node, d.gpu, d.job, d.rank)
        if not d.alert:
            raised.discard(who)
            continue
        if who in raised:
            continue
        raised.add(who)
        value = f"{d.factor:.2f}" if d.type == "straggler" and d.factor else f"{d.probability:.2f}"
        sig = ", ".join(f"{s.name}={s.value}" for s in d.signals[:2])
        job = f"{d.job}/{d.rank}" if d.job else "-"
        where = f"{d.node}/{d.gpu if d.gpu is not None else '*'}"
        alerts.add_row(when(d.ts), d.type, where, job, value, sig[:60])
    console.print(alerts)
    commands = Table("time (UTC)", "command", "target", "reason", title="Commands (signed, idempotent)")
    for d in decisions:
        if d.kind == "command":
            commands.add_row(when(d.ts), d.type, f"{d.job or '-'} {d.node}/{d.gpu}", d.reason[:70])
    console.print(commands)

    # 5. How the decisions compare with what was injected.
    console.rule("[bold]5. Backtest against the injected ground truth")
    n_gpus = sum(len(inv.gpus) for inv in inventories)
    job_span: dict[str, list[float]] = {}
    for fv in runtime.bus.records(T.FEATURES.name):
        if fv.scope == "rank" and fv.job:  # type: ignore[attr-defined]
            span = job_span.setdefault(fv.job, [fv.ts, fv.ts])  # type: ignore[attr-defined]
            span[1] = fv.ts
    failure = runtime.control.failure
    metrics = score_all(
        decisions, labels, gpu_days=n_gpus * config.days,
        horizon_h=failure.model.horizon_h if failure is not None else 24.0,
        job_hours=sum(b - a for a, b in job_span.values()) / 3600.0,
    )
    scorecard = Table("metric", "value", "target (issue)")
    for row in metrics_rows(metrics):
        scorecard.add_row(*row)
    console.print(scorecard)
    _demo_trends(runtime.control.trend_rows, decisions)
    report = out_dir / "report.html"
    _write_report(report, decisions, labels_path, runtime.control.trend_rows)
    _demo_actions(runtime, decisions, plan, inventories, trace, when)
    _demo_kube(plan, decisions, out_dir)
    if not no_training:
        _demo_training(out_dir)
    console.rule("[bold]Files")
    for path in (plan_png, trace, labels_path, decisions_path, trends_path, report):
        console.print(f"  {path}")


def _demo_trends(rows: list, decisions: list) -> None:
    """Thermal headroom and utilisation per site and rack: the last hour, with its trends."""
    from rich.table import Table

    console.rule("[bold]Thermal headroom and utilisation per site and rack")
    last = {(r.scope, r.name): r for r in rows}
    table = Table("where", "GPUs", "now", "at full power", "hottest GPU", "drift/day", "util %",
                  title="Last hour: headroom (C) to the thermal limit, least first (6 h trend per hour)",
                  title_justify="left")
    for col in (table.columns[0], table.columns[4]):
        col.no_wrap = True

    def with_trend(value: float | None, trend: float | None, fmt: str) -> str:
        if value is None:
            return "-"
        return f"{value:{fmt}}" + ("" if trend is None else f" ({trend:+.2f})")

    order = sorted(last.values(), key=lambda r: (r.scope != "site", r.headroom_at_tdp_min_c is None,
                                                r.headroom_at_tdp_min_c or 0.0))
    for r in order:
        table.add_row(r.name, str(r.gpus), "-" if r.headroom_min_c is None else f"{r.headroom_min_c:.1f}",
                      with_trend(r.headroom_at_tdp_min_c, r.headroom_trend_c_per_h, ".1f"), r.hottest or "-",
                      "-" if r.drift_mean_c_per_day is None else f"{r.drift_mean_c_per_day:+.2f} C",
                      with_trend(r.util_mean_pct, r.util_trend_pct_per_h, ".0f"))
    console.print(table)
    warned = sorted({f"{d.node}/{d.gpu}" for d in decisions
                     if d.kind == "prediction" and d.type == "thermal"})
    console.print(f"GPUs warned of running out of headroom at full power within a day (`thermal` "
                  f"predictions): {', '.join(warned) if warned else 'none'}")


def _demo_training(out_dir: Path) -> None:
    """Training plugin: three real torch processes (gloo, CPU) train with the plugin; one slows
    2x mid-run, the embedded control plane flags it from their step records and sends a signed
    rebalance, and the plugin applies it live at a step boundary on every rank."""
    from rich.table import Table

    try:
        import torch  # noqa: F401
    except ImportError:
        console.print("torch is not installed (extra `train`): skipping the live rebalance")
        return
    from fleetwise.training.example import run_job

    console.rule("[bold]Training plugin: a live rebalance of real torch processes (3 ranks, gloo, CPU)")
    slow_at, steps, per_sample = 8, 24, 0.008
    console.print(f"3 ranks x 16 samples; node-2 becomes 2x slower at step {slow_at} (emulated: a sleep per "
                  "sample); the embedded control plane reads their step records ...", highlight=False)
    run = run_job(out_dir / "training", "demo-train", [16, 16, 16], steps, per_sample,
                  [f"node-2:2.0@{slow_at}"], control=True, timeout_s=120)
    st = run["step_time"]
    done = [a for a in run["acks"] if a.status == "done" and a.command_id.startswith("rebalance")]
    at = done[0].step if done else None
    table = Table("steps", "shares (samples per rank)", "median step (ms)",
                  title="Step time before and after")

    def row(label: str, lo: int, hi: int) -> None:
        if hi > lo:
            window = sorted(st[lo:hi])
            table.add_row(label, str(run["shares"][lo]), f"{window[len(window) // 2] * 1e3:.0f}")

    row(f"2-{slow_at - 1}: all ranks equal", 2, slow_at)
    row(f"{slow_at}-{(at or steps) - 1}: node-2 2x slower", slow_at, at or steps)
    if at is not None:
        row(f"{at + 1}-{steps - 1}: after the live rebalance", at + 1, steps)
    console.print(table)
    for cmd in run["commands"]:
        console.print(f"command {cmd.id} ({cmd.type}, seq {cmd.seq}, signed {cmd.key_id}): {cmd.reason}",
                      highlight=False)
    console.print("acks: " + ", ".join(f"{a.command_id} {a.status} at step {a.step}" for a in run["acks"]),
                  highlight=False)


def _demo_kube(plan: Any, decisions: list, out_dir: Path) -> None:
    """Kubernetes: the KAI objects for the demo job, and the KAI consumer's dry-run API calls
    for the demo's drain (no cluster needed: `fleetwise kube consumer --dry-run`)."""
    from rich.table import Table

    from fleetwise.kube.consumer import DryRunApi, KubeConsumer
    from fleetwise.kube.render import dump_yaml, render_plan
    from fleetwise.schemas import Ack

    console.rule(f"[bold]10. Kubernetes: KAI Scheduler objects for {plan.job}, and the drain as API calls")
    objects = render_plan(plan, plan.job, "default")
    path = out_dir / "kai-objects.yaml"
    _write_output(path, dump_yaml(objects), "KAI objects")
    pg = next(o for o in objects if o["kind"] == "PodGroup")
    table = Table("kind", "name", "GPU product", "GPUs", title=f"kubectl apply -f {path}")
    for o in objects:
        spec = o.get("spec", {})
        product = spec.get("nodeSelector", {}).get("nvidia.com/gpu.product", "")
        gpus = spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] if o["kind"] == "Pod" else ""
        table.add_row(o["kind"], o["metadata"]["name"], product, gpus)
    console.print(table)
    subgroups = ", ".join(f"{s['name']}={s['minMember']}" for s in pg["spec"]["subGroups"])
    console.print(f"PodGroup {pg['metadata']['name']}: gang of {pg['spec']['minMember']} pods, subGroups "
                  f"{subgroups}", highlight=False)
    drain = next((d for d in decisions if d.kind == "command" and d.type == "drain" and d.job == plan.job),
                 next((d for d in decisions if d.kind == "command" and d.type == "drain"), None))
    if drain is None:
        console.print("no drain in this replay: nothing for the KAI consumer to do")
        return
    calls: list[str] = []
    consumer = KubeConsumer(DryRunApi(out=calls.append), clock=lambda: drain.ts)
    acks = consumer.on_command(drain)
    for cid in drain.requires:  # the training side's checkpoint is done: evictions may go
        acks += consumer.on_ack(Ack(command_id=cid, ts=drain.ts, by="training-plugin", status="done"))
    console.print(f"drain {drain.id} of {drain.node}/gpu{drain.gpu} ({drain.job or 'no job'}), dry run:",
                  highlight=False)
    for line in calls:
        console.print(f"  {line[:400]}", highlight=False, soft_wrap=True)
    console.print("acks: " + ", ".join(f"{a.status}" + (f" ({a.detail})" if a.detail else "") for a in acks),
                  highlight=False)


def _demo_actions(runtime: Any, decisions: list, plan: Any, inventories: list, trace: Path,
                  when: Any) -> None:
    """The demo's acting half: fleet state from acks, a drain in the main job with its resize
    and plan diff, a placement for a new job, a consolidation at low load."""
    from rich.table import Table

    from fleetwise.schemas import Prediction
    from fleetwise.schemas import topics as T
    from fleetwise.streams.embedded import EmbeddedRuntime, SimulatedConsumers
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    # 6. Fleet state: what the consumers acknowledged.
    console.rule("[bold]6. Fleet state from the consumers' acks (simulated consumers in a replay)")
    policy = runtime.control.policy
    drains = [d for d in decisions if d.kind == "command" and d.type == "drain"]
    state = Table("GPU", "status", "since (UTC)", "drains sent", "by command", title="GPUs out of service")
    for (node, gpu), g in sorted(policy.fleet.gpus.items()):
        if g.status != "in_service":
            sent = sum(1 for d in drains if (d.node, d.gpu) == (node, gpu))
            state.add_row(f"{node}/{gpu}", g.status, when(g.since_ts), str(sent), g.command_id or "-")
    console.print(state)
    events: dict[str, int] = {}
    for e in runtime.audit_events():
        events[e.event] = events.get(e.event, 0) + 1
    console.print(f"audit events (rails that held something back, expiries): {events or 'none'}")

    # 7. A failure alert inside the main job: checkpoint -> drain -> resize, re-planned.
    alert = next((d for d in decisions if isinstance(d, Prediction) and d.type == "failure" and d.alert
                  and any((r.node, r.gpu) == (d.node, d.gpu) for r in plan.ranks)), None)
    if alert is not None:
        console.rule(f"[bold]7. The alert on {alert.node}/gpu{alert.gpu} inside {plan.job}: "
                     "checkpoint, drain, resize")
        rank = next(r.rank for r in plan.ranks if (r.node, r.gpu) == (alert.node, alert.gpu))
        config = ControlPlaneConfig(failure_predictor=False, straggler_detector=False, publish_features=False)
        acting = EmbeddedRuntime(ControlPlane(config), consumers=SimulatedConsumers())
        acting.feed(T.INVENTORY.name, inventories)
        acting.feed(T.PLANS.name, [plan])
        acting.feed(T.PREDICTIONS.name, [alert.model_copy(update={"job": plan.job, "rank": rank})])
        chain = Table("seq", "command", "requires", "acked", "reason")
        acks = {a.command_id: a.status for a in acting.bus.records(T.ACKS.name)}
        resize = None
        for c in acting.decisions():
            if c.kind == "command":
                chain.add_row(str(c.seq), f"{c.type} {c.id}", ", ".join(c.requires) or "-",
                              acks.get(c.id, "-"), c.reason[:60])
                resize = c if c.type == "resize" else resize
        console.print(chain)
        if resize is not None and resize.params.get("plan_diff"):
            p = resize.params
            console.print(f"re-planned: {plan.dp}x{plan.tp}x{plan.pp} (dp x tp x pp) -> "
                          f"{p['strategy']['dp']}x{p['strategy']['tp']}x{p['strategy']['pp']}, "
                          f"predicted step {p['predicted_step_s']['before']:.3f} s -> "
                          f"{p['predicted_step_s']['after']:.3f} s")
            diff = Table("GPU", "before (micro-batch x count, dp rank)", "after", title="Plan diff per GPU")

            def part(v: dict | None) -> str:
                if v is None:
                    return "left"
                return f"{v['micro_batch']} x {v['num_micro_batches']}, dp {v['dp_rank']}"
            for d in p["plan_diff"][:12]:
                diff.add_row(f"{d['node']}/{d['gpu']}", part(d["before"]), part(d["after"]))
            if len(p["plan_diff"]) > 12:
                diff.add_row("...", f"{len(p['plan_diff']) - 12} more GPUs", "")
            console.print(diff)

    # 7b. A node joins: the job grows to its intent's maximum (the plan carries the intent).
    _demo_growth(plan, inventories)

    # 8. Placement of a new job over the fleet (what is in service now).
    console.rule("[bold]8. Placement of a new job")
    from fleetwise.planner import resolve_model
    from fleetwise.planner.placement import PlacementError, PlacementSettings, place_job
    from fleetwise.schemas import JobConstraints, JobIntent

    out = policy.fleet.out_of_service()
    in_service = [inv.model_copy(update={"gpus": [g for g in inv.gpus if (inv.node, g.index) not in out]})
                  for inv in inventories]
    intent = JobIntent(job="demo-new", model=resolve_model("llama-7b"), global_batch=256,
                       constraints=JobConstraints(min_gpus=8, max_gpus=8))
    try:
        # The demo fleet has one rack per GPU type and site: a job may fill a rack here.
        result = place_job(intent, in_service, settings=PlacementSettings(max_rack_share=1.0))
    except PlacementError as exc:
        console.print(f"no placement: {exc}")
    else:
        ranked = Table("#", "site", "GPU", "nodes", "step s", "largest cost terms (weighted)", "total",
                       title=f"{intent.job}: llama-7b on 8 GPUs, options ranked "
                       "(every term: fleetwise place --json)")
        for opt in result.options[:5]:
            top = sorted(opt.weighted.items(), key=lambda kv: -kv[1])[:3]
            ranked.add_row(str(opt.rank), opt.site, opt.gpu_type, str(opt.nodes), f"{opt.step_s:.3g}",
                           ", ".join(f"{k} {v:.2f}" for k, v in top), f"{opt.total:.3f}")
        console.print(ranked)

    # 9. Consolidation at low load: the quietest hour of the trace.
    console.rule("[bold]9. Consolidation at low load")
    _demo_consolidation(trace, in_service, when, policy.config)


def _demo_growth(plan: Any, inventories: list) -> None:
    """A second job on a node the main job leaves free, planned from an intent that allows 8 more
    GPUs; a node of 8 GPUs of that model joins; the policy re-plans the job over them and, since
    that pays, grows it (a resize, acked by the simulated consumers)."""
    from fleetwise.planner import (
        InfeasiblePlanError,
        PlanRequest,
        cluster_from_inventory,
        plan_job,
        resolve_model,
    )
    from fleetwise.schemas import GpuInventory, JobConstraints, NodeInventory
    from fleetwise.schemas import topics as T
    from fleetwise.streams.embedded import EmbeddedRuntime, SimulatedConsumers
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    used = {r.node for r in plan.ranks}
    host = next((inv for inv in inventories if inv.node not in used), None)
    if host is None:
        return
    model = host.gpus[0].model
    console.rule(f"[bold]7b. A node of 8 {model} joins: a job grows to its intent's maximum")
    try:
        elastic = plan_job(PlanRequest(model=resolve_model("llama-7b"), global_batch=256, job="demo-elastic",
                                       dtype="fp16",  # every generation has it (V100s have no bf16)
                                       constraints=JobConstraints(max_gpus=len(host.gpus) + 8)),
                           cluster_from_inventory([host]))
    except InfeasiblePlanError as exc:
        console.print(f"no plan for llama-7b on {host.node}: {exc}")
        return
    joining = NodeInventory(ts=max(inv.ts for inv in inventories) + 3600, node="node-joining", rack=host.rack,
                            site=host.site, gpus=[GpuInventory(index=g, model=model) for g in range(8)])
    config = ControlPlaneConfig(failure_predictor=False, straggler_detector=False, publish_features=False)
    acting = EmbeddedRuntime(ControlPlane(config), consumers=SimulatedConsumers())
    acting.feed(T.INVENTORY.name, inventories)
    acting.feed(T.PLANS.name, [plan, elastic])  # the main job's plan carries no intent: it keeps its size
    acting.feed(T.INVENTORY.name, [joining])
    grown = [c for c in acting.decisions() if c.kind == "command" and c.type == "resize"]
    held = [e.reason for e in acting.audit_events() if e.event == "not_grown"]
    console.print(f"{elastic.job}: llama-7b (fp16) on {len(elastic.ranks)} GPUs of {host.node} "
                  f"({elastic.dp}x{elastic.tp}x{elastic.pp} dp x tp x pp), intent's max_gpus "
                  f"{elastic.constraints.max_gpus}")
    for cmd in grown:
        p = cmd.params
        acks = [f"{a.by} {a.status}" for a in acting.bus.records(T.ACKS.name) if a.command_id == cmd.id]
        console.print(f"resize {cmd.id} (seq {cmd.seq}; {', '.join(acks)}): {cmd.reason}")
        console.print(f"joining: {', '.join(f'{n}/{g}' for n, g in p['join'])}; now "
                      f"{p['strategy']['dp']}x{p['strategy']['tp']}x{p['strategy']['pp']}; the job's plan "
                      f"has {len(acting.control.policy.jobs[cmd.job].plan['ranks'])} GPUs after the done ack")
    for reason in held:
        console.print(f"held back: {reason}")


def _demo_consolidation(trace: Path, inventories: list, when: Any, config: Any) -> None:
    """Plan a consolidation over the trace's quietest hour, as the policy would at its end:
    the same utilisation window, snapshot and thresholds (`config`: the policy's settings)."""
    import numpy as np

    from fleetwise.actuators.consolidation import ConsolidationConfig, ConsolidationError, plan_consolidation
    from fleetwise.actuators.moves import UtilisationWindow, consolidation_snapshot

    rows = [(float(o["ts"]), o["node"], int(o["gpu"]), float(o["metrics"]["DCGM_FI_DEV_GPU_UTIL"]),
             o.get("job"), o.get("rank"))
            for o in _iter_jsonl(trace) if o.get("metrics", {}).get("DCGM_FI_DEV_GPU_UTIL") is not None]
    if not rows:
        console.print("no utilisation samples in the trace")
        return
    cons = config.consolidate
    hour = cons.sustained_s
    start = min(r[0] for r in rows)
    by_hour: dict[int, list[float]] = {}
    jobs_by_hour: dict[int, set[str]] = {}
    for ts, _node, _gpu, util, job, _rank in rows:
        h = int((ts - start) // hour)
        by_hour.setdefault(h, []).append(util)
        if job:
            jobs_by_hour.setdefault(h, set()).add(job)
    # The quietest full hour in which at least two jobs ran (there is something to pack).
    busy = [h for h in by_hour if h > 0 and len(jobs_by_hour.get(h, ())) >= 2] or [max(by_hour)]
    quiet = min(busy, key=lambda h: sum(by_hour[h]) / len(by_hour[h]))
    end = start + (quiet + 1) * hour
    window_rows = [r for r in rows if end - hour <= r[0] < end]
    window = UtilisationWindow(hour)
    window.observe([(r[1], r[2]) for r in window_rows], np.array([r[0] for r in window_rows]),
                   np.array([r[3] for r in window_rows]), [r[4] for r in window_rows],
                   [r[5] for r in window_rows])
    mean = sum(r[3] for r in window_rows) / len(window_rows) / 100.0
    snapshot = consolidation_snapshot(window, inventories, end, cons.utilisation_below * 100.0, (), ())
    if snapshot is None:
        console.print(f"hour ending {when(end)}: mean GPU utilisation {mean:.0%}; no node stayed below "
                      f"{cons.utilisation_below:.0%} all hour: nothing to consolidate")
        return
    settings = ConsolidationConfig(low_util_threshold=cons.utilisation_below, window_s=hour,
                                   max_moves=cons.max_moves)
    try:
        plan = plan_consolidation(snapshot, settings)
    except ConsolidationError as exc:
        console.print(f"consolidation not planned: {exc}")
        return
    console.print(f"hour ending {when(end)}: mean GPU utilisation {mean:.0%}, {len(snapshot.jobs)} jobs on "
                  f"nodes below {cons.utilisation_below:.0%}; {len(plan.moves)} job moves, "
                  f"{len(plan.hibernate)} nodes to hibernate "
                  f"({plan.active_nodes_before} -> {plan.active_nodes_after} nodes awake)")
    for move in plan.moves[:6]:
        console.print(f"  move {move.job}: {move.reason}", highlight=False)
    sv = plan.savings
    console.print(f"saved: {sv.watts_saved:,.0f} W, {sv.gpu_hours_saved:,.1f} GPU-hours and "
                  f"{sv.gco2_saved / 1000:,.1f} kg CO2 over {settings.horizon_h:g} h "
                  "(commands need an operator's approval by default: policy consolidate.mode)")


def _write_report(path: Path, decisions: list, labels: Path | None, trends: list) -> None:
    from fleetwise.predictors.report import replay_report_html

    label_rows = []
    if labels is not None:
        _existing([labels], "labels")
        label_rows = [json.loads(line) for line in labels.read_text().splitlines() if line.strip()]
    path.write_text(replay_report_html(decisions, label_rows, trends), encoding="utf-8")


# ---- policy, approvals, GPU returns ----------------------------------------------------------
def _load_policy(path: Path | None):  # -> PolicyConfig
    from fleetwise.actuators import PolicyConfig, PolicyFileError, parse_policy

    if path is None:
        return PolicyConfig()
    _existing([path], "policy")
    try:
        return parse_policy(path.read_text(), source=str(path))
    except PolicyFileError as exc:
        fail(str(exc))


def _keys(operators: bool, signs: bool):  # -> Keyring
    """A keyring from the environment: the command keys, or the operators' (`operators`);
    `signs`: the verb signs, so a keyring of public keys only is an error now rather than at
    its first record."""
    from fleetwise.actuators import KeyringError
    from fleetwise.actuators.signing import ENV_KEYS, ENV_OPERATOR_KEYS
    from fleetwise.streams.keys import keyring_from_env, operator_keyring_from_env

    what, var = ("operator keys", ENV_OPERATOR_KEYS) if operators else ("signing keys", ENV_KEYS)
    try:
        ring = operator_keyring_from_env() if operators else keyring_from_env()
    except KeyringError as exc:
        fail(f"{what}: {exc}")
    if signs and not ring.active:
        fail(f"{what} ({var}[_FILE]) hold only public keys {ring.ids()}: this verb signs, give it "
             "the private entry (ID=ed25519:...)")
    return ring


def _keyring(signs: bool = False):  # -> Keyring
    return _keys(operators=False, signs=signs)


def _operator_keys(signs: bool = False):  # -> Keyring
    return _keys(operators=True, signs=signs)


keys_app = typer.Typer(help="Signing keys (commands, operator actions, producers' identities).",
                       no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(
    key_id: str = typer.Argument(..., help="The new key's id (e.g. k2026-12: rotation keeps several)."),
) -> None:
    """Print a new Ed25519 key pair as keyring entries: the first line (private) goes only to the
    signers (workers: FLEETWISE_SIGNING_KEYS[_FILE]; operators: FLEETWISE_OPERATOR_KEYS[_FILE]),
    the second (public) to the verifiers (training plugin, kube consumer; workers for operator
    keys), which then hold no secret that can sign."""
    from fleetwise.actuators import generate_ed25519_entries

    if not key_id.strip() or any(c in key_id for c in "=,\n#"):
        fail(f"key id must be non-empty and without '=', ',', '#' or newlines; got {key_id!r}")
    private, public = generate_ed25519_entries(key_id.strip())
    print(private)
    print(public)


@keys_app.command("identity")
def keys_identity(
    identity: str = typer.Argument(..., help="node/NODE (an agent), job/JOB (a training job's plugin) "
                                   "or kube-consumer."),
) -> None:
    """Print a producer's own key (`ID=hex:<key>`, for its FLEETWISE_IDENTITY_KEY[_FILE]),
    derived from the identity master key in FLEETWISE_IDENTITY_MASTER_KEY[_FILE] that the workers
    hold. The producer can sign only as itself; the workers check every message."""
    from fleetwise.actuators import KeyringError
    from fleetwise.actuators.signing import JOB_PREFIX, KUBE_CONSUMER_IDENTITY, NODE_PREFIX, identity_key
    from fleetwise.streams.keys import identity_master_key_from_env

    ident = identity.strip()
    name = ident.removeprefix(NODE_PREFIX).removeprefix(JOB_PREFIX)
    if (ident != KUBE_CONSUMER_IDENTITY and not ident.startswith((NODE_PREFIX, JOB_PREFIX))) or not name \
            or any(c in ident for c in "=,;\n#"):
        fail(f"identity must be node/NODE, job/JOB or {KUBE_CONSUMER_IDENTITY}, without '=', ',', ';', '#' "
             f"or newlines; got {identity!r}")
    try:
        master = identity_master_key_from_env()
        if master is None:
            fail("set FLEETWISE_IDENTITY_MASTER_KEY or FLEETWISE_IDENTITY_MASTER_KEY_FILE (the workers' "
                 "identity master key) to derive a producer's key")
        print(f"{ident}=hex:{identity_key(master, ident).hex()}")
    except KeyringError as exc:
        fail(f"identity master key: {exc}")


policy_app = typer.Typer(help="Operator policy files: check one, or print the defaults.",
                         no_args_is_help=True)
app.add_typer(policy_app, name="policy")


@policy_app.command("check")
def policy_check(
    file: Path = typer.Argument(..., help="Policy file (YAML)."),
    as_json: bool = typer.Option(False, "--json", help="Print the policy in effect as JSON."),
) -> None:
    """Validate a policy file; errors name the field. Prints the policy in effect."""
    from fleetwise.actuators import policy_yaml

    config = _load_policy(file)
    if as_json:
        print_json(config.model_dump(mode="json"))
        return
    console.print(f"[green]ok[/] {file}: valid policy", highlight=False)
    console.print(policy_yaml(config), highlight=False, markup=False)


@policy_app.command("show")
def policy_show() -> None:
    """Print the default policy as YAML (a starting file: every field, with its default)."""
    from fleetwise.actuators import PolicyConfig, policy_yaml

    console.print(policy_yaml(PolicyConfig()), highlight=False, markup=False)


def _send_operator(action, bootstrap: str | None, prefix: str = "") -> None:  # action: OperatorAction
    """Sign an operator action with the operators' active key and publish it on
    fleetwise.operator, or print it (a replay input line)."""
    from fleetwise.actuators import sign

    action = sign(action, _operator_keys(signs=True))
    if bootstrap is None:
        print(action.to_json())
        return
    from fleetwise.schemas import topics as T
    from fleetwise.streams.kafka_io import record_key

    topic = _publish(bootstrap, T.OPERATOR, prefix, action, record_key)
    console.print(f"sent {action.action} to {topic} on {bootstrap}", highlight=False)


def _publish(bootstrap: str, topic, prefix: str, record, key) -> str:  # topic: Topic
    """Write one record (None: a tombstone) to a registry topic under the workers' prefix, or
    fail with the client's error; returns the topic name written."""
    from fleetwise.streams.kafka_io import produce_records, run, topic_name

    name = topic_name(topic, prefix)
    try:
        run(produce_records(bootstrap, name, [record], key=key))
    except Exception as exc:  # noqa: BLE001 - any client error is reported, not raised
        fail(f"could not publish to {bootstrap}: {exc}")
    return name


_OPERATOR_BOOTSTRAP = typer.Option(None, "--bootstrap", envvar="FLEETWISE_BOOTSTRAP",
                                   help="Kafka bootstrap; without it the record is printed (append it "
                                   "to a replay trace).")
# The workers' --topic-prefix (Helm: kafka.topicPrefix): the topics these verbs write are theirs.
_TOPIC_PREFIX = typer.Option("", "--topic-prefix", envvar="FLEETWISE_TOPIC_PREFIX",
                             help="Prefix of every topic name, as the workers run with.")


def _operator_ts(ts: str | None) -> float:
    import time

    from fleetwise.schemas import parse_timestamp

    if ts is None:
        return time.time()
    try:
        return parse_timestamp(ts)
    except ValueError as exc:
        fail(f"--ts: {exc}")


@app.command("approve")
def approve(
    command_id: str = typer.Argument(..., help="The held command's id (its awaiting_approval audit event)."),
    bootstrap: str | None = _OPERATOR_BOOTSTRAP,
    by: str = typer.Option("operator", "--by", help="Who approves (kept in the audit)."),
    ts: str | None = typer.Option(None, "--ts", help="Event time (Unix s or RFC 3339; default now)."),
    deny: bool = typer.Option(False, "--deny", help="Deny it instead."),
    topic_prefix: str = _TOPIC_PREFIX,
) -> None:
    """Approve (or --deny) a command the policy holds for approval."""
    from fleetwise.schemas import OperatorAction

    _send_operator(OperatorAction(ts=_operator_ts(ts), action="deny" if deny else "approve",
                                  command_id=command_id, by=by), bootstrap, topic_prefix)


gpu_app = typer.Typer(help="Operator actions on GPUs.", no_args_is_help=True)
app.add_typer(gpu_app, name="gpu")


@gpu_app.command("return")
def gpu_return(
    target: str = typer.Argument(..., help="NODE/GPU, e.g. node-003/5."),
    bootstrap: str | None = _OPERATOR_BOOTSTRAP,
    by: str = typer.Option("operator", "--by", help="Who returns it (kept in the audit)."),
    reason: str = typer.Option("", "--reason", help="Why (e.g. the RMA ticket)."),
    ts: str | None = typer.Option(None, "--ts", help="Event time (Unix s or RFC 3339; default now)."),
    topic_prefix: str = _TOPIC_PREFIX,
) -> None:
    """Bring a drained GPU back into service (it rejoins later plans)."""
    from fleetwise.schemas import OperatorAction

    node, sep, gpu = target.rpartition("/")
    if not sep or not node or not gpu.isdigit():
        fail(f"target must be NODE/GPU with a GPU index, e.g. node-003/5; got {target!r}")
    _send_operator(OperatorAction(ts=_operator_ts(ts), action="return_gpu", node=node, gpu=int(gpu),
                                  by=by, reason=reason), bootstrap, topic_prefix)


job_app = typer.Typer(help="The jobs the control plane knows.", no_args_is_help=True)
app.add_typer(job_app, name="job")


@job_app.command("start")
def job_start(
    plan_file: Path | None = typer.Option(
        None, "--plan", help="The job's plan (fleetwise plan --format json)."),
    intent_file: Path | None = typer.Option(
        None, "--intent", help="A job intent (YAML/JSON, as for `fleetwise place`); planned over --gpus, "
        "its constraints (max_gpus: how far the job may grow) carried in the plan."),
    gpus: str | None = typer.Option(
        None, "--gpus", help="With --intent: 'h100-sxm:16,b200:16' or an inventory."),
    job: str | None = typer.Option(None, "--job", help="Job name (default: the plan's / intent's)."),
    bootstrap: str | None = typer.Option(None, "--bootstrap", envvar="FLEETWISE_BOOTSTRAP",
                                         help="Kafka bootstrap; without it the plan is printed as one "
                                         "line (append it to a replay trace)."),
    topic_prefix: str = _TOPIC_PREFIX,
) -> None:
    """Start a job for the control plane: its plan under the job's key on the compacted
    fleetwise.plans (the workers learn its ranks, shares, layers and intent from it). A new plan
    under the same name replaces the old one; `fleetwise job end` withdraws it."""
    from fleetwise.schemas import topics as T

    plan, name, _queue = _plan_or_intent(plan_file, intent_file, gpus, job)
    plan = plan.model_copy(update={"job": name})
    if bootstrap is None:
        print(plan.to_json())
        return
    topic = _publish(bootstrap, T.PLANS, topic_prefix, plan, plan.job)
    console.print(f"started job {plan.job} ({len(plan.ranks)} GPUs): plan on {topic} on {bootstrap}",
                  highlight=False)


@job_app.command("end")
def job_end(
    job: str = typer.Argument(..., help="The job's name (the key of its plan on fleetwise.plans)."),
    bootstrap: str | None = typer.Option(None, "--bootstrap", envvar="FLEETWISE_BOOTSTRAP",
                                         help="Kafka bootstrap; without it the job_end record is printed "
                                         "(append it to a replay trace)."),
    ts: str | None = typer.Option(None, "--ts", help="Event time of the printed record (Unix s or RFC 3339; "
                                  "default now). A tombstone carries none."),
    topic_prefix: str = _TOPIC_PREFIX,
) -> None:
    """End a job: withdraw its plan (a tombstone under its key on fleetwise.plans). The control
    plane then forgets the job, and the kube consumer its command sequence."""
    from fleetwise.schemas import JobEnd
    from fleetwise.schemas import topics as T

    if not job.strip():
        fail("JOB must not be empty")
    if bootstrap is None:
        print(JobEnd(job=job, ts=_operator_ts(ts)).to_json())
        return
    topic = _publish(bootstrap, T.PLANS, topic_prefix, None, job)
    console.print(f"ended job {job}: tombstone on {topic} on {bootstrap}", highlight=False)


# ---- predictor -------------------------------------------------------------------------------
predictor_app = typer.Typer(help="Failure predictor: reproducible training.", no_args_is_help=True)
app.add_typer(predictor_app, name="predictor")

# Fleet mixes of plain-simulator training (`--family none`; the previous packaged model's).
TRAIN_MIXES = "h100-sxm:64,a100-sxm-80gb:64;h200:64,a100-sxm-80gb:32,h100-sxm:32;a100-sxm-80gb:96,h200:32"
# Defaults of `fleetwise predictor train`: they reproduce the packaged model (its metadata has
# the exact command); the alert policy is the one tuned for it (bench/failure_eval.py --tune).
TRAIN_FAMILY: str | None = "train"
TRAIN_SEEDS = "0,1,2,3,4,5,6,7,8,9,10,11"
TRAIN_DAYS = 5.0
TRAIN_INTERVALS = "60,120,300"  # of the randomised family's traces (the plain simulator: 60,120,300,120)


def _iter_jsonl(path: Path):  # noqa: ANN202 - Iterator[dict]
    import gzip

    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as exc:
                fail(f"{path}:{lineno}: not valid JSON ({exc.msg})")


def _read_jsonl(path: Path) -> list[dict]:
    return list(_iter_jsonl(path))


def _sim_trace(mix: str, days: float, seed: int, failure_rate: float, interval: float,  # noqa: ANN202
               cache: Path | None = None, family: str | None = None):
    """Raw samples and labels of one simulator trace (with `family`, member `seed` of that
    configuration family, fleetwise.sim.randomize); with `cache`, the raw sample arrays and
    labels are kept there (same config -> same file), so a retrain skips the simulation."""
    import numpy as np

    from fleetwise.predictors.training import RawSamples, raw_samples
    from fleetwise.sim import FleetSimulator, SimConfig, SimConfigError
    from fleetwise.sim.randomize import family_config, family_key

    if family:
        name = family_key(family, seed, mix, days, failure_rate, interval)
    else:
        name = f"{mix.replace(':', 'x').replace(',', '_')}-d{days:g}-s{seed}-r{failure_rate:g}-i{interval:g}"
    if cache is not None and (cache / f"{name}.npz").exists() and (cache / f"{name}.labels.json").exists():
        d = np.load(cache / f"{name}.npz")
        raw = RawSamples(json.loads(str(d["meta"])), d["slots"], d["ts"], d["rows"])
        return raw, json.loads((cache / f"{name}.labels.json").read_text())
    try:
        if family:
            config = family_config(family, seed, days=days, failure_rate=failure_rate, gpus=mix or None,
                                   interval_s=interval or None)
        else:
            config = SimConfig(gpus=mix, days=days, seed=seed, sample_interval_s=interval,
                               failure_rate_per_1000_gpu_days=failure_rate)
        sim = FleetSimulator(config)
    except (SimConfigError, ValueError) as exc:
        fail(f"--mixes {mix!r}: {exc}")
    raw = raw_samples(s for tick in sim.ticks() for s in tick.samples)
    labels = sim.labels()
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        np.savez(cache / f"{name}.npz", meta=json.dumps(raw.meta), slots=raw.slots, ts=raw.ts, rows=raw.rows)
        (cache / f"{name}.labels.json").write_text(json.dumps(labels))
    return raw, labels


def _trace_samples(trace: Path, steps=None, window: tuple[float | None, float | None] = (None, None)):  # noqa: ANN001,ANN202
    """GPU samples of a trace file (sample lines and node batches); step records go to `steps`
    (a list, or a backtest's StepStream: anything with `append`). With a `window` (since, until),
    only records with since <= ts < until (a record whose ts is not a number passes, for the
    reader to name)."""
    since, until = window

    def inside(r: dict) -> bool:
        if since is None and until is None:
            return True
        try:
            t = float(r["ts"])
        except (KeyError, TypeError, ValueError):
            return True
        return (since is None or t >= since) and (until is None or t < until)

    for r in _iter_jsonl(trace):
        if "metrics" in r:
            if inside(r):
                yield r
        elif "samples" in r and isinstance(r["samples"], list):
            yield from (s for s in r["samples"] if not isinstance(s, dict) or inside(s))
        elif "step_time_s" in r and steps is not None and inside(r):
            steps.append(r)


def _time_window(since: str | None, until: str | None) -> tuple[float | None, float | None]:
    """--since / --until (Unix seconds or RFC 3339 with an offset) -> Unix seconds."""
    from fleetwise.schemas import parse_timestamp

    out: list[float | None] = []
    for flag, text in (("--since", since), ("--until", until)):
        if text is None:
            out.append(None)
            continue
        try:
            out.append(float(text))
        except ValueError:
            try:
                out.append(parse_timestamp(text))
            except ValueError as exc:
                fail(f"{flag}: {exc}")
    if out[0] is not None and out[1] is not None and out[0] >= out[1]:
        fail(f"--since ({since}) must be before --until ({until})")
    return out[0], out[1]


def _operator_labels(path: Path) -> list[dict]:
    from fleetwise.predictors.training import LabelError, labels_from_records

    try:
        return labels_from_records(_read_jsonl(path), source=str(path))
    except LabelError as exc:
        fail(str(exc))


def _parse_policy(text: str | None, base=None):  # noqa: ANN001,ANN202 - AlertPolicy | None
    """`--policy` -> an AlertPolicy (`policy_from_spec` over `base`), None when not given."""
    from fleetwise.predictors.failure import policy_from_spec

    if not text:
        return None
    try:
        return policy_from_spec(text, base)
    except ValueError as exc:
        fail(f"--policy: {exc}")


@predictor_app.command("train")
def predictor_train(
    out_dir: Path = typer.Option(Path("fleetwise/predictors/models"), "--out-dir", help="Model folder."),
    seeds: str = typer.Option(TRAIN_SEEDS,
                              help="Simulator seeds (with --family: member indices), comma-separated "
                              "(one trace per seed)."),
    mixes: str | None = typer.Option(None, help="Fleet mixes, ';'-separated, used round-robin over seeds "
                                     "(default: the family's own mixes, or the legacy training mixes)."),
    days: float = typer.Option(TRAIN_DAYS, min=1.0, help="Days per training trace."),
    failure_rate: float = typer.Option(40.0, help="Failures per 1,000 GPU-days in training traces."),
    intervals: str | None = typer.Option(None, "--interval", "--intervals",
                                         help="Sample interval(s) of training traces, s; comma-separated, "
                                         "round-robin (default: 60,120,300 for a family, 0 = the family's "
                                         "own; 60,120,300,120 for the plain simulator)."),
    family: str | None = typer.Option(TRAIN_FAMILY, "--family",
                                      help="Configuration family of fleetwise.sim.randomize ('train'), or "
                                      "'none' for the plain simulator."),
    trace: list[Path] = typer.Option([], "--trace", help="Your own telemetry (.jsonl[.gz] of GPU samples); "
                                     "repeat for several. Replaces the simulator (see --with-simulator)."),
    with_simulator: bool = typer.Option(False, "--with-simulator", help="With --trace: fit on your traces "
                                        "and on the simulator's (--seeds, --family ...) together, for a "
                                        "fleet with few failures of its own."),
    labels: list[Path] = typer.Option([], "--labels", help="Failure records for each --trace, in order "
                                      "(docs/predictors.md: labels file)."),
    policy: str | None = typer.Option(None, "--policy", help="Alert policy 'hi,k,k_memory[,hi_memory]' "
                                      "to store with the model (choose it with `fleetwise backtest "
                                      "--choose-policy`)."),
    model_alerts: bool | None = typer.Option(None, "--model-alerts/--rules-only", help="Store a policy "
                                             "in which the model raises alerts beside the rules, or the "
                                             "rules alone (default: both, as the packaged policy; "
                                             "--rules-only where a backtest on your fleet shows the model "
                                             "does not pay)."),
    fit_seed: int = typer.Option(0, help="Seed of the model fit (subsampling, calibration split)."),
    cache: Path | None = typer.Option(None, "--cache", help="Keep simulated traces here (raw arrays; "
                                      "a rerun with the same settings skips the simulation)."),
    since: str | None = typer.Option(None, "--since", help="With --trace: read only records at or after "
                                     "this time (Unix seconds or RFC 3339 with an offset)."),
    until: str | None = typer.Option(None, "--until", help="With --trace: read only records before this "
                                     "time (the training part of a fleet's history split by time)."),
) -> None:
    """Fit the failure model on simulator traces (a randomised family by default) or on your own
    telemetry and failure records (--trace/--labels), and write it to OUT_DIR."""
    import time
    from dataclasses import asdict, replace

    import numpy as np

    from fleetwise.predictors.training import fit_failure_model, training_rows

    family = None if family in (None, "", "none") else family
    chosen = _parse_policy(policy)
    if (since or until) and not trace:
        fail("--since / --until select part of your own --trace; the simulator's traces are whole")
    if with_simulator and not trace:
        fail("--with-simulator adds the simulator's traces to your --trace files: give --trace and --labels")
    window = _time_window(since, until)
    if len(trace) != len(labels):
        fail(f"give one --labels file per --trace ({len(trace)} traces, {len(labels)} labels files)")
    _existing([*trace, *labels], "file")
    try:
        seed_list = [int(s) for s in seeds.split(",") if s.strip()]
    except ValueError:
        fail(f"--seeds must be comma-separated integers, got {seeds!r}")
    if family:
        from fleetwise.sim.randomize import FAMILIES

        if family not in FAMILIES:
            fail(f"--family {family!r}: unknown; known: {', '.join(sorted(FAMILIES))}")
    mix_list = [m.strip() for m in (mixes or ("" if family else TRAIN_MIXES)).split(";") if m.strip()] or [""]
    try:
        intervals = intervals or (TRAIN_INTERVALS if family else "60,120,300,120")
        interval_list = [float(v) for v in intervals.split(",") if v.strip()]
    except ValueError:
        fail(f"--interval must be comma-separated numbers of seconds, got {intervals!r}")
    if not interval_list or min(interval_list) < 0 or (not family and min(interval_list) <= 0):
        fail(f"--interval must be positive seconds, got {intervals!r}")
    if (with_simulator or not trace) and not seed_list:
        fail("need at least one seed (or --trace with --labels)")
    xs, ys, hours, groups = [], [], [], []
    offset, started, n_fail = 0, time.time(), 0

    def add(source, label_list, what: str) -> None:  # noqa: ANN001 - RawSamples or sample dicts
        # The rows a fit reads, labelled chunk by chunk: a trace's samples and its full feature
        # table are never held (a 30-day fleet's would not fit).
        nonlocal offset, n_fail
        try:
            rows = training_rows(source, label_list)
        except ValueError as exc:
            fail(f"{what}: {exc}")
        if rows.hops == 0:
            fail(f"{what}: no GPU samples")
        xs.append(rows.x)
        ys.append(rows.y)
        hours.append(rows.hours_to_failure)
        groups.append(rows.groups + offset)
        offset += rows.gpus
        n_fail += sum(1 for x in label_list if x.get("kind") == "failure")
        console.print(f"{what}: {rows.samples:,} samples, {rows.hops:,} GPU-hops, "
                      f"{int(rows.y.sum())} positive hops used")

    for tr, lb in zip(trace, labels, strict=True):
        add(_trace_samples(tr, window=window), _operator_labels(lb), f"{tr.name} ({lb.name})")
    if with_simulator or not trace:
        for i, seed in enumerate(seed_list):
            mix = mix_list[i % len(mix_list)]
            interval = interval_list[i % len(interval_list)]
            raw, label_list = _sim_trace(mix, days, seed, failure_rate, interval, cache, family)
            add(raw, label_list, f"seed {seed} ({family or 'plain'}{', ' + mix if mix else ''}"
                f"{f', {interval:g} s' if interval else ''})")
    y_all = np.concatenate(ys)
    if y_all.sum() < 5:
        fail(f"only {int(y_all.sum())} positive GPU-hops: the labels name too few failures of GPUs in the "
             "trace (docs/predictors.md: how much data)")
    import sklearn

    from fleetwise.predictors.failure import MODEL_FEATURES, feature_schema_hash

    if trace and not with_simulator:
        command = ("fleetwise predictor train --out-dir {} {}".format(out_dir, " ".join(
            f"--trace {t} --labels {lb}" for t, lb in zip(trace, labels, strict=True))))
    else:
        command = (f"fleetwise predictor train --out-dir {out_dir} --seeds {seeds} "
                   f"--family {family or 'none'} " + (f"--mixes '{mixes}' " if mixes else "")
                   + f"--days {days} --failure-rate {failure_rate} "
                   + (f"--interval {intervals} " if intervals else "") + f"--fit-seed {fit_seed}")
        if trace:
            command += " --with-simulator " + " ".join(
                f"--trace {t} --labels {lb}" for t, lb in zip(trace, labels, strict=True))
    if trace:
        command += (f" --since {since}" if since else "") + (f" --until {until}" if until else "")
    if policy:
        command += f" --policy {policy}"
    meta = {"version": f"1.2+{feature_schema_hash(MODEL_FEATURES)[:8]}.s{fit_seed}",
            "training_command": command, "seeds": seed_list if with_simulator or not trace else [],
            "family": family,
            "mixes": mix_list, "days": days, "failure_rate_per_1000_gpu_days": failure_rate,
            "sample_interval_s": interval_list, "traces": [str(t) for t in trace],
            "fit_seed": fit_seed, "failures_in_training": n_fail, "sklearn": sklearn.__version__}
    model = fit_failure_model(np.vstack(xs), y_all, np.concatenate(hours),
                              np.concatenate(groups), seed=fit_seed, metadata=meta)
    model.policy = chosen or model.policy  # the fit's: AlertPolicy(), the packaged model's tuned policy
    if model_alerts is not None:
        command += " --model-alerts" if model_alerts else " --rules-only"
        model.metadata["training_command"] = command
        model.policy = replace(model.policy, model_alerts=model_alerts)
    model_path, meta_path = model.save(out_dir, {"rows": int(sum(len(y) for y in ys)),
                                                 "policy_source": policy or "default"})
    size_kb = model_path.stat().st_size / 1024
    console.print(f"model -> {model_path} ({size_kb:.0f} KiB), metadata -> {meta_path} "
                  f"in {time.time() - started:.0f} s; policy {asdict(model.policy)}")


@app.command("backtest")
def backtest_cmd(
    trace: Path = typer.Option(..., "--trace", help="Trace (.jsonl / .jsonl.gz) of GPU samples and steps."),
    labels: Path = typer.Option(..., "--labels", help="Simulator labels, or your own failure records "
                                "(.jsonl; docs/predictors.md: labels file)."),
    report: Path | None = typer.Option(None, "--report", help="Write an HTML report with plots."),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="A model other than the packaged one."),
    as_json: bool = typer.Option(False, "--json", help="Print the metrics as JSON."),
    policy: str | None = typer.Option(None, "--policy", help="Score another alert policy "
                                      "'hi,k,k_memory[,hi_memory]'."),
    choose: bool = typer.Option(False, "--choose-policy", help="Score the trace once, replay a grid of "
                                "alert policies over it and choose the one that calls the most failures "
                                "within --budget (docs/predictors.md, 'Retraining on your own fleet')."),
    budget: float = typer.Option(0.2, "--budget", help="With --choose-policy: false alarms per 1,000 "
                                 "GPU-days a policy may make, at the 95% upper bound."),
    grid: str | None = typer.Option(None, "--grid", help="With --choose-policy: the policies to try, "
                                    "';'-separated 'hi,k,k_memory[,hi_memory]' (default: hi 0.8-0.97 held "
                                    "6-72 hops)."),
    since: str | None = typer.Option(None, "--since", help="Read only records at or after this time "
                                     "(Unix seconds or RFC 3339 with an offset): the held-out part of a "
                                     "fleet's history split by time."),
    until: str | None = typer.Option(None, "--until", help="Read only records before this time."),
    model_alerts: bool | None = typer.Option(None, "--model-alerts/--rules-only", help="Score the model's "
                                             "alerts beside the rules, or the rules alone (default: as "
                                             "the model's policy says)."),
) -> None:
    """Score failure and straggler predictions over TRACE against LABELS."""
    from dataclasses import replace

    from fleetwise.predictors.backtest import StepStream, backtest_trace, metrics_rows
    from fleetwise.predictors.failure import FailurePredictor, FeatureSchemaError

    _existing([trace, labels], "file")
    window = _time_window(since, until)
    if choose and (policy or report or model_alerts is not None):
        fail("--choose-policy replays its own grid of the model's policies: leave out --policy, --report "
             "and --model-alerts / --rules-only")
    if not choose and grid:
        fail("--grid is the sweep of --choose-policy: give both")
    try:
        predictor = FailurePredictor.load(model_dir)
    except (FileNotFoundError, FeatureSchemaError) as exc:
        fail(str(exc))
    if choose:
        _choose_policy(trace, _operator_labels(labels), predictor, budget, grid, as_json, window)
        return
    chosen = _parse_policy(policy, predictor.policy)
    if model_alerts is not None:
        if policy and not model_alerts:
            fail("--policy sets the model's thresholds; --rules-only leaves the model out: give one")
        chosen = replace(chosen or predictor.policy, model_alerts=model_alerts)
    if chosen is not None:
        predictor = FailurePredictor(predictor.model, chosen)
    label_list = _operator_labels(labels)
    steps = StepStream()
    try:
        run = backtest_trace(_trace_samples(trace, steps, window), steps, label_list, predictor)
    except ValueError as exc:
        fail(f"{trace}: {exc}")
    metrics = run.metrics
    if report is not None:
        from fleetwise.predictors.report import backtest_report_html

        html = backtest_report_html(metrics, label_list, run.table.keys, run.table.ts, run.probs,
                                    run.table.features, run.predictions)
        report.write_text(html, encoding="utf-8")
    if as_json:
        print_json(metrics)
        return
    from rich.table import Table

    t = Table(title=f"failure predictor backtest: {trace.name}")
    for col in ("metric", "value", "target"):
        t.add_column(col)
    for row in metrics_rows(metrics):
        t.add_row(*row)
    console.print(t)
    if "straggler" in metrics:
        s = metrics["straggler"]
        flat = ", ".join(f"{k}={v}" for k, v in s.items() if not isinstance(v, list | dict))
        console.print(f"stragglers: {flat}")
    else:
        console.print("stragglers: no step records in trace")
    if report is not None:
        console.print(f"report -> {report}")



def _choose_policy(trace: Path, labels: list[dict], predictor, budget: float,  # noqa: ANN001
                   grid: str | None, as_json: bool, window: tuple[float | None, float | None]) -> None:
    """`backtest --choose-policy`: one scoring pass, every policy of the grid replayed over it."""
    from fleetwise.predictors.failure import policy_from_spec
    from fleetwise.predictors.policy_choice import (
        POLICY_CHOICE_GRID,
        RANK_BUCKETS,
        choose_policy,
        score_hops,
    )

    specs = [g.strip() for g in grid.split(";") if g.strip()] if grid else list(POLICY_CHOICE_GRID)
    for spec in specs:  # a bad spec fails here, before the trace is read
        try:
            policy_from_spec(spec)
        except ValueError as exc:
            fail(f"--grid: {exc}")
    try:
        scores = score_hops(_trace_samples(trace, window=window), predictor)
        choice = choose_policy(scores, labels, predictor, budget, specs)
    except ValueError as exc:
        fail(f"{trace}: {exc}")
    if as_json:
        print_json({
            "budget_per_1000_gpu_days": choice.budget_per_1000_gpu_days, "gpu_days": choice.gpu_days,
            "chosen": choice.chosen.spec if choice.chosen else None, "reason": choice.reason,
            "trials": [{"policy": t.spec, "false_alarms": t.false_alarms,
                        "false_alarms_per_1000_gpu_days": t.false_alarms_per_1000_gpu_days,
                        "upper95_per_1000_gpu_days": t.upper95_per_1000_gpu_days,
                        "within_budget": t.within_budget, "precision": t.precision,
                        **{b: {"caught": c, "n": n} for b, (c, n) in t.caught.items()}}
                       for t in choice.trials],
        })
        return
    from rich.table import Table

    t = Table(title=f"alert policies on {trace.name}: {choice.gpu_days:,.0f} GPU-days, "
                    f"budget {budget:g} false alarms / 1,000 GPU-days (95% upper bound)")
    t.caption = ("FA: false alarms (n, per 1,000 GPU-days, 95% upper bound); caught / failures: long "
                 "precursors (>= 18 h) 12 h ahead, any precursor 30 min ahead, all failures 12 h and 30 min "
                 "ahead; prec: precision of alert episodes; * chosen")
    for col in ("policy", "FA", "FA/1k", "upper", "in budget", "long@12h", "pre@30m", "all@12h", "all@30m",
                "prec"):
        t.add_column(col, no_wrap=True)
    t.caption_justify = "left"
    for tr in choice.trials:
        mark = " *" if tr is choice.chosen else ""
        t.add_row(tr.spec + mark, str(tr.false_alarms), f"{tr.false_alarms_per_1000_gpu_days:.2f}",
                  f"{tr.upper95_per_1000_gpu_days:.2f}", "yes" if tr.within_budget else "no",
                  *(f"{c}/{n}" for c, n in (tr.caught[b] for b in RANK_BUCKETS)),
                  "-" if tr.precision is None else f"{tr.precision:.2f}")
    from rich.console import Console

    Console(width=max(console.width, 110)).print(t)  # the columns whole on an 80-column pipe
    console.print(f"chosen: {choice.reason}")
    if choice.chosen is not None:
        console.print(f"store it with the model: fleetwise predictor train --trace ... --labels ... "
                      f"--policy {choice.chosen.spec} --out-dir DIR")


# ---- worker / agent --------------------------------------------------------------------------
@app.command("worker")
def worker(
    bootstrap: str = typer.Option(..., "--bootstrap", help="Kafka bootstrap servers, host:port[,host:port]."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here."),
    store: str = typer.Option("memory://", "--store", help="Table store: memory:// or rocksdb://."),
    app_id: str = typer.Option("fleetwise", "--app-id", help="Consumer group / app id."),
    topic_prefix: str = typer.Option("", "--topic-prefix", envvar="FLEETWISE_TOPIC_PREFIX",
                                     help="Prefix of every topic name (Helm: kafka.topicPrefix; tests)."),
    web_port: int | None = typer.Option(None, "--web-port", help="faust's web UI port (off by default)."),
    take_max: int = typer.Option(500, "--take-max", help="Max messages per processed batch."),
    checkpoint_interval: float = typer.Option(
        5.0, "--checkpoint-interval", help="Seconds between state checkpoints (and offset commits)."
    ),
    loglevel: str = typer.Option("warning", "--loglevel", help="faust log level."),
    stagger_hops: bool = typer.Option(
        True, "--stagger-hops/--aligned-hops", help="Shift each GPU's hop grid by a phase from its "
        "key, so hops close spread over the hop instead of all at once (default; keeps the p99 "
        "latency down), or one hop grid for all GPUs. Replay with the same choice gives the "
        "same features."),
    policy: Path | None = typer.Option(None, "--policy", envvar="FLEETWISE_POLICY",
                                       help="Operator policy file (YAML)."),
    model_alerts: bool | None = typer.Option(None, "--model-alerts/--rules-only", help="Failure alerts "
                                             "from the model beside the rules, or the rules alone (default: "
                                             "as the model's policy says; the packaged model's: both, the "
                                             "model's after 6 h at p >= 0.97, 12 h where single-bit errors "
                                             "drive the risk, 18 h where heat does)."),
) -> None:
    """Run a stream worker: telemetry from Kafka through the control plane, outputs to Kafka.

    Commands are signed with FLEETWISE_SIGNING_KEYS / FLEETWISE_SIGNING_KEYS_FILE (the first
    key signs; all verify), else a development key."""
    import importlib.util
    import re

    hostport = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+:\d{1,5}$")
    bad = [hp for hp in bootstrap.split(",") if not hostport.match(hp.strip())]
    if bad:
        fail(f"--bootstrap must be host:port[,host:port...]; bad entries: {', '.join(bad)}")
    if store not in ("memory://", "rocksdb://"):
        fail(f"--store must be memory:// or rocksdb://, got {store!r}")
    if store == "rocksdb://" and importlib.util.find_spec("rocksdict") is None:
        fail("--store rocksdb:// needs the python-rocksdict package (pip install rocksdict); "
             "use --store memory:// (state is rebuilt from the changelog at start)")
    if take_max < 1:
        fail(f"--take-max must be at least 1, got {take_max}")
    if not 0.1 <= checkpoint_interval <= 3600:
        fail(f"--checkpoint-interval must be 0.1..3600 seconds, got {checkpoint_interval}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        fail(f"--metrics-port must be 0..65535, got {metrics_port}")
    from fleetwise.actuators import KeyringError
    from fleetwise.streams.app import run_worker
    from fleetwise.streams.keys import identity_verifier_from_env
    from fleetwise.streams.pipeline import ControlPlane, ControlPlaneConfig

    try:
        identity_verifier = identity_verifier_from_env()
    except KeyringError as exc:
        fail(f"identity master key: {exc}")
    try:
        run_worker(bootstrap, app_id=app_id, store=store, metrics_port=metrics_port, web_port=web_port,
                   topic_prefix=topic_prefix, loglevel=loglevel, take_max=take_max,
                   checkpoint_interval_s=checkpoint_interval, identity_verifier=identity_verifier,
                   control=ControlPlane(ControlPlaneConfig(stagger_hops=stagger_hops,
                                                           policy=_load_policy(policy),
                                                           keyring=_keyring(signs=True),
                                                           operator_keys=_operator_keys(),
                                                           model_alerts=model_alerts)))
    except ConnectionError as exc:
        fail(str(exc))


@app.command("agent")
def agent(
    bootstrap: str = typer.Option(..., "--bootstrap", envvar="FLEETWISE_BOOTSTRAP",
                                  help="Kafka bootstrap servers, host:port[,host:port]."),
    source: str = typer.Option("nvml", "--source", help="Collector: nvml | dcgm | sim."),
    dcgm_url: str = typer.Option("http://localhost:9400/metrics", "--dcgm-url", envvar="FLEETWISE_DCGM_URL",
                                 help="dcgm-exporter /metrics URL (--source dcgm)."),
    node: str | None = typer.Option(None, "--node", envvar=["FLEETWISE_NODE", "NODE_NAME"],
                                    help="Node name (default: hostname or dcgm-exporter's hostname label)."),
    interval: float = typer.Option(10.0, "--interval", help="Seconds between collections."),
    rack: str | None = typer.Option(None, "--rack", envvar="FLEETWISE_RACK", help="Rack of this node."),
    site: str | None = typer.Option(None, "--site", envvar="FLEETWISE_SITE", help="Site of this node."),
    rack_power_w: str | None = typer.Option(None, "--rack-power-w", envvar="FLEETWISE_RACK_POWER_W",
                                            help="Power budget of the rack, W."),
    label: list[str] | None = typer.Option(None, "--label",
                                           help="Node label k=v (repeat; also FLEETWISE_LABELS=k=v,k=v)."),
    nic: list[str] | None = typer.Option(None, "--nic",
                                         help="NIC NAME:GBPS[:KIND] (repeat; default: /sys/class/net)."),
    nvlink_groups: str | None = typer.Option(None, "--nvlink-groups",
                                             help="NVLink domains, e.g. '0-3;4-7' (default: observed)."),
    sim_gpus: str | None = typer.Option(None, "--sim-gpus",
                                        help="Simulated fleet spec, e.g. h100-sxm:8 (--source sim)."),
    sim_nodes: int = typer.Option(1, "--sim-nodes", help="Simulated nodes this agent reports (load tests)."),
    seed: int = typer.Option(0, "--seed", help="Simulator seed."),
    fast: bool = typer.Option(False, "--fast", help="No pacing: collect as fast as possible (load tests)."),
    metrics_port: int | None = typer.Option(None, "--metrics-port", help="Serve Prometheus /metrics here."),
    max_buffer: int = typer.Option(1000, "--max-buffer", help="Batches buffered while the broker is away."),
    count: int | None = typer.Option(None, "--count", help="Stop after N collections (tests)."),
    topic_prefix: str = typer.Option("", "--topic-prefix", envvar="FLEETWISE_TOPIC_PREFIX",
                                     help="Prefix of every topic name (Helm: kafka.topicPrefix; tests)."),
    create_topics: bool = typer.Option(True, "--create-topics/--no-create-topics",
                                       help="Create missing topics (needs the admin ACL)."),
    flush_timeout: float = typer.Option(10.0, "--flush-timeout", help="Seconds to flush the buffer at exit."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON summary of the run at exit."),
    loglevel: str = typer.Option("info", "--loglevel", help="Log level (debug, info, warning, error)."),
) -> None:
    """Run a node agent: publish this node's inventory, then a node batch of GPU samples per interval."""
    import asyncio
    import logging
    import os

    from fleetwise.agent import BatchPublisher, CollectorError, NodeConfig
    from fleetwise.agent import config as agent_config
    from fleetwise.agent.runner import SOURCES, build_collector, run_until_signal

    if source not in SOURCES:
        fail(f"--source must be one of {', '.join(SOURCES)}, got {source!r}")
    if not interval > 0:
        fail(f"--interval must be > 0 seconds, got {interval}")
    if max_buffer < 1:
        fail(f"--max-buffer must be at least 1 batch, got {max_buffer}")
    if count is not None and count < 1:
        fail(f"--count must be at least 1, got {count}")
    if metrics_port is not None and not 0 <= metrics_port <= 65535:
        fail(f"--metrics-port must be 0..65535, got {metrics_port}")
    if loglevel.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        fail(f"--loglevel must be debug, info, warning or error, got {loglevel!r}")
    logging.basicConfig(level=loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        bootstrap = agent_config.parse_bootstrap(bootstrap)
        config = NodeConfig(
            node=node or None, rack=rack, site=site,
            rack_power_w=agent_config.parse_power(rack_power_w) if rack_power_w is not None else None,
            labels=agent_config.parse_labels(label, os.environ.get("FLEETWISE_LABELS")),
            nics=[agent_config.parse_nic(n) for n in nic] if nic else None,
            nvlink_groups=agent_config.parse_nvlink_groups(nvlink_groups) if nvlink_groups else None,
        ).resolved()
        collector = build_collector(source, config, dcgm_url=dcgm_url, sim_gpus=sim_gpus, sim_nodes=sim_nodes,
                                    seed=seed, interval_s=interval, count=count, fast=fast)
        collector.start()
    except (agent_config.AgentConfigError, CollectorError) as exc:
        fail(str(exc))
    name = config.node or getattr(collector, "node", None) or os.uname().nodename
    if metrics_port is not None:
        from fleetwise.agent.metrics import start_metrics_server

        try:
            port = start_metrics_server(metrics_port)
        except OSError as exc:
            collector.close()
            fail(f"--metrics-port {metrics_port}: cannot listen: {exc}")
        err_console.print(f"agent metrics on :{port}/metrics", highlight=False)
    from fleetwise.actuators import KeyringError
    from fleetwise.actuators.signing import node_identity
    from fleetwise.streams.keys import identity_keys_from_env

    try:
        signer = identity_keys_from_env()
    except KeyringError as exc:
        collector.close()
        fail(f"identity key: {exc}")
    if signer is not None and signer.master is None:
        if source == "sim" and sim_nodes > 1:
            collector.close()
            fail(f"FLEETWISE_IDENTITY_KEY signs as one node ({signer.identity}); --sim-nodes {sim_nodes} "
                 "needs FLEETWISE_IDENTITY_MASTER_KEY")
        if signer.identity != node_identity(name):
            collector.close()
            fail(f"FLEETWISE_IDENTITY_KEY is {signer.identity!r}'s key; this agent reports node {name!r} "
                 f"({node_identity(name)!r})")
    publisher = BatchPublisher(bootstrap, agent=name, max_buffer=max_buffer, topic_prefix=topic_prefix,
                               create_topics=create_topics, signer=signer)
    run = asyncio.run(run_until_signal(collector, publisher, interval_s=interval, count=count, fast=fast,
                                       flush_timeout_s=flush_timeout, started=True))
    stats = publisher.stats
    summary = {
        "agent": name, "source": source, "ticks": run.ticks, "batches": run.batches, "samples": run.samples,
        "batches_sent": stats.batches_sent, "inventories_sent": stats.inventories_sent,
        "dropped": stats.dropped, "send_errors": stats.send_errors, "connect_errors": stats.connect_errors,
        "collect_errors": run.collect_errors, "undelivered": publisher.depth,
        "elapsed_s": round(run.elapsed_s, 3),
    }
    if as_json:
        print_json(summary)
    else:
        err_console.print(" ".join(f"{k}={v}" for k, v in summary.items()), highlight=False)
    if not run.delivered:
        fail(f"agent stopped with {publisher.depth} batches undelivered (broker {bootstrap} unreachable?)",
             code=1)

if __name__ == "__main__":  # pragma: no cover
    app()
