"""``Plan(compile=True)``: each of a rank's graphs compiled by Inductor on its first call.

A rank's forward, backward and step graphs are plain aten graphs whose collectives are c10d functional ops
(``all_gather_into_tensor`` then ``wait_tensor``), bound to the rank's process groups. ``torch.compile`` takes
each one whole (``fullgraph=True``, static shapes): the collectives stay in the compiled graph, where Inductor
keeps their issue/wait split and, on GPU, reorders them against compute. Compilation happens once per graph
and process, on the first call; Inductor's on-disk FX graph cache serves ranks (and later runs) whose graph is
the same. Values are the eager program's up to kernel fusion: Inductor reorders floating-point reductions
inside fused kernels, so results match at the dtype's rounding, not bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils._python_dispatch import _disable_current_modes

from fxpar.errors import InductorError


def compiled_graph(gm: fx.GraphModule, where: str) -> Callable[..., Any]:
    """``gm`` compiled by Inductor on its first call; ``where`` (``"rank 3 stage 0 forward"``) names it in errors.

    Requires: ``gm`` a rank graph (positional tensors in, a tuple out) whose collectives name real process groups.
    Ensures: the callable returns what ``gm`` returns (up to fused reductions' rounding); a compiler failure
    raises ``InductorError`` naming ``where`` and the graph node it stopped at. Compiling runs outside any
    dispatch mode the caller has active (a collective counter sees the compiled graph's calls, not the compiler's).
    """
    state: dict[str, Any] = {}

    def run(*args: Any) -> Any:
        if "fn" not in state:
            state["fn"] = _compile(gm, list(args), where)
        return state["fn"](*args)

    run.graph_module = gm  # type: ignore[attr-defined]
    return run


def compile_fx(gm: fx.GraphModule, args: list[Any]) -> Callable[..., Any]:
    """Inductor's ``compile_fx``, imported on first use: importing ``torch._inductor`` costs every process that
    never compiles (each launched rank, each test worker) about 2 s."""
    from torch._inductor.compile_fx import compile_fx as inductor_compile_fx

    return inductor_compile_fx(gm, args)


def _compile(gm: fx.GraphModule, args: list[Any], where: str) -> Callable[..., Any]:
    if isinstance(gm, _LazyGraphModule):
        _LazyGraphModule.force_recompile(gm)
    try:
        with _disable_current_modes():
            return compile_fx(gm, args)
    except Exception as e:  # noqa: BLE001 - every compiler failure names the graph and node
        raise InductorError(_explain(e, gm, where)) from e


def _explain(e: BaseException, gm: fx.GraphModule, where: str) -> str:
    text = str(e)
    first = next((line for line in text.splitlines() if line.strip()), type(e).__name__)
    node = _node_lowered(e, gm) or _node_named(text, gm)
    at = f"\n  at node {node.name}: {node.format_node()}" if node is not None else ""
    return f"Inductor could not compile {where}: {type(e).__name__}: {first}{at}"


def _node_lowered(e: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The node of ``gm`` whose lowering raised ``e``: Inductor lowers its own retrace of ``gm``, one node at a time
    (``GraphLowering.run_node(n)``, on the failing frame's stack); ``n.meta["from_node"]`` names the node of ``gm``
    it came from. Its messages (``LoweringException``) name only the op and Inductor's buffers."""
    names = {n.name: n for n in gm.graph.nodes}
    lowered = None
    for frame in _frames(e):
        n = frame.f_locals.get("n") if frame.f_code.co_name == "run_node" else None
        if isinstance(n, fx.Node):
            lowered = n  # the innermost one
    sources = list(lowered.meta.get("from_node") or ()) if lowered is not None else []
    while sources:
        source = sources.pop()
        if source.name in names and source.graph_id == id(gm.graph):
            return names[source.name]
        sources.extend(source.from_node or ())
    return None


def _frames(e: BaseException | None) -> Any:
    """Every frame on the tracebacks of ``e`` and the exceptions it was raised from, outermost first."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            yield tb.tb_frame
            tb = tb.tb_next
        e = e.__cause__ or e.__context__


def _node_named(text: str, gm: fx.GraphModule) -> fx.Node | None:
    """The graph node the compiler's message names, if any: the node fx's interpreter was running
    (``While executing %mm_3``, which Inductor's lowering errors end with), else the first node name in the text
    besides the op names of ``target:`` lines (``aten.mm.default`` would name the graph's first ``mm``)."""
    names = {n.name: n for n in gm.graph.nodes}
    executing = re.findall(r"While executing %([A-Za-z_][A-Za-z0-9_]*)", text)
    if executing and executing[-1] in names:
        return names[executing[-1]]
    text = re.sub(r"\b(?:aten|prims|_c10d_functional|c10d|fxpar)\.[\w.]+", " ", text)
    for word in re.findall(r"%?([A-Za-z_][A-Za-z0-9_]*)", text):
        if word in names and names[word].op == "call_function":
            return names[word]
    return None
