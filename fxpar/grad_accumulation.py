"""Gradients summed across a block's boundary, in the order a whole-model trace sums them.

autograd sums the gradient contributions of a tensor in the order they arrive, each onto the running sum:
``((acc + c1) + c2)``. When a block reads an outside tensor twice (a decoder layer's cross-attention reads the
encoder's output for its keys and for its values) and that tensor already holds a gradient from outside (the
next layer's, or the next pipeline stage's), the whole-model trace adds ``c1`` and then ``c2`` onto it. The
block traced alone sums its own two first (``c1 + c2``), and the model's graph adds that sum on: the same value
up to rounding, in another order, printed differently. ``fxpar.stitch`` rebuilds the whole-model order: it
starts the block's sum from the outside accumulator and drops the model's add (``absorbed``).

When the block's gradient of such a tensor is one contribution of its own (no sum inside the block), the
whole-model trace adds it onto the accumulator as soon as autograd has run the backward of the op that made it
(the nodes sharing its ``seq_nr``), in the middle of the block's backward; the model's graph adds it after the
whole block. ``fxpar.stitch`` emits the model's add where the whole-model trace has it (``added_after``).

A block's accumulation for input ``x`` is the chain of ``is_gradient_acc`` adds ending at ``x``'s gradient,
at most one fewer than ``x``'s uses in the block's forward (an add further down sums another tensor's
contributions, and stays as it is).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.fx as fx

from fxpar.ir import Provenance
from fxpar.source import traced_provenance

_ADD = torch.ops.aten.add.Tensor


def is_accumulation(n: Any) -> bool:
    """An add autograd made to sum two gradient contributions of one tensor (AOTAutograd marks it)."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is _ADD and \
        bool(n.meta.get("is_gradient_acc"))


def accumulation_chains(inputs: Mapping[fx.Node, int], grads: Mapping[int, fx.Node]) -> dict[int, fx.Node]:
    """For each block input whose gradient the block sums from several of its own contributions: the first add
    of that sum (``c1 + c2``), by the input's index."""
    placeholder_of = {i: ph for ph, i in inputs.items()}
    first: dict[int, fx.Node] = {}
    for i, grad in grads.items():
        ph = placeholder_of.get(i)
        if ph is None or any(u.op != "output" for u in grad.users):  # the sum is read inside: it stays the block's
            continue
        uses = sum(1 for u in ph.users if u.meta.get("partitioner_tag") != "is_backward")
        node, depth = grad, 0
        while depth < uses - 1 and is_accumulation(node) and (node is grad or len(node.users) == 1):
            first[i], node, depth = node, node.args[0], depth + 1
    return first


def absorbed(call: fx.Node, chains: Mapping[int, fx.Node], env: Mapping[fx.Node, Any]) -> dict[fx.Node, fx.Node]:
    """The model's accumulation adds onto ``call``'s gradients (a ``fxpar::block_backward`` node) that the block's
    own sum should start from instead: {the model's add: the first add of the block's sum}."""
    return {add: chains[index] for add, index in _outside_adds(call, env) if index in chains}


def added_after(call: fx.Node, rep_backward: list[fx.Node], chains: Mapping[int, fx.Node], grads: Mapping[int, fx.Node],
                env: Mapping[fx.Node, Any]) -> dict[fx.Node, tuple[fx.Node, fx.Node]]:
    """The model's accumulation adds onto ``call``'s gradients whose gradient is one contribution the block
    computes (no sum of its own: ``chains`` has none): {the model's add: (the contribution's node in
    ``rep_backward``, the last node of the op backward that computes it)}."""
    position = {r: i for i, r in enumerate(rep_backward)}
    out: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}
    for add, index in _outside_adds(call, env):
        contribution = grads.get(index)
        if index not in chains and contribution in position and all(u.op == "output" for u in contribution.users):
            out[add] = (contribution, _op_backward_end(rep_backward, position[contribution]))
    return out


def _outside_adds(call: fx.Node, env: Mapping[fx.Node, Any]) -> Iterator[tuple[fx.Node, int]]:
    """(the model's add, the op input whose gradient it adds) for each accumulation add of an accumulator already
    computed (``env``) onto one of ``call``'s gradients as the new contribution."""
    grad_inputs = call.args[4]
    for item in call.users:
        if item.target is not operator.getitem or len(item.users) != 1:
            continue
        add = next(iter(item.users))
        if is_accumulation(add) and add.args[1] is item and add.args[0] is not item and add.args[0] in env:
            yield add, grad_inputs[item.args[1]]


def _op_backward_end(nodes: list[fx.Node], i: int) -> fx.Node:
    """The last of the nodes from ``nodes[i]`` on that autograd made for the same op's backward (its ``seq_nr``)."""
    seq = nodes[i].meta.get("seq_nr")
    while seq is not None and i + 1 < len(nodes) and nodes[i + 1].meta.get("seq_nr") == seq \
            and not is_accumulation(nodes[i + 1]):
        i += 1
    return nodes[i]


def emitted_after(g: fx.Graph, adds: Mapping[fx.Node, tuple[fx.Node, fx.Node]], env: Mapping[fx.Node, Any],
                  renv: Mapping[fx.Node, fx.Node], take_name: Callable[[str], str], early: dict[fx.Node, fx.Node]
                  ) -> dict[fx.Node, list[Callable[[], None]]]:
    """For ``fxpar.stitch``'s copy of a block's backward: after which block node to emit each of the model's
    ``adds`` (``added_after``), as a callable that makes its copy in ``g`` (recorded in ``early``, so the model's
    own node is not copied again). ``env``/``renv``: the copies of the model's and the block's nodes so far."""
    then: dict[fx.Node, list[Callable[[], None]]] = {}
    for add, (contribution, end) in adds.items():
        def emit(add: fx.Node = add, contribution: fx.Node = contribution) -> None:
            new = g.create_node(add.op, add.target, (env[add.args[0]], renv[contribution]),
                                fx.map_arg(add.kwargs, lambda a: env[a]), name=take_name(add.name), type_expr=add.type)
            new.meta = dict(add.meta)  # the whole-model trace's add has the line of the op backward it follows
            own = traced_provenance(add)
            source = renv[contribution].meta["fxpar_provenance"].source  # (a block node's copy: stitch's meta)
            new.meta["fxpar_provenance"] = Provenance(own.module, source, own.phase)
            early[add] = new
        then.setdefault(end, []).append(emit)
    return then
