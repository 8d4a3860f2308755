"""The dashboard's sign-in cookie as pure functions: signing, checking, the key and its file."""

from __future__ import annotations

import json
import stat
import threading
from pathlib import Path

import pytest

from rankscope.config import ConfigError, Settings
from rankscope.dashboard import session_cookie as sc

KEY = b"k" * 32
NOW = 1_800_000_000


def test_a_signed_cookie_verifies_until_it_expires() -> None:
    value = sc.sign(KEY, NOW + 60)
    expiry, mac = value.split(".")
    assert expiry == str(NOW + 60) and len(mac) == 64 and int(mac, 16) >= 0
    assert sc.verify(KEY, value, NOW) == NOW + 60
    assert sc.verify(KEY, value, NOW + 59.9) == NOW + 60
    assert sc.verify(KEY, value, NOW + 60) is None  # expired
    assert sc.verify(KEY, value, NOW + 3600) is None


def test_tampered_cookies_are_refused() -> None:
    value = sc.sign(KEY, NOW + 60)
    expiry, mac = value.split(".")
    assert sc.verify(KEY, f"{NOW + 10**6}.{mac}", NOW) is None  # a later expiry with the old MAC
    flipped = mac[:-1] + ("0" if mac[-1] != "0" else "1")
    assert sc.verify(KEY, f"{expiry}.{flipped}", NOW) is None
    assert sc.verify(KEY, f"{expiry}.{mac.upper()}", NOW) is None
    assert sc.verify(b"other key", value, NOW) is None  # signed with another secret


@pytest.mark.parametrize("value", [None, "", ".", "abc", str(NOW + 60), f"{NOW + 60}.", f".{'0' * 64}",
                                   f"{NOW + 60}.{'0' * 63}", f"{NOW + 60}.{'0' * 65}", f"{NOW + 60}.{'g' * 64}",
                                   f"-{NOW + 60}.{'0' * 64}", f"{NOW + 60}.{'0' * 64}.x", f" {NOW + 60}.{'0' * 64}",
                                   f"{'9' * 40}.{'0' * 64}", f"١٢٣.{'0' * 64}"])
def test_malformed_cookies_are_refused(value: str | None) -> None:
    assert sc.verify(KEY, value, NOW) is None


def test_the_key_depends_on_password_and_secret() -> None:
    k = sc.signing_key("pw", b"secret")
    assert len(k) == 32 and k == sc.signing_key("pw", b"secret")
    assert k != sc.signing_key("pw2", b"secret")  # a new password ends every session
    assert k != sc.signing_key("pw", b"secret2")
    assert sc.verify(sc.signing_key("pw2", b"secret"), sc.sign(k, NOW + 60), NOW) is None


def test_key_file_is_created_once_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "data" / sc.KEY_FILE
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(sc.load_or_create_key(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and len(keys[0]) == sc.KEY_BYTES
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sc.load_or_create_key(path) == keys[0]  # a restart reads the same key
    assert [p.name for p in path.parent.iterdir()] == [sc.KEY_FILE]  # no temporary file left
    path.write_text("not hex\n")
    with pytest.raises(ValueError, match="no session key"):
        sc.load_or_create_key(path)


def test_dashboard_key_uses_the_secret_setting_or_the_key_file(tmp_path: Path) -> None:
    from_file = sc.dashboard_key("pw", "", str(tmp_path))
    assert (tmp_path / sc.KEY_FILE).is_file()
    assert from_file == sc.signing_key("pw", sc.load_or_create_key(tmp_path / sc.KEY_FILE))
    assert sc.dashboard_key("pw", "s3cret", str(tmp_path / "elsewhere")) == sc.signing_key("pw", b"s3cret")
    assert not (tmp_path / "elsewhere").exists()


def test_dashboard_key_without_a_writable_data_dir_is_per_process(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the data directory should be
    k = sc.dashboard_key("pw", "", str(blocked / "data"))
    assert len(k) == 32 and k == sc.dashboard_key("pw", "", str(blocked / "data"))
    assert "sessions end when this process does" in caplog.text


def test_cookie_scripts() -> None:
    name = sc.cookie_name(8501)
    assert name == "rankscope_session_8501"
    js = sc.set_cookie_js(name, "123.abc", 3600)
    assert js.startswith("<script>") and js.endswith("</script>")
    literal = js.removeprefix("<script>document.cookie = ").split(" + ", 1)[0]
    assert json.loads(literal) == "rankscope_session_8501=123.abc; Path=/; Max-Age=3600; SameSite=Strict"
    assert "'; Secure'" in js and "https:" in js
    clear = sc.clear_cookie_js(name)
    assert "rankscope_session_8501=; Path=/; Max-Age=0" in clear and "location.reload()" in clear


def test_session_settings() -> None:
    s = Settings.from_env({"RANKSCOPE_DASHBOARD_SESSION_H": "0.5", "RANKSCOPE_DASHBOARD_SECRET": "topsecret"})
    assert s.dashboard_session_h == 0.5 and s.dashboard_secret == "topsecret"
    assert "topsecret" not in repr(s)
    assert Settings().dashboard_session_h == 12.0 and Settings().dashboard_secret == ""
    with pytest.raises(ConfigError, match="dashboard_session_h"):
        Settings(dashboard_session_h=0)
    with pytest.raises(ConfigError, match="dashboard_session_h"):
        Settings(dashboard_session_h=10**9)  # its cookie's expiry would not fit the cookie's format
