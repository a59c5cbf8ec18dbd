"""lower: one rank's programs from the annotated global Program, as an ordered list of steps.

``retrace`` interprets the global joint graph for one rank: each global node becomes the same aten
op on local shards (shape arguments rewritten to local shapes), each planned placement change
becomes ``torch.ops._c10d_functional`` collectives with separate ``wait_tensor`` nodes, naming their
group symbolically (``"tp[2,3]"``; backends bind the names to process groups). The steps below then
turn that joint graph into what the rank runs, each ``RankProgram -> RankProgram``:
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx as fx

from fxpar.ir import Program, graph_module, py_name
from fxpar.lower import overlap as issue_order  # the module: ``fxpar.lower.overlap`` stays importable
from fxpar.lower.fuse_bias import fuse_split_bias, split_adds
from fxpar.lower.program import LedgerRow, RankProgram, group_name
from fxpar.lower.retrace import Lowerer
from fxpar.lower.split_joint import from_zero3_shards, split_joint
from fxpar.read_coord import ReadCoord

__all__ = ["LedgerRow", "RankProgram", "from_zero3_shards", "group_name", "lower", "py_name", "split_joint"]

Step = Callable[[Lowerer, RankProgram], RankProgram]


def lower(prog: Program, rank: int) -> RankProgram:
    """Lower ``prog`` for ``rank``: retrace it, then run every step in order."""
    lw = Lowerer(prog, rank)
    lw.coord = ReadCoord(lw.coord)  # ``rp.coord.read``: the axes whose coordinate the lowering read (its role)
    rp = lw.retrace()
    for step in steps():
        rp = step(lw, rp)
    return rp


def steps() -> list[Step]:
    """The lowering steps, in order."""
    return [
        fuse_linear_bias,  # add(mm(x, w), b) -> addmm(b, x, w) where no collective came between: eager's rounding
        split_forward_backward,  # forward graph -> user outputs + saved values; backward: saved + tangents -> grads
        add_reduce_grads,  # the batch axes' gradient reductions deferred out of the backward, bucketed, own graph
        add_gather_params,  # ZeRO-1/2: the once-per-step all-gather of the dp-sharded parameters, own graph
        inline_reductions,  # overlap, one stage and one microbatch: the bucket all-reduces issued inside the backward
        reorder_for_overlap,  # overlap: every collective issued early, waited late (gloo: one in flight at a time)
        read_ledger,  # the ledger, read from the final graphs' collective nodes (recomputed ones re-issue)
    ]


def fuse_linear_bias(lw: Lowerer, rp: RankProgram) -> RankProgram:
    if fuse_split_bias(rp.joint.graph, split_adds(lw.prog.graph)):
        rp.joint.recompile()
    return rp


def split_forward_backward(lw: Lowerer, rp: RankProgram) -> RankProgram:
    casts = len(lw.prog.signature.params) if (lw.prog.notes.get("mixed_precision") or (None,))[0] else 0
    fwd, bwd, saved = split_joint(rp.joint, lw.prog.signature.num_outputs, lw.root, casts)
    return dataclasses.replace(rp, forward=fwd, backward=bwd, saved=saved)


def add_reduce_grads(lw: Lowerer, rp: RankProgram) -> RankProgram:
    graph = lw.reduce_grads_graph(rp.backward)
    deferred = [(pos - lw.prog.signature.num_outputs, fqn) for pos, fqn, _ in lw.deferred]
    return dataclasses.replace(rp, reduce_grads=graph_module(lw.root, graph) if graph is not None else None,
                               deferred=deferred)


def add_gather_params(lw: Lowerer, rp: RankProgram) -> RankProgram:
    graph = lw.gather_params_graph()
    if graph is None:
        return rp
    gm = graph_module(lw.root, graph)
    return dataclasses.replace(rp, gather_params=gm, gather_ledger=_rows(gm.graph, None))


def inline_reductions(lw: Lowerer, rp: RankProgram) -> RankProgram:
    settings = lw.prog.notes.get("overlap")
    if settings is None or not settings["in_backward"] or rp.reduce_grads is None:
        return rp
    issue_order.inline_reduction(rp.backward.graph, rp.reduce_grads.graph, [pos for pos, _ in rp.deferred])
    return dataclasses.replace(rp, reduce_grads=None, deferred=[])


def reorder_for_overlap(lw: Lowerer, rp: RankProgram) -> RankProgram:
    if lw.prog.notes.get("overlap") is None:
        return rp
    in_flight = issue_order.gloo_in_flight() if lw.prog.mesh.device == "cpu" else "many"  # see fxpar.lower.overlap
    for gm in (rp.forward, rp.backward):
        issue_order.overlap(gm.graph, in_flight)
        gm.recompile()
    return rp


def read_ledger(lw: Lowerer, rp: RankProgram) -> RankProgram:
    ledger = [*_rows(rp.forward.graph, "fwd"), *_rows(rp.backward.graph, "bwd"),
              *(_rows(rp.reduce_grads.graph, "bwd") if rp.reduce_grads is not None else [])]
    return dataclasses.replace(rp, ledger=ledger, groups=dict(lw.groups))


def _rows(graph: fx.Graph, phase: str | None) -> list[LedgerRow]:
    """The ledger rows lowering recorded on ``graph``'s collective nodes, in node order (``phase``: the graph's)."""
    rows = [n.meta["ledger_row"] for n in graph.nodes if "ledger_row" in n.meta]
    return [dataclasses.replace(r, phase=phase) for r in rows] if phase is not None else rows
