"""Hand-written PyTorch DTensor tensor-parallel baseline that fxpar is compared against.

Run as two gloo ranks on CPU::

    torchrun --standalone --nproc_per_node 2 bench/dtensor_baseline.py
"""

from __future__ import annotations

import copy
import fnmatch
import os
import sys
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}

# Canonical kind names for funcol / c10d collective op names.
_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "broadcast": "broadcast",
    "broadcast_": "broadcast",
}


def _kind(func: Any) -> str:
    name = func._overloadpacket.__name__
    return _KINDS.get(name, name)


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class _ModuleTracker(_CommModeModuleTracker):
    """CommDebugMode's module tracker, fixed for a module called more than once per forward.

    The stock tracker registers one more forward hook on a module at each of its calls, so a module
    called twice in one forward (the bundled Llama's ``Block.drop``, an ``nn.Identity`` applied to both
    residual branches) pops the parent stack too often and raises ``IndexError``. Here the module's
    previous hook is removed before the new one is registered.
    """

    def _fw_pre_hook(self, mod: nn.Module, input: Any) -> None:
        old = self.register_forward_hook_handles.get(self._get_mod_name(mod))
        if old is not None:
            old.remove()
        super()._fw_pre_hook(mod, input)


class _ByteCountingCommMode(CommDebugMode):
    """CommDebugMode that also sums, per collective kind, the bytes of the tensors handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.advanced_module_tracker = _ModuleTracker()
        self.comm_bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and self.get_total_counts() > before:
            self.comm_bytes[_kind(func)] += _nbytes(args[0]) if args else 0
        return out


def dtensor_megatron(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> nn.Module:
    """Apply a Megatron plan with ``parallelize_module``, in place, and return ``model``.

    ``plan`` maps module-path globs (e.g. ``"layers.*.attn.q"``) to ``"colwise"`` or ``"rowwise"``;
    globs are expanded with :mod:`fnmatch` over ``model.named_modules()``. Colwise outputs stay
    sharded as local tensors, so attention must derive its head count from the projected tensor
    (``view(b, s, -1, head_dim)``), as the bundled Llama and HF Llama both do.
    """
    concrete: dict[str, Any] = {}
    for name, _ in model.named_modules():
        for glob, style in plan.items():
            if name and fnmatch.fnmatchcase(name, glob):
                concrete[name] = _STYLES[style]()
                break
    unmatched = [g for g in plan if not any(fnmatch.fnmatchcase(n, g) for n in concrete)]
    if unmatched:
        raise ValueError(f"plan globs matched no module: {unmatched}")
    parallelize_module(model, tp_mesh, concrete)
    return model


def count_collectives(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn()`` under ``CommDebugMode`` and count the collectives it issues on this rank.

    Returns ``{"all_reduce": n, "all_gather": n, "reduce_scatter": n, <other kinds>: n,
    "total": n, "bytes": {kind: b}}``. ``CommDebugMode`` only counts ops, so the bytes come from
    a subclass that adds up the size of each collective's input tensor(s), i.e. the per-rank
    payload handed to the collective (for all_gather that is the local shard, not the result).
    """
    mode = _ByteCountingCommMode()
    with mode, warnings.catch_warnings():
        # CommDebugMode's module tracker installs full backward hooks; when only backward is
        # counted, their inputs do not require grad and torch warns harmlessly about it.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        fn()
    counts: dict[str, Any] = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    for op, n in mode.get_comm_counts().items():
        kind = _KINDS.get(op.__name__, op.__name__)
        counts[kind] = counts.get(kind, 0) + n
    counts["total"] = mode.get_total_counts()
    counts["bytes"] = dict(mode.comm_bytes)
    return counts


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fxpar.models.llama import Llama, LlamaConfig, llama_plan

    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    rank = dist.get_rank()

    torch.manual_seed(0)  # identical init on every rank
    cfg = LlamaConfig(n_layers=4)
    reference = Llama(cfg)
    model = dtensor_megatron(copy.deepcopy(reference), mesh, llama_plan())
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    ref_loss = reference(tokens).float().pow(2).mean()
    ref_loss.backward()
    state: dict[str, torch.Tensor] = {}

    def forward() -> None:
        state["loss"] = model(tokens).float().pow(2).mean()

    fwd = count_collectives(forward)
    bwd = count_collectives(lambda: state["loss"].backward())
    if rank == 0:
        per_layer = (fwd["all_reduce"] + bwd["all_reduce"]) / cfg.n_layers
        err = (state["loss"] - ref_loss).abs().item()
        gerr = (model.embed.weight.grad - reference.embed.weight.grad).abs().max().item()
        print(
            f"tp={world} n_layers={cfg.n_layers} loss={state['loss'].item():.6f} "
            f"|loss-ref|={err:.2e} max|embed.grad-ref|={gerr:.2e}"
        )
        print(f"forward : {fwd}")
        print(f"backward: {bwd}")
        print(f"all_reduce per layer: {per_layer:g}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
