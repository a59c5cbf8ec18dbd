"""Collective-order proof: simulate every rank's step and show that no rank can hang.

Each rank's step is a list of events read from what it will really run: its schedule actions,
the collectives inside the lowered graph each action executes (forward, backward, B/W halves,
the once-per-step gradient reduction), the point-to-point transfers, the tied-weight gradient
sums and the loss all-reduce. ``verify`` then plays all ranks together:

* a collective completes when every member of its group has it next, and all of them must issue
  the same op on the same shape and dtype (else: the group and each rank's step are named);
* a send is buffered; a receive completes when the matching send (same peer and tag) was issued,
  with the same shape and dtype;
* if no rank can move and some have events left, that is a deadlock: each stuck rank is named
  with the event it waits on.

By default one rank per pipeline coordinate is simulated, those sharing the calling rank's dp/tp
coordinate (a role: the ranks of one dp/tp group run the same program, up to group names), so
meshes of thousands of ranks verify in seconds; ``ranks="all"`` simulates every rank, checking
each group's members against each other.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx

from fxpar.backends.comm import COLLECTIVES, group_arg_index
from fxpar.backward_split import split_backward
from fxpar.executor import boundary_meta
from fxpar.lower import LedgerRow, RankProgram
from fxpar.schedules import Action, DeadlockError


class VerifyError(AssertionError):
    """The ranks' programs can deadlock or disagree on a collective or a transfer."""


@dataclass(frozen=True)
class Event:
    """One communication a rank issues, in order."""

    kind: str  # "coll" | "send" | "recv"
    op: str
    group: tuple[int, ...]  # collective: its ranks; send/recv: (src, dst)
    shape: tuple[int, ...]
    dtype: torch.dtype
    where: str  # the action and graph it comes from
    tag: tuple[Any, ...] = ()

    def __str__(self) -> str:
        if self.kind == "coll":
            return f"{self.op} {list(self.shape)} {self.dtype} on ranks {list(self.group)} ({self.where})"
        return f"{self.op} {self.tag} {list(self.shape)} {self.dtype} {self.group[0]}->{self.group[1]} ({self.where})"


def verify(pm: Any, ranks: str | list[int] = "roles", actions: dict[int, list[Action]] | None = None) -> None:
    """Prove that ``pm``'s rank programs issue matching collectives and transfers and cannot deadlock.

    ``ranks``: ``"roles"`` (one rank per pipeline coordinate), ``"all"``, or a list of ranks.
    ``actions``: per global rank, an action list to check instead of the schedule's (for tests).
    Raises ``VerifyError`` naming the group or rank pair and the first mismatching step.
    """
    chosen = _ranks(pm, ranks)
    _check_schedules(pm, actions or {})
    events = {r: rank_events(pm, r, (actions or {}).get(r)) for r in chosen}
    _simulate(events, full=set(chosen))


def _check_schedules(pm: Any, actions: dict[int, list[Action]]) -> None:
    """Each action list must respect data dependencies (a forward after its input's receive, ...)."""
    schedule = pm.schedule
    variants = [(None, schedule.actions)]
    for rank, acts in sorted(actions.items()):
        lists = list(schedule.actions)
        lists[pm._compiled.pp_coord(rank)] = acts
        variants.append((rank, lists))
    for rank, lists in variants:
        try:
            replace(schedule, actions=lists).simulate()
        except (ValueError, DeadlockError) as e:
            who = f"rank {rank}'s action list" if rank is not None else f"schedule {schedule.name}"
            raise VerifyError(f"{who} is not runnable: {e}") from e


def _ranks(pm: Any, ranks: str | list[int]) -> list[int]:
    """The ranks to simulate. Roles: the ranks that share this rank's dp/tp coordinate, one per pp coordinate.

    Starting from the rank ``pm`` runs on (rank 0 on a fake mesh) keeps its own, already lowered
    programs in the check and simulates its real pipeline peers.
    """
    mesh = pm.mesh
    if ranks == "all":
        return list(range(mesh.size))
    if ranks == "roles":
        own = pm._rank if pm._rank is not None else 0
        if "pp" not in mesh.axes:
            return [own]
        base = list(mesh.coord(own))
        out = []
        for p in range(mesh.axes["pp"]):
            base[mesh.axis_index("pp")] = p
            out.append(mesh.rank_of(tuple(base)))
        return out
    return list(ranks)


