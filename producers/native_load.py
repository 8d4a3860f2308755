"""Loading a compiled extension module from a file in the cache dir (the C stack walker, the C++
trace reader): one place for importlib's steps."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def load_module(name: str, path: Path, abi: int) -> Any | None:
    """The module ``name`` built into ``path``, or None when its ``ABI`` is not ``abi``. Raises what
    loading it raises (a missing library, an undefined symbol)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        return None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod if getattr(mod, "ABI", None) == abi else None
