"""The stream services' collector settings (rankscope/gc_tuning.py); that the sink and the
processors apply them is checked on the running services (tests/integration/test_metrics_scrape.py)."""

from __future__ import annotations

import subprocess
import sys

from rankscope.gc_tuning import STREAMING_THRESHOLDS


def test_tune_for_streaming_freezes_start_up_objects_and_raises_thresholds() -> None:
    # In a child process: freezing and thresholds are process-wide.
    code = ("import gc; from rankscope.gc_tuning import tune_for_streaming; "
            "before = gc.get_freeze_count(); tune_for_streaming(); "
            "print(gc.get_threshold(), before, gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == f"{STREAMING_THRESHOLDS} 0 True"
