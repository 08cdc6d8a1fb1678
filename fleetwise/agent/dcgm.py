"""`--source dcgm`: scrape a dcgm-exporter /metrics page and turn it into GPU samples.

dcgm-exporter (github.com/NVIDIA/dcgm-exporter) writes one series per DCGM field and GPU with
labels `gpu` (index), `UUID`, `pci_bus_id`, `device`, `modelName`, `Hostname` (older releases) or
`hostname`, static fields as labels (e.g. `DCGM_FI_DRIVER_VERSION`), and `pod`, `namespace`,
`container` on a GPU a pod uses. The metric name is the DCGM field name, which is exactly the
key our GpuSample.metrics uses. DCGM's blank sentinels and non-finite values become missing keys.
"""

from __future__ import annotations

import math
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from fleetwise.agent.collector import CollectorError, batches_by_node
from fleetwise.agent.config import NodeConfig
from fleetwise.agent.inventory import build_inventory, read_sys_nics
from fleetwise.agent.prom import PromPage, PromParseError, parse_exposition
from fleetwise.schemas import GpuInventory, GpuSample, NodeBatch, NodeInventory, is_dcgm_blank

HOSTNAME_LABELS = ("Hostname", "hostname")
POD_LABELS = ("pod", "namespace", "container")
# Framebuffer fields (MiB) whose sum is the GPU's memory when the catalog does not know it.
FB_FIELDS = ("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED")


def usable_value(value: float) -> bool:
    """False for NaN/inf and DCGM blank sentinels (both mean "no value")."""
    return math.isfinite(value) and not (value > 0 and is_dcgm_blank(value))


@dataclass
class DcgmGpu:
    """One GPU's series on a page, merged: identity labels, metrics, pod, latest timestamp."""

    node: str
    gpu: int
    uuid: str | None
    model: str
    pci_bus_id: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    pod: dict[str, str] = field(default_factory=dict)
    timestamp_ms: int | None = None


def gpus_from_page(
    page: PromPage, *, node: str | None = None, default_node: str = "localhost"
) -> list[DcgmGpu]:
    """Group a page's series by (node, gpu). `node` overrides the page's hostname label;
    `default_node` is used when neither is there. Series without a `gpu` label are skipped
    (they are not per-GPU), and with MIG the first series of a GPU's field wins (device-level
    fields repeat per instance)."""
    gpus: dict[tuple[str, int], DcgmGpu] = {}
    for s in page.samples:
        gpu_text = s.labels.get("gpu")
        if gpu_text is None:
            continue
        try:
            index = int(gpu_text)
        except ValueError:
            continue
        host = node or next((s.labels[k] for k in HOSTNAME_LABELS if s.labels.get(k)), None) or default_node
        key = (host, index)
        entry = gpus.get(key)
        if entry is None:
            entry = gpus[key] = DcgmGpu(
                node=host,
                gpu=index,
                uuid=s.labels.get("UUID") or None,
                model=s.labels.get("modelName") or "unknown",
                pci_bus_id=s.labels.get("pci_bus_id") or None,
            )
        for k in POD_LABELS:
            if s.labels.get(k) and k not in entry.pod:
                entry.pod[k] = s.labels[k]
        if s.timestamp_ms is not None:
            entry.timestamp_ms = max(entry.timestamp_ms or s.timestamp_ms, s.timestamp_ms)
        if s.name not in entry.metrics and usable_value(s.value):
            entry.metrics[s.name] = s.value
    return [gpus[k] for k in sorted(gpus)]


def samples_from_page(page: PromPage, ts: float, *, node: str | None = None,
                      default_node: str = "localhost", rack: str | None = None,
                      site: str | None = None) -> list[GpuSample]:
    """GpuSamples from a page. A GPU's ts is its series' latest timestamp when the exporter
    writes timestamps, else `ts` (the scrape time). Pod labels ride along as extra fields."""
    out = []
    for g in gpus_from_page(page, node=node, default_node=default_node):
        sample_ts = g.timestamp_ms / 1000.0 if g.timestamp_ms is not None else ts
        extra = dict(g.pod)
        out.append(
            GpuSample(ts=sample_ts, node=g.node, gpu=g.gpu, uuid=g.uuid, model=g.model,
                      metrics=dict(g.metrics), rack=rack, site=site, **extra)
        )
    return out


