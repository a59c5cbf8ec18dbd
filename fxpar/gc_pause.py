"""Compile without the cyclic garbage collector's full collections.

Compiling builds millions of small, long-lived objects (fake tensors, fx nodes, their metadata). CPython's
collector walks every tracked object on each generation-2 collection, and while a compile allocates, those
come round every few seconds of work: on HF Llama at Llama-3-70B widths with 80 layers (fake dp=8 x tp=8),
``parallelize`` + ``program(rank=37)`` took 8.9-9.1 CPU s with the collector on and 6.6-7.8 s with it paused
(2 runs each, one process per run, 2-core machine), for 26 MB more peak RSS (523 against 497 MB). So the
compiler's entry points pause automatic collection while they run and restore it after: the garbage they
leave in cycles is collected by the next automatic collection after they return (one full collection instead
of about six; ``bench/compile_time.py`` times it inside fxpar's figure: about 1 s of the 9 s at 80 layers).
Nothing is lost or kept alive by the pause. Reentrant: a nested pause leaves the outer one's state alone.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def without_gc_pauses(fn: F) -> F:
    """``fn`` with automatic cyclic collection paused while it runs (restored on return or raise)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return paused  # type: ignore[return-value]
