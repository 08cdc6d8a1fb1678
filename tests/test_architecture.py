"""The layout is the architecture (DESIGN.md): core packages are plain code over plain data.

Checked statically over the source, so an import added in a rarely run branch is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "fleetwise"
# Each core package and the fleetwise packages it may import (the one-way direction of DESIGN.md).
CORE = {
    "schemas": {"schemas"},
    "catalog": {"schemas", "catalog"},
    "planner": {"schemas", "catalog", "planner"},
    "predictors": {"schemas", "catalog", "planner", "predictors"},
    "actuators": {"schemas", "catalog", "planner", "predictors", "actuators"},
}
# Transports, cluster clients and frameworks belong to the adapters (streams, agent, training, kube).
FOREIGN = {"faust", "aiokafka", "kafka", "confluent_kafka", "kubernetes", "torch", "socket", "subprocess"}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(CORE))
def test_core_packages_import_no_adapter_transport_or_framework(package: str) -> None:
    wrong = []
    for path in sorted((PKG / package).rglob("*.py")):
        for line, name in _imports(path):
            top, _, rest = name.partition(".")
            sub = rest.partition(".")[0]
            if top in FOREIGN or (top == "fleetwise" and sub not in CORE[package]):
                wrong.append(f"{path.relative_to(PKG.parent)}:{line} imports {name}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", sorted(CORE))
def test_core_packages_do_not_read_the_environment(package: str) -> None:
    """Settings reach the core as arguments; the adapters read the environment (streams.keys)."""
    wrong = []
    for path in sorted((PKG / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
                    and node.attr in {"environ", "getenv", "putenv"}):
                wrong.append(f"{path.relative_to(PKG.parent)}:{node.lineno} os.{node.attr}")
    assert not wrong, "\n".join(wrong)