def rank_events(pm: Any, rank: int, actions: list[Action] | None = None) -> list[Event]:
    """Every communication ``rank`` issues in one ``pm.step``, in order."""
    c = pm._compiled
    actions = actions if actions is not None else c.schedule.actions[c.pp_coord(rank)]
    out: list[Event] = []
    for s in pm.stages_of(rank):  # ZeRO: parameters gathered once, before the first action
        rp = pm.rank_program(rank, s)
        if rp.gather_params is not None:
            out += _collectives(rp.gather_params, rp, f"stage {s} gather_params")
    each_mb = c.plan.zero >= 2  # ZeRO-2 reduces after every backward, not once per step
    for a in actions:
        if a.is_compute:
            rp = pm.rank_program(rank, a.stage)
            for gm, name in _graphs_of(pm, rp, a):
                out += _collectives(gm, rp, f"{a} {name}")
            if each_mb and a.kind == _last_backward(pm) and rp.reduce_grads is not None:
                out += _collectives(rp.reduce_grads, rp, f"{a} reduce_grads")
        else:
            out += _transfers(pm, rank, a)
    for s in pm.stages_of(rank):
        rp = pm.rank_program(rank, s)
        if rp.reduce_grads is not None and not each_mb:
            out += _collectives(rp.reduce_grads, rp, f"stage {s} reduce_grads")
    out += _tie_events(pm, rank)
    out.append(_loss_event(pm))
    return out


def _last_backward(pm: Any) -> str:
    """The action that produces parameter gradients: W when the backward is split, else B."""
    return "W" if pm.schedule.has_w else "B"


def _graphs_of(pm: Any, rp: RankProgram, a: Action) -> list[tuple[fx.GraphModule, str]]:
    if a.kind == "F":
        return [(rp.forward, "forward")]
    if not pm.schedule.has_w:
        return [(rp.backward, "backward")]
    sig = pm._compiled.stages[a.stage].signature
    b, w = split_backward(rp.backward, {idx - sig.num_outputs for _, idx in sig.input_grads})
    return [(b, "backward (input grads)")] if a.kind == "B" else [(w, "backward (weight grads)")]


def _collectives(gm: fx.GraphModule, rp: RankProgram, where: str) -> list[Event]:
    out = []
    for n in gm.graph.nodes:
        i = group_arg_index(n.target)
        if i is None:
            continue
        val = n.args[0].meta["val"]
        out.append(Event("coll", COLLECTIVES[n.target], rp.groups[n.args[i]], tuple(val.shape), val.dtype, where))
    return out


def _transfers(pm: Any, rank: int, a: Action) -> list[Event]:
    c = pm._compiled
    direction = "F" if a.kind.endswith("_F") else "B"
    receiver_stage = a.stage + 1 if direction == "F" else a.stage
    meta = boundary_meta(c.stages[receiver_stage], pm.mesh.coord(rank))
    if direction == "B":
        meta = [b for b in meta if b.has_grad]
    coord = list(pm.mesh.coord(rank))
    coord[pm.mesh.axis_index("pp")] = a.peer
    peer = pm.mesh.rank_of(tuple(coord))
    pair = (rank, peer) if a.is_send else (peer, rank)
    op = "send" if a.is_send else "recv"
    return [Event(op, op, pair, tuple(b.shape), b.dtype, str(a), (direction, a.stage, a.mb, i))
            for i, b in enumerate(meta)]


def _tie_events(pm: Any, rank: int) -> list[Event]:
    from fxpar.runtime import tie_ranks
    from fxpar.split import splitter

    out = []
    for fqn, ranks in tie_ranks(pm._compiled, rank):
        prog = next(q for q in pm._compiled.stages if fqn in dict(q.signature.params))
        name = dict(prog.signature.params)[fqn]
        val = prog.node(name).meta["val"]
        shape = tuple(splitter(prog).local_shape(val.shape, prog.placements[name], pm.mesh.coord(rank)))
        out.append(Event("coll", "all_reduce", ranks, shape, val.dtype, f"tied weight {fqn}"))
    return out


