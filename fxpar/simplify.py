"""Rewrites of the captured joint graph that keep its values and let more of it run sharded."""

from __future__ import annotations

import math
from typing import Any

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
    which has the same shape and values (with no other index: ``clone(x)``, unsqueezed to the index's rank); other
    ops are untouched.
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
        if rest:
            n.args = (x, [None, *squeezed])
        else:  # x[arange(B)[:, None, ..]]: a copy of x with ndim - 1 size-1 dims after its rows
            _copy_with_unit_dims(gm.graph, n, x, ndim - 1)
        _erase_unused_chain(gm.graph, i0)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _copy_with_unit_dims(graph: fx.Graph, n: fx.Node, x: fx.Node, k: int) -> None:
    """``n`` becomes ``clone(x)`` (an index op needs an index tensor); its users read it with ``k`` size-1 dims
    after dim 0, the shape the batch index gave it."""
    meta = {key: v for key, v in n.meta.items() if key != "val"}
    n.target, n.args = aten.clone.default, (x,)
    n.meta["val"] = n.meta["val"].new_empty(x.meta["val"].shape)
    users = list(n.users)
    out = n
    for _ in range(k):
        with graph.inserting_after(out):
            out = graph.call_function(aten.unsqueeze.default, (out, 1))
        out.meta.update(meta)
        out.meta["val"] = out.args[0].meta["val"].unsqueeze(1)
    for user in users:
        user.replace_input_with(n, out)


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


FLAT_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
LAYOUT_ONLY = {*FLAT_VIEWS, aten.transpose.int, aten.expand.default, aten.clone.default}


def bmm_over_heads(gm: fx.GraphModule) -> int:
    """``bmm`` over ``B * H`` flattened rows, unflattened after, -> ``fxpar::bmm4`` on the 4-D tensors.

    Eager attention (and the backward of any 4-D ``matmul``) flattens ``[B, H, M, K]`` to ``[B * H, M, K]`` before
    ``bmm``. With heads sharded that flatten is not a plain shard, so propagation would gather q, k and v and
    run attention whole on every rank. ``bmm4`` computes the same products on the 4-D tensors, sharded on either
    batch dim.

    Requires: a ``bmm`` whose operands are each a flattening view of a 4-D ``[B, H, ...]`` tensor (or the
    transpose of its last two dims of one) and whose only user views the result as ``[B, H, M, N]``.
    Ensures: that view's users read ``bmm4(a4, b4)`` instead (the same values); the bmm and views nothing else
    reads are erased. Other ``bmm`` ops are untouched. Returns how many were rewritten.
    """
    import fxpar.ops  # noqa: F401  (defines torch.ops.fxpar.bmm4)

    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.target is not aten.bmm.default or len(n.users) != 1:
            continue
        (out,) = n.users
        if out.target not in FLAT_VIEWS or out.meta["val"].ndim != 4:
            continue
        heads = tuple(out.meta["val"].shape[:2])
        with gm.graph.inserting_before(out):
            operands = [_four_d(gm.graph, a, heads) for a in n.args]
            if any(o is None for o in operands):
                continue
            new = gm.graph.call_function(torch.ops.fxpar.bmm4.default, tuple(operands))
            new.meta.update({k: v for k, v in out.meta.items() if k != "val"})
            new.meta["val"] = out.meta["val"].new_empty(out.meta["val"].shape)
        out.replace_all_uses_with(new)
        _erase_unused_chain(gm.graph, out)  # the view, then the bmm it alone read
        rewritten += 1
    if rewritten:
        for node in reversed(list(gm.graph.nodes)):  # the flattening copies and views left without users
            if node.op == "call_function" and not node.users and node.target in LAYOUT_ONLY:
                gm.graph.erase_node(node)
        gm.recompile()
    return rewritten


def _four_d(graph: fx.Graph, a: fx.Node, heads: tuple[int, int]) -> fx.Node | None:
    """The 4-D ``[B, H, ...]`` tensor ``a`` flattens (a new transpose node for a transposed operand), or None."""
    transposed = a.target is aten.transpose.int and sorted(d % 3 for d in a.args[1:3]) == [1, 2]
    view = a.args[0] if transposed else a
    if view.target not in FLAT_VIEWS:
        return None
    x = view.args[0]
    shape = tuple(x.meta["val"].shape)
    if len(shape) != 4 or shape[:2] != heads or tuple(view.meta["val"].shape) != (shape[0] * shape[1], *shape[2:]):
        return None
    if not transposed:
        return x
    t = graph.call_function(aten.transpose.int, (x, 2, 3))
    t.meta.update({k: v for k, v in a.meta.items() if k != "val"})
    t.meta["val"] = x.meta["val"].transpose(2, 3)
    return t


def tokens_unflattened(gm: fx.GraphModule) -> int:
    """A Linear's matmuls on ``[B * S, K]`` flattened tokens -> ``fxpar`` ops on the ``[B, S, K]`` tensors.

    Linear (and its backward) flattens every token dim into one before ``mm``. With the sequence dim sharded
    (context parallel) that flatten is DTensor's ``_StridedShard``, so every Linear would gather its input.
    Three patterns are rewritten, each to the same values:

    * ``view(mm(flat(x), w), [*L, N])`` (also with a bias ``add`` between) -> ``matmul_nd(x, w)``;
    * ``mm(t(flat(a)), flat(b))`` (a weight gradient) -> ``token_contract(a, b)``;
    * ``sum(flat(g), [0])`` (a bias gradient) -> ``sum(g, [0, .., ndim - 2])``.

    Requires: ``flat`` a view of an N-D tensor (N >= 3) as ``[prod(L), K]``. Ensures: the rewritten ops no longer
    read a flattened token dim; flattening views left without users are erased. Returns how many were rewritten.
    """
    import fxpar.ops  # noqa: F401  (defines the ops)

    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.mm.default:
            rewritten += _forward_mm(gm.graph, n) or _contract_mm(gm.graph, n)
        elif n.target is aten.sum.dim_IntList and list(n.args[1]) in ([0], [-2]) and _flattened(n.args[0]):
            rewritten += _token_sum(gm.graph, n)
    if rewritten:
        for node in reversed(list(gm.graph.nodes)):
            if node.op == "call_function" and not node.users and node.target in LAYOUT_ONLY | {aten.t.default}:
                gm.graph.erase_node(node)
        gm.recompile()
    return rewritten


def round_trip_views(gm: fx.GraphModule) -> int:
    """``view(view(x, s1), x.shape)`` -> ``x`` for a contiguous ``x``: the same values, laid out alike.

    AOTAutograd leaves such pairs where a 3-D ``matmul``'s flattened product meets an in-place add (Falcon's
    ``mlp_output += attention_output``). With the sequence sharded the flatten is no plain shard, so the pair
    gathered the whole stream. Ensures: users of the outer view read ``x``; views left unused are erased.
    Returns how many pairs were bypassed.
    """
    rewritten = 0
    for n in list(gm.graph.nodes):
        inner = n.args[0] if n.op == "call_function" and n.target in FLAT_VIEWS else None
        if not (isinstance(inner, fx.Node) and inner.target in FLAT_VIEWS and isinstance(inner.args[0], fx.Node)):
            continue
        x, val = inner.args[0].meta.get("val"), n.meta.get("val")
        if isinstance(x, torch.Tensor) and isinstance(val, torch.Tensor) and x.shape == val.shape \
                and x.dtype == val.dtype and x.is_contiguous():
            n.replace_all_uses_with(inner.args[0])
            _erase_unused_chain(gm.graph, n)
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def bias_after_token_view(gm: fx.GraphModule) -> int:
    """``view(add(mm(x, w), bias), [*L, N])`` -> ``add(view(mm(x, w), [*L, N]), bias)``: the same values.

    A biased Linear adds its bias on the flattened ``[prod(L), N]`` product. Under tensor parallelism a
    row-parallel product is a partial sum, which must be reduced before the add; on the flattened tensor only
    an all-reduce can, as a sequence shard of ``[*L, N]`` is no shard of ``[prod(L), N]``. With the add after
    the view, sequence parallelism reduce-scatters the product (half an all-reduce's bytes) and adds the bias
    on each rank's own tokens. Requires: ``bias`` 1-D of size ``N``, ``mm`` and ``add`` each with one user.
    Ensures: only forward nodes move (the backward reads neither). Returns how many were rewritten.
    """
    rewritten = 0
    for add in list(gm.graph.nodes):
        if not (add.op == "call_function" and add.target is aten.add.Tensor and len(add.users) == 1
                and isinstance(add.args[0], fx.Node) and add.args[0].target is aten.mm.default
                and len(add.args[0].users) == 1 and _is_vector(add.args[1])):
            continue
        (view,) = add.users
        val = view.meta.get("val")
        if view.target not in FLAT_VIEWS or not isinstance(val, torch.Tensor) or val.ndim < 3 \
                or val.shape[-1] != add.meta["val"].shape[-1]:
            continue
        with gm.graph.inserting_before(view):
            new_view = gm.graph.call_function(view.target, (add.args[0], *view.args[1:]), dict(view.kwargs))
            copy_meta(new_view, view, val.new_empty(val.shape))
            new_add = gm.graph.call_function(aten.add.Tensor, (new_view, add.args[1]))
            copy_meta(new_add, add, val.new_empty(val.shape))
        view.replace_all_uses_with(new_add)
        gm.graph.erase_node(view)
        gm.graph.erase_node(add)
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _flattened(a: Any) -> fx.Node | None:
    """The N-D tensor (N >= 3) whose token dims ``a`` flattens into one (``[prod(L), K]``), or None."""
    if not isinstance(a, fx.Node) or a.target not in FLAT_VIEWS:
        return None
    x = a.args[0]
    shape, flat = tuple(x.meta["val"].shape), tuple(a.meta["val"].shape)
    if len(shape) < 3 or flat != (math.prod(shape[:-1]), shape[-1]):
        return None
    return x


def copy_meta(new: fx.Node, like: fx.Node, val: torch.Tensor) -> None:
    new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
    new.meta["val"] = val


def _forward_mm(graph: fx.Graph, mm: fx.Node) -> int:
    """``view(mm(flat(x), w) [+ bias], [*L, N])`` -> ``matmul_nd(x, w) [+ bias]``."""
    x = _flattened(mm.args[0])
    if x is None or len(mm.users) != 1:
        return 0
    (user,) = mm.users
    bias = user if user.target is aten.add.Tensor and user.args[0] is mm and _is_vector(user.args[1]) else None
    top = bias if bias is not None else mm
    lead = tuple(x.meta["val"].shape[:-1])
    views = list(top.users)
    if not views or any(v.target not in FLAT_VIEWS or tuple(v.meta["val"].shape[:-1]) != lead for v in views):
        return 0
    val = views[0].meta["val"]
    with graph.inserting_before(top if bias is None else bias):
        new = graph.call_function(torch.ops.fxpar.matmul_nd.default, (x, mm.args[1]))
        copy_meta(new, mm, val.new_empty(val.shape))
        if bias is not None:
            new_bias = graph.call_function(aten.add.Tensor, (new, bias.args[1]))
            copy_meta(new_bias, bias, val.new_empty(val.shape))
            new = new_bias
    for v in views:
        v.replace_all_uses_with(new)
        graph.erase_node(v)
    for dead in (bias, mm):
        if dead is not None and not dead.users:
            graph.erase_node(dead)
    return 1


def _is_vector(a: Any) -> bool:
    return isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].ndim == 1


