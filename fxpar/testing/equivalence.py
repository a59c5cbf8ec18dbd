"""Parallel-vs-single-device equivalence, run inside each rank of a launched mesh.

``check_rank`` builds the model twice from the same seed: once as the single-device
reference (the whole batch), once through ``fxpar.parallelize`` (this rank's dp shard). It
compares outputs, every parameter gradient and every parameter after ``steps`` AdamW steps,
and returns the worst errors per tensor so the parent process can assert and report them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fxpar


@dataclass
class Mismatch:
    """Where a parallel program and the reference disagree beyond tolerance."""

    tensor: str
    rank: int
    step: int
    max_abs: float
    max_rel: float


@dataclass
class RankReport:
    rank: int
    losses: list[tuple[float, float]] = field(default_factory=list)  # (fxpar, reference) per step
    worst_abs: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)
    program: str = ""
    ledger: str = ""


def build(factory: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``factory`` is ``"module:function"``; it returns a fresh model."""
    mod, fn = factory.split(":")
    return getattr(importlib.import_module(mod), fn)(**kwargs)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(name: str, got: torch.Tensor, ref: torch.Tensor, rank: int, step: int, rtol: float, atol: float,
             report: RankReport) -> None:
    if step > 0:  # after optimizer steps, values inherit the parameter drift (see param_atol)
        rtol, atol = max(rtol, 1e-4), max(atol, 1e-4)
    got, ref = got.detach().double(), ref.detach().double()
    # fp32 sums of many terms err by ~k*eps*max|term|: scale the absolute floor with the tensor
    atol = atol * max(1.0, ref.abs().max().item() if ref.numel() else 1.0)
    err = (got - ref).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    max_rel = (err / ref.abs().clamp_min(1e-12)).max().item() if err.numel() else 0.0
    report.worst_abs = max(report.worst_abs, max_abs)
    if not torch.allclose(got, ref, rtol=rtol, atol=atol):
        report.mismatches.append(Mismatch(name, rank, step, max_abs, max_rel))


# Adam moves an element by lr * g / (|g| + eps): its sensitivity to a rounding difference dg in
# the gradient is up to lr * dg / eps. With eps=1e-8 an element whose gradient sits at the fp32
# noise floor (dg ~ 1e-9) can move anywhere within +-lr, which no tolerance can tell from a bug;
# eps=1e-6 (a common AdamW setting) bounds it to ~1e-3 * lr.
ADAM_EPS = 1e-6


def param_atol(lr: float) -> float:
    """Tolerance on parameters after AdamW steps: 2% of one step (``lr``) per element.

    Adam divides each gradient element by its own running RMS, so every element moves by about
    ``lr`` whatever its size. Elements whose gradient sits at the fp32 noise floor (a sum of
    cancelling terms, |g| ~ 1e-6) get a different relative value from a different reduction
    order, and Adam turns that into an absolute difference of up to a few 1e-3 x ``lr``.
    Outputs and gradients of the first step, which have no such normalization, are held to
    rtol 1e-5 / atol 1e-6. At later steps they are computed from parameters that may differ by
    this bound, summed over a fan-in of tens to hundreds, so they are held to 1e-4; a missing or
    doubled reduction still shows up as an O(1) relative error.
    """
    return 2e-2 * lr


def check_rank(factory: str, model_kwargs: dict[str, Any], mesh_axes: dict[str, int], plan: dict | None,
               inputs: tuple[torch.Tensor, ...], steps: int = 3, rtol: float = 1e-5, atol: float = 1e-6,
               lr: float = 1e-3, want_program: bool = False, loss: str = "mean") -> RankReport:
    """Run in every rank (under ``run_ranks``); see the module docstring."""
    rank = dist.get_rank()
    mesh = fxpar.Mesh(mesh_axes)
    torch.manual_seed(0)
    reference = build(factory, model_kwargs)
    torch.manual_seed(0)
    model = build(factory, model_kwargs)
    pm = fxpar.parallelize(model, mesh, inputs, plan=plan)
    report = RankReport(rank)
    if want_program:
        report.program, report.ledger = pm.program(rank), pm.ledger_table(rank)
    dp = mesh_axes.get("dp", 1)
    dp_idx = mesh.coord(rank)[mesh.axis_index("dp")] if "dp" in mesh_axes else 0
    local = tuple(x.chunk(dp)[dp_idx] for x in inputs)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr, eps=ADAM_EPS)
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        out = pm(*local)
        ref_out = reference(*inputs)
        out_t = out if isinstance(out, torch.Tensor) else out[0]
        ref_t = ref_out if isinstance(ref_out, torch.Tensor) else ref_out[0]
        _compare("output", out_t, ref_t.chunk(dp)[dp_idx], rank, step, rtol, atol, report)
        loss_val = out_t.float().pow(2).mean() if loss == "mean" else out_t.sum()
        ref_loss = ref_t.float().pow(2).mean()
        loss_val.backward()
        ref_loss.backward()
        # the global loss is the mean of the dp ranks' local losses
        global_loss = loss_val.detach().clone()
        if dp > 1:
            dist.all_reduce(global_loss)
            global_loss /= dist.get_world_size()
            # every tp rank holds the same loss; the world mean equals the dp mean
        report.losses.append((global_loss.item(), ref_loss.item()))
        for name, p in pm.named_parameters():
            if p.grad is None:
                report.mismatches.append(Mismatch(f"grad of {name} is None", rank, step, float("inf"), float("inf")))
                continue
            _compare(f"grad of {name}", _full(p.grad), ref_params[name].grad, rank, step, rtol, atol, report)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for name, p in pm.named_parameters():
            _compare(f"{name} after step {step + 1}", _full(p.data), ref_params[name].data, rank, step, rtol,
                     param_atol(lr), report)
    return report
