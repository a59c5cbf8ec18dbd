"""fp8_gather: with ZeRO-3 and fp8, cast each weight shard to float8 before its all-gather (1/4 of the bytes)."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.ir import Program, consumed_tensors
from fxpar.pass_context import Context

aten = torch.ops.aten
SAME = {aten.abs.default, aten.clamp.default, aten._to_copy.default, aten.clone.default,
        aten.clamp_min.default, aten.div.Tensor, aten.reciprocal.default}
TRANSPOSES = {aten.t.default, aten.transpose.int}


def fp8_gather(prog: Program, ctx: Context) -> Program:
    """Run the float8 cast of every ZeRO-3 weight on the dp shard, so the all-gather moves float8.

    Requires: ``fp8`` tagged each weight operand's cast nodes with ``meta["fp8_weight"]`` (the weight's
    placeholder); ``propagate`` placed every node; ``zero`` chose ``notes["zero"]``; ``insert_collectives``
    has not run yet (it turns the placements set here into collectives).
    Ensures: with ``zero=3``, for each weight in ``notes["zero"]`` whose casts reach it through transposes
    only, the dp placement of the cast nodes becomes the shard's (``Shard(d)`` moved through the
    transposes): the amax is a ``Partial("max")`` over dp where it reduces the shard dim (one max
    all-reduce of the scale: a scalar for tensorwise, a vector for rowwise), the scaled float8 value stays
    sharded and is all-gathered where ``_scaled_mm`` reads it (1 byte per element; a rowwise scale
    sharded along with its rows is gathered too). The cast reads the weight as ``Shard(d)`` over dp, which
    lowering serves from the ZeRO-3 shard itself (no fp32 gather). Values do not change: the global
    amax is the max of the shard amaxes, and casting is elementwise. ``notes["fp8_gather"]`` lists the
    weights. Otherwise the Program is unchanged.
    """
    if ctx.plan.fp8 is None or prog.notes.get("zero_level") != 3 or "dp" not in prog.mesh.names:
        return prog
    dims = zero3_dims(prog)
    casts: dict[str, list[fx.Node]] = {}
    for n in prog.graph.nodes:
        if n.meta.get("fp8_weight") in dims:
            casts.setdefault(n.meta["fp8_weight"], []).append(n)
    placements, arg_placements, done = shard_casts(prog, casts, dims)
    if not done:
        return prog
    fqns = [fqn for fqn, name in prog.signature.params if name in done]
    return prog.replace("fp8_gather", placements=placements, arg_placements=arg_placements,
                        notes={**prog.notes, "fp8_gather": fqns})


def zero3_dims(prog: Program) -> dict[str, int]:
    """ZeRO-3 parameter placeholder -> the dim its dp shard is on (``notes["zero"]``, by graph name)."""
    return {name: prog.notes["zero"][fqn] for fqn, name in prog.signature.params if fqn in prog.notes["zero"]}


def shard_casts(prog: Program, casts: dict[str, list[fx.Node]], dims: dict[str, int]
                ) -> tuple[dict[str, tuple], dict[str, tuple], list[str]]:
    """Placements that run each weight's ``casts`` on its ZeRO-3 dp shard ``Shard(dims[weight])``.

    Ensures: for every weight whose casts reach it through transposes only (and whose dp shard dim no other axis
    shards there), the cast nodes (and those transposes) are placed as the shard moved through them and read the
    weight as its dp shard; insert_collectives
    then all-gathers the cast value where it is read whole. Returns the new placements, the new argument
    placements and the weights done.
    """
    ax = prog.mesh.axis_index("dp")
    placements = dict(prog.placements)
    arg_placements = dict(prog.arg_placements)
    done = []
    for weight, nodes in casts.items():
        dp_of = _dp_placements(prog.node(weight), dims[weight], nodes)
        if dp_of is None or any(_sharded_elsewhere(placements[n.name], ax, p) for n, p in dp_of.items()):
            continue
        for n, p in dp_of.items():
            placements[n.name] = _with(placements[n.name], ax, p)
        for n in dp_of:
            arg_placements[n.name] = tuple(_required(a, req, dp_of, ax, dims[weight])
                                           for a, req in zip(consumed_tensors(n), prog.arg_placements[n.name],
                                                             strict=True))
        done.append(weight)
    return placements, arg_placements, done


def _sharded_elsewhere(placed: tuple, ax: int, p: Placement) -> bool:
    """Whether another mesh axis already shards the dim ``p`` would shard over dp (sequence parallelism's ``Shard(1)``
    of a ViT's ``[1, S, h]`` position table, whose dp shard is dim 1 too): two axes on one dim cannot change apart."""
    return isinstance(p, Shard) and any(isinstance(q, Shard) and q.dim == p.dim
                                        for i, q in enumerate(placed) if i != ax)


def _dp_placements(weight: fx.Node, dim: int, casts: list[fx.Node]) -> dict[fx.Node, Placement] | None:
    """The dp placement of each node from ``weight`` (``Shard(dim)``) through its transposes to its casts,
    or None when some node there is not one the shard can run (a view, or a transpose used elsewhere)."""
    tagged = set(casts)
    out: dict[fx.Node, Placement] = {}
    order = [*_transposes_to(weight, tagged), *casts]
    for n in order:
        first = n.all_input_nodes[0]  # the value a cast op transforms (a scale comes second)
        src = Shard(dim) if first is weight else out.get(first)
        if src is None:
            return None
        out[n] = _through(n, src)
        if out[n] is None:
            return None
    return out


def _transposes_to(weight: fx.Node, casts: set[fx.Node]) -> list[fx.Node]:
    """The transposes between ``weight`` and its cast nodes (each used by casts or transposes only)."""
    path, frontier = [], [weight]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.target in TRANSPOSES and u not in casts and any(_reaches(u, casts)):
                path.append(u)
                frontier.append(u)
    return path


def _reaches(n: fx.Node, casts: set[fx.Node]) -> list[bool]:
    return [u in casts or u.target in TRANSPOSES for u in n.users]


def _through(n: fx.Node, src: Placement) -> Placement | None:
    """The dp placement of ``n`` given its first input's."""
    if isinstance(src, Partial):  # a scale after the amax: reduced over dp before it is used
        src = Replicate()
    if n.target in TRANSPOSES:
        if isinstance(src, Replicate):
            return src
        nd = n.args[0].meta["val"].ndim
        d0, d1 = (0, 1) if n.target is aten.t.default else (n.args[1] % nd, n.args[2] % nd)
        return Shard({d0: d1, d1: d0}.get(src.dim, src.dim))
    if n.target is aten.amax.default:
        reduced = [d % n.args[0].meta["val"].ndim for d in n.args[1]]
        return Partial("max") if isinstance(src, Shard) and src.dim in reduced else src
    if n.target in SAME or n.target is aten.mul.Tensor:
        return src
    return None


def _required(arg: fx.Node | None, req: tuple | None, dp_of: dict[fx.Node, Placement], ax: int, dim: int) -> object:
    """What a cast node needs of ``arg`` over dp: the weight as its dp shard, a partial amax reduced, the rest as
    the cast now places it. The other axes keep what propagation required (a tp-partial amax is reduced too)."""
    if arg is None or req is None:
        return req
    if arg not in dp_of:  # the weight itself
        return _with(req, ax, Shard(dim))
    return _with(req, ax, Replicate() if isinstance(dp_of[arg], Partial) else dp_of[arg])


def _with(placements: tuple, ax: int, p: Placement) -> tuple:
    return (*placements[:ax], p, *placements[ax + 1:])
