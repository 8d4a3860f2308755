"""The serve process: in embedded mode the one process that holds the chDB directory.

It runs the sink in a daemon thread and the Streamlit dashboard in-process, so the pages read the
store through the same clickhouse-connect client (``open_store(settings.store_dsn)`` returns the
process's shared store). With a ClickHouse server DSN the same process works too, and the sink may
run elsewhere (``rankscope sink``; ``serve --no-sink``).

Order matters (see FACTS.md "Embedded mode in one process"):
1. import pandas, pyarrow and clickhouse_connect in the main thread (a first import racing between
   threads fails with "partially initialized module");
2. export every setting as ``RANKSCOPE_*`` into ``os.environ`` so that pages, which build their
   settings with ``Settings.from_env()``, get identical settings;
3. open the store (raises StoreLocked while another process holds the directory);
4. start the sink thread and, in embedded mode, the loopback query endpoint
   (``storage/query_endpoint.py``: ``rankscope sql`` and ``rankscope export`` read through it);
5. run Streamlit in the main thread (``bootstrap.run`` blocks; SIGINT/SIGTERM stop it), then stop the
   sink, which writes and commits its open batch, and close the store.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
from dataclasses import fields
from pathlib import Path
from typing import Any

from rankscope.clock import SYSTEM_CLOCK, Clock
from rankscope.config import ConfigError, Settings, redact_dsn

log = logging.getLogger(__name__)

SINK_RESTART_S = 5.0
SINK_JOIN_S = 30.0
# Streamlit's toolbar: "minimal" shows no developer items (Deploy, Rerun, Clear cache) and, as the
# dashboard sets no menu items, no main menu either.
TOOLBAR_MODE = "minimal"
#: The Streamlit options every dashboard process runs with (``rankscope serve``, and the benchmarks'
#: and browser tests' ``streamlit run``): headless, no telemetry, the minimal toolbar, and no file
#: watcher. A watcher reruns nothing on a deployed dashboard, yet after every run of a page it scans
#: every loaded module's path for new files to watch: ~8% of a 10,000-rank Job page visit on 2 cores.
FIXED_OPTIONS: dict[str, Any] = {
    "server_headless": True,
    "browser_gatherUsageStats": False,
    "client_toolbarMode": TOOLBAR_MODE,
    "server_fileWatcherType": "none",
}


def option_flags(options: dict[str, Any]) -> list[str]:
    """``streamlit run`` flags for ``bootstrap.run``-style options: ``{"server_port": 1}`` ->
    ``["--server.port", "1"]`` (booleans as ``true``/``false``)."""
    flags = []
    for key, value in options.items():
        section, _, name = key.partition("_")
        flags += [f"--{section}.{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    return flags

_RUNNING: dict[str, Any] = {}   # the sink of this process, for pages that show its stats
_RUNNING_LOCK = threading.Lock()


def running_sink() -> Any:
    """The Sink running in this process (serve or sink command), or None."""
    with _RUNNING_LOCK:
        return _RUNNING.get("sink")


def default_script() -> Path:
    """The dashboard's web server script (dashboard/server.py: Streamlit's ASGI app for app.py).
    Streamlit runs it: serve locates it and imports none of the dashboard's code."""
    import importlib.util

    spec = importlib.util.find_spec("rankscope.dashboard")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("rankscope.dashboard is not installed (pip install 'rankscope[dashboard]')")
    return Path(spec.origin).resolve().parent / "server.py"


