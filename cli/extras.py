"""Which optional dependency group (pip extra) each server-side feature needs.

``pip install rankscope`` installs the rank side only (the Tracer and the Kafka CLI commands). The
offline analysis, the processors, the sink, the dashboard and the embedded ClickHouse come with
extras; a command whose extra is missing stops with :class:`MissingExtra` naming the extra to
install, instead of an ImportError from deep inside a page or a worker.
"""

from __future__ import annotations

import importlib.util

# extra -> the import names it provides (what its modules import at the top). extra_for takes the
# first extra that provides a name, so the smallest comes first: pandas missing for `rankscope
# analyze` names `analysis` (pandas, msgspec), not `processors` (which adds faust).
EXTRAS: dict[str, tuple[str, ...]] = {
    "gpu": ("pynvml",),
    "analysis": ("pandas", "msgspec"),
    "processors": ("faust", "aiokafka", "msgspec", "pandas", "prometheus_client"),
    "sink": ("clickhouse_connect", "pandas", "pyarrow", "prometheus_client"),
    "dashboard": ("streamlit", "altair", "clickhouse_connect", "pandas", "pyarrow", "prometheus_client"),
    "embedded": ("chdb",),
}


class MissingExtra(RuntimeError):
    """A command needs an optional dependency group that is not installed."""

    def __init__(self, what: str, extras: list[str], missing: list[str]) -> None:
        self.extras = extras
        self.missing = missing
        spec = f"rankscope[{','.join(extras)}]"
        super().__init__(f"{what} needs {', '.join(missing)} (not installed): "
                         f"pip install '{spec}' (or 'rankscope[server]' for every server part)")


def missing_modules(*extras: str) -> list[str]:
    """The import names of ``extras`` that cannot be found, in order, without importing them."""
    out: list[str] = []
    for extra in extras:
        for name in EXTRAS[extra]:
            if name not in out and importlib.util.find_spec(name) is None:
                out.append(name)
    return out


def require(what: str, *extras: str) -> None:
    """Raise MissingExtra unless every module of ``extras`` is importable. ``what`` names the caller
    in the message (e.g. "rankscope processors"). Never imports the modules."""
    missing = missing_modules(*extras)
    if missing:
        needed = [e for e in extras if any(m in EXTRAS[e] for m in missing)]
        raise MissingExtra(what, needed, missing)


def extra_for(module: str | None) -> str | None:
    """The extra that provides top-level import name ``module`` (e.g. from ModuleNotFoundError.name)."""
    top = (module or "").split(".")[0]
    return next((extra for extra, names in EXTRAS.items() if top in names), None)


def store_extras(embedded: bool) -> tuple[str, ...]:
    """Extras a process that opens the store needs: ``sink``, plus ``embedded`` for a chdb:// store."""
    return ("sink", "embedded") if embedded else ("sink",)
