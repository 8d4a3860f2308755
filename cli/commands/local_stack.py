"""``rankscope up|down|status|processors|supervise``: the whole local stack, and the processors worker.

``up`` starts one detached ``supervise`` process, which runs ``processors`` and ``serve`` as its
children and restarts them when they exit (cli/stack/supervisor.py); ``down`` stops it, then
whatever is left.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import time

from rankscope.cli import extras
from rankscope.cli.stack import services, supervisor
from rankscope.config import Settings

SERVICES = ("processors", "serve")
ALL_SERVICES = ("demo-job", *SERVICES)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("up", parents=[common], help="start broker, topics, processors, sink and dashboard")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each service")
    p.set_defaults(func=up)
    p = sub.add_parser("down", parents=[common], help="stop everything `rankscope up` started")
    p.add_argument("--keep-kafka", action="store_true", help="leave the local broker running")
    p.set_defaults(func=down)
    p = sub.add_parser("status", parents=[common], help="which local services run")
    p.set_defaults(func=status)
    p = sub.add_parser("processors", parents=[common], help="run the faust stream processors (foreground)")
    p.set_defaults(func=processors)
    p = sub.add_parser("supervise", parents=[common],
                       help="(started by `up`) run processors and serve, restarting them when they exit")
    # Tests supervise a stand-in instead of the real services: NAME=COMMAND (a shell-quoted argv).
    p.add_argument("--service", action="append", default=[], metavar="NAME=COMMAND", help=argparse.SUPPRESS)
    p.set_defaults(func=supervise)


def up(args: argparse.Namespace, settings: Settings) -> int:
    extras.require("rankscope up", "processors", "dashboard", *extras.store_extras(settings.embedded_store))
    from rankscope.cli.stack.admin import ensure_topics
    from rankscope.cli.stack.broker import ensure_broker
    from rankscope.storage.serve import check_bind

    check_bind(settings)  # before starting anything: serve would refuse, and be restarted, forever

    bootstrap = ensure_broker(settings, timeout_s=args.timeout)
    ensure_topics(settings, timeout_s=60)
    print(f"kafka        {bootstrap}")
    if not services.pid_of(settings, "supervisor"):
        for name in SERVICES:  # left by an earlier start without a supervisor
            services.stop(settings, name)
    services.start(settings, "supervisor", ["supervise"])
    services.wait_port("127.0.0.1", settings.dashboard_port, args.timeout, "dashboard",
                       services.log_path(settings, "serve"))
    print(f"supervisor   pid {services.pid_of(settings, 'supervisor')}  log {services.log_path(settings, 'supervisor')}")
    for name in SERVICES:
        print(f"{name:<12} pid {services.pid_of(settings, name)}  log {services.log_path(settings, name)}")
    print(f"store        {settings.store_dsn_redacted}")
    print(f"dashboard    http://127.0.0.1:{settings.dashboard_port}")
    return 0


def down(args: argparse.Namespace, settings: Settings) -> int:
    if services.stop(settings, "supervisor", timeout_s=supervisor.STOP_TIMEOUT_S + 10):
        print("stopped supervisor")
    for name in ALL_SERVICES:
        if services.stop(settings, name):
            print(f"stopped {name}")
    if settings.local_broker and not args.keep_kafka:
        from rankscope.cli.stack.broker import LocalBroker

        if LocalBroker(settings).stop():
            print("stopped kafka")
    return 0


def status(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.cli.stack.broker import LocalBroker

    running = LocalBroker(settings).is_running() if settings.local_broker else None
    print(f"kafka        {settings.bootstrap} {'running' if running else 'external' if running is None else 'stopped'}")
    sup_pid = services.pid_of(settings, "supervisor")
    state = supervisor.read_state(settings) if sup_pid else None
    print(f"supervisor   {'pid ' + str(sup_pid) if sup_pid else 'stopped'}")
    if state is None:
        for name in SERVICES:
            pid = services.pid_of(settings, name)
            print(f"{name:<12} {'pid ' + str(pid) if pid else 'stopped'}{_metrics(settings, name)}")
        return 0
    for name, svc in state.get("services", {}).items():
        pid, started = svc.get("pid"), svc.get("started")
        line = f"pid {pid}  up {_duration(time.time() - started)}" if pid and started else "waiting to restart"
        line += f"  restarts {svc.get('restarts', 0)}"
        if svc.get("last_exit"):
            line += f"  last exit {svc['last_exit']}"
        print(f"{name:<12} {line}{_metrics(settings, name)}")
    return 0


def _metrics(settings: Settings, name: str) -> str:
    url = settings.metrics_url(name)
    return f"  metrics {url}" if url else ""


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def supervise(args: argparse.Namespace, settings: Settings) -> int:
    other = services.pid_of(settings, "supervisor")
    if other and other != os.getpid():
        print(f"rankscope supervise: a supervisor already runs (pid {other})", file=sys.stderr)
        return 1
    specs = []
    for item in args.service:
        name, sep, command = item.partition("=")
        if not sep or not name or not command:
            print(f"rankscope supervise: --service wants NAME=COMMAND, got {item!r}", file=sys.stderr)
            return 2
        specs.append(supervisor.ServiceSpec(name, tuple(shlex.split(command))))
    sup = supervisor.Supervisor(settings, specs or supervisor.rankscope_services(SERVICES))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.request_stop())
    pid_file = services.run_dir(settings) / "supervisor.pid"
    pid_file.write_text(str(os.getpid()))
    try:
        return sup.run()
    finally:
        if services.pid_of(settings, "supervisor") == os.getpid():
            pid_file.unlink()


def processors(args: argparse.Namespace, settings: Settings) -> int:
    extras.require("rankscope processors", "processors")
    from rankscope.cli.stack.admin import ensure_topics
    from rankscope.stream_processors.app import run_worker

    ensure_topics(settings, timeout_s=60)
    run_worker(settings, loglevel=settings.log_level.upper())
    return 0
