"""Which ops keep a partial sum partial: ``propagate`` asks ``keeps_partial`` before it lets a candidate read a
``Partial("sum")`` input as a partial (no all-reduce first). An op may when it is linear in that input."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate

from fxpar.ir import tensor_val
from fxpar.rules.registry import Candidate
from fxpar.rules.scatter_add import is_partial_scatter_add

aten = torch.ops.aten

PARTIAL_LINEAR = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default, aten.transpose.int,
    aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
    aten.clone.default, aten.alias.default, aten.detach.default, aten.neg.default, aten.mul.Scalar,
    aten.div.Scalar, aten.sum.dim_IntList, aten.sum.default, aten.slice_backward.default, aten.slice.Tensor,
    aten.select.int, aten.narrow.default,
    aten.embedding_dense_backward.default,  # linear in the gradient (a batch-free position table)
    aten._weight_norm_interface_backward.default,  # linear in the weight's gradient (its rule's only partial input)
}
PARTIAL_SUMS = {aten.add.Tensor, aten.sub.Tensor}  # partial only if every tensor arg is partial
# linear in one argument while the other is replicated (which one may be partial is the candidate's, DTensor's,
# call); kept partial only for a scalar (a loss over sharded rows, ``fxpar.global_means``): on a larger value a
# greedy choice to stay partial can cost two all-reduces downstream where one was enough
PARTIAL_PRODUCTS = {aten.mul.Tensor, aten.div.Tensor}


def keeps_partial(node: fx.Node, cand: Candidate, kept_partial: list[bool]) -> bool:
    """Whether ``node`` under ``cand`` may read the inputs flagged in ``kept_partial`` as partial sums."""
    if node.target in PARTIAL_SUMS:
        return all(kept_partial)
    if node.target in PARTIAL_PRODUCTS and _is_scalar(node):
        return sum(kept_partial) == 1 and all(isinstance(p, (Partial, Replicate)) for p in cand.inputs)
    return node.target in PARTIAL_LINEAR or is_partial_scatter_add(node, cand) or is_float_cast(node)


def _is_scalar(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.ndim == 0


def is_float_cast(node: fx.Node) -> bool:
    """A cast between floating dtypes of 16 bits or more (mixed precision's casts): a partial sum stays partial
    through it, up to one rounding per rank, as FSDP2 reduces each rank's cast gradient; an fp8 cast does not."""
    if node.target is not aten._to_copy.default or set(node.kwargs) - {"dtype", "layout", "device"}:
        return False
    src, out = tensor_val(node.args[0]), node.meta.get("val")
    return (src is not None and isinstance(out, torch.Tensor) and src.device == out.device
            and all(t.dtype.is_floating_point and t.dtype.itemsize >= 2 for t in (src, out)))
