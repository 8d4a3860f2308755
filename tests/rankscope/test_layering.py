"""The import layering, enforced: the protocol and shared rules (the ground layer, rankscope/) import
none of the runtimes; producers, processors, sink and dashboard import the ground layer and not
each other; the offline analysis (offline/) imports the processors' pure analyzers, the ranks'
summarizer and the store, and nothing live imports it; the CLI imports the runtimes it drives but
not the dashboard; nothing imports the CLI or the dashboard except their own entry points
(``rankscope/__main__.py`` and ``storage/serve.py``).

Every import counts, also the ones inside functions (they are how optional parts load lazily).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIMES = ("producers", "stream_processors", "offline", "storage", "dashboard")
CLI = ("rankscope.cli", "rankscope.commands", "rankscope.__main__")

# package -> the packages it may import besides itself and the ground layer
MAY_IMPORT = {
    "producers": set(),
    "stream_processors": set(),
    "offline": {"stream_processors", "producers", "storage"},   # shared analyzers, the ranks' summarizer
    "storage": set(),
    "dashboard": {"storage"},          # the pages read the store
    "rankscope": set(),                # the ground layer
    "cli": {"producers", "stream_processors", "offline", "storage"},   # rankscope.cli and rankscope.commands
    "demo": set(),                     # the example job: the tracer through the ground layer's facade
}
# Named exceptions, each with its reason.
ALLOWED = {
    ("rankscope/__init__.py", "producers"): "the public facade: `from rankscope import Tracer` loads it lazily",
    ("storage/serve.py", "dashboard"): "serve is the dashboard's entry point (it starts the Streamlit app)",
    ("rankscope/analysis.py", "offline"): "the notebook facade: loads the offline analyzers lazily, "
        "as rankscope/__init__.py loads the tracer",
}


def layer(module: str) -> str:
    """The layer of a module by its installed name (``rankscope.storage.sink`` is in ``storage``)."""
    parts = module.split(".")
    if parts[0] != "rankscope":
        return parts[0]
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
    for pkg in (*RUNTIMES, "rankscope"):
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
            dst = layer(name)
            if dst not in (*RUNTIMES, "rankscope", "cli", "demo") or dst == src or dst == "rankscope":
                continue
            if (rel, dst) in ALLOWED:
                continue
            if dst not in MAY_IMPORT[src]:
                bad.append(f"{rel} imports {name} ({src} -> {dst})")
    return bad


def test_the_layers_import_only_downwards():
    assert len(source_files()) > 100          # the scan sees the code it checks
    assert violations() == []


def test_the_check_sees_a_violation(tmp_path, monkeypatch):
    """The scan itself: an import of the CLI from a runtime is found, also inside a function, and so
    are an import of the offline analysis from the processors and of the dashboard from the CLI."""
    fake = tmp_path / "stream_processors"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from rankscope.commands.trace import run\n")
    (fake / "ok.py").write_text("from rankscope.wire import decode\nfrom rankscope.stream_processors import app\n")
    (fake / "also_bad.py").write_text("from rankscope.producers.tracer import Tracer\n")
    (fake / "offline_bad.py").write_text("def f():\n    from rankscope.offline.kineto import load_trace\n")
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "ok.py").write_text("from rankscope.stream_processors.analysis.report import build_report\n"
                                   "from rankscope.producers.trace_events import summarize\n")
    commands = tmp_path / "rankscope" / "commands"
    commands.mkdir(parents=True)
    (commands / "bad.py").write_text("def run():\n    from rankscope.dashboard import queries\n")
    (commands / "ok.py").write_text("from rankscope.storage.windows import trace_events\nfrom rankscope.commands import bad\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["REPO"]), "REPO", tmp_path)
    assert violations() == [
        "stream_processors/also_bad.py imports rankscope.producers.tracer (stream_processors -> producers)",
        "stream_processors/bad.py imports rankscope.commands.trace (stream_processors -> cli)",
        "stream_processors/offline_bad.py imports rankscope.offline.kineto (stream_processors -> offline)",
        "rankscope/commands/bad.py imports rankscope.dashboard (cli -> dashboard)"]


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
