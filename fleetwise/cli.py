"""The `fleetwise` command: thin typer adapter over the core packages.

Each verb parses arguments, calls core functions, and prints. Errors in user input
become a one-line message and exit code 2 (`fail`), never a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

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


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")


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


# ---- sim -------------------------------------------------------------------------------------


# ---- replay / demo / backtest ----------------------------------------------------------------
def _existing(paths: list[Path], what: str) -> list[Path]:
    for path in paths:
        if not path.is_file():
            fail(f"{what} not found: {path}")
    return paths


@app.command()
def replay(
    traces: list[Path] = typer.Argument(..., help="Recorded telemetry: .jsonl or .jsonl.gz files."),
    out: Path = typer.Option(..., "--out", help="Decision output (JSON lines: predictions and commands)."),
    inventory: Path | None = typer.Option(None, help="Node inventories (.jsonl) to load first."),
    report: Path | None = typer.Option(None, help="Write an HTML report of the predictions."),
    labels: Path | None = typer.Option(None, help="Simulator labels, to mark failures in the report."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    max_bad_lines: int = typer.Option(20, help="How many bad lines to list (all are counted)."),
) -> None:
    """Run the whole control plane, embedded, over recorded telemetry; write its decisions."""
    from fleetwise.streams.embedded import replay as run_replay

    _existing(traces, "trace")
    if inventory is not None:
        _existing([inventory], "inventory")
    runtime = run_replay(traces, out, inventory=inventory)
    summary = runtime.summary
    decisions = runtime.decisions()
    if report is not None:
        _write_report(report, decisions, labels)
    data = {
        "lines": summary.lines, "samples": summary.samples, "steps": summary.steps,
        "bad_lines": len(summary.bad_lines),
        "predictions": sum(1 for d in decisions if d.kind == "prediction"),
        "alerts": sum(1 for d in decisions if d.kind == "prediction" and d.alert),
        "commands": sum(1 for d in decisions if d.kind == "command"),
        "outputs": dict(summary.outputs), "out": str(out),
    }
    if as_json:
        print_json(data)
        return
    for source, reason in summary.bad_lines[:max_bad_lines]:
        err_console.print(f"[yellow]skipped[/] {source}: {reason}", highlight=False)
    if len(summary.bad_lines) > max_bad_lines:
        err_console.print(f"... and {len(summary.bad_lines) - max_bad_lines} more bad lines")
    console.print(
        f"replayed {data['lines']} lines: {data['samples']} GPU samples, {data['steps']} step records, "
        f"{data['bad_lines']} bad lines skipped; {data['predictions']} predictions "
        f"({data['alerts']} alerts), {data['commands']} commands -> {out}"
    )


def _write_report(path: Path, decisions: list, labels: Path | None) -> None:
    from fleetwise.predictors.report import write_report

    label_rows = []
    if labels is not None:
        _existing([labels], "labels")
        label_rows = [json.loads(line) for line in labels.read_text().splitlines() if line.strip()]
    write_report(path, decisions, label_rows)


# ---- predictor -------------------------------------------------------------------------------


# ---- worker / agent --------------------------------------------------------------------------


if __name__ == "__main__":  # pragma: no cover
    app()