def _contract_mm(graph: fx.Graph, mm: fx.Node) -> int:
    """``mm(t(flat(a)), flat(b))`` -> ``token_contract(a, b)``."""
    left, right = mm.args
    if not isinstance(left, fx.Node) or left.target is not aten.t.default:
        return 0
    a, b = _flattened(left.args[0]), _flattened(right)
    if a is None or b is None or a.meta["val"].shape[:-1] != b.meta["val"].shape[:-1]:
        return 0
    with graph.inserting_before(mm):
        new = graph.call_function(torch.ops.fxpar.token_contract.default, (a, b))
        copy_meta(new, mm, mm.meta["val"].new_empty(mm.meta["val"].shape))
    mm.replace_all_uses_with(new)
    graph.erase_node(mm)
    return 1


def _token_sum(graph: fx.Graph, s: fx.Node) -> int:
    """``sum(flat(g), [0], keepdim)`` -> ``sum(g, every token dim)``, viewed back to ``[1, K]`` when kept."""
    g = _flattened(s.args[0])
    keep = bool(s.args[2]) if len(s.args) > 2 else bool(s.kwargs.get("keepdim", False))
    dims = list(range(g.meta["val"].ndim - 1))
    with graph.inserting_before(s):
        kwargs = {k: v for k, v in s.kwargs.items() if k != "keepdim"}
        new = graph.call_function(aten.sum.dim_IntList, (g, dims, keep), kwargs)
        copy_meta(new, s, g.meta["val"].sum(dims, keepdim=keep))
        if keep:
            flat = graph.call_function(aten.view.default, (new, list(s.meta["val"].shape)))
            copy_meta(flat, s, s.meta["val"].new_empty(s.meta["val"].shape))
            new = flat
    s.replace_all_uses_with(new)
    graph.erase_node(s)
    return 1