def _simulate(events: dict[int, list[Event]], full: set[int]) -> None:
    heads = dict.fromkeys(events, 0)
    mailbox: dict[tuple[Any, ...], Event] = {}
    moved = True
    while moved:
        moved = False
        for r in events:
            while heads[r] < len(events[r]):
                e = events[r][heads[r]]
                if e.kind == "send":
                    mailbox[(*e.group, e.tag)] = e
                    heads[r] += 1
                elif e.kind == "recv":
                    sent = mailbox.pop((*e.group, e.tag), None)
                    if sent is None:
                        break
                    if (sent.shape, sent.dtype) != (e.shape, e.dtype):
                        raise VerifyError(f"rank {e.group[1]} step {heads[r]} receives {e} but rank {e.group[0]} "
                                          f"sends {sent}")
                    heads[r] += 1
                elif not _collective(events, heads, r, e, full):
                    break
                moved = True
    stuck = [r for r in events if heads[r] < len(events[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits at step {heads[r]} on {events[r][heads[r]]}" for r in stuck)
        raise VerifyError(f"deadlock: {waits}")
    if mailbox:
        raise VerifyError(f"sends never received: {', '.join(str(e) for e in mailbox.values())}")


def _collective(events: dict[int, list[Event]], heads: dict[int, int], r: int, e: Event, full: set[int]) -> bool:
    """Complete collective ``e`` at ``r``'s head if every simulated member has it next; raise on a mismatch."""
    members = [m for m in e.group if m in full]
    if len(members) < len(e.group) and len(members) == 1:  # a role stands for its whole group
        heads[r] += 1
        return True
    for m in members:
        if heads[m] >= len(events[m]):
            raise VerifyError(f"group {list(e.group)}: rank {r} step {heads[r]} issues {e}, but rank {m} has finished")
        other = events[m][heads[m]]
        if other.kind != "coll":
            return False
        if other.group != e.group:
            return False  # m is inside another collective first: it waits there (a deadlock shows at the end)
        if (other.op, other.shape, other.dtype) != (e.op, e.shape, e.dtype):
            raise VerifyError(f"collective mismatch in group {list(e.group)}: rank {r} step {heads[r]} issues {e}; "
                              f"rank {m} step {heads[m]} issues {other}")
    for m in members:
        heads[m] += 1
    return True


def step_ledger(pm: Any, rank: int) -> list[LedgerRow]:
    """The ledger of one ``pm.step`` on ``rank``: ZeRO's parameter all-gather, every microbatch's collectives and
    transfers in schedule order, then the once-per-step gradient reductions (dp, then tied weights over pp)."""
    c = pm._compiled
    rows: list[LedgerRow] = []
    for s in pm.stages_of(rank):  # ZeRO: the once-per-step parameter all-gather comes first
        rows += [_at(row, s, None) for row in pm.rank_program(rank, s).gather_ledger]
    each_mb = c.plan.zero >= 2
    for a in c.schedule.actions[c.pp_coord(rank)]:
        rp = pm.rank_program(rank, a.stage) if a.is_compute else None
        if a.kind in ("F", "B"):
            phase = "fwd" if a.kind == "F" else "bwd"
            main = rp.ledger[: len(rp.ledger) - len(rp.deferred)]
            rows += [_at(row, a.stage, a.mb) for row in main if row.phase == phase]
        if each_mb and a.kind == _last_backward(pm):  # ZeRO-2: this microbatch's gradients, reduced now
            rows += [_at(row, a.stage, a.mb) for row in rp.ledger[len(rp.ledger) - len(rp.deferred):]]
        elif a.is_comm:
            for e in _transfers(pm, rank, a):
                peer = e.group[1] if a.is_send else e.group[0]
                nbytes = int(torch.Size(e.shape).numel()) * e.dtype.itemsize
                rows.append(LedgerRow("fwd" if e.tag[0] == "F" else "bwd", e.op, "pp", e.shape, e.dtype, nbytes,
                                      e.group, a.stage, a.mb, peer))
    for s in pm.stages_of(rank) if not each_mb else []:
        rp = pm.rank_program(rank, s)
        rows += [_at(row, s, None) for row in rp.ledger[len(rp.ledger) - len(rp.deferred):]]
    for e in _tie_events(pm, rank):
        rows.append(LedgerRow("bwd", "all_reduce", "pp", e.shape, e.dtype, _nbytes(e), e.group))
    return rows  # the loss report (one f64 scalar all-reduced over the world) is not training traffic: left out


def _loss_event(pm: Any) -> Event:
    """``pm.step`` reports the global mean loss on every rank: one float64 scalar all-reduced over the world."""
    return Event("coll", "all_reduce", tuple(range(pm.mesh.size)), (), torch.float64, "step loss")


def _nbytes(e: Event) -> int:
    return int(torch.Size(e.shape).numel()) * e.dtype.itemsize


def _at(row: LedgerRow, stage: int, mb: int | None) -> LedgerRow:
    return replace(row, stage=stage, mb=mb)
