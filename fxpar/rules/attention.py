"""Attention kernels DTensor has no strategy for (the CPU flash kernels, forward and backward).

Attention is independent per batch element and per head, so q/k/v/out/logsumexp (and the
gradients) may all be sharded on the batch dim (0) or all on the heads dim (1). A mask whose
batch or heads dim is a broadcast 1 stays replicated. GQA works head-sharded as long as both
the query and the kv head counts divide by the axis size (local groups stay aligned).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

from fxpar.rules.registry import Candidate, register

aten = torch.ops.aten


def _mask_placement(mask: torch.Tensor | None, dim: int) -> list:
    if mask is None:
        return []
    return [Shard(dim) if mask.shape[dim] > 1 else Replicate()]


def _attention_candidates(tensors: list[torch.Tensor], mask: torch.Tensor | None, n_out: int, n: int):
    out = [Candidate(tuple(Replicate() for _ in range(len(tensors) + (mask is not None))),
                     tuple(Replicate() for _ in range(n_out)))]
    for dim in (1, 0):  # heads first: it is what tensor parallel wants
        # heads must divide (query heads of a kv group stay together); every tensor has one batch size,
        # so its pieces line up however the axis splits it (uneven batches too)
        if all(t.shape[dim] % n == 0 if dim == 1 else t.shape[dim] >= n for t in tensors):
            ins = tuple(Shard(dim) for _ in tensors) + tuple(_mask_placement(mask, dim))
            out.append(Candidate(ins, tuple(Shard(dim) for _ in range(n_out))))
    return out


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_cpu_forward(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    q, k, v = args[:3]
    return _attention_candidates([q, k, v], kwargs.get("attn_mask"), 2, n)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_cpu_backward(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    grad_out, q, k, v, out, lse = args[:6]
    return _attention_candidates([grad_out, q, k, v, out, lse], kwargs.get("attn_mask"), 3, n)