def export_settings(settings: Settings, environ: Any = None) -> dict[str, str]:
    """Write every setting into ``environ`` (default ``os.environ``) as ``RANKSCOPE_<NAME>``.

    Returns what was written. Raises ConfigError when the result would not rebuild ``settings``
    (e.g. an empty string where the default is not empty: an empty env var means "default").
    """
    env = os.environ if environ is None else environ
    written = {}
    for f in fields(settings):
        value = getattr(settings, f.name)
        written[f"RANKSCOPE_{f.name.upper()}"] = str(value)
    env.update(written)
    rebuilt = Settings.from_env(env)
    if rebuilt != settings:
        diff = [f.name for f in fields(settings) if getattr(rebuilt, f.name) != getattr(settings, f.name)]
        raise ConfigError(f"settings {diff} cannot be passed through RANKSCOPE_* env vars unchanged")
    return written


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(settings: Settings) -> None:
    """Raise ConfigError when the dashboard would bind a non-loopback address without a password."""
    if not is_loopback(settings.dashboard_host) and not settings.dashboard_password:
        raise ConfigError(
            f"dashboard_host={settings.dashboard_host!r} is reachable from other machines, so the dashboard "
            "needs a password: set RANKSCOPE_DASHBOARD_PASSWORD, or bind 127.0.0.1 (RANKSCOPE_DASHBOARD_HOST)")


def streamlit_options(settings: Settings) -> dict[str, Any]:
    """Flag options for ``bootstrap.run``: ``dashboard_host``, :data:`FIXED_OPTIONS` (headless, no
    telemetry, no developer toolbar or menu, so no "Deploy" button even on localhost; no file
    watcher), and the agent API (when this Streamlit
    has it) on loopback binds only."""
    from streamlit import config as st_config

    opts: dict[str, Any] = {
        "server_port": settings.dashboard_port,
        "server_address": settings.dashboard_host,
        **FIXED_OPTIONS,
    }
    if "server.enableAgentApi" in getattr(st_config, "_config_options_template", {}):
        opts["server_enableAgentApi"] = is_loopback(settings.dashboard_host)
    return opts


def _preload_main_thread_imports() -> None:
    import clickhouse_connect  # noqa: F401
    import pandas  # noqa: F401
    import pyarrow  # noqa: F401


class SinkThread:
    """Runs a Sink in a daemon thread; rebuilds it after an unexpected error (the dashboard stays up)."""

    def __init__(self, settings: Settings, store: Any, clock: Clock = SYSTEM_CLOCK) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._main, name="rankscope-sink", daemon=True)

    def start(self) -> SinkThread:
        self.thread.start()
        return self

    def stop(self, timeout_s: float = SINK_JOIN_S) -> bool:
        """Ask the sink to write its open batch and close; True when it finished within ``timeout_s``."""
        self.stop_event.set()
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.error("sink thread did not stop within %.0fs", timeout_s)
            return False
        return True

    def _main(self) -> None:
        from rankscope.kafka_client import KafkaAuthError
        from rankscope.storage.sink import Sink

        while not self.stop_event.is_set():
            sink = None
            try:
                sink = Sink(self.settings, self.store, self.clock)
                with _RUNNING_LOCK:
                    _RUNNING["sink"] = sink
                log.info("sink consuming %s into %s", sorted(sink.topics.values()), redact_dsn(self.store.dsn))
                sink.run(self.stop_event)
            except KafkaAuthError:
                return  # reported once by the client; the same credentials would fail again
            except Exception:
                log.exception("sink failed; restarting in %.0fs", SINK_RESTART_S)
                if sink is not None:
                    try:
                        sink.close()
                    except Exception:
                        log.exception("closing the failed sink")
                self.stop_event.wait(SINK_RESTART_S)
            finally:
                with _RUNNING_LOCK:
                    if _RUNNING.get("sink") is sink:
                        _RUNNING.pop("sink", None)


