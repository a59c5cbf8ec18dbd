"""Sharding rules for advanced indexing on trailing dims: ``_unsafe_index`` and its backward ``_unsafe_index_put``.

``F.interpolate`` (nearest, bilinear, bicubic) and ``nn.Upsample`` decompose into them, indexing the spatial dims
with index tensors while the batch and channel dims pass through. DTensor has no strategy, so without these rules
every upsampling ran replicated, its dp-sharded input all-gathered. A dim before the first indexed one keeps its
place in the result (the index tensors replicated), so it may stay sharded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from fxpar.rules.registry import Candidate, register

aten = torch.ops.aten


def _leading(x: torch.Tensor, indices: list[Any], n: int) -> list[int]:
    """Dims of ``x`` before its first indexed dim, with at least ``n`` entries; none when the indexed dims are not
    adjacent (advanced indexing then moves the indexed result to the front)."""
    indexed = [i for i, index in enumerate(indices) if index is not None]
    if not indexed or indexed != list(range(indexed[0], indexed[-1] + 1)):
        return []
    return [d for d in range(min(indexed[0], x.ndim)) if x.shape[d] >= n]


@register(aten._unsafe_index.Tensor)
def unsafe_index(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``x[..., idx_h, idx_w]``: replicated, or ``x`` sharded on a leading dim (the output likewise)."""
    x, indices = args[0], args[1]
    rest = tuple(Replicate() for index in indices if index is not None)
    out = [Candidate((Replicate(), *rest), Replicate())]
    return out + [Candidate((Shard(d), *rest), Shard(d)) for d in _leading(x, indices, n)]


@register(aten._unsafe_index_put.default)
def unsafe_index_put(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``self[..., idx_h, idx_w] (+)= values``: replicated, or ``self`` and ``values`` sharded on one leading dim."""
    x, indices = args[0], args[1]
    rest = tuple(Replicate() for index in indices if index is not None)
    out = [Candidate((Replicate(), *rest, Replicate()), Replicate())]
    return out + [Candidate((Shard(d), *rest, Shard(d)), Shard(d)) for d in _leading(x, indices, n)]
