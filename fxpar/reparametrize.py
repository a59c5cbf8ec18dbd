"""Swap tensors into a module for the duration of a trace, and put back exactly what was there.

``torch.nn.utils.stateless._reparametrize_module(..., tie_weights=True)`` (what ``torch.func.functional_call``
runs) does not restore a module that sits under several paths: ALBERT-style weight sharing,
``nn.ModuleList([block] * n)``. It swaps ``layers.0.w`` and records the original, then swaps ``layers.1.w`` (the
same attribute of the same module) and records the tensor it just swapped in as that one's original; on exit the
last restore wins and the user's model keeps the stand-in (torch 2.13). ``swapped_in`` snapshots every module's
own parameters and buffers first and puts those objects back afterwards, whatever the order of the restores.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.nn.utils.stateless import _reparametrize_module


@contextmanager
def swapped_in(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, ``model``'s parameters and buffers named in ``state`` (``named_parameters`` names; tied
    names follow) are ``state``'s tensors. Ensures: afterwards every module of ``model`` holds the very parameter
    and buffer objects it held before (also on an exception)."""
    saved = [(module, dict(module._parameters), dict(module._buffers)) for module in _unique_modules(model)]
    try:
        with _reparametrize_module(model, state, tie_weights=True):
            yield
    finally:
        for module, params, buffers in saved:
            module._parameters.update(params)
            module._buffers.update(buffers)


def _unique_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list({id(m): m for m in model.modules(remove_duplicate=False)}.values())
