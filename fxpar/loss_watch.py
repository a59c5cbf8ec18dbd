"""Warn when ``loss_fn`` is not a batch mean because it ignores some of its targets.

``pm.step`` computes ``loss_fn`` on each rank's share of the batch and averages the ranks' losses (and gradients)
over dp, as DDP does: exact for a mean over samples. Cross-entropy with ``ignore_index`` (padding labeled -100 in a
language model's targets) or with class weights averages over the targets it keeps, a count that differs from rank
to rank, so the mean of the ranks' means is not the single device's loss, and the gradients are off by the same
uneven weights: a silent wrong answer. ``IgnoredTargets`` watches the loss's ``nll_loss`` kernels (what every
PyTorch cross-entropy and NLL loss runs) for a mean over fewer targets than given, and the step executor warns once.
A loss computed inside the model's forward (HF models given ``labels=``) is traced instead, and fxpar averages it
over the whole batch's kept targets (``fxpar.global_means``): that one is exact.

A loss can fail to be a batch mean in ways no kernel shows: one that compares rows with each other (a contrastive
loss, CLIP's ``a @ b.T`` against ``arange`` labels), sums over the batch (``reduction="sum"``) or normalizes by a
batch statistic. ``split_mean_gap`` tests the definition once, on the first microbatch a rank computes the loss of:
the loss of its rows against the row-weighted mean of the losses of its two halves (two more ``loss_fn`` calls,
without gradients). They agree, up to rounding, exactly when the loss is a mean over rows.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.utils._pytree as pytree
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


def split_mean_gap(loss_fn: Any, leaves: list[Any], targets: Any, loss: torch.Tensor) -> tuple[float, float] | None:
    """``(loss, mean of halves)`` when ``loss`` (``loss_fn(leaves, targets)``) is not the row-weighted mean of the
    losses of the two halves of the microbatch beyond rounding; None when it is, or when the microbatch cannot be
    halved (fewer than 2 rows, or ``loss_fn`` fails on half of them: a saved program's loss is traced for one
    shape). Rows are dim 0 of the first output with a dim; every output and target with that
    many rows in dim 0 is halved, the rest (a scalar loss the model returned) is passed whole."""
    rows = next((t.shape[0] for t in leaves if isinstance(t, torch.Tensor) and t.dim()), 0)
    if rows < 2:
        return None
    spans = [(0, rows // 2), (rows // 2, rows)]
    try:
        with torch.no_grad():
            values = [loss_fn(_rows(leaves, rows, a, b), _rows(targets, rows, a, b)) for a, b in spans]
    except Exception:  # noqa: BLE001 - a loss that takes one shape only (a saved program's traced loss): no test
        return None
    if not all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values):
        return None
    halves = sum(float(v) * (b - a) for v, (a, b) in zip(values, spans, strict=True)) / rows
    whole = float(loss)
    rtol = 1e-4 if loss.dtype in (torch.float32, torch.float64) else 5e-2
    if abs(whole - halves) <= rtol * max(abs(whole), abs(halves)) + 1e-7:
        return None
    return whole, halves


def _rows(tree: Any, rows: int, start: int, stop: int) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t[start:stop].detach() if t.dim() and t.shape[0] == rows
                                else t, tree)


def warn_split_mean(batch_ranks: int, microbatches: int, whole: float, halves: float) -> None:
    """The warning, for a step that splits the batch into ``batch_ranks`` x ``microbatches`` shares."""
    shares = " x ".join(f"{n} {what}" for n, what in ((batch_ranks, "ranks"), (microbatches, "microbatches"))
                        if n > 1)
    warnings.warn(
        f"fxpar: loss_fn is not a mean over the batch's rows: on the first microbatch it gave {whole:.6g}, and the "
        f"mean of its two halves' losses {halves:.6g}. pm.step splits the batch into {shares} and averages their "
        "losses and gradients, which is the single device's step only for a batch mean; a loss that compares rows "
        "with each other (contrastive: logits = a @ b.T against arange labels), sums over the batch "
        "(reduction='sum') or normalizes by a batch statistic gives another loss and other gradients. Compute it "
        "inside the model's forward (fxpar traces it and shards it exactly), or make it a mean over rows",
        FxparWarning, stacklevel=3)
