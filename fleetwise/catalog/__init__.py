"""GPU catalog: GPU generations as data (with sources) and capability lookup."""

from __future__ import annotations

from typing import Any

from fleetwise.catalog.gpus import (
    DTYPES,
    FAMILY_EFFICIENCY,
    CatalogError,
    GpuSpec,
    UnknownGpuError,
    UnsupportedDtypeError,
    add_gpus,
    all_gpus,
    catalog_rows,
    lookup,
    normalize_dtype,
    parse_gpu_counts,
)

__all__ = [
    "DTYPES",
    "FAMILY_EFFICIENCY",
    "CatalogError",
    "GpuSpec",
    "UnknownGpuError",
    "UnsupportedDtypeError",
    "add_gpus",
    "all_gpus",
    "catalog_rows",
    "catalog_table",
    "lookup",
    "normalize_dtype",
    "parse_gpu_counts",
]


def __getattr__(name: str) -> Any:
    # Lazy so that core users of the catalog do not import rich.
    if name == "catalog_table":
        from fleetwise.catalog.render import catalog_table

        return catalog_table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
