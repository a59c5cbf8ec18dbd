"""Eager rank graphs call each op's C++ entry point, bound once, instead of looking it up on every call.

An FX ``GraphModule``'s code calls ``torch.ops.aten.mm.default(x, w)``: four attribute lookups, then
``OpOverload.__call__``, a Python frame whose whole body is ``return self._op(*args, **kwargs)``. A decoder's rank
graph makes a few hundred such calls a microbatch, and at small microbatches their Python time is a visible share
of a step (bench/README.md section 14). ``direct_calls(gm)`` runs the same generated code with each
``torch.ops.<namespace>.<op>.<overload>`` bound to that overload's ``_op``: the same kernels, arguments and order.
``FXPAR_DIRECT_CALLS=0`` runs the ``GraphModule`` as it is, but for ``overrides``: ops bound to another
implementation of the same semantics (gloo's collectives through the classic API, ``fxpar.backends.classic``).

One op is always bound to a function of its own: ``aten.view`` copies (``reshape``) where the real tensor's strides
do not allow the view. The graphs were traced on fake tensors, and a few CPU kernels lay their outputs out
otherwise than their fake implementation says (eval-mode ``BatchNorm1d`` on a transposed ``[b, c, s]`` activation:
a contiguous output where the fake one keeps the input's strides), so a ``view`` the trace proved valid fails
when it runs ("view size is not compatible"); ``torch.compile(backend="aot_eager")`` fails the same way on the
single device. The values are the same either way.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch._ops import OpOverload

DIRECT_CALLS_ENV = "FXPAR_DIRECT_CALLS"
_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")
_VIEW, _RESHAPE = torch.ops.aten.view.default._op, torch.ops.aten.reshape.default._op


def view_or_copy(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """``x.view(shape)``, or ``x.reshape(shape)`` where ``x``'s real strides do not allow a view (see above)."""
    try:
        return _VIEW(x, shape)
    except RuntimeError:
        return _RESHAPE(x, shape)


def direct_calls(gm: fx.GraphModule, overrides: Mapping[OpOverload, Callable[..., Any]] | None = None
                 ) -> Callable[..., Any]:
    """``gm``'s forward with every op call bound to the op's C++ entry point, or to ``overrides[op]`` (a function
    that returns what ``op`` returns); ``gm`` itself when turned off and nothing is overridden.

    Ensures: the callable returns what ``gm(*args)`` returns; ``.graph_module`` is ``gm``, and an edit of ``gm``'s
    graph followed by ``gm.recompile()`` (fault-injection tests do this) is what the next call runs.
    """
    direct = os.environ.get(DIRECT_CALLS_ENV, "1") != "0"
    overrides = dict(overrides or {})
    if not direct and not overrides:
        return gm
    overrides.setdefault(torch.ops.aten.view.default, view_or_copy)
    state: dict[str, Any] = {"code": None, "forward": None}

    def run(*args: Any) -> Any:
        code = gm.code
        if code is not state["code"]:  # first call, or recompiled since
            state["code"], state["forward"] = code, _bound_forward(gm, code, overrides, direct)
        return state["forward"](gm, *args)

    run.graph_module = gm  # type: ignore[attr-defined]
    return run


def _bound_forward(gm: fx.GraphModule, code: str, overrides: Mapping[OpOverload, Callable[..., Any]],
                   direct: bool) -> Callable[..., Any]:
    bound: dict[str, Any] = {}

    def bind(m: re.Match[str]) -> str:
        name = "_op_" + "_".join(m.groups())
        if name not in bound:
            namespace, op, overload = m.groups()
            target = getattr(getattr(getattr(torch.ops, namespace), op), overload)
            if target not in overrides and not direct:
                return m.group(0)
            bound[name] = overrides.get(target) or target._op
        return name + "("

    source = _CALL.sub(bind, code)
    scope = {**gm.forward.__globals__, **bound}
    exec(compile(source, f"<fxpar direct calls {id(gm):x}>", "exec"), scope)  # noqa: S102 - gm's own code
    return scope["forward"]
