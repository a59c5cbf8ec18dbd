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


@register(torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default)
def new_empty(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``self.new_empty(size)``: a buffer whose values nothing reads before the model writes them (DeepSeek-V3's MLA
    fills one by two slice copies); ``self`` gives only its dtype and device. The buffer is placed as ``self`` is on
    each dim they share (same extent, at least ``n`` entries), else replicated: DTensor's replicate-only factory made
    a batch- or sequence-sharded model gather the batch into it."""
    x, size = args[0], list(args[1])
    out = [Candidate((Replicate(),), Replicate())]
    return out + [Candidate((Shard(d),), Shard(d)) for d in range(min(x.ndim, len(size)))
                  if x.shape[d] == size[d] >= n]
