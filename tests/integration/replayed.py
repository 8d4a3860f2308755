"""Replayed windows (a helper module, not a test): recorded trace files sent through the real
pipeline with ``rankscope replay``, and the report the processors built for them."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rankscope.cli.stack.admin import ensure_topics
from rankscope.config import Settings
from tests.integration.helpers import child_env, start_processors, stop_process, tail

# A replayed job has no live ranks to announce who is expected: its report is built at the deadline.
REPORT_DEADLINE_S = 3.0


@contextmanager
def processors(kafka_settings: Settings, work: Path, prefix: str) -> Iterator[Settings]:
    """A processors worker on fresh topics (prefix ``prefix``); yields its settings, stops it on exit."""
    settings = kafka_settings.with_overrides(topic_prefix=prefix, data_dir=str(work), auto_trace_steps=0,
                                             report_deadline_s=REPORT_DEADLINE_S)
    ensure_topics(settings, timeout_s=60)
    proc = start_processors(settings, work / "processors.log")
    try:
        yield settings
    finally:
        stop_process(proc)
        print("processors log:\n" + tail(work / "processors.log"))


def replayed_report(settings: Settings, job: str, window_id: str, paths: list[Path], timeout_s: float = 300
                    ) -> dict[str, Any]:
    """Replay ``paths`` as window ``window_id`` of ``job`` and return the processors' report of it."""
    from rankscope.trace_client import wait_for_report

    replayed_ns = time.time_ns()
    out = subprocess.run([sys.executable, "-m", "rankscope", "replay", *map(str, paths), "--job", job,
                          "--window-id", window_id], env=child_env(settings), capture_output=True, text=True,
                         timeout=timeout_s)
    assert out.returncode == 0, out.stdout + out.stderr
    rep = wait_for_report(settings, job, window_id, timeout_s, since_ns=replayed_ns)
    assert rep is not None, f"no report for {job}/{window_id} within {timeout_s:.0f} s"
    return rep


def offline_report(settings: Settings, paths: list[Path], timeout_s: float = 600) -> dict[str, Any]:
    """``rankscope analyze --format json`` of ``paths``; asserts it printed its progress."""
    out = subprocess.run([sys.executable, "-m", "rankscope", "analyze", *map(str, paths), "--format", "json"],
                         env=child_env(settings), capture_output=True, text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stderr
    assert f"{len(paths)}/{len(paths)} files analysed" in out.stderr, out.stderr
    return json.loads(out.stdout)
