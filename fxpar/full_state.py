"""``pm.load_state_dict(model.state_dict())``: a single-device state dict loads into a ``ParallelModule``.

A ``ParallelModule``'s parameters are DTensors, and ``nn.Module.load_state_dict`` copies a plain tensor into a
DTensor only with an error ("aten.copy_.default got mixed torch.Tensor and DTensor arguments"). FSDP2 users reach
for ``torch.distributed.checkpoint.state_dict.set_model_state_dict(..., full_state_dict=True)``; here the module
does it itself: each whole tensor is distributed as its parameter is stored (``distribute_tensor``: rank 0's
value broadcast, each rank keeping its shard, ZeRO's dp shards included), so the state dict of the model
``fxpar.parallelize`` was given, or of the same model trained on one device, loads as it is. With pipeline stages a
rank holds its stages' parameters only: the model's other entries are skipped, not unexpected. Every rank must call
it (the broadcast). DTensors load as torch loads them. ``fxpar.checkpoint`` is the sharded, resharding path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor


def distributed_state(own: Mapping[str, Any], given: Mapping[str, Any], held_elsewhere: set[str]) -> dict[str, Any]:
    """``given`` with each plain tensor whose entry in ``own`` is a DTensor of the same shape distributed like it,
    and the entries in ``held_elsewhere`` (the model's, on another pipeline stage) that ``own`` lacks left out."""
    out: dict[str, Any] = {}
    for key, value in given.items():
        mine = own.get(key)
        if mine is None and key in held_elsewhere:
            continue
        if isinstance(mine, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
                and tuple(value.shape) == tuple(mine.shape):
            local = value.detach().to(device=mine.to_local().device, dtype=mine.dtype)
            value = distribute_tensor(local, mine.device_mesh, mine.placements)
        out[key] = value
    return out


class FullStateLoading:
    """Mixin of ``ParallelModule``: ``load_state_dict`` that also takes a single-device state dict. Reads the
    module's ``_save_sources`` (the model's parameter and buffer names)."""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, also from a single-device state dict: whole tensors are distributed as each
        parameter is stored, and the model's entries another pipeline stage holds are skipped
        (``fxpar.full_state``). Call it on every rank."""
        model_keys = {*self._save_sources.requires_grad, *self._save_sources.buffers}
        given = distributed_state(self.state_dict(), state_dict, model_keys)
        return super().load_state_dict(given, strict=strict, assign=assign)
