"""Host-wide metrics via psutil, sampled on local rank 0 (see producers/hw.py for names and units)."""

from __future__ import annotations

import os
from typing import Any

from rankscope.producers.hw_groups import MetricGroup, Rate, run_groups

PER_CORE_EVERY_S = 1.0
BUSY_CORE_PCT = 90.0


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
        self._net = Rate()
        self._disk = Rate()
        self.groups = [MetricGroup("cpu", self._cpu), MetricGroup("cpu_cores", self._cores), MetricGroup("mem", self._mem),
                       MetricGroup("net", self._net_io)]
        self._disks = self._whole_disks()
        if self._disks:
            self.groups.append(MetricGroup("disk", self._disk_io))

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
        utils = [100.0 * max(0.0, b - pb) / (t - pt) for (b, t), (pb, pt) in zip(cur, prev, strict=True) if t > pt]
        if utils:
            # Two numbers instead of one per core (a host has up to a few hundred): the hottest core
            # shows a single-threaded bottleneck (a data loader, the Python main thread), the count of
            # busy cores a host short of CPU.
            out["cpu_util_core_max"] = round(max(utils), 1)
            out["cpu_cores_busy"] = float(sum(u >= BUSY_CORE_PCT for u in utils))

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
        run_groups(self.groups, out, now, "host")
        return out
