"""Gradient clipping by the norm of the whole model's gradient, across pipeline stages.

``torch.nn.utils.clip_grad_norm_(pm.parameters(), max_norm)`` is right on dp, tp and ZeRO (the gradients are
DTensors: their norm is reduced over the mesh), but with pipeline stages a rank holds only its stages'
parameters: each rank would clip by its stages' norm, not the model's, and the step would differ from the single
device's without any error. ``clip_grad_norm_`` sums the stages' norms over ``pp`` (torchtitan does the same over
its pipeline mesh), counts a weight tied across stages (held, with the same summed gradient, by several) once,
and scales every gradient this rank holds by the same coefficient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fxpar.compiled import Compiled
from fxpar.rank_step import tie_holders


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0, *,
                    pp_group: dist.ProcessGroup | None = None, counted_elsewhere: Iterable[torch.Tensor] = (),
                    error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that the model's total ``norm_type``-norm is at most ``max_norm``;
    return that total norm (before clipping), the same on every rank, as ``torch.nn.utils.clip_grad_norm_`` does.

    Requires: the gradients of one rank's stages (DTensors on the mesh without ``pp``, or plain tensors);
    ``pp_group`` this rank's pipeline group (``None`` without stages); ``counted_elsewhere`` parameters whose
    gradient another stage's rank counts (tied weights). Every rank of the mesh calls it (it is collective).
    """
    params = [p for p in parameters if p.grad is not None]
    skip = {id(p) for p in counted_elsewhere}
    counted = [p.grad for p in params if id(p) not in skip]
    norm = torch.nn.utils.get_total_norm(counted, norm_type, error_if_nonfinite, foreach)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if pp_group is not None:
        norm = _over_stages(norm.to(torch.float32), norm_type, pp_group)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad  # each shard scaled alike
        g.mul_(coef.to(g.device, g.dtype))
    return norm


def _over_stages(norm: torch.Tensor, norm_type: float, pp_group: dist.ProcessGroup) -> torch.Tensor:
    if math.isinf(norm_type):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=pp_group)
        return norm
    powered = norm ** norm_type
    dist.all_reduce(powered, group=pp_group)
    return powered ** (1.0 / norm_type)


def counted_on_another_stage(compiled: Compiled, rank: int) -> list[str]:
    """The weights ``rank`` holds that a rank of an earlier pipeline coordinate holds too (tied across stages, with
    the same summed gradient): the norm counts them there."""
    mine = compiled.pp_coord(rank)
    return [fqn for fqn, pps in tie_holders(compiled).items() if mine in pps and mine != pps[0]]
