"""The guard of user-written SQL: one read-only statement that reads nothing but the store's tables.

Used wherever a person's SQL runs: the dashboard's SQL console, ``rankscope sql``, and the serve
process's loopback query endpoint (``storage/query_endpoint.py``). Pure: no I/O.

A statement passes :func:`check_readonly_sql` when it is one statement that starts with one of
:data:`READONLY_STATEMENTS`, has no ``INTO OUTFILE``, and calls none of :data:`REFUSED_FUNCTIONS`
(functions and table functions that read files, the network, other databases, programs or the
process's memory). The statement then runs with :func:`readonly_settings` (``readonly=1``), so
ClickHouse itself refuses writes and DDL too. The name scan is needed on top of ``readonly=1``:
chDB runs ``SELECT file('/etc/passwd')`` and ``SELECT ... INTO OUTFILE`` even read-only.
"""

from __future__ import annotations

import re
from typing import Any

DEFAULT_MAX_ROWS = 10_000
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
#: First keywords accepted: statements that only read.
READONLY_STATEMENTS = ("SELECT", "WITH", "SHOW", "DESCRIBE", "DESC", "EXPLAIN")
#: Functions and table functions refused wherever they are called (lower case; ClickHouse's names
#: are case-insensitive for most of them, so the comparison is too).
REFUSED_FUNCTIONS = frozenset(name.lower() for name in (
    # files
    "file", "fileCluster", "input", "executable", "executablePool",
    # object stores and lakes
    "s3", "s3Cluster", "gcs", "cosn", "oss", "azureBlobStorage", "azureBlobStorageCluster", "hdfs",
    "hdfsCluster", "deltaLake", "deltaLakeCluster", "deltaLakeS3", "deltaLakeAzure", "deltaLakeLocal",
    "hudi", "hudiCluster", "iceberg", "icebergS3", "icebergAzure", "icebergHDFS", "icebergLocal",
    "icebergCluster", "icebergS3Cluster", "icebergAzureCluster", "icebergHDFSCluster", "paimon",
    "paimonS3", "paimonAzure", "paimonHDFS", "paimonLocal", "hive",
    # the network and other databases
    "url", "urlCluster", "remote", "remoteSecure", "cluster", "clusterAllReplicas", "mysql",
    "postgresql", "mongodb", "redis", "sqlite", "odbc", "jdbc", "arrowFlight", "arrowflight", "ytsaurus",
    "prometheusQuery", "prometheusQueryRange", "timeSeriesData", "timeSeriesMetrics", "timeSeriesTags",
    # chDB: Python objects of the process that runs the query
    "python", "pythonTable",
))
_LEADING_COMMENTS = re.compile(r"\A(?:\s+|--[^\n]*(?:\n|\Z)|#[^\n]*(?:\n|\Z)|/\*.*?\*/)*", re.S)
_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.I)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*")


class SqlRefused(ValueError):
    """The guard refused a statement before it was sent (the message says why)."""


def check_readonly_sql(sql: str) -> str:
    """Return the one read-only statement in ``sql`` (leading comments and one trailing ';' removed).

    Raises :class:`SqlRefused` unless it is a single statement starting with one of
    :data:`READONLY_STATEMENTS`, with no ';' inside, no ``INTO OUTFILE`` and no call of a
    :data:`REFUSED_FUNCTIONS` name (bare, backquoted or double-quoted). Strict on purpose: a ';'
    inside a string literal is refused too.
    """
    text = _LEADING_COMMENTS.sub("", sql or "", count=1).rstrip()
    if text.endswith(";"):
        text = text[:-1].rstrip()
    if not text:
        raise SqlRefused("empty statement")
    if ";" in text:
        raise SqlRefused("one statement at a time: remove the ';' inside the query")
    first = re.match(r"[A-Za-z]+", text)
    word = first.group(0).upper() if first else text[:12]
    if word not in READONLY_STATEMENTS:
        raise SqlRefused(f"{word} is not allowed: the SQL is read-only "
                         f"(statements must start with {', '.join(READONLY_STATEMENTS)})")
    if _OUTFILE.search(_code_only(text)):
        raise SqlRefused("INTO OUTFILE is not allowed: queries do not write files")
    called = sorted({name for name in called_functions(text) if name.lower() in REFUSED_FUNCTIONS})
    if called:
        raise SqlRefused(f"{', '.join(n + '()' for n in called)} not allowed: queries read the store's tables only, "
                         "not files, URLs, other servers or databases")
    return text


def readonly_settings(max_rows: int = DEFAULT_MAX_ROWS, timeout_s: float = DEFAULT_TIMEOUT_S,
                      max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """ClickHouse settings of a guarded query, ``readonly`` last (once set, no setting can change).

    Raises ValueError for a limit that is not > 0.
    """
    for name, value in (("max_rows", max_rows), ("timeout_s", timeout_s), ("max_bytes", max_bytes)):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    return {"max_result_rows": int(max_rows), "result_overflow_mode": "break",
            "max_result_bytes": int(max_bytes), "max_execution_time": float(timeout_s), "readonly": 1}


def called_functions(text: str) -> list[str]:
    """Names directly followed by ``(`` outside string literals and comments, in order.

    Backquoted and double-quoted identifiers count as names (``\\`file\\`(...)`` calls ``file``).
    """
    out: list[str] = []
    last_name: str | None = None
    for kind, value in _tokens(text):
        if kind == "(" and last_name is not None:
            out.append(last_name)
        if kind != "space":
            last_name = value if kind == "name" else None
    return out


def _code_only(text: str) -> str:
    """``text`` with string literals and comments blanked out."""
    return "".join(v if k not in ("space",) else " " for k, v in _tokens(text) if k != "string")


def _tokens(text: str) -> list[tuple[str, str]]:
    """A coarse lexer: ('string', literal), ('name', identifier), ('space', ...), ('(', '('), ('other', c)."""
    out: list[tuple[str, str]] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c == "'":
            j = _end_of_quoted(text, i, "'")
            out.append(("string", text[i:j]))
            i = j
        elif c in "`\"":
            j = _end_of_quoted(text, i, c)
            out.append(("name", text[i + 1:j - 1]))
            i = j
        elif text.startswith(("--", "# ", "#!"), i):   # ClickHouse's comments ('#x' is a syntax error)
            j = text.find("\n", i)
            i = n if j < 0 else j
            out.append(("space", " "))
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            out.append(("space", " "))
        elif c.isspace():
            out.append(("space", c))
            i += 1
        elif c == "(":
            out.append(("(", c))
            i += 1
        else:
            m = _IDENT.match(text, i)
            if m:
                out.append(("name", m.group(0)))
                i = m.end()
            else:
                out.append(("other", c))
                i += 1
    return out


def _end_of_quoted(text: str, start: int, quote: str) -> int:
    """Index just past the literal or quoted identifier opened at ``start`` (backslash and doubled-quote escapes)."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            if i + 1 < len(text) and text[i + 1] == quote:
                i += 2
                continue
            return i + 1
        i += 1
    return len(text)
