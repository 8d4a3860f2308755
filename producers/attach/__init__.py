"""Zero-code attach: instrument an unmodified training script.

``rankscope run -- torchrun ... train.py`` puts :func:`boot_dir` (a ``sitecustomize.py``) first on
``PYTHONPATH`` and sets ``RANKSCOPE_ATTACH=1``. Every Python process of the launched tree then calls
:func:`attach_if_rank` at start-up; it makes a :class:`~rankscope.producers.tracer.Tracer` only in a rank:

1. ``RANKSCOPE_ATTACH`` is true (the boot hook checks this before importing anything of rankscope);
2. the process has a rank: ``RANK`` (torchrun and most launchers) or ``RANKSCOPE_RANK`` >= 0, so the
   torchrun launcher itself is left alone;
3. no ancestor was attached: the attached rank exports ``RANKSCOPE_ATTACHED_PID`` (its pid), and a
   process that inherits another pid there (a DataLoader worker started by spawn or forkserver, a
   compile worker) is left alone. A forked child inherits the parent's tracer, which is inert there.

The time before the first optimizer step (imports, rendezvous, loading, the first iteration) is
start-up, never taken for a hang; step 0 ends there without a record
(:meth:`~rankscope.producers.tracer.Tracer.defer_first_step`). The tracer gets its steps from the optimizer (:class:`rankscope.producers.step_hooks.OptimizerSteps`) or,
with ``step_marker`` set, from calls of that function; it finds DDP models by itself
(``ddp_autodetect``), and its exit hooks record how the rank ended (an exception's type and
traceback frames included).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

log = logging.getLogger("rankscope.attach")

ATTACHED_PID = "RANKSCOPE_ATTACHED_PID"
_TRUE = ("1", "true", "yes", "on")

_attached: dict[str, Any] = {}   # the process's tracer and step source, kept alive for its lifetime


def boot_dir() -> str:
    """The folder to put first on ``PYTHONPATH``: it holds only the ``sitecustomize.py`` boot hook."""
    return str(Path(__file__).resolve().parent / "boot")


def attach_env(env: Mapping[str, str]) -> dict[str, str]:
    """The variables that attach every rank launched with ``env`` (``RANKSCOPE_ATTACH`` and
    ``PYTHONPATH`` with the boot folder first)."""
    paths = [boot_dir()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != boot_dir()]
    return {"RANKSCOPE_ATTACH": "1", "PYTHONPATH": os.pathsep.join(paths)}


def should_attach(env: Mapping[str, str], pid: int) -> bool:
    """Rules 1-3 of the module docstring."""
    if env.get("RANKSCOPE_ATTACH", "").lower() not in _TRUE:
        return False
    try:
        has_rank = "RANK" in env or int(env.get("RANKSCOPE_RANK", "-1") or -1) >= 0
    except ValueError:
        has_rank = False
    owner = env.get(ATTACHED_PID, "")
    return has_rank and owner in ("", str(pid))


def attach_if_rank(env: MutableMapping[str, str] | None = None, **tracer_kw: Any) -> Any:
    """Make this rank's tracer and its step source when :func:`should_attach`; return the tracer
    (None otherwise). Never raises; a second call returns the first call's tracer."""
    env = os.environ if env is None else env
    if "tracer" in _attached:
        return _attached["tracer"]
    if not should_attach(env, os.getpid()):
        return None
    try:
        from rankscope.config import Settings
        from rankscope.producers.step_hooks import OptimizerSteps, StepMarker
        from rankscope.producers.tracer import Tracer

        settings = Settings.from_env(env)
        tracer = Tracer(settings, **tracer_kw)
        tracer.defer_first_step()
        env[ATTACHED_PID] = str(os.getpid())
        source: Any
        if settings.step_marker:
            source = StepMarker(settings.step_marker, tracer.step)
            source.install()
        else:
            source = OptimizerSteps(tracer.step)
            source.install()
        _attached.update(tracer=tracer, steps=source)
        return tracer
    except Exception as e:  # never fail the training script
        log.warning("rankscope: attach failed: %s: %s", type(e).__name__, e)
        return None


def detach() -> None:
    """Close the attached tracer and remove its step source (tests, or a script that wants to stop)."""
    source = _attached.pop("steps", None)
    tracer = _attached.pop("tracer", None)
    if source is not None:
        source.remove()
    if tracer is not None:
        tracer.close()
