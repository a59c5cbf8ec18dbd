"""Layers that each hold their own unregistered ``{name: helper module}`` dict, as transformers 5.25's attention
layers hold ``_kernel_funcs``: for the sharing of blocks whose reads torch.export rebuilds after its trace.

Module-level so that spawned gloo ranks can unpickle them; they import nothing from fxpar (they stand for user code).
"""

from __future__ import annotations

import torch
from torch import nn


class _Activation(nn.Module):
    """A stateless helper module (no parameters, buffers or children), as transformers' hub-kernel wrappers are."""

    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.k


class _HelperDictBlock(nn.Module):
    """Holds its own ``{name: helper module}`` dict without registering it (transformers 5.25's ``_kernel_funcs``):
    torch.export rebuilds such a dict when it puts the module's attributes back after the trace."""

    def __init__(self, width: int, k: float) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.__dict__["_helpers"] = {"act": _Activation(k)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._helpers["act"](self.lin(x))


class PerLayerHelperDicts(nn.Module):
    """Four ``_HelperDictBlock``s, each with its own helper: the first three scale by 1.0, the last by 2.0."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(_HelperDictBlock(width, 2.0 if i == 3 else 1.0) for i in range(4))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def per_layer_helper_dicts() -> PerLayerHelperDicts:
    torch.manual_seed(0)
    return PerLayerHelperDicts()
