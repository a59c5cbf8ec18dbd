"""The loss events of a rank's step: each microbatch's loss on the last stage, and the step's mean loss.

``StepExecutor`` runs them (``fxpar.executor``): ``loss`` computes ``loss_fn`` eagerly on the last stage's outputs
and the gradients of those outputs (the backward's incoming gradients), watching for a loss that is not a batch
mean (``fxpar.loss_watch``); ``loss_value`` is the same loss without its gradient (an evaluation step);
``global_loss`` averages over microbatches and the ranks sharing the batch.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpar.loss_watch import IgnoredTargets, split_mean_gap, warn_split_mean, warn_uneven_mean

if TYPE_CHECKING:
    from fxpar.executor import StepState


def transfer_device() -> torch.device:
    """Where a rank's pipeline transfers and step-loss reduction run: the current CUDA device when the default
    process group is NCCL's (which takes no CPU tensor), else the CPU."""
    if "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StepLosses:
    """Mixin of ``StepExecutor``: reads ``loss_fn``, ``spec``, ``m``, ``device``, ``warned_uneven_mean`` and
    ``checked_split_mean``."""

    loss_fn: Any
    spec: Any
    m: int
    device: torch.device
    warned_uneven_mean: bool
    checked_split_mean: bool
    dead_outputs: frozenset[int] = frozenset()  # outputs the loss made no gradient for at the first step

    def loss(self, outs: list[torch.Tensor], targets: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        leaves = [o.detach().requires_grad_() if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                  for o in outs]
        watch = IgnoredTargets() if self.spec.batch_ranks > 1 and not self.warned_uneven_mean else nullcontext()
        with torch.enable_grad(), watch:
            loss = self.loss_fn(leaves, targets)
        if isinstance(watch, IgnoredTargets) and watch.uneven:
            warn_uneven_mean(self.spec.batch_ranks)
            self.warned_uneven_mean = True
        self._check_split_mean(leaves, targets, loss)
        with torch.enable_grad():
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.requires_grad:
                raise ValueError(_not_a_loss(loss))
            (loss / self.m).backward()
        return loss.detach(), [x.grad if isinstance(x, torch.Tensor) else None for x in leaves]

    def check_dead_outputs(self, grads: list[torch.Tensor | None]) -> None:
        """The parameters only the outputs the loss left out at the first step reach keep no gradient
        (``fxpar.unreached``): a loss that reads one of them now would lose its gradient, so it is refused."""
        used = [i for i in self.dead_outputs if grads[i] is not None]
        if used:
            raise RuntimeError(f"loss_fn made a gradient for model output(s) {used}, which it did not read at the "
                               "first pm.step: fxpar decided then which parameters the loss reaches (the others "
                               "keep .grad None). A loss must read the same outputs at every step; build the "
                               "module again (fxpar.parallelize) for a loss that reads others")

    def _check_split_mean(self, leaves: list[Any], targets: Any, loss: torch.Tensor) -> None:
        """Once per module, where the step splits the batch: warn if ``loss_fn`` is not a mean over rows."""
        if self.checked_split_mean or self.warned_uneven_mean or self.spec.batch_ranks * self.m == 1:
            return
        self.checked_split_mean = True
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            return  # refused below, by name
        gap = split_mean_gap(self.loss_fn, leaves, targets, loss)
        if gap is not None:
            warn_split_mean(self.spec.batch_ranks, self.m, *gap)
            self.warned_uneven_mean = True

    def loss_value(self, outs: list[torch.Tensor], targets: Any) -> torch.Tensor:
        """The loss of one microbatch, without its gradient (an evaluation step)."""
        loss = self.loss_fn(outs, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ValueError(_not_a_loss(loss))
        return loss.detach()

    def global_loss(self, st: StepState) -> torch.Tensor:
        """The mean loss over microbatches and dp ranks, on every rank (one world all-reduce of a scalar)."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)  # a rank without the last stage
        if st.losses:
            value = torch.stack([loss.double() for loss in st.losses.values()]).mean() / self.spec.loss_divisor
            value = value * self.spec.batch_weight
        dist.all_reduce(value)
        return value.float()



def _not_a_loss(loss: Any) -> str:
    what = (f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) and loss.dim()
            else "a tensor that does not depend on the outputs" if isinstance(loss, torch.Tensor)
            else f"{type(loss).__name__}")
    return (f"loss_fn returned {what}: it must return a scalar tensor computed from the model's outputs, the mean "
            "over the batch (for example F.cross_entropy(logits.flatten(0, 1), targets.flatten()))")
