"""What one rank does in one training step, as the ordered list of events it performs.

``rank_step(compiled, rank)`` turns the compiled program, the pipeline schedule and a rank into
that list; it is the one place that knows the order of a step. The executor runs it event by
event; ``fxpar.verify`` plays every rank's list against the others; ``pm.ledger`` reads its
communications; ``pm.memory`` reads when activations are saved and freed; the Chrome trace
names its events. A step is:

1. ``gather``: ZeRO-1/2's once-per-step all-gather of each stage's dp-sharded parameters;
2. the schedule's actions: ``F``/``B``/``W`` run a stage graph on one microbatch (its
   collectives inside), ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` move the stage boundary
   tensors (activations forward, their gradients back), each with its exact
   ``torch.distributed`` tag and peer rank; a backward whose input gradient goes to another rank
   runs as ``B`` (that gradient), its ``SEND_B``, then ``W`` (the weight gradients: ``backward_halves``);
   under ZeRO-2 a ``reduce`` follows every backward that produces parameter gradients; a ``wait_SEND_F`` or
   ``wait_SEND_B`` follows the receive that proves that send arrived (``fxpar.schedules.arrivals``) and frees
   its tensor;
3. ``wait_sends`` (the sends not awaited yet), then (below ZeRO-2) one ``reduce`` per stage of the summed
   gradients;
4. ``tied``: a weight held by stages on several pipeline ranks has its gradient summed over them;
5. ``loss``: the mean loss, all-reduced over the world (a report, not training traffic: no ledger row).

Every collective of a graph comes from the lowered graph node itself (``meta["ledger_row"]``), so
the ledger lists exactly the collectives the graphs issue.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar.backends.comm import COLLECTIVES, group_arg_index
from fxpar.ir import Program
from fxpar.lower import LedgerRow
from fxpar.schedules import Action
from fxpar.schedules.arrivals import send_arrivals
from fxpar.split import splitter

if TYPE_CHECKING:
    from fxpar.compiled import Compiled

MAX_BOUNDARY_TENSORS = 64  # tags give each boundary tensor of a (stage, microbatch, direction) one of 64 slots


@dataclass(frozen=True)
class Comm:
    """One communication an event issues: a collective of a graph, or one tensor of a transfer."""

    op: str  # the runtime call: all_reduce | all_gather | reduce_scatter | all_to_all | send | recv
    ranks: tuple[int, ...]  # a collective's group; a transfer's (src, dst)
    shape: tuple[int, ...]  # the tensor handed to the call
    dtype: torch.dtype
    row: LedgerRow | None  # its ledger row (None: the loss report)
    tag: int | None = None  # a transfer's torch.distributed tag


@dataclass(frozen=True)
class StepEvent:
    """One thing a rank does in a step, in order."""

    kind: str  # gather F B W reduce SEND_F RECV_F SEND_B RECV_B wait_SEND_F wait_SEND_B wait_sends tied loss
    stage: int | None = None
    mb: int | None = None  # microbatch; None for once-per-step events
    graph: str = ""  # the stage graph it runs (``Compiled.stage_graph``); "" for transfers and once-per-step sums
    comms: tuple[Comm, ...] = ()
    label: str = ""  # where it comes from (the schedule action, as the Chrome trace names it)
    fqn: str = ""  # tied: the weight whose gradient is summed

    def __str__(self) -> str:
        return f"{self.label} {self.graph}" if self.graph and self.graph not in self.label else self.label


@dataclass(frozen=True)
class Boundary:
    """One value a stage receives from the previous stage."""

    value: str  # the value's name in the model's forward graph (as the sender's ``StageInfo.sent`` lists it)
    placeholder: str  # the receiving program's input placeholder
    shape: list[int]  # local shape on a rank
    dtype: torch.dtype
    has_grad: bool  # the receiver sends its gradient back


def boundary_meta(prog: Program, coord: tuple[int, ...]) -> list[Boundary]:
    """Every value ``prog``'s stage receives on the rank at mesh ``coord``, in order."""
    stage = prog.notes["stage"]
    with_grad = {name for name, _ in prog.signature.input_grads}
    out = []
    for value, name in zip(stage.received, prog.signature.inputs[: len(stage.received)], strict=True):
        val = prog.node(name).meta["val"]
        shape = splitter(prog).local_shape(val.shape, prog.placements[name], coord)  # as annotate placed it
        out.append(Boundary(value, name, shape, val.dtype, name in with_grad))
    return out


