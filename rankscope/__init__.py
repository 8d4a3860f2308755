"""rankscope: online performance diagnosis for distributed PyTorch training.

User-facing import::

    from rankscope import Tracer
    tracer = Tracer()
    for batch in loader:
        ...
        tracer.step()
"""

from __future__ import annotations

from typing import Any

__all__ = ["Tracer"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "Tracer":
        from rankscope.producers.tracer import Tracer

        return Tracer
    raise AttributeError(name)
