"""Node inventory: what a node has, published once at agent start (compacted topic)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fleetwise.schemas._base import Record, Timestamp


class GpuInventory(Record):
    index: int = Field(ge=0)
    uuid: str | None = None
    model: str = Field(min_length=1)
    memory_gb: float | None = Field(default=None, gt=0)
    pci_bus_id: str | None = None
    nvlink_peers: list[int] = Field(default_factory=list)


class Nic(Record):
    name: str
    speed_gbps: float = Field(gt=0)
    kind: Literal["infiniband", "roce", "ethernet", "efa", "other"] = "ethernet"
    rdma: bool = False


class NodeInventory(Record):
    """A node's GPUs, their NVLink/PCIe topology, NICs and where it sits."""

    ts: Timestamp
    node: str = Field(min_length=1)
    rack: str | None = None
    site: str | None = None
    rack_power_budget_w: float | None = Field(default=None, gt=0)
    gpus: list[GpuInventory]
    # NVLink domains as groups of GPU indexes; GPUs in one group talk over NVLink,
    # others over PCIe (same node) or the network (other nodes).
    nvlink_groups: list[list[int]] = Field(default_factory=list)
    nvlink_gbs: float | None = Field(default=None, ge=0)
    pcie_gbs: float | None = Field(default=None, gt=0)
    nics: list[Nic] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _indexes(self) -> NodeInventory:
        seen = [g.index for g in self.gpus]
        if len(set(seen)) != len(seen):
            raise ValueError(f"gpus: duplicate GPU index in {seen}")
        known = set(seen)
        for gi, group in enumerate(self.nvlink_groups):
            for idx in group:
                if idx not in known:
                    raise ValueError(f"nvlink_groups.{gi}: GPU index {idx} is not in gpus")
        return self

    @property
    def network_gbs(self) -> float:
        """Aggregate NIC bandwidth of the node in GB/s (0 when none is listed)."""
        return sum(n.speed_gbps for n in self.nics) / 8.0
