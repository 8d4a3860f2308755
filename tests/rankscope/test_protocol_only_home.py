"""rankscope/protocol is the only place that declares wire-message fields and bounds: an AST scan of
the production packages outside it finds none of

- (a) a ``WireError(...)`` or ``InvalidMessage(...)`` built with a literal reason other than the
  routing and wrapping ones in :data:`ALLOWED_REASONS` (a body check raises ``bad_body``, and those
  live in protocol; passing on a protocol error's own ``e.reason`` is fine);
- (b) a schema-like table: a module-level name bound to a dict literal whose values are types or
  tuples of types, or to a tuple of types (``_ROW_TYPES = (int, str, int)``);
- (c) a module-level ``MAX_*`` integer constant compared against ``len(...)`` in a function that
  raises WireError or InvalidMessage (a message bound checked outside protocol).

:data:`STORE_COLUMN_MODULES` are the exception to (a): storage/columns.py keeps a value out of a
store column whose type cannot hold it (Int64, Int32, UInt32), a property of the store, not of a
message.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("rankscope", "producers", "stream_processors", "storage", "offline", "dashboard")
PROTOCOL = REPO / "rankscope" / "protocol"
ERRORS = {"WireError", "InvalidMessage"}
# Reasons a module outside protocol may give: a message on a topic that does not carry its kind,
# and the sink's codes for an alert, a dead letter or a report that protocol (or the report's own
# schema check) refused, whose detail it passes on.
ALLOWED_REASONS = {"unexpected_kind", "bad_alert", "bad_deadletter", "bad_report"}
STORE_COLUMN_MODULES = {"storage/columns.py"}
TYPE_NAMES = {"int", "float", "str", "bytes", "bool", "list", "dict", "tuple", "type(None)", "NoneType"}


def _is_type(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in TYPE_NAMES
    if isinstance(node, ast.Call):   # type(None)
        return ast.unparse(node) in TYPE_NAMES
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_is_type(e) for e in node.elts)
    return False


def _is_type_tuple(node: ast.expr) -> bool:
    return isinstance(node, ast.Tuple) and len(node.elts) >= 2 and all(_is_type(e) for e in node.elts)


def _name(func: ast.expr) -> str:
    """``WireError`` of ``WireError(...)`` and of ``errors.WireError(...)``."""
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _raises_wire_error(fn: ast.AST) -> bool:
    for node in ast.walk(fn):
        if isinstance(node, ast.Raise) and node.exc is not None:
            call = node.exc
            if _name(call.func if isinstance(call, ast.Call) else call) in ERRORS:
                return True
    return False


def violations(source: str, rel: str) -> list[str]:
    """The places in one module's source that declare or check a message field outside protocol."""
    tree = ast.parse(source, rel)
    out = []
    if rel not in STORE_COLUMN_MODULES:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _name(node.func) in ERRORS \
                    and node.args and isinstance(node.args[0], ast.Constant) \
                    and node.args[0].value not in ALLOWED_REASONS:
                out.append(f"{rel}:{node.lineno}: {_name(node.func)}({node.args[0].value!r}, ...) checks a message")
    for node in tree.body:   # tables are declared at module level
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if isinstance(value, ast.Dict) and value.values and all(_is_type(v) for v in value.values):
            out.append(f"{rel}:{node.lineno}: a table of field types")
        elif isinstance(value, ast.Tuple) and _is_type_tuple(value):
            out.append(f"{rel}:{node.lineno}: a tuple of field types")
    bounds = {t.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
              for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(t, ast.Name) and t.id.startswith("MAX_") and isinstance(node.value, ast.Constant | ast.BinOp)}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or not _raises_wire_error(fn):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                names = {s.id for s in sides if isinstance(s, ast.Name)} & bounds
                if names and any(isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "len"
                                 for s in sides):
                    out.append(f"{rel}:{node.lineno}: {', '.join(sorted(names))} bounds a message in {fn.name}")
    return out


def production_modules() -> list[tuple[str, Path]]:
    out = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            if PROTOCOL in path.parents:
                continue
            out.append((path.relative_to(REPO).as_posix(), path))
    return out


def test_only_protocol_declares_message_fields_and_bounds() -> None:
    found = [v for rel, path in production_modules() for v in violations(path.read_text(), rel)]
    assert not found, "message checks outside rankscope/protocol:\n" + "\n".join(found)


def test_the_scan_covers_the_production_packages() -> None:
    rels = {rel for rel, _ in production_modules()}
    assert {"storage/rows.py", "stream_processors/shard_summary.py", "producers/control.py"} <= rels
    assert not any(rel.startswith("rankscope/protocol/") for rel in rels)


PLANTED = {
    "a body check": '''
from rankscope.protocol.errors import WireError
def check(body):
    if "x" not in body:
        raise WireError("bad_body", "x missing")
''',
    "a store-side body check": '''
def rows(body):
    raise InvalidMessage("bad_body", "rows missing")
''',
    "a body check through the module": '''
from rankscope.protocol import errors
def check(body):
    raise errors.WireError("bad_body", "x missing")
''',
    "a schema table": '''
FIELDS = {"step": int, "since_s": (int, float), "stacks": (list, type(None))}
''',
    "a tuple of field types": '''
_ROW_TYPES = (int, str, int, (int, float))
''',
    "a bound of a message": '''
MAX_ROWS = 2048
def parse(raw):
    if len(raw) > MAX_ROWS:
        raise WireError("bad_rows", "too many")
    return raw
''',
}


@pytest.mark.parametrize("name", PLANTED)
def test_the_scan_finds_a_planted_violation(name: str) -> None:
    assert violations(PLANTED[name], "stream_processors/planted.py"), name


def test_the_scan_lets_routing_reasons_type_tests_and_unrelated_bounds_pass() -> None:
    source = '''
MAX_OPEN = 256
def route(env, kinds):
    if env.kind not in kinds:
        raise WireError("unexpected_kind", env.kind)
    if isinstance(env.rank, (int, float)) and type(env.seq) in (int, float):
        return MAX_OPEN
def keep(items):
    if len(items) > MAX_OPEN:
        items.pop()
'''
    assert violations(source, "stream_processors/planted.py") == []
