"""GPU catalog: data completeness, name resolution, capability maths, rendering."""

from __future__ import annotations

import copy
import csv
import dataclasses
import io
import json
import pickle
import re
from importlib import resources

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from rich.table import Table

from fleetwise.catalog import (
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
)
from fleetwise.catalog import gpus as gpus_mod
from fleetwise.catalog.render import catalog_table

# The `name` column of ../shared/data/gpu_catalog_reference.csv (35 rows) and the row each is.
# Other tools (and trace generators) built from that file name GPUs this way.
REFERENCE_NAMES = {
    "NVIDIA V100 PCIe 16GB": "v100-pcie-16gb",
    "NVIDIA V100 PCIe 32GB": "v100-pcie-32gb",
    "NVIDIA V100 SXM2 32GB": "v100-sxm2-32gb",
    "NVIDIA T4": "t4",
    "NVIDIA A10": "a10",
    "NVIDIA A30": "a30",
    "NVIDIA A40": "a40",
    "NVIDIA A100 40GB PCIe": "a100-pcie-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA A100 40GB SXM4": "a100-sxm-40gb",
    "NVIDIA A100 80GB SXM4": "a100-sxm-80gb",
    "NVIDIA L4": "l4",
    "NVIDIA L40": "l40",
    "NVIDIA L40S": "l40s",
    "NVIDIA RTX 6000 Ada Generation": "rtx-6000-ada",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H100 SXM": "h100-sxm",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA H20": "h20",
    "NVIDIA GH200 (96GB HBM3)": "gh200",
    "NVIDIA GH200 (144GB HBM3e)": "gh200-144gb",
    "NVIDIA H200 SXM": "h200",
    "NVIDIA H200 NVL": "h200-nvl",
    "NVIDIA B100": "b100",
    "NVIDIA B200 (HGX)": "b200",
    "NVIDIA GB200 (per Blackwell GPU, NVL72/NVL4)": "gb200",
    "NVIDIA B300 (HGX, Blackwell Ultra)": "b300",
    "NVIDIA GB300 (per Blackwell Ultra GPU, NVL72)": "gb300",
    "NVIDIA Rubin (VR200, per GPU in Vera Rubin NVL72)": "rubin",
    "NVIDIA RTX PRO 6000 Blackwell Server Edition": "rtx-pro-6000-blackwell",
    "AMD Instinct MI250X": "mi250x",
    "AMD Instinct MI300X": "mi300x",
    "AMD Instinct MI325X": "mi325x",
    "AMD Instinct MI350X": "mi350x",
    "AMD Instinct MI355X": "mi355x",
}
REFERENCE_IDS = set(REFERENCE_NAMES.values())


def _csv_rows() -> list[dict[str, str]]:
    text = resources.files("fleetwise.catalog").joinpath("gpus.csv").read_text("utf-8")
    return list(csv.DictReader(text.splitlines()))


# --- data -----------------------------------------------------------------------------------


def test_at_least_19_entries_each_sourced_with_positive_memory() -> None:
    specs = all_gpus()
    assert len(specs) >= 19
    assert {s.id for s in specs} >= REFERENCE_IDS  # all 35 reference rows are present
    for s in specs:
        assert s.source.startswith("https://"), s.id
        assert s.memory_gb > 0 and s.memory_bytes == int(round(s.memory_gb * 1e9)), s.id
        assert s.memory_bw_tbs > 0 and s.tdp_w > 0, s.id
        assert s.family in FAMILY_EFFICIENCY and s.efficiency == FAMILY_EFFICIENCY[s.family]
        assert set(s.peak_tflops) == set(DTYPES)
        assert s.supports("bf16") or s.supports("fp16"), s.id
        assert s.nvlink_domain >= 1
        if s.nvlink_gbs == 0:
            assert s.nvlink_domain == 1, s.id


