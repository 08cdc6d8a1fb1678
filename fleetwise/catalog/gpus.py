"""GPU generations as data (``gpus.csv``, one sourced row per variant) and name resolution.

Every number is a *dense* peak from a vendor datasheet or a cited reproduction of one; the
source URL of each row is kept in ``GpuSpec.source``. Rows whose figures were recalled,
derived or announced-but-unshipped carry ``estimate=True``. Peak is never achieved, so
``capability_tflops`` scales it by a per-family model-FLOPs-utilisation factor
(``FAMILY_EFFICIENCY``).

``lookup`` resolves what people and tools call a GPU: short ids (``h100-sxm``), aliases
(``a100-80gb``), canonical names, NVML / dcgm-exporter ``modelName`` values
(``NVIDIA H100 80GB HBM3``) and GPU Feature Discovery ``nvidia.com/gpu.product`` labels
(``NVIDIA-A100-SXM4-80GB-SHARED``, ``NVIDIA-A100-80GB-PCIe-MIG-1g.10gb``). A MIG or shared
label resolves to its parent GPU.

This module does no I/O beyond reading its own package data: a site's rows for GPUs the
package lacks come in as text (``add_gpus``; the CLI reads them from ``FLEETWISE_CATALOG_EXTRA``).
"""

from __future__ import annotations

import csv
import difflib
import io
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from types import MappingProxyType
from typing import Any, NoReturn

__all__ = [
    "DTYPES",
    "FAMILY_EFFICIENCY",
    "CatalogError",
    "GpuSpec",
    "UnknownGpuError",
    "UnsupportedDtypeError",
    "all_gpus",
    "catalog_rows",
    "lookup",
    "parse_gpu_counts",
    "normalize_dtype",
]

DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp8", "fp32")

_DTYPE_ALIASES: Mapping[str, str] = MappingProxyType(
    {
        "bfloat16": "bf16",
        "float16": "fp16",
        "half": "fp16",
        "float32": "fp32",
        "float": "fp32",
        "float8": "fp8",
        "fp8e4m3": "fp8",
        "fp8e5m2": "fp8",
        "e4m3": "fp8",
        "e5m2": "fp8",
    }
)

# Achieved model-FLOPs utilisation (MFU) relative to *dense* peak, per family. Only ratios
# between families matter to the planner (they weight a mixed fleet); absolute step-time
# predictions inherit the uncertainty. "estimate" marks values without a published
# large-scale training measurement for that family.
FAMILY_EFFICIENCY: Mapping[str, float] = MappingProxyType(
    {
        # Measured: Megatron-LM (Shoeybi et al. 2019, arXiv 1909.08053) sustained 39 TFLOPS on one
        # V100 = ~30-31% of the 125 TFLOPS FP16 tensor peak. No FlashAttention-2 on Volta.
        "volta": 0.31,
        # Estimate: no published training MFU; T4 is a 70 W power-capped inference card, no FA2.
        "turing": 0.30,
        # Measured: Narayanan et al. 2021 (arXiv 2104.04473) 163 TFLOPS/GPU = 52% of 312 on
        # 3,072 A100s (1T GPT); REFERENCE.md: 54% MFU for 530B on 2,240 A100s.
        "ampere": 0.52,
        # Estimate: no published large-scale Ada training MFU; GDDR6 bandwidth per FLOP is
        # 2-4x lower than A100/H100 HBM, so set below Hopper.
        "ada": 0.40,
        # Measured: REFERENCE.md, Megatron-LM reports 41-48% MFU on H100 up to 6,144 GPUs
        # (47% -> 42% strong-scaling GPT-3 175B from 96 to 4,608 GPUs); midpoint.
        "hopper": 0.45,
        # Estimate: dense peak grew 2.3x over Hopper while HBM bandwidth grew ~2.3x and NVLink 2x;
        # no Megatron MFU table for Blackwell in REFERENCE.md. Set below Hopper.
        "blackwell": 0.40,
        # Estimate on estimated peaks (REFERENCE.md: Rubin figures +-30%).
        "rubin": 0.38,
        # Measured: Dash et al. 2023, "Optimizing Distributed Training on Frontier for LLMs"
        # (arXiv 2312.12705): 38.4% / 36.1% / 32.0% of peak for 22B / 175B / 1T on MI250X GCDs.
        "cdna2": 0.35,
        # Estimate: REFERENCE.md and github.com/alpharomercoma/MI300X-vs-H200 (METHODOLOGY.md):
        # measured MI300X training throughput trails H200 despite 1.32x higher peak BF16, so
        # 0.30 x 1307 = 392 < 0.45 x 989 = 445 effective TFLOPS.
        "cdna3": 0.30,
        # Estimate: same ROCm software stack as CDNA3; no published training MFU yet.
        "cdna4": 0.30,
    }
)

