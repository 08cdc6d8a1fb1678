"""Terminal rendering of the GPU catalog (``fleetwise catalog``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich import box
from rich.table import Table

__all__ = ["catalog_table"]


def _num(value: Any, digits: int = 0) -> str:
    """Format a number; 0 (unsupported / none) and None render as a dash."""
    if value is None:
        return "-"
    number = float(value)
    if number == 0:
        return "-"
    if digits == 0 and number != int(number) and number < 10:
        digits = 1
    return f"{number:.{digits}f}"


def catalog_table(rows: Iterable[Mapping[str, Any]], *, title: str | None = None) -> Table:
    """A readable table of ``catalog_rows()`` output: dense peaks, capability, memory, links."""
    rows = list(rows)
    dtype = str(rows[0].get("dtype", "bf16")) if rows else "bf16"
    table = Table(
        title=title if title is not None else "Fleetwise GPU catalog",
        caption=(
            f"TFLOPS are dense peaks (- = unsupported); Cap. = {dtype} peak x family efficiency (Eff.); "
            "Dom. = GPUs per NVLink domain; * = estimate. Sources: fleetwise catalog --json."
        ),
        header_style="bold",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        padding=(0, 1, 0, 0),
        caption_justify="left",
    )
    table.add_column("ID", style="bold cyan", no_wrap=True)
    for header in ("Family", "Year", "Mem\nGB", "BW\nTB/s", "BF16", "FP16", "FP8", "FP32", "Eff."):
        table.add_column(header, justify="left" if header == "Family" else "right", no_wrap=True)
    table.add_column(f"Cap.\n{dtype}", justify="right", style="green", no_wrap=True)
    for header in ("NVLink\nGB/s", "Dom.", "TDP\nW"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("Name", overflow="fold", max_width=30)

    previous_vendor = None
    for row in rows:
        vendor = row.get("vendor")
        if previous_vendor is not None and vendor != previous_vendor:
            table.add_section()
        previous_vendor = vendor
        estimate = bool(row.get("estimate"))
        table.add_row(
            str(row.get("id", "")) + ("*" if estimate else ""),
            str(row.get("family", "")),
            str(row.get("year", "")),
            _num(row.get("memory_gb")),
            _num(row.get("memory_bw_tbs"), 2),
            _num(row.get("bf16_tflops")),
            _num(row.get("fp16_tflops")),
            _num(row.get("fp8_tflops")),
            _num(row.get("fp32_tflops")),
            f"{float(row['efficiency']):.2f}" if row.get("efficiency") is not None else "-",
            _num(row.get("capability_tflops")),
            _num(row.get("nvlink_gbs")),
            str(row.get("nvlink_domain", "")),
            _num(row.get("tdp_w")),
            str(row.get("name", "")),
            style="dim" if estimate else None,
        )
    return table