def rank_step(compiled: Compiled, rank: int, actions: list[Action] | None = None) -> list[StepEvent]:
    """Every event ``rank`` performs in one ``pm.step``, in order (``actions``: its schedule's, unless given)."""
    arrivals = {} if actions is not None else send_arrivals(compiled.schedule.actions, compiled.pp_coord(rank))
    actions = actions if actions is not None else compiled.schedule.actions[compiled.pp_coord(rank)]
    stages = compiled.stage_of_rank(rank)
    memo: dict[Any, Any] = {}  # per (stage, graph) comms and per (stage, direction) boundaries: same every mb
    each_mb = compiled.plan.zero >= 2  # ZeRO-2 reduces after every backward, not once per step
    has_w = compiled.schedule.has_w
    halves = backward_halves(compiled, rank, actions)
    after_send: dict[tuple[int, int], list[StepEvent]] = {}  # (stage, mb) -> the W that follows its SEND_B
    # sends issued so far: a wait_SEND_* follows only one of these, and not a forward send's own gradient (its
    # RECV_B awaits it already)
    sent: set[tuple[str, int, int]] = set()

    def reduce_after(a: Action) -> list[StepEvent]:
        if not each_mb or compiled.rank_program(rank, a.stage).reduce_grads is None:
            return []
        return [_graph_event(compiled, rank, "reduce", a.stage, a.mb, "reduce_grads", f"{a} reduce_grads", memo)]

    events = [_graph_event(compiled, rank, "gather", s, None, "gather_params", f"stage {s} gather_params", memo)
              for s in stages if compiled.rank_program(rank, s).gather_params is not None]
    for a in actions:
        if a.kind == "B" and not has_w and a.stage in halves:  # B, its send, then W (``backward_halves``)
            events.append(_graph_event(compiled, rank, "B", a.stage, a.mb, "backward_b", str(a), memo))
            w = Action("W", a.stage, a.mb)
            after_send[(a.stage, a.mb)] = [_graph_event(compiled, rank, "W", a.stage, a.mb, "backward_w",
                                                        f"{w} (of {a})", memo), *reduce_after(w)]
        elif a.is_compute:
            graph = _graph_name(a.kind, has_w)
            events.append(_graph_event(compiled, rank, a.kind, a.stage, a.mb, graph, str(a), memo))
            if a.kind == ("W" if has_w else "B"):
                events += reduce_after(a)
        else:
            events.append(_transfer(compiled, rank, a, memo))
            events += after_send.pop((a.stage, a.mb), []) if a.kind == "SEND_B" else []
            sent.update([(a.kind, a.stage, a.mb)] if a.is_send else [])
            events += [StepEvent(f"wait_{kind}", s, mb, label=f"await {kind}{s}.{mb} ({a} proves it arrived)")
                       for kind, s, mb in arrivals.get((a.kind, a.stage, a.mb), [])
                       if (kind, s, mb) in sent and (kind, a.kind, a.stage, a.mb) != ("SEND_F", "RECV_B", s + 1, mb)]
    assert not after_send, f"a split backward without its send: {sorted(after_send)}"
    events.append(StepEvent("wait_sends", label="wait for this step's sends"))
    if not each_mb:
        events += [_graph_event(compiled, rank, "reduce", s, None, "reduce_grads", f"stage {s} reduce_grads", memo)
                   for s in stages if compiled.rank_program(rank, s).reduce_grads is not None]
    events += [_tied(compiled, rank, fqn, ranks) for fqn, ranks in tie_ranks(compiled, rank)]
    loss = Comm("all_reduce", tuple(range(compiled.mesh.size)), (), torch.float64, None)
    events.append(StepEvent("loss", comms=(loss,), label="step loss"))
    return events


