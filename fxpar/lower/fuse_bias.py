"""A Linear's bias added inside its matmul again, where no collective came between the two.

Capture splits every ``addmm(b, x, w)`` into ``add(mm(x, w), b)`` (``fxpar.capture``), so that a row-parallel
Linear completes its partial product before the replicated bias is added. Where the product needed no collective
(a replicated, column-parallel or batch-sharded Linear: most of them), the rank graph would round the product to
the compute dtype and then round the sum, where eager ``F.linear`` adds the bias inside the matmul and rounds once:
in bf16 that is one unit in the last place apart on some outputs, enough to flip an MoE router's top-k.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.ir import SPLIT_ADDMM

aten = torch.ops.aten

VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}  # token dims flattened or restored
RECOMPUTE_META = ("fxpar_recompute", "for_node")  # what recompute (and its byte budget) reads of a rank node


def split_adds(global_graph: fx.Graph) -> set[str]:
    """The names of the adds capture split from an ``addmm`` (``meta["split_addmm"]``): a rank graph's node keeps
    the name of the global node it lowers."""
    return {n.name for n in global_graph.nodes if n.meta.get(SPLIT_ADDMM)}


def fuse_split_bias(graph: fx.Graph, split: set[str]) -> int:
    """Rewrite each ``add(mm(x, w), b)`` capture split (named in ``split``) to ``addmm(b, x, w)``, and each
    ``add(view(mm(x, w), shape), b)`` (the add moved after the token view, ``fxpar.simplify.bias_after_token_view``)
    to ``view(addmm(b, x, w), shape)``, where the ``mm`` (and view) feed the add alone and ``b`` has the product's
    dtype: no collective came between them.

    Requires: node meta ``val``. Ensures: the values eager's ``F.linear`` computes; returns the pairs fused."""
    fused = 0
    for add in list(graph.nodes):
        if add.op != "call_function" or add.name not in split or add.target is not aten.add.Tensor:
            continue
        product, bias = add.args[0], add.args[1]
        view = product if isinstance(product, fx.Node) and product.target in VIEWS else None
        mm = view.args[0] if view is not None else product
        if not (isinstance(mm, fx.Node) and isinstance(bias, fx.Node) and mm.target is aten.mm.default
                and len(mm.users) == 1 and (view is None or len(view.users) == 1) and not add.kwargs
                and _same_dtype(mm, bias)):
            continue
        with graph.inserting_before(add):
            addmm = graph.call_function(aten.addmm.default, (bias, *mm.args))
            addmm.meta.update(mm.meta)
            out = addmm if view is None else graph.call_function(view.target, (addmm, *view.args[1:]), view.kwargs)
        out.meta.update(add.meta if view is not None else _outside_recompute(add.meta, mm.meta))
        add.replace_all_uses_with(out)
        for dead in (add, view, mm):
            if dead is not None:
                graph.erase_node(dead)
        fused += 1
    return fused


def _outside_recompute(add_meta: dict, mm_meta: dict) -> dict:
    """The add's meta for the fused ``addmm`` (its value, placements, provenance) but the matmul's say in whether
    it is recomputed: ``selective`` saves matmuls and recomputes the add; the fused node is a matmul."""
    meta = dict(add_meta)
    for key in RECOMPUTE_META:
        meta.pop(key, None)
        if key in mm_meta:
            meta[key] = mm_meta[key]
    return meta


def _same_dtype(a: fx.Node, b: fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype and vb.ndim <= 2
