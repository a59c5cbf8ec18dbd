"""Check a sharding candidate by running the op on real shards of real tensors.

For an axis of ``n`` ranks, each simulated rank gets its shard of every input (a chunk for
``Shard``, the whole tensor for ``Replicate``, a random split that sums to the tensor for
``Partial``); the per-rank outputs are reassembled by the output placement (concatenate,
take any, or sum) and compared with the op on the full tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.rules.registry import Candidate


def _shards(t: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Shard):
        return list(t.chunk(n, p.dim))
    if isinstance(p, Partial):
        parts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for _ in range(n - 1)]
        return [*parts, t - sum(parts)]
    return [t] * n


def _assemble(outs: list[torch.Tensor], p: Placement) -> torch.Tensor:
    if isinstance(p, Shard):
        return torch.cat(outs, p.dim)
    if isinstance(p, Partial):
        return sum(outs[1:], outs[0])
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0])
    return outs[0]


def check_candidate(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], cand: Candidate, n: int,
                    rtol: float = 1e-5, atol: float = 1e-5) -> None:
    """Raise AssertionError if ``cand`` does not compute ``op(*args, **kwargs)`` on ``n`` shards."""
    gen = torch.Generator().manual_seed(0)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    assert len(tensor_pos) == len(cand.inputs), f"{op}: candidate has {len(cand.inputs)} inputs"
    per_arg = {i: _shards(leaves[i], p, n, gen) for i, p in zip(tensor_pos, cand.inputs, strict=True)}
    outs = []
    for r in range(n):
        local = list(leaves)
        for i in tensor_pos:
            local[i] = per_arg[i][r]
        a, k = pytree.tree_unflatten(local, spec)
        outs.append(op(*a, **k))
    full = op(*args, **kwargs)
    if isinstance(full, torch.Tensor):
        torch.testing.assert_close(_assemble(outs, cand.output), full, rtol=rtol, atol=atol)
        return
    for j, (f, p) in enumerate(zip(full, cand.output, strict=True)):
        if p is not None and isinstance(f, torch.Tensor):
            torch.testing.assert_close(_assemble([o[j] for o in outs], p or Replicate()), f, rtol=rtol, atol=atol,
                                       msg=lambda m, j=j: f"{op} output {j}: {m}")
