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


class NoRuleMLP(nn.Module):
    """``down(hardswish(h) * bucket(h))`` with ``h = up(x)`` sharded over tp: two elementwise ops DTensor
    cannot shard, so fxpar runs them replicated (gathering their inputs) and must stay exact.

    * ``aten.searchsorted.Tensor`` (forward): no strategy, no rule and no decomposition in DTensor.
    * ``aten.hardswish_backward.default`` (backward only: ``hardswish`` itself has a strategy): DTensor has a
      decomposition, but propagating through it fails (it builds ``scalar_tensor`` factories).
    """

    def __init__(self, dim: int = 32, hidden: int = 64, out: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, out)
        self.register_buffer("boundaries", torch.tensor([-0.5, 0.0, 0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        bucket = torch.searchsorted(self.boundaries, h.detach().contiguous()).to(h.dtype)  # 0..3 per element
        return self.down(F.hardswish(h) * (1 + bucket))


def no_rule_mlp(**kwargs: int) -> NoRuleMLP:
    return NoRuleMLP(**kwargs)


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
