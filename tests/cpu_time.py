"""A pytest plugin that prints the tests that cost the most CPU, as ``--durations`` prints the
slowest by wall time: on a machine whose cores the suite keeps busy, CPU, not waiting, sets how
long ``make test`` takes, so this is the list to shorten.

A test's CPU is this process's and its reaped child processes' (``RUSAGE_SELF`` + ``RUSAGE_CHILDREN``,
user and system) over its setup, call and teardown. A child is counted when it is reaped: a broker
or server a module-scoped fixture starts is counted in the test whose teardown stops it.
``--cpu-durations=N`` (default 0: off) sets how many to print; tests/run_lanes.py asks for 15.
"""

from __future__ import annotations

import resource
from collections.abc import Iterator

import pytest


def cpu_seconds() -> float:
    """User + system CPU of this process and the child processes it has reaped."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="print the N tests that cost the most CPU (with their child processes)")


_costs: dict[str, float] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    before = cpu_seconds()
    yield
    _costs[item.nodeid] = cpu_seconds() - before


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    n = config.getoption("--cpu-durations")
    if not n or not _costs:
        return
    total = sum(_costs.values())
    terminalreporter.write_sep("=", f"most CPU: {n} tests of {len(_costs)} ({total:.0f} CPU-s in all)")
    for nodeid, cost in sorted(_costs.items(), key=lambda kv: -kv[1])[:n]:
        terminalreporter.write_line(f"{cost:8.1f} CPU-s  {nodeid}")
