"""When a pipeline send has certainly arrived, read from the schedule of both ranks.

A pipeline rank sends stage outputs forward and input gradients back with non-blocking sends, and each tensor stays
alive until its send is awaited. Backward sends awaited only at the step's end held every microbatch's gradient
at once: on Megatron-LM's 1T layout (512 microbatches, two stages per rank, a 105 MB gradient each) 107 GB per
rank; a forward send awaited when its gradient comes back is held for a whole round trip of the pipeline.

Receives block. So once this rank has received a message its peer sent after the peer's matching receive
returned, that receive had completed, and this rank's send with it: awaiting the send there returns at once and
frees its tensor. ``send_arrivals`` finds, for each send of a rank, the first of its receives that proves so; a
send with no such receive (the peer sends nothing after it) is awaited as before (a forward send when its
gradient comes back, any other at the step's end).
"""

from __future__ import annotations

from .actions import Action

ArrivalKey = tuple[str, int, int]  # a receive action of this rank: (kind, stage, microbatch)
RECEIVE_OF = {"SEND_F": "RECV_F", "SEND_B": "RECV_B"}


def send_arrivals(actions: list[list[Action]], rank: int) -> dict[ArrivalKey, list[ArrivalKey]]:
    """Receive ``(kind, stage, mb)`` of pipeline rank ``rank`` -> the sends ``(kind, stage, mb)`` of ``rank`` that
    have arrived once that receive has returned (module docstring).

    Requires: ``actions`` every pipeline rank's schedule (``Schedule.actions``), each transfer naming its peer, and
    every send matched by its peer's receive of the same kind, stage and microbatch.
    """
    out: dict[ArrivalKey, list[ArrivalKey]] = {}
    for a in actions[rank]:
        if not a.is_send or a.peer == rank:
            continue
        peer = actions[a.peer]
        mine = (RECEIVE_OF[a.kind], a.stage, a.mb)
        received = next(i for i, b in enumerate(peer) if (b.kind, b.stage, b.mb) == mine)
        later = next((b for b in peer[received + 1:] if b.is_send and b.peer == rank), None)
        if later is not None:
            out.setdefault((RECEIVE_OF[later.kind], later.stage, later.mb), []).append((a.kind, a.stage, a.mb))
    return out
