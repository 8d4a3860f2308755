"""The training thread's CPU time and run-queue wait, as the kernel counts them.

``/proc/<pid>/task/<tid>/schedstat`` holds three numbers for a thread: nanoseconds on a CPU,
nanoseconds runnable but waiting for one (the run-queue wait), and time slices. A rank whose
thread waits for a CPU much longer than its peers' is starved by its host (data-loader workers,
another job, too many ranks for the cores), which the slow-rank alert then says. The heartbeat
thread reads the file once a beat: one ``open`` and ``read`` of a 30-byte file.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


class ThreadCpu:
    """Reads one thread's ``(cpu_ns, runq_ns)``; ``None`` until a thread is watched, and for good
    once the file cannot be read (one log line says why)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self.path = ""
        self.off_reason = ""

    def watch(self, native_tid: int) -> None:
        """Read the thread with this kernel thread id (``threading.get_native_id()``) from now on."""
        if not self.off_reason:
            self.path = os.path.join(self.proc_root, str(os.getpid()), "task", str(native_tid), "schedstat")

    def read(self) -> tuple[int, int] | None:
        if not self.path or self.off_reason:
            return None
        try:
            with open(self.path, "rb") as f:
                cpu, runq = f.read().split()[:2]
            return int(cpu), int(runq)
        except (OSError, ValueError) as e:
            self.off_reason = f"{self.path}: {e}"
            log.info("rankscope: the training thread's run-queue wait is not reported (%s)", self.off_reason)
            return None
