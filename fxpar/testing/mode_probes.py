"""Rank bodies for ``tests/test_modes.py``: train, evaluate and train again, against the single device on every rank.

Module-level so that pool ranks can unpickle them. Every rank also runs the single-device reference (the whole
batch), from the same generator state, and reports the largest differences rather than asserting, so a failure
shows every number at once.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _first(out: Any) -> torch.Tensor:
    """The tensor a model's output leads with (HF outputs: logits)."""
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.logits


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of ``a`` from ``b`` relative to ``b``'s scale (fp32: rtol 1e-5 is the bar)."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def train_evaluate_train(model_fn: Callable[[], torch.nn.Module], axes: dict[str, int], plan: Any,
                         inputs: torch.Tensor, targets: torch.Tensor,
                         loss_fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """Two SGD steps in training mode, ``pm.eval()`` forwards (twice, under ``no_grad``), ``pm.train()`` and one
    more step, beside the single-device model doing the same. Returns relative gaps: ``eval`` (outputs of this
    rank's batch share), ``eval_again`` (the second eval forward against the first: no randomness, no writes),
    ``params`` and ``buffers`` after the last step, and whether eval forwards left the buffers alone."""
    import fxpar

    torch.manual_seed(0)
    model = model_fn()
    reference = copy.deepcopy(model)
    rank, mesh = dist.get_rank(), fxpar.Mesh(axes)
    pm = fxpar.parallelize(model, mesh, (inputs,), plan=plan, loss_fn=loss_fn)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)

    def share(t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the batch: its dp coordinate's chunk."""
        if "dp" not in axes:
            return t
        return t.chunk(axes["dp"])[mesh.coord(rank)[mesh.axis_index("dp")]]

    def train_step() -> None:
        state = torch.get_rng_state()
        pm.step(share(inputs), share(targets))
        torch.set_rng_state(state)  # the reference draws what the ranks drew (fxpar.random_draws)
        loss_fn(reference(inputs), targets).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()

    for _ in range(2):
        train_step()
    pm.eval()
    reference.eval()
    held = {name: b.clone() for name, b in pm.named_buffers()}
    with torch.no_grad():
        first, second = _first(pm(share(inputs))), _first(pm(share(inputs)))
        expected = share(_first(reference(inputs)))
    untouched = all(torch.equal(b, held[name]) for name, b in pm.named_buffers())
    eval_program = pm.program(rank)
    pm.train()
    reference.train()
    train_step()
    ref_params, ref_buffers = dict(reference.named_parameters()), dict(reference.named_buffers())
    params = max(_gap(p.full_tensor(), ref_params[name]) for name, p in pm.named_parameters())
    buffers = max((_gap(b, ref_buffers[name]) for name, b in pm.named_buffers() if b.is_floating_point()),
                  default=0.0)
    return {"eval": _gap(first, expected), "eval_again": _gap(second, first), "buffers_untouched": untouched,
            "params": params, "buffers": buffers, "eval_program_draws": "native_dropout" in eval_program,
            "eval_program_writes": "aten.copy_(" in eval_program, "training": pm.training}


def token_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a language model's logits (``_first``) against target tokens."""
    logits = _first(out)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def validate_between_steps(model_fn: Callable[[], torch.nn.Module], axes: dict[str, int], plan: Any,
                           inputs: torch.Tensor, targets: torch.Tensor,
                           loss_fn: Callable[..., torch.Tensor]) -> dict[str, Any]:
    """A training step, then a validation step (``pm.eval()`` and ``pm.step`` under ``no_grad``: forwards and loss
    only), then a training step again, beside the single device. Returns the validation loss gap, whether the
    validation left every gradient as it found it (none), and the parameters' gap after the last step."""
    import fxpar

    torch.manual_seed(0)
    model = model_fn()
    reference = copy.deepcopy(model)
    rank, mesh = dist.get_rank(), fxpar.Mesh(axes)
    pm = fxpar.parallelize(model, mesh, (inputs,), plan=plan, loss_fn=loss_fn, example_targets=targets)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    dp = axes.get("dp", 1)
    piece = (lambda t: t.chunk(dp)[mesh.coord(rank)[mesh.axis_index("dp")]]) if dp > 1 else (lambda t: t)

    def train_step() -> None:
        state = torch.get_rng_state()
        pm.step(piece(inputs), piece(targets))
        torch.set_rng_state(state)
        loss_fn(reference(inputs), targets).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()

    train_step()
    pm.eval()
    reference.eval()
    with torch.no_grad():
        validation = pm.step(piece(inputs), piece(targets))
        expected = loss_fn(reference(inputs), targets)
    untouched = all(p.grad is None for p in pm.parameters())
    pm.train()
    reference.train()
    train_step()
    ref_params = dict(reference.named_parameters())
    params = max(_gap(p.full_tensor(), ref_params[name]) for name, p in pm.named_parameters())
    return {"validation": _gap(validation, expected), "grads_untouched": untouched, "params": params}