def test_ids_unique_and_catalog_order_is_vendor_then_year() -> None:
    specs = all_gpus()
    assert len({s.id for s in specs}) == len(specs)
    vendors = [s.vendor for s in specs]
    assert vendors == sorted(vendors, key=["NVIDIA", "AMD"].index)
    for a, b in zip(specs, specs[1:], strict=False):
        if a.vendor == b.vendor:
            assert a.year <= b.year, (a.id, b.id)


def test_fp16_equals_bf16_where_bf16_exists_and_volta_turing_fp16_from_notes() -> None:
    for s in all_gpus():
        if s.supports("bf16"):
            assert s.peak_tflops["fp16"] == s.peak_tflops["bf16"], s.id
    assert lookup("v100-sxm2-32gb").peak("fp16") == 125
    assert lookup("v100-pcie-16gb").peak("fp16") == 112
    assert lookup("t4").peak("fp16") == 65


def test_fp8_only_from_hopper_and_ada_onwards() -> None:
    for s in all_gpus():
        if s.family in {"volta", "turing", "ampere", "cdna2"}:
            assert not s.supports("fp8"), s.id
        if s.family in {"hopper", "ada", "blackwell", "rubin", "cdna3", "cdna4"}:
            assert s.peak("fp8") == pytest.approx(2 * s.peak("bf16"), rel=0.02), s.id


def test_estimates_are_flagged() -> None:
    assert lookup("rubin").estimate
    assert lookup("mi350x").estimate
    assert lookup("a30").estimate
    assert not lookup("h100-sxm").estimate
    assert not lookup("b200").estimate


def test_nvlink_domains() -> None:
    assert lookup("h100-sxm").nvlink_domain == 8
    assert lookup("b200").nvlink_domain == 8
    assert lookup("gb200").nvlink_domain == 72
    assert lookup("gb300").nvlink_domain == 72
    assert lookup("a100-pcie-40gb").nvlink_domain == 2
    assert lookup("l40s").nvlink_domain == 1
    assert lookup("t4").nvlink_domain == 1


def test_mi250x_gcd_is_half_a_package() -> None:
    pkg, gcd = lookup("mi250x"), lookup("mi250x-gcd")
    assert gcd.memory_gb * 2 == pkg.memory_gb
    assert gcd.peak("bf16") * 2 == pytest.approx(pkg.peak("bf16"))


