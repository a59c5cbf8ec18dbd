"""fxpar's own ops: what the graph rewrites emit when no aten op keeps a sharding plain.

``fxpar::bmm4(a [B, H, M, K], b [B, H, K, N]) -> [B, H, M, N]``: a batched matmul over two batch dims. Eager
attention computes ``q @ k^T`` as ``bmm`` over ``B * H`` flattened rows; with heads sharded (tensor parallel) that
flatten is not a plain shard, so the whole attention would be gathered. ``fxpar.simplify.bmm_over_heads`` writes
those matmuls as ``bmm4`` on the 4-D tensors instead, which shards on either batch dim.

``fxpar::matmul_nd`` and ``fxpar::token_contract``: a Linear's forward/input-gradient matmul and its weight gradient
on the un-flattened ``[batch, seq, ...]`` activations. Linear flattens ``[B, S, K]`` to ``[B * S, K]`` before ``mm``;
with the sequence sharded (context parallel) that flatten is DTensor's ``_StridedShard``, which fxpar does not
lower, so every Linear would gather. ``fxpar.simplify.tokens_unflattened`` writes those matmuls with these ops,
on which a sharded token dim (batch or sequence) stays a plain shard.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("fxpar::bmm4", mutates_args=())
def bmm4(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


@bmm4.register_fake
def _bmm4_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


@torch.library.custom_op("fxpar::matmul_nd", mutates_args=())
def matmul_nd(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x [*L, K] @ w [K, N] -> [*L, N]``: a Linear's matmul without flattening the token dims ``L``."""
    return torch.matmul(x, w)


@matmul_nd.register_fake
def _matmul_nd_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[-1]))


@torch.library.custom_op("fxpar::token_contract", mutates_args=())
def token_contract(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [*L, P], b [*L, Q] -> [P, Q]``: the sum over every token position of ``a``'s row times ``b``'s row (a
    Linear's weight gradient) without flattening ``L``."""
    return a.reshape(-1, a.shape[-1]).t() @ b.reshape(-1, b.shape[-1])


@token_contract.register_fake
def _token_contract_fake(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[-1], b.shape[-1]))


from fxpar import moe  # noqa: E402, F401  (the experts ops: fxpar.moe_experts, fxpar.expert_mlp, ...)
