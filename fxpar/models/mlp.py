"""A plain two-layer MLP test model (no fxpar imports)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}
NORMS = {"layer": nn.LayerNorm, "rms": nn.RMSNorm}


class MLP(nn.Module):
    """``down(act(norm(up(x))))``; ``norm`` (over the hidden features) is optional."""

    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16, bias: bool = True, activation: str = "gelu",
                 norm: str | None = None) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.norm = NORMS[norm](hidden) if norm else None
        self.activation = activation
        self.down = nn.Linear(hidden, out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.norm is not None:
            h = self.norm(h)
        return self.down(ACTIVATIONS[self.activation](h))


def mlp(**kwargs: int | bool | str | None) -> MLP:
    return MLP(**kwargs)


def mlp_plan() -> dict[str, str]:
    return {"up": "colwise", "down": "rowwise"}
