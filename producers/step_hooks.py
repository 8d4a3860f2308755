"""Step boundaries for a script that never calls ``tracer.step()`` (the attach path).

Two sources, one per process:

- :class:`OptimizerSteps` (the default): torch.optim's global step post-hook. A training step may
  step several optimizers (a GAN's two, one per parameter group of a sharded model, ZeRO's inner and
  outer), so one optimizer leads: the first to step in the process. Each of its steps ends one
  tracer step; the others are not counted. When the lead is garbage-collected the next optimizer
  to step leads.
- :class:`StepMarker`: ``module:qualname`` (``step_marker``) names a function or method whose calls
  end a step. It is wrapped when its module is imported, or at once when it already is. The module
  must be importable by that name (the script run as ``__main__`` is not).

Both call ``on_step`` on the training thread, right after the optimizer step or the marked call;
neither raises into training code.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger("rankscope.steps")


class OptimizerSteps:
    """Calls ``on_step`` once per step of the lead optimizer (the first to step)."""

    def __init__(self, on_step: Callable[[], None]) -> None:
        self._on_step = on_step
        self._lead: weakref.ref[Any] | None = None
        self._handle: Any = None

    def install(self) -> bool:
        """Register the global post-hook. False when torch.optim has no such hook."""
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
        except Exception as e:
            log.warning("rankscope: optimizer steps not counted: %s", e)
            return False
        self._handle = register_optimizer_step_post_hook(self._hook)
        return True

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            lead = self._lead() if self._lead is not None else None
            if lead is None:
                self._lead = weakref.ref(optimizer)
                lead = optimizer
            if optimizer is lead:
                self._on_step()
        except Exception:
            pass


class StepMarker:
    """Wraps ``module:qualname`` so each call ends a step (``on_step`` runs after the call returns
    or raises)."""

    def __init__(self, spec: str, on_step: Callable[[], None]) -> None:
        module, _, qualname = spec.partition(":")
        if not module or not qualname:
            raise ValueError(f"step marker must be 'module:function', got {spec!r}")
        self.module, self.qualname = module, qualname
        self._on_step = on_step
        self._finder: _AfterImport | None = None
        self.wrapped = False

    def install(self) -> None:
        """Wrap now when the module is imported, else once it is. Never raises."""
        if self.module == "__main__":
            log.warning("rankscope: step marker %s:%s is in the script itself; move it to a module the "
                        "script imports (steps are not counted)", self.module, self.qualname)
            return
        mod = sys.modules.get(self.module)
        if mod is not None:
            self._wrap(mod)
            return
        self._finder = _AfterImport(self.module, self._wrap)
        sys.meta_path.insert(0, self._finder)

    def remove(self) -> None:
        """Stop waiting for the import (a wrapped function stays wrapped and keeps counting)."""
        if self._finder is not None and self._finder in sys.meta_path:
            sys.meta_path.remove(self._finder)
        self._finder = None

    def _wrap(self, mod: ModuleType) -> None:
        try:
            *path, name = self.qualname.split(".")
            owner: Any = mod
            for part in path:
                owner = getattr(owner, part)
            raw = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name)
            if raw is None:
                raw = getattr(owner, name)
            kind: Any = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
            fn = raw.__func__ if kind is not None else raw
            if not callable(fn):
                raise TypeError(f"{self.module}:{self.qualname} is not callable")
            on_step = self._on_step

            @functools.wraps(fn)
            def _rankscope_step_marker(*args: Any, **kwargs: Any) -> Any:
                try:
                    return fn(*args, **kwargs)
                finally:
                    try:
                        on_step()
                    except Exception:
                        pass

            setattr(owner, name, kind(_rankscope_step_marker) if kind is not None else _rankscope_step_marker)
            self.wrapped = True
        except Exception as e:
            log.warning("rankscope: step marker %s:%s not installed: %s: %s", self.module, self.qualname,
                        type(e).__name__, e)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders and calls ``after(module)`` once it has executed."""

    def __init__(self, name: str, after: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.after = after
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy.on = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one module, one import
        spec.loader = _ThenLoader(spec.loader, self.after)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, after: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:  # get_data, get_filename, is_package, ...
        return getattr(self._inner, name)
