"""Mixed precision with FSDP2's ``MixedPrecisionPolicy`` semantics, applied where the model is traced.

``Plan(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: parameters (the master weights) and
optimizer state keep their own dtype; every module that owns floating parameters runs its ``forward``
on copies of them cast to ``param_dtype``, and the root and every repeated block (FSDP2's units under a
``fully_shard`` per block) cast their floating tensor inputs too (FSDP2's ``cast_forward_inputs``). So does every
module that owns floating parameters, where FSDP2 would not: a float32 buffer added to the stream (a sinusoidal
position table) promotes the stream to float32, and the next ``Linear`` would meet its bf16 weight with a float32
input (torch refuses the matmul; under FSDP2 such a model fails at its first step). Where a module's input is
already in ``param_dtype`` the cast is no op and leaves no node. The backward of each cast hands the gradient back
in the parameter's dtype, where the batch axes reduce it in ``reduce_dtype`` (``fxpar.lower.grads``).

The casts are made while the model is traced, not by rewriting a float32 graph afterwards: a model's
own code branches on dtypes (an RMSNorm computes in float32 and casts back to its input's dtype, an
attention mask is built in the query's dtype), and only a trace in ``param_dtype`` records what the
model does in it. Each cast sits inside the module that owns the parameter, so its provenance, its
pipeline stage and its repeated block are that module's; under ZeRO-3 ``gather_casts`` runs it on the
dp shard, so the all-gather moves ``param_dtype`` bytes. ``computing_in`` is also what a single-device
reference runs, so equivalence compares the same arithmetic.

Batch normalization (``BatchNorm1d/2d/3d``, ``SyncBatchNorm``, ``InstanceNorm``: torch's ``_NormBase`` modules) keeps
its parameters, running statistics and arithmetic in their own dtype: its input is cast up to it and its output
back to ``param_dtype`` (apex AMP's ``keep_batchnorm_fp32``). Its statistics are sums over the batch that bf16
cannot hold, and torch's kernels refuse a bf16 weight beside float32 running statistics (FSDP2 users wrap such
modules in a float32 policy of their own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.nn.modules.batchnorm import _NormBase

from fxpar.structure import structure_of


@contextmanager
def computing_in(model: torch.nn.Module, param_dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: ``model`` computes in ``param_dtype`` (see the module docstring); nothing changes for ``None``.

    Requires: the model is not being run by another thread. Ensures: on exit every patched ``forward`` is
    the one it was (the model's parameters are never replaced outside a call).
    """
    if param_dtype is None:
        yield
        return
    patched: list[tuple[torch.nn.Module, bool]] = []
    scope = _CastScope(model, param_dtype)
    units = _fsdp_units(model)
    try:
        for module in model.modules():
            if isinstance(module, _NormBase):
                had = "forward" in module.__dict__
                module.forward = _own_dtype_forward(module, module.forward, param_dtype)
                patched.append((module, had))
                continue
            names = [n for n, p in module._parameters.items()
                     if p is not None and p.is_floating_point() and p.dtype != param_dtype]
            owns = any(p is not None and p.is_floating_point() for p in module._parameters.values())
            cast_inputs = module is model or id(module) in units or owns
            if cast_inputs or any(p.is_floating_point() for p in module.parameters()):
                had = "forward" in module.__dict__
                module.forward = _casting_forward(module, module.forward, names, param_dtype, cast_inputs, scope)
                patched.append((module, had))
        yield
    finally:
        for module, had in reversed(patched):
            if had:
                module.forward = module.forward.original  # type: ignore[attr-defined]
            else:
                del module.forward


def _fsdp_units(model: torch.nn.Module) -> set[int]:
    """The modules FSDP2 users ``fully_shard`` besides the root, whose floating inputs it casts: the entries of a
    list of alike modules (``nn.ModuleList``, ``nn.Sequential``, ``nn.ModuleDict``; same class and parameter
    shapes), the repeated blocks."""
    units: set[int] = set()
    for container in model.modules():
        if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)):
            kids = list(container.children())
            keys = [structure_of(k) for k in kids]
            units.update(id(k) for k, key in zip(kids, keys, strict=True) if keys.count(key) > 1)
    return units


