"""Names for nodes copied from traces of parts of a model, as one trace of everything gives them.

``fxpar.stitch`` copies the model's own joint graph and each block call's nodes into one graph. A tracer numbers
``mm``, ``mm_1``, ... in the order it creates nodes; ``Names`` asks ``torch.fx`` for the base name each source node
was created under, after taking the names the source skipped, so the copy is numbered as the whole-model trace.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

import torch.fx as fx

from fxpar.block_chain import chain_members
from fxpar.blocks import BLOCK_OPS, base_name

if TYPE_CHECKING:
    from fxpar.stitch import Blocks

_ILLEGAL = fx.graph._illegal_names


class Names:
    """Names for nodes copied into ``g`` from one traced graph (the model's own, or one call of a block's), in its
    order, as one trace of everything gives them: the tracer numbers ``mm``, ``mm_1``, ... and a name the source
    skips (a node it made, then dropped as dead code, as the whole-model trace does too) is taken here too."""

    def __init__(self, g: fx.Graph | fx.graph._Namespace) -> None:
        self.ns = g._graph_namespace if isinstance(g, fx.Graph) else g
        self.last: dict[str, int] = {}

    def take(self, name: str) -> str:
        """The base name to create a copy of source node ``name`` under (after taking the names it skipped)."""
        base, k = split_name(name)
        for _ in range(k - self.last.get(base, -1) - 1):
            self.ns.create_name(base, None)
        self.last[base] = k
        return base

    def take_dropped(self, names: Any, unpacked: set[str] | frozenset[str] = frozenset()) -> None:
        """Take the names of nodes the source's trace made and dropped here (``fxpar.creation_order``); names in
        ``unpacked`` are skipped (outputs of a block call: a whole-model trace names the block's own nodes)."""
        for name in names:
            if name in unpacked:
                self.skip(name)
            else:
                self.ns.create_name(self.take(name), None)

    def skip(self, name: str) -> None:
        """Source node ``name`` is not copied, and no whole-model trace has it (a block call's output)."""
        base, k = split_name(name)
        self.last[base] = k


def split_name(name: str) -> tuple[str, int]:
    """(base, how many names of that base came before): ``mm_12`` -> ("mm", 12); ``mm`` -> ("mm", 0); a Python
    builtin's base is never used bare: ``slice_1`` is the first slice -> ("slice", 0)."""
    base = base_name(name)
    k = int(name[len(base) + 1:]) if base != name else 0
    return base, k - 1 if base in _ILLEGAL and k > 0 else k


def name_as_whole(gm: fx.GraphModule, blocks: Blocks) -> None:
    """Rename the nodes of the exported forward ``gm`` (in place) to the names a whole-model export gives them: a
    block call's outputs are named as the block's nodes that compute them (pipeline boundaries print them)."""
    ns = fx.graph._Namespace()
    for n in list(gm.graph.nodes):
        if n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].target is BLOCK_OPS[0]:
            continue
        if n.op == "call_function" and n.target is BLOCK_OPS[0]:
            *before, last = chain_members(blocks.table, n.args[0])
            for site_id in before:  # the calls a run's one op stands for, before its last, take their names too
                _names_of_call(ns, blocks.of(site_id).forward_graph)
                ns.create_name("_fxpar_block", None)
            forward = blocks.of(last).forward_graph
            made = _names_of_call(ns, forward)
            outs = forward.output_node().args[0]
            used = blocks.used[last]
            for u in n.users:
                u.name = made[outs[used.index(u.args[1])]] if u.users else ns.create_name("_fxpar_unused", None)
            n.name = ns.create_name("_fxpar_block", None)
        else:
            keep = n.op in ("placeholder", "get_attr", "output")
            n.name = ns.create_name(n.name if keep else base_name(n.name), None)
    gm.graph._graph_namespace = ns
    gm.recompile()


def _names_of_call(ns: fx.graph._Namespace, forward: fx.Graph) -> dict[fx.Node, str]:
    """Name a call's nodes in ``ns`` as a whole-model export would: its block's exported ``forward`` in order, after
    the names that export skipped (a node it made, then dropped: ``view_1`` after a dropped ``view``)."""
    names = Names(ns)
    return {r: ns.create_name(names.take(r.name), None) for r in forward.nodes if r.op == "call_function"}
