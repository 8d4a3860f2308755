"""The import layering, enforced: the protocol and shared rules (the ground layer, rankscope/) import
none of the runtimes; producers, processors, sink and dashboard import the ground layer and not
each other; the offline analysis (offline/) imports the processors' pure analyzers, the ranks'
summarizer and the store, and nothing live imports it; the CLI imports the runtimes it drives but
not the dashboard (the CLI, its commands and the local stack they run live in cli/, installed as
``rankscope.cli``); nothing imports the CLI or the dashboard (``rankscope/__main__.py`` runs the CLI;
``storage/serve.py`` hands the dashboard's script to Streamlit, which runs it). The package's public facades
(``rankscope/__init__.py``: ``Tracer``; ``rankscope/analysis.py``: ``TraceAnalysis``) are a layer of
their own on top: they load the runtime whose API they expose, and nothing but users imports them.

Every import counts, also the ones inside functions (they are how optional parts load lazily). The
imports a module runs when it is loaded (its top-level ones) form no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUNTIMES = ("producers", "stream_processors", "offline", "storage", "dashboard")
CLI = ("rankscope.cli", "rankscope.__main__")      # cli/: the commands and the local stack they run
FACADES = ("rankscope", "rankscope.analysis")     # `from rankscope import Tracer`, TraceAnalysis

# package -> the packages it may import besides itself and the ground layer
MAY_IMPORT = {
    "producers": set(),
    "stream_processors": set(),
    "offline": {"stream_processors", "producers", "storage"},   # shared analyzers, the ranks' summarizer
    "storage": set(),
    "dashboard": {"storage"},          # the pages read the store
    "rankscope": set(),                # the ground layer
    "cli": {"producers", "stream_processors", "offline", "storage"},   # cli/: rankscope.cli.*
    "demo": set(),                     # the example job: the tracer through the ground layer's facade
    "facade": {"producers", "offline"},    # the public API: the tracer, the offline analysis
}



def layer(module: str) -> str:
    """The layer of a module by its installed name (``rankscope.storage.sink`` is in ``storage``)."""
    parts = module.split(".")
    if parts[0] != "rankscope":
        return parts[0]
    if module in FACADES:
        return "facade"
    if len(parts) > 1 and parts[1] in RUNTIMES:
        return parts[1]
    return "cli" if module.startswith(CLI) else ("demo" if module.startswith("rankscope.demo") else "rankscope")


def imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def source_files() -> list[tuple[str, Path]]:
    files = []
    for pkg in (*RUNTIMES, "cli", "rankscope"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            module = rel[:-3].replace("/", ".").removesuffix(".__init__")
            module = module if pkg == "rankscope" else f"rankscope.{module}"   # its installed name
            files.append((module, path))
    return files


def violations() -> list[str]:
    bad = []
    for module, path in source_files():
        src = layer(module)
        rel = path.relative_to(REPO).as_posix()
        for name in imports(path):
            # `from rankscope import protocol` imports a module of the ground layer, not the facade.
            dst = layer(name) if name != "rankscope" else "rankscope"
            if dst not in (*RUNTIMES, "rankscope", "cli", "demo", "facade") or dst == src or dst == "rankscope":
                continue
            if dst not in MAY_IMPORT[src]:
                bad.append(f"{rel} imports {name} ({src} -> {dst})")
    return bad


def load_time_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that loading ``path`` imports: its top-level imports (those under
    ``if TYPE_CHECKING`` run only for the type checker; those in functions run when called)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out & known


def import_cycles() -> list[list[str]]:
    """The cycles among load-time imports (strongly connected components of two or more modules)."""
    files = dict(source_files())
    graph = {m: load_time_imports(p, set(files)) - {m} for m, p in files.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:          # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_module_imports_itself_back_when_loaded():
    assert import_cycles() == []


def test_the_check_sees_a_cycle(tmp_path, monkeypatch):
    ground = tmp_path / "rankscope"
    ground.mkdir()
    (ground / "a.py").write_text("from rankscope.b import x\n")
    (ground / "b.py").write_text("from rankscope import c\n")
    (ground / "c.py").write_text("import rankscope.a\n")
    (ground / "d.py").write_text("from rankscope.a import y\ndef f():\n    from rankscope.d import z\n")
    (ground / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rankscope.f import T\n")
    (ground / "f.py").write_text("from rankscope.e import U\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["REPO"]), "REPO", tmp_path)
    assert import_cycles() == [["rankscope.a", "rankscope.b", "rankscope.c"]]


@pytest.mark.parametrize("module, expected", [("rankscope", "facade"), ("rankscope.analysis", "facade"),
                                              ("rankscope.protocol.envelope", "rankscope"), ("rankscope.cli.commands.trace", "cli"),
                                              ("rankscope.storage.sink", "storage")])
def test_modules_are_placed_in_their_layer(module, expected):
    assert layer(module) == expected


def test_the_layers_import_only_downwards():
    assert len(source_files()) > 100          # the scan sees the code it checks
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The scan itself: an import of the CLI from a runtime is found, also inside a function, and so
    are an import of the offline analysis from the processors and of the dashboard from the CLI."""
    fake = tmp_path / "stream_processors"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from rankscope.cli.commands.trace import run\n")
    (fake / "ok.py").write_text("from rankscope.protocol.envelope import decode\nfrom rankscope.stream_processors import app\n")
    (fake / "also_bad.py").write_text("from rankscope.producers.tracer import Tracer\n")
    (fake / "offline_bad.py").write_text("def f():\n    from rankscope.offline.kineto import load_trace\n")
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "ok.py").write_text("from rankscope.stream_processors.analysis.report import build_report\n"
                                   "from rankscope.producers.trace_events import summarize\n")
    commands = tmp_path / "cli" / "commands"
    commands.mkdir(parents=True)
    (commands / "bad.py").write_text("def run():\n    from rankscope.dashboard import queries\n")
    (commands / "ok.py").write_text("from rankscope.storage.windows import trace_events\nfrom rankscope.cli.commands import bad\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["REPO"]), "REPO", tmp_path)
    assert violations() == [
        "stream_processors/also_bad.py imports rankscope.producers.tracer (stream_processors -> producers)",
        "stream_processors/bad.py imports rankscope.cli.commands.trace (stream_processors -> cli)",
        "stream_processors/offline_bad.py imports rankscope.offline.kineto (stream_processors -> offline)",
        "cli/commands/bad.py imports rankscope.dashboard (cli -> dashboard)"]


def test_every_import_uses_the_installed_names():
    """``storage`` or ``producers`` alone resolve only in a checkout; installed, they are
    ``rankscope.storage`` and ``rankscope.producers``, so code, tests and benchmarks import those."""
    bad = []
    for path in sorted(REPO.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith((".", "build/")) or "/." in rel:
            continue
        bad += [f"{rel} imports {name}" for name in imports(path) if name.split(".")[0] in RUNTIMES]
    assert bad == []
