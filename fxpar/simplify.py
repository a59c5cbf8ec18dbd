"""Rewrites of the captured joint graph that keep its values and let more of it run sharded."""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten
SHAPE_ONLY = {aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default}


def drop_identity_batch_index(gm: fx.GraphModule) -> int:
    """``x[arange(B)[:, None, ..], i, ..]`` -> ``x[:, i[0], ..]``; returns how many ``index`` ops it rewrote.

    Hugging Face builds its 4-D attention masks this way (``mask[batch_idx, kv_idx]`` with
    ``batch_idx = arange(B)`` broadcast along the batch). An ``arange`` is a factory, so it is replicated,
    and an index by a replicated tensor along the batch dim would all-gather the batch-sharded mask.
    Indexing dim 0 by ``arange`` of its own size picks every row in order: the same values come from
    leaving dim 0 alone, which any sharding of dim 0 runs locally.

    Requires: ``index(x, [i0, i1, ...])`` with ``i0`` an ``arange(x.size(0))`` shaped ``(B, 1, ..., 1)``
    through unsqueezes or views, and every other index of the same rank with size 1 in dim 0 (so the
    broadcast shape is ``(B, *rest)``). Ensures: such ops read ``index(x, [None, i1.squeeze(0), ...])``,
    which has the same shape and values; other ops are untouched.
    """
    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.target is not aten.index.Tensor:
            continue
        x, indices = n.args
        if not indices or not isinstance(indices[0], fx.Node) or not _is_batch_arange(indices[0], x):
            continue
        rest = list(indices[1:])
        ndim = indices[0].meta["val"].ndim
        if not all(isinstance(i, fx.Node) and i.meta["val"].ndim == ndim and i.meta["val"].shape[0] == 1
                   for i in rest):
            continue
        with gm.graph.inserting_before(n):
            squeezed = []
            for i in rest:
                s = gm.graph.call_function(aten.squeeze.dims, (i, [0]))
                s.meta.update({k: v for k, v in i.meta.items() if k != "val"})
                s.meta["val"] = i.meta["val"].squeeze(0)
                squeezed.append(s)
        i0 = indices[0]
        n.args = (x, [None, *squeezed])
        _erase_unused_chain(gm.graph, i0)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _erase_unused_chain(graph: fx.Graph, n: fx.Node) -> None:
    """Erase ``n`` and the producers it alone used, while they are unused (the arange and its reshapes)."""
    while not n.users:
        inputs = n.all_input_nodes
        graph.erase_node(n)
        if len(inputs) != 1:
            return
        n = inputs[0]


def _is_batch_arange(i0: fx.Node, x: fx.Node) -> bool:
    """Whether ``i0`` is ``arange(x.size(0))`` with trailing size-1 dims added."""
    shape = tuple(i0.meta["val"].shape)
    rows = x.meta["val"].shape[0]
    if shape[0] != rows or any(s != 1 for s in shape[1:]):
        return False
    n = i0
    while n.target in SHAPE_ONLY:
        n = n.args[0]
    if n.target is aten.arange.default:
        return n.args[0] == rows and n.kwargs.get("dtype", torch.int64) in (torch.int64, torch.int32)
    if n.target is aten.arange.start_step or n.target is aten.arange.start:
        step = n.args[2] if len(n.args) > 2 else 1
        return n.args[0] == 0 and n.args[1] == rows and step == 1
    return False
