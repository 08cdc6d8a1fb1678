"""Unit tests for the node agent: exposition parser, dcgm collector over HTTP, NVML mapping and
failure, inventory, drop-oldest buffer and publisher, simulator source, CLI errors."""

from __future__ import annotations

import asyncio
import ctypes.util
import http.server
import math
import socket
import threading
import types
import urllib.request
from pathlib import Path

import pynvml
import pytest
from prometheus_client import REGISTRY
from typer.testing import CliRunner

from fleetwise.agent import (
    AgentConfigError,
    BatchPublisher,
    CollectorError,
    DcgmCollector,
    DropOldestBuffer,
    NodeConfig,
    NvmlCollector,
    PromParseError,
    SimCollector,
    build_inventory,
    parse_exposition,
    parse_labels,
    parse_nic,
    parse_nvlink_groups,
    read_sys_nics,
    run_agent,
    samples_from_page,
)
from fleetwise.agent.config import parse_bootstrap
from fleetwise.agent.metrics import start_metrics_server
from fleetwise.cli import app
from fleetwise.schemas import GpuInventory, GpuSample, NodeBatch, NodeInventory

DATA = Path(__file__).parent / "data"
SAMPLE_PAGE = (DATA / "dcgm-sample-metrics.prom").read_text()
EDGE_PAGE = (DATA / "dcgm-edge-cases.prom").read_text()


def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(i: int, node: str = "n1") -> NodeBatch:
    return NodeBatch(ts=1000.0 + i, node=node, samples=[
        GpuSample(ts=1000.0 + i, node=node, gpu=0, model="NVIDIA H100 80GB HBM3",
                  metrics={"DCGM_FI_DEV_GPU_TEMP": 50.0 + i})])


