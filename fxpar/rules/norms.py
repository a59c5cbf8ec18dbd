"""Sharding rules for per-channel normalizations DTensor has no strategy for.

BatchNorm in eval mode (``_native_batch_norm_legit_no_training``) is a per-channel affine map.

With running statistics the op normalizes each element by its channel's stored mean and variance: nothing is
reduced over the batch, so the batch (and any spatial dim) may stay sharded. DTensor has no strategy for it; without
this rule an eval-mode (or frozen) BatchNorm all-gathered its dp-sharded input and everything after it ran on the
whole batch on every rank. Training-mode BatchNorm is traced as sums (``fxpar.batch_norm``) and needs no rule.

Weight normalization's backward (``_weight_norm_interface_backward``: ``torch.nn.utils.weight_norm`` and the
parametrization's fused kernel) maps the weight's gradient to the direction's and the magnitude's, linearly and
per slice along ``dim``: a dp-partial weight gradient stays partial (reduced with the other gradients, a ZeRO
reduce-scatter included), where without a rule it was all-reduced first and the op ran replicated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import Candidate, register

aten = torch.ops.aten


@register(aten._native_batch_norm_legit_no_training.default)
def batch_norm_with_running_stats(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``(x, weight, bias, running_mean, running_var, momentum, eps) -> (out, empty, empty)``: replicated; ``x``
    sharded on a non-channel dim with at least ``n`` entries (the per-channel tensors whole); or on the channel dim
    with every per-channel tensor sharded alike. The two empty saved statistics are replicated."""
    x = args[0]
    per_channel = sum(isinstance(a, torch.Tensor) for a in args[1:5])
    empty = (Replicate(), Replicate())
    whole = (Replicate(),) * per_channel
    out = [Candidate((Replicate(), *whole), (Replicate(), *empty))]
    out += [Candidate((Shard(d), *whole), (Shard(d), *empty)) for d in range(x.ndim) if d != 1 and x.shape[d] >= n]
    if x.ndim > 1 and x.shape[1] >= n:
        out.append(Candidate((Shard(1), *(Shard(0),) * per_channel), (Shard(1), *empty)))
    return out


@register(aten._weight_norm_interface_backward.default)
def weight_norm_backward(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """``(grad_w, v, g, norms, dim) -> (grad_v, grad_g)``: replicated; ``grad_w`` a partial sum with the rest
    replicated (both gradients partial: the op is linear in ``grad_w``); or, for ``dim=0``, every tensor sharded on
    dim 0 (each slice is normalized on its own) when it has at least ``n`` entries. The CPU kernel takes only
    contiguous tensors, which a shard of a later dim is not."""
    grad_w, dim = args[0], args[4] if len(args) > 4 else kwargs.get("dim", 0)
    dim = dim % grad_w.ndim
    out = [Candidate((Replicate(),) * 4, (Replicate(), Replicate())),
           Candidate((Partial(), Replicate(), Replicate(), Replicate()), (Partial(), Partial()))]
    if dim == 0 and grad_w.shape[0] >= n:
        out.append(Candidate((Shard(0),) * 4, (Shard(0), Shard(0))))
    return out