# --- lookup ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "gpu_id"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"),
        ("Tesla V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("Tesla V100-SXM2-16GB", "v100-sxm2-16gb"),
        ("NVIDIA B200", "b200"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100 80GB PCIe", "a100-pcie-80gb"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("NVIDIA GH200 144G HBM3e", "gh200-144gb"),
        ("NVIDIA B300 SXM6 AC", "b300"),
        ("Tesla T4", "t4"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L40", "l40"),
        ("NVIDIA A10", "a10"),
        ("A100-SXM4-40GB", "a100-sxm-40gb"),  # older drivers: no "NVIDIA " prefix
    ],
)
def test_lookup_nvml_names(name: str, gpu_id: str) -> None:
    assert lookup(name).id == gpu_id


@pytest.mark.parametrize(
    ("label", "gpu_id"),
    [
        ("NVIDIA-H100-80GB-HBM3", "h100-sxm"),
        ("NVIDIA-A100-SXM4-80GB", "a100-sxm-80gb"),
        ("NVIDIA-A100-SXM4-80GB-SHARED", "a100-sxm-80gb"),
        ("NVIDIA-A100-80GB-PCIe-MIG-1g.10gb", "a100-pcie-80gb"),
        ("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb-SHARED", "a100-sxm-40gb"),
        ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb+me", "h100-sxm"),
        ("NVIDIA-GH200-480GB", "gh200"),
        ("Tesla-V100-SXM2-32GB", "v100-sxm2-32gb"),
        ("AMD_Instinct_MI300X_OAM", "mi300x"),
    ],
)
def test_lookup_gfd_labels(label: str, gpu_id: str) -> None:
    assert lookup(label).id == gpu_id


@pytest.mark.parametrize(
    ("name", "gpu_id"),
    [
        ("h100-sxm", "h100-sxm"),
        ("H100_SXM", "h100-sxm"),
        ("  h100 sxm ", "h100-sxm"),
        ("a100-80gb", "a100-sxm-80gb"),
        ("A100 80GB", "a100-sxm-80gb"),
        ("b200", "b200"),
        ("gb300", "gb300"),
        ("rubin", "rubin"),
        ("vr200", "rubin"),
        ("mi300x", "mi300x"),
        ("AMD Instinct MI355X", "mi355x"),
        ("NVIDIA H100 SXM", "h100-sxm"),
        ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
    ],
)
def test_lookup_ids_aliases_and_canonical_names(name: str, gpu_id: str) -> None:
    assert lookup(name).id == gpu_id


@pytest.mark.parametrize(("name", "gpu_id"), sorted(REFERENCE_NAMES.items()))
def test_the_reference_files_names_resolve_to_their_rows(name: str, gpu_id: str) -> None:
    # "NVIDIA B200 (HGX)" and the like: a sample named so was dead-lettered as an unknown GPU.
    assert lookup(name).id == gpu_id


def test_every_csv_name_resolves_back_to_its_own_row() -> None:
    rows = _csv_rows()
    assert len(rows) == len(all_gpus())
    claimed: dict[str, str] = {}
    for row in rows:
        names = [row["id"], row["name"]]
        for col in ("aliases", "nvml_names", "gfd_labels"):
            names += [n for n in row[col].split(";") if n]
        for name in names:
            assert lookup(name).id == row["id"], name
            assert lookup(name.upper()).id == row["id"], name
            key = gpus_mod._norm(name)
            assert claimed.setdefault(key, row["id"]) == row["id"], f"{name!r} is ambiguous"
        for label in row["gfd_labels"].split(";"):
            if label:
                assert lookup(label + "-SHARED").id == row["id"]
        # GFD labels are the NVML names with spaces replaced by '-'
        gfd = set(row["gfd_labels"].split(";"))
        for nvml in filter(None, row["nvml_names"].split(";")):
            assert nvml.replace(" ", "-") in gfd


def test_lookup_returns_the_same_object_and_accepts_a_spec() -> None:
    spec = lookup("h100-sxm")
    assert lookup("NVIDIA H100 80GB HBM3") is spec
    assert lookup(spec) is spec


def test_unknown_gpu_lists_closest_ids() -> None:
    with pytest.raises(UnknownGpuError) as info:
        lookup("H100 SMX")
    err = info.value
    assert isinstance(err, KeyError)
    assert err.suggestions[0] == "h100-sxm"
    assert len(err.suggestions) == 3
    assert str(err).startswith("unknown GPU 'H100 SMX': closest known ids: h100-sxm, ")
    with pytest.raises(UnknownGpuError) as info:
        lookup("v100")  # ambiguous on purpose: three V100 variants
    assert all(s.startswith("v100") for s in info.value.suggestions)
    with pytest.raises(UnknownGpuError):
        lookup("NVIDIA GeForce RTX 4090")
    with pytest.raises(UnknownGpuError):
        lookup("")


def test_lookup_rejects_non_strings() -> None:
    with pytest.raises(TypeError):
        lookup(80)  # type: ignore[arg-type]


@given(st.text(max_size=40))
def test_lookup_never_crashes_unexpectedly(name: str) -> None:
    try:
        spec = lookup(name)
    except UnknownGpuError as err:
        assert all(s in {g.id for g in all_gpus()} for s in err.suggestions)
    else:
        assert isinstance(spec, GpuSpec)


def test_ambiguous_names_are_rejected_when_building_the_index() -> None:
    a, b = lookup("h100-sxm"), lookup("h200")
    clash = dataclasses.replace(b, nvml_names=("NVIDIA H100 80GB HBM3",))
    with pytest.raises(CatalogError, match="ambiguous"):
        gpus_mod._Catalog((a, clash))
    with pytest.raises(CatalogError, match="duplicate"):
        gpus_mod._Catalog((a, a))


# --- capability -----------------------------------------------------------------------------


def test_capability_ordering_bf16() -> None:
    b200, h100, a100 = lookup("b200"), lookup("h100-sxm"), lookup("a100-sxm-80gb")
    assert b200.capability_tflops("bf16") > h100.capability_tflops("bf16") > a100.capability_tflops("bf16")
    for s in (b200, h100, a100):
        assert s.capability_tflops("bf16") == pytest.approx(s.peak("bf16") * s.efficiency)
        assert 0 < s.capability_tflops("bf16") < s.peak("bf16")


def test_mi300x_trails_h200_despite_higher_peak() -> None:
    mi300x, h200 = lookup("mi300x"), lookup("h200")
    assert mi300x.peak("bf16") > h200.peak("bf16")
    assert mi300x.capability_tflops("bf16") < h200.capability_tflops("bf16")


def test_b200_over_h100_bf16_peak_ratio() -> None:
    ratio = lookup("b200").peak("bf16") / lookup("h100-sxm").peak("bf16")
    assert ratio == pytest.approx(2.27, abs=0.01)


def test_v100_has_no_bf16_but_fp16() -> None:
    v100 = lookup("Tesla V100-SXM2-32GB")
    assert not v100.supports("bf16")
    assert v100.supports("fp16") and v100.supports("float16")
    assert v100.dtypes == ("fp16", "fp32")
    assert v100.capability_tflops("fp16") == pytest.approx(125 * v100.efficiency)
    with pytest.raises(UnsupportedDtypeError) as info:
        v100.capability_tflops("bf16")
    assert isinstance(info.value, ValueError)
    assert "v100-sxm2-32gb" in str(info.value) and "bf16" in str(info.value)
    assert info.value.gpu == "v100-sxm2-32gb" and info.value.dtype == "bf16"


def test_fp8_unsupported_on_a100() -> None:
    with pytest.raises(UnsupportedDtypeError, match="a100-sxm-80gb.*fp8"):
        lookup("a100-sxm-80gb").capability_tflops("fp8")
    assert lookup("h100-sxm").capability_tflops("fp8") > lookup("h100-sxm").capability_tflops("bf16")


def test_dtype_names() -> None:
    assert normalize_dtype("BF16") == "bf16"
    assert normalize_dtype("bfloat16") == "bf16"
    assert normalize_dtype("float32") == "fp32"
    assert normalize_dtype("fp8_e4m3") == "fp8"
    with pytest.raises(UnsupportedDtypeError, match="unknown dtype"):
        normalize_dtype("int3")
    assert not lookup("h100-sxm").supports("int3")


def test_family_efficiency_values() -> None:
    assert 0.41 <= FAMILY_EFFICIENCY["hopper"] <= 0.48  # Megatron H100 41-48% MFU
    assert FAMILY_EFFICIENCY["ampere"] > FAMILY_EFFICIENCY["hopper"]
    assert FAMILY_EFFICIENCY["cdna3"] < FAMILY_EFFICIENCY["hopper"]
    assert all(0 < v < 1 for v in FAMILY_EFFICIENCY.values())
    with pytest.raises(TypeError):
        FAMILY_EFFICIENCY["hopper"] = 1.0  # type: ignore[index]


def test_spec_is_immutable_hashable_and_serialisable() -> None:
    spec = lookup("h100-sxm")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.memory_gb = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.peak_tflops["bf16"] = 1.0  # type: ignore[index]
    assert {spec: 1}[lookup("h100")] == 1
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec
    as_dict = dataclasses.asdict(spec)
    assert json.loads(json.dumps(as_dict))["peak_tflops"]["bf16"] == pytest.approx(989.4)


def test_custom_spec_normalises_peaks() -> None:
    spec = GpuSpec(
        id="test-gpu", name="Test GPU", vendor="NVIDIA", family="hopper", year=2030,
        memory_gb=100, memory_bw_tbs=5, peak_tflops={"bfloat16": 1000}, nvlink_gbs=0,
        nvlink_domain=1, pcie_gen=5, tdp_w=500, form_factor="test", efficiency=0.5,
    )  # fmt: skip
    assert dict(spec.peak_tflops) == {"bf16": 1000.0, "fp16": 0.0, "fp8": 0.0, "fp32": 0.0}
    assert spec.capability_tflops("bf16") == 500.0


# --- rows and rendering ---------------------------------------------------------------------


def test_catalog_rows_are_plain_json() -> None:
    rows = catalog_rows()
    assert len(rows) == len(all_gpus())
    json.dumps(rows)
    by_id = {r["id"]: r for r in rows}
    h100 = by_id["h100-sxm"]
    for key in (
        "id", "name", "vendor", "family", "year", "memory_gb", "memory_bw_tbs", "bf16_tflops",
        "fp16_tflops", "fp8_tflops", "fp32_tflops", "capability_tflops", "efficiency",
        "nvlink_gbs", "nvlink_domain", "tdp_w", "source", "estimate",
    ):  # fmt: skip
        assert key in h100
    assert h100["capability_tflops"] == pytest.approx(989.4 * FAMILY_EFFICIENCY["hopper"], abs=0.1)
    assert by_id["v100-sxm2-32gb"]["capability_tflops"] is None
    assert catalog_rows("fp16")[0]["capability_tflops"] is not None
    with pytest.raises(ValueError):
        catalog_rows("int3")


def test_catalog_table_renders() -> None:
    table = catalog_table(catalog_rows())
    assert isinstance(table, Table)
    assert table.row_count == len(all_gpus())
    console = Console(width=200, record=True, color_system=None)
    console.print(table)
    text = console.export_text()
    assert "h100-sxm" in text and "rubin*" in text and "mi300x" in text
    assert isinstance(catalog_table([]), Table)


def test_parse_gpu_counts_is_the_one_spec_parser():
    from fleetwise.catalog import CatalogError, parse_gpu_counts

    parts = parse_gpu_counts("h100-sxm:16, NVIDIA B200:8")
    assert [(g.id, n) for g, n in parts] == [("h100-sxm", 16), ("b200", 8)]
    with pytest.raises(CatalogError, match="closest known ids"):
        parse_gpu_counts("h100-smx:4")
    with pytest.raises(CatalogError, match="has no count"):
        parse_gpu_counts("h100-sxm")


# --- a site's own rows (FLEETWISE_CATALOG_EXTRA) ------------------------------------------------

_SITE_ROW = {  # a made-up GPU: the test is about the mechanism, not a part's figures
    "id": "tx1-80gb", "name": "Testco TX1 80GB", "vendor": "NVIDIA", "family": "hopper", "year": "2025",
    "memory_gb": "80", "memory_bw_tbs": "3.0", "bf16_tflops": "700", "fp16_tflops": "700",
    "fp8_tflops": "1400", "fp32_tflops": "50", "nvlink_gbs": "400", "nvlink_domain": "8", "pcie_gen": "5",
    "tdp_w": "650", "form_factor": "SXM", "aliases": "tx1", "nvml_names": "NVIDIA TX1 80GB HBM3",
    "gfd_labels": "NVIDIA-TX1-80GB-HBM3", "source_url": "https://example.com/tx1-datasheet",
    "estimate": "false", "notes": "test row",
}  # fmt: skip


def _site_csv(*rows: dict[str, str]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=gpus_mod._COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


@pytest.fixture
def site_catalog():
    """The catalog as packaged again after the test (site rows are process-wide)."""
    yield
    gpus_mod._IN_USE.clear()
    gpus_mod._resolve.cache_clear()
    gpus_mod._suggest.cache_clear()
    from fleetwise.predictors import stragglers

    stragglers._model_id.cache_clear()


def test_a_sites_rows_join_the_catalog_and_resolve_by_every_name(site_catalog) -> None:
    with pytest.raises(UnknownGpuError):
        lookup("NVIDIA TX1 80GB HBM3")
    with pytest.raises(UnknownGpuError) as before_rows:
        lookup("Testco TX1")  # unknown before and after; its closest ids follow the catalog
    assert "tx1-80gb" not in before_rows.value.suggestions
    before = len(all_gpus())
    added = add_gpus(_site_csv(_SITE_ROW), "site.csv")
    assert [s.id for s in added] == ["tx1-80gb"]
    assert len(all_gpus()) == before + 1
    for name in ("NVIDIA TX1 80GB HBM3", "NVIDIA-TX1-80GB-HBM3-SHARED", "tx1", "Testco TX1 80GB"):
        assert lookup(name).id == "tx1-80gb", name
    assert lookup("tx1").tdp_w == 650 and lookup("h100-sxm").id == "h100-sxm"
    with pytest.raises(UnknownGpuError) as after_rows:
        lookup("Testco TX1")
    assert after_rows.value.suggestions[0] == "tx1-80gb"
    assert add_gpus(_site_csv(_SITE_ROW), "site.csv") == ()  # the same file again: nothing new


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tdp_w": "650", "notes": "changed"}, "GPU id 'tx1-80gb' is in the catalog already"),
        ({"id": "h100-sxm"}, "GPU id 'h100-sxm' is in the catalog already"),
        ({"id": "tx2", "aliases": "", "nvml_names": "NVIDIA H100 80GB HBM3", "gfd_labels": ""},
         "ambiguous GPU name 'NVIDIA H100 80GB HBM3'"),
        ({"id": "tx3", "aliases": "", "nvml_names": "", "gfd_labels": "", "tdp_w": "lots"},
         "site.csv line 2: tdp_w='lots' is not a number"),
    ],
)  # fmt: skip
def test_a_sites_rows_add_gpus_and_never_change_or_shadow_one(site_catalog, change, message) -> None:
    if change.get("notes") == "changed":
        add_gpus(_site_csv(_SITE_ROW), "site.csv")
    before = len(all_gpus())
    with pytest.raises(CatalogError, match=re.escape(message)):
        add_gpus(_site_csv({**_SITE_ROW, **change}), "site.csv")
    assert len(all_gpus()) == before  # nothing of the refused file was added
    assert lookup("NVIDIA H100 80GB HBM3").id == "h100-sxm"


