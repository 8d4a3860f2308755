"""The dashboard's sign-in cookie: signing, checking, and the key it is signed with.

A cookie's value is ``<expiry_unix>.<hex HMAC-SHA256 of the expiry>``. It holds no session id: any
cookie whose expiry is still ahead and whose MAC is right signs its browser in, until it expires or the
signing key changes. The key is derived from the dashboard password and ``dashboard_secret`` (or,
when that is empty, a random key kept in ``<data dir>/dashboard_session.key``, mode 0600), so a
restart keeps sessions and a new password or secret ends them all.

Pure functions and file access only; ``login.py`` reads and writes the cookie through Streamlit.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
from pathlib import Path

log = logging.getLogger(__name__)

COOKIE_PREFIX = "rankscope_session"
KEY_FILE = "dashboard_session.key"
KEY_BYTES = 32
_VALUE = re.compile(r"([0-9]{1,12})\.([0-9a-f]{64})")
_KEY_LOCK = threading.Lock()
_KEYS: dict[tuple[str, str, str], bytes] = {}


def cookie_name(port: int) -> str:
    """The cookie's name for the dashboard on ``port``: browsers share cookies across the ports of a
    host, so two dashboards on one host keep one cookie each."""
    return f"{COOKIE_PREFIX}_{port}"


def sign(key: bytes, expiry: int) -> str:
    """The cookie value for ``expiry`` (unix seconds)."""
    return f"{expiry}.{_mac(key, expiry)}"


def verify(key: bytes, value: str | None, now: float) -> int | None:
    """The expiry of ``value`` when it is well formed, signed with ``key`` and not expired at ``now``;
    else None. The MAC is compared in constant time."""
    if not value:
        return None
    m = _VALUE.fullmatch(value)
    if m is None:
        return None
    expiry = int(m.group(1))
    if not hmac.compare_digest(m.group(2), _mac(key, expiry)):
        return None
    return expiry if expiry > now else None


def _mac(key: bytes, expiry: int) -> str:
    return hmac.new(key, str(expiry).encode(), hashlib.sha256).hexdigest()


def signing_key(password: str, secret: bytes) -> bytes:
    """The key cookies are signed with: HMAC-SHA256 keyed by ``secret`` over the password's SHA-256."""
    return hmac.new(secret, b"rankscope dashboard session\0" + hashlib.sha256(password.encode()).digest(),
                    hashlib.sha256).digest()


def load_or_create_key(path: Path) -> bytes:
    """The random key in ``path`` (hex), created with mode 0600 when missing.

    The file is written in full under a temporary name and then linked into place, so a concurrent
    reader sees either no file or the whole key, and of two processes creating it both use the one
    linked first. Raises OSError when the file cannot be read or created, ValueError when it holds
    no key.
    """
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    text = path.read_text().strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) < 16:
        raise ValueError(f"{path} holds no session key (delete it to make a new one)")
    return key


def dashboard_key(password: str, secret_setting: str, data_dir: str) -> bytes:
    """The signing key of this dashboard, from ``dashboard_secret`` when set, else from the data
    directory's key file; computed once per process for each combination.

    When the key file cannot be read or created, a random key of this process is used instead (one
    warning): sessions then last until the process restarts.
    """
    cache_key = (password, secret_setting, data_dir)
    with _KEY_LOCK:
        if cache_key not in _KEYS:
            if secret_setting:
                secret = secret_setting.encode()
            else:
                path = Path(data_dir) / KEY_FILE
                try:
                    secret = load_or_create_key(path)
                except (OSError, ValueError) as e:
                    log.warning("dashboard sessions end when this process does: no session key at %s (%s)",
                                path, e)
                    secret = secrets.token_bytes(KEY_BYTES)
            _KEYS[cache_key] = signing_key(password, secret)
        return _KEYS[cache_key]


def set_cookie_js(name: str, value: str, max_age_s: int) -> str:
    """A script that stores the cookie in the browser (``Secure`` when the page came over https)."""
    attrs = f"; Path=/; Max-Age={max(0, int(max_age_s))}; SameSite=Strict"
    return _cookie_script(json.dumps(f"{name}={value}{attrs}"))


def clear_cookie_js(name: str) -> str:
    """A script that deletes the cookie from the browser, then reloads the page: the new session starts
    signed out, and nothing of the pages (their navigation included) stays on screen."""
    return _cookie_script(json.dumps(f"{name}=; Path=/; Max-Age=0; SameSite=Strict"), "window.location.reload();")


def _cookie_script(literal: str, then: str = "") -> str:
    return (f"<script>document.cookie = {literal} + "
            f"(window.location.protocol === 'https:' ? '; Secure' : '');{then}</script>")
