"""The agent loop: publish the inventory, then one collection tick per interval, forever or
`count` times. Collection and delivery are separate tasks: a tick only appends to the
publisher's buffer, so a slow or absent broker never delays collection."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from fleetwise.agent import metrics
from fleetwise.agent.collector import Collector, CollectorError
from fleetwise.agent.config import NodeConfig
from fleetwise.agent.dcgm import DcgmCollector
from fleetwise.agent.nvml import NvmlCollector
from fleetwise.agent.publisher import BatchPublisher
from fleetwise.agent.sim import SimCollector

log = logging.getLogger("fleetwise.agent")


@dataclass
class AgentRun:
    """What one run did (also exported as metrics)."""

    ticks: int = 0
    batches: int = 0
    samples: int = 0
    collect_errors: int = 0
    skipped_ticks: int = 0  # ticks skipped because collection overran the interval
    collect_s: list[float] = field(default_factory=list)  # wall time per tick
    delivered: bool = False
    elapsed_s: float = 0.0


async def run_agent(
    collector: Collector,
    publisher: BatchPublisher,
    *,
    interval_s: float = 10.0,
    count: int | None = None,
    fast: bool = False,
    stop: asyncio.Event | None = None,
    flush_timeout_s: float = 10.0,
    started: bool = False,
) -> AgentRun:
    """Run the agent. `collector.start()` is called here unless `started` (the CLI starts it
    first to report a missing driver or a bad URL before anything else). `fast` skips the
    pacing (load tests, the simulator). Stops after `count` ticks, when `stop` is set, or when
    the collector runs out (the simulator's horizon); then flushes for up to `flush_timeout_s`."""
    agent = publisher.agent
    run = AgentRun()
    if not started:
        collector.start()
    loop_start = time.monotonic()
    try:
        for inventory in collector.inventories(time.time()):
            publisher.offer_inventory(inventory)
        await publisher.start()
        next_at = time.monotonic()
        while count is None or run.ticks < count:
            if stop is not None and stop.is_set():
                break
            if not fast:
                delay = next_at - time.monotonic()
                if delay > 0:
                    if stop is not None:
                        try:
                            await asyncio.wait_for(stop.wait(), delay)
                            break
                        except TimeoutError:
                            pass
                    else:
                        await asyncio.sleep(delay)
            t0 = time.monotonic()
            try:
                # Blocking sources (NVML, HTTP) run in a thread so the sender keeps the loop.
                batches = collector.collect(time.time()) if fast else await asyncio.to_thread(
                    collector.collect, time.time())
            except StopIteration:
                log.info("collector %s has no more ticks", collector.name)
                break
            except CollectorError as exc:
                run.collect_errors += 1
                metrics.COLLECT_ERRORS.labels(agent=agent).inc()
                log.warning("collection failed: %s", exc)
                batches = []
            spent = time.monotonic() - t0
            run.collect_s.append(spent)
            metrics.COLLECT_SECONDS.labels(agent=agent).observe(spent)
            run.ticks += 1
            for batch in batches:
                if not batch.samples:
                    continue
                publisher.offer(batch)
                run.batches += 1
                run.samples += len(batch.samples)
                metrics.SAMPLES_COLLECTED.labels(agent=agent).inc(len(batch.samples))
                metrics.BATCHES_COLLECTED.labels(agent=agent).inc()
            if fast:
                await asyncio.sleep(0)  # let the sender run between ticks
            else:
                next_at += interval_s
                now = time.monotonic()
                if now - next_at > interval_s:
                    # More than a whole interval behind: skip the missed ticks rather than burst.
                    missed = int((now - next_at) // interval_s)
                    run.skipped_ticks += missed
                    next_at += missed * interval_s
    finally:
        run.delivered = await publisher.stop(flush_timeout_s)
        collector.close()
        run.elapsed_s = time.monotonic() - loop_start
    return run


SOURCES = ("nvml", "dcgm", "sim")


def build_collector(
    source: str,
    config: NodeConfig,
    *,
    dcgm_url: str | None = None,
    sim_gpus: str | None = None,
    sim_nodes: int = 1,
    seed: int = 0,
    interval_s: float = 10.0,
    count: int | None = None,
    fast: bool = False,
) -> Collector:
    """The collector for `--source`; CollectorError names a bad choice or a bad option."""
    if source == "nvml":
        return NvmlCollector(config)
    if source == "dcgm":
        if not dcgm_url:
            raise CollectorError("--source dcgm needs --dcgm-url (e.g. http://localhost:9400/metrics)")
        return DcgmCollector(dcgm_url, config)
    if source == "sim":
        # Paced runs start the simulated clock at the current interval boundary so event time
        # looks live; fast runs keep the simulator's fixed start (same seed, same records).
        start_ts = None if fast else (time.time() // interval_s) * interval_s
        return SimCollector(config, gpus=sim_gpus, nodes=sim_nodes, seed=seed, interval_s=interval_s,
                            start_ts=start_ts, ticks=count)
    raise CollectorError(f"--source must be one of {', '.join(SOURCES)}, got {source!r}")


async def run_until_signal(collector: Collector, publisher: BatchPublisher, **kwargs) -> AgentRun:
    """run_agent with SIGINT/SIGTERM setting the stop event (graceful flush on shutdown)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return await run_agent(collector, publisher, stop=stop, **kwargs)
