"""Per-rank compute orders of the pipeline schedules, and the pass that adds their transfers.

Stage ``s`` lives on rank ``s % pp`` (looped placement). Each ``*_order`` function returns, for one rank,
the F/B/W actions in execution order; ``add_comm`` then inserts the SEND/RECV actions.
"""

from __future__ import annotations

from collections.abc import Callable

from .actions import Action

Order = Callable[[int, int, int, int], list[Action]]


def gpipe_order(rank: int, pp: int, stages: int, microbatches: int) -> list[Action]:
    """GPipe: every forward, then every backward, both in microbatch order. Requires ``stages == pp``."""
    forwards = [Action("F", rank, mb) for mb in range(microbatches)]
    return forwards + [Action("B", rank, mb) for mb in range(microbatches)]


def one_f_one_b_order(rank: int, pp: int, stages: int, microbatches: int) -> list[Action]:
    """1F1B (PipeDream-Flush): ``pp - 1 - rank`` warmup forwards, then alternate F and B, then the remaining B.

    Requires ``stages == pp``. Ensures at most ``pp - rank`` microbatches are in flight on ``rank``.
    """
    warmup = min(pp - 1 - rank, microbatches)
    order = [Action("F", rank, mb) for mb in range(warmup)]
    for mb in range(microbatches - warmup):
        order += [Action("F", rank, warmup + mb), Action("B", rank, mb)]
    return order + [Action("B", rank, mb) for mb in range(microbatches - warmup, microbatches)]


def zb_h1_order(rank: int, pp: int, stages: int, microbatches: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023): 1F1B with B split into B (input grad) and W (weight grad).

    The first ``rank`` steady-state steps skip their W; every later B is followed by the oldest pending W,
    and the W still pending after the last B run at the end, where they fill the cooldown bubble. Requires
    ``stages == pp``. Ensures at most ``pp`` microbatches hold activations (F done, W not yet) on any rank,
    the 1F1B peak of rank 0.
    """
    warmup = min(pp - 1 - rank, microbatches)
    order = [Action("F", rank, mb) for mb in range(warmup)]
    pending: list[int] = []
    for mb in range(microbatches):
        if warmup + mb < microbatches:
            order.append(Action("F", rank, warmup + mb))
        order.append(Action("B", rank, mb))
        pending.append(mb)
        if mb >= rank:
            order.append(Action("W", rank, pending.pop(0)))
    return order + [Action("W", rank, mb) for mb in pending]


def _chunk_action(kind: str, rank: int, pp: int, v: int, k: int, backward: bool) -> Action:
    """The ``k``-th forward (or backward) chunk action of ``rank`` in Megatron's interleaved order."""
    chunk = (k // pp) % v
    if backward:
        chunk = v - 1 - chunk
    mb = (k // (pp * v)) * pp + k % pp
    return Action(kind, chunk * pp + rank, mb)


def interleaved_order(rank: int, pp: int, stages: int, microbatches: int) -> list[Action]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021) with ``v = stages // pp`` chunks per rank.

    Microbatches go in groups of ``pp``: chunk 0 of the group, then chunk 1, ...; backwards visit the chunks
    in reverse. Rank ``r`` runs ``(v - 1) * pp + 2 * (pp - 1 - r)`` warmup forwards (capped at ``v * m``),
    then alternates F and B, then the remaining B. Requires ``microbatches % pp == 0``; with ``v == 1``
    this is exactly 1F1B.
    """
    v = stages // pp
    if v == 1:
        return one_f_one_b_order(rank, pp, stages, microbatches)
    total = v * microbatches
    warmup = min((v - 1) * pp + 2 * (pp - 1 - rank), total)
    order = [_chunk_action("F", rank, pp, v, k, False) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(_chunk_action("F", rank, pp, v, warmup + k, False))
        order.append(_chunk_action("B", rank, pp, v, k, True))
    return order + [_chunk_action("B", rank, pp, v, k, True) for k in range(total - warmup, total)]


def _recv_before(action: Action, rank: int, pp: int, stages: int) -> list[Action]:
    """The RECV that must precede ``action`` on ``rank`` (at most one)."""
    if action.kind == "F" and action.stage > 0 and (action.stage - 1) % pp != rank:
        return [Action("RECV_F", action.stage - 1, action.mb, (action.stage - 1) % pp)]
    if action.kind == "B" and action.stage < stages - 1 and (action.stage + 1) % pp != rank:
        return [Action("RECV_B", action.stage + 1, action.mb, (action.stage + 1) % pp)]
    return []


def _send_after(action: Action, rank: int, pp: int, stages: int) -> list[Action]:
    """The SEND that must follow ``action`` on ``rank`` (at most one)."""
    if action.kind == "F" and action.stage < stages - 1 and (action.stage + 1) % pp != rank:
        return [Action("SEND_F", action.stage, action.mb, (action.stage + 1) % pp)]
    if action.kind == "B" and action.stage > 0 and (action.stage - 1) % pp != rank:
        return [Action("SEND_B", action.stage, action.mb, (action.stage - 1) % pp)]
    return []


def add_comm(compute: list[list[Action]], pp: int, stages: int) -> list[list[Action]]:
    """Insert the transfers into per-rank compute lists.

    Requires: ``compute[r]`` holds only F/B/W actions of stages on rank ``r``.
    Ensures: after F(s, mb) comes SEND_F(s, mb) to the rank of stage s+1 when that is another rank, and the
    matching RECV_F comes right before F(s+1, mb); likewise SEND_B(s, mb) after B(s, mb) and RECV_B right
    before B(s-1, mb). Neighbouring stages on the same rank hand values over locally (no transfer).
    """
    out: list[list[Action]] = []
    for rank, actions in enumerate(compute):
        steps: list[Action] = []
        for action in actions:
            steps += _recv_before(action, rank, pp, stages) + [action] + _send_after(action, rank, pp, stages)
        out.append(steps)
    return out


ORDERS: dict[str, Order] = {
    "gpipe": gpipe_order,
    "1f1b": one_f_one_b_order,
    "interleaved-1f1b": interleaved_order,
    "zb-h1": zb_h1_order,
}
