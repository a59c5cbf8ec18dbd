"""When a backward send has certainly arrived, read from the schedule of both ranks.

A pipeline rank sends each stage input's gradient back with a non-blocking send (``SEND_B``), and the tensor stays
alive until the send is awaited. Awaited only at the step's end, every microbatch's gradient is held at once: on
Megatron-LM's 1T layout (512 microbatches, two stages per rank, a 105 MB gradient each) that is 107 GB per rank.

Receives block. So once this rank has received a message its peer sent after the peer's matching ``RECV_B``
returned, that ``RECV_B`` had completed, and this rank's send with it: awaiting the send there returns at once
and frees its tensor. ``backward_send_arrivals`` finds, for each ``SEND_B`` of a rank, the first of its receives
that proves so; a send with no such receive (the peer sends nothing after it) is awaited at the step's end.
"""

from __future__ import annotations

from .actions import Action

ArrivalKey = tuple[str, int, int]  # a receive action of this rank: (kind, stage, microbatch)


def backward_send_arrivals(actions: list[list[Action]], rank: int) -> dict[ArrivalKey, list[tuple[int, int]]]:
    """Receive ``(kind, stage, mb)`` of pipeline rank ``rank`` -> the ``(stage, mb)`` of its ``SEND_B`` actions
    that have arrived once that receive has returned (module docstring).

    Requires: ``actions`` every pipeline rank's schedule (``Schedule.actions``), each transfer naming its peer, and
    every ``SEND_B`` matched by its peer's ``RECV_B`` of the same stage and microbatch.
    """
    out: dict[ArrivalKey, list[tuple[int, int]]] = {}
    for a in actions[rank]:
        if a.kind != "SEND_B" or a.peer == rank:
            continue
        peer = actions[a.peer]
        received = next(i for i, b in enumerate(peer) if (b.kind, b.stage, b.mb) == ("RECV_B", a.stage, a.mb))
        later = next((b for b in peer[received + 1:] if b.is_send and b.peer == rank), None)
        if later is not None:
            key = ("RECV_F" if later.kind == "SEND_F" else "RECV_B", later.stage, later.mb)
            out.setdefault(key, []).append((a.stage, a.mb))
    return out
