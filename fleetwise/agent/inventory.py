"""The node inventory the agent publishes at start: GPUs, NVLink/PCIe topology, NICs, placement.

The collector says what GPUs it sees (`GpuInventory` items, with NVLink peers when it can
observe them); this module adds the topology it cannot observe from the catalog or the
operator's config, the NICs from sysfs (or config), and rack/site/power from config or labels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path

from fleetwise.agent.config import NodeConfig
from fleetwise.catalog import GpuSpec, UnknownGpuError, lookup
from fleetwise.schemas import GpuInventory, Nic, NodeInventory

# PCIe x16 bandwidth per direction, GB/s, by generation: 8 / 16 / 32 / 64 GT/s per lane x 16
# lanes (PCI-SIG base specs 3.0-6.0), rounded as vendors quote it (same table as fleetwise.sim).
PCIE_X16_GBS = {3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}
# ARPHRD_INFINIBAND in linux/if_arp.h: /sys/class/net/<if>/type of an IPoIB interface.
ARPHRD_INFINIBAND = 32

_RATE = re.compile(r"^\s*([0-9.]+)\s*Gb/sec")


def catalog_spec(model: str) -> GpuSpec | None:
    """The catalog entry for an NVML/DCGM model name, or None when the catalog does not know it."""
    try:
        return lookup(model)
    except (UnknownGpuError, TypeError):
        return None


def catalog_nvlink_groups(spec: GpuSpec | None, indexes: list[int]) -> list[list[int]]:
    """NVLink domains the catalog implies: consecutive GPUs in groups of `nvlink_domain`.

    An assumption used only when the collector cannot see the topology (dcgm, sim); SXM boards
    wire all GPUs of a baseboard together, PCIe cards with a bridge only in pairs.
    """
    if spec is None or spec.nvlink_gbs <= 0 or spec.nvlink_domain <= 1:
        return []
    ordered = sorted(indexes)
    size = spec.nvlink_domain
    return [ordered[i : i + size] for i in range(0, len(ordered), size) if len(ordered[i : i + size]) > 1]


def groups_from_peers(peers: Mapping[int, Iterable[int]]) -> list[list[int]]:
    """Connected components of the observed NVLink peer graph (singletons left out)."""
    adjacency: dict[int, set[int]] = {i: set() for i in peers}
    for i, ps in peers.items():
        for p in ps:
            adjacency.setdefault(i, set()).add(p)
            adjacency.setdefault(p, set()).add(i)
    seen: set[int] = set()
    groups: list[list[int]] = []
    for start in sorted(adjacency):
        if start in seen:
            continue
        stack, comp = [start], []
        seen.add(start)
        while stack:
            cur = stack.pop()
            comp.append(cur)
            for nxt in adjacency[cur]:
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        if len(comp) > 1:
            groups.append(sorted(comp))
    return groups


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_sys_nics(net_root: Path = Path("/sys/class/net"),
                  ib_root: Path = Path("/sys/class/infiniband")) -> list[Nic]:
    """NICs from sysfs: active RDMA ports (InfiniBand, RoCE, EFA) and physical Ethernet links.

    RDMA ports come from /sys/class/infiniband/<dev>/ports/<n>/{state,rate,link_layer}; a netdev
    that belongs to an RDMA device (device/net/<if>) or is IPoIB is not counted twice. Virtual
    interfaces (no `device` link: lo, bridges, veth, ifb) and links without a speed are skipped.
    """
    nics: list[Nic] = []
    rdma_netdevs: set[str] = set()
    if ib_root.is_dir():
        for dev in sorted(p for p in ib_root.iterdir()):
            net_dir = dev / "device" / "net"
            if net_dir.is_dir():
                rdma_netdevs.update(p.name for p in net_dir.iterdir())
            ports = sorted((dev / "ports").iterdir()) if (dev / "ports").is_dir() else []
            for port in ports:
                if "ACTIVE" not in (_read(port / "state") or ""):
                    continue
                m = _RATE.match(_read(port / "rate") or "")
                if not m or float(m.group(1)) <= 0:
                    continue
                layer = (_read(port / "link_layer") or "").lower()
                if dev.name.startswith("efa"):
                    kind = "efa"
                elif layer == "infiniband":
                    kind = "infiniband"
                elif layer == "ethernet":
                    kind = "roce"
                else:
                    kind = "other"
                name = dev.name if len(ports) == 1 else f"{dev.name}/{port.name}"
                nics.append(Nic(name=name, speed_gbps=float(m.group(1)), kind=kind, rdma=True))
    if net_root.is_dir():
        for iface in sorted(net_root.iterdir()):
            if iface.name == "lo" or iface.name in rdma_netdevs or not (iface / "device").exists():
                continue
            if _read(iface / "type") == str(ARPHRD_INFINIBAND):
                continue
            try:
                speed_mbps = float(_read(iface / "speed") or "")
            except ValueError:
                continue
            if speed_mbps <= 0:  # -1 when the link is down or the driver does not say
                continue
            nics.append(Nic(name=iface.name, speed_gbps=speed_mbps / 1000.0, kind="ethernet", rdma=False))
    return nics


def build_inventory(
    ts: float,
    node: str,
    gpus: list[GpuInventory],
    config: NodeConfig,
    nics: list[Nic],
    *,
    labels: Mapping[str, str] | None = None,
    topology_observed: bool = False,
) -> NodeInventory:
    """Assemble a NodeInventory. NVLink groups: config, else observed peers (`topology_observed`:
    the collector saw the links, so no peers means no NVLink), else the catalog's assumption."""
    config = config.resolved()
    specs = [catalog_spec(g.model) for g in gpus]
    first = next((s for s in specs if s is not None), None)
    indexes = [g.index for g in gpus]
    if config.nvlink_groups is not None:
        groups = [list(g) for g in config.nvlink_groups]
    elif topology_observed or any(g.nvlink_peers for g in gpus):
        groups = groups_from_peers({g.index: g.nvlink_peers for g in gpus})
    else:
        # One model per node is the norm; mixed boards get no assumed NVLink.
        same_model = len({g.model for g in gpus}) == 1
        groups = catalog_nvlink_groups(first, indexes) if same_model else []
    out_gpus = []
    for g, spec in zip(gpus, specs, strict=True):
        peers = g.nvlink_peers or sorted({p for grp in groups if g.index in grp for p in grp if p != g.index})
        memory = g.memory_gb if g.memory_gb is not None else (spec.memory_gb if spec else None)
        out_gpus.append(g.model_copy(update={"nvlink_peers": peers, "memory_gb": memory}))
    all_labels = dict(config.labels)
    all_labels.update(labels or {})
    if first is not None:
        all_labels.setdefault("fleetwise.io/catalog-id", first.id)
    return NodeInventory(
        ts=ts,
        node=node,
        rack=config.rack,
        site=config.site,
        rack_power_budget_w=config.rack_power_w,
        gpus=out_gpus,
        nvlink_groups=groups,
        nvlink_gbs=(first.nvlink_gbs or None) if first and groups else None,
        pcie_gbs=PCIE_X16_GBS.get(first.pcie_gen) if first else None,
        nics=nics,
        labels=all_labels,
    )