# --------------------------------------------------------------------------- exposition parser
def test_parser_reads_every_series_of_the_real_page():
    page = parse_exposition(SAMPLE_PAGE)
    sample_lines = [ln for ln in SAMPLE_PAGE.splitlines() if ln and not ln.startswith("#")]
    assert len(page.samples) == len(sample_lines)
    type_lines = [ln.split()[2:4] for ln in SAMPLE_PAGE.splitlines() if ln.startswith("# TYPE")]
    assert page.types == {name: kind for name, kind in type_lines}
    assert page.types["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == "counter"
    assert page.help["DCGM_FI_DEV_GPU_TEMP"] == "GPU temperature (in C)."
    first = page.samples[0]
    assert first.labels["pod"] == "llm-70b-worker-3"
    assert first.labels["DCGM_FI_DRIVER_VERSION"] == "570.86.15"


def test_parser_label_escapes_commas_braces_trailing_comma_and_timestamps():
    page = parse_exposition(EDGE_PAGE)
    s0 = page.samples[0]
    assert s0.labels["namespace"] == 'ml"team'
    assert s0.labels["pod"] == "job-a,b}c"
    assert s0.timestamp_ms == 1764547200000
    assert page.samples[1].labels["Hostname"] == "old-exporter-node"  # trailing comma accepted
    xid = next(s for s in page.samples if s.name == "DCGM_FI_DEV_XID_ERRORS")
    assert xid.labels["err_msg"] == 'GPU has fallen off the bus \\ (see "dmesg")'
    nan = next(s for s in page.samples if s.name == "DCGM_FI_DEV_POWER_USAGE" and s.labels["gpu"] == "1")
    assert math.isnan(nan.value)
    assert any(s.value == math.inf for s in page.samples)


def test_parser_help_escapes():
    page = parse_exposition("# HELP m a\\\\b\\nc\n# TYPE m gauge\nm 1\n")
    assert page.help["m"] == "a\\b\nc"


@pytest.mark.parametrize("line", [
    'm{a="x} 1',  # unterminated label value
    "m{a=x} 1",  # unquoted value
    'm{a="x" b="y"} 1',  # missing comma
    'm{a="x"} one',  # value not a number
    'm{a="x"} 1 1.5',  # timestamp not an integer
    'm{a="x",a="y"} 1',  # duplicate label
    "{a=\"x\"} 1",  # no metric name
    "m",  # no value
])
def test_parser_rejects_malformed_lines_with_line_number(line):
    with pytest.raises(PromParseError, match="line 2"):
        parse_exposition("# TYPE m gauge\n" + line + "\n")


# --------------------------------------------------------------------------- dcgm -> samples
def test_dcgm_page_becomes_one_sample_per_gpu_with_blanks_missing():
    page = parse_exposition(SAMPLE_PAGE)
    samples = samples_from_page(page, 1764547200.0)
    assert [(s.node, s.gpu) for s in samples] == [("gpu-node-017", 0), ("gpu-node-017", 1)]
    g0, g1 = samples
    assert g0.model == "NVIDIA H100 80GB HBM3"
    assert g0.uuid == "GPU-2f4b0c1e-8d3a-4c55-9b1e-7a6c3d2e1f00"
    # every DCGM field on the page is a metric of each GPU, except the blank one
    names = {s.name for s in page.samples}
    assert set(g0.metrics) == names
    assert set(g1.metrics) == names - {"DCGM_FI_DEV_MEMORY_TEMP"}  # 9223372036854775794 on the page
    assert g0.metrics["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] == 918273645512  # counter, exact
    assert g1.metrics["DCGM_FI_DEV_XID_ERRORS"] == 31
    assert "DCGM_FI_DRIVER_VERSION" not in g0.metrics  # a label, not a metric
    # pod labels ride along on the GPU a pod uses, not on the idle one
    assert (g0.model_extra or {}).get("pod") == "llm-70b-worker-3"
    assert (g0.model_extra or {}).get("namespace") == "training"
    assert not (g1.model_extra or {}).get("pod")
    # the records are valid contracts and survive a JSON round trip
    nb = NodeBatch(ts=1764547200.0, node="gpu-node-017", samples=samples)
    again = NodeBatch.model_validate_json(nb.to_json())
    assert again.samples[0].metrics == g0.metrics


def test_dcgm_edge_cases_fp64_int32_int64_blanks_nan_inf_timestamps_old_hostname():
    samples = samples_from_page(parse_exposition(EDGE_PAGE), 1.0)
    assert [(s.node, s.gpu) for s in samples] == [("old-exporter-node", 0), ("old-exporter-node", 1)]
    g0, g1 = samples
    assert "DCGM_FI_DEV_POWER_USAGE" not in g0.metrics  # DCGM FP64 blank
    assert "DCGM_FI_DEV_SM_CLOCK" not in g0.metrics  # DCGM INT32 blank
    assert "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL" not in g1.metrics  # DCGM INT64 blank
    assert "DCGM_FI_DEV_POWER_USAGE" not in g1.metrics  # NaN
    assert "DCGM_FI_DEV_SM_CLOCK" not in g1.metrics  # +Inf
    assert g0.metrics == {"DCGM_FI_DEV_GPU_TEMP": 55, "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 2,
                          "DCGM_FI_DEV_XID_ERRORS": 79}
    assert g0.ts == 1764547200.0 and g1.ts == 1764547201.5  # exporter timestamps win
    assert (g0.model_extra or {})["pod"] == "job-a,b}c"


def test_dcgm_node_option_overrides_hostname_label():
    samples = samples_from_page(parse_exposition(SAMPLE_PAGE), 5.0, node="my-node", rack="r1")
    assert {s.node for s in samples} == {"my-node"}
    assert {s.rack for s in samples} == {"r1"}


class _Server:
    """A real HTTP server on 127.0.0.1:0 serving dcgm-exporter text at /metrics."""

    def __init__(self, body: str, status: int = 200) -> None:
        outer = self
        self.body, self.status, self.hits = body, status, 0

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.hits += 1
                data = outer.body.encode()
                self.send_response(outer.status)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_dcgm_collector_scrapes_a_live_http_endpoint():
    with _Server(SAMPLE_PAGE) as srv:
        c = DcgmCollector(srv.url, NodeConfig(rack="rack-7", site="eu-1", rack_power_w=40000), nics=[])
        c.start()
        assert c.node == "gpu-node-017"
        invs = c.inventories(100.0)
        first = c.collect(100.0)
        srv.body = SAMPLE_PAGE.replace("} 64\n", "} 66\n")  # GPU 0 warms up
        second = c.collect(110.0)
        c.close()
    assert srv.hits == 2  # start's scrape is reused for the first tick
    [inv] = invs
    assert inv.node == "gpu-node-017" and inv.rack == "rack-7" and inv.rack_power_budget_w == 40000
    assert [g.pci_bus_id for g in inv.gpus] == ["00000000:18:00.0", "00000000:2A:00.0"]
    # memory from the framebuffer fields: free + used + reserved MiB
    assert inv.gpus[0].memory_gb == round((6120 + 74421 + 562) / 1024, 1)
    # no topology on the page: the catalog's H100 SXM NVLink domain is assumed
    assert inv.nvlink_groups == [[0, 1]] and inv.gpus[0].nvlink_peers == [1]
    [b1], [b2] = first, second
    assert b1.samples[0].metrics["DCGM_FI_DEV_GPU_TEMP"] == 64
    assert b2.samples[0].metrics["DCGM_FI_DEV_GPU_TEMP"] == 66
    assert b2.ts == 110.0 and b2.samples[0].site == "eu-1"


def test_dcgm_collector_errors_are_specific():
    with pytest.raises(CollectorError, match="http:// or https://"):
        DcgmCollector("localhost:9400/metrics")
    with pytest.raises(CollectorError, match="cannot reach dcgm-exporter"):
        DcgmCollector(f"http://127.0.0.1:{closed_port()}/metrics", timeout_s=2).start()
    with _Server("not found", status=404) as srv, pytest.raises(CollectorError, match="HTTP 404"):
        DcgmCollector(srv.url).start()
    with _Server("process_open_fds 12\n") as srv, pytest.raises(CollectorError, match="no GPU series"):
        DcgmCollector(srv.url).start()
    with _Server('DCGM_FI_DEV_GPU_TEMP{gpu="0" 1\n') as srv, pytest.raises(CollectorError, match="malformed"):
        DcgmCollector(srv.url).start()


# --------------------------------------------------------------------------- NVML
def test_nvml_fails_clearly_without_a_driver():
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has libnvidia-ml: the no-driver path cannot be exercised here")
    with pytest.raises(CollectorError) as exc:
        NvmlCollector().start()
    assert str(exc.value) == ("NVML unavailable: NVIDIA driver library libnvidia-ml.so.1 not found "
                              "(is this a GPU node with the NVIDIA driver installed?)")
    result = CliRunner().invoke(app, ["agent", "--bootstrap", "127.0.0.1:9092", "--source", "nvml"])
    assert result.exit_code == 2
    assert "libnvidia-ml.so.1 not found" in result.output
    assert "Traceback" not in result.output


class FakeNvml(types.ModuleType):
    """pynvml's constants and error classes with a scripted two-GPU node behind the calls.

    Stands in for the driver only because none can run here; GPU 1 lacks row remapping and
    memory temperature (NotSupported), both GPUs share NVLink 0<->1, GPU 1 logged XID 79.
    """

    def __init__(self) -> None:
        super().__init__("fake_pynvml")
        for k, v in vars(pynvml).items():
            if k.startswith(("NVML", "nvmlEventType", "NVMLError")) or k in ("c_nvmlValue_t",):
                setattr(self, k, v)
        self.handles = [object(), object()]
        xid = pynvml.nvmlEventTypeXidCriticalError
        self.events = [types.SimpleNamespace(device=self.handles[1], eventType=xid, eventData=79)]
        self.shut = False

    def _idx(self, h):
        return self.handles.index(h)

    def _unsupported(self):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlInit(self): pass  # noqa: E704, N802
    def nvmlShutdown(self): self.shut = True  # noqa: E704, N802
    def nvmlDeviceGetCount(self): return 2  # noqa: E704, N802
    def nvmlDeviceGetHandleByIndex(self, i): return self.handles[i]  # noqa: E704, N802
    def nvmlDeviceGetName(self, h): return b"NVIDIA H100 80GB HBM3"  # noqa: E704, N802
    def nvmlDeviceGetUUID(self, h): return f"GPU-{self._idx(h)}"  # noqa: E704, N802
    def nvmlDeviceGetIndex(self, h): return self._idx(h)  # noqa: E704, N802

    def nvmlDeviceGetNvLinkState(self, h, link):  # noqa: N802
        if link >= 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1 if link == 0 else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):  # noqa: N802
        return types.SimpleNamespace(busId=b"00000000:%02X:00.0" % (0x18 + 0x10 * (1 - self._idx(h))))

    def nvmlDeviceGetPciInfo(self, h):  # noqa: N802
        return types.SimpleNamespace(busId=b"0000:%02x:00.0" % (0x18 + 0x10 * self._idx(h)))

    def nvmlEventSetCreate(self): return "event-set"  # noqa: E704, N802
    def nvmlDeviceRegisterEvents(self, h, types_, es): pass  # noqa: E704, N802
    def nvmlEventSetFree(self, es): pass  # noqa: E704, N802

    def nvmlEventSetWait(self, es, timeout_ms):  # noqa: N802
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlDeviceGetTemperature(self, h, sensor): return 60 + self._idx(h)  # noqa: E704, N802

    def nvmlDeviceGetFieldValues(self, h, ids):  # noqa: N802
        if self._idx(h) == 1:
            self._unsupported()
        return [types.SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, value=types.SimpleNamespace(uiVal=70))]

    def nvmlDeviceGetPowerUsage(self, h): return 612448  # noqa: E704, N802  (mW)
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return 918273645512  # noqa: E704, N802
    def nvmlDeviceGetClockInfo(self, h, clock): return 1980 if clock == pynvml.NVML_CLOCK_SM else 2619  # noqa: E704, N802
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return 0x20  # noqa: E704, N802

    def nvmlDeviceGetViolationStatus(self, h, policy):  # noqa: N802
        power = policy == pynvml.NVML_PERF_POLICY_POWER
        return types.SimpleNamespace(violationTime=5_000_000 if power else 0)

    def nvmlDeviceGetUtilizationRates(self, h): return types.SimpleNamespace(gpu=98, memory=41)  # noqa: E704, N802

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        return types.SimpleNamespace(total=85_899_345_920, free=6120 * 2**20, used=74421 * 2**20)

    def nvmlDeviceGetTotalEccErrors(self, h, err, counter):  # noqa: N802
        return 3 if err == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else 0

    def nvmlDeviceGetRemappedRows(self, h):  # noqa: N802
        if self._idx(h) == 1:
            self._unsupported()
        return (2, 0, 0, 0)

    def nvmlDeviceGetRetiredPages(self, h, cause): self._unsupported()  # noqa: E704, N802
    def nvmlDeviceGetRetiredPagesPendingStatus(self, h): self._unsupported()  # noqa: E704, N802
    def nvmlDeviceGetPcieReplayCounter(self, h): return 3  # noqa: E704, N802
    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter): return 1  # noqa: E704, N802


