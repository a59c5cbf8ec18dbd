"""Scatter-adds of sharded rows into a zeros tensor: each rank adds its own rows, the sum is the whole.

An MoE layer's backward (Hugging Face's ``batched_mm`` experts, for one) forms each expert weight's gradient as
``index_put(new_zeros([E, ...]), [expert_of_row], grad_rows, accumulate=True)``. The rows (tokens) are
batch-sharded; the zeros are replicated. DTensor has no strategy with a partial base, so the rows would be
all-gathered (every token's per-expert gradient, many times the weights' size). But zeros are the identity
of a sum: the zeros may start as ``Partial("sum")`` at no cost, each rank scatter-adds its own rows into its
own copy, and the sum over ranks is the scatter-add of all rows: one all-reduce of the weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.ir import tensor_val
from fxpar.rules.registry import Candidate

aten = torch.ops.aten
ZEROS = {aten.new_zeros.default, aten.zeros_like.default}


def is_scatter_add(node: fx.Node) -> bool:
    return node.target is aten.index_put.default and len(node.args) > 3 and node.args[3] is True


def rows_sharded(node: fx.Node, placement_of: Callable[[fx.Node], Placement | None]) -> bool:
    """Whether every index tensor and the values of the scatter-add ``node`` are sharded on their rows."""
    _, indices, values = node.args[:3]
    rows = [i for i in indices if i is not None] + [values]
    return all(isinstance(placement_of(r), Shard) and placement_of(r).dim == 0 for r in rows)


def partial_zeros(node: fx.Node, placement_of: Callable[[fx.Node], Placement | None],
                  current: list[Placement]) -> Candidate | None:
    """``Partial("sum")`` for a zeros tensor whose every user scatter-adds rows sharded on this axis into it."""
    if node.target not in ZEROS or not node.users:
        return None
    for user in node.users:
        if not (is_scatter_add(user) and user.args[0] is node and rows_sharded(user, placement_of)):
            return None
    return Candidate(tuple(current), Partial())


def scatter_add_candidate(node: fx.Node, current: list[Placement]) -> Candidate | None:
    """A scatter-add with a partial base and row-sharded indices and values: a partial result."""
    if not is_scatter_add(node) or not current or not _is_sum(current[0]):
        return None
    if not all(isinstance(p, Shard) and p.dim == 0 for p in current[1:]):
        return None
    return Candidate(tuple(current), Partial())


def is_partial_scatter_add(node: fx.Node, cand: Candidate) -> bool:
    """Whether ``cand`` is ``scatter_add_candidate``'s: the one way a scatter-add keeps a partial base."""
    return len(cand.inputs) == _n_tensors(node) and cand == scatter_add_candidate(node, list(cand.inputs))


def _n_tensors(node: fx.Node) -> int:
    return sum(1 for a in pytree.tree_leaves((node.args, node.kwargs)) if tensor_val(a) is not None)


def _is_sum(p: Any) -> bool:
    return type(p) is Partial and p.reduce_op == "sum"
