"""Captured programs reused where the caller vouches that the model stays the same.

Capture (``torch.export`` on fake tensors, then the joint forward+backward graph) is most of a compile,
and it reads only the model's code and structure, the example inputs' pytree, shapes and dtypes, and a
few things of the mesh and plan: the device, whether there is an ``ep`` axis of a given size (experts
run as one op) or a ``cp`` axis (tokens kept un-flattened), ``param_dtype``, and for pipelines where the
stages start. The plan's tp styles, ZeRO level, recompute, fp8 and the dp and tp sizes are the passes'
business. So a planner that compiles tens of candidate plans of one model, or a test suite that
compiles one model under many meshes, need capture it only once per distinct key.

Nothing is reused outside a ``CaptureMemo.vouching(model, key)`` scope, and only for that very model
object: a model may change between two ``fxpar.parallelize`` calls (its code, a config attribute, a
global flag it reads) in ways no key can see, so ``parallelize`` alone captures afresh every time.
``key`` names what the model is (the planner uses the object itself; the equivalence harness the pickled
``model_fn``, which builds the same model every time). Programs are never edited in place
(``fxpar.ir``), so a reused one is shared as is, with the caller's mesh put in.
"""

from __future__ import annotations

import contextvars
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from fxpar.blocks import share_min, sharing_enabled
from fxpar.mesh import Mesh
from fxpar.split import CONTEXT_AXIS

T = TypeVar("T")


@dataclass(frozen=True)
class _Scope:
    memo: CaptureMemo
    model: torch.nn.Module
    key: Hashable


_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("fxpar_capture_memo", default=None)


class CaptureMemo:
    """Captures by (model key, what capture reads of the inputs, mesh and plan), the ``size`` latest kept."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._kept: OrderedDict[Hashable, Any] = OrderedDict()

    @contextmanager
    def vouching(self, model: torch.nn.Module, key: Hashable | None = None) -> Iterator[None]:
        """Within the scope, captures of ``model`` (this object) are looked up by ``key`` (default: the object
        itself, kept alive by the memo while its entries are) before they are traced."""
        token = _ACTIVE.set(_Scope(self, model, model if key is None else key))
        try:
            yield
        finally:
            _ACTIVE.reset(token)

    def _get_or_build(self, key: Hashable, build: Callable[[], T]) -> T:
        if key in self._kept:
            self.hits += 1
            self._kept.move_to_end(key)
            return self._kept[key]
        self.misses += 1
        value = build()  # an error is raised as usual and nothing is kept
        self._kept[key] = value
        while len(self._kept) > self.size:
            self._kept.popitem(last=False)
        return value


@contextmanager
def one_call(model: torch.nn.Module) -> Iterator[None]:
    """For the duration of one call that may compile ``model`` several times (``parallelize`` with a plan search,
    the search's candidates): captures are shared by key, the model object itself. Nested calls share the
    outer call's memo."""
    scope = _ACTIVE.get()
    if scope is not None and scope.model is model:
        yield
        return
    with CaptureMemo().vouching(model):
        yield


def reused(model: torch.nn.Module, what: Hashable, mesh: Mesh, inputs: Any, param_dtype: torch.dtype | None,
           build: Callable[[], T]) -> T:
    """``build()``, or what it returned before for the same model key and capture key, when a scope vouches for
    ``model``; ``what`` adds what else the capture depends on (the input kind, pipeline stage starts)."""
    scope = _ACTIVE.get()
    if scope is None or scope.model is not model:
        return build()
    modes = tuple(m.training for m in model.modules())  # a module's mode changes its graph (``fxpar.modes``)
    return scope.memo._get_or_build((scope.key, what, modes, capture_key(mesh, inputs, param_dtype)), build)


def capture_key(mesh: Mesh, inputs: Any, param_dtype: torch.dtype | None) -> Hashable:
    """Everything of the mesh, inputs and plan that capture reads (module docstring), as a hashable value."""
    leaves, spec = pytree.tree_flatten(inputs)
    metas = tuple(_meta(x) for x in leaves)
    return (mesh.device, mesh.axes.get("ep", 1), mesh.axes.get(CONTEXT_AXIS, 1) > 1, str(param_dtype), str(spec),
            metas, sharing_enabled(), share_min(), torch.is_grad_enabled(), str(torch.get_default_dtype()))


def _meta(x: Any) -> Hashable:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), str(x.dtype), x.device.type, x.requires_grad,
                isinstance(x, torch.nn.Parameter))
    return ("value", type(x).__qualname__, repr(x))
