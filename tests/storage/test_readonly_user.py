"""The dashboard's and console's ClickHouse server user: what its statements grant and refuse.
No ClickHouse server installs here, so the statements are checked as text; what ClickHouse does with
them (no INSERT/ALTER grant: refused; no FILE/URL source grant: ``file()`` refused; ``readonly = 2``:
every write refused whatever the grants) is ClickHouse's access model."""

from __future__ import annotations

import hashlib
import re

import pytest

from rankscope.cli import main
from rankscope.storage.readonly_user import LIMITS, PROFILE, ReadonlyUserError, readonly_user_statements


def test_the_user_may_only_select_from_rankscopes_database() -> None:
    stmts = readonly_user_statements("rankscope", "reader", "s3cret")
    grants = [s for s in stmts if s.startswith(("GRANT", "REVOKE"))]
    assert grants == ["REVOKE ALL ON *.* FROM reader", "GRANT SELECT ON rankscope.* TO reader"]
    text = " ".join(grants).upper()
    for never in ("INSERT", "ALTER", "CREATE", "DROP", "FILE", "URL", "REMOTE", "S3", "SOURCES",
                  "GRANT OPTION", "ACCESS MANAGEMENT", "TRUNCATE", "SYSTEM"):
        assert not re.search(rf"\b{never}\b", text), never


def test_the_profile_is_read_only_with_capped_limits_and_the_password_is_only_hashed() -> None:
    stmts = readonly_user_statements("rankscope", "reader", "s3cret")
    profiles = [s for s in stmts if s.split()[1:3] == ["SETTINGS", "PROFILE"]]
    assert len(profiles) == 2
    for p in profiles:
        assert re.search(r"\breadonly = 2\b", p)
        for name, (value, cap) in LIMITS.items():
            assert f"{name} = {value} MAX {cap}" in p
    users = [s for s in stmts if s.split()[1] == "USER"]
    digest = hashlib.sha256(b"s3cret").hexdigest()
    assert len(users) == 2 and all(f"sha256_hash BY '{digest}'" in u and f"PROFILE '{PROFILE}'" in u for u in users)
    assert "s3cret" not in " ".join(stmts)


@pytest.mark.parametrize("user,database,password", [
    ("bad-name", "rankscope", "p"), ("x; DROP TABLE t", "rankscope", "p"), ("reader", "rank scope", "p"),
    ("reader", "rankscope", ""), ("1reader", "rankscope", "p")])
def test_names_that_are_not_identifiers_and_an_empty_password_are_refused(user: str, database: str,
                                                                          password: str) -> None:
    with pytest.raises(ReadonlyUserError):
        readonly_user_statements(database, user, password)


def test_the_command_prints_the_statements_and_refuses_chdb_and_a_missing_password(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    monkeypatch.delenv("RANKSCOPE_READONLY_PASSWORD", raising=False)
    assert main(["readonly-user", "--user", "reader"]) == 2
    assert "RANKSCOPE_READONLY_PASSWORD" in capsys.readouterr().err
    monkeypatch.setenv("RANKSCOPE_READONLY_PASSWORD", "s3cret")
    assert main(["readonly-user", "--user", "reader"]) == 0
    out = capsys.readouterr().out
    assert "GRANT SELECT ON rankscope.* TO reader;" in out and "s3cret" not in out
    assert main(["readonly-user", "--user", "reader", "--apply", "--clickhouse-dsn", f"chdb://{tmp_path}/ch"]) == 2
    assert "chDB" in capsys.readouterr().err
