"""Whether a capture traces repeated blocks once, and the fallback to tracing every layer when it cannot."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from fxpar.blocks import SHARING_ENV, sharing_enabled

log = logging.getLogger("fxpar.capture")
T = TypeVar("T")


@dataclass(frozen=True)
class Sharing:
    """Whether to trace repeated blocks once (``on``), and if not, why."""

    on: bool
    reason: str = ""


def with_shared_blocks(build: Callable[[Sharing], T]) -> T:
    """``build(Sharing(True))`` (repeated blocks traced once); where that cannot be proven to give the whole-model
    graph (``NotShared``) or fails, ``build(Sharing(False, why))``: every layer traced, the user's errors raised."""
    if not sharing_enabled():
        return build(Sharing(False, f"{SHARING_ENV}=0"))
    try:
        return build(Sharing(True))
    except Exception as e:  # noqa: BLE001 - the whole-model capture decides what the user sees
        log.debug("repeated blocks not shared (%s: %s); tracing the whole model", type(e).__name__, e)
        reason = f"{type(e).__name__}: {e}"
    # outside the except clause: an error of the whole-model capture must not chain to the shared attempt's
    # (error reports walk the chain for the user's line)
    return build(Sharing(False, reason))
