"""Repeated layers a model holds in nested lists, or holds without calling: for finding the blocks to share.

Module-level so that spawned gloo ranks can unpickle them; they import nothing from fxpar (they stand for user code).
"""

from __future__ import annotations

import torch
from torch import nn


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate(torch.tanh(self.fc(x)))


class GroupedLayers(nn.Module):
    """Four groups of two layers, in a ``ModuleList`` of ``ModuleList``s (``for g in self.groups: for layer in g``):
    the groups are never called, their eight layers are."""

    def __init__(self, width: int = 8, groups: int = 4, per_group: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.groups = nn.ModuleList(nn.ModuleList(_Layer(width) for _ in range(per_group)) for _ in range(groups))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for group in self.groups:
            for layer in group:
                x = layer(x)
        return self.head(x)


class WeightsOnlyLayers(nn.Module):
    """Four identical ``Linear`` layers whose weights the model multiplies by itself, never calling them."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(x @ layer.weight.t() + layer.bias)
        return self.head(x)
