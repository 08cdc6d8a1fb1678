"""`--source nvml`: read the GPUs through NVML (nvidia-ml-py's `pynvml`), mapped to DCGM field names.

Field mapping (REFERENCE.md "Telemetry"; DCGM field ids in dcgm_fields.h), DCGM field <- NVML call:

- DCGM_FI_DEV_GPU_TEMP, _MEMORY_TEMP <- nvmlDeviceGetTemperature, FieldValues(NVML_FI_DEV_MEMORY_TEMP)
- DCGM_FI_DEV_POWER_USAGE (W) <- nvmlDeviceGetPowerUsage (mW) / 1000
- DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ) <- nvmlDeviceGetTotalEnergyConsumption (mJ)
- DCGM_FI_DEV_SM_CLOCK, _MEM_CLOCK (MHz) <- nvmlDeviceGetClockInfo(SM, MEM)
- DCGM_FI_DEV_CLOCKS_EVENT_REASONS <- nvmlDeviceGetCurrentClocksEventReasons (same bitmask)
- DCGM_FI_DEV_POWER_VIOLATION, _THERMAL_VIOLATION (ns) <- nvmlDeviceGetViolationStatus
- DCGM_FI_DEV_GPU_UTIL, _MEM_COPY_UTIL (%) <- nvmlDeviceGetUtilizationRates
- DCGM_FI_DEV_FB_FREE, _FB_USED (MiB) <- nvmlDeviceGetMemoryInfo (bytes)
- DCGM_FI_DEV_ECC_{SBE,DBE}_{VOL,AGG}_TOTAL <- nvmlDeviceGetTotalEccErrors
- DCGM_FI_DEV_{UN,}CORRECTABLE_REMAPPED_ROWS, _ROW_REMAP_{FAILURE,PENDING} <- nvmlDeviceGetRemappedRows
- DCGM_FI_DEV_RETIRED_{SBE,DBE,PENDING} <- nvmlDeviceGetRetiredPages, ...PendingStatus
- DCGM_FI_DEV_PCIE_REPLAY_COUNTER <- nvmlDeviceGetPcieReplayCounter
- DCGM_FI_DEV_NVLINK_{CRC_FLIT,CRC_DATA,REPLAY,RECOVERY}_ERROR_COUNT_TOTAL
  <- nvmlDeviceGetNvLinkErrorCounter, summed over the active links
- DCGM_FI_DEV_XID_ERRORS (the last XID) <- nvmlDeviceRegisterEvents(XidCriticalError) + nvmlEventSetWait

A call the GPU does not support (NVMLError_NotSupported and friends) leaves its keys out: a
V100 has no row remapping, an A100 no retired pages, a PCIe card no NVLink.
"""

from __future__ import annotations

import ctypes
import socket
from typing import Any

from fleetwise.agent.collector import CollectorError
from fleetwise.agent.config import NodeConfig
from fleetwise.agent.inventory import build_inventory, read_sys_nics
from fleetwise.schemas import GpuInventory, GpuSample, NodeBatch, NodeInventory

MIB = 2**20
# How long one nvmlEventSetWait may block while draining XID events at a tick (ms). Short:
# events queue in the event set between ticks, the wait only has to see the queue.
XID_WAIT_MS = 1
# Bound on events drained per tick, so an XID storm cannot stall collection.
XID_MAX_EVENTS_PER_TICK = 1000

NVLINK_ERROR_FIELDS = (
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "NVML_NVLINK_ERROR_DL_CRC_FLIT"),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "NVML_NVLINK_ERROR_DL_CRC_DATA"),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "NVML_NVLINK_ERROR_DL_REPLAY"),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "NVML_NVLINK_ERROR_DL_RECOVERY"),
)


def _import_pynvml() -> Any:
    try:
        import pynvml
    except ImportError:
        raise CollectorError(
            "NVML unavailable: the nvidia-ml-py package is not installed (pip install 'fleetwise[nvml]')"
        ) from None
    return pynvml


