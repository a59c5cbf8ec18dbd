"""Lowering ``fxpar::moe_experts`` (and its backward) on an ``ep`` axis: token routing with all-to-alls.

See ``fxpar.moe`` for the route. Each rank holds ``E / ep`` experts (``gate_up_proj``, ``down_proj`` sharded on dim
0) and its own ``T`` tokens. The forward issues three all-to-alls over ep (the per-expert counts, the dispatched
rows, the expert outputs) and the backward two (the output rows' gradients, the input rows' gradients), with split
sizes read from the counts at run time. The backward reuses the forward's route, counts and received rows (saved
across the forward/backward split) and recomputes the experts' hidden rows.

The ledger cannot know data-dependent sizes at compile time: its all-to-all rows are the uniform-routing sizes
(every rank sends ``T * k / ep`` rows to each rank). Real sizes differ by routing; their total per rank is always
``T * k`` rows sent (no token is dropped and nothing is padded).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxpar.backends.comm import c10d, rank_sizes
from fxpar.moe import MOE_BACKWARD
from fxpar.split import balanced_sizes

fxpar_ops = torch.ops.fxpar
EXPERT_AXIS = "ep"


@dataclass
class Route:
    """What the forward's routing leaves for the backward, as nodes of the rank graph."""

    order: fx.Node  # this rank's (token, expert) pairs sorted by expert
    recv_counts: fx.Node  # rows each source rank sends each local expert, [ep * E_local]
    counts: fx.Node  # this rank's pairs per expert, [E]
    rows_in: fx.Node  # the rows this rank's experts received
    rows_back: fx.Node  # the experts' outputs for this rank's pairs, in ``order``


class ExpertLowering:
    """Emits the ep route of every ``moe_experts`` node of one rank program (``lw`` is fxpar.lower's lowerer)."""

    def __init__(self, lw: Any) -> None:
        self.lw = lw
        self.n = lw.mesh.axes[EXPERT_AXIS]
        self.routes: dict[tuple[str, ...], Route] = {}

    def lower(self, node: fx.Node, args: tuple, module: str) -> fx.Node:
        """The local value of ``node`` (the forward's output, or the backward's tuple of four gradients)."""
        if node.target is MOE_BACKWARD:
            return self.backward(node, args, module)
        out, route = self.forward(args, module, node.name, self.lw.prog.placements.get(node.name))
        self.routes[_key(node.args[:5])] = route
        return out

    def forward(self, args: tuple, module: str, name: str | None = None, placements: Any = None
                ) -> tuple[fx.Node, Route]:
        x, top_k_index, top_k_weights, gate_up, down, act = args
        num_experts = gate_up.meta["val"].shape[0] * self.n  # the rank holds E / ep of them
        k = top_k_index.meta["val"].shape[1]
        emit = self._emitter(module)
        route = emit(fxpar_ops.moe_route.default, (top_k_index, num_experts))
        order, counts = emit(operator.getitem, (route, 0)), emit(operator.getitem, (route, 1))
        per_rank = [num_experts // self.n] * self.n
        recv_counts = self.all_to_all(counts, per_rank, per_rank, module)
        pairs = x.meta["val"].shape[0] * k
        send, recv = self.sizes(counts, pairs, module), self.sizes(recv_counts, pairs, module)
        rows = emit(fxpar_ops.moe_dispatch.default, (x, order, k))
        rows_in = self.all_to_all(rows, recv, send, module)
        out_rows = emit(fxpar_ops.expert_mlp.default, (rows_in, recv_counts, gate_up, down, act))
        rows_back = self.all_to_all(out_rows, send, recv, module)
        out = self.lw.emit(fxpar_ops.moe_combine.default, (rows_back, order, top_k_weights), placements=placements,
                           module=module, name=name)
        return out, Route(order, recv_counts, counts, rows_in, rows_back)

    def backward(self, node: fx.Node, args: tuple, module: str) -> fx.Node:
        grad, x, top_k_index, top_k_weights, gate_up, down, act = args
        route = self.routes.get(_key(node.args[1:6]))
        if route is None:  # the forward is not in this program (never with capture's joint graph): route again
            _, route = self.forward(args[1:], module)
        k = top_k_index.meta["val"].shape[1]
        emit = self._emitter(module)
        pairs = x.meta["val"].shape[0] * k
        send, recv = self.sizes(route.counts, pairs, module), self.sizes(route.recv_counts, pairs, module)
        combined = emit(fxpar_ops.moe_combine_backward.default, (grad, route.rows_back, route.order, top_k_weights))
        grad_back, grad_weights = emit(operator.getitem, (combined, 0)), emit(operator.getitem, (combined, 1))
        grad_out_rows = self.all_to_all(grad_back, recv, send, module)
        mlp = emit(fxpar_ops.expert_mlp_backward.default, (grad_out_rows, route.rows_in, route.recv_counts,
                                                           gate_up, down, act))
        grad_in, grad_up, grad_down = (emit(operator.getitem, (mlp, i)) for i in range(3))
        grad_rows = self.all_to_all(grad_in, send, recv, module)
        tokens = x.meta["val"].shape[0]
        grad_x = emit(fxpar_ops.moe_dispatch_backward.default, (grad_rows, route.order, k, tokens))
        return self.lw.emit(tuple, ([grad_x, grad_weights, grad_up, grad_down],),
                            placements=self.lw.prog.placements.get(node.name), module=module, name=node.name)

    def all_to_all(self, x: fx.Node, out_sizes: Any, in_sizes: Any, module: str) -> fx.Node:
        lw = self.lw
        c = lw.emit(c10d.all_to_all_single.default, (x, out_sizes, in_sizes, lw.group(EXPERT_AXIS)), module=module,
                    name=f"{x.name}_alltoall")
        lw.record("all_to_all", EXPERT_AXIS, c.meta["val"], c)
        return lw.emit(c10d.wait_tensor.default, (c,), module=module, name=f"{x.name}_routed")

    def sizes(self, counts: fx.Node, pairs: int, module: str) -> fx.Node:
        """The all-to-all split sizes of ``counts`` (a list at run time). Its compile-time value is uniform routing of
        the rank's ``pairs`` rows."""
        lw = self.lw
        node = lw.graph.create_node("call_function", rank_sizes, (counts, self.n))
        node.meta.update(val=balanced_sizes(pairs, self.n), module=module, phase=lw.site.phase,
                         source=lw.site.source, for_node=lw.site.for_node, placements=None)
        return node

    def _emitter(self, module: str):  # noqa: ANN202
        return lambda target, args: self.lw.emit(target, args, module=module)


def _key(args: tuple) -> tuple[str, ...]:
    return tuple(a.name for a in args if isinstance(a, fx.Node))
