"""A plain two-layer MLP test model (no fxpar imports)."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def mlp(**kwargs: int) -> MLP:
    return MLP(**kwargs)


def mlp_plan() -> dict[str, str]:
    return {"up": "colwise", "down": "rowwise"}
