"""Hardware sampling on the rank: NVML for this rank's GPU, psutil for the host (local rank 0 only).

A daemon thread samples every ``period_s`` (``settings.hw_sample_s``, default 1 s; 0.1 s while a trace
window is open, see :meth:`HardwareSampler.set_fast`) and sends what it buffered as one ``hw`` body
every ``send_every_s`` (``settings.hw_send_s``, default 5 s), or sooner once ``MAX_ROWS_PER_BODY``
entries are buffered, through the ``send(kind, body)`` callable the tracer provides (which wraps it
in an envelope and queues it on the HW topic). Sampling every second but sending every five keeps a
10,000-rank job at 2,000 hardware messages a second instead of 10,000 (with a beat per rank per
second, the ranks send 12,000 messages a second instead of 20,000). Bodies are columnar, one entry per (sample, device)::

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

Host metrics (psutil, device -1, local rank 0 only): ``cpu_util`` (%), ``cpu_util_core_max`` (%, the
busiest core) and ``cpu_cores_busy`` (cores at least 90% busy; both at most once a second),
``mem_used_bytes`` (total - available), ``mem_total_bytes``, ``net_tx_bytes_s``, ``net_rx_bytes_s``
(all interfaces but loopback), ``disk_read_bytes_s``, ``disk_write_bytes_s``.
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

from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import Settings
from rankscope.producers.hw_gpu import GpuSampler, pick_gpu
from rankscope.producers.hw_host import HostSampler
from rankscope.producers.identity import RankIdentity
from rankscope.producers.untraced import leave_profiler

log = logging.getLogger("rankscope.hw")

HOST_DEVICE = -1
FAST_PERIOD_S = 0.1
MAX_ROWS_PER_BODY = 64   # bounds a body (a GPU entry is ~0.2-0.5 KB, a host one ~0.2 KB)
NO_NVML_MESSAGE = "rankscope: no NVIDIA driver/NVML: GPU metrics off, host metrics only"

SendFn = Callable[[str, dict[str, Any]], None]


class HardwareSampler:
    """Samples this rank's GPU (and the host on local rank 0) and sends ``hw`` bodies via ``send``.

    ``period_s`` defaults to ``settings.hw_sample_s`` (0 = off: :meth:`start` does nothing),
    ``send_every_s`` to ``settings.hw_send_s``.
    ``env`` (CUDA_VISIBLE_DEVICES) defaults to ``os.environ``. Thread-safe; never raises.
    """

    def __init__(self, settings: Settings, identity: RankIdentity, send: SendFn, clock: Clock | None = None, *,
                 period_s: float | None = None, fast_period_s: float = FAST_PERIOD_S,
                 send_every_s: float | None = None, env: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.identity = identity
        self._send = send
        self.clock = clock or SYSTEM_CLOCK
        hw = getattr(settings, "hw_sample_s", 1.0)
        self.period_s = float(hw if period_s is None else period_s)
        self.fast_period_s = float(fast_period_s)
        self.send_every_s = float(getattr(settings, "hw_send_s", 5.0) if send_every_s is None else send_every_s)
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
        self.gpu_ns = 0              # wall time in NVML (much of it waiting on the driver)
        self.gpu_cpu_ns = 0          # this thread's CPU in it
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
                t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
                g = self.gpu.sample(now)
                self.gpu_ns += time.perf_counter_ns() - t0
                self.gpu_cpu_ns += time.thread_time_ns() - c0
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
                "gpu_cpu_us_per_sample": (round(self.gpu_cpu_ns / 1e3 / self.gpu_samples, 2) if self.gpu_samples
                                          else None),
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
                # Send once per send_every_s (with slow periods, every sample is a message), or when
                # the buffer holds a body's worth.
                if (now - self._last_send >= max(self.send_every_s, period) - period / 2
                        or len(self._rows) >= MAX_ROWS_PER_BODY):
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