_CSV_NAME = "gpus.csv"
_COLUMNS = (
    "id",
    "name",
    "vendor",
    "family",
    "year",
    "memory_gb",
    "memory_bw_tbs",
    "bf16_tflops",
    "fp16_tflops",
    "fp8_tflops",
    "fp32_tflops",
    "nvlink_gbs",
    "nvlink_domain",
    "pcie_gen",
    "tdp_w",
    "form_factor",
    "aliases",
    "nvml_names",
    "gfd_labels",
    "source_url",
    "estimate",
    "notes",
)


class CatalogError(ValueError):
    """The packaged catalog data is malformed or ambiguous (raised at import)."""


class UnknownGpuError(KeyError):
    """No catalog entry matches a GPU name; ``suggestions`` holds the closest known ids."""

    def __init__(self, name: str, suggestions: tuple[str, ...] = ()) -> None:
        self.name = name
        self.suggestions = tuple(suggestions)
        msg = f"unknown GPU {name!r}"
        if self.suggestions:
            msg += ": closest known ids: " + ", ".join(self.suggestions)
        self.message = msg
        super().__init__(msg)

    def __str__(self) -> str:
        return self.message

    @property
    def record_reason(self) -> str:
        """Why a record naming this GPU is refused, and what a site does about it."""
        return f"model: {self.message} (a site adds a catalog row: FLEETWISE_CATALOG_EXTRA, docs/deploy.md)"


class UnsupportedDtypeError(ValueError):
    """A GPU has no hardware support for a dtype (peak 0), or the dtype is unknown."""

    def __init__(self, gpu: str | None, dtype: str, message: str | None = None) -> None:
        self.gpu = gpu
        self.dtype = dtype
        if message is None:
            message = f"GPU {gpu!r} does not support dtype {dtype!r} (no hardware support, peak 0)"
        super().__init__(message)


def normalize_dtype(dtype: str) -> str:
    """Canonical dtype name (one of ``DTYPES``); accepts e.g. ``bfloat16``, ``float16``, ``FP8``."""
    if not isinstance(dtype, str):
        raise UnsupportedDtypeError(None, repr(dtype), f"dtype must be a string, got {dtype!r}")
    key = re.sub(r"[\s_-]", "", dtype.casefold())
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise UnsupportedDtypeError(
            None, dtype, f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}"
        )
    return key


class _FrozenDict(dict):
    """A read-only dict: JSON-serialisable, picklable and ``dataclasses.asdict``-friendly."""

    __slots__ = ()

    def _readonly(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError("GpuSpec.peak_tflops is read-only")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]
    __ior__ = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (dict(self),))

    def __copy__(self) -> _FrozenDict:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> _FrozenDict:
        return self


