"""Sharding rule for ``aten._scaled_mm`` (fxpar's fp8 matmuls) with scales that follow the data.

DTensor's rule places a row-wise scale like its data operand, so with the contracting dim sharded (a rowwise
Linear's input) it has no strategy and the float8 operands would be gathered (which gloo cannot even do).
fxpar's fp8 pass computes every scale over the whole contracting dim (a max all-reduce when it is sharded),
so the scales are replicated there and the product of the local shards is an exact partial sum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import Candidate, register

aten = torch.ops.aten


@register(aten._scaled_mm.default)
def scaled_mm(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``a [m, k] @ b [k, n]`` with scale_a (``[]`` or ``[m, 1]``) and scale_b (``[]`` or ``[1, n]``): the mm
    strategies, each scale sharded with its operand's non-contracting dim or replicated."""
    a, b, scale_a, scale_b = args[:4]
    if (len(args) > 4 and args[4] is not None) or (len(args) > 5 and args[5] is not None):
        return []  # a bias or a result scale: not emitted by fxpar's fp8 pass

    def row(p: Any, scale: torch.Tensor, dim: int) -> Any:
        return p if scale.numel() > 1 and isinstance(p, Shard) and p.dim == dim else Replicate()

    r = Replicate()
    out = [Candidate((r, r, r, r), r)]
    if a.shape[0] >= n:
        out.append(Candidate((Shard(0), r, row(Shard(0), scale_a, 0), r), Shard(0)))
    if b.shape[1] >= n:
        out.append(Candidate((r, Shard(1), r, row(Shard(1), scale_b, 1)), Shard(1)))
    if a.shape[1] >= n and a.shape[1] % n == 0:
        out.append(Candidate((Shard(1), Shard(0), r, r), Partial()))
    return out
