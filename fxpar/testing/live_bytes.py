"""The most bytes a real ``pm.step`` has alive at once, to hold ``pm.memory(rank).peak`` to it.

``LiveBytes`` is a ``TorchDispatchMode`` that records the storage of every tensor an op returns while it is active
and drops it when the storage is freed (a weak finalizer): its ``peak`` is the largest total of storages made
inside and alive together. ``step_peak`` is a rank body (module level, for the rank pool): one warm-up step and
optimizer step, then a measured ``pm.step``, with the parameters, buffers, optimizer state and inputs added once.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.testing.probes import built_for_steps, storage_bytes


class LiveBytes(TorchDispatchMode):
    """Bytes of the CPU storages ops made while active that are still alive: ``current`` and its ``peak``."""

    def __init__(self, already: list[torch.Tensor] = ()) -> None:
        super().__init__()
        self.live: dict[int, int] = {t.untyped_storage().data_ptr(): 0 for t in already}  # not counted
        self.current = self.peak = 0

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if key in self.live or size == 0:
            return
        self.live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.device.type == "cpu":
                self._track(t)
        return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def step_peak(model_fn: Any, mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor,
              loss_fn: Any) -> tuple[int, int]:
    """Rank body: (bytes alive at the peak of a steady-state ``pm.step`` plus the state kept across steps,
    ``pm.memory(rank).peak``)."""
    pm, local, opt = built_for_steps(model_fn, mesh_axes, plan, tokens, loss_fn)
    pm.step(local, local)
    opt.step()
    opt.zero_grad(set_to_none=True)
    state = [_local(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    kept = [_local(p) for p in pm.parameters()] + list(pm.buffers()) + state
    with LiveBytes([*kept, local]) as live:
        pm.step(local, local)
    return storage_bytes(kept) + live.peak, pm.memory(dist.get_rank()).peak
