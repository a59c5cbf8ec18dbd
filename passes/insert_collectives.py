"""insert_collectives: every placement change becomes an explicit list of collective steps."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.ir import Placements, Program, Step, consumed_tensors
from fxpar.pass_context import Context

aten = torch.ops.aten


def insert_collectives(prog: Program, ctx: Context) -> Program:
    """Map each (node, tensor arg) whose placement must change to its collective steps.

    Requires: ``propagate`` (placements and arg_placements).
    Ensures: ``notes["redistribute"][(consumer, arg position)] = (producer, dst, steps)``; the
    same producer redistributed to the same placement is computed once by ``lower``, and so is a view that
    repeats an earlier one (the same op of the same input: each of q, k and v flattens the same activation):
    its consumers read the earlier view's redistribution, so sequence parallelism gathers it once.
    Raises NotImplementedError for a placement change with two mesh axes sharding one dim.
    """
    plan: dict[tuple[str, int], tuple[str, Placements, tuple[Step, ...]]] = {}
    first_view: dict[tuple[object, ...], str] = {}
    for node in prog.graph.nodes:
        required = prog.arg_placements.get(node.name)
        if required is None:
            continue
        for pos, (arg, dst) in enumerate(zip(consumed_tensors(node), required, strict=True)):
            if arg is None or dst is None:
                continue
            if any(type(p) is Partial and p.reduce_op != "sum" for p in dst):
                raise AssertionError(f"{node.name} would read {arg.name} as {dst}: only a sum partial may be "
                                     "consumed as one; a max partial (an fp8 amax) must be all-reduced first")
            src = prog.placements[arg.name]
            if src != dst:
                try:
                    steps = steps_between(prog.mesh.names, src, dst)
                except NotImplementedError as e:
                    raise NotImplementedError(f"{e} ({arg.name} -> {node.name}, {node.target})") from None
                plan[(node.name, pos)] = (_first_of(arg, src, first_view), dst, steps)
    return prog.replace("insert_collectives", notes={**prog.notes, "redistribute": plan})


VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
         aten.permute.default, aten.unsqueeze.default}


def _first_of(arg: fx.Node, src: Placements, first_view: dict[tuple[object, ...], str]) -> str:
    """The earliest redistributed view equal to ``arg`` (same op, input, arguments and placement), else ``arg``."""
    if arg.op != "call_function" or arg.target not in VIEWS:
        return arg.name
    key = (arg.target, _key(arg.args), _key(tuple(sorted(arg.kwargs.items()))), tuple(src))
    return first_view.setdefault(key, arg.name)


def _key(x: object) -> object:
    if isinstance(x, fx.Node):
        return ("node", x.name)
    if isinstance(x, (list, tuple)):
        return tuple(_key(v) for v in x)
    return x


def steps_between(axes: tuple[str, ...], src: Placements, dst: Placements) -> tuple[Step, ...]:
    """Collective steps turning ``src`` into ``dst``, one per axis that changes, in mesh order, except that when
    one axis gives up a dim another axis takes (``tp:S(1) -> cp:S(1)``), the steps that give up a shard run first:
    a slice of a piece another axis still holds would take the wrong rows.

    A dim two axes shard (the batch over ``dp`` then ``ep``) is split by the first axis, then each piece by the next
    (DTensor's nesting, in mesh order): only the innermost of them may change, gathers innermost first and slices
    outermost first."""
    steps = [Step(_op_for(s, d), axis, s, d) for axis, s, d in zip(axes, src, dst, strict=True) if s != d]
    nested = _nested_dims(src) | _nested_dims(dst)
    for d in nested:
        _check_nested(axes, src, dst, d)
    taken = {st.dst.dim for st in steps if isinstance(st.dst, Shard)}
    if any(isinstance(st.src, Shard) and st.src.dim in taken for st in steps):
        steps.sort(key=lambda st: not isinstance(st.src, Shard))  # stable: mesh order within each group
    if nested:  # gathers of a nested dim run innermost first
        order = {ax: i for i, ax in enumerate(axes)}
        steps.sort(key=lambda st: (not isinstance(st.src, Shard),
                                   -order[st.axis] if isinstance(st.src, Shard) else order[st.axis]))
    return tuple(steps)


def _nested_dims(placements: Placements) -> set[int]:
    dims = [p.dim for p in placements if isinstance(p, Shard)]
    return {d for d in dims if dims.count(d) > 1}


def _check_nested(axes: tuple[str, ...], src: Placements, dst: Placements, d: int) -> None:
    """Every axis that changes how dim ``d`` is sharded comes after every axis that keeps sharding it."""
    kept = [i for i, (s, t) in enumerate(zip(src, dst, strict=True)) if s == t == Shard(d)]
    changed = [i for i, (s, t) in enumerate(zip(src, dst, strict=True)) if s != t and Shard(d) in (s, t)]
    if kept and changed and min(changed) < max(kept):
        raise NotImplementedError(f"two mesh axes shard the same dim and an outer one changes: {src} -> {dst} "
                                  f"over {axes}")


def _op_for(src: Placement, dst: Placement) -> str:
    if isinstance(src, Partial):
        return "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"
    if isinstance(src, Replicate):
        return "slice"
    return "all_gather" if isinstance(dst, Replicate) else "all_to_all"
