"""rankscope's start-up hook (``rankscope run`` puts this folder first on PYTHONPATH).

Python imports ``sitecustomize`` at start-up. This one first runs the ``sitecustomize`` it hides
(the next one on ``sys.path``, if any), then, only when ``RANKSCOPE_ATTACH`` is set, lets
:func:`rankscope.producers.attach.attach_if_rank` decide whether this process is a rank to instrument.
Nothing here may fail the process.
"""

import os
import sys


def _run_hidden_sitecustomize() -> None:
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def _boot() -> None:
    if os.environ.get("RANKSCOPE_ATTACH", "").lower() not in ("1", "true", "yes", "on"):
        return
    from rankscope.producers.attach import attach_if_rank

    attach_if_rank()


for _step in (_run_hidden_sitecustomize, _boot):
    try:
        _step()
    except Exception as _e:  # noqa: BLE001
        print(f"rankscope: start-up hook {_step.__name__} failed: {type(_e).__name__}: {_e}", file=sys.stderr)