def serve(settings: Settings, script_path: str | Path | None = None, *, with_sink: bool = True,
          clock: Clock = SYSTEM_CLOCK) -> int:
    """Run the dashboard (and, by default, the sink) in this process until SIGINT/SIGTERM. Blocks.

    Must be called from the main thread (Streamlit installs signal handlers). Raises StoreLocked when
    another process holds the embedded store, ConfigError for a missing script or for a non-loopback
    ``dashboard_host`` without ``dashboard_password``. Returns 0.
    """
    check_bind(settings)
    script = Path(script_path) if script_path is not None else default_script()
    if not script.is_file():
        raise ConfigError(f"dashboard script {script} does not exist")
    _preload_main_thread_imports()
    export_settings(settings)

    from streamlit.web import bootstrap

    from rankscope.retention import table_ttl_days
    from rankscope.storage.store import close_store, open_store

    store = open_store(settings.store_dsn, ttl_days=table_ttl_days(settings.store_ttl_days))
    from rankscope.metrics import start_metrics

    start_metrics(settings, "serve")
    sink = SinkThread(settings, store, clock).start() if with_sink else None
    endpoint = _start_query_endpoint(settings, store)
    opts = streamlit_options(settings)
    log.info("dashboard on http://%s:%d (store %s, sink %s, password %s)", settings.dashboard_host,
             settings.dashboard_port, settings.store_dsn_redacted, "on" if sink else "off",
             "required" if settings.dashboard_password else "off")
    from rankscope.storage import closed_tabs

    closed_tabs.install()
    try:
        bootstrap.load_config_options(opts)
        run_streamlit(script, opts)
    finally:
        if endpoint is not None:
            endpoint.stop()
        if sink is not None:
            sink.stop()
        close_store(settings.store_dsn)
    return 0


class _Stopped(Exception):
    """SIGINT or SIGTERM, raised again by uvicorn once it has shut the server down."""


def _stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


def run_streamlit(script: Path, opts: dict[str, Any]) -> None:
    """Serve ``script`` as ``streamlit run`` does: an ``st.App`` in it through uvicorn, else the
    script itself. Blocks until SIGINT/SIGTERM, then returns.

    uvicorn handles the signal, shuts the server down and then raises the signal again for the
    handler it found: with the default one, SIGTERM would end the process before the caller's
    clean-up (the sink, the query endpoint's file). So the handlers it finds raise an exception,
    caught here."""
    from streamlit.web import bootstrap
    from streamlit.web.server.app_discovery import discover_asgi_app

    found = discover_asgi_app(script)
    if not (found.is_asgi_app and found.import_string):
        bootstrap.run(str(script), False, [], opts)
        return
    previous = {sig: signal.signal(sig, _stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        bootstrap.run_asgi_app(str(script), found.import_string, [], opts)
    except _Stopped:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start_query_endpoint(settings: Settings, store: Any) -> Any:
    """In embedded mode, serve's loopback query endpoint (``rankscope sql``/``export`` use it); else None."""
    if not store.embedded:
        return None
    from rankscope.storage.query_endpoint import QueryEndpoint

    return QueryEndpoint(store, settings.data_dir).start()


def run_sink(settings: Settings, clock: Clock = SYSTEM_CLOCK) -> int:
    """Run the sink alone in this process until SIGINT/SIGTERM. Blocks; returns 0.

    Raises StoreLocked when the embedded store is held by another process (e.g. ``rankscope serve``).
    """
    _preload_main_thread_imports()
    from rankscope.gc_tuning import tune_for_streaming
    from rankscope.retention import table_ttl_days
    from rankscope.storage.sink import Sink
    from rankscope.storage.store import close_store, open_store

    store = open_store(settings.store_dsn, ttl_days=table_ttl_days(settings.store_ttl_days))
    if store.embedded:
        log.warning("the sink holds the embedded store %s alone: nothing else can read it while it runs "
                    "(`rankscope serve` runs sink and dashboard together)", settings.store_dsn_redacted)
    from rankscope.metrics import start_metrics

    start_metrics(settings, "sink")
    tune_for_streaming()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        sink = Sink(settings, store, clock)
        with _RUNNING_LOCK:
            _RUNNING["sink"] = sink
        log.info("sink consuming %s into %s", sorted(sink.topics.values()), settings.store_dsn_redacted)
        sink.run(stop)
        log.info("sink stopped: %s", sink.stats())
    finally:
        with _RUNNING_LOCK:
            _RUNNING.pop("sink", None)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        close_store(settings.store_dsn)
    return 0
