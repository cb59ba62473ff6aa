"""The hooks that tie a process's evidence to the process's life: a flush when it ends (forked
children included) and a fresh start in a child forked from it."""

from __future__ import annotations

import multiprocessing.util
import os
import weakref
from collections.abc import Callable
from typing import TypeVar

Owner = TypeVar("Owner")


def register_exit_flush(flush: Callable[[], None]) -> None:
    """``flush`` when this process ends. multiprocessing's finalizers run at the interpreter's exit and
    also where multiprocessing ends a child it started with ``os._exit`` (vLLM's fork start method),
    where no ``atexit`` function runs; a finalizer inherited by a forked child is not run there (the
    child registers its own)."""
    multiprocessing.util.Finalize(None, flush, exitpriority=0)


def after_fork_in_child(owner: Owner, hook: Callable[[Owner], None]) -> None:
    """``hook(owner)`` in every child forked from this process while ``owner`` lives. A forked child
    (vLLM's fork start method: an offline LLM's engine core and workers) loads no plugin again: what
    the parent built becomes the child's own there. Held weakly: the hook keeps nothing alive."""
    this = weakref.ref(owner)

    def in_child() -> None:
        if (alive := this()) is not None:
            hook(alive)

    os.register_at_fork(after_in_child=in_child)