def backward_halves(compiled: Compiled, rank: int, actions: list[Action] | None = None) -> set[int]:
    """The stages of ``rank`` whose backward runs as its two halves (``fxpar.backward_split``): every stage under a
    schedule with ``W`` actions (zero-bubble); under any other schedule, each stage whose input gradient goes to
    another pipeline rank. Its ``B`` then computes only that gradient, the ``SEND_B`` leaves at once and a ``W``
    event (the weight gradients) follows the send, so the previous stage's backward starts a ``W`` earlier.
    Every node runs once either way, so the gradients are the fused backward's, bit for bit; the cost is the
    values ``W`` reads from ``B``, held from one to the other (``pm.memory`` counts them with the activations).
    That is every weight gradient's input of the stage, which under ``recompute`` is most of what recompute
    frees (the fused backward recomputes and frees one block at a time): a plan that recomputes keeps its
    backward whole unless the schedule has ``W`` actions. ``FXPAR_BACKWARD_HALVES=0`` at compile time keeps
    such a backward whole too."""
    if compiled.schedule.has_w:
        return set(compiled.stage_of_rank(rank))
    if not compiled.sent_backward_halves:  # FXPAR_BACKWARD_HALVES=0 when the model was compiled
        return set()
    if compiled.plan.recompute is not None:  # memory first: halves would hold what recompute frees
        return set()
    actions = actions if actions is not None else compiled.schedule.actions[compiled.pp_coord(rank)]
    return {a.stage for a in actions if a.kind == "SEND_B"}


def step_ledger(events: list[StepEvent]) -> list[LedgerRow]:
    """The ledger rows of a step's events, in issue order, each with its stage and microbatch."""
    return [replace(c.row, stage=e.stage if e.stage is not None else c.row.stage, mb=e.mb)
            for e in events for c in e.comms if c.row is not None]


def graph_comms(gm: fx.GraphModule, groups: dict[str, tuple[int, ...]]) -> tuple[Comm, ...]:
    """The collectives ``gm`` issues, in node order, each with the ledger row lowering recorded on its node."""
    out = []
    for n in gm.graph.nodes:
        i = group_arg_index(n.target)
        if i is None:
            continue
        if "ledger_row" not in n.meta:
            raise AssertionError(f"collective {n.name} ({n.target}) has no ledger row: lowering must record each one")
        val = n.args[0].meta["val"]
        out.append(Comm(COLLECTIVES[n.target], groups[n.args[i]], tuple(val.shape), val.dtype, n.meta["ledger_row"]))
    return tuple(out)


def _graph_name(kind: str, has_w: bool) -> str:
    if kind == "F":
        return "forward"
    if not has_w:
        return "backward"
    return "backward_b" if kind == "B" else "backward_w"


def _graph_event(compiled: Compiled, rank: int, kind: str, stage: int, mb: int | None, graph: str,
                 label: str, memo: dict[Any, Any]) -> StepEvent:
    key = ("graph", stage, graph)
    if key not in memo:
        rp = compiled.rank_program(rank, stage)
        phase = "fwd" if graph in ("forward",) else "bwd"
        comms = graph_comms(compiled.stage_graph(rank, stage, graph), rp.groups)
        if graph != "gather_params":  # the ledger's phase is the graph's (a recomputed collective re-issues in bwd)
            comms = tuple(replace(c, row=replace(c.row, phase=phase)) for c in comms)
        memo[key] = comms
    return StepEvent(kind, stage, mb, graph, memo[key], label)


def peer_rank(compiled: Compiled, rank: int, pp_coord: int) -> int:
    """The rank at pipeline coordinate ``pp_coord`` with ``rank``'s coordinates on every other axis."""
    mesh = compiled.mesh
    coord = list(mesh.coord(rank))
    coord[mesh.axis_index("pp")] = pp_coord
    return mesh.rank_of(tuple(coord))


