"""``rankscope up|down|status|processors``: the whole local stack, and the processors worker."""

from __future__ import annotations

import argparse

from rankscope import services
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


def up(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.admin import ensure_topics
    from rankscope.broker import ensure_broker

    bootstrap = ensure_broker(settings, timeout_s=args.timeout)
    ensure_topics(settings, timeout_s=60)
    print(f"kafka        {bootstrap}")
    services.start(settings, "processors", ["processors"])
    services.start(settings, "serve", ["serve"])
    services.wait_port("127.0.0.1", settings.dashboard_port, args.timeout, "dashboard",
                       services.log_path(settings, "serve"))
    for name in SERVICES:
        print(f"{name:<12} pid {services.pid_of(settings, name)}  log {services.log_path(settings, name)}")
    print(f"store        {settings.store_dsn}")
    print(f"dashboard    http://127.0.0.1:{settings.dashboard_port}")
    return 0


def down(args: argparse.Namespace, settings: Settings) -> int:
    for name in ALL_SERVICES:
        if services.stop(settings, name):
            print(f"stopped {name}")
    if settings.local_broker and not args.keep_kafka:
        from rankscope.broker import LocalBroker

        if LocalBroker(settings).stop():
            print("stopped kafka")
    return 0


def status(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.broker import LocalBroker

    running = LocalBroker(settings).is_running() if settings.local_broker else None
    print(f"kafka        {settings.bootstrap} {'running' if running else 'external' if running is None else 'stopped'}")
    for name in SERVICES:
        pid = services.pid_of(settings, name)
        print(f"{name:<12} {'pid ' + str(pid) if pid else 'stopped'}")
    return 0


def processors(args: argparse.Namespace, settings: Settings) -> int:
    from rankscope.admin import ensure_topics
    from stream_processors.app import run_worker

    ensure_topics(settings, timeout_s=60)
    run_worker(settings, loglevel=settings.log_level.upper())
    return 0
