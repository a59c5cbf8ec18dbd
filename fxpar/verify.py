"""Collective-order proof: simulate every rank's step and show that no rank can hang.

Each rank's step is the event list ``fxpar.rank_step`` builds: the very list the executor runs
(its graphs' collectives, read from the lowered graph nodes, the point-to-point transfers with
their tags and peers, the gradient reductions, the tied-weight sums and the loss all-reduce).
``verify`` plays all ranks together:

* a collective completes when every member of its group has it next, and all of them must issue
  the same op on the same shape and dtype (else: the group and each rank's step are named);
* a send is buffered; a receive completes when the matching send (same pair of ranks and tag)
  was issued, with the same shape and dtype;
* if no rank can move and some have events left, that is a deadlock: each stuck rank is named
  with the step it waits on, and any send nobody received.

By default one rank per role is simulated (``fxpar.roles``): every pipeline coordinate, times every
coordinate of each axis whose coordinate some lowering read (uneven pieces, cp chunks), the other
coordinates those of the calling rank. A rank left out has the same coordinates as a simulated one
on every axis its lowering reads, so its step is that rank's with other group names, in groups of
the same shape: meshes of thousands of ranks verify in seconds. ``ranks="all"`` simulates every
rank. ``verify`` returns a ``Proof`` saying what it checked.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fxpar.blocks import sharing_enabled
from fxpar.compiled import Compiled
from fxpar.rank_step import Comm, StepEvent, rank_step
from fxpar.schedules import Action, DeadlockError


class VerifyError(AssertionError):
    """The ranks' programs can deadlock or disagree on a collective or a transfer."""


@dataclass(frozen=True)
class Issued:
    """One communication of a rank's step: ``comm`` of the rank's event number ``step``."""

    rank: int
    step: int
    event: StepEvent
    comm: Comm

    def __str__(self) -> str:
        c = self.comm
        if c.op in ("send", "recv"):
            what = f"{c.op} tag {c.tag} {list(c.shape)} {c.dtype} rank {c.ranks[0]} -> rank {c.ranks[1]}"
        else:
            what = f"{c.op} {list(c.shape)} {c.dtype} on ranks {list(c.ranks)}"
        return f"{what} (step {self.step}: {self.event})"


@dataclass(frozen=True)
class Proof:
    """What ``verify`` checked: the ranks it simulated, the roles and process groups they cover, the events."""

    ranks: tuple[int, ...]
    mesh_size: int
    roles: int  # distinct lowered programs (roles) behind the simulated ranks' stages (each rank's own: sharing off)
    groups: int  # process groups whose members' collectives were matched
    collectives: int
    transfers: int  # point-to-point sends and receives matched
    events: int  # step events simulated, all ranks

    def __str__(self) -> str:
        return (f"verified: {len(self.ranks)} of {self.mesh_size} ranks simulated ({self.roles} roles), "
                f"{self.groups} groups, {self.events} step events: {self.collectives} collectives and "
                f"{self.transfers} transfers matched, no deadlock")


def verify(pm: Any, ranks: str | list[int] = "roles", actions: dict[int, list[Action]] | None = None,
           events: dict[int, list[StepEvent]] | None = None) -> Proof:
    """Prove that ``pm``'s rank programs issue matching collectives and transfers and cannot deadlock.

    ``ranks``: ``"roles"`` (one rank per pipeline coordinate), ``"all"``, or a list of ranks.
    ``actions``: per global rank, an action list to check instead of the schedule's (for tests).
    ``events``: per global rank, a step's event list (``pm.step_events(rank)``, what the executor runs) to check
    instead of the one built from the schedule; those ranks and their pipeline peers are simulated.
    Raises ``VerifyError`` naming the group or rank pair and the first mismatching step; returns the ``Proof``.
    """
    c: Compiled = pm._compiled
    own = pm._rank if pm._rank is not None else 0
    actions, events = actions or {}, events or {}
    chosen = list(dict.fromkeys([*_ranks(c, own, ranks), *(r for e in events for r in _ranks(c, e, "roles"))]))
    _check_schedules(c, actions)
    steps = {r: events[r] if r in events else rank_step(c, r, actions.get(r)) for r in chosen}
    issued = {r: _issued(r, evs) for r, evs in steps.items()}
    _simulate(issued, full=set(chosen))
    comms = [i.comm for evs in issued.values() for i in evs]
    p2p = sum(m.op in ("send", "recv") for m in comms)
    groups = {m.ranks for m in comms if m.op not in ("send", "recv")}
    roles = _role_ids(c, chosen) if sharing_enabled() else {(r, s) for r in chosen for s in c.stage_of_rank(r)}
    return Proof(tuple(chosen), c.mesh.size, len(roles), len(groups), len(comms) - p2p, p2p,
                 sum(len(e) for e in steps.values()))


def _role_ids(c: Compiled, ranks: list[int]) -> set[tuple[int, int]]:
    """(stage, role index) of every simulated rank's stages, as ``c.roles`` lowered them."""
    out = set()
    for r in ranks:
        coord = c.mesh.coord(r)
        for s in c.stage_of_rank(r):
            out.update((s, i) for i, role in enumerate(c.roles.roles.get(s, [])) if role.fits(coord))
    return out


