"""Split a stage's backward graph into B (input gradients) and W (weight gradients), for zero-bubble schedules.

A compiler can do this exactly: B is every node the input-gradient outputs depend on; W is the
rest of the nodes the parameter-gradient outputs need. B also returns the values W reads from it.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from fxpar.ir import graph_module


def split_backward(backward: fx.GraphModule, input_grad_positions: set[int]) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``b(saved..., tangents...) -> (input grads..., stash...)`` and ``w(saved..., tangents..., stash...) -> grads``.

    Requires: ``backward`` returns a tuple; ``input_grad_positions`` index the input gradients in it.
    Ensures: ``w`` returns a tuple as long as ``backward``'s, with the parameter gradients where
    ``backward`` had them and ``None`` at the input-gradient positions; running b then w computes
    exactly what ``backward`` computes, every node once.
    """
    g = backward.graph
    outs = list(g.output_node().args[0])
    phs = [n for n in g.nodes if n.op == "placeholder"]
    b_nodes = _ancestors([outs[i] for i in sorted(input_grad_positions) if isinstance(outs[i], fx.Node)])
    # the items of B's multi-output nodes (a norm's backward: input, weight and bias gradients) are B's: W then
    # reads tensors, never a tuple (a compiled graph returns tensors only)
    b_nodes |= {u for n in b_nodes for u in n.users if u.target is operator.getitem}
    w_roots = [o for i, o in enumerate(outs) if i not in input_grad_positions and isinstance(o, fx.Node)]
    w_nodes = _ancestors(w_roots) - b_nodes
    stash = [n for n in g.nodes if n in b_nodes and n.op != "placeholder" and any(u in w_nodes for u in n.users)]
    stash += [o for o in w_roots if o in b_nodes and o not in stash and o.op != "placeholder"]

    b_graph, b_env = fx.Graph(), {}
    for n in g.nodes:
        if n in b_nodes or n.op == "placeholder":
            b_env[n] = b_graph.node_copy(n, lambda a: b_env[a])
    b_graph.output((*[b_env[outs[i]] if isinstance(outs[i], fx.Node) else None
                      for i in sorted(input_grad_positions)], *[b_env[s] for s in stash]))

    w_graph, w_env = fx.Graph(), {}
    for n in phs:
        w_env[n] = w_graph.node_copy(n, lambda a: w_env[a])
    for s in stash:
        ph = w_graph.placeholder(f"stash_{s.name}")
        ph.meta.update(s.meta)
        w_env[s] = ph
    for n in g.nodes:
        if n in w_nodes and n.op != "placeholder":
            w_env[n] = w_graph.node_copy(n, lambda a: w_env[a])
    w_graph.output(tuple(None if i in input_grad_positions or not isinstance(o, fx.Node) else w_env[o]
                         for i, o in enumerate(outs)))
    b, w = graph_module(backward, b_graph), graph_module(backward, w_graph)
    b.graph.eliminate_dead_code()
    w.graph.eliminate_dead_code()
    b.recompile()
    w.recompile()
    return b, w


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen
