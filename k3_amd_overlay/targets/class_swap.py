"""The per-instance class swap the overlay's hooks share: a K3-only subclass of one vLLM object's
own class, made once per class, whose ``forward`` is the hook's; only the instance's ``__class__``
changes, never the shared vLLM class that every other model uses."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def subclass_once(made: dict[type, type], base: type, forward_for: Callable[[type], Callable[..., Any]],
                  doc: str) -> type:
    """``made[base]``, made on first use: ``K3Overlay<base>`` with ``forward_for(base)`` as its
    ``forward``, ``doc`` as its docstring, and the hook's module (its forward's) as its own."""
    if base not in made:
        forward = forward_for(base)
        made[base] = type(f"K3Overlay{base.__name__}", (base,),
                          {"forward": forward, "__doc__": doc, "__module__": forward.__module__})
    return made[base]