def _issued(rank: int, events: list[StepEvent]) -> list[Issued]:
    return [Issued(rank, i, e, comm) for i, e in enumerate(events) for comm in e.comms]


def _check_schedules(c: Compiled, actions: dict[int, list[Action]]) -> None:
    """Each action list must respect data dependencies (a forward after its input's receive, ...)."""
    schedule = c.schedule
    variants = [(None, schedule.actions)]
    for rank, acts in sorted(actions.items()):
        lists = list(schedule.actions)
        lists[c.pp_coord(rank)] = acts
        variants.append((rank, lists))
    for rank, lists in variants:
        try:
            replace(schedule, actions=lists).simulate()
        except (ValueError, DeadlockError) as e:
            who = f"rank {rank}'s action list" if rank is not None else f"schedule {schedule.name}"
            raise VerifyError(f"{who} is not runnable: {e}") from e


def _ranks(c: Compiled, own: int, ranks: str | list[int]) -> list[int]:
    """The ranks to simulate. Roles: the ranks that share ``own``'s dp/tp coordinate, one per pp coordinate.

    Starting from the rank ``pm`` runs on (rank 0 on a fake mesh) keeps its own, already lowered
    programs in the check and simulates its real pipeline peers.
    """
    mesh = c.mesh
    if ranks == "all":
        return list(range(mesh.size))
    if ranks == "roles":
        per_pp = _along(mesh, own, ["pp"] if "pp" in mesh.axes else [])
        for r in per_pp:  # lower one rank per pipeline coordinate: which axes' coordinates do the roles read?
            for s in c.stage_of_rank(r):
                c.rank_program(r, s)
        read = [a for i, a in enumerate(mesh.axes) if i in c.roles.read_axes and a != "pp"]
        return _along(mesh, own, (["pp"] if "pp" in mesh.axes else []) + read)
    return list(ranks)


def _along(mesh: Any, own: int, axes: list[str]) -> list[int]:
    """Every rank whose coordinates equal ``own``'s except along ``axes``."""
    out = [own]
    for axis in axes:
        out = [g for r in out for g in mesh.group_ranks(r, axis)]
    return sorted(set(out), key=out.index)


def _simulate(issued: dict[int, list[Issued]], full: set[int]) -> None:
    heads = dict.fromkeys(issued, 0)
    mailbox: dict[tuple[Any, ...], Issued] = {}
    moved = True
    while moved:
        moved = False
        for r in issued:
            while heads[r] < len(issued[r]):
                e = issued[r][heads[r]]
                if e.comm.op == "send":
                    mailbox[(*e.comm.ranks, e.comm.tag)] = e
                    heads[r] += 1
                elif e.comm.op == "recv":
                    if not _receive(e, mailbox):
                        break
                    heads[r] += 1
                elif not _collective(issued, heads, r, e, full):
                    break
                moved = True
    stuck = [r for r in issued if heads[r] < len(issued[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits on {issued[r][heads[r]]}" for r in stuck)
        raise VerifyError(f"deadlock: {waits}{_unmatched(mailbox)}")
    if mailbox:
        raise VerifyError(f"sends never received: {', '.join(str(e) for e in mailbox.values())}")


def _receive(e: Issued, mailbox: dict[tuple[Any, ...], Issued]) -> bool:
    """Complete receive ``e`` if its send (same pair and tag) was issued; raise if the tensors differ."""
    sent = mailbox.pop((*e.comm.ranks, e.comm.tag), None)
    if sent is None:
        return False
    if (sent.comm.shape, sent.comm.dtype) != (e.comm.shape, e.comm.dtype):
        src, dst = e.comm.ranks
        raise VerifyError(f"transfer rank {src} -> rank {dst} mismatch: rank {dst} receives {e}; rank {src} sends "
                          f"{sent}")
    return True


def _unmatched(mailbox: dict[tuple[Any, ...], Issued]) -> str:
    if not mailbox:
        return ""
    return "; sent but never received: " + ", ".join(str(e) for e in mailbox.values())


def _collective(issued: dict[int, list[Issued]], heads: dict[int, int], r: int, e: Issued, full: set[int]) -> bool:
    """Complete collective ``e`` at ``r``'s head if every simulated member has it next; raise on a mismatch."""
    members = [m for m in e.comm.ranks if m in full]
    if len(members) < len(e.comm.ranks) and len(members) == 1:  # a role stands for its whole group
        heads[r] += 1
        return True
    for m in members:
        if heads[m] >= len(issued[m]):
            raise VerifyError(f"group {list(e.comm.ranks)}: rank {r} issues {e}, but rank {m} has finished its step")
        other = issued[m][heads[m]]
        if other.comm.op in ("send", "recv"):
            return False
        if other.comm.ranks != e.comm.ranks:
            return False  # m is inside another collective first: it waits there (a deadlock shows at the end)
        if (other.comm.op, other.comm.shape, other.comm.dtype) != (e.comm.op, e.comm.shape, e.comm.dtype):
            raise VerifyError(f"collective mismatch in group {list(e.comm.ranks)}: rank {r} issues {e}; rank {m} "
                              f"issues {other}")
    for m in members:
        heads[m] += 1
    return True
