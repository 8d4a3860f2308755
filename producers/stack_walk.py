"""The C stack walker (producers/native/stack_walk.c): built once per Python into the cache dir with
the C compiler Python was built with, and loaded by the stack sampler. It needs neither torch nor
ninja, so it builds where the C++ trace reader does not (a torch outside the tested range)."""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

log = logging.getLogger("rankscope.profile")

SOURCE = Path(__file__).resolve().parent / "native" / "stack_walk.c"
NAME = "rankscope_stack_walk"
ABI = 3


class WalkerBuildError(RuntimeError):
    pass


def _path(cache_dir: str | Path) -> Path:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(f"{sys.version}|{platform.machine()}|{ABI}".encode())
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return Path(cache_dir).expanduser() / "native" / f"stackwalk-{h.hexdigest()[:12]}" / f"{NAME}{suffix}"


def build(cache_dir: str | Path) -> Path:
    """Compile the walker (a no-op when built); returns the module file. Raises WalkerBuildError
    with the compiler's complaint."""
    so = _path(cache_dir)
    if so.exists():
        return so
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    if shutil.which(cc[0]) is None:
        cc = ["cc"]
    include = sysconfig.get_paths()["include"]
    so.parent.mkdir(parents=True, exist_ok=True)
    tmp = so.with_name(f"{so.name}.{os.getpid()}.tmp")      # ranks of one host may build at once
    cmd = [*cc, "-O2", "-fPIC", "-shared", f"-I{include}", str(SOURCE), "-o", str(tmp)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WalkerBuildError(f"{' '.join(cmd)}: {e}") from None
    if out.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise WalkerBuildError(f"{' '.join(cmd)} failed: {(out.stderr or out.stdout)[-2000:]}")
    tmp.replace(so)
    return so


def load(cache_dir: str | Path) -> Any | None:
    """The built walker for this Python, or None (not built, or it does not load)."""
    from rankscope.producers.native_load import load_module

    try:
        so = _path(cache_dir)
        return load_module(NAME, so, ABI) if so.exists() else None
    except Exception as e:
        log.warning("rankscope: stack walker %s does not load (%s)", cache_dir, e)
        return None
