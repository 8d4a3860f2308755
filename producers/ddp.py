"""Find DistributedDataParallel models by themselves and mark their busy time.

Under DDP the gradients are all-reduced inside ``backward()`` (by DDP's C++ reducer), so the time a
rank waits for its peers never passes through a Python collective and step time is the same on
every rank. :func:`rankscope.producers.collectives.register_ddp_hook` marks when this rank's backward pass
produced its last gradient; a :class:`DdpWatcher` puts that mark on every DDP model of the process
without a call from the user:

- models made after the watcher starts: ``DistributedDataParallel.__init__`` is wrapped (once per
  process, at class level, so subclasses and every import path are covered);
- models made before: one scan of the garbage collector's objects at start, done only when DDP's
  module was already imported (no DDP model can exist otherwise).

Each model gets at most one mark per watcher (``watch`` is idempotent), so an explicit
``Tracer.watch_ddp(model)`` on a model the watcher already found does nothing.

FSDP (``fully_shard`` and ``FullyShardedDataParallel``) all-gathers and reduce-scatters from Python
through ``torch.distributed`` (``all_gather_single``, ``reduce_scatter_single``, ``Work.wait``), so
the collective timing of :mod:`rankscope.producers.collectives` already measures its wait; its gradients are
written by FSDP's own post-backward hooks on sharded parameters, where no autograd hook marks the
end of this rank's compute, so FSDP models get no gradient mark.
"""

from __future__ import annotations

import functools
import gc
import logging
import sys
import threading
import weakref
from typing import Any

from rankscope.producers.collectives import CommTimer, register_ddp_hook

log = logging.getLogger("rankscope.ddp")

_DDP_MODULE = "torch.nn.parallel.distributed"
# DDP's reducer waits for the gradient all-reduce in C++, below the autograd engine's Python frames;
# this frame stands for that wait, so a stack read elsewhere shows the rank waiting in a collective.
REDUCER_WAIT_FRAME = "torch/nn/parallel/distributed.py:0 all_reduce (DDP reducer: gradients ready, waiting for peers)"
_PATCH_MARK = "_rankscope_ddp_init"
_WATCHERS: list[DdpWatcher] = []
_LOCK = threading.Lock()


class DdpWatcher:
    """Puts the last-gradient mark of ``timer`` on every DDP model of the process, once each.

    ``start()`` and ``watch()`` never raise; ``close()`` removes every mark this watcher made.
    """

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer
        self._handles: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def watched(self) -> int:
        """How many live models carry this watcher's mark."""
        return len(self._handles)

    def watch(self, model: Any) -> bool:
        """Mark ``model`` (a DDP model, or any module whose backward ends its compute). False when
        it already carries this watcher's mark, has no trainable parameter, or the watcher is closed."""
        with self._lock:
            if self._closed or model in self._handles:
                return False
            try:
                handle = register_ddp_hook(model, self.timer)
            except Exception as e:
                log.warning("rankscope: DDP hook not installed: %s", e)
                return False
            if handle is None:
                return False
            self._handles[model] = handle
            return True

    def start(self) -> DdpWatcher:
        """Mark the DDP models that exist now and every one made from now on."""
        try:
            existed = _DDP_MODULE in sys.modules
            ddp_cls = _ddp_class()
            if ddp_cls is None:
                return self
            _patch_init(ddp_cls)
            with _LOCK:
                _WATCHERS.append(self)
            if existed:
                for obj in gc.get_objects():
                    if issubclass(type(obj), ddp_cls):   # type(), not isinstance: no __class__ lookups
                        self.watch(obj)
        except Exception as e:  # never fail the training script
            log.warning("rankscope: DDP models not watched: %s: %s", type(e).__name__, e)
        return self

    def close(self) -> None:
        """Stop watching and remove every mark this watcher made. Idempotent."""
        with _LOCK:
            if self in _WATCHERS:
                _WATCHERS.remove(self)
        with self._lock:
            self._closed = True
            handles = list(self._handles.values())
            self._handles.clear()
        for handle in handles:
            try:
                handle.remove()
            except Exception:
                pass


def _ddp_class() -> Any:
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return None
        from torch.nn.parallel import DistributedDataParallel
    except Exception:
        return None
    return DistributedDataParallel


def _patch_init(ddp_cls: Any) -> None:
    with _LOCK:
        orig = ddp_cls.__init__
        if getattr(orig, _PATCH_MARK, False):
            return

        @functools.wraps(orig)
        def _rankscope_ddp_init(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            _on_new_model(self)

        setattr(_rankscope_ddp_init, _PATCH_MARK, True)
        ddp_cls.__init__ = _rankscope_ddp_init


def _on_new_model(model: Any) -> None:
    with _LOCK:
        watchers = list(_WATCHERS)
    for w in watchers:
        try:
            w.watch(model)
        except Exception:
            pass


def mark_reducer_wait(stacks: list[dict[str, Any]], max_frames: int) -> None:
    """Append :data:`REDUCER_WAIT_FRAME` to each stack stopped inside autograd's backward (call it
    only when this rank's DDP backward has produced its last gradient in the current step)."""
    for s in stacks:
        frames = s.get("frames") or []
        if frames and "torch/autograd/" in frames[-1]:
            s["frames"] = [*frames[-(max_frames - 1):], REDUCER_WAIT_FRAME]
