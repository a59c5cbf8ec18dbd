"""Overlap: issue each collective as early as its input exists and wait for it as late as its first use.

Lowering emits every collective as ``c = collective(x); y = wait(c)`` back to back. ``overlap`` reorders
one rank graph so the compute between the two runs while the collective is in flight (gloo runs
collectives on its own threads, NCCL on its own stream):

* every ``wait`` moves to just before its first user (the graph's output if it has none);
* every issue moves up to just after the last of its inputs, but never above the previous collective of
  the same process group (each group keeps the order every rank issues, so ``fxpar.verify``'s proof
  holds) and never below its own wait;
* a ZeRO-3 parameter all-gather (inputs: parameter shards only) of block ``b`` (``layers.<b>``) moves up
  no further than the first wait of block ``b - 1``'s gathers: the next block's parameters are prefetched
  while the current block computes (FSDP's one-block prefetch), not every block's at once;
* with ``one_per_group`` (gloo, i.e. CPU meshes) a group has at most one collective in flight: the wait of
  its previous collective moves up to just before the next issue. Gloo in torch 2.13 corrupts the heap now
  and then (glibc "malloc(): unaligned tcache chunk detected") when several functional collectives are in
  flight on one process group; one at a time per group, with other groups in flight beside it, it does so
  several times more rarely (``bench/gloo_in_flight.py``, bench/README.md section 12). Compute still runs
  while each collective is in flight. NCCL meshes keep every collective in flight as long as it can be.

Compute nodes keep their order and no value changes: results are bitwise those of the unreordered graph.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxpar.backends.comm import c10d, group_arg_index
from fxpar.ir import BLOCK

aten = torch.ops.aten
# layout-only ops that move with the collective they feed or unpack
CHEAP = {aten.movedim.int, aten.clone.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
         aten.cat.default, aten.slice.Tensor, aten.permute.default, aten.constant_pad_nd.default, aten.t.default,
         aten.transpose.int, aten.view.dtype}


def overlap(graph: fx.Graph, one_per_group: bool = False) -> int:
    """Reorder ``graph`` in place as the module docstring says; returns how many collectives end up with compute
    between their issue and their wait. ``one_per_group``: at most one collective in flight per group (gloo).

    The cheap layout copies that only prepare a collective's input (``movedim``, ``clone``, a bucket's
    ``cat``) move up with it, and those that only unpack its result (``slice``, ``view``) move down with
    its wait.
    """
    nodes = list(graph.nodes)
    issues = [n for n in nodes if group_arg_index(n.target) is not None]
    if not issues:
        return 0
    wait_of = {n.args[0]: n for n in nodes if n.target is c10d.wait_tensor.default and n.args[0] in set(issues)}
    prep = _prep_nodes(issues)
    order = [n for n in nodes if n not in set(issues) and n not in prep]
    for p in (n for n in nodes if n in prep):  # hoisted: right after their last input
        order.insert(max((order.index(a) for a in p.all_input_nodes), default=0) + 1, p)
    _sink_results(order, set(wait_of.values()), prep | set(issues))
    prefetch_bound = _prefetch_bounds(issues, wait_of, order)
    last_in_group: dict[str, fx.Node] = {}
    for c in issues:
        group = c.args[group_arg_index(c.target)]
        bound = max((order.index(a) for a in c.all_input_nodes), default=0)
        if group in last_in_group:
            bound = max(bound, order.index(last_in_group[group]))
        if c in prefetch_bound:
            bound = max(bound, order.index(prefetch_bound[c]))
        pos = bound + 1
        if c in wait_of:
            pos = min(pos, order.index(wait_of[c]))
        order.insert(pos, c)
        last_in_group[group] = c
    if one_per_group:
        _one_in_flight_per_group(order, wait_of)
    _apply(graph, order)
    return sum(1 for c, w in wait_of.items() if order.index(w) - order.index(c) > 1)


def _prep_nodes(issues: list[fx.Node]) -> set[fx.Node]:
    """Cheap layout nodes used only to build some collective's input."""
    prep: set[fx.Node] = set()
    for c in issues:
        stack = list(c.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in prep or n.target not in CHEAP or not all(u in prep or u is c for u in n.users):
                continue
            prep.add(n)
            stack.extend(n.all_input_nodes)
    return prep


def _sink_results(order: list[fx.Node], waits: set[fx.Node], feeding: set[fx.Node]) -> None:
    """Move every wait, and the cheap nodes computed from waits alone, to just before their first user; a node
    that feeds a collective (``feeding``: issues and their input copies) stays where the collective needs it."""
    sinkable = set()
    for n in order:
        if (n in waits or (n.target in CHEAP and n.all_input_nodes and all(a in sinkable for a in n.all_input_nodes))) \
                and n not in feeding and not any(u in feeding for u in n.users):
            sinkable.add(n)
    for n in reversed([n for n in order if n in sinkable]):
        order.remove(n)
        order.insert(_first_use(order, n), n)


def _prefetch_bounds(issues: list[fx.Node], wait_of: dict[fx.Node, fx.Node], order: list[fx.Node]
                     ) -> dict[fx.Node, fx.Node]:
    """For each ZeRO-3 gather of block ``b``: the first wait among block ``b - 1``'s gathers."""
    by_block: dict[tuple[str, int], list[fx.Node]] = {}
    for c in issues:
        if _is_param_gather(c) and c in wait_of:
            m = BLOCK.match(c.meta.get("module", ""))
            if m:
                by_block.setdefault((m.group(1), int(m.group(2))), []).append(c)
    bounds = {}
    for (prefix, b), gathers in by_block.items():
        previous = by_block.get((prefix, b - 1))
        if previous:
            first_wait = min((wait_of[p] for p in previous), key=order.index)
            bounds.update(dict.fromkeys(gathers, first_wait))
    return bounds


def _is_param_gather(c: fx.Node) -> bool:
    """An all-gather whose input comes from ZeRO-3 shard placeholders alone (through moves and copies)."""
    if c.target is not c10d.all_gather_into_tensor.default:
        return False
    stack, seen = list(c.all_input_nodes), set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if not n.meta.get("zero3_shard"):
                return False
        else:
            stack.extend(n.all_input_nodes)
    return True


def _one_in_flight_per_group(order: list[fx.Node], wait_of: dict[fx.Node, fx.Node]) -> None:
    """Move the wait of a group's in-flight collective up to just before the group's next issue."""
    in_flight: dict[str, fx.Node] = {}
    i = 0
    while i < len(order):
        n = order[i]
        index = group_arg_index(n.target)
        if index is not None:
            group = n.args[index]
            previous = in_flight.pop(group, None)
            if previous is not None:  # its wait is still below n
                order.remove(wait_of[previous])
                order.insert(i, wait_of[previous])
                i += 1
            if n in wait_of:
                in_flight[group] = n
        elif n.target is c10d.wait_tensor.default:
            for group, c in list(in_flight.items()):
                if wait_of[c] is n:
                    del in_flight[group]
        i += 1


def _first_use(order: list[fx.Node], node: fx.Node) -> int:
    users = set(node.users)
    return next(i for i, n in enumerate(order) if n in users or n.op == "output")


def _apply(graph: fx.Graph, order: list[fx.Node]) -> None:
    anchor = order[0]
    for n in order[1:]:
        if anchor.next is not n:
            anchor.append(n)
        anchor = n


def inline_reduction(backward: fx.Graph, reduce: fx.Graph, positions: list[int]) -> None:
    """Append the ``reduce_grads`` graph to ``backward``: its placeholders become the backward's gradient
    outputs at ``positions`` and those outputs become its results (the reduction runs inside the backward)."""
    out = backward.output_node()
    outs = list(out.args[0])
    phs = [n for n in reduce.nodes if n.op == "placeholder"]
    env: dict[fx.Node, fx.Node] = {ph: outs[pos] for ph, pos in zip(phs, positions, strict=True)}
    with backward.inserting_before(out):
        for n in reduce.nodes:
            if n.op not in ("placeholder", "output"):
                env[n] = backward.node_copy(n, lambda a: env[a])
    for pos, result in zip(positions, reduce.output_node().args[0], strict=True):
        outs[pos] = env[result]
    out.args = (tuple(outs),)
