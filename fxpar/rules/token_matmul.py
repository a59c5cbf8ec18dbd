"""Sharding rules for ``fxpar::matmul_nd`` and ``fxpar::token_contract`` (a Linear on un-flattened tokens).

``matmul_nd(x [*L, K], w [K, N]) -> [*L, N]``: einsum ``...k,kn->...n``. ``token_contract(a [*L, P], b [*L, Q])
-> [P, Q]``: einsum ``...p,...q->pq``, a sum over every token dim.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import fxpar.ops  # noqa: F401  (defines the ops)
from fxpar.rules.registry import Candidate, register

R = Replicate()


@register(torch.ops.fxpar.matmul_nd.default)
def matmul_nd(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """A token dim of ``x`` sharded alone (rows); ``N`` sharded on ``w`` alone (columns); ``K`` sharded on both
    (a partial sum); or all replicated."""
    x, w = args[:2]
    last = x.ndim - 1
    out = [Candidate((R, R), R)]
    out += [Candidate((Shard(d), R), Shard(d)) for d in range(last) if x.shape[d] >= n]
    if w.shape[1] >= n:
        out.append(Candidate((R, Shard(1)), Shard(last)))
    if x.shape[last] >= n:
        out.append(Candidate((Shard(last), Shard(0)), Partial()))
    return out


@register(torch.ops.fxpar.token_contract.default)
def token_contract(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """A token dim sharded on both (each rank sums its own tokens: a partial sum); ``P`` or ``Q`` sharded alone;
    or all replicated."""
    a, b = args[:2]
    last = a.ndim - 1
    out = [Candidate((R, R), R)]
    out += [Candidate((Shard(d), Shard(d)), Partial()) for d in range(last) if a.shape[d] >= n]
    if a.shape[last] >= n:
        out.append(Candidate((Shard(last), R), Shard(0)))
    if b.shape[last] >= n:
        out.append(Candidate((R, Shard(last)), Shard(1)))
    return out
