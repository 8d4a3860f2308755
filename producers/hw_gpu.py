"""NVML metrics of this rank's GPU (see producers/hw.py for the metric names and units)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rankscope.producers.hw_groups import MetricGroup, Rate, nvml_const, run_groups

log = logging.getLogger("rankscope.hw")

# GPM metric ids (pynvml NVML_GPM_METRIC_*) -> our names.
_GPM_METRICS = (
    ("NVML_GPM_METRIC_SM_UTIL", 2, "gpm_sm_active_pct"),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", 3, "gpm_sm_occupancy_pct"),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", 5, "gpm_tensor_active_pct"),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", 10, "gpm_dram_bw_pct"),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", 20, "gpm_pcie_tx_mibps"),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", 21, "gpm_pcie_rx_mibps"),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", 61, "gpm_nvlink_tx_mibps"),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", 60, "gpm_nvlink_rx_mibps"),
)


_VALUE_ATTRS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")  # by NVML_VALUE_TYPE_*


def _field_value(fv: Any) -> float:
    vt = fv.valueType
    return getattr(fv.value, _VALUE_ATTRS[vt] if 0 <= vt < len(_VALUE_ATTRS) else "ullVal")


def pick_gpu(nvml: Any, local_rank: int, env: Mapping[str, str]) -> tuple[Any, int] | None:
    """This rank's GPU: (NVML handle, NVML index), or None when it has none.

    ``CUDA_VISIBLE_DEVICES`` entries may be indices, UUIDs (or unique UUID prefixes) or MIG UUIDs
    (sampled as their parent GPU). With one visible device per process, every rank takes it.
    """
    lr = max(local_rank, 0)
    count = int(nvml.nvmlDeviceGetCount())
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if lr >= count:
            return None
        handle, idx = nvml.nvmlDeviceGetHandleByIndex(lr), lr
    else:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if not entries:
            return None
        entry = entries[lr] if lr < len(entries) else entries[0] if len(entries) == 1 else None
        if entry is None:
            return None
        if entry.lstrip("-").isdigit():
            idx = int(entry)
            if not 0 <= idx < count:
                return None
            handle = nvml.nvmlDeviceGetHandleByIndex(idx)
        elif entry.startswith("MIG-"):
            mig = nvml.nvmlDeviceGetHandleByUUID(entry)
            handle, idx = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig), -1
        else:
            handle, idx = None, -1
            for i in range(count):
                h = nvml.nvmlDeviceGetHandleByIndex(i)
                uuid = nvml.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                if uuid == entry or uuid.startswith(entry):
                    handle, idx = h, i
                    break
            if handle is None:
                return None
    try:
        idx = int(nvml.nvmlDeviceGetIndex(handle))
    except Exception:
        pass
    return handle, idx


class GpuSampler:
    """NVML metrics of one GPU. Everything reusable (handle, field list, GPM buffers) is made here."""

    def __init__(self, nvml: Any, handle: Any, index: int) -> None:
        self.nvml = nvml
        self.handle = handle
        self.index = index
        self.groups: list[MetricGroup] = []
        self._event_set: Any = None
        self._gpm: list[Any] = []
        self._gpm_get: Any = None
        self._gpm_names: list[str] = []
        self._gpm_have_prev = False
        self._fields: list[tuple[int, int]] = []
        self._field_names: list[str] = []
        self._field_slot: list[int] = []
        self._field_out: list[tuple[str, float]] = []
        self._field_rate = Rate()
        self._pcie_last = 0.0
        self._pcie_cached: tuple[float, float] | None = None
        n = nvml
        h = handle
        temp_sensor = nvml_const(n, "NVML_TEMPERATURE_GPU", 0)
        clock_sm = nvml_const(n, "NVML_CLOCK_SM", 1)
        err_unc = nvml_const(n, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        ecc_vol = nvml_const(n, "NVML_VOLATILE_ECC", 0)
        reasons = (getattr(n, "nvmlDeviceGetCurrentClocksEventReasons", None)
                   or getattr(n, "nvmlDeviceGetCurrentClocksThrottleReasons", None))

        def util(out: dict[str, Any], now: float) -> None:
            u = n.nvmlDeviceGetUtilizationRates(h)
            out["gpu_util"] = u.gpu
            out["mem_util"] = u.memory

        def mem(out: dict[str, Any], now: float) -> None:
            m = n.nvmlDeviceGetMemoryInfo(h)
            out["mem_used_bytes"] = m.used
            out["mem_total_bytes"] = m.total

        def power(out: dict[str, Any], now: float) -> None:
            out["power_w"] = n.nvmlDeviceGetPowerUsage(h) / 1000.0

        def temp(out: dict[str, Any], now: float) -> None:
            out["temp_c"] = n.nvmlDeviceGetTemperature(h, temp_sensor)

        def sm_clock(out: dict[str, Any], now: float) -> None:
            out["sm_clock_mhz"] = n.nvmlDeviceGetClockInfo(h, clock_sm)

        def throttle(out: dict[str, Any], now: float) -> None:
            out["throttle_reasons"] = float(reasons(h))  # type: ignore[misc]

        def ecc(out: dict[str, Any], now: float) -> None:
            out["ecc_uncorrected_volatile"] = n.nvmlDeviceGetTotalEccErrors(h, err_unc, ecc_vol)

        self.groups = [MetricGroup("util", util), MetricGroup("mem", mem), MetricGroup("power", power),
                       MetricGroup("temp", temp), MetricGroup("sm_clock", sm_clock)]
        if reasons is not None:
            self.groups.append(MetricGroup("throttle", throttle))
        self.groups.append(MetricGroup("ecc", ecc))
        self._setup_fields()
        self._setup_xid()
        self._setup_gpm()

    # Field values: PCIe byte counters and NVLink per-link throughput counters, one call -------------
    def _setup_fields(self) -> None:
        n, h = self.nvml, self.handle
        pcie_tx = nvml_const(n, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197)
        pcie_rx = nvml_const(n, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198)
        nvl_tx = nvml_const(n, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
        nvl_rx = nvml_const(n, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
        link_count_id = nvml_const(n, "NVML_FI_DEV_NVLINK_LINK_COUNT", 91)
        if not hasattr(n, "nvmlDeviceGetFieldValues"):
            self._add_pcie_throughput()
            return
        links = 0
        try:
            fv = n.nvmlDeviceGetFieldValues(h, [link_count_id])[0]
            if fv.nvmlReturn == 0:
                links = int(_field_value(fv))
        except Exception:
            links = 0
        wanted: list[tuple[str, tuple[int, int]]] = [("pcie_tx", (pcie_tx, 0)), ("pcie_rx", (pcie_rx, 0))]
        for link in range(min(max(links, 0), 64)):
            wanted += [("nvlink_tx", (nvl_tx, link)), ("nvlink_rx", (nvl_rx, link))]
        try:
            probe = n.nvmlDeviceGetFieldValues(h, [w[1] for w in wanted])
            ok = [w for w, fv in zip(wanted, probe, strict=True) if fv.nvmlReturn == 0]
        except Exception:
            ok = []
        names = {w[0] for w in ok}
        if not {"pcie_tx", "pcie_rx"} <= names:
            ok = [w for w in ok if not w[0].startswith("pcie")]
            self._add_pcie_throughput()
        if not ok:
            return
        self._fields = [w[1] for w in ok]
        self._field_names = sorted({w[0] for w in ok})
        self._field_slot = [self._field_names.index(w[0]) for w in ok]   # field i -> total index
        # Output name and scale to KB/s: PCIe counters are bytes, NVLink throughput counters KiB.
        self._field_out = [(f"{name}_kbps", 1e-3 if name.startswith("pcie") else 1.024)
                           for name in self._field_names]
        self.groups.append(MetricGroup("fields", self._sample_fields))

    def _sample_fields(self, out: dict[str, Any], now: float) -> None:
        fvs = self.nvml.nvmlDeviceGetFieldValues(self.handle, self._fields)
        totals = [0.0] * len(self._field_names)
        for fv, slot in zip(fvs, self._field_slot, strict=False):
            if fv.nvmlReturn == 0:
                totals[slot] += _field_value(fv)
        for (name, scale), r in zip(self._field_out, self._field_rate.update(now, tuple(totals)), strict=True):
            if r is not None:
                out[name] = r * scale

    def _add_pcie_throughput(self) -> None:
        """Fallback for drivers without PCIe byte counters: nvmlDeviceGetPcieThroughput samples over
        ~20 ms inside the call, so it runs at most once a second and the value is reused between."""
        n, h = self.nvml, self.handle
        if not hasattr(n, "nvmlDeviceGetPcieThroughput"):
            return
        tx_c = nvml_const(n, "NVML_PCIE_UTIL_TX_BYTES", 0)
        rx_c = nvml_const(n, "NVML_PCIE_UTIL_RX_BYTES", 1)

        def pcie(out: dict[str, Any], now: float) -> None:
            if self._pcie_cached is None or now - self._pcie_last >= 1.0:
                self._pcie_last = now
                self._pcie_cached = (float(n.nvmlDeviceGetPcieThroughput(h, tx_c)),
                                     float(n.nvmlDeviceGetPcieThroughput(h, rx_c)))
            out["pcie_tx_kbps"], out["pcie_rx_kbps"] = self._pcie_cached

        self.groups.append(MetricGroup("pcie_throughput", pcie))

    # Xid critical errors through an event set polled with a zero timeout ---------------------------
    def _setup_xid(self) -> None:
        n, h = self.nvml, self.handle
        try:
            es = n.nvmlEventSetCreate()
        except Exception:
            return
        try:
            n.nvmlDeviceRegisterEvents(h, nvml_const(n, "nvmlEventTypeXidCriticalError", 8), es)
        except Exception:
            try:
                n.nvmlEventSetFree(es)
            except Exception:
                pass
            return
        self._event_set = es

        def xid(out: dict[str, Any], now: float) -> None:
            last = None
            for _ in range(16):
                try:
                    data = n.nvmlEventSetWait(es, 0)
                except Exception as e:
                    if getattr(e, "value", None) == 10:  # NVML_ERROR_TIMEOUT: no pending event
                        break
                    raise
                last = data.eventData
            if last is not None:
                out["xid"] = float(last)

        self.groups.append(MetricGroup("xid", xid))

    # GPM (Hopper+): two reusable sample buffers, metrics computed between consecutive samples -----
    def _setup_gpm(self) -> None:
        n, h = self.nvml, self.handle
        try:
            if not n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                return
            self._gpm = [n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()]
            mg = n.c_nvmlGpmMetricsGet_t()
            mg.version = nvml_const(n, "NVML_GPM_METRICS_GET_VERSION", 1)
            mg.numMetrics = len(_GPM_METRICS)
            for i, (const, default, name) in enumerate(_GPM_METRICS):
                mg.metrics[i].metricId = nvml_const(n, const, default)
                self._gpm_names.append(name)
            self._gpm_get = mg
            n.nvmlGpmSampleGet(h, self._gpm[0])
            self._gpm_have_prev = True
        except Exception as e:
            log.debug("GPM metrics off: %s: %s", type(e).__name__, e)
            self._free_gpm()
            return
        self.groups.append(MetricGroup("gpm", self._sample_gpm))

    def _sample_gpm(self, out: dict[str, Any], now: float) -> None:
        n = self.nvml
        prev, cur = self._gpm
        n.nvmlGpmSampleGet(self.handle, cur)
        if self._gpm_have_prev:
            mg = self._gpm_get
            mg.sample1, mg.sample2 = prev, cur
            n.nvmlGpmMetricsGet(mg)
            metrics = mg.metrics
            for i, name in enumerate(self._gpm_names):
                m = metrics[i]
                if m.nvmlReturn == 0:
                    out[name] = float(m.value)
        self._gpm = [cur, prev]
        self._gpm_have_prev = True

    def _free_gpm(self) -> None:
        for s in self._gpm:
            try:
                self.nvml.nvmlGpmSampleFree(s)
            except Exception:
                pass
        self._gpm = []

    def sample(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        run_groups(self.groups, out, now, "GPU")
        return out

    def close(self) -> None:
        self._free_gpm()
        if self._event_set is not None:
            try:
                self.nvml.nvmlEventSetFree(self._event_set)
            except Exception:
                pass
            self._event_set = None
        self.groups = []