def test_nvml_collector_maps_to_dcgm_fields_and_leaves_unsupported_keys_out():
    fake = FakeNvml()
    c = NvmlCollector(NodeConfig(node="n7"), nvml=fake, nics=[])
    c.start()
    [b] = c.collect(123.0)
    [inv] = c.inventories(123.0)
    c.close()
    g0, g1 = b.samples
    assert b.node == "n7" and g0.model == "NVIDIA H100 80GB HBM3" and g1.uuid == "GPU-1"
    assert g0.metrics["DCGM_FI_DEV_POWER_USAGE"] == pytest.approx(612.448)  # mW -> W
    assert g0.metrics["DCGM_FI_DEV_FB_USED"] == 74421  # bytes -> MiB
    assert g0.metrics["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"] == 0x20
    assert g0.metrics["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"] == 3
    assert g0.metrics["DCGM_FI_DEV_ECC_DBE_AGG_TOTAL"] == 0
    assert g0.metrics["DCGM_FI_DEV_POWER_VIOLATION"] == 5_000_000
    assert g0.metrics["DCGM_FI_DEV_MEMORY_TEMP"] == 70
    assert g0.metrics["DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"] == 2
    assert g0.metrics["DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL"] == 1  # one active link
    # unsupported calls are missing keys, not zeros
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in g1.metrics
    assert "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS" not in g1.metrics
    assert "DCGM_FI_DEV_RETIRED_SBE" not in g0.metrics
    # the XID event lands on the GPU that raised it; the other reports 0 ("none seen")
    assert g1.metrics["DCGM_FI_DEV_XID_ERRORS"] == 79 and g0.metrics["DCGM_FI_DEV_XID_ERRORS"] == 0
    # NVLink peers from the remote PCI ids (bus ids in two spellings)
    assert inv.nvlink_groups == [[0, 1]] and inv.gpus[1].nvlink_peers == [0]
    assert inv.gpus[0].memory_gb == 80.0 and inv.nvlink_gbs == 900
    assert fake.shut


