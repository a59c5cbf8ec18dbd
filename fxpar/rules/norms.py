"""Sharding rule for BatchNorm in eval mode (``_native_batch_norm_legit_no_training``): a per-channel affine map.

With running statistics the op normalizes each element by its channel's stored mean and variance: nothing is
reduced over the batch, so the batch (and any spatial dim) may stay sharded. DTensor has no strategy for it; without
this rule an eval-mode (or frozen) BatchNorm all-gathered its dp-sharded input and everything after it ran on the
whole batch on every rank. Training-mode BatchNorm is traced as sums (``fxpar.batch_norm``) and needs no rule.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Replicate, Shard

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
