"""Optimizer steps on local shards: ``torch.optim`` over fxpar's DTensor parameters without DTensor dispatch.

fxpar's parameters are DTensors so that any ``torch.optim`` optimizer, ``state_dict()`` and DCP work
unchanged. But an eager optimizer step over DTensors dispatches every elementwise op through DTensor
(sharding propagation, then the local op): on CPU, AdamW over the bundled Llama's 39 parameters takes
2.4x as long as over plain tensors, most of the gap between fxpar ``zero=0`` and DDP.

The elementwise optimizers below compute each parameter's update from that parameter's own gradient
and state only. Where a parameter, its gradient and every state tensor share one mesh and placements,
the update of the whole tensor restricted to this rank's shard is the update of the shard: the local
op DTensor would have dispatched to. So fxpar runs the optimizer's math on the local tensors:

* Parameters, gradients and state stay DTensors everywhere the user can see them (``param_groups``,
  ``state``, ``state_dict()``, hooks); state is created as DTensors by the optimizer's own first step.
* Only the flat lists an optimizer's ``_init_group`` hands its functional kernel (``adam(...)``,
  ``rmsprop(...)``) are swapped for the DTensors' local tensors, which the kernel updates in place.
* A call is swapped only if every parameter in it is one fxpar placed (``own_parameter``), every other
  DTensor in it has the placements, mesh and shape of its parameter, and no state entry is still
  missing; otherwise it runs as usual (another library's DTensors are left to DTensor).
  ``torch.compile``'d steps run as usual too, and ``FXPAR_LOCAL_OPTIMIZER=0`` turns this off.

Results are bitwise the DTensor path's: the same local ops on the same local tensors.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

LOCAL_OPTIMIZER_ENV = "FXPAR_LOCAL_OPTIMIZER"  # "0": every optimizer step dispatches through DTensor

# Optimizers whose update is elementwise per parameter and whose ``step`` keeps no reference to the lists
# ``_init_group`` fills (SGD is left out: its step writes new momentum buffers back into ``state`` by the
# list's tensors).
ELEMENTWISE: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam,
    torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop,
)

_OWNED = "_fxpar_local_step"  # set on the parameters fxpar places (a flag: a tensor's ``==`` is elementwise)
_hook: Any = None


def enabled() -> bool:
    return os.environ.get(LOCAL_OPTIMIZER_ENV, "1") != "0"


def own_parameter(param: torch.nn.Parameter) -> None:
    """Mark ``param`` as one of fxpar's, and make sure optimizers are watched (once per process).

    Requires: ``param`` is a DTensor parameter fxpar placed. Ensures: the next step of any optimizer of an
    ``ELEMENTWISE`` class over such parameters computes on their local shards (see the module docstring)."""
    global _hook
    setattr(param, _OWNED, True)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_watch)


def _watch(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global step pre-hook: give an elementwise optimizer the localizing ``_init_group`` (once per instance)."""
    if torch.compiler.is_compiling() or type(opt) not in ELEMENTWISE or "_init_group" in vars(opt):
        return
    opt._init_group = _LocalizingInitGroup(opt)  # type: ignore[method-assign]


class _LocalizingInitGroup:
    """``opt._init_group``: the class's own, then its lists' DTensors swapped for their local tensors where safe.

    (An instance attribute holding a weak reference: ``Optimizer.__getstate__`` leaves it out of pickles and
    deep copies, and it keeps no optimizer alive.)"""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._opt = weakref.ref(opt)

    def __call__(self, group: dict[str, Any], *lists: Any) -> Any:
        opt = self._opt()
        assert opt is not None
        out = type(opt)._init_group(opt, group, *lists)
        if enabled() and not torch.compiler.is_compiling() and not group.get("differentiable", False) \
                and _localizable(lists):
            for tensors in lists:
                tensors[:] = [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]
        return out


def _localizable(lists: tuple[Any, ...]) -> bool:
    """Whether ``lists`` (parameters first, then parallel lists of gradients and state) hold only fxpar's
    parameters, and every other DTensor in them is laid out exactly as its parameter, with nothing missing."""
    params = lists[0]
    if not params or not all(isinstance(p, DTensor) and getattr(p, _OWNED, False) for p in params):
        return False
    for tensors in lists[1:]:
        if any(t is None for t in tensors):  # a state the kernel would create (it would be a plain tensor)
            return False
        dtensors = [t for t in tensors if isinstance(t, DTensor)]
        if not dtensors:
            continue
        if len(tensors) != len(params):
            return False
        for p, t in zip(params, tensors, strict=True):
            if isinstance(t, DTensor) and not _same_layout(p, t):
                return False
    return True


def _same_layout(p: DTensor, t: DTensor) -> bool:
    return t.device_mesh is p.device_mesh and t.placements == p.placements and t.shape == p.shape \
        and t._local_tensor.shape == p._local_tensor.shape
