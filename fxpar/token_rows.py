"""Token rows kept in their ``[batch, seq, ...]`` shape where the model's own code flattens them.

Some models flatten the tokens themselves and run a row-wise stretch of layers on ``[B * S, H]``: OPT's decoder
layer does ``hidden.reshape(-1, H)``, then the final layer norm, ``fc1``, the activation, ``fc2``, dropout and the
residual add, then ``.view(B, S, H)``. With the sequence dim sharded (sequence or context parallelism) that
flatten is no plain shard (DTensor's ``_StridedShard``), so every such layer gathered the tokens, all-reduced
``fc2``'s product where a reduce-scatter does, and left the residual stream replicated from there on (OPT at
``tp=2`` with ``sequence_parallel=True``: the layers' activation collectives moved 1.75x Megatron's bytes).

Each op of such a stretch computes every token row from the same row of its inputs, so it computes the same
values on the un-flattened tensor: ``linear``, ``layer_norm``/``rms_norm`` over the last dim, dropout and
element-wise ops take any leading dims. :func:`token_rows_unflattened` rewrites the exported forward graph so
the stretch runs on ``[*L, C]`` values, before AOTAutograd traces the joint (its backward follows), and the sharded
token dims stay plain shards through it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
# ops whose first argument is a token-rows value and whose other tensor arguments are parameters of the op
# (a Linear's weight and bias, a norm's weight and bias); each output row depends on the same input row only
_ROW_OPS = {aten.linear.default, aten.dropout.default, aten.relu.default, aten.gelu.default, aten.silu.default,
            aten.tanh.default, aten.sigmoid.default, aten.neg.default, aten.clone.default, aten.alias.default,
            aten.contiguous.default, aten.to.dtype, aten.leaky_relu.default, aten.hardtanh.default}
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}  # over the last dim only (checked)
_ELEMENTWISE = {aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor}


def token_rows_unflattened(gm: fx.GraphModule) -> int:
    """Run row-wise stretches of the exported forward ``gm`` on un-flattened token values, in place.

    A stretch starts at views ``x [*L, H] -> [prod(L), H]`` (``len(L) >= 2``) and ends at views back to
    ``[*L, C]``; in between every op is row-wise (``_ROW_OPS``, a norm over the last dim, an element-wise op of two
    stretch values or of one and a vector or a number). Requires: an exported (pre-autograd) graph with fake
    ``val`` metadata. Ensures: each stretch whose values are read only by its own ops and its closing views reads
    ``x`` itself, its values hold ``[*L, C]`` (the same numbers, rows in the same order), its opening views are
    erased and its closing views become views to their own shape; a stretch read by anything else is left as it
    was. Returns how many opening views were removed.
    """
    lead: dict[fx.Node, tuple[int, ...]] = {}
    opens: list[fx.Node] = []
    parent: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        shape = _flattening(n)
        if shape is not None:
            lead[n], parent[n] = shape, n
            opens.append(n)
            continue
        inputs = _row_inputs(n, lead)
        if inputs:
            lead[n] = lead[inputs[0]]
            parent[n] = n
            for i in inputs:
                _union(parent, n, i)
    closes, bad = _closes_and_escapes(lead, parent)
    removed = 0
    for root in {_find(parent, n) for n in opens} - bad:
        if not closes.get(root):
            continue
        for n in [n for n in lead if _find(parent, n) == root]:
            if n in opens:
                n.replace_all_uses_with(n.args[0])
                gm.graph.erase_node(n)
                removed += 1
            else:
                n.meta["val"] = n.meta["val"].reshape(*lead[n], n.meta["val"].shape[-1])
    if removed:
        gm.recompile()
    return removed


def _flattening(n: fx.Node) -> tuple[int, ...] | None:
    """``L`` when ``n`` views ``x [*L, H]`` (``len(L) >= 2``) as ``[prod(L), H]``."""
    if n.target not in _VIEWS or not isinstance(n.args[0], fx.Node):
        return None
    src, out = n.args[0].meta.get("val"), n.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.ndim < 3 or out.ndim != 2:
        return None
    lead = tuple(src.shape[:-1])
    return lead if tuple(out.shape) == (math.prod(lead), src.shape[-1]) else None


def _row_inputs(n: fx.Node, lead: dict[fx.Node, tuple[int, ...]]) -> list[fx.Node]:
    """The stretch values ``n`` reads when ``n`` is a row-wise op of them (all with the same ``L``), else ``[]``."""
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.ndim != 2 or n.kwargs.get("dim") is not None:
        return []
    first = n.args[0] if n.args else None
    if n.target in _ROW_OPS or n.target in _NORMS:
        if not _in(first, lead) or any(_in(a, lead) for a in n.args[1:]):
            return []
        if n.target in _NORMS and len(n.args[1]) != 1:
            return []
        inputs = [first]
    elif n.target in _ELEMENTWISE and len(n.args) == 2:
        inputs = [a for a in n.args if _in(a, lead)]
        others = [a for a in n.args if not _in(a, lead)]
        if not inputs or not all(_broadcasts_over_rows(a) for a in others):
            return []
    else:
        return []
    shapes = {lead[i] for i in inputs}
    return inputs if len(shapes) == 1 and val.shape[0] == math.prod(next(iter(shapes))) else []


def _in(a: Any, lead: dict[fx.Node, tuple[int, ...]]) -> bool:
    return isinstance(a, fx.Node) and a in lead


def _broadcasts_over_rows(a: Any) -> bool:
    """A number, or a tensor of at most one dim (broadcast along the last dim, whatever the leading ones)."""
    if isinstance(a, (int, float, bool)):
        return True
    val = a.meta.get("val") if isinstance(a, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.ndim <= 1


def _closes_and_escapes(lead: dict[fx.Node, tuple[int, ...]], parent: dict[fx.Node, fx.Node]
                        ) -> tuple[dict[fx.Node, list[fx.Node]], set[fx.Node]]:
    """Per stretch (its root): the views that close it, and the stretches some other node reads."""
    closes: dict[fx.Node, list[fx.Node]] = {}
    bad: set[fx.Node] = set()
    for n, shape in lead.items():
        root = _find(parent, n)
        for user in n.users:
            if user in lead and _find(parent, user) == root:
                continue
            out = user.meta.get("val")
            if user.target in _VIEWS and user.args[0] is n and isinstance(out, torch.Tensor) \
                    and tuple(out.shape[:-1]) == shape:
                closes.setdefault(root, []).append(user)
            else:
                bad.add(root)
    return closes, bad


def _find(parent: dict[fx.Node, fx.Node], n: fx.Node) -> fx.Node:
    while parent[n] is not n:
        parent[n] = parent[parent[n]]
        n = parent[n]
    return n


def _union(parent: dict[fx.Node, fx.Node], a: fx.Node, b: fx.Node) -> None:
    ra, rb = _find(parent, a), _find(parent, b)
    if ra is not rb:
        parent[rb] = ra
