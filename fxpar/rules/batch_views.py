"""A sharding rule DTensor does not have: views of a dim the batch axis splits unevenly.

DTensor refuses to flatten or split a dim its mesh axis does not divide (``_view_ops``: "Cannot flatten
unevenly sharded tensor"), since its ``torch.chunk`` pieces of ``b * s`` are not the flattened pieces of
``b``. fxpar splits every dp-sharded dim as the batch is split, scaled (``fxpar.split``), so a view that
keeps each rank's rows together is exact: ``[6, 16, 64] -> [96, 64]`` at dp=4 holds 32, 32, 16, 16 rows,
which is how ``fxpar.split`` splits 96. Without this rule every Linear would all-gather the batch.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar.rules.registry import Candidate
from fxpar.split import Splitter

aten = torch.ops.aten
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def batch_view_candidate(node: fx.Node, cur: Shard, split: Splitter, ax: int) -> Candidate | None:
    """``Shard(d) -> Shard(j)`` for a view of a value sharded unevenly on dim ``d`` over the batch axis ``ax``,
    when every rank's rows form whole rows of output dim ``j`` in the split ``fxpar.split`` gives that dim;
    ``None`` otherwise (the caller falls back to DTensor's rules)."""
    if node.target not in VIEWS:
        return None
    src, out = node.args[0].meta.get("val"), node.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return None
    d = cur.dim
    if split.is_even(src.shape, (*[None] * ax, cur)) or math.prod(src.shape[:d]) != 1:
        return None  # even (DTensor's rule applies), or rows of one rank are not one contiguous range
    inner = math.prod(src.shape[d + 1:])
    j = next((i for i, size in enumerate(out.shape) if size != 1), None)
    if j is None:
        return None
    inner_out = math.prod(out.shape[j + 1:])
    rows = [size * inner for size in split.sizes(src.shape[d], ax)]  # elements per rank, in rank order
    if any(r % inner_out for r in rows) or [r // inner_out for r in rows] != split.sizes(out.shape[j], ax):
        return None
    return Candidate((cur,), Shard(j))
