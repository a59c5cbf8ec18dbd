"""What makes two blocks alike: the same class and the same parameter names and shapes (no fxpar imports, so that
capture-time modules such as ``fxpar.mixed_precision`` can use it beside ``fxpar.stages``)."""

from __future__ import annotations

import torch


def structure_of(m: torch.nn.Module) -> tuple:
    """A block's class and parameter names and shapes: equal for blocks a list repeats."""
    return type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())
