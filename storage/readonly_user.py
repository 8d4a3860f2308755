"""The ClickHouse user the dashboard and the SQL console use against a server: ``SELECT`` on
rankscope's database and nothing else, under a settings profile that makes every query read-only.

ClickHouse enforces it: the user has no INSERT, ALTER, CREATE or DROP grant, and no source grant
(FILE, URL, REMOTE, S3, ...), which table functions such as ``file()`` need; the profile's
``readonly = 2`` refuses every write and DDL statement whatever the grants, while still letting a
query change its own limits (``max_result_rows``, ``max_execution_time``, which the console's guard
sends, and the output formats clickhouse-connect asks for), but never ``readonly`` itself. The limits
a query may raise are capped by the profile. The console's deny list
(:mod:`rankscope.sql_guard`) stays as a second layer, and is the only one on chDB, which has no users.
"""

from __future__ import annotations

import hashlib
import re

PROFILE = "rankscope_readonly"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# Per-query limits the profile sets and the most a query may raise them to.
LIMITS = {"max_execution_time": (60, 600), "max_memory_usage": (8 * 2**30, 32 * 2**30),
          "max_result_bytes": (0, 4 * 2**30)}


class ReadonlyUserError(ValueError):
    """A user or database name that is not a plain identifier, or an empty password."""


def readonly_user_statements(database: str, user: str, password: str) -> list[str]:
    """The statements that create (or update) the profile and the user, and grant it ``SELECT`` on
    ``database``. The password travels only as its SHA-256. Raises ReadonlyUserError."""
    for what, name in (("user", user), ("database", database)):
        if not _NAME.match(name):
            raise ReadonlyUserError(f"{what} name {name!r} must be a plain identifier (letters, digits, _)")
    if not password:
        raise ReadonlyUserError("the read-only user needs a password")
    digest = hashlib.sha256(password.encode()).hexdigest()
    limits = ", ".join(f"{k} = {v} MAX {cap}" for k, (v, cap) in LIMITS.items())
    profile = f"SETTINGS readonly = 2, {limits}"
    return [
        f"CREATE SETTINGS PROFILE IF NOT EXISTS {PROFILE} {profile}",
        f"ALTER SETTINGS PROFILE {PROFILE} {profile}",
        f"CREATE USER IF NOT EXISTS {user} IDENTIFIED WITH sha256_hash BY '{digest}' "
        f"DEFAULT DATABASE {database} SETTINGS PROFILE '{PROFILE}'",
        f"ALTER USER {user} IDENTIFIED WITH sha256_hash BY '{digest}' DEFAULT DATABASE {database} "
        f"SETTINGS PROFILE '{PROFILE}'",
        f"REVOKE ALL ON *.* FROM {user}",
        f"GRANT SELECT ON {database}.* TO {user}",
    ]
