"""A dashboard server for the browser tests: started as a real process, waited for until its health
endpoint answers, stopped, and its log checked for tracebacks (a helper module, not a test)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.dashboard_process import running, streamlit_cmd
from rankscope.cli.stack.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
__all__ = ["ROOT", "free_port", "served", "streamlit_cmd"]


@contextmanager
def served(cmd: list[str], port: int, env: dict[str, str], log: Path, cwd: Path = ROOT,
           stop_timeout_s: float = 15.0) -> Iterator[str]:
    """Run ``cmd`` (a dashboard listening on ``port``), yield its URL once healthy, then stop it and
    assert its log has no traceback."""
    with running(cmd, port, env, log, cwd, stop_timeout_s) as url:
        yield url
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
