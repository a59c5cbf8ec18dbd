"""Attention kernels DTensor has no strategy for, or one fxpar cannot use: the CPU flash kernels and CUDA's
flash, memory-efficient and cuDNN kernels, forward and backward.

Attention is independent per batch element and per head, so q/k/v/out/logsumexp (and the
gradients) may all be sharded on the batch dim (0) or all on the heads dim (1). A mask (or bias)
broadcasts from the right, as torch does: a 2-D ``[q, k]`` mask has no batch or heads dim and a 3-D
one has no batch dim; a mask without that dim, or whose size there is a broadcast 1, stays replicated.
GQA works head-sharded as long as both the query and the kv head counts divide by the axis size
(local groups stay aligned).

The CUDA kernels also pass small bookkeeping tensors from forward to backward (the dropout RNG's seed and
offset, 0-D or 1-D): those are the same on every rank (replicated), as are the kernels' integer outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.rules.registry import Candidate, register

aten = torch.ops.aten


ATTENTION_NDIM = 4  # [batch, heads, seq, head_dim]: what a mask or bias broadcasts against


def _broadcast_dim(t: torch.Tensor, dim: int) -> int | None:
    """The dim of ``t`` (a mask or bias) that lines up with attention dim ``dim`` under right-aligned
    broadcasting, or None where ``t`` has no such dim or its size there is a broadcast 1."""
    own = dim - (ATTENTION_NDIM - t.dim())
    return own if own >= 0 and t.shape[own] > 1 else None


def _mask_placement(mask: torch.Tensor | None, dim: int) -> list:
    if mask is None:
        return []
    own = _broadcast_dim(mask, dim)
    return [Shard(own) if own is not None else Replicate()]


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


CUDA_ATTENTION = (
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_cudnn_attention_backward.default,
)
PER_HEAD_NDIM = 3  # [batch, heads, seq(, head_dim)]: q, k, v, out, logsumexp, their gradients, a bias


def _cuda_attention_rule(op: torch._ops.OpOverload) -> Callable[[tuple[Any, ...], dict[str, Any], int],
                                                                list[Candidate]]:
    """The rule of one CUDA attention kernel: every per-head tensor (3-D or more) sharded on batch or heads, the
    RNG bookkeeping replicated. The outputs are read off the kernel's fake run on the arguments' metadata."""
    arg_names = [a.name for a in op._schema.arguments]

    def rule(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
        named = dict(zip(arg_names, args, strict=False)) | kwargs
        bias = named.get("attn_bias")
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = op(*args, **kwargs)
        out = [Candidate(tuple(Replicate() for _ in tensors), _outputs_placed(outputs, lambda t: Replicate()))]
        for dim in (1, 0):  # heads first: it is what tensor parallel wants
            cand = _cuda_candidate(tensors, bias, outputs, dim, n)
            if cand is not None:
                out.append(cand)
        return out

    return rule


def _cuda_candidate(tensors: list[torch.Tensor], bias: torch.Tensor | None, outputs: Any, dim: int,
                    n: int) -> Candidate | None:
    """All per-head tensors sharded on ``dim``, or None where that cannot be: a per-head size that does not split
    (heads must divide; the batch only needs a piece per rank), or a broadcast size other than the bias's (a
    bias broadcast on ``dim`` stays whole, and then its gradient could not be sharded)."""
    def place(t: torch.Tensor, may_broadcast: bool) -> Placement | None:
        if may_broadcast:  # the bias lines up with the per-head tensors from the right
            own = _broadcast_dim(t, dim)
            return Replicate() if own is None else Shard(own) if (t.shape[own] % n == 0 if dim == 1 else
                                                                    t.shape[own] >= n) else None
        if t.dim() < PER_HEAD_NDIM:
            return Replicate()
        size = t.shape[dim]
        if size == 1:
            return Replicate() if may_broadcast else None
        return Shard(dim) if (size % n == 0 if dim == 1 else size >= n) else None

    ins = tuple(place(t, t is bias) for t in tensors)
    outs = _outputs_placed(outputs, lambda t: place(t, False))
    if None in ins or any(o is None and isinstance(v, torch.Tensor) for o, v in zip(outs, outputs, strict=True)):
        return None
    return Candidate(ins, outs)


def _outputs_placed(outputs: Any, place: Callable[[torch.Tensor], Placement | None]) -> tuple[Placement | None, ...]:
    return tuple(place(v) if isinstance(v, torch.Tensor) else None for v in outputs)


for _op in CUDA_ATTENTION:
    register(_op)(_cuda_attention_rule(_op))