def explain_init_error(nvml: Any, exc: Exception) -> str:
    """A message that tells an operator what is wrong with NVML on this machine."""
    code = getattr(exc, "value", None)
    if code == getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12):
        return ("NVML unavailable: NVIDIA driver library libnvidia-ml.so.1 not found "
                "(is this a GPU node with the NVIDIA driver installed?)")
    if code == getattr(nvml, "NVML_ERROR_DRIVER_NOT_LOADED", 9):
        return ("NVML unavailable: the NVIDIA kernel driver is not loaded "
                "(check `nvidia-smi` and `lsmod | grep nvidia` on this node)")
    if code == getattr(nvml, "NVML_ERROR_NO_PERMISSION", 4):
        return ("NVML unavailable: no permission to open the NVIDIA devices "
                "(run the agent with access to /dev/nvidia*)")
    return f"NVML unavailable: nvmlInit failed: {exc}"


def _decode(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def normalize_bus_id(bus_id: str) -> str:
    """PCI bus ids as NVML writes them ("00000000:18:00.0") in one canonical, lower-case form."""
    text = bus_id.strip().lower()
    domain, sep, rest = text.partition(":")
    if not sep or ":" not in rest:
        return text
    try:
        return f"{int(domain, 16):08x}:{rest}"
    except ValueError:
        return text


class NvmlCollector:
    """Reads every GPU of this node through NVML once per tick."""

    name = "nvml"

    def __init__(
        self, config: NodeConfig | None = None, *, nvml: Any = None, nics: list | None = None
    ) -> None:
        self.config = (config or NodeConfig()).resolved()
        self.node = self.config.node or socket.gethostname()
        self._nvml = nvml
        self._nics = nics
        self._handles: list[Any] = []
        self._handle_index: dict[int, int] = {}
        self._models: list[str] = []
        self._uuids: list[str | None] = []
        self._links: list[list[int]] = []
        self._event_set: Any = None
        self._xid_registered: set[int] = set()
        self._last_xid: dict[int, int] = {}
        self._started = False

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        nvml = self._nvml = self._nvml or _import_pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise CollectorError(explain_init_error(nvml, exc)) from None
        self._started = True
        try:
            count = nvml.nvmlDeviceGetCount()
        except nvml.NVMLError as exc:
            raise CollectorError(f"NVML unavailable: cannot count GPUs: {exc}") from None
        if count == 0:
            raise CollectorError("NVML found no GPUs on this node")
        for i in range(count):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            self._handles.append(h)
            self._handle_index[self._handle_key(h)] = i
            self._models.append(_decode(nvml.nvmlDeviceGetName(h)))
            self._uuids.append(self._try(lambda h=h: _decode(nvml.nvmlDeviceGetUUID(h))))
            self._links.append(self._active_links(h))
        self._register_xid_events()

    def close(self) -> None:
        nvml = self._nvml
        if nvml is None or not self._started:
            return
        if self._event_set is not None:
            self._try(lambda: nvml.nvmlEventSetFree(self._event_set))
            self._event_set = None
        self._try(nvml.nvmlShutdown)
        self._started = False

    # --- helpers -----------------------------------------------------------------------------
    def _try(self, fn: Any) -> Any:
        """Call fn; None when NVML says the GPU cannot answer it (not supported, no permission...)."""
        try:
            return fn()
        except self._nvml.NVMLError:
            return None

    @staticmethod
    def _handle_key(handle: Any) -> int:
        # pynvml handles are ctypes pointers; their address identifies the device.
        try:
            return ctypes.cast(handle, ctypes.c_void_p).value or id(handle)
        except (TypeError, ctypes.ArgumentError):
            return id(handle)

    def _active_links(self, h: Any) -> list[int]:
        nvml = self._nvml
        links = []
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            try:
                state = nvml.nvmlDeviceGetNvLinkState(h, link)
            except nvml.NVMLError:
                # NotSupported on a PCIe card; InvalidArgument past the last link.
                break
            if state:
                links.append(link)
        return links

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        self._event_set = self._try(nvml.nvmlEventSetCreate)
        if self._event_set is None:
            return
        for i, h in enumerate(self._handles):
            try:
                nvml.nvmlDeviceRegisterEvents(h, nvml.nvmlEventTypeXidCriticalError, self._event_set)
            except nvml.NVMLError:
                continue  # not supported on this GPU: its XID key stays missing
            self._xid_registered.add(i)
            self._last_xid[i] = 0  # DCGM reports 0 until an XID is seen

    def drain_xid_events(self) -> int:
        """Read queued XID events; remember the last XID per GPU. Returns how many were read."""
        nvml = self._nvml
        if self._event_set is None:
            return 0
        seen = 0
        for _ in range(XID_MAX_EVENTS_PER_TICK):
            try:
                data = nvml.nvmlEventSetWait(self._event_set, XID_WAIT_MS)
            except nvml.NVMLError:
                break  # NVML_ERROR_TIMEOUT: the queue is empty
            if not data.eventType & nvml.nvmlEventTypeXidCriticalError:
                continue
            idx = self._handle_index.get(self._handle_key(data.device))
            if idx is None:
                idx = self._try(lambda d=data: nvml.nvmlDeviceGetIndex(d.device))
            if idx is not None:
                self._last_xid[idx] = int(data.eventData)
                seen += 1
        return seen

    # --- reading -----------------------------------------------------------------------------
    def read_metrics(self, i: int) -> dict[str, float]:
        """All fields of GPU i this GPU supports, keyed by DCGM field name."""
        nvml = self._nvml
        h = self._handles[i]
        t = self._try
        m: dict[str, float] = {}

        def put(key: str, value: Any) -> None:
            if value is not None:
                m[key] = float(value)

        put("DCGM_FI_DEV_GPU_TEMP", t(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU)))
        mem_temp = t(lambda: nvml.nvmlDeviceGetFieldValues(h, [nvml.NVML_FI_DEV_MEMORY_TEMP]))
        if mem_temp is not None and mem_temp[0].nvmlReturn == nvml.NVML_SUCCESS:
            put("DCGM_FI_DEV_MEMORY_TEMP", mem_temp[0].value.uiVal)
        power_mw = t(lambda: nvml.nvmlDeviceGetPowerUsage(h))
        put("DCGM_FI_DEV_POWER_USAGE", power_mw / 1000.0 if power_mw is not None else None)
        put("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", t(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h)))
        put("DCGM_FI_DEV_SM_CLOCK", t(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM)))
        put("DCGM_FI_DEV_MEM_CLOCK", t(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_MEM)))
        reasons = t(lambda: nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        if reasons is None:  # drivers before r535 only have the old name
            reasons = t(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(h))
        put("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", reasons)
        for key, policy in (("DCGM_FI_DEV_POWER_VIOLATION", "NVML_PERF_POLICY_POWER"),
                            ("DCGM_FI_DEV_THERMAL_VIOLATION", "NVML_PERF_POLICY_THERMAL")):
            viol = t(lambda p=policy: nvml.nvmlDeviceGetViolationStatus(h, getattr(nvml, p)))
            put(key, viol.violationTime if viol is not None else None)
        util = t(lambda: nvml.nvmlDeviceGetUtilizationRates(h))
        if util is not None:
            put("DCGM_FI_DEV_GPU_UTIL", util.gpu)
            put("DCGM_FI_DEV_MEM_COPY_UTIL", util.memory)
        mem = t(lambda: nvml.nvmlDeviceGetMemoryInfo(h))
        if mem is not None:
            put("DCGM_FI_DEV_FB_FREE", mem.free / MIB)
            put("DCGM_FI_DEV_FB_USED", mem.used / MIB)
        for key, err_type, counter in (
            ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
            ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
            ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
            ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
        ):
            put(key, t(lambda e=err_type, c=counter: nvml.nvmlDeviceGetTotalEccErrors(
                h, getattr(nvml, e), getattr(nvml, c))))
        rows = t(lambda: nvml.nvmlDeviceGetRemappedRows(h))
        if rows is not None:
            corr, unc, pending, failure = rows
            put("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", corr)
            put("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", unc)
            put("DCGM_FI_DEV_ROW_REMAP_PENDING", pending)
            put("DCGM_FI_DEV_ROW_REMAP_FAILURE", failure)
        for key, cause in (
            ("DCGM_FI_DEV_RETIRED_SBE", "NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS"),
            ("DCGM_FI_DEV_RETIRED_DBE", "NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR"),
        ):
            pages = t(lambda c=cause: nvml.nvmlDeviceGetRetiredPages(h, getattr(nvml, c)))
            put(key, len(pages) if pages is not None else None)
        put("DCGM_FI_DEV_RETIRED_PENDING", t(lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)))
        put("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", t(lambda: nvml.nvmlDeviceGetPcieReplayCounter(h)))
        if self._links[i]:
            for key, counter in NVLINK_ERROR_FIELDS:
                values = [t(lambda ln=link, c=counter: nvml.nvmlDeviceGetNvLinkErrorCounter(
                    h, ln, getattr(nvml, c))) for link in self._links[i]]
                if any(v is not None for v in values):
                    put(key, sum(v for v in values if v is not None))
        if i in self._xid_registered:
            put("DCGM_FI_DEV_XID_ERRORS", self._last_xid.get(i, 0))
        return m

    def collect(self, ts: float) -> list[NodeBatch]:
        self.drain_xid_events()
        samples = [
            GpuSample(ts=ts, node=self.node, gpu=i, uuid=self._uuids[i], model=self._models[i],
                      metrics=self.read_metrics(i), rack=self.config.rack, site=self.config.site)
            for i in range(len(self._handles))
        ]
        return [NodeBatch(ts=ts, node=self.node, samples=samples)]

    def inventories(self, ts: float) -> list[NodeInventory]:
        nvml = self._nvml
        bus_ids: list[str | None] = []
        for h in self._handles:
            info = self._try(lambda h=h: nvml.nvmlDeviceGetPciInfo(h))
            bus_ids.append(normalize_bus_id(_decode(info.busId)) if info is not None else None)
        by_bus = {b: i for i, b in enumerate(bus_ids) if b}
        peers: dict[int, set[int]] = {}
        switched: set[int] = set()
        for i, h in enumerate(self._handles):
            peers[i] = set()
            for link in self._links[i]:
                remote = self._try(lambda h=h, ln=link: nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, ln))
                if remote is None:
                    continue
                j = by_bus.get(normalize_bus_id(_decode(remote.busId)))
                if j is None:
                    switched.add(i)  # the link ends at an NVSwitch, not at a GPU of this node
                elif j != i:
                    peers[i].add(j)
        # GPUs on NVSwitches reach every other switched GPU of the node over NVLink.
        for i in switched:
            peers[i] |= switched - {i}
        gpus = []
        for i, h in enumerate(self._handles):
            mem = self._try(lambda h=h: nvml.nvmlDeviceGetMemoryInfo(h))
            gpus.append(GpuInventory(
                index=i, uuid=self._uuids[i], model=self._models[i],
                memory_gb=round(mem.total / 2**30, 1) if mem is not None else None,
                pci_bus_id=bus_ids[i], nvlink_peers=sorted(peers[i]),
            ))
        nics = self._nics if self._nics is not None else (
            self.config.nics if self.config.nics is not None else read_sys_nics())
        return [build_inventory(ts, self.node, gpus, self.config, nics, topology_observed=True)]
