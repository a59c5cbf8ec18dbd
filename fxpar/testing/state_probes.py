"""Rank bodies for ``tests/test_full_state.py``: a single-device state dict loaded into a ``ParallelModule``.

Module-level so that pool ranks can unpickle them; each reports numbers rather than asserting.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def load_single_device_state(model_fn: Callable[[], torch.nn.Module], axes: dict[str, int], plan: Any,
                             inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[..., torch.Tensor],
                             frozen: str | None = None) -> dict[str, Any]:
    """Parallelize ``model_fn()`` (seed 0), then ``pm.load_state_dict`` the state dict of another draw of it (seed
    1) whose parameters and buffers all differ; one ``pm.step`` against that model's loss and gradients. ``frozen``:
    a submodule put in eval mode in both (its buffers only read). Returns what loaded, the loss gap, the largest
    relative gradient gap and whether the module's ``state_dict`` keys are those the rank holds of the model's."""
    import fxpar

    torch.manual_seed(0)
    model = model_fn()
    torch.manual_seed(1)
    other = model_fn()
    with torch.no_grad():
        for b in other.buffers():
            if b.is_floating_point():
                b.add_(0.5)  # running statistics that differ from the first model's
    for m in (model, other):
        if frozen:
            m.get_submodule(frozen).eval()
    mesh = fxpar.Mesh(axes)
    pm = fxpar.parallelize(model, mesh, (inputs,), plan=plan, loss_fn=loss_fn, example_targets=targets)
    result = pm.load_state_dict(other.state_dict())
    rank = dist.get_rank()
    dp = axes.get("dp", 1)
    piece = mesh.coord(rank)[mesh.axis_index("dp")] if dp > 1 else 0
    loss = pm.step(inputs.chunk(dp)[piece], targets.chunk(dp)[piece])
    expected = loss_fn(other(inputs), targets)
    expected.backward()
    grads = dict(other.named_parameters())
    gap = max(((p.grad.full_tensor() - grads[n].grad).abs().max() / grads[n].grad.abs().max().clamp_min(1e-12)).item()
              for n, p in pm.named_parameters() if p.grad is not None)
    model_keys = set(other.state_dict())
    return {"loaded": str(result), "loss_gap": abs(loss.item() - expected.item()), "grad_gap": gap,
            "keys_are_the_models": set(pm.state_dict()) <= model_keys and bool(pm.state_dict())}


def state_keys_after_a_step(model_fn: Callable[[], torch.nn.Module], axes: dict[str, int], plan: Any,
                            inputs: torch.Tensor, targets: torch.Tensor, loss_fn: Callable[..., torch.Tensor]
                            ) -> dict[str, Any]:
    """Parallelize ``model_fn()``, take one ``pm.step`` and an optimizer step; the rank's ``pm.state_dict()`` keys
    and its parameter names."""
    import fxpar

    pm = fxpar.parallelize(model_fn(), fxpar.Mesh(axes), (inputs,), plan=plan, loss_fn=loss_fn,
                           example_targets=targets)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    pm.step(inputs, targets)
    opt.step()
    return {"state": sorted(pm.state_dict()), "params": sorted(n for n, _ in pm.named_parameters())}
