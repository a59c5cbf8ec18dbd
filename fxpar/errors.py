"""User-facing errors. Internal invariants use ``assert``; the user's mistakes raise these."""

from __future__ import annotations

import difflib
import sys
import warnings


class PlanError(ValueError):
    """The plan does not fit the model or the mesh (unknown module, bad style, ...)."""


class CaptureError(RuntimeError):
    """The model could not be traced; the message points at the user's source line."""


class InductorError(RuntimeError):
    """``Plan(compile=True)``: Inductor could not compile a rank's graph; the message names the graph and node."""


class FxparWarning(UserWarning):
    """fxpar compiled the model but something deserves the user's attention."""


class CheckpointError(ValueError):
    """A checkpoint does not hold what the module being loaded expects (a parameter name it lacks)."""


class SavedProgramError(ValueError):
    """A saved program folder cannot run as asked (another fxpar version, another world size, missing data)."""


def close_matches(word: str, candidates: list[str], n: int = 5) -> list[str]:
    """Candidates that look like ``word``, best first (for 'did you mean' hints); case counts only to order them."""
    exact_case = difflib.get_close_matches(word, candidates, n=n, cutoff=0.4)
    by_lower = {c.lower(): c for c in candidates}
    folded = [by_lower[c] for c in difflib.get_close_matches(word.lower(), list(by_lower), n=n, cutoff=0.4)]
    return list(dict.fromkeys(exact_case + folded))[:n]


def warn_at_callers_line(message: str) -> None:
    """A ``FxparWarning`` shown at the line of the user's code that called into fxpar (``parallelize``, a test
    harness's call): the first frame outside fxpar and torch, however deep the pass that warns."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARY:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, FxparWarning, stacklevel=level + 1)


_LIBRARY = frozenset(("fxpar", "torch", "contextlib", "functools"))
