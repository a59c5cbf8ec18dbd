"""Models and rank functions for ``tests/test_errors.py``: bad inputs fxpar must refuse or survive.

Everything here is module-level so that spawned gloo ranks (``run_ranks``) can unpickle it, and the
models import nothing from fxpar except inside the rank functions: they stand for user code.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

MLP_PLAN = {"up": "colwise", "down": "rowwise"}


class DataDependentBranch(nn.Module):
    """Python ``if`` on a tensor value: cannot be traced into one graph."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.sum() > 0:  # BRANCH: the data-dependent line the CaptureError must name
            return h.relu()
        return -h


def data_dependent_branch(**kwargs: int) -> DataDependentBranch:
    return DataDependentBranch(**kwargs)


class HardswishMLP(nn.Module):
    """``down(hardswish(up(x)))``: DTensor has a strategy for ``hardswish`` but none for the
    ``hardswish_backward`` op of the joint graph, so fxpar falls back to running it replicated."""

    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.hardswish(self.up(x)))


def hardswish_mlp(**kwargs: int) -> HardswishMLP:
    return HardswishMLP(**kwargs)


def mesh_size_mismatch(axes: dict[str, int]) -> str:
    """Rank body: parallelize on a mesh whose size differs from the world size; return the error text."""
    import fxpar
    from fxpar.models.mlp import mlp

    try:
        fxpar.parallelize(mlp(), fxpar.Mesh(axes), (torch.randn(8, 32),), plan=MLP_PLAN)
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def die_before_first_forward(dying_rank: int) -> str:
    """Rank body: compile the MLP on tp=2; ``dying_rank`` exits hard just before the first forward while
    the others run a training step, whose collectives then have no peer."""
    import fxpar
    from fxpar.models.mlp import mlp

    torch.manual_seed(0)
    pm = fxpar.parallelize(mlp(), fxpar.Mesh({"tp": dist.get_world_size()}), (torch.randn(8, 32),), plan=MLP_PLAN)
    if dist.get_rank() == dying_rank:
        os._exit(1)
    loss = pm(torch.randn(8, 32)).pow(2).mean()
    loss.backward()
    return "step completed"