@dataclass(frozen=True)
class GpuSpec:
    """One GPU generation/variant. TFLOPS are dense peaks; 0 means no hardware support."""

    id: str
    name: str
    vendor: str
    family: str
    year: int
    memory_gb: float
    memory_bw_tbs: float
    peak_tflops: Mapping[str, float]
    nvlink_gbs: float
    nvlink_domain: int
    pcie_gen: int
    tdp_w: float
    form_factor: str
    efficiency: float
    nvml_names: tuple[str, ...] = ()
    gfd_labels: tuple[str, ...] = ()
    source: str = ""
    estimate: bool = False
    notes: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        peaks: dict[str, float] = {d: 0.0 for d in DTYPES}
        for dtype, value in dict(self.peak_tflops).items():
            value = float(value)
            if value < 0:
                raise ValueError(f"GPU {self.id!r}: negative peak for {dtype}: {value}")
            peaks[normalize_dtype(dtype)] = value
        object.__setattr__(self, "peak_tflops", _FrozenDict(peaks))
        for attr in ("nvml_names", "gfd_labels", "aliases"):
            object.__setattr__(self, attr, tuple(getattr(self, attr)))

    def __hash__(self) -> int:
        return hash((self.id, self.name))

    def supports(self, dtype: str) -> bool:
        """True when the hardware has a non-zero peak for ``dtype`` (unknown dtypes: False)."""
        try:
            return self.peak_tflops[normalize_dtype(dtype)] > 0
        except UnsupportedDtypeError:
            return False

    def peak(self, dtype: str) -> float:
        """Dense peak TFLOPS for ``dtype`` (0.0 when unsupported); raises on unknown dtypes."""
        return self.peak_tflops[normalize_dtype(dtype)]

    def capability_tflops(self, dtype: str) -> float:
        """Expected achieved TFLOPS: dense peak x family efficiency.

        Raises ``UnsupportedDtypeError`` (a ``ValueError``) naming the GPU and dtype when the
        hardware does not support ``dtype``.
        """
        key = normalize_dtype(dtype)
        peak = self.peak_tflops[key]
        if peak <= 0:
            alt = ", ".join(self.dtypes) or "none"
            raise UnsupportedDtypeError(
                self.id,
                key,
                f"GPU {self.id!r} ({self.name}) does not support {key} in hardware; supported: {alt}",
            )
        return peak * self.efficiency

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The dtypes this GPU supports, in ``DTYPES`` order."""
        return tuple(d for d in DTYPES if self.peak_tflops[d] > 0)

    @property
    def memory_bytes(self) -> int:
        """Memory in bytes, decimal GB as vendors quote it (``memory_gb * 1e9``)."""
        return int(round(self.memory_gb * 1e9))

    @property
    def memory_bw_bytes_s(self) -> float:
        """Memory bandwidth in bytes per second (decimal TB/s * 1e12)."""
        return self.memory_bw_tbs * 1e12


# --- loading -------------------------------------------------------------------------------


def _split(cell: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in cell.split(";") if part.strip())


def _parse_row(line: int, raw: dict[str, str], source: str = _CSV_NAME) -> GpuSpec:
    where = f"{source} line {line}"
    missing = [c for c in _COLUMNS if raw.get(c) is None]
    if missing:
        raise CatalogError(f"{where}: missing columns {missing}")
    row = {k: (v or "").strip() for k, v in raw.items() if k is not None}
    for col in ("id", "name", "vendor", "family", "source_url"):
        if not row[col]:
            raise CatalogError(f"{where}: empty {col}")

    def num(col: str) -> float:
        try:
            value = float(row[col])
        except ValueError:
            raise CatalogError(f"{where}: {col}={row[col]!r} is not a number") from None
        if value < 0 or value != value:
            raise CatalogError(f"{where}: {col}={row[col]!r} must be >= 0")
        return value

    family = row["family"]
    if family not in FAMILY_EFFICIENCY:
        raise CatalogError(f"{where}: family {family!r} has no FAMILY_EFFICIENCY entry")
    estimate = row["estimate"].casefold()
    if estimate not in ("true", "false"):
        raise CatalogError(f"{where}: estimate must be true/false, got {row['estimate']!r}")
    spec = GpuSpec(
        id=row["id"],
        name=row["name"],
        vendor=row["vendor"],
        family=family,
        year=int(num("year")),
        memory_gb=num("memory_gb"),
        memory_bw_tbs=num("memory_bw_tbs"),
        peak_tflops={d: num(f"{d}_tflops") for d in DTYPES},
        nvlink_gbs=num("nvlink_gbs"),
        nvlink_domain=int(num("nvlink_domain")),
        pcie_gen=int(num("pcie_gen")),
        tdp_w=num("tdp_w"),
        form_factor=row["form_factor"],
        efficiency=FAMILY_EFFICIENCY[family],
        nvml_names=_split(row["nvml_names"]),
        gfd_labels=_split(row["gfd_labels"]),
        source=row["source_url"],
        estimate=estimate == "true",
        notes=row["notes"],
        aliases=_split(row["aliases"]),
    )
    if spec.memory_gb <= 0 or spec.memory_bw_tbs <= 0 or spec.tdp_w <= 0:
        raise CatalogError(f"{where}: memory, bandwidth and TDP must be positive")
    if not spec.supports("bf16") and not spec.supports("fp16"):
        raise CatalogError(f"{where}: {spec.id} supports neither bf16 nor fp16")
    if spec.nvlink_domain < 1 or (spec.nvlink_gbs == 0 and spec.nvlink_domain != 1):
        raise CatalogError(f"{where}: nvlink_domain must be >= 1, and 1 when nvlink_gbs is 0")
    if not spec.source.startswith(("http://", "https://")):
        raise CatalogError(f"{where}: source_url must be an http(s) URL")
    return spec


def _norm(name: str) -> str:
    """Index key: case-, whitespace-, underscore-, hyphen- and punctuation-insensitive."""
    return re.sub(r"[^a-z0-9.+]", "", name.casefold())


_VENDOR_PREFIX = re.compile(r"^(?:nvidia|amd)?(?:tesla|instinct|geforce)?")
_SHARED_SUFFIX = re.compile(r"[\s_-]+shared$", re.IGNORECASE)
_MIG_SUFFIX = re.compile(r"[\s_-]+mig(?:[\s_-]+[0-9][0-9a-z.+]*)?$", re.IGNORECASE)


def _strip_vendor(key: str) -> str:
    return _VENDOR_PREFIX.sub("", key, count=1)


class _Catalog:
    def __init__(self, specs: tuple[GpuSpec, ...]) -> None:
        self.specs = specs
        self.by_id: dict[str, GpuSpec] = {}
        self.index: dict[str, str] = {}
        self.origin: dict[str, str] = {}
        for spec in specs:
            if spec.id in self.by_id:
                raise CatalogError(f"duplicate GPU id {spec.id!r} in {_CSV_NAME}")
            self.by_id[spec.id] = spec
        names = [(n, s.id) for s in specs for n in (s.id, *s.aliases, s.name, *s.nvml_names, *s.gfd_labels)]
        for name, gpu_id in names:
            self._add(_norm(name), gpu_id, name)
        # Vendor-prefix-free forms ("A100-SXM4-40GB" from older drivers, "T4", "MI300X").
        for name, gpu_id in names:
            stripped = _strip_vendor(_norm(name))
            if stripped:
                self._add(stripped, gpu_id, name)

    def _add(self, key: str, gpu_id: str, name: str) -> None:
        if not key:
            raise CatalogError(f"GPU {gpu_id!r}: name {name!r} normalises to nothing")
        other = self.index.get(key)
        if other is not None and other != gpu_id:
            raise CatalogError(
                f"ambiguous GPU name {name!r}: claimed by {gpu_id!r} and {other!r} (as {self.origin[key]!r})"
            )
        self.index.setdefault(key, gpu_id)
        self.origin.setdefault(key, name)

    def find(self, name: str) -> str | None:
        for candidate in _candidates(name):
            key = _norm(candidate)
            for k in (key, _strip_vendor(key)):
                if k and k in self.index:
                    return self.index[k]
        return None

    def suggest(self, name: str, n: int = 3) -> tuple[str, ...]:
        """Closest ids: difflib ratio over the indexed names plus a shared-prefix (model number) bonus."""
        queries = {k for k in (_norm(c) for c in _candidates(name)) for k in (k, _strip_vendor(k)) if k}
        if not queries:
            return ()
        best: dict[str, float] = {}
        matcher = difflib.SequenceMatcher(autojunk=False)
        for key, gpu_id in self.index.items():
            matcher.set_seq1(key)
            for query in queries:
                matcher.set_seq2(query)
                if matcher.real_quick_ratio() + 0.4 <= best.get(gpu_id, 0.0):
                    continue
                prefix = len(os.path.commonprefix([key, query])) / len(query)
                score = matcher.ratio() + 0.4 * prefix
                if score > best.get(gpu_id, 0.0):
                    best[gpu_id] = score
        order = {s.id: i for i, s in enumerate(self.specs)}
        ranked = sorted(best, key=lambda gpu_id: (-best[gpu_id], order[gpu_id]))
        return tuple(ranked[:n])


def _candidates(name: str) -> tuple[str, ...]:
    raw = name.strip()
    unshared = _SHARED_SUFFIX.sub("", raw)
    unmig = _SHARED_SUFFIX.sub("", _MIG_SUFFIX.sub("", unshared))
    return tuple(dict.fromkeys((raw, unshared, unmig)))


def _parse_csv(text: str, source: str) -> tuple[GpuSpec, ...]:
    reader = csv.DictReader(io.StringIO(text))
    if tuple(reader.fieldnames or ()) != _COLUMNS:
        raise CatalogError(f"{source}: columns {reader.fieldnames} != expected {list(_COLUMNS)}")
    return tuple(_parse_row(i, raw, source) for i, raw in enumerate(reader, start=2))


# The catalog this process reads (one slot, filled on first use): the packaged rows, then a
# site's own (`add_gpus` replaces it with the extended catalog it validated).
_IN_USE: list[_Catalog] = []


def _catalog() -> _Catalog:
    if not _IN_USE:
        text = resources.files(__package__ or "fleetwise.catalog").joinpath(_CSV_NAME).read_text("utf-8")
        _IN_USE.append(_Catalog(_parse_csv(text, _CSV_NAME)))
    return _IN_USE[0]


def add_gpus(csv_text: str, source: str) -> tuple[GpuSpec, ...]:
    """Add a site's catalog rows (CSV text with ``gpus.csv``'s columns, one sourced row per
    GPU the packaged catalog lacks) for this process; returns the rows added.

    The catalog is extended, never overridden: a row whose id is taken, or a name another row
    already resolves, raises `CatalogError` naming `source` and the line, and nothing is added.
    Adding a row that is already there, identical, is a no-op (so a process may add its file
    twice)."""
    have = _catalog().by_id
    new = []
    for spec in _parse_csv(csv_text, source):
        if have.get(spec.id) == spec:
            continue
        if spec.id in have:
            raise CatalogError(f"{source}: GPU id {spec.id!r} is in the catalog already (rows add GPUs, "
                               "they do not change one)")
        new.append(spec)
    extended = _Catalog((*_catalog().specs, *new))  # validates: ambiguous names raise here
    _IN_USE[0] = extended
    _resolve.cache_clear()
    _suggest.cache_clear()
    return tuple(new)


# --- public API ----------------------------------------------------------------------------


@lru_cache(maxsize=4096)
def _resolve(name: str) -> str | None:
    return _catalog().find(name)


# An unknown model comes once per sample of every GPU of that model (each a dead letter), and a
# suggestion is a fuzzy match over every indexed name: ~3 ms, which made a replay of a fleet
# with one model missing from the catalog run minutes instead of seconds.
@lru_cache(maxsize=1024)
def _suggest(name: str) -> tuple[str, ...]:
    return _catalog().suggest(name)


def lookup(name: str | GpuSpec) -> GpuSpec:
    """Resolve a short id, alias, canonical name, NVML/dcgm-exporter ``modelName`` or GFD label.

    Matching ignores case, whitespace, ``_`` and ``-``, a leading ``NVIDIA``/``Tesla``/``AMD
    Instinct``, a GFD ``-SHARED`` suffix and a MIG suffix (``-MIG-1g.10gb``; MIG slices resolve to
    the parent GPU). Raises ``UnknownGpuError`` listing the closest known ids.
    """
    if isinstance(name, GpuSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"GPU name must be a string, got {type(name).__name__}")
    gpu_id = _resolve(name)
    if gpu_id is None:
        raise UnknownGpuError(name, _suggest(name))
    return _catalog().by_id[gpu_id]


def parse_gpu_counts(spec: str) -> list[tuple[GpuSpec, int]]:
    """Parse ``"h100-sxm:16,b200:16"`` (any name `lookup` resolves) into (GpuSpec, count) pairs.

    The one parser of GPU specs: the planner and the simulator both use it. Raises
    `CatalogError` (a ValueError) naming the bad entry; unknown names list the closest ids.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CatalogError("GPU spec is empty; expected e.g. 'h100-sxm:16,b200:16'")
    out: list[tuple[GpuSpec, int]] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise CatalogError(f"GPU spec {spec!r} has an empty entry; expected NAME:COUNT,NAME:COUNT")
        name, _, count_text = part.rpartition(":")
        if not name:
            raise CatalogError(
                f"GPU spec entry {part!r} has no count; expected NAME:COUNT, e.g. 'h100-sxm:8'"
            )
        name, count_text = name.strip(), count_text.strip()
        try:
            count = int(count_text)
        except ValueError:
            raise CatalogError(
                f"GPU spec entry {part!r}: count {count_text!r} is not a whole number"
            ) from None
        if count < 1:
            raise CatalogError(f"GPU spec entry {part!r}: count must be at least 1, got {count}")
        try:
            out.append((lookup(name), count))
        except UnknownGpuError as exc:
            raise CatalogError(str(exc)) from None
    return out


