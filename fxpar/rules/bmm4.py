"""Sharding rule for ``fxpar::bmm4`` (``a [B, H, M, K] @ b [B, H, K, N]``): bmm's strategies with two batch dims."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxpar.ops  # noqa: F401  (defines the op)
from fxpar.rules.registry import Candidate, register


@register(torch.ops.fxpar.bmm4.default)
def bmm4(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """Both batch dims sharded alike; rows of ``a`` or columns of ``b`` sharded alone; the contracted dim sharded
    on both (a partial sum); or all replicated."""
    a, b = args[:2]
    r = Replicate()
    out = [Candidate((r, r), r)]
    for d in (0, 1):
        if a.shape[d] >= n:
            out.append(Candidate((Shard(d), Shard(d)), Shard(d)))
    if a.shape[2] >= n:
        out.append(Candidate((Shard(2), r), Shard(2)))
    if b.shape[3] >= n:
        out.append(Candidate((r, Shard(3)), Shard(3)))
    if a.shape[3] >= n and a.shape[3] % n == 0:
        out.append(Candidate((Shard(3), Shard(2)), Partial()))
    return out
