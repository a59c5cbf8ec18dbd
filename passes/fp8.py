"""fp8: run Linear matmuls (forward, input gradient, weight gradient) as ``torch._scaled_mm`` on float8."""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from fxpar.errors import FxparWarning, PlanError, close_matches
from fxpar.ir import Program, Provenance, graph_module
from fxpar.modules import ModuleTable
from fxpar.pass_context import Context

aten = torch.ops.aten
RECIPES = ("tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: torch.finfo(E4M3).max, E5M2: torch.finfo(E5M2).max}
EPS = 1e-12  # torchao's floor on amax: an all-zero tensor gets a finite scale
LAYOUT = {aten.t.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def fp8(prog: Program, ctx: Context) -> Program:
    """Replace every ``mm`` of the chosen ``nn.Linear`` modules in the joint graph by a float8 ``_scaled_mm``.

    Requires: the captured joint Program (``addmm`` already split into ``mm`` + ``add``); ``ctx.plan.fp8``
    is ``None``, a recipe (``"tensorwise"``, ``"rowwise"``: every Linear whose in and out features are
    multiples of 16) or ``{module glob: recipe}`` (each glob must match Linears with such dims).
    Ensures: each of the module's matmuls (the forward, the input gradient, the weight gradient) becomes
    ``_scaled_mm(cast(a), cast(b), 1 / scale_a, 1 / scale_b)`` out in the matmul's dtype (fp32; under mixed
    precision ``param_dtype``, with the scales still fp32), with dynamic scales
    ``scale = fp8_max / amax`` (torchao's recipes): activations and weights in e4m3, gradients in e5m2.
    ``tensorwise``: one scale per operand, the amax over the whole (global) tensor, so a sharded operand's
    amax is a max over its shards (propagation makes it a ``Partial("max")``, lowered as a one-scalar max
    all-reduce) and tensor-parallel FP8 computes what single-device FP8 computes. ``rowwise``: one scale
    per row of ``a`` and per column of ``b``, each the amax along the contracting dim (no communication
    unless that dim is sharded). ``notes["fp8"]`` = ``{module: recipe}``. Without ``plan.fp8`` the
    Program is unchanged.
    """
    if ctx.plan.fp8 is None:
        return prog
    chosen = choose_modules(ctx.modules, ctx.plan.fp8)
    gm = graph_module(prog.gm, _copy(prog.graph))  # rewrite a copy: the input Program's graph stays as it was
    provenance = dict(prog.provenance)
    weights = _weight_nodes(prog, gm.graph)
    mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    for node in list(gm.graph.nodes):
        prov = provenance.get(node.name)
        if node.target is aten.mm.default and prov is not None and prov.module in chosen:
            _rewrite(gm.graph, node, chosen[prov.module], weights, provenance, mode)
    gm.graph.lint()
    gm.recompile()
    return prog.replace("fp8", gm=gm, provenance=provenance, notes={**prog.notes, "fp8": chosen})


def _copy(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` with the same node names and metadata (``node_copy`` keeps both)."""
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        env[n] = out.node_copy(n, lambda a: env[a])
    return out


def choose_modules(table: ModuleTable, spec: str | dict[str, str]) -> dict[str, str]:
    """``{module path: recipe}`` for a recipe name or a ``{glob: recipe}`` dict; clear errors for the rest."""
    modules = table.modules
    linears = table.of_kind("linear")
    if isinstance(spec, str):
        _check_recipe(spec, "fp8")
        if not linears:
            raise PlanError(f"fp8={spec!r}: the model has no nn.Linear, and fp8 runs only nn.Linear matmuls (as "
                            "torch._scaled_mm); leave fp8=None")
        skipped = [f"{p} ({m.in_features} x {m.out_features})" for p, m in linears.items() if not _fits(m)]
        if skipped:
            warnings.warn(f"fxpar: fp8 skips Linears whose dims are not multiples of 16: {', '.join(skipped)}",
                          FxparWarning, stacklevel=2)
        return {p: spec for p, m in linears.items() if _fits(m)}
    if not isinstance(spec, dict):
        raise PlanError(f"fp8 must be None, a recipe in {RECIPES} or a dict of module globs to recipes, got {spec!r}")
    chosen: dict[str, str] = {}
    for glob, recipe in spec.items():
        _check_recipe(recipe, f"fp8[{glob!r}]")
        matched = [p for p in modules if p and fnmatch.fnmatchcase(p, glob)]
        if not matched:
            hint = close_matches(glob, list(linears)) or close_matches(glob.replace("*", "0"), list(linears))
            raise PlanError(f"fp8[{glob!r}] matches no module of the model"
                            + (f"; did you mean: {', '.join(hint)}?" if hint else ""))
        for path in matched:
            mod = modules[path]
            if mod.kind != "linear":
                raise PlanError(f"fp8[{glob!r}]: module {path!r} is a {mod.type_name}, which has no fp8 path "
                                "(fp8 runs nn.Linear matmuls as torch._scaled_mm)")
            if not _fits(mod):
                raise PlanError(f"fp8[{glob!r}]: Linear {path!r} is {mod.in_features} -> {mod.out_features}; "
                                "torch._scaled_mm needs both dims to be multiples of 16")
            chosen[path] = recipe
    return chosen


def _check_recipe(recipe: object, where: str) -> None:
    if recipe not in RECIPES:
        raise PlanError(f"{where} = {recipe!r}: the recipe must be one of {RECIPES}")


def _fits(m: torch.nn.Linear) -> bool:
    return m.in_features % 16 == 0 and m.out_features % 16 == 0


def _weight_nodes(prog: Program, graph: fx.Graph) -> set[fx.Node]:
    names = {name for _, name in prog.signature.params}
    return {n for n in graph.nodes if n.name in names}


def _root(n: fx.Node) -> fx.Node:
    while n.target in LAYOUT:
        n = n.args[0]
    return n


def _dtype(operand: fx.Node, weights: set[fx.Node], provenance: dict[str, Provenance]) -> torch.dtype:
    """e4m3 for a weight or a forward activation (through transposes and views), e5m2 for a gradient."""
    root = _root(operand)
    prov = provenance.get(root.name)
    return E4M3 if root in weights or (prov is not None and prov.phase != "bwd") else E5M2


def _rewrite(graph: fx.Graph, mm: fx.Node, recipe: str, weights: set[fx.Node], provenance: dict[str, Provenance],
             mode: object) -> None:
    a, b = mm.args
    prov = provenance[mm.name]

    def emit(target: Callable, *args: object, **kwargs: object) -> fx.Node:
        node = graph.call_function(target, args, kwargs)
        vals = [x.meta["val"] if isinstance(x, fx.Node) else x for x in args]
        with mode:
            node.meta["val"] = target(*vals, **kwargs)
        provenance[node.name] = prov
        return node

    with graph.inserting_before(mm):
        start = mm.prev
        a8, a_inv = _cast(emit, a, _dtype(a, weights, provenance), dims=[1] if recipe == "rowwise" else [0, 1])
        # CUDA's _scaled_mm takes a row-major and b column-major (CPU takes any layout)
        if not a8.meta["val"].is_contiguous():
            a8 = emit(aten.clone.default, a8, memory_format=torch.contiguous_format)
        _tag_weight_cast(start, mm, a, weights)
        start = mm.prev
        b8, b_inv = _cast(emit, b, _dtype(b, weights, provenance), dims=[0] if recipe == "rowwise" else [0, 1])
        if b8.meta["val"].stride(0) != 1:
            b8 = emit(aten.t.default, emit(aten.clone.default, emit(aten.t.default, b8),
                                           memory_format=torch.contiguous_format))
        _tag_weight_cast(start, mm, b, weights)
        out = emit(aten._scaled_mm.default, a8, b8, a_inv, b_inv, None, None, mm.meta["val"].dtype)
    mm.replace_all_uses_with(out)
    graph.erase_node(mm)


def _tag_weight_cast(start: fx.Node, end: fx.Node, operand: fx.Node, weights: set[fx.Node]) -> None:
    """Mark the nodes emitted between ``start`` and ``end`` (one operand's cast) with the weight they cast,
    when the operand is a weight: ``fp8_gather`` may then run that cast on a ZeRO-3 shard."""
    root = _root(operand)
    if root not in weights:
        return
    n = start.next
    while n is not end:
        n.meta["fp8_weight"] = root.name
        n = n.next


def _cast(op: Callable, x: Any, dtype: torch.dtype, dims: list[int]) -> tuple[Any, Any]:
    """``x`` scaled into ``dtype``'s range and cast, and the inverse scale ``_scaled_mm`` multiplies back.
    ``dims``: the dims the amax reduces (both: tensorwise; the contracting one, kept: rowwise). ``op(target,
    *args)`` applies an aten op: eagerly (``quantize``) or by emitting a graph node (the pass)."""
    amax = op(aten.amax.default, op(aten.abs.default, x), dims, len(dims) == 1)
    if _dtype_of(x) != torch.float32:  # mixed precision: scales are float32 (what _scaled_mm takes)
        amax = op(aten._to_copy.default, amax, dtype=torch.float32)
    inverse = op(aten.div.Tensor, op(aten.clamp_min.default, amax, EPS), FP8_MAX[dtype])  # amax / fp8_max
    scaled = op(aten.clamp.default, op(aten.mul.Tensor, x, op(aten.reciprocal.default, inverse)),
                -FP8_MAX[dtype], FP8_MAX[dtype])
    return op(aten._to_copy.default, scaled, dtype=dtype), inverse


def _dtype_of(x: Any) -> torch.dtype:
    return x.meta["val"].dtype if isinstance(x, fx.Node) else x.dtype


def quantize(x: torch.Tensor, dtype: torch.dtype, dims: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The pass's cast, run eagerly on ``x``: ``(x8, inverse_scale)``, so ``x8.float() * inverse ~= x``."""
    return _cast(lambda target, *args, **kwargs: target(*args, **kwargs), x, dtype, dims)
