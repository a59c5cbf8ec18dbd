"""Warn when ``loss_fn`` is not a batch mean because it ignores some of its targets.

``pm.step`` computes ``loss_fn`` on each rank's share of the batch and averages the ranks' losses (and gradients)
over dp, as DDP does: exact for a mean over samples. Cross-entropy with ``ignore_index`` (padding labeled -100 in a
language model's targets) or with class weights averages over the targets it keeps, a count that differs from rank
to rank, so the mean of the ranks' means is not the single device's loss, and the gradients are off by the same
uneven weights: a silent wrong answer. ``IgnoredTargets`` watches the loss's ``nll_loss`` kernels (what every
PyTorch cross-entropy and NLL loss runs) for a mean over fewer targets than given, and the step executor warns once.
A loss computed inside the model's forward (HF models given ``labels=``) is traced instead, and fxpar averages it
over the whole batch's kept targets (``fxpar.global_means``): that one is exact.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.errors import FxparWarning

aten = torch.ops.aten
NLL = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
MEAN = 1  # ``reduction`` as the kernels take it: 0 none, 1 mean, 2 sum


class IgnoredTargets(TorchDispatchMode):
    """Inside the block, ``uneven`` turns True when an ``nll_loss`` kernel averages over a count other than the
    number of its targets (ignored targets, or class weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.uneven = False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func in NLL and not self.uneven:
            target, weight, reduction = args[1], args[2], args[3]
            if reduction == MEAN and (weight is not None or out[1].item() != target.numel()):
                self.uneven = True
        return out


def warn_uneven_mean(batch_ranks: int) -> None:
    """The warning, for a batch split over ``batch_ranks`` ranks."""
    warnings.warn(
        f"fxpar: loss_fn averages over fewer targets than it is given (cross-entropy's ignore_index, e.g. padding "
        f"labeled -100, or class weights), so it is not a batch mean: each of the {batch_ranks} ranks sharing the "
        "batch averages over its own count, and the mean of their losses (and gradients) is not the single "
        "device's. Compute the loss inside the model's forward (an HF model given labels=...), where fxpar traces "
        "it and averages over the whole batch's kept targets, or give every rank the same count of kept targets",
        FxparWarning, stacklevel=3)