def test_replay_reads_a_site_gpu_from_the_catalog_file_named_in_the_environment(
        site_catalog, tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from fleetwise.cli import app

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(
        json.dumps({"ts": 1764547200.0 + 60 * i, "node": "n1", "gpu": 0, "model": "NVIDIA TX1 80GB HBM3",
                    "metrics": {"DCGM_FI_DEV_GPU_TEMP": 60, "DCGM_FI_DEV_POWER_USAGE": 400.0}}) + "\n"
        for i in range(30)))
    args = ["replay", str(trace), "--out", str(tmp_path / "d.jsonl"), "--json"]
    unknown = CliRunner().invoke(app, args)
    assert unknown.exit_code == 0
    assert json.loads(unknown.stdout)["samples"] == 0 and json.loads(unknown.stdout)["bad_lines"] == 30
    listed = " ".join(CliRunner().invoke(app, args[:-1]).output.split())  # each bad line and why
    assert "unknown GPU 'NVIDIA TX1 80GB HBM3'" in listed
    assert "FLEETWISE_CATALOG_EXTRA" in listed  # what to do about it
    site = tmp_path / "site.csv"
    site.write_text(_site_csv(_SITE_ROW))
    monkeypatch.setenv("FLEETWISE_CATALOG_EXTRA", str(site))
    known = CliRunner().invoke(app, args)
    assert known.exit_code == 0, known.output
    assert json.loads(known.stdout)["samples"] == 30 and json.loads(known.stdout)["bad_lines"] == 0
    monkeypatch.setenv("FLEETWISE_CATALOG_EXTRA", str(tmp_path / "missing.csv"))
    missing = CliRunner().invoke(app, args)
    assert missing.exit_code == 2 and "FLEETWISE_CATALOG_EXTRA: cannot read" in missing.output
