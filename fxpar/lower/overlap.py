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
* ``in_flight`` bounds how many collectives run at once. ``"many"`` (NCCL meshes) keeps every collective in
  flight as long as it can be. ``"group"`` keeps at most one in flight per process group and ``"process"``
  (gloo, i.e. CPU meshes: ``gloo_in_flight()``) at most one in the whole rank program: the wait of the
  previous collective moves up to just before the next issue. ``"none"`` leaves every wait right after its
  issue. Gloo in torch 2.13 corrupts the heap now and then (glibc "malloc(): unaligned tcache chunk
  detected"), and a rank dies: in ``bench/gloo_in_flight.py`` (bench/README.md section 12) about once per
  70,000 batches of functional collectives with several in flight on one process group, once per 180,000
  with one per group on two groups, once in about 790,000 with one per process, and once in about 200,000
  with each waited right after its issue. No setting of the functional ops is free of it; one per process has
  the fewest losses per batch and still runs compute beside each collective, and the same loop through the
  classic ``torch.distributed`` API lost no rank in a million batches, so gloo rank programs run these
  collectives through it when they are bound (``fxpar.backends.classic``). ``FXPAR_GLOO_IN_FLIGHT`` picks
  another setting.

Compute nodes keep their order and no value changes: results are bitwise those of the unreordered graph.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Literal, get_args

import torch
import torch.fx as fx

from fxpar.backends.comm import c10d, group_arg_index
from fxpar.ir import block_entry

aten = torch.ops.aten
InFlight = Literal["many", "group", "process", "none"]
GLOO_IN_FLIGHT: InFlight = "process"  # the fewest ranks lost per batch of collectives (bench/README.md section 12)
GLOO_ENV = "FXPAR_GLOO_IN_FLIGHT"
# layout-only ops that move with the collective they feed or unpack
CHEAP = {aten.movedim.int, aten.clone.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
         aten.cat.default, aten.slice.Tensor, aten.permute.default, aten.constant_pad_nd.default, aten.t.default,
         aten.transpose.int, aten.view.dtype}


def gloo_in_flight() -> InFlight:
    """How many collectives a rank program on gloo keeps in flight: ``$FXPAR_GLOO_IN_FLIGHT``, else
    ``GLOO_IN_FLIGHT``."""
    value = os.environ.get(GLOO_ENV, GLOO_IN_FLIGHT)
    if value not in get_args(InFlight):
        raise ValueError(f"{GLOO_ENV}={value!r}: expected one of {', '.join(get_args(InFlight))}")
    return value  # type: ignore[return-value]


def overlap(graph: fx.Graph, in_flight: InFlight = "many") -> int:
    """Reorder ``graph`` in place as the module docstring says; returns how many collectives end up with compute
    between their issue and their wait. ``in_flight``: ``"many"``, at most one per ``"group"`` or ``"process"``,
    or ``"none"`` (each wait moves to right after its issue, where lowering emits it).

    The cheap layout copies that only prepare a collective's input (``movedim``, ``clone``, a bucket's
    ``cat``) move up with it, and those that only unpack its result (``slice``, ``view``) move down with
    its wait. Time is linear in the graph (``_Order``): an 80-layer rank graph has tens of thousands of nodes.
    """
    nodes = list(graph.nodes)
    issue_set = {n for n in nodes if group_arg_index(n.target) is not None}
    issues = [n for n in nodes if n in issue_set]
    if not issues:
        return 0
    wait_of = {n.args[0]: n for n in nodes if n.target is c10d.wait_tensor.default and n.args[0] in issue_set}
    if in_flight == "none":  # each wait right after its issue
        for c in issues:
            if c in wait_of:
                c.append(wait_of[c])
        return 0
    prep = _prep_nodes(issues)
    order = _Order([n for n in nodes if n not in issue_set and n not in prep])
    first = order.first()
    for p in (n for n in nodes if n in prep):  # hoisted: right after their last input
        order.insert_after(max(p.all_input_nodes, key=order.pos, default=first), p)
    _sink_results(order, set(wait_of.values()), prep | issue_set)
    prefetch_bound = _prefetch_bounds(issues, wait_of, order)
    last_in_group: dict[str, fx.Node] = {}
    for c in issues:
        group = c.args[group_arg_index(c.target)]
        bounds = [*c.all_input_nodes, *([last_in_group[group]] if group in last_in_group else []),
                  *([prefetch_bound[c]] if c in prefetch_bound else [])]
        bound = max(bounds, key=order.pos, default=first)
        if c in wait_of and order.pos(wait_of[c]) <= order.pos(bound):
            order.insert_before(wait_of[c], c)
        else:
            order.insert_after(bound, c)
        last_in_group[group] = c
    if in_flight != "many":
        _one_in_flight(order, wait_of, per_group=in_flight == "group")
    _apply(graph, list(order))
    return sum(1 for c, w in wait_of.items() if order.after(c) is not w)


_SPACING = 1 << 256


class _Order:
    """A node order with constant-time moves and position comparisons: a doubly linked list whose nodes carry
    increasing integer keys, ``2**256`` apart (an insertion takes the midpoint of its neighbours; the keys are
    respaced when no integer is left between two of them: after 256 insertions at one place, where float keys
    ran out after about 40 and respaced an 80-layer backward a dozen times)."""

    def __init__(self, nodes: list[fx.Node]) -> None:
        self._next: dict[fx.Node | None, fx.Node | None] = {}
        self._prev: dict[fx.Node | None, fx.Node | None] = {}
        self._key: dict[fx.Node, int] = {}
        prev = None
        for n in nodes:
            self._link(prev, n, None)
            prev = n
        self._respace()

    def first(self) -> fx.Node | None:
        return self._next.get(None)

    def after(self, n: fx.Node) -> fx.Node | None:
        return self._next[n]

    def pos(self, n: fx.Node) -> int:
        return self._key[n]

    def __iter__(self) -> Iterator[fx.Node]:
        n = self._next.get(None)
        while n is not None:
            yield n
            n = self._next[n]

    def remove(self, n: fx.Node) -> None:
        before, after = self._prev.pop(n), self._next.pop(n)
        self._next[before], self._prev[after] = after, before
        del self._key[n]

    def insert_after(self, anchor: fx.Node | None, n: fx.Node) -> None:
        """Insert ``n`` right after ``anchor`` (at the front for ``None``)."""
        self._link(anchor, n, self._next.get(anchor))
        low = self._key[anchor] if anchor is not None else 0
        high = self._key[self._next[n]] if self._next[n] is not None else low + 2 * _SPACING
        self._key[n] = (low + high) // 2
        if not low < self._key[n] < high:
            self._respace()

    def insert_before(self, anchor: fx.Node, n: fx.Node) -> None:
        self.insert_after(self._prev[anchor], n)

    def _link(self, before: fx.Node | None, n: fx.Node, after: fx.Node | None) -> None:
        self._next[before], self._prev[n], self._next[n], self._prev[after] = n, before, after, n

    def _respace(self) -> None:
        self._key = {n: (i + 1) * _SPACING for i, n in enumerate(self)}


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


def _sink_results(order: _Order, waits: set[fx.Node], feeding: set[fx.Node]) -> None:
    """Move every wait, and the cheap nodes computed from waits alone, to just before their first user; a node
    that feeds a collective (``feeding``: issues and their input copies) stays where the collective needs it."""
    sinkable, sinkable_set = [], set()
    for n in order:
        if (n in waits or (n.target in CHEAP and n.all_input_nodes
                           and all(a in sinkable_set for a in n.all_input_nodes))) \
                and n not in feeding and not any(u in feeding for u in n.users):
            sinkable.append(n)
            sinkable_set.add(n)
    for n in reversed(sinkable):
        order.remove(n)
        order.insert_before(_first_use(order, n), n)


def _prefetch_bounds(issues: list[fx.Node], wait_of: dict[fx.Node, fx.Node], order: _Order
                     ) -> dict[fx.Node, fx.Node]:
    """For each ZeRO-3 gather of block ``b``: the first wait among block ``b - 1``'s gathers."""
    by_block: dict[tuple[str, int], list[fx.Node]] = {}
    for c in issues:
        if _is_param_gather(c) and c in wait_of:
            entry = block_entry(c.meta.get("module", ""))
            if entry:
                by_block.setdefault(entry, []).append(c)
    bounds = {}
    for (prefix, b), gathers in by_block.items():
        previous = by_block.get((prefix, b - 1))
        if previous:
            first_wait = min((wait_of[p] for p in previous), key=order.pos)
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


def _one_in_flight(order: _Order, wait_of: dict[fx.Node, fx.Node], per_group: bool) -> None:
    """Move the wait of an in-flight collective up to just before the next issue: of its group (``per_group``),
    else of any group."""
    in_flight: dict[str, fx.Node] = {}
    waiting = {w: c for c, w in wait_of.items()}
    for n in list(order):
        index = group_arg_index(n.target)
        if index is not None:
            group = n.args[index] if per_group else ""
            previous = in_flight.pop(group, None)
            if previous is not None:  # its wait is still below n
                order.remove(wait_of[previous])
                order.insert_before(n, wait_of[previous])
            if n in wait_of:
                in_flight[group] = n
        elif n in waiting:
            for group, c in list(in_flight.items()):
                if c is waiting[n]:
                    del in_flight[group]


def _first_use(order: _Order, node: fx.Node) -> fx.Node:
    """The first of ``node``'s users in ``order``, or the graph's output."""
    return min([*node.users, node.graph.output_node()], key=order.pos)


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
