"""Where a node sits and what the operator says about it: rack, site, power budget, labels.

Values come from (highest first) explicit options, then Kubernetes node labels passed in as
``--label k=v`` (or ``FLEETWISE_LABELS``), then nothing. Pure parsing: no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from fleetwise.schemas import Nic

# Label keys read for placement, first match wins. `topology.kubernetes.io/zone` is the
# well-known Kubernetes label for a failure domain (kubernetes.io/docs/reference/labels-annotations-taints);
# racks have no well-known label, so ours (`fleetwise.io/...`) come first and common ones after.
RACK_LABELS = ("fleetwise.io/rack", "topology.kubernetes.io/rack", "rack")
SITE_LABELS = ("fleetwise.io/site", "topology.kubernetes.io/zone", "site")
RACK_POWER_LABELS = ("fleetwise.io/rack-power-w",)
NIC_KINDS = ("infiniband", "roce", "ethernet", "efa", "other")


class AgentConfigError(ValueError):
    """Bad agent configuration; the message names the option and the bad value."""


@dataclass
class NodeConfig:
    """What the operator tells the agent about its node (everything optional)."""

    node: str | None = None
    rack: str | None = None
    site: str | None = None
    rack_power_w: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    nics: list[Nic] | None = None  # None: read /sys/class/net
    nvlink_groups: list[list[int]] | None = None  # None: observed topology or the catalog's

    def resolved(self) -> NodeConfig:
        """A copy with rack/site/power filled from labels where no explicit value was given."""
        rack = self.rack or _first_label(self.labels, RACK_LABELS)
        site = self.site or _first_label(self.labels, SITE_LABELS)
        power = self.rack_power_w
        if power is None:
            text = _first_label(self.labels, RACK_POWER_LABELS)
            if text is not None:
                power = parse_power(text, f"label {RACK_POWER_LABELS[0]}")
        return NodeConfig(self.node, rack, site, power, dict(self.labels), self.nics, self.nvlink_groups)


def _first_label(labels: dict[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = labels.get(key)
        if value:
            return value
    return None


def parse_power(text: str | float, what: str = "--rack-power-w") -> float:
    """A positive, finite wattage."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise AgentConfigError(f"{what} must be a number of watts, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise AgentConfigError(f"{what} must be a positive number of watts, got {text!r}")
    return value


def parse_labels(items: list[str] | None, env_text: str | None = None) -> dict[str, str]:
    """`k=v` items (and a comma-separated `k=v,k=v` env string) into a dict; items win."""
    labels: dict[str, str] = {}
    sources: list[tuple[str, str]] = []
    if env_text:
        sources += [("FLEETWISE_LABELS", part) for part in env_text.split(",") if part.strip()]
    sources += [("--label", item) for item in items or []]
    for where, item in sources:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise AgentConfigError(
                f"{where} {item!r} is not KEY=VALUE (e.g. topology.kubernetes.io/zone=eu-1)"
            )
        labels[key] = value.strip()
    return labels


def parse_nic(text: str) -> Nic:
    """`NAME:GBPS[:KIND]` (KIND one of infiniband, roce, ethernet, efa, other) into a Nic."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise AgentConfigError(f"--nic {text!r} is not NAME:GBPS[:KIND] (e.g. mlx5_0:400:infiniband)")
    try:
        speed = float(parts[1])
    except ValueError:
        raise AgentConfigError(f"--nic {text!r}: speed {parts[1]!r} is not a number of Gb/s") from None
    if not math.isfinite(speed) or speed <= 0:
        raise AgentConfigError(f"--nic {text!r}: speed must be > 0 Gb/s")
    kind = parts[2].lower() if len(parts) == 3 else "ethernet"
    if kind not in NIC_KINDS:
        raise AgentConfigError(f"--nic {text!r}: kind {kind!r} is not one of {', '.join(NIC_KINDS)}")
    return Nic(name=parts[0], speed_gbps=speed, kind=kind, rdma=kind in ("infiniband", "roce", "efa"))


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_nvlink_groups(text: str) -> list[list[int]]:
    """`0-3;4-7` or `0,1,2,3;4,5,6,7` (groups separated by `;`) into lists of GPU indexes."""
    groups: list[list[int]] = []
    seen: set[int] = set()
    for raw_group in text.split(";"):
        if not raw_group.strip():
            continue
        group: list[int] = []
        for raw in raw_group.split(","):
            item = raw.strip()
            m = _RANGE.match(item)
            if not m:
                raise AgentConfigError(
                    f"--nvlink-groups {text!r}: {item!r} is not an index or a range like 0-3"
                )
            lo = int(m.group(1))
            hi = int(m.group(2)) if m.group(2) is not None else lo
            if hi < lo:
                raise AgentConfigError(f"--nvlink-groups {text!r}: range {item!r} runs backwards")
            for idx in range(lo, hi + 1):
                if idx in seen:
                    raise AgentConfigError(f"--nvlink-groups {text!r}: GPU {idx} is in two groups")
                seen.add(idx)
                group.append(idx)
        groups.append(group)
    if not groups:
        raise AgentConfigError(f"--nvlink-groups {text!r} lists no GPUs; expected e.g. 0-3;4-7")
    return groups


_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")


def parse_bootstrap(text: str) -> str:
    """`host:port[,host:port...]`, checked; returns it without blanks around entries."""
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise AgentConfigError("--bootstrap is empty; expected host:port[,host:port...]")
    for entry in entries:
        m = _HOSTPORT.match(entry)
        if not m or not 0 < int(m.group(2)) < 65536:
            raise AgentConfigError(f"--bootstrap entry {entry!r} is not host:port (port 1-65535)")
    return ",".join(entries)