class _CastScope:
    """While the outermost casting forward of ``model`` runs, a floating parameter read by other code than its
    module's own ``forward`` reads cast to ``dtype``, once per outermost call: ``nn.MultiheadAttention`` hands its
    child ``out_proj``'s weight to its functional form without calling ``out_proj``; a hand-tied head reads the
    embedding's weight. FSDP2 hands every module of a unit its parameters in ``param_dtype`` alike. Each module
    reads through a subclass of its class with the same names (``_cast_reading``), as
    ``fxpar.blocks.recording_reads`` records reads; a module's own forward stores its cast copies itself."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype, self.depth = model, dtype, 0

    @contextmanager
    def entered(self) -> Iterator[None]:
        if self.depth:
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
            return
        made: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        # every module, not only those holding parameters now: a repeated block's are off it while the model is
        # exported (``fxpar.taken_off``) and back on while its code runs
        swapped = [(m, type(m)) for m in self.model.modules() if not isinstance(m, _NormBase)]
        self.depth = 1
        try:
            for m, cls in swapped:
                m.__class__ = _cast_reading(cls)
                m.__dict__[_CAST] = (self.dtype, made)
            yield
        finally:
            self.depth = 0
            for m, cls in swapped:
                m.__class__ = cls
                m.__dict__.pop(_CAST, None)


_CAST = "_fxpar_cast"
_CAST_READING: dict[type, type] = {}


def _cast_reading(cls: type) -> type:
    if cls not in _CAST_READING:
        def __getattr__(self: Any, name: str) -> Any:  # noqa: N807
            value = cls.__getattr__(self, name)
            dtype, made = self.__dict__[_CAST]
            if (not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == dtype
                    or self.__dict__["_parameters"].get(name) is not value):
                return value  # not a parameter, or already the forward's cast copy
            key = (id(self), name)
            if key not in made or made[key][0] is not value:
                made[key] = (value, value.to(dtype))
            return made[key][1]

        _CAST_READING[cls] = type(cls.__name__, (cls,), {"__getattr__": __getattr__, "__module__": cls.__module__,
                                                         "__qualname__": cls.__qualname__})
    return _CAST_READING[cls]


def raw_parameter(module: torch.nn.Module, path: str) -> torch.nn.Parameter:
    """``module.get_parameter(path)`` as stored, not as a casting forward hands it to the model's code."""
    *owner, name = path.split(".")
    return module.get_submodule(".".join(owner))._parameters[name]


def _casting_forward(module: torch.nn.Module, forward: Callable[..., Any], names: list[str], dtype: torch.dtype,
                     cast_inputs: bool, scope: _CastScope) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if cast_inputs:
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: _cast_input(t, dtype), (args, kwargs))
        with scope.entered():
            params = module._parameters
            saved = {n: params[n] for n in names}
            try:
                for n, p in saved.items():
                    params[n] = p.to(dtype)  # a plain tensor: the module reads it as its parameter
                return forward(*args, **kwargs)
            finally:
                params.update(saved)

    call.original = forward  # type: ignore[attr-defined]
    call.cast_key = (tuple(names), dtype, cast_inputs)  # type: ignore[attr-defined]  # all the closure depends on
    return call


def _own_dtype_forward(module: torch.nn.Module, forward: Callable[..., Any], dtype: torch.dtype) -> Callable[..., Any]:
    """A batch norm's ``forward`` in the dtype of its own tensors: floating inputs cast up to it, floating outputs
    back to ``dtype`` (the module docstring)."""
    own = next((t.dtype for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
                if t.is_floating_point()), None)

    def call(*args: Any, **kwargs: Any) -> Any:
        if own is None:
            return forward(*args, **kwargs)
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: _cast_input(t, own), (args, kwargs))
        return pytree.tree_map_only(torch.Tensor, lambda t: _cast_input(t, dtype), forward(*args, **kwargs))

    call.original = forward  # type: ignore[attr-defined]
    call.cast_key = ("own dtype", own, dtype)  # type: ignore[attr-defined]
    return call


def _cast_input(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
