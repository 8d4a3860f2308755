"""Hardware sampling on the rank: NVML for this rank's GPU, psutil for the host (local rank 0 only).

A daemon thread samples every ``period_s`` (``settings.hw_sample_s``, default 1 s; 0.1 s while a trace
window is open, see :meth:`HardwareSampler.set_fast`) and sends one ``hw`` body about once a second
through the ``send(kind, body)`` callable the tracer provides (which wraps it in an envelope and
queues it on the HW topic). Bodies are columnar, one entry per (sample, device)::

    {"ts_ns": [...], "device": [...], "metrics": {name: [value or None, ...]}}

``device`` is the GPU's NVML index, or -1 for host-wide metrics.

GPU metrics (NVML, this rank's GPU only: index = local rank, through ``CUDA_VISIBLE_DEVICES`` when
set; NVML numbers GPUs in PCI bus order, which matches CUDA's order on homogeneous nodes):
``gpu_util``, ``mem_util`` (%), ``mem_used_bytes``, ``mem_total_bytes``, ``power_w``, ``temp_c``,
``sm_clock_mhz``, ``pcie_tx_kbps``, ``pcie_rx_kbps``, ``nvlink_tx_kbps``, ``nvlink_rx_kbps``
(KB/s = 1000 bytes/s), ``throttle_reasons`` (NVML clock-event bitmask, as float),
``ecc_uncorrected_volatile``, ``xid`` (the last Xid critical error seen since the previous sample;
absent otherwise) and, on Hopper and newer, GPM metrics: ``gpm_sm_active_pct``,
``gpm_sm_occupancy_pct``, ``gpm_tensor_active_pct``, ``gpm_dram_bw_pct``, ``gpm_pcie_tx_mibps``,
``gpm_pcie_rx_mibps``, ``gpm_nvlink_tx_mibps``, ``gpm_nvlink_rx_mibps``. A metric the device or
driver does not support is dropped after its first failure, silently (debug log).

Host metrics (psutil, device -1, local rank 0 only): ``cpu_util`` (%), ``cpu_util_core<i>`` (%, at
most once a second), ``mem_used_bytes`` (total - available), ``mem_total_bytes``, ``net_tx_bytes_s``,
``net_rx_bytes_s`` (all interfaces but loopback), ``disk_read_bytes_s``, ``disk_write_bytes_s``.
Rates come from deltas between samples, so the first sample has none.

Contract: construction, sampling and :meth:`stop` never raise. NVML is initialised once (in the
sampler thread, not on the training thread) and handles, field lists and GPM buffers are made once.
Without a driver the sampler logs one line and samples the host only.
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from producers.identity import RankIdentity
from producers.untraced import leave_profiler
from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings

log = logging.getLogger("rankscope.hw")

HOST_DEVICE = -1
FAST_PERIOD_S = 0.1
SEND_EVERY_S = 1.0
PER_CORE_EVERY_S = 1.0
NO_NVML_MESSAGE = "rankscope: no NVIDIA driver/NVML: GPU metrics off, host metrics only"

SendFn = Callable[[str, dict[str, Any]], None]

# NVML codes that mean "this will never work here": drop the metric group.
_PERMANENT_NVML = {2, 3, 4, 13}  # INVALID_ARGUMENT, NOT_SUPPORTED, NO_PERMISSION, FUNCTION_NOT_FOUND

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


def _const(mod: Any, name: str, default: int) -> int:
    return int(getattr(mod, name, default))


class _Group:
    """One metric group: a callable filling a dict, dropped once it proves unsupported."""

    __slots__ = ("name", "fn", "failures")

    def __init__(self, name: str, fn: Callable[[dict[str, Any], float], None]) -> None:
        self.name = name
        self.fn = fn
        self.failures = 0


def _run_groups(groups: list[_Group], out: dict[str, Any], now: float, what: str) -> None:
    for g in list(groups):
        try:
            g.fn(out, now)
            g.failures = 0
        except Exception as e:
            g.failures += 1
            code = getattr(e, "value", None)
            permanent = (code in _PERMANENT_NVML or isinstance(e, AttributeError | TypeError | NotImplementedError)
                         or g.failures >= 30)
            if permanent:
                groups.remove(g)
                log.debug("%s metric group %s off: %s: %s", what, g.name, type(e).__name__, e)


class _Rate:
    """Per-second rates of monotonically increasing counters (None on the first call or a reset)."""

    __slots__ = ("_prev", "_t")

    def __init__(self) -> None:
        self._prev: tuple[float, ...] | None = None
        self._t = 0.0

    def update(self, now: float, values: tuple[float, ...]) -> tuple[float | None, ...]:
        prev, t0 = self._prev, self._t
        self._prev, self._t = values, now
        dt = now - t0
        if prev is None or dt <= 0 or len(prev) != len(values):
            return (None,) * len(values)
        return tuple(None if v < p else (v - p) / dt for v, p in zip(values, prev, strict=True))


# --------------------------------------------------------------------------------------------
# GPU (NVML)
# --------------------------------------------------------------------------------------------

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
        self.groups: list[_Group] = []
        self._event_set: Any = None
        self._gpm: list[Any] = []
        self._gpm_get: Any = None
        self._gpm_names: list[str] = []
        self._gpm_have_prev = False
        self._fields: list[tuple[int, int]] = []
        self._field_names: list[str] = []
        self._field_slot: list[int] = []
        self._field_out: list[tuple[str, float]] = []
        self._field_rate = _Rate()
        self._pcie_last = 0.0
        self._pcie_cached: tuple[float, float] | None = None
        n = nvml
        h = handle
        temp_sensor = _const(n, "NVML_TEMPERATURE_GPU", 0)
        clock_sm = _const(n, "NVML_CLOCK_SM", 1)
        err_unc = _const(n, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1)
        ecc_vol = _const(n, "NVML_VOLATILE_ECC", 0)
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

        self.groups = [_Group("util", util), _Group("mem", mem), _Group("power", power),
                       _Group("temp", temp), _Group("sm_clock", sm_clock)]
        if reasons is not None:
            self.groups.append(_Group("throttle", throttle))
        self.groups.append(_Group("ecc", ecc))
        self._setup_fields()
        self._setup_xid()
        self._setup_gpm()

    # Field values: PCIe byte counters and NVLink per-link throughput counters, one call -------------
    def _setup_fields(self) -> None:
        n, h = self.nvml, self.handle
        pcie_tx = _const(n, "NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 197)
        pcie_rx = _const(n, "NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 198)
        nvl_tx = _const(n, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", 138)
        nvl_rx = _const(n, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", 139)
        link_count_id = _const(n, "NVML_FI_DEV_NVLINK_LINK_COUNT", 91)
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
        self.groups.append(_Group("fields", self._sample_fields))

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
        tx_c = _const(n, "NVML_PCIE_UTIL_TX_BYTES", 0)
        rx_c = _const(n, "NVML_PCIE_UTIL_RX_BYTES", 1)

        def pcie(out: dict[str, Any], now: float) -> None:
            if self._pcie_cached is None or now - self._pcie_last >= 1.0:
                self._pcie_last = now
                self._pcie_cached = (float(n.nvmlDeviceGetPcieThroughput(h, tx_c)),
                                     float(n.nvmlDeviceGetPcieThroughput(h, rx_c)))
            out["pcie_tx_kbps"], out["pcie_rx_kbps"] = self._pcie_cached

        self.groups.append(_Group("pcie_throughput", pcie))

    # Xid critical errors through an event set polled with a zero timeout ---------------------------
    def _setup_xid(self) -> None:
        n, h = self.nvml, self.handle
        try:
            es = n.nvmlEventSetCreate()
        except Exception:
            return
        try:
            n.nvmlDeviceRegisterEvents(h, _const(n, "nvmlEventTypeXidCriticalError", 8), es)
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

        self.groups.append(_Group("xid", xid))

    # GPM (Hopper+): two reusable sample buffers, metrics computed between consecutive samples -----
    def _setup_gpm(self) -> None:
        n, h = self.nvml, self.handle
        try:
            if not n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                return
            self._gpm = [n.nvmlGpmSampleAlloc(), n.nvmlGpmSampleAlloc()]
            mg = n.c_nvmlGpmMetricsGet_t()
            mg.version = _const(n, "NVML_GPM_METRICS_GET_VERSION", 1)
            mg.numMetrics = len(_GPM_METRICS)
            for i, (const, default, name) in enumerate(_GPM_METRICS):
                mg.metrics[i].metricId = _const(n, const, default)
                self._gpm_names.append(name)
            self._gpm_get = mg
            n.nvmlGpmSampleGet(h, self._gpm[0])
            self._gpm_have_prev = True
        except Exception as e:
            log.debug("GPM metrics off: %s: %s", type(e).__name__, e)
            self._free_gpm()
            return
        self.groups.append(_Group("gpm", self._sample_gpm))

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
        _run_groups(self.groups, out, now, "GPU")
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


# --------------------------------------------------------------------------------------------
# Host (psutil)
# --------------------------------------------------------------------------------------------

def _busy_total(t: Any) -> tuple[float, float]:
    # As psutil.cpu_percent: guest time is already counted in user time on Linux.
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    idle = t.idle + getattr(t, "iowait", 0.0)
    return total - idle, total


class HostSampler:
    """Host-wide metrics via psutil. CPU is computed from our own cpu_times deltas, so the sampler
    does not disturb ``psutil.cpu_percent`` state that the training script may use. Counters are
    read with ``nowrap=False`` (cheaper); a counter going backwards gives no rate for that sample."""

    def __init__(self, psutil_mod: Any) -> None:
        self.ps = psutil_mod
        self._cpu_prev: tuple[float, float] | None = None
        self._core_prev: list[tuple[float, float]] | None = None
        self._core_last = -1e9
        self._net = _Rate()
        self._disk = _Rate()
        self.groups = [_Group("cpu", self._cpu), _Group("cpu_cores", self._cores), _Group("mem", self._mem),
                       _Group("net", self._net_io)]
        self._disks = self._whole_disks()
        if self._disks:
            self.groups.append(_Group("disk", self._disk_io))

    def _whole_disks(self) -> frozenset[str]:
        """Whole block devices to sum (not partitions, loop/ram/zram, or stacked dm/md devices, which
        would count the same bytes twice). Decided once; psutil's own filter stats /sys each call."""
        try:
            names = set(self.ps.disk_io_counters(perdisk=True, nowrap=False))
        except Exception:
            return frozenset()
        try:
            block = set(os.listdir("/sys/block"))
        except OSError:
            block = names
        skip = ("loop", "ram", "zram", "dm-", "md", "sr", "fd")
        return frozenset(n for n in names & block if not n.startswith(skip))

    def _cpu(self, out: dict[str, Any], now: float) -> None:
        busy, total = _busy_total(self.ps.cpu_times())
        prev, self._cpu_prev = self._cpu_prev, (busy, total)
        if prev is not None and total > prev[1]:
            out["cpu_util"] = round(100.0 * max(0.0, busy - prev[0]) / (total - prev[1]), 2)

    def _cores(self, out: dict[str, Any], now: float) -> None:
        if now - self._core_last < PER_CORE_EVERY_S - 0.05:
            return
        self._core_last = now
        cur = [_busy_total(t) for t in self.ps.cpu_times(percpu=True)]
        prev, self._core_prev = self._core_prev, cur
        if prev is None or len(prev) != len(cur):
            return
        for i, ((b, t), (pb, pt)) in enumerate(zip(cur, prev, strict=True)):
            if t > pt:
                out[f"cpu_util_core{i}"] = round(100.0 * max(0.0, b - pb) / (t - pt), 1)

    def _mem(self, out: dict[str, Any], now: float) -> None:
        vm = self.ps.virtual_memory()
        out["mem_used_bytes"] = vm.total - vm.available
        out["mem_total_bytes"] = vm.total

    def _net_io(self, out: dict[str, Any], now: float) -> None:
        sent = recv = 0
        for nic, c in self.ps.net_io_counters(pernic=True, nowrap=False).items():
            if nic != "lo":
                sent += c.bytes_sent
                recv += c.bytes_recv
        tx, rx = self._net.update(now, (sent, recv))
        if tx is not None:
            out["net_tx_bytes_s"], out["net_rx_bytes_s"] = tx, rx

    def _disk_io(self, out: dict[str, Any], now: float) -> None:
        read = write = 0
        for name, d in self.ps.disk_io_counters(perdisk=True, nowrap=False).items():
            if name in self._disks:
                read += d.read_bytes
                write += d.write_bytes
        r, w = self._disk.update(now, (read, write))
        if r is not None:
            out["disk_read_bytes_s"], out["disk_write_bytes_s"] = r, w

    def sample(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        _run_groups(self.groups, out, now, "host")
        return out


# --------------------------------------------------------------------------------------------
# The sampler thread
# --------------------------------------------------------------------------------------------

class HardwareSampler:
    """Samples this rank's GPU (and the host on local rank 0) and sends ``hw`` bodies via ``send``.

    ``period_s`` defaults to ``settings.hw_sample_s`` (0 = off: :meth:`start` does nothing).
    ``env`` (CUDA_VISIBLE_DEVICES) defaults to ``os.environ``. Thread-safe; never raises.
    """

    def __init__(self, settings: Settings, identity: RankIdentity, send: SendFn, clock: Clock | None = None, *,
                 period_s: float | None = None, fast_period_s: float = FAST_PERIOD_S,
                 send_every_s: float = SEND_EVERY_S, env: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.identity = identity
        self._send = send
        self.clock = clock or SYSTEM_CLOCK
        hw = getattr(settings, "hw_sample_s", 1.0)
        self.period_s = float(hw if period_s is None else period_s)
        self.fast_period_s = float(fast_period_s)
        self.send_every_s = float(send_every_s)
        self._env = env
        self.host_enabled = identity.local_rank <= 0
        self.gpu: GpuSampler | None = None
        self.host: HostSampler | None = None
        self._nvml: Any = None
        self._opened = False
        self._open_lock = threading.Lock()
        self._lock = threading.Lock()          # guards the buffer
        self._rows: list[tuple[int, int, dict[str, Any]]] = []
        self._fast = False
        self._stopping = False
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_send = time.monotonic()
        # Counters (read by benchmarks and tests).
        self.samples = 0
        self.messages = 0
        self.send_errors = 0
        self.gpu_ns = 0
        self.gpu_samples = 0
        self.host_ns = 0
        self.host_samples = 0

    # Public -----------------------------------------------------------------------------------
    @property
    def gpu_index(self) -> int | None:
        return None if self.gpu is None else self.gpu.index

    @property
    def fast(self) -> bool:
        return self._fast

    def start(self) -> HardwareSampler:
        """Start the sampler thread (NVML is initialised there). No-op when the period is 0."""
        try:
            if self.period_s > 0 and self._thread is None and not self._stopping:
                self._last_send = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="rankscope-hw", daemon=True)
                self._thread.start()
        except Exception as e:
            log.debug("hw sampler not started: %s", e)
        return self

    def set_fast(self, on: bool = True) -> None:
        """Sample every ``fast_period_s`` (trace windows) instead of ``period_s``. Switching on samples
        at once; switching off resumes the slow period from the last sample."""
        self._fast = bool(on)
        self._wake.set()

    def open(self) -> None:
        """Initialise NVML and psutil state once (idempotent; called by the thread)."""
        with self._open_lock:
            if self._opened:
                return
            self._opened = True
            self._open_gpu()
            if self.host_enabled:
                try:
                    self.host = HostSampler(importlib.import_module("psutil"))
                except Exception as e:
                    log.warning("rankscope: psutil unavailable (%s): host metrics off", e)

    def sample_once(self) -> int:
        """Take one sample of every enabled source into the buffer. Returns rows added. Never raises."""
        try:
            self.open()
            now = time.monotonic()
            ts = self.clock.wall_ns()
            rows: list[tuple[int, int, dict[str, Any]]] = []
            if self.gpu is not None:
                t0 = time.perf_counter_ns()
                g = self.gpu.sample(now)
                self.gpu_ns += time.perf_counter_ns() - t0
                self.gpu_samples += 1
                if g:
                    rows.append((ts, self.gpu.index, g))
            if self.host is not None:
                t0 = time.perf_counter_ns()
                h = self.host.sample(now)
                self.host_ns += time.perf_counter_ns() - t0
                self.host_samples += 1
                if h:
                    rows.append((ts, HOST_DEVICE, h))
            self.samples += 1
            if rows:
                with self._lock:
                    self._rows.extend(rows)
            return len(rows)
        except Exception as e:
            log.debug("hw sample failed: %s: %s", type(e).__name__, e)
            return 0

    def take_body(self) -> dict[str, Any] | None:
        """The buffered rows as one columnar ``hw`` body (None when empty); empties the buffer."""
        with self._lock:
            rows, self._rows = self._rows, []
        if not rows:
            return None
        names: dict[str, None] = {}
        for _, _, m in rows:
            for k in m:
                names.setdefault(k, None)
        return {"ts_ns": [r[0] for r in rows], "device": [r[1] for r in rows],
                "metrics": {k: [r[2].get(k) for r in rows] for k in names}}

    def flush(self) -> bool:
        """Send what is buffered. Returns True if a message went to ``send``. Never raises."""
        try:
            body = self.take_body()
            self._last_send = time.monotonic()
            if body is None:
                return False
            self._send("hw", body)
            self.messages += 1
            return True
        except Exception as e:
            self.send_errors += 1
            log.debug("hw send failed: %s: %s", type(e).__name__, e)
            return False

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop the thread, send the last buffered samples, release NVML. Idempotent; never raises."""
        if self._stopping:
            return
        self._stopping = True
        self._wake.set()
        t = self._thread
        try:
            if t is not None and t is not threading.current_thread():
                t.join(timeout_s)
            self.flush()
            if t is None or not t.is_alive():
                self._close_nvml()
        except Exception as e:
            log.debug("hw sampler stop: %s", e)

    def stats(self) -> dict[str, Any]:
        return {"samples": self.samples, "messages": self.messages, "send_errors": self.send_errors,
                "gpu_us_per_sample": round(self.gpu_ns / 1e3 / self.gpu_samples, 2) if self.gpu_samples else None,
                "host_us_per_sample": round(self.host_ns / 1e3 / self.host_samples, 2) if self.host_samples else None,
                "gpu_index": self.gpu_index, "host": self.host is not None, "fast": self._fast}

    # Internals --------------------------------------------------------------------------------
    def _open_gpu(self) -> None:
        try:
            nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
        except Exception as e:
            log.info("%s (%s)", NO_NVML_MESSAGE, type(e).__name__)
            return
        self._nvml = nvml
        try:
            env = os.environ if self._env is None else self._env
            picked = pick_gpu(nvml, self.identity.local_rank, env)
            if picked is None:
                log.warning("rankscope: no GPU for local rank %d (CUDA_VISIBLE_DEVICES=%r): GPU metrics off",
                            self.identity.local_rank, env.get("CUDA_VISIBLE_DEVICES"))
            else:
                self.gpu = GpuSampler(nvml, *picked)
        except Exception as e:
            log.warning("rankscope: GPU metrics off: %s: %s", type(e).__name__, e)
            self.gpu = None
        if self.gpu is None:
            self._close_nvml()

    def _close_nvml(self) -> None:
        if self.gpu is not None:
            self.gpu.close()
            self.gpu = None
        nvml, self._nvml = self._nvml, None
        if nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    def _run(self) -> None:
        try:
            self.open()
            if self.gpu is None and self.host is None:
                return
            next_at = time.monotonic()
            while not self._stopping:
                leave_profiler()
                sampled_at = time.monotonic()
                self.sample_once()
                now = time.monotonic()
                period = self.fast_period_s if self._fast else self.period_s
                # Send once per send_every_s; with slow periods, every sample is a message.
                if now - self._last_send >= max(self.send_every_s, period) - period / 2:
                    self.flush()
                next_at = max(next_at + period, now + period / 10)
                next_at = self._wait_until(next_at, sampled_at)
        except Exception as e:  # keep training alive whatever happens
            log.debug("hw sampler thread ended: %s: %s", type(e).__name__, e)

    def _wait_until(self, next_at: float, sampled_at: float) -> float:
        """Sleep until ``next_at`` or a switch of mode; returns when the next sample is due. Into fast
        mode (a window opened): now. Out of it (the window closed): a slow period after the last
        sample, not now: the window's sender is converting on this rank's cores just then, and a
        host sample costs ~1.4 ms of CPU on a busy host."""
        while not self._stopping:
            self._wake.wait(max(0.0, next_at - time.monotonic()))
            if not self._wake.is_set():
                return next_at
            self._wake.clear()
            if self._fast:
                return time.monotonic()
            next_at = sampled_at + self.period_s
            if time.monotonic() >= next_at:
                return next_at
        return next_at