def transfer_tag(stage: int, mb: int, direction: str, index: int, microbatches: int) -> int:
    """The ``torch.distributed`` tag of boundary tensor ``index`` of (stage, microbatch, direction): unique per step."""
    return ((stage * microbatches + mb) * 2 + (0 if direction == "F" else 1)) * MAX_BOUNDARY_TENSORS + index


def _transfer(compiled: Compiled, rank: int, a: Action, memo: dict[Any, Any]) -> StepEvent:
    direction = "F" if a.kind.endswith("_F") else "B"
    receiver = a.stage + 1 if direction == "F" else a.stage
    if ("boundary", receiver, direction) not in memo:
        meta = boundary_meta(compiled.stages[receiver], compiled.mesh.coord(rank))
        memo[("boundary", receiver, direction)] = [b for b in meta if b.has_grad] if direction == "B" else meta
    meta = memo[("boundary", receiver, direction)]
    if len(meta) > MAX_BOUNDARY_TENSORS:
        raise ValueError(f"stage {receiver} receives {len(meta)} boundary tensors; at most {MAX_BOUNDARY_TENSORS} fit "
                         "the transfer tags: choose another stage split")
    peer = peer_rank(compiled, rank, a.peer)
    pair = (rank, peer) if a.is_send else (peer, rank)
    op = "send" if a.is_send else "recv"
    phase = "fwd" if direction == "F" else "bwd"
    comms = []
    for i, b in enumerate(meta):
        shape = tuple(b.shape)
        nbytes = int(torch.Size(shape).numel()) * b.dtype.itemsize
        row = LedgerRow(phase, op, "pp", shape, b.dtype, nbytes, pair, a.stage, a.mb, peer)
        comms.append(Comm(op, pair, shape, b.dtype, row, transfer_tag(a.stage, a.mb, direction, i,
                                                                      compiled.microbatches)))
    return StepEvent(a.kind, a.stage, a.mb, "", tuple(comms), str(a))


def _tied(compiled: Compiled, rank: int, fqn: str, ranks: tuple[int, ...]) -> StepEvent:
    prog = next(q for q in compiled.stages if fqn in dict(q.signature.params))
    name = dict(prog.signature.params)[fqn]
    val = prog.node(name).meta["val"]
    placements = list(prog.placements[name])
    if fqn in prog.notes.get("zero", {}):  # ZeRO: the step sums this rank's dp shard of the gradient
        placements[compiled.mesh.axis_index("dp")] = Shard(prog.notes["zero"][fqn])
    shape = tuple(splitter(prog).local_shape(val.shape, placements, compiled.mesh.coord(rank)))
    nbytes = int(torch.Size(shape).numel()) * val.dtype.itemsize
    row = LedgerRow("bwd", "all_reduce", "pp", shape, val.dtype, nbytes, ranks)
    return StepEvent("tied", comms=(Comm("all_reduce", ranks, shape, val.dtype, row),), label=f"tied weight {fqn}",
                     fqn=fqn)


def tie_ranks(compiled: Compiled, rank: int) -> list[tuple[str, tuple[int, ...]]]:
    """(fqn, ranks) for each weight ``rank`` holds that stages on other pipeline ranks hold too (tied embeddings).

    The gradient of such a weight is summed over those ranks (same coordinates on every other axis).
    """
    out = []
    for fqn, pps in tie_holders(compiled).items():
        if compiled.pp_coord(rank) in pps:
            out.append((fqn, tuple(peer_rank(compiled, rank, p) for p in pps)))
    return out


def tie_holders(compiled: Compiled) -> dict[str, list[int]]:
    """fqn -> the pipeline coordinates holding it, for each weight held on more than one."""
    holders: dict[str, set[int]] = {}
    for s, prog in enumerate(compiled.stages):
        for fqn, _ in prog.signature.params:
            holders.setdefault(fqn, set()).add(compiled.schedule.stage_rank(s))
    return {fqn: sorted(pps) for fqn, pps in sorted(holders.items()) if len(pps) > 1}
