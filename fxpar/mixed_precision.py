"""Mixed precision with FSDP2's ``MixedPrecisionPolicy`` semantics, applied where the model is traced.

``Plan(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``: parameters (the master weights) and
optimizer state keep their own dtype; every module that owns floating parameters runs its ``forward``
on copies of them cast to ``param_dtype``, and the root casts its floating tensor inputs too (FSDP2's
``cast_forward_inputs``). The backward of each cast hands the gradient back in the parameter's dtype,
where the batch axes reduce it in ``reduce_dtype`` (``fxpar.lower.grads``).

The casts are made while the model is traced, not by rewriting a float32 graph afterwards: a model's
own code branches on dtypes (an RMSNorm computes in float32 and casts back to its input's dtype, an
attention mask is built in the query's dtype), and only a trace in ``param_dtype`` records what the
model does in it. Each cast sits inside the module that owns the parameter, so its provenance, its
pipeline stage and its repeated block are that module's; under ZeRO-3 ``gather_casts`` runs it on the
dp shard, so the all-gather moves ``param_dtype`` bytes. ``computing_in`` is also what a single-device
reference runs, so equivalence compares the same arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.utils._pytree as pytree


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
    try:
        for module in model.modules():
            names = [n for n, p in module._parameters.items()
                     if p is not None and p.is_floating_point() and p.dtype != param_dtype]
            root = module is model
            if root or any(p.is_floating_point() for p in module.parameters()):
                had = "forward" in module.__dict__
                module.forward = _casting_forward(module, module.forward, names, param_dtype, root, scope)
                patched.append((module, had))
        yield
    finally:
        for module, had in reversed(patched):
            if had:
                module.forward = module.forward.original  # type: ignore[attr-defined]
            else:
                del module.forward


class _CastOnRead(dict):
    """A module's parameters while a casting forward runs: a floating one read by other code than the module's own
    ``forward`` (``nn.MultiheadAttention`` passes ``out_proj.weight`` to its functional form, a tied head reads the
    embedding's weight) is read cast to ``dtype``, once per outermost call, as FSDP2 hands every module of a unit
    its parameters in ``param_dtype``. The module's own forward stores its cast copies here itself."""

    def __init__(self, params: dict[str, Any], dtype: torch.dtype, made: dict[tuple[int, str], Any]) -> None:
        super().__init__(params)
        self.dtype, self.made = dtype, made

    def __getitem__(self, name: str) -> Any:
        p = dict.__getitem__(self, name)
        if p is None or not p.is_floating_point() or p.dtype == self.dtype:
            return p
        key = (id(self), name)
        if key not in self.made or self.made[key][0] is not p:
            self.made[key] = (p, p.to(self.dtype))
        return self.made[key][1]


class _CastScope:
    """While the outermost casting forward of ``model`` runs, every module's ``_parameters`` is a ``_CastOnRead``."""

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
        made: dict[tuple[int, str], Any] = {}
        swapped = [(m, m.__dict__["_parameters"]) for m in self.model.modules() if m._parameters]
        for m, params in swapped:
            m.__dict__["_parameters"] = _CastOnRead(params, self.dtype, made)
        self.depth = 1
        try:
            yield
        finally:
            self.depth = 0
            for m, params in swapped:
                m.__dict__["_parameters"] = params


def raw_parameter(module: torch.nn.Module, path: str) -> torch.nn.Parameter:
    """``module.get_parameter(path)`` as stored, not as a casting forward hands it to the model's code."""
    *owner, name = path.split(".")
    sub = module.get_submodule(".".join(owner))
    return dict.__getitem__(sub._parameters, name)


def _casting_forward(module: torch.nn.Module, forward: Callable[..., Any], names: list[str], dtype: torch.dtype,
                     cast_inputs: bool, scope: _CastScope) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        if cast_inputs:
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: _cast_input(t, dtype), (args, kwargs))
        with scope.entered():
            params = module._parameters
            saved = {n: dict.__getitem__(params, n) for n in names}
            try:
                for n, p in saved.items():
                    params[n] = p.to(dtype)  # a plain tensor: the module reads it as its parameter
                return forward(*args, **kwargs)
            finally:
                params.update(saved)

    call.original = forward  # type: ignore[attr-defined]
    call.cast_key = (tuple(names), dtype, cast_inputs)  # type: ignore[attr-defined]  # all the closure depends on
    return call


def _cast_input(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t
