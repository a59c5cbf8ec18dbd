"""fxpar's own ops: what the graph rewrites emit when no aten op keeps a sharding plain.

``fxpar::bmm4(a [B, H, M, K], b [B, H, K, N]) -> [B, H, M, N]``: a batched matmul over two batch dims. Eager
attention computes ``q @ k^T`` as ``bmm`` over ``B * H`` flattened rows; with heads sharded (tensor parallel) that
flatten is not a plain shard, so the whole attention would be gathered. ``fxpar.simplify.bmm_over_heads`` writes
those matmuls as ``bmm4`` on the 4-D tensors instead, which shards on either batch dim.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fxpar::bmm4", mutates_args=())
def bmm4(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


@bmm4.register_fake
def _bmm4_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))
