"""Predicted memory per rank, read off the lowered programs (no execution).

``pm.memory(rank)`` counts what one training step keeps resident on ``rank``:

* ``params``: the local shards of every parameter the rank holds (each once, also when a tied
  weight sits on two of its stages); with ZeRO-1 (``Plan(zero=1)``) a dp-sharded parameter counts
  its shard plus the tp-local copy gathered for the step (``4 Psi / N + 4 Psi`` in fp32; also ZeRO-2);
  under mixed precision that copy is gathered in ``param_dtype`` (``4 Psi / N + 2 Psi`` with bf16);
  with ZeRO-3 only the shard (``4 Psi / N``): the graphs gather each parameter where they use it,
  and those gathered copies count in ``transient``;
* ``grads``: one gradient per trainable parameter, the same size as its shard; with ZeRO-1 the
  accumulated tp-local gradient plus its reduce-scattered shard in ``.grad`` (``4 Psi + 4 Psi / N``);
  with ZeRO-2 and 3 only the shard (``4 Psi / N``): one backward's whole gradients are reduce-scattered
  right away and counted in ``transient``;
* ``optimizer``: Adam-like, two states per trainable parameter shard (``exp_avg``, ``exp_avg_sq``), in the
  parameter's dtype (``8 Psi / N`` with ZeRO-1, 2 and 3). torch's per-parameter ``step`` counters (one scalar
  each) are not counted;
* ``activations``: the tensors each forward saves for its backward, times the microbatches the
  schedule keeps in flight on this rank (stage by stage, the schedule's own order). A saved value
  that is a parameter, a buffer, an input or a view of one adds nothing; views of one saved tensor
  count once. A backward that runs as halves (zero-bubble schedules; under any schedule, a stage whose
  input gradient goes to another rank: ``fxpar.rank_step.backward_halves``) releases its set after its
  ``W`` (an upper bound: some of it dies at ``B``) and holds what ``W`` reads from ``B`` in between. Pipeline
  transfers count too: a received activation until its forward (until its backward ends when the forward
  saves it), a received gradient until its backward, a sent activation or gradient until a receive proves it
  arrived (``fxpar.schedules.arrivals``; an activation at the latest when its gradient comes back), else until
  the step's sends are awaited;
* ``transient``: the largest set of temporaries alive at once inside one forward or backward graph,
  beyond its inputs (liveness over the graph's node order; a view is free; a backward's output cut from a
  larger buffer keeps the rest of it alive until the graph returns); with several microbatches, a backward's
  own parameter gradients beside the running sums, and the dp reduction's bucket after the last backward;
* ``buffers``: the module's copy of every buffer the rank's stages read (BatchNorm's running statistics, rotary
  tables; each once), whole, in its dtype (``fxpar.params.stage_buffer_values``);
* ``peak`` = params + grads + optimizer + activations + transient + buffers.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxpar.rank_step import backward_halves, rank_step
from fxpar.split import splitter

if TYPE_CHECKING:
    from fxpar.compiled import Compiled
    from fxpar.ir import Program
    from fxpar.lower.program import RankProgram

aten = torch.ops.aten

# ops whose output shares its input's storage
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int, aten.permute.default,
            aten.expand.default, aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
            aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.detach.default, aten.as_strided.default,
            aten.unflatten.int, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int,
            aten.chunk.default, aten.narrow.default, aten.diagonal.default}


@dataclass(frozen=True)
class Memory:
    """Bytes per rank for one training step (see the module docstring for what each counts)."""

    rank: int
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    buffers: int = 0

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.transient + self.buffers

    def __str__(self) -> str:
        rows = [("params", self.params), ("grads", self.grads), ("optimizer (Adam, 2 states)", self.optimizer),
                ("activations (saved, in flight)", self.activations), ("transient (largest graph)", self.transient),
                ("buffers", self.buffers), ("peak", self.peak)]
        width = max(len(name) for name, _ in rows)
        lines = [f"memory of rank {self.rank} (bytes)"]
        lines += [f"  {name:<{width}}  {value:>14,}  {_mib(value):>10}" for name, value in rows]
        return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def predict(c: Compiled, rank: int) -> Memory:
    """``pm.memory(rank)``: the rank's predicted bytes (lowers the rank's programs if not yet built)."""
    stages = c.stage_of_rank(rank)
    param_bytes: dict[str, int] = {}
    grad_bytes: dict[str, int] = {}
    state_bytes: dict[str, int] = {}
    whole_grads: dict[int, int] = {}  # per stage: bytes of one backward's unreduced gradients of dp shards
    saved: dict[int, int] = {}
    stash: dict[int, int] = {}  # per stage whose backward runs as halves: what W reads from B
    shared: dict[int, int] = {}  # of it, what B also sends (counted with the send, freed when both are done)
    kept: dict[int, _Boundary] = {}
    halves = backward_halves(c, rank)
    transient = 0
    buffer_bytes: dict[str, int] = {}
    for s in stages:
        prog, rp = c.stages[s], c.rank_program(rank, s)
        for fqn, name in prog.signature.buffers:
            val = prog.node(name).meta["val"]
            buffer_bytes[fqn] = val.numel() * val.element_size()
        placeholders = [n for n in rp.forward.graph.nodes if n.op == "placeholder"]
        trainable = {fqn for fqn, _ in prog.signature.grads}
        for (fqn, name), node in zip(prog.signature.params, placeholders, strict=False):
            master = prog.node(name).meta["val"].element_size()  # the master weight keeps its dtype
            numel, own = zero_numels(c, prog, rank, fqn, name) if fqn in rp.zero else (node.meta["val"].numel(),) * 2
            full, shard = numel * master, own * master
            # a ZeRO-1/2 working copy (the forward's placeholder) may be gathered in param_dtype; ZeRO-3 gathers
            # inside the graphs
            working_copy = numel * node.meta["val"].element_size() if fqn in rp.zero and c.plan.zero < 3 else 0
            param_bytes[fqn] = shard + working_copy
            if fqn in trainable:  # ZeRO-1 keeps the summed whole gradient until the step's end; ZeRO-2 does not
                state_bytes[fqn] = 2 * shard  # a frozen parameter gets no gradient, so Adam keeps no state for it
                grad_bytes[fqn] = shard + (full if fqn in rp.zero and c.plan.zero == 1 else 0)
                whole_grads[s] = whole_grads.get(s, 0) + (full if fqn in rp.zero else 0)
        saved[s] = saved_bytes(rp.forward, prog.signature.num_outputs)
        kept[s] = _boundary(prog, rp, last=s == len(c.stages) - 1)
        unreduced = whole_grads.get(s, 0) if c.plan.zero >= 2 else 0
        grads_at = [idx - prog.signature.num_outputs for _, idx in prog.signature.grads]
        if s in halves:  # B, then W reading B's stash (``fxpar.rank_step.backward_halves``)
            b, w = c.stage_graph(rank, s, "backward_b"), c.stage_graph(rank, s, "backward_w")
            stash[s], shared[s] = stash_bytes(b, len(prog.signature.input_grads))
            fresh = _fresh_grads(c, w, [p - len(prog.signature.input_grads) for p in grads_at])
            backward_end = max(largest_live_set(b), largest_live_set(w, output_excess=True) + unreduced + fresh)
        else:
            fresh = _fresh_grads(c, rp.backward, grads_at)
            backward_end = largest_live_set(rp.backward, output_excess=True) + unreduced + fresh
        transient = max(transient, largest_live_set(rp.forward), backward_end, _reduction(rp.reduce_grads))
    return Memory(rank, sum(param_bytes.values()), sum(grad_bytes.values()), sum(state_bytes.values()),
                  _activations_in_flight(c, rank, saved, stash, kept, shared), transient, sum(buffer_bytes.values()))


def zero_numels(c: Compiled, prog: Program, rank: int, fqn: str, name: str) -> tuple[int, int]:
    """(elements of the tp-local parameter, elements of ``rank``'s dp shard of it) for a ZeRO parameter ``fqn``
    (placeholder ``name``): the pieces differ where dp does not divide its dim (``fxpar.split``)."""
    split = splitter(prog)
    coord = c.mesh.coord(rank)
    shape = split.local_shape(prog.node(name).meta["val"].shape, prog.placements[name], coord)
    d, ax = prog.notes["zero"][fqn], c.mesh.axis_index("dp")
    numel = 1
    for size in shape:
        numel *= size
    return numel, numel // shape[d] * split.sizes(shape[d], ax)[coord[ax]] if shape[d] else 0


def _fresh_grads(c: Compiled, backward: fx.GraphModule, positions: list[int]) -> int:
    """Bytes of one backward's parameter gradients held beside the running sums (``fxpar.grad_sums``): with more
    than one microbatch, every backward after the first returns its own before they are added in (ZeRO-2 and 3
    reduce them first: counted as ``unreduced``)."""
    if c.microbatches == 1 or c.plan.zero >= 2:
        return 0
    outs = backward.graph.output_node().args[0]
    roots = {storage_root(outs[p]) for p in positions if isinstance(outs[p], fx.Node)}
    return sum(nbytes(r) for r in roots if r.op == "call_function")


def _reduction(reduce: fx.GraphModule | None) -> int:
    """The temporaries of the gradient reduction run after the backwards (``reduce_grads``) beside the sums it
    reads: the bucket it concatenates and the collective's result its outputs are slices of."""
    return 0 if reduce is None else largest_live_set(reduce)


def saved_per_microbatch(c: Compiled, rank: int) -> int:
    """Bytes one forward of each of ``rank``'s stages saves for its backward, summed over the stages: the part of
    ``activations`` a recompute policy, sequence or context parallelism changes (without what the schedule keeps in
    flight, the transfers and the last stage's output gradients)."""
    return sum(saved_bytes(c.rank_program(rank, s).forward, c.stages[s].signature.num_outputs)
               for s in c.stage_of_rank(rank))


def nbytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def unread_outputs_bytes(node: fx.Node) -> int:
    """Bytes of the tensors a multi-output op returns that no ``getitem`` takes: the kernel allocates them all (the
    whole float output ``native_dropout`` computes beside the mask a rank program keeps, a layer norm's unused
    statistics; an item taken but never read is the same), and they are freed with the tuple."""
    val = node.meta.get("val")
    if node.op != "call_function" or not isinstance(val, (tuple, list)):
        return 0
    taken = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
    return sum(v.numel() * v.element_size() for i, v in enumerate(val)
               if isinstance(v, torch.Tensor) and i not in taken)


def storage_root(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` uses: follows view ops (and items of a split) back to their base."""
    while node.op == "call_function":
        if node.target in VIEW_OPS and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        elif node.target is operator.getitem and isinstance(node.args[0], fx.Node) \
                and node.args[0].op == "call_function" and node.args[0].target in VIEW_OPS:
            node = node.args[0]
        else:
            break
    return node


def saved_roots(forward: fx.GraphModule, num_outputs: int) -> set[fx.Node]:
    """The storage roots of what the forward graph saves for backward (its outputs after ``num_outputs``)."""
    return {storage_root(o) for o in forward.graph.output_node().args[0][num_outputs:] if isinstance(o, fx.Node)}


def saved_bytes(forward: fx.GraphModule, num_outputs: int) -> int:
    """Bytes of new storage the forward graph saves for backward (placeholders and their views excluded)."""
    return sum(nbytes(r) for r in saved_roots(forward, num_outputs) if r.op != "placeholder")


def stash_bytes(b: fx.GraphModule, n_input_grads: int) -> tuple[int, int]:
    """Bytes of new storage a backward's ``B`` half hands its ``W`` half (its outputs after the input gradients),
    as (held by the stash alone, also an input gradient ``B`` sends: a gradient a long skip passes through
    unchanged that a weight gradient reads too; one storage, alive until both are done with it)."""
    outs = b.graph.output_node().args[0]
    sent = {storage_root(o) for o in outs[:n_input_grads] if isinstance(o, fx.Node)}
    roots = {storage_root(o) for o in outs[n_input_grads:] if isinstance(o, fx.Node)}
    new = [r for r in roots if r.op != "placeholder"]
    return sum(nbytes(r) for r in new if r not in sent), sum(nbytes(r) for r in new if r in sent)


def largest_live_set(gm: fx.GraphModule, output_excess: bool = False) -> int:
    """Max over the graph's node order of the bytes of temporaries alive at once (not inputs, not outputs).

    ``output_excess``: an output that is a slice of a larger buffer (a rank's gradient shard cut from a gradient
    computed whole) keeps the rest of that buffer alive from its creation to the graph's end; count that rest
    (the backward's outputs are counted elsewhere at their own size; a forward's saved buffers count whole)."""
    nodes = list(gm.graph.nodes)
    outs = [o for o in gm.graph.output_node().args[0] if isinstance(o, fx.Node)]
    outputs = {storage_root(o) for o in outs}
    excess = _output_excess(outs) if output_excess else {}
    last_use: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[storage_root(a)] = i
    live = peak = 0
    alive: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        root = storage_root(n)
        if n.op == "call_function" and root is n and n not in outputs and n in last_use:
            alive[n] = nbytes(n) + unread_outputs_bytes(n)  # a tuple lives until its last item is taken
            live += alive[n]
        live += excess.get(n, 0)  # never released before the graph returns
        dropped = unread_outputs_bytes(n) if n not in last_use and root is n else 0  # allocated, freed at once
        peak = max(peak, live + dropped)
        for a in [a for a, end in last_use.items() if end == i and a in alive]:
            live -= alive.pop(a)
    return peak


def _output_excess(outs: list[fx.Node]) -> dict[fx.Node, int]:
    """Output storage roots -> their bytes beyond the distinct outputs that view them (none for a bucket its
    slices fill)."""
    used: dict[fx.Node, int] = {}
    for o in dict.fromkeys(outs):
        root = storage_root(o)
        used[root] = used.get(root, 0) + nbytes(o)
    return {root: nbytes(root) - n for root, n in used.items() if root.op == "call_function" and nbytes(root) > n}


@dataclass(frozen=True)
class _Boundary:
    """What a stage's transfers keep alive beyond its saved set."""

    saved_received: frozenset[int]  # positions of the received values the forward saves (kept until its backward)
    sent_forward: int  # bytes of forward outputs nothing else keeps: held by their send until the gradient returns
    output_grads: int  # the last stage: its outputs' gradients, made with the loss at F and read by the backward


def _boundary(prog: Program, rp: RankProgram, last: bool) -> _Boundary:
    """The rank forward's placeholders are the parameters, the buffers, then the received values (in
    ``fxpar.rank_step.boundary_meta``'s order) and the user's inputs."""
    num_outputs = prog.signature.num_outputs
    roots = saved_roots(rp.forward, num_outputs)
    sent = sum(nbytes(o) for o in rp.forward.graph.output_node().args[0][:num_outputs] if isinstance(o, fx.Node)
               and storage_root(o) not in roots and storage_root(o).op != "placeholder")
    fixed = len(prog.signature.params) + len(prog.signature.buffers)
    placeholders = list(rp.forward.graph.find_nodes(op="placeholder"))
    saved = frozenset(i - fixed for i, n in enumerate(placeholders) if i >= fixed and n in roots)
    tangents = sum(nbytes(n) for n in rp.backward.graph.find_nodes(op="placeholder") if n.name.startswith("tangents"))
    return _Boundary(saved, sent, tangents if last else 0)


def _activations_in_flight(c: Compiled, rank: int, saved: dict[int, int], stash: dict[int, int],
                           kept: dict[int, _Boundary], shared: dict[int, int]) -> int:
    """Peak bytes over the rank's step events of what outlives one graph: F adds its stage's saved set, the backward
    that finishes it (``backward`` or ``backward_w``) frees it; a ``B`` of a split backward adds its stash until its
    ``W``. Transfers: a received activation lives until its forward (or, saved, until its backward ends), a
    received gradient until that backward; a forward send holds its buffer until the gradient comes back (the
    executor awaits it there) and a backward send until the step's ``wait_sends``, unless a receive proves either
    arrived earlier (``wait_SEND_F``, ``wait_SEND_B``); what a send moves is counted from the return of the graph
    that made it, where it lives beside that graph's inputs."""
    live = peak = 0
    until_forward: dict[tuple[int, int], int] = {}
    until_backward: dict[tuple[int, int], int] = {}
    forward_sends: dict[tuple[int, int], int] = {}
    back_sends: dict[tuple[int, int], int] = {}  # held until their wait_SEND_B, or the step's wait_sends
    events = rank_step(c, rank)
    # what a forward (F) or a backward (B) makes for its send, alive from the graph's return (the send takes it over)
    sends_of = {(e.kind[-1], e.stage, e.mb): kept[e.stage].sent_forward if e.kind == "SEND_F"
                else sum(cm.row.bytes for cm in e.comms) for e in events if e.kind in ("SEND_F", "SEND_B")}
    made: dict[tuple[str, int, int], int] = {}
    holders: dict[tuple[int, int], list[int]] = {}  # a sent gradient W reads too: [bytes, holders left (send, W)]

    def release(key: tuple[int, int]) -> int:
        """One holder of ``key``'s shared storage is done: its bytes once the other is done too (else 0)."""
        held = holders.get(key)
        if held is None:
            return 0
        held[1] -= 1
        return holders.pop(key)[0] if held[1] == 0 else 0

    def send_done(key: tuple[int, int], sent: int) -> int:  # the send's bytes, less a storage W still reads
        return sent - (holders[key][0] if key in holders else 0) + release(key)

    for e in events:
        after = 0  # freed once the event is over
        key = (e.stage, e.mb)
        if e.kind == "RECV_F":
            receiver = e.stage + 1
            for position, cm in enumerate(e.comms):  # in ``fxpar.rank_step.boundary_meta``'s order, as the placeholders
                held = until_backward if position in kept[receiver].saved_received else until_forward
                held[(receiver, e.mb)] = held.get((receiver, e.mb), 0) + cm.row.bytes
                live += cm.row.bytes
        elif e.kind == "RECV_B":  # the gradient arrives, then the executor awaits the activation's send
            after = forward_sends.pop((e.stage - 1, e.mb), 0)
            n = sum(cm.row.bytes for cm in e.comms)
            until_backward[(e.stage - 1, e.mb)] = until_backward.get((e.stage - 1, e.mb), 0) + n
            live += n
        elif e.kind == "SEND_F":  # the buffers its forward made
            forward_sends[key] = made.pop(("F", *key))
        elif e.kind == "SEND_B":  # the input gradients its backward made
            back_sends[key] = made.pop(("B", *key))
        elif e.kind == "wait_SEND_B":
            after = send_done(key, back_sends.pop(key))
        elif e.kind == "wait_SEND_F":
            after = forward_sends.pop(key, 0)
        elif e.kind == "F":
            made[("F", *key)] = sends_of.get(("F", *key), 0)
            live += saved[e.stage] + kept[e.stage].output_grads + made[("F", *key)]
            until_backward[key] = until_backward.get(key, 0) + kept[e.stage].output_grads
            after = until_forward.pop(key, 0)
        if e.graph in ("backward", "backward_b"):  # its input gradients exist when it returns, beside its inputs
            made[("B", *key)] = sends_of.get(("B", *key), 0)
            live += made[("B", *key)]
        if e.graph == "backward_b":
            live += stash[e.stage]
            if shared.get(e.stage) and ("B", *key) in sends_of:
                holders[key] = [shared[e.stage], 2]
        elif e.graph in ("backward", "backward_w"):
            after = saved[e.stage] + until_backward.pop(key, 0)
            after += stash[e.stage] + release(key) if e.graph == "backward_w" else 0
        elif e.kind == "wait_sends":
            after = sum(send_done(k, n) for k, n in back_sends.items()) + sum(forward_sends.values())
            back_sends, forward_sends = {}, {}
        peak = max(peak, live)
        live -= after
    return peak
