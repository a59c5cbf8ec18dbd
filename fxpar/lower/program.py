"""What lowering produces for one rank: its ``RankProgram`` and the ledger rows of its collectives."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass(frozen=True)
class LedgerRow:
    """One collective (or point-to-point transfer) a rank issues. ``bytes`` is the full tensor it
    reduces or produces (for ``send``/``recv``: the tensor transferred)."""

    phase: str
    op: str
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    group: tuple[int, ...]
    stage: int = 0
    mb: int | None = None  # microbatch, in a step ledger; None for once-per-step collectives
    peer: int | None = None  # the other rank of a send/recv


@dataclass
class RankProgram:
    """One rank's lowered program: the joint graph, its forward/backward split, and the ledger."""

    rank: int
    coord: tuple[int, ...]
    joint: fx.GraphModule | None  # lowering's intermediate: a program bound from its role's has none
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: list[str]
    ledger: list[LedgerRow] = field(default_factory=list)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # symbolic name -> ranks
    # dp gradient reductions, deferred to once per step: backward output index -> parameter fqn, and the
    # graph that reduces those accumulated gradients (``None`` when there are none)
    deferred: list[tuple[int, str]] = field(default_factory=list)
    reduce_grads: fx.GraphModule | None = None
    stage: int = 0
    # ZeRO: parameters stored as dp shards (fqn -> shard dim), the graph that all-gathers them once per
    # step (shards in, this rank's tp-local parameters out, in ``zero`` order) and its ledger rows
    zero: dict[str, int] = field(default_factory=dict)
    gather_params: fx.GraphModule | None = None
    gather_ledger: list[LedgerRow] = field(default_factory=list)


def group_name(axis: str, ranks: list[int] | tuple[int, ...]) -> str:
    return f"{axis}[{','.join(map(str, ranks))}]"
