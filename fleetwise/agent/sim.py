"""`--source sim`: the fleet simulator (fleetwise.sim) standing in for one node's GPUs, or for
many nodes in a load test. Event time is the simulator's (seeded, deterministic); the agent
loop only paces how fast ticks are produced."""

from __future__ import annotations

from fleetwise.agent.collector import CollectorError
from fleetwise.agent.config import NodeConfig
from fleetwise.schemas import NodeBatch, NodeInventory, is_dcgm_blank

DEFAULT_GPUS_PER_NODE = 8
# Ticks simulated ahead of need when --count is not given: 30 days (at 10 s, 259,200 ticks);
# the simulator pre-schedules its whole horizon at start, which takes well under a second.
OPEN_ENDED_DAYS = 30.0


def is_blank(value: float) -> bool:
    """True for a DCGM blank sentinel."""
    return value > 0 and is_dcgm_blank(value)


class SimCollector:
    """Simulated nodes. `gpus` is a fleet spec like the planner's ("h100-sxm:16,b200:8");
    when None, `nodes` x 8 H100 SXM. The agent reports the first `nodes` nodes of that fleet."""

    name = "sim"

    def __init__(
        self,
        config: NodeConfig | None = None,
        *,
        gpus: str | None = None,
        nodes: int = 1,
        seed: int = 0,
        interval_s: float = 10.0,
        start_ts: float | None = None,
        ticks: int | None = None,
    ) -> None:
        if nodes < 1:
            raise CollectorError(f"--sim-nodes must be >= 1, got {nodes}")
        self.config = (config or NodeConfig()).resolved()
        if self.config.node and nodes > 1:
            raise CollectorError("--node names one simulated node; with --sim-nodes > 1 the simulator "
                                 "names them (node-000, node-001, ...)")
        self.gpus = gpus or f"h100-sxm:{DEFAULT_GPUS_PER_NODE * nodes}"
        self.n_nodes = nodes
        self.seed = seed
        self.interval_s = interval_s
        self.start_ts = start_ts
        self.n_ticks = ticks
        self.sim = None
        self._ticks = None
        self._names: dict[str, str] = {}  # simulator node name -> published name
        self.node: str | None = self.config.node

    def start(self) -> None:
        from fleetwise.sim import FleetSimulator, SimConfig, SimConfigError

        if self.n_ticks is None:
            days = OPEN_ENDED_DAYS
        else:
            days = max(self.n_ticks + 1, 2) * self.interval_s / 86400.0
        params: dict = {"gpus": self.gpus, "seed": self.seed, "sample_interval_s": self.interval_s,
                        "days": days}
        if self.start_ts is not None:
            params["start_ts"] = self.start_ts
        try:
            self.sim = FleetSimulator(SimConfig(**params))
        except SimConfigError as exc:
            raise CollectorError(f"--sim-gpus {self.gpus!r}: {exc}") from None
        sim_nodes = [n.name for n in self.sim.fleet.nodes]
        if self.n_nodes > len(sim_nodes):
            raise CollectorError(f"--sim-nodes {self.n_nodes} but --sim-gpus {self.gpus!r} makes only "
                                 f"{len(sim_nodes)} nodes of up to {DEFAULT_GPUS_PER_NODE} GPUs")
        chosen = sim_nodes[: self.n_nodes]
        self._names = {n: (self.config.node if self.config.node else n) for n in chosen}
        # The agent's own name (metrics label): the node when there is one, else "sim".
        self.node = next(iter(self._names.values())) if len(chosen) == 1 else "sim"
        self._ticks = self.sim.ticks()

    def _rename(self, record: dict) -> dict:
        out = dict(record)
        out["node"] = self._names[record["node"]]
        metrics = record.get("metrics")
        if metrics is not None:
            # The simulator writes DCGM blanks as an exporter would; like the other collectors,
            # the agent publishes them as missing keys.
            out["metrics"] = {k: v for k, v in metrics.items() if v is not None and not is_blank(v)}
        if self.config.rack:
            out["rack"] = self.config.rack
        if self.config.site:
            out["site"] = self.config.site
        return out

    def inventories(self, ts: float) -> list[NodeInventory]:
        out = []
        for inv in self.sim.inventory():
            if inv["node"] not in self._names:
                continue
            record = self._rename(inv)
            record["ts"] = ts
            if self.config.rack_power_w is not None:
                record["rack_power_budget_w"] = self.config.rack_power_w
            if self.config.labels:
                record["labels"] = {**record.get("labels", {}), **self.config.labels}
            out.append(NodeInventory.model_validate(record))
        return out

    def collect(self, ts: float) -> list[NodeBatch]:
        """The simulator's next tick (its own event time; `ts` is ignored). Nodes in a scrape
        gap of the simulated trace send no batch that tick. Raises StopIteration at the end."""
        tick = next(self._ticks)
        grouped: dict[str, list[dict]] = {}
        for s in tick.samples:
            if s["node"] in self._names:
                sample = self._rename(s)
                grouped.setdefault(sample["node"], []).append(sample)
        # One validation call per node batch (the samples are validated inside it).
        return [NodeBatch.model_validate({"ts": tick.ts, "node": node, "samples": grouped[node]})
                for node in sorted(grouped)]

    def close(self) -> None:
        self._ticks = None
