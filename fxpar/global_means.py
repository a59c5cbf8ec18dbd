"""Means over a whole tensor as a sum, then a division: the same values, and a sum of sharded pieces stays a
partial sum (one scalar all-reduced) where a mean of pieces would first gather the whole tensor.

A model that computes its own loss (Hugging Face's ``model(input_ids, labels=labels).loss``, an auxiliary
``x.pow(2).mean()``) ends in such a mean over the batch. Left as a mean, a batch-sharded input has no cheap
placement: DTensor's ``Partial("avg")`` of a loss is biased when shards hold different numbers of counted
targets (``ignore_index``) or rows, so propagation gathers the whole input over dp, which for the logits of
a language model is ``tokens x vocab`` per rank. Rewritten, each rank sums its own rows and the sums are
reduced: the ledger moves a scalar, and the loss is the global one.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.simplify import copy_meta

aten = torch.ops.aten
MEAN, SUM = 1, 2  # ATen's loss reductions (``torch.nn._reduction``)
EXACT_DTYPES = {torch.float32, torch.float64}  # where ATen's mean is exactly its sum divided by the count


def means_as_sums(gm: fx.GraphModule) -> int:
    """Rewrite the joint graph ``gm`` in place; return how many means were rewritten.

    * ``nll_loss_forward(x, t, w, reduction=mean)`` -> ``nll_loss_forward(x, t, w, reduction=sum)`` and the
      sum divided by its ``total_weight`` (what the kernel computes; the backward reads the same total weight);
    * ``mean(x)`` over every element, of a float32/64 ``x`` -> ``sum(x) / x.numel()`` (ATen's mean; a
      lower-precision mean accumulates in float32 and rounds once, so it stays as it is).

    Requires: forward nodes carry ``val`` meta. Ensures: every value of the graph is bitwise what it was on one
    device; the new nodes take the replaced node's meta (provenance, phase).
    """
    rewritten = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.nll_loss_forward.default and len(n.args) == 5 and n.args[3] == MEAN and not n.kwargs:
            _nll_loss_as_sum(gm.graph, n)
            rewritten += 1
        elif n.target is aten.mean.default and len(n.args) == 1 and not n.kwargs \
                and n.args[0].meta["val"].dtype in EXACT_DTYPES:
            _mean_as_sum(gm.graph, n)
            rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten


def _nll_loss_as_sum(graph: fx.Graph, n: fx.Node) -> None:
    x, t, w, _, ignore_index = n.args
    out, total_weight = n.meta["val"]
    with graph.inserting_before(n):
        summed = _call(graph, n, aten.nll_loss_forward.default, (x, t, w, SUM, ignore_index), n.meta["val"])
        loss_sum = _call(graph, n, operator.getitem, (summed, 0), out)
        weight = _call(graph, n, operator.getitem, (summed, 1), total_weight)
        loss = _call(graph, n, aten.div.Tensor, (loss_sum, weight), out)
    for user in list(n.users):
        if user.target is not operator.getitem:
            raise AssertionError(f"{n.name} is read whole by {user.name}")
        user.replace_all_uses_with(loss if user.args[1] == 0 else weight)
        graph.erase_node(user)
    graph.erase_node(n)


def _mean_as_sum(graph: fx.Graph, n: fx.Node) -> None:
    (x,) = n.args
    with graph.inserting_before(n):
        total = _call(graph, n, aten.sum.default, (x,), n.meta["val"])
        mean = _call(graph, n, aten.div.Scalar, (total, x.meta["val"].numel()), n.meta["val"])
    n.replace_all_uses_with(mean)
    graph.erase_node(n)


def _call(graph: fx.Graph, like: fx.Node, target: object, args: tuple, val: object) -> fx.Node:
    new = graph.call_function(target, args)
    copy_meta(new, like, val)
    return new
