"""BatchNorm in training mode as sums, so a batch-sharded BatchNorm computes the whole batch's statistics.

torch's CPU and CUDA kernels compute a batch's mean and variance inside one op that no sharding rule can split:
on a dp-sharded batch the op would run on an all-gathered input (and everything after it on the whole batch).
Capture instead traces training-mode batch norm as the two-pass formula the kernels use, written with sums over
the batch and spatial dims (``mean = sum(x) / n``, ``var = sum((x - mean)^2) / n``, ``n`` the global count);
propagation turns each sum over a sharded dim into a partial sum completed by one all-reduce of ``C`` values, so
the program normalizes every shard with the global statistics: SyncBatchNorm's semantics, which are the single
device's. The backward is torch's own sum-based decomposition (two more ``C``-sized all-reduces). Running
statistics follow the kernel's update (``(1 - momentum) * old + momentum * stat``, the variance unbiased); their
write is an ``aten.copy_`` into the buffer at the end of the forward (``fxpar.capture.buffer_writes_as_copies``).
Statistics are accumulated in fp32 for low-precision inputs, as the kernels do (the CPU kernel uses fp64: results
agree to fp32 rounding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._decomp import decomposition_table

aten = torch.ops.aten


def _training_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(output, mean, rstd, biased variance, count) of a training batch norm over every dim but 1."""
    dims = [0, *range(2, x.ndim)]
    n = x.numel() // x.shape[1]
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = torch.sum(xf, dims, keepdim=True) / n
    centered = xf - mean
    var = torch.sum(centered * centered, dims, keepdim=True) / n
    rstd = torch.rsqrt(var + eps)
    out = centered * rstd
    shape = [1, x.shape[1]] + [1] * (x.ndim - 2)
    if weight is not None:
        out = out * weight.reshape(shape)
    if bias is not None:
        out = out + bias.reshape(shape)
    return out.to(x.dtype), mean.reshape(-1), rstd.reshape(-1), var.reshape(-1), n


def legit_functional(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                     running_mean: torch.Tensor, running_var: torch.Tensor, training: bool, momentum: float,
                     eps: float) -> tuple[torch.Tensor, ...]:
    """``aten._native_batch_norm_legit_functional``: (output, mean, rstd, new running mean, new running var)."""
    if not training:
        return decomposition_table[aten._native_batch_norm_legit_functional.default](
            x, weight, bias, running_mean, running_var, training, momentum, eps)
    out, mean, rstd, var, n = _training_norm(x, weight, bias, eps)
    unbiased = var * (n / (n - 1)) if n > 1 else var
    new_mean = running_mean * (1 - momentum) + mean.to(running_mean.dtype) * momentum
    new_var = running_var * (1 - momentum) + unbiased.to(running_var.dtype) * momentum
    return out, mean, rstd, new_mean, new_var


def legit_no_stats(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, training: bool,
                   momentum: float, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``aten._native_batch_norm_legit.no_stats`` (``track_running_stats=False``): (output, mean, rstd)."""
    out, mean, rstd, _, _ = _training_norm(x, weight, bias, eps)
    return out, mean, rstd


# what capture decomposes while it traces the joint graph (below autograd: the backward is differentiated from
# the kernels' own formula, then decomposed into sums too)
CAPTURE_DECOMPOSITIONS: dict[Any, Callable[..., Any]] = {
    aten._native_batch_norm_legit_functional.default: legit_functional,
    aten._native_batch_norm_legit.no_stats: legit_no_stats,
    aten.native_batch_norm_backward.default: decomposition_table[aten.native_batch_norm_backward.default],
}
