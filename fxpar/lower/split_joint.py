"""Split a rank's joint graph into its forward and backward graphs (what crosses between them is saved)."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir import copy_node, graph_module


def split_joint(joint: fx.GraphModule, num_outputs: int, root: torch.nn.Module, recompute_casts: int = 0
                ) -> tuple[fx.GraphModule, fx.GraphModule, list[str]]:
    """Forward graph: fwd-phase nodes, returning user outputs + saved values. Backward graph:
    saved values + tangents -> gradients.

    A forward value computed from ZeRO-3 parameter shards alone (their all-gather, a transpose of the
    gathered weight) is not saved: the backward recomputes it from the shards (FSDP's re-gather). So
    is every node the ``recompute`` pass chose (``meta["fxpar_recompute"]``, with the collectives lowering
    emitted for it). Recomputed copies carry ``meta["recomputed"]``. With ``recompute_casts = n`` (mixed
    precision: the first ``n`` placeholders are the parameters), a forward value computed from parameters
    alone (each weight's cast to ``param_dtype`` and its transposes) is recomputed too, so every microbatch in
    flight keeps no copy of the weights of its own.
    """
    out_node = joint.graph.output_node()
    outs = out_node.args[0]
    fwd_g, bwd_g = fx.Graph(), fx.Graph()
    fenv: dict[fx.Node, fx.Node] = {}
    benv: dict[fx.Node, fx.Node] = {}
    saved: list[fx.Node] = []

    from_shards = from_zero3_shards(joint.graph) | {n for n in joint.graph.nodes if n.meta.get("fxpar_recompute")}
    if recompute_casts:
        params = [n for n in joint.graph.nodes if n.op == "placeholder"][:recompute_casts]
        from_shards |= _derived(joint.graph, set(params))

    def bwd_arg(n: fx.Node) -> fx.Node:
        if n not in benv and n in from_shards:  # recompute it in the backward instead of saving it
            benv[n] = copy_node(bwd_g, n, bwd_arg)
            benv[n].meta.update(phase="bwd", recomputed=True)
        elif n not in benv:  # a forward value the backward needs: saved across the two graphs
            ph = bwd_g.placeholder(f"saved_{n.name}")
            ph.meta.update(n.meta)
            benv[n] = ph
            saved.append(n)
        return benv[n]

    for n in joint.graph.nodes:
        if n.op == "output":
            continue
        is_bwd = n.meta.get("phase") == "bwd"
        if not is_bwd:
            fenv[n] = copy_node(fwd_g, n, fenv.__getitem__)
        else:
            benv[n] = copy_node(bwd_g, n, bwd_arg)
    # tangents first in the backward signature: move saved placeholders before them by order of use
    fwd_g.output((*[None if o is None else fenv[o] for o in outs[:num_outputs]], *[fenv[s] for s in saved]))
    bwd_g.output(tuple(None if o is None else (benv[o] if o in benv else bwd_arg(o)) for o in outs[num_outputs:]))
    _placeholders_first(bwd_g)
    return graph_module(root, fwd_g), graph_module(root, bwd_g), [s.name for s in saved]


def from_zero3_shards(graph: fx.Graph) -> set[fx.Node]:
    """Forward nodes computed from ZeRO-3 parameter shards alone (the shard placeholders excluded)."""
    return _derived(graph, {n for n in graph.nodes if n.op == "placeholder" and n.meta.get("zero3_shard")})


def _derived(graph: fx.Graph, shards: set[fx.Node]) -> set[fx.Node]:
    """Forward nodes computed from ``shards`` alone."""
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function" and n.meta.get("phase") != "bwd" and n.all_input_nodes \
                and all(a in shards or a in derived for a in n.all_input_nodes):
            derived.add(n)
    return derived


def _placeholders_first(g: fx.Graph) -> None:
    phs = [n for n in g.nodes if n.op == "placeholder"]
    first = next(iter(g.nodes))
    for ph in phs:
        first.prepend(ph)
    saved = [p for p in phs if p.name.startswith("saved_")]
    tangents = [p for p in phs if not p.name.startswith("saved_")]
    anchor = next(iter(g.nodes))
    for ph in saved + tangents:
        anchor.append(ph) if ph is not anchor else None
        anchor = ph
