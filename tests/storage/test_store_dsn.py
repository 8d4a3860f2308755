"""ClickHouse server DSN: user, password and TLS from the DSN or from settings; the password stays out of text.

No ClickHouse server runs here: ``clickhouse_connect.get_client`` is replaced by a recorder (or by
one that fails as a refused login does), so these tests check what the store would connect with.
"""

from __future__ import annotations

import logging
from typing import Any

import clickhouse_connect
import pytest

from rankscope.config import ConfigError, Settings, redact_dsn, server_dsn
from rankscope.storage import store as store_mod
from rankscope.storage.store import Store, StoreError, open_store, server_params

SECRET = "Pa55:w@rd/%x"   # characters that need quoting in a URL


def test_plain_http_dsn_uses_the_default_user_and_port() -> None:
    assert server_params("http://127.0.0.1") == {"host": "127.0.0.1", "port": 8123, "username": None,
                                                 "password": "", "secure": False}


def test_user_and_password_in_the_dsn() -> None:
    p = server_params("http://alice:s3cret@127.0.0.1:9123")
    assert (p["username"], p["password"], p["port"], p["secure"]) == ("alice", "s3cret", 9123, False)


def test_https_is_secure_verified_on_8443_with_a_ca_file() -> None:
    p = server_params("https://bob:pw@127.0.0.1?ca_cert=/etc/rankscope/ca.pem")
    assert p == {"host": "127.0.0.1", "port": 8443, "username": "bob", "password": "pw", "secure": True,
                 "verify": True, "ca_cert": "/etc/rankscope/ca.pem"}
    assert server_params("https://127.0.0.1:9440?verify=false")["verify"] is False


def test_settings_override_the_dsn_and_survive_quoting() -> None:
    s = Settings(clickhouse_dsn="https://old:oldpw@127.0.0.1:8443", clickhouse_user="ops",
                 clickhouse_password=SECRET, clickhouse_ca_file="/ca dir/ca.pem")
    p = server_params(s.store_dsn)
    assert (p["username"], p["password"], p["ca_cert"], p["verify"]) == ("ops", SECRET, "/ca dir/ca.pem", True)
    keep_user = Settings(clickhouse_dsn="http://dsnuser@127.0.0.1:8123", clickhouse_password=SECRET)
    assert (server_params(keep_user.store_dsn)["username"], server_params(keep_user.store_dsn)["password"]) == \
        ("dsnuser", SECRET)
    no_verify = Settings(clickhouse_dsn="https://127.0.0.1", clickhouse_verify=False)
    assert server_params(no_verify.store_dsn)["verify"] is False
    assert Settings(clickhouse_dsn="http://127.0.0.1:8123").store_dsn == "http://127.0.0.1:8123"
    assert server_dsn("http://127.0.0.1:8123") == "http://127.0.0.1:8123"


def test_settings_from_env() -> None:
    s = Settings.from_env({"RANKSCOPE_CLICKHOUSE_DSN": "https://127.0.0.1:8443",
                           "RANKSCOPE_CLICKHOUSE_USER": "ops", "RANKSCOPE_CLICKHOUSE_PASSWORD": SECRET,
                           "RANKSCOPE_CLICKHOUSE_CA_FILE": "/ca.pem", "RANKSCOPE_CLICKHOUSE_VERIFY": "true"})
    assert server_params(s.store_dsn)["password"] == SECRET


def test_embedded_dsn_is_left_alone() -> None:
    s = Settings(clickhouse_dsn="chdb:///tmp/x", clickhouse_user="ops", clickhouse_password=SECRET)
    assert s.store_dsn == "chdb:///tmp/x" and s.embedded_store


@pytest.mark.parametrize("dsn, needle", [
    ("ftp://127.0.0.1", "unsupported DSN scheme"),
    ("http://:pw@:8123", "no host"),
    ("http://127.0.0.1:notaport", "bad host or port"),
    ("http://127.0.0.1?ca_cert=/ca.pem", "need an https DSN"),
    ("https://127.0.0.1?compress=zstd", "unknown option"),
])
def test_bad_dsns_are_refused_without_showing_the_password(dsn: str, needle: str) -> None:
    secret_dsn = dsn.replace("://", f"://u:{SECRET.replace('/', '%2F').replace('@', '%40')}@", 1) \
        if "@" not in dsn else dsn
    with pytest.raises(StoreError, match=needle) as e:
        server_params(secret_dsn)
    assert "Pa55" not in str(e.value)


def test_the_password_is_in_no_repr_and_no_message(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    s = Settings(clickhouse_dsn="https://ops@127.0.0.1:8443", clickhouse_password=SECRET)
    assert SECRET not in repr(s) and "Pa55" not in s.store_dsn_redacted
    assert "ops:***@127.0.0.1:8443" in s.store_dsn_redacted
    assert "Pa55" not in redact_dsn(s.store_dsn)
    assert "Pa55" not in repr(Store(object(), s.store_dsn))

    def refused(**kw: Any) -> Any:   # what a server answers a wrong password with, echoing it back
        raise RuntimeError(f"Code: 516. ops: Authentication failed: password is incorrect ({kw['password']})")

    monkeypatch.setattr(clickhouse_connect, "get_client", refused)
    with caplog.at_level(logging.DEBUG), pytest.raises(StoreError) as e:
        open_store(s.store_dsn)
    msg = str(e.value)
    assert "cannot reach ClickHouse at https://127.0.0.1:8443 as user ops" in msg and "Authentication failed" in msg
    assert SECRET not in msg and SECRET not in caplog.text and e.value.__cause__ is None
    with pytest.raises(ConfigError) as ce:
        Settings(clickhouse_dsn=f"clickhouse://u:{SECRET}@127.0.0.1")
    assert SECRET not in str(ce.value)


def test_open_store_connects_with_the_parsed_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []

    class Client:
        def command(self, *a: Any, **kw: Any) -> None:
            return None

        def close(self) -> None:
            pass

    def record(**kw: Any) -> Client:
        seen.append(kw)
        return Client()

    monkeypatch.setattr(clickhouse_connect, "get_client", record)
    s = Settings(clickhouse_dsn="https://127.0.0.1:9440", clickhouse_user="ops", clickhouse_password=SECRET,
                 clickhouse_ca_file="/ca.pem")
    store = open_store(s.store_dsn, apply=False)
    try:
        assert seen == [{"host": "127.0.0.1", "port": 9440, "username": "ops", "password": SECRET, "secure": True,
                         "verify": True, "ca_cert": "/ca.pem"}]
        assert open_store(s.store_dsn, apply=False) is store and len(seen) == 1
    finally:
        store_mod.close_store(s.store_dsn)
