"""One step of a pipeline schedule: a compute action (F, B, W) or a point-to-point transfer (SEND_*, RECV_*).

Text form: ``F0.1`` (kind, stage, ``.``, microbatch); transfers add the peer rank after ``>`` (send) or
``<`` (receive): ``SEND_F0.1>1`` sends stage 0's forward output of microbatch 1 to rank 1, ``RECV_F0.1<0``
receives it from rank 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B", "W")
SEND_KINDS = ("SEND_F", "SEND_B")
RECV_KINDS = ("RECV_F", "RECV_B")
COMM_KINDS = SEND_KINDS + RECV_KINDS
KINDS = COMPUTE_KINDS + COMM_KINDS

_PATTERN = re.compile(r"(SEND_F|RECV_F|SEND_B|RECV_B|F|B|W)(\d+)\.(\d+)(?:([<>])(\d+))?")


@dataclass(frozen=True)
class Action:
    """One scheduled step on one pipeline rank.

    ``stage`` is the stage whose value the action computes or moves: ``SEND_F(s)``/``RECV_F(s)`` carry stage
    ``s``'s forward output to stage ``s + 1``; ``SEND_B(s)``/``RECV_B(s)`` carry stage ``s``'s input gradient
    to stage ``s - 1``. ``peer`` is the other pipeline rank of a transfer and ``None`` for compute.

    Requires: ``kind`` in ``KINDS``; ``stage``, ``mb`` >= 0; ``peer`` >= 0 for transfers, ``None`` for compute.
    """

    kind: str
    stage: int
    mb: int
    peer: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {', '.join(KINDS)}")
        if self.stage < 0 or self.mb < 0:
            raise ValueError(f"action {self.kind} needs stage >= 0 and mb >= 0, got stage={self.stage} mb={self.mb}")
        if self.is_comm and (self.peer is None or self.peer < 0):
            raise ValueError(f"{self.kind} needs a peer rank >= 0, got peer={self.peer}")
        if not self.is_comm and self.peer is not None:
            raise ValueError(f"compute action {self.kind} takes no peer, got peer={self.peer}")

    @property
    def is_compute(self) -> bool:
        """True for F, B and W."""
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        """True for SEND_* and RECV_*."""
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        """True for SEND_F and SEND_B."""
        return self.kind in SEND_KINDS

    @property
    def is_recv(self) -> bool:
        """True for RECV_F and RECV_B."""
        return self.kind in RECV_KINDS

    @property
    def payload(self) -> str:
        """The compute kind whose value this action produces or moves: "F", "B" or "W"."""
        return self.kind[-1]

    def __str__(self) -> str:
        """Ensures: ``Action.parse(str(a)) == a``."""
        base = f"{self.kind}{self.stage}.{self.mb}"
        if self.is_send:
            return f"{base}>{self.peer}"
        if self.is_recv:
            return f"{base}<{self.peer}"
        return base

    @staticmethod
    def parse(text: str) -> Action:
        """Inverse of ``__str__``. Requires: text in the compact form; raises ValueError otherwise."""
        match = _PATTERN.fullmatch(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. 'F0.1', 'SEND_F0.1>1', 'RECV_B1.0<1'")
        kind, stage, mb, arrow, peer = match.groups()
        expected = ">" if kind in SEND_KINDS else "<" if kind in RECV_KINDS else None
        if arrow != expected:
            want = f"'{expected}PEER'" if expected else "no peer"
            raise ValueError(f"cannot parse action {text!r}: {kind} takes {want}")
        return Action(kind, int(stage), int(mb), None if peer is None else int(peer))
