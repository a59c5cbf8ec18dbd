"""Eager rank graphs call each op's C++ entry point, bound once, instead of looking it up on every call.

An FX ``GraphModule``'s code calls ``torch.ops.aten.mm.default(x, w)``: four attribute lookups, then
``OpOverload.__call__``, a Python frame whose whole body is ``return self._op(*args, **kwargs)``. A decoder's rank
graph makes a few hundred such calls a microbatch, and at small microbatches their Python time is a visible share
of a step (bench/README.md section 14). ``direct_calls(gm)`` runs the same generated code with each
``torch.ops.<namespace>.<op>.<overload>`` bound to that overload's ``_op``: the same kernels, arguments and order.
``FXPAR_DIRECT_CALLS=0`` runs the ``GraphModule`` as it is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

DIRECT_CALLS_ENV = "FXPAR_DIRECT_CALLS"
_CALL = re.compile(r"\btorch\.ops\.(\w+)\.(\w+)\.(\w+)\(")


def direct_calls(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s forward with every op call bound to the op's C++ entry point (``gm`` itself when turned off).

    Ensures: the callable returns what ``gm(*args)`` returns; ``.graph_module`` is ``gm``, and an edit of ``gm``'s
    graph followed by ``gm.recompile()`` (fault-injection tests do this) is what the next call runs.
    """
    if os.environ.get(DIRECT_CALLS_ENV, "1") == "0":
        return gm
    state: dict[str, Any] = {"code": None, "forward": None}

    def run(*args: Any) -> Any:
        code = gm.code
        if code is not state["code"]:  # first call, or recompiled since
            state["code"], state["forward"] = code, _bound_forward(gm, code)
        return state["forward"](gm, *args)

    run.graph_module = gm  # type: ignore[attr-defined]
    return run


def _bound_forward(gm: fx.GraphModule, code: str) -> Callable[..., Any]:
    bound: dict[str, Any] = {}

    def bind(m: re.Match[str]) -> str:
        name = "_op_" + "_".join(m.groups())
        if name not in bound:
            namespace, op, overload = m.groups()
            bound[name] = getattr(getattr(getattr(torch.ops, namespace), op), overload)._op
        return name + "("

    source = _CALL.sub(bind, code)
    scope = {**gm.forward.__globals__, **bound}
    exec(compile(source, f"<fxpar direct calls {id(gm):x}>", "exec"), scope)  # noqa: S102 - gm's own code
    return scope["forward"]
