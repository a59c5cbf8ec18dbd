"""Stacks whose layers take an argument they never read and return a view, as OPT's decoder layers do (they take
``position_ids`` and end in ``.view``): for blocks shared across pipeline stages.

Module-level so that spawned gloo ranks can unpickle them; they import nothing from fxpar (they stand for user code).
"""

from __future__ import annotations

import torch
from torch import nn


class _IgnoringLayer(nn.Module):
    """Takes ``positions`` and ignores it; returns a view of its sum (what a stage boundary sends)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.view(b * t, d)
        return (flat + torch.relu(self.fc(flat))).view(b, t, d)


class PositionsIgnored(nn.Module):
    """Four ``_IgnoringLayer``s, each passed positions the stack computes from the input's shape alone (a pipeline
    stage computes them itself: nothing crosses a boundary for them)."""

    def __init__(self, width: int = 8, n_layers: int = 4) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)  # so that every layer's input needs a gradient (one capture for all)
        self.layers = nn.ModuleList(_IgnoringLayer(width) for _ in range(n_layers))
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.ones(x.shape[:2], device=x.device).cumsum(1).long() - 1
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x, positions)
        return self.head(x)


class InputMaskIgnored(PositionsIgnored):
    """As ``PositionsIgnored``, but what the layers ignore is computed from the input's values: a whole-model
    pipeline stage would not receive it, a stage of shared blocks would."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x.sum(-1) > 0).long()
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


class _MaskedLayer(_IgnoringLayer):
    """Scales its update by a mask it is given."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.fc(x)) * mask


class InputMaskRead(PositionsIgnored):
    """Layers that read a float mask computed from the input's values alone: a later pipeline stage receives it, and
    since no parameter flows into it, sends no gradient back for it."""

    def __init__(self, width: int = 8, n_layers: int = 4) -> None:
        super().__init__(width, n_layers)
        self.layers = nn.ModuleList(_MaskedLayer(width) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (x.sum(-1, keepdim=True) > 0).float()
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def stage_loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A loss the last stage computes from the output and the input it was given as the target."""
    return (out - x[..., :3]).pow(2).mean()
