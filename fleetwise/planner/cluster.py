"""The GPUs a plan runs on: slots (node, GPU index, catalog spec, NVLink domain) and links."""

from __future__ import annotations

from dataclasses import dataclass, field

from fleetwise.catalog import GpuSpec, UnknownGpuError, lookup, parse_gpu_counts
from fleetwise.schemas import NodeInventory

# Default NIC bandwidth per node: one 400 Gb/s port (ConnectX-7 / NDR InfiniBand) = 50 GB/s.
DEFAULT_NETWORK_GBS = 50.0

# Usable PCIe x16 bandwidth per direction, GB/s, by generation (PCI-SIG: 8, 16, 32, 64 GT/s
# per lane for gen 3..6, 128b/130b coding -> ~15.8, 31.5, 63, 121 GB/s; rounded).
PCIE_X16_GBS = {3: 16.0, 4: 32.0, 5: 64.0, 6: 128.0}

# Nodes of a `parse_gpu_spec` cluster hold 8 GPUs (HGX/DGX baseboards), or a whole NVLink
# domain when the catalog says it is larger (GB200/GB300 NVL72 racks).
DEFAULT_NODE_GPUS = 8


@dataclass(frozen=True)
class GpuSlot:
    """One GPU a plan may use.

    ``speed`` scales the catalog capability (1.0 = as the catalog says; 0.8 = measured 25%
    slower, i.e. a slowdown factor of 1.25).
    """

    node: str
    gpu: int
    spec: GpuSpec
    nvlink_group: int = 0
    rack: str | None = None
    speed: float = 1.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.node, self.gpu)


@dataclass
class Cluster:
    """A set of GPU slots and the bandwidth of the links between them."""

    slots: list[GpuSlot]
    node_network_gbs: dict[str, float] = field(default_factory=dict)
    node_nvlink_gbs: dict[str, float] = field(default_factory=dict)  # overrides the catalog
    node_pcie_gbs: dict[str, float] = field(default_factory=dict)  # overrides PCIE_X16_GBS
    default_network_gbs: float = DEFAULT_NETWORK_GBS

    def network_gbs(self, node: str) -> float:
        """NIC bandwidth of ``node`` (all ports together), GB/s."""
        return self.node_network_gbs.get(node, self.default_network_gbs)

    def nvlink_gbs(self, node: str, spec: GpuSpec) -> float:
        """NVLink bandwidth per GPU (both directions together, as datasheets quote it), GB/s."""
        return self.node_nvlink_gbs.get(node, spec.nvlink_gbs)

    def pcie_gbs(self, node: str, spec: GpuSpec) -> float:
        """PCIe bandwidth per GPU and direction, GB/s."""
        return self.node_pcie_gbs.get(node, PCIE_X16_GBS.get(spec.pcie_gen, 16.0))

    def __len__(self) -> int:
        return len(self.slots)

    def counts(self) -> dict[str, int]:
        """GPUs per catalog id."""
        out: dict[str, int] = {}
        for slot in self.slots:
            out[slot.spec.id] = out.get(slot.spec.id, 0) + 1
        return out


def parse_gpu_spec(spec: str, *, network_gbs: float = DEFAULT_NETWORK_GBS) -> Cluster:
    """Build a cluster from ``"h100-sxm:16,b200:16"`` (any name the catalog resolves).

    GPUs are packed into nodes of 8 (or of the catalog's NVLink domain when it is larger),
    named ``<id>-n000``, ``<id>-n001``, ...; a node's GPUs share NVLink domains of the
    catalog's ``nvlink_domain`` size. Raises ``ValueError`` with a specific message.
    """
    slots: list[GpuSlot] = []
    next_node: dict[str, int] = {}
    for gpu_spec, count in parse_gpu_counts(spec):
        node_size = max(DEFAULT_NODE_GPUS, gpu_spec.nvlink_domain)
        domain = max(1, min(gpu_spec.nvlink_domain, node_size))
        made = 0
        while made < count:
            index = next_node.get(gpu_spec.id, 0)
            next_node[gpu_spec.id] = index + 1
            node = f"{gpu_spec.id}-n{index:03d}"
            for g in range(min(node_size, count - made)):
                slots.append(GpuSlot(node=node, gpu=g, spec=gpu_spec, nvlink_group=g // domain))
            made += min(node_size, count - made)
    return Cluster(slots=slots, default_network_gbs=network_gbs)


def cluster_from_inventory(inventories: list[NodeInventory]) -> Cluster:
    """Build a cluster from node inventories (GPU models resolved through the catalog).

    NVLink domains come from ``nvlink_groups``; a node that lists none is assumed to follow
    the catalog (groups of ``nvlink_domain`` consecutive GPUs). Raises ``ValueError``.
    """
    slots: list[GpuSlot] = []
    cluster = Cluster(slots=slots)
    seen: set[str] = set()
    for inv in inventories:
        if inv.node in seen:
            raise ValueError(f"inventory: node {inv.node!r} appears more than once")
        seen.add(inv.node)
        group_of: dict[int, int] = {}
        for gi, group in enumerate(inv.nvlink_groups):
            for idx in group:
                group_of.setdefault(idx, gi)
        next_group = len(inv.nvlink_groups)
        ordered = sorted(inv.gpus, key=lambda g: g.index)
        for pos, gpu in enumerate(ordered):
            try:
                gpu_spec = lookup(gpu.model)
            except UnknownGpuError as exc:
                raise ValueError(f"inventory node {inv.node!r} GPU {gpu.index}: {exc}") from None
            if gpu.index in group_of:
                group = group_of[gpu.index]
            elif not inv.nvlink_groups:
                group = pos // max(1, gpu_spec.nvlink_domain)
            else:  # listed topology, but this GPU is in no NVLink group: alone
                group = next_group
                next_group += 1
            slots.append(
                GpuSlot(node=inv.node, gpu=gpu.index, spec=gpu_spec, nvlink_group=group, rack=inv.rack)
            )
        if inv.nics:
            cluster.node_network_gbs[inv.node] = inv.network_gbs
        if inv.nvlink_gbs:
            cluster.node_nvlink_gbs[inv.node] = inv.nvlink_gbs
        if inv.pcie_gbs:
            cluster.node_pcie_gbs[inv.node] = inv.pcie_gbs
    if not slots:
        raise ValueError("inventory lists no GPUs")
    return cluster