# --------------------------------------------------------------------------- inventory / config
def test_inventory_placement_from_labels_and_explicit_options_win():
    labels = parse_labels(["topology.kubernetes.io/zone=eu-west-1a", "fleetwise.io/rack=r12"],
                          env_text="fleetwise.io/rack-power-w=36000,team=ml")
    gpus = [GpuInventory(index=i, model="NVIDIA A100-SXM4-80GB") for i in range(8)]
    inv = build_inventory(1.0, "n1", gpus, NodeConfig(labels=labels), [])
    assert (inv.site, inv.rack, inv.rack_power_budget_w) == ("eu-west-1a", "r12", 36000)
    assert inv.labels["team"] == "ml"
    assert inv.nvlink_groups == [list(range(8))]  # A100 SXM4: one 8-GPU NVSwitch domain
    assert inv.gpus[0].memory_gb == 80 and inv.pcie_gbs == 32.0  # catalog: PCIe gen4 x16
    explicit = NodeConfig(rack="r1", site="s1", rack_power_w=1000.0, labels=labels,
                          nvlink_groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    inv2 = build_inventory(1.0, "n1", gpus, explicit, [])
    assert (inv2.site, inv2.rack, inv2.rack_power_budget_w) == ("s1", "r1", 1000.0)
    assert inv2.gpus[5].nvlink_peers == [4, 6, 7]
    pcie = build_inventory(1.0, "n2", [GpuInventory(index=0, model="l40s")], NodeConfig(), [])
    assert pcie.nvlink_groups == [] and pcie.nvlink_gbs is None
    NodeInventory.model_validate_json(inv2.to_json())


def test_read_sys_nics_from_a_sysfs_tree(tmp_path):
    net, ib = tmp_path / "net", tmp_path / "infiniband"

    def write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    for iface, speed in (("eth0", "25000"), ("eth1", "-1"), ("ens5", "100000")):
        write(net / iface / "speed", speed)
        write(net / iface / "type", "1")
        (net / iface / "device").mkdir()
    write(net / "lo" / "speed", "")
    write(net / "docker0" / "speed", "10000")  # virtual: no device link
    write(net / "ib0" / "type", "32")  # IPoIB of mlx5_0
    (net / "ib0" / "device").mkdir()
    for dev, layer, state, rate in (("mlx5_0", "InfiniBand", "4: ACTIVE", "400 Gb/sec (4X NDR)"),
                                    ("mlx5_1", "Ethernet", "4: ACTIVE", "200 Gb/sec (4X HDR)"),
                                    ("mlx5_2", "InfiniBand", "1: DOWN", "10 Gb/sec (4X SDR)"),
                                    ("efa_0", "Unspecified", "4: ACTIVE", "100 Gb/sec")):
        write(ib / dev / "ports" / "1" / "link_layer", layer)
        write(ib / dev / "ports" / "1" / "state", state)
        write(ib / dev / "ports" / "1" / "rate", rate)
    (ib / "mlx5_1" / "device" / "net" / "ens5").mkdir(parents=True)  # RoCE netdev of mlx5_1
    nics = {n.name: n for n in read_sys_nics(net, ib)}
    assert set(nics) == {"mlx5_0", "mlx5_1", "efa_0", "eth0"}
    assert (nics["mlx5_0"].kind, nics["mlx5_0"].speed_gbps, nics["mlx5_0"].rdma) == ("infiniband", 400, True)
    assert nics["mlx5_1"].kind == "roce" and nics["efa_0"].kind == "efa"
    assert (nics["eth0"].kind, nics["eth0"].speed_gbps, nics["eth0"].rdma) == ("ethernet", 25.0, False)


@pytest.mark.parametrize("fn,arg,match", [
    (parse_labels, ["novalue"], "not KEY=VALUE"),
    (parse_nic, "mlx5_0", "NAME:GBPS"),
    (parse_nic, "mlx5_0:fast", "not a number"),
    (parse_nic, "mlx5_0:400:token-ring", "kind"),
    (parse_nvlink_groups, "0-3;2-5", "two groups"),
    (parse_nvlink_groups, "3-0", "backwards"),
    (parse_nvlink_groups, "a,b", "not an index"),
    (parse_bootstrap, "localhost", "host:port"),
    (parse_bootstrap, "h:99999", "host:port"),
])
def test_config_parsers_reject_bad_input(fn, arg, match):
    with pytest.raises(AgentConfigError, match=match):
        fn(arg)


def test_config_parsers_accept_good_input():
    assert parse_nvlink_groups("0-3;4,5,6,7") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert parse_nic("mlx5_0:400:infiniband").rdma
    assert parse_bootstrap(" a:1, [::1]:9092 ") == "a:1,[::1]:9092"


# --------------------------------------------------------------------------- buffer / publisher
def test_buffer_drops_oldest_and_counts():
    dropped = []
    buf = DropOldestBuffer(3, on_drop=dropped.append)
    for i in range(5):
        buf.push(i)
    assert buf.peek_all() == [2, 3, 4] and dropped == [0, 1] and buf.dropped == 2
    taken = buf.take(2)
    assert taken == [2, 3]
    buf.push(5)
    buf.push(6)
    # the failed send goes back in front (it is older) and the oldest beyond the bound go
    assert buf.requeue(taken) == 2
    assert buf.peek_all() == [4, 5, 6] and dropped == [0, 1, 2, 3]


def test_publisher_offer_never_blocks_and_counts_drops_in_prometheus():
    name = f"unit-{id(object())}"
    pub = BatchPublisher("127.0.0.1:9", agent=name, max_buffer=4)
    for i in range(10):
        pub.offer(batch(i))
    assert pub.depth == 4 and pub.stats.dropped == 6
    assert [json_ts(item.value) for item in pub.buffer.peek_all()] == [1006.0, 1007.0, 1008.0, 1009.0]
    assert REGISTRY.get_sample_value("fleetwise_agent_dropped_total", {"node": name}) == 6
    assert REGISTRY.get_sample_value("fleetwise_agent_buffered_batches", {"node": name}) == 4


def json_ts(value: bytes) -> float:
    return NodeBatch.model_validate_json(value).ts


async def test_collection_is_not_blocked_by_an_unreachable_broker():
    """A real closed port: connecting fails; every tick is still collected on time and the
    buffer keeps only the newest batches."""
    interval, count = 0.1, 20
    collector = SimCollector(gpus="h100-sxm:8", seed=3, interval_s=interval, ticks=count)
    pub = BatchPublisher(f"127.0.0.1:{closed_port()}", agent="unit-outage", max_buffer=5,
                         backoff_max_s=0.2, request_timeout_ms=2000)
    run = await asyncio.wait_for(
        run_agent(collector, pub, interval_s=interval, count=count, flush_timeout_s=0.3), 30)
    assert run.ticks == count and run.batches == count
    # paced by the interval, not by the broker (slack for a loaded 2-core machine)
    assert run.elapsed_s < count * interval + 1.5
    assert not run.delivered and pub.stats.batches_sent == 0 and pub.stats.connect_errors >= 1
    assert pub.stats.dropped == 15 and pub.depth == 5
    assert max(run.collect_s) < 1.0
    # the Prometheus endpoint tells the same story
    port = start_metrics_server(0, addr="127.0.0.1")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        page = parse_exposition(resp.read().decode())
    values = {(s.name, s.labels.get("agent") or s.labels.get("node")): s.value for s in page.samples}
    assert values[("fleetwise_agent_dropped_total", "unit-outage")] == 15
    assert values[("fleetwise_agent_buffered_batches", "unit-outage")] == 5
    assert values[("fleetwise_agent_samples_collected_total", "unit-outage")] == 20 * 8
    assert values[("fleetwise_agent_send_errors_total", "unit-outage")] >= 1
    assert values[("fleetwise_agent_batches_sent_total", "unit-outage")] == 0


# --------------------------------------------------------------------------- simulator source
def test_sim_source_is_deterministic_and_renames_the_node():
    def ticks(seed):
        c = SimCollector(NodeConfig(node="demo-1", rack="r9"), gpus="a100-sxm-80gb:8", seed=seed,
                         interval_s=10, ticks=5)
        c.start()
        out = [c.collect(0.0) for _ in range(5)]
        inv = c.inventories(0.0)
        return [b.to_json() for bs in out for b in bs], inv

    a, inv = ticks(7)
    b, _ = ticks(7)
    c, _ = ticks(8)
    assert a == b and a != c
    parsed = [NodeBatch.model_validate_json(x) for x in a]
    assert {p.node for p in parsed} == {"demo-1"} and {s.rack for p in parsed for s in p.samples} == {"r9"}
    assert [p.ts for p in parsed] == sorted(p.ts for p in parsed)
    assert inv[0].node == "demo-1" and inv[0].rack == "r9" and len(inv[0].gpus) == 8


def test_sim_source_publishes_dcgm_blanks_as_missing_keys():
    c = SimCollector(gpus="h100-sxm:8", seed=1, interval_s=10, ticks=2)
    c.start()
    raw = next(c.sim.ticks()).samples[0]
    raw["metrics"]["DCGM_FI_DEV_MEMORY_TEMP"] = 9223372036854775794  # what dcgm-exporter prints
    cleaned = c._rename(raw)["metrics"]
    assert "DCGM_FI_DEV_MEMORY_TEMP" not in cleaned
    assert cleaned["DCGM_FI_DEV_GPU_TEMP"] == raw["metrics"]["DCGM_FI_DEV_GPU_TEMP"]


def test_sim_source_errors():
    with pytest.raises(CollectorError, match="makes only 1 nodes"):
        SimCollector(gpus="h100-sxm:8", nodes=2).start()
    with pytest.raises(CollectorError, match="--node names one simulated node"):
        SimCollector(NodeConfig(node="x"), nodes=3)
    with pytest.raises(CollectorError, match="unknown GPU"):
        SimCollector(gpus="nope:8").start()


# --------------------------------------------------------------------------- CLI errors
@pytest.mark.parametrize("args,match", [
    (["--bootstrap", "nohost"], "--bootstrap entry 'nohost' is not host:port"),
    (["--bootstrap", "h:1", "--source", "rocm"], "--source must be one of nvml, dcgm, sim"),
    (["--bootstrap", "h:1", "--source", "dcgm", "--dcgm-url", "ftp://x/metrics"], "http:// or https://"),
    (["--bootstrap", "h:1", "--source", "sim", "--label", "oops"], "--label 'oops' is not KEY=VALUE"),
    (["--bootstrap", "h:1", "--source", "sim", "--rack-power-w", "lots"], "--rack-power-w must be a number"),
    (["--bootstrap", "h:1", "--source", "sim", "--interval", "0"], "--interval must be > 0"),
    (["--bootstrap", "h:1", "--source", "sim", "--max-buffer", "0"], "--max-buffer must be at least 1"),
    (["--bootstrap", "h:1", "--source", "sim", "--sim-gpus", "h100-sxm:8", "--sim-nodes", "4"],
     "makes only 1"),
])
def test_cli_agent_bad_input_fails_cleanly(args, match):
    result = CliRunner().invoke(app, ["agent", *args])
    assert result.exit_code == 2, result.output
    assert match in " ".join(result.output.split())
    assert "Traceback" not in result.output