def all_gpus() -> tuple[GpuSpec, ...]:
    """Every catalog entry, in catalog order (NVIDIA then AMD, each by year)."""
    return _catalog().specs


def catalog_rows(dtype: str = "bf16") -> list[dict[str, Any]]:
    """Plain dicts (JSON-ready) for display; ``capability_tflops`` is for ``dtype`` or None."""
    key = normalize_dtype(dtype)
    rows: list[dict[str, Any]] = []
    for spec in all_gpus():
        rows.append(
            {
                "id": spec.id,
                "name": spec.name,
                "vendor": spec.vendor,
                "family": spec.family,
                "year": spec.year,
                "memory_gb": spec.memory_gb,
                "memory_bw_tbs": spec.memory_bw_tbs,
                **{f"{d}_tflops": spec.peak_tflops[d] for d in DTYPES},
                "dtype": key,
                "capability_tflops": (round(spec.capability_tflops(key), 1) if spec.supports(key) else None),
                "efficiency": spec.efficiency,
                "nvlink_gbs": spec.nvlink_gbs,
                "nvlink_domain": spec.nvlink_domain,
                "pcie_gen": spec.pcie_gen,
                "tdp_w": spec.tdp_w,
                "form_factor": spec.form_factor,
                "nvml_names": list(spec.nvml_names),
                "source": spec.source,
                "estimate": spec.estimate,
            }
        )
    return rows


# Build and validate the index at import: an ambiguous or malformed catalog fails loudly here.
_catalog()
