"""rankscope's own frames, told apart from the user's in any frame name rankscope handles. Pure.

Names come in three forms: the profiler's ``path/file.py(12): func``, the heartbeat stacks'
``path/file.py:12 func`` (producers/stacks.py), and bare function names. A frame is rankscope's own
when its function is a wrapper (``_rankscope_*``) or its file is one of rankscope's modules
(producers, rankscope, stream_processors, offline, cli, storage, dashboard; the example job rankscope/demo is
the user's code), matched on the package-relative path, so a user's ``storage/io.py`` is not hidden
unless rankscope ships a ``storage/io.py`` too.

Call paths (outermost frame first, ``"root;...;leaf"`` as strings) are folded by one rule, used by
the flame graph, the folded-stack and speedscope exports and the report: :func:`user_path` leaves
rankscope's frames out, so an own frame's time counts as the user's call that made it, and a user's
frame called through a wrapper hangs under the user's caller.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterable
from pathlib import Path

WRAPPER_PREFIX = "_rankscope_"
PACKAGES = ("producers", "rankscope", "stream_processors", "offline", "cli", "storage", "dashboard")
_PROFILER = re.compile(r"^(?P<path>.*?\.py)\(\d+\): (?P<func>.*)$")
_LABEL = re.compile(r"^(?P<path>\S*?\.py):\d+ (?P<func>.*)$")


@functools.cache
def package_dirs() -> dict[str, Path]:
    """Where each of rankscope's packages lies, by its short name: ``rankscope/producers`` once
    installed, the checkout's ``producers/`` folder in development. Found without importing them."""
    out = {"rankscope": Path(__file__).resolve().parent}
    for pkg in PACKAGES:
        if pkg != "rankscope":
            spec = importlib.util.find_spec(f"rankscope.{pkg}")
            if spec is not None and spec.submodule_search_locations:
                out[pkg] = Path(next(iter(spec.submodule_search_locations))).resolve()
    return out


@functools.cache
def own_files() -> frozenset[str]:
    """Package-relative paths of rankscope's modules, e.g. ``producers/collectives.py``."""
    out = set()
    for pkg, root in package_dirs().items():
        for p in root.rglob("*.py"):
            rel = f"{pkg}/{p.relative_to(root).as_posix()}"
            if not rel.startswith("rankscope/demo/"):
                out.add(rel)
    return frozenset(out)


def split_frame(name: str) -> tuple[str, str]:
    """(file path or "", function) of a frame name in any of the three forms."""
    m = _PROFILER.match(name) or _LABEL.match(name)
    return (m.group("path"), m.group("func")) if m else ("", name)


@functools.lru_cache(maxsize=65536)
def is_own_frame(name: str) -> bool:
    """True when the frame ``name`` is rankscope's code, not the user's."""
    path, func = split_frame(name)
    if func.startswith(WRAPPER_PREFIX):
        return True
    if not path:
        return False
    path = path.replace("\\", "/")
    files = own_files()
    parts = path.split("/")
    return any("/".join(parts[i:]) in files for i in range(max(0, len(parts) - 4), len(parts) - 1))


def user_path(frames: Iterable[str]) -> tuple[str, ...]:
    """The frames of a call path (outermost first) less rankscope's own: the path the user's time
    is counted at. Empty when every frame is rankscope's."""
    return tuple(f for f in frames if not is_own_frame(f))


def fold_path(path: str, sep: str = ";") -> str:
    """:func:`user_path` of a ``"root;...;leaf"`` string, joined again ("" when nothing is left)."""
    return sep.join(user_path(f for f in path.split(sep) if f))


def has_own_frame(path: str, sep: str = ";") -> bool:
    """True when any frame of the ``"root;...;leaf"`` string ``path`` is rankscope's."""
    return any(is_own_frame(f) for f in path.split(sep) if f)
