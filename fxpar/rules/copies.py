"""Sharding rules for copies DTensor has no strategy for (without them they ran replicated, with a warning).

``lift_fresh_copy`` is the copy the export makes of a tensor the model's forward creates (``torch.tensor(...)`` in
Falcon's attention, for one): any placement carries through unchanged. ``copy`` is a functionalized in-place write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import Candidate, register


@register(torch.ops.aten.lift_fresh_copy.default)
def lift_fresh_copy(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """Replicated, a partial sum, or sharded on any dim with at least ``n`` entries: the output as the input."""
    x = args[0]
    out = [Candidate((Replicate(),), Replicate()), Candidate((Partial(),), Partial())]
    return out + [Candidate((Shard(d),), Shard(d)) for d in range(x.ndim) if x.shape[d] >= n]


@register(torch.ops.aten.copy.default)
def copy(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``copy(self, src)``: ``src``'s values in ``self``'s shape and dtype (a functionalized in-place write, as
    ``buffer.mul_(0.9)`` in an EMA). Replicated, or sharded on a dim of ``self`` with at least ``n`` entries, where
    ``src`` is sharded on the same dim or broadcast along it (whole)."""
    dst, src = args[0], args[1]
    out = [Candidate((Replicate(), Replicate()), Replicate())]
    lead = dst.ndim - src.ndim
    for d in range(dst.ndim):
        if dst.shape[d] < n:
            continue
        if d >= lead and src.shape[d - lead] == dst.shape[d]:
            out.append(Candidate((Shard(d), Shard(d - lead)), Shard(d)))
        elif d < lead or src.shape[d - lead] == 1:
            out.append(Candidate((Shard(d), Replicate()), Shard(d)))
    return out