def validate_url(url: str) -> str:
    """An http(s) URL with a host; raises CollectorError naming what is wrong."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https"):
        raise CollectorError(f"--dcgm-url {url!r} must be an http:// or https:// URL "
                             "(e.g. http://localhost:9400/metrics)")
    if not parsed.hostname:
        raise CollectorError(f"--dcgm-url {url!r} has no host (e.g. http://localhost:9400/metrics)")
    try:
        _ = parsed.port
    except ValueError:
        raise CollectorError(f"--dcgm-url {url!r} has an invalid port") from None
    return url


def scrape(url: str, timeout_s: float = 5.0) -> str:
    """GET the page; CollectorError with the reason when it cannot be had."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            return resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        raise CollectorError(f"dcgm-exporter at {url} answered HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        raise CollectorError(f"cannot reach dcgm-exporter at {url}: {exc.reason}") from None
    except TimeoutError:
        raise CollectorError(f"dcgm-exporter at {url} did not answer within {timeout_s:g} s") from None
    except OSError as exc:
        raise CollectorError(f"cannot reach dcgm-exporter at {url}: {exc}") from None


class DcgmCollector:
    """Scrapes dcgm-exporter once per tick. Nodes come from `--node` or the hostname label."""

    name = "dcgm"

    def __init__(self, url: str, config: NodeConfig | None = None, *, timeout_s: float = 5.0,
                 nics: list | None = None) -> None:
        self.url = validate_url(url)
        self.config = (config or NodeConfig()).resolved()
        self.timeout_s = timeout_s
        self._nics = nics
        self._last: PromPage | None = None
        self.node: str | None = self.config.node  # the agent's name; set from the page at start
        self.scrape_errors = 0

    def _page(self) -> PromPage:
        text = scrape(self.url, self.timeout_s)
        try:
            return parse_exposition(text)
        except PromParseError as exc:
            raise CollectorError(f"dcgm-exporter at {self.url} served a malformed page: {exc}") from None

    def start(self) -> None:
        """First scrape: the exporter must answer and list at least one GPU."""
        page = self._page()
        gpus = gpus_from_page(page, node=self.config.node, default_node=socket.gethostname())
        if not gpus:
            raise CollectorError(f"dcgm-exporter at {self.url} lists no GPU series (no 'gpu' label); "
                                 "is it a dcgm-exporter /metrics URL?")
        self._last = page
        nodes = sorted({g.node for g in gpus})
        self.node = nodes[0] if len(nodes) == 1 else "dcgm"

    def inventories(self, ts: float) -> list[NodeInventory]:
        page = self._last if self._last is not None else self._page()
        nics = self._nics if self._nics is not None else (
            self.config.nics if self.config.nics is not None else read_sys_nics())
        by_node: dict[str, list[GpuInventory]] = {}
        for g in gpus_from_page(page, node=self.config.node, default_node=socket.gethostname()):
            fb = [g.metrics.get(f) for f in FB_FIELDS]
            memory_gb = sum(v for v in fb if v is not None) / 1024.0 if fb[0] is not None else None
            by_node.setdefault(g.node, []).append(
                GpuInventory(index=g.gpu, uuid=g.uuid, model=g.model, pci_bus_id=g.pci_bus_id,
                             memory_gb=round(memory_gb, 1) if memory_gb else None)
            )
        return [build_inventory(ts, node, gpus, self.config, nics) for node, gpus in sorted(by_node.items())]

    def collect(self, ts: float) -> list[NodeBatch]:
        page = self._last if self._last is not None else self._page()
        self._last = None  # the start-up page is used once, for the first tick
        samples = samples_from_page(page, ts, node=self.config.node, default_node=socket.gethostname(),
                                    rack=self.config.rack, site=self.config.site)
        return batches_by_node(ts, samples)

    def close(self) -> None:
        self._last = None

