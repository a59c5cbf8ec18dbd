"""Static checks of per-rank action lists (what can be told without running them).

Timing-dependent problems (a RECV whose SEND never comes or comes from another peer, actions in an order
that cannot run) are left to the simulation, which reports them as ``DeadlockError``.
"""

from __future__ import annotations

from collections import Counter

from .actions import Action


def _check_ranges(rank: int, action: Action, pp: int, stages: int, microbatches: int) -> None:
    """Stage, microbatch and peer of one action are in range, and it runs on the right rank."""
    if action.stage >= stages or action.mb >= microbatches:
        raise ValueError(f"rank {rank}: {action} is out of range (stages={stages}, microbatches={microbatches})")
    if action.is_comm and (action.peer is None or action.peer >= pp or action.peer == rank):
        raise ValueError(f"rank {rank}: {action} has peer {action.peer}; expected another rank in [0, {pp})")
    if action.kind in ("SEND_F", "RECV_F") and action.stage == stages - 1:
        raise ValueError(f"rank {rank}: {action}: the last stage {stages - 1} has no next stage to send to")
    if action.kind in ("SEND_B", "RECV_B") and action.stage == 0:
        raise ValueError(f"rank {rank}: {action}: stage 0 has no previous stage to send a gradient to")
    owner = {"RECV_F": action.stage + 1, "RECV_B": action.stage - 1}.get(action.kind, action.stage) % pp
    if owner != rank:
        raise ValueError(f"rank {rank}: {action} belongs on rank {owner} (stage s lives on rank s % {pp})")


def _check_compute_once(actions: list[list[Action]], stages: int, microbatches: int) -> None:
    """Every F and B of every (stage, mb) appears exactly once; W too, if the schedule has any W."""
    counts = Counter((a.kind, a.stage, a.mb) for rank_actions in actions for a in rank_actions if a.is_compute)
    kinds = ("F", "B", "W") if any(kind == "W" for kind, _, _ in counts) else ("F", "B")
    for kind in kinds:
        for stage in range(stages):
            for mb in range(microbatches):
                n = counts.get((kind, stage, mb), 0)
                if n != 1:
                    raise ValueError(f"{kind}{stage}.{mb} appears {n} times in the schedule; expected exactly once")


def _check_recv_before_use(rank: int, rank_actions: list[Action], pp: int, stages: int) -> None:
    """Each F/B that consumes a value from another rank comes after the RECV of that value."""
    received: set[tuple[str, int, int]] = set()
    for action in rank_actions:
        if action.is_recv:
            received.add((action.payload, action.stage, action.mb))
            continue
        if action.kind == "F" and action.stage > 0 and (action.stage - 1) % pp != rank:
            need = ("F", action.stage - 1, action.mb)
        elif action.kind == "B" and action.stage < stages - 1 and (action.stage + 1) % pp != rank:
            need = ("B", action.stage + 1, action.mb)
        else:
            continue
        if need not in received:
            kind, stage, mb = need
            raise ValueError(f"rank {rank}: {action} needs RECV_{kind}{stage}.{mb} earlier on the same rank")


def validate(actions: list[list[Action]], pp: int, stages: int, microbatches: int) -> None:
    """Raise ValueError unless the lists are well formed.

    Requires nothing. Ensures, when it returns: one list per rank; every action in range and on the rank that
    owns its stage; every compute action exactly once; and, if the schedule has any transfers, every value
    that crosses ranks is received before its use.
    """
    if len(actions) != pp:
        raise ValueError(f"schedule has {len(actions)} rank lists but pp={pp}")
    for rank, rank_actions in enumerate(actions):
        for action in rank_actions:
            _check_ranges(rank, action, pp, stages, microbatches)
    _check_compute_once(actions, stages, microbatches)
    if any(a.is_comm for rank_actions in actions for a in rank_actions):
        for rank, rank_actions in enumerate(actions):
            _check_recv_before_use(rank, rank_actions, pp, stages)
