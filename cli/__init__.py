"""The ``rankscope`` command. Each subcommand lives in cli/commands/<name>.py and exposes
``register(subparsers, common)``; this module only discovers and dispatches them.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys

from rankscope.cli import logs
from rankscope.cli.extras import MissingExtra, extra_for
from rankscope.config import ConfigError, Settings, unknown_env
from rankscope.kafka_client import KafkaAuthError
from rankscope.version import package_version

log = logging.getLogger("rankscope.cli")


def common_parser() -> argparse.ArgumentParser:
    """Flags every command accepts; each overrides its RANKSCOPE_* env var."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common settings (override RANKSCOPE_* env vars)")
    g.add_argument("--data-dir", dest="data_dir", help="local state folder (RANKSCOPE_DATA_DIR)")
    g.add_argument("--bootstrap-servers", dest="bootstrap_servers",
                   help="external Kafka bootstrap; empty = managed local broker")
    g.add_argument("--kafka-port", dest="kafka_port", type=int)
    g.add_argument("--clickhouse-dsn", dest="clickhouse_dsn", help="chdb:///path or http://host:8123")
    g.add_argument("--topic-prefix", dest="topic_prefix")
    g.add_argument("--dashboard-port", dest="dashboard_port", type=int)
    g.add_argument("--log-level", dest="log_level")
    return p


SETTING_FLAGS = ("data_dir", "bootstrap_servers", "kafka_port", "clickhouse_dsn", "topic_prefix",
                 "dashboard_port", "log_level")


def build_parser() -> argparse.ArgumentParser:
    common = common_parser()
    parser = argparse.ArgumentParser(prog="rankscope", description="rankscope: find out, while it runs, why a distributed PyTorch job is slow or stuck.")
    parser.add_argument("--version", action="version", version=f"rankscope {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    import rankscope.cli.commands as pkg

    for mod in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"rankscope.cli.commands.{mod.name}")
        if hasattr(module, "register"):
            module.register(sub, common)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    return Settings.from_env(**{k: getattr(args, k, None) for k in SETTING_FLAGS})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        parser.error(str(e))
    logs.configure(settings, service=args.command)
    for warning in unknown_env():
        log.warning("%s", warning)
    try:
        rc = args.func(args, settings)
    except ConfigError as e:
        print(f"rankscope: error: {e}", file=sys.stderr)
        return 2
    except KafkaAuthError:
        return 1  # the client's error callback logged the one clear message
    except MissingExtra as e:
        print(f"rankscope: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = extra_for(e.name)
        if extra is None:
            raise
        print(f"rankscope: error: {e.name} is not installed: pip install 'rankscope[{extra}]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
