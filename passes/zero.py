"""zero: store parameters sharded over dp (ZeRO-1/2: gathered once per step; ZeRO-3: at each use)."""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.distributed.tensor import Shard

from fxpar.errors import warn_at_callers_line
from fxpar.ir import Program
from fxpar.pass_context import Context
from fxpar.split import chunk_sizes, splitter


def zero(prog: Program, ctx: Context) -> Program:
    """Choose, per parameter, the dim its dp shard is taken on.

    Requires: an annotated Program (parameter placements per mesh axis, replicated over dp);
    ``ctx.plan.zero`` in (0, 1, 2, 3); with ``zero >= 1`` a dp axis of size > 1 (checked by the Plan).
    Ensures: with ``zero >= 1``, ``notes["zero"] = {fqn: dim}`` for every parameter stored as a dp
    shard: ``dim`` is a dim that no other mesh axis shards (so the dp shard of the tp shard is a plain
    ``Shard(dim)`` and needs no strided layout): the first one whose per-rank size (after tp) dp divides; where
    none does, the one whose largest piece is smallest (an uneven DTensor shard, pieces of ``ceil(size / dp)``
    first, as FSDP2 shards: ``fxpar.split``). Only dims whose dp pieces ``fxpar.split`` takes as DTensor's are
    chosen (a dim dp does not divide needs a batch dp divides, ``Splitter.batch_even``; a multiple of an uneven
    batch follows the batch's split). Parameters without such a dim stay replicated over
    dp (DDP for them) and are listed in ``notes["zero_replicated"]`` (a ``FxparWarning`` when they hold 1% or
    more of the parameter bytes).
    Lowering reads the table. ZeRO-1/2: a ``gather_params`` graph
    all-gathers the shards once per step and ``reduce_grads`` reduce-scatters their gradients
    (ZeRO-1: once per step; ZeRO-2: after every microbatch's backward, in the executor). ZeRO-3
    (FSDP): the forward graph takes the shards and all-gathers each right before its first use,
    the backward graph all-gathers again what it reads (the gathered copy is not saved between
    the two), and gradients are reduce-scattered after every microbatch's backward, as ZeRO-2.
    Uneven pieces are padded to one size inside those collectives (the ledger counts the padding).
    With ``zero == 0`` the Program is returned unchanged.
    """
    if not ctx.plan.zero:
        return prog
    dp = prog.mesh.axes["dp"]
    split, ax = splitter(prog), prog.mesh.axis_index("dp")
    dims: dict[str, int] = {}
    replicated: list[str] = []
    for fqn, name in prog.signature.params:
        dim = _shard_dim(prog.node(name).meta["val"].shape, prog.placements[name], dp,
                         lambda size: split.sizes(size, ax) == chunk_sizes(size, dp))
        if dim is None:
            replicated.append(fqn)
        else:
            dims[fqn] = dim
    _warn_replicated(prog, replicated, ctx.plan.zero, dp, split.batch_even(dp))
    return prog.replace("zero", notes={**prog.notes, "zero": dims, "zero_replicated": replicated,
                                                     "zero_level": ctx.plan.zero})


def _shard_dim(shape: tuple[int, ...], placements: tuple, dp: int, as_dtensor: Callable[[int], bool]) -> int | None:
    """The dim a parameter of global ``shape`` is sharded on over dp (None: none of its free dims can be): the first
    free dim dp divides, else the free dim of at least dp rows whose largest piece is smallest; only dims whose dp
    pieces lowering takes as DTensor's (``as_dtensor``: a dim that is a multiple of an uneven batch follows the
    batch's split, ``fxpar.split``)."""
    taken = {p.dim for p in placements if isinstance(p, Shard)}  # the dims it may choose are whole: global = local
    free = [d for d in range(len(shape)) if d not in taken and shape[d] >= dp and as_dtensor(shape[d])]
    even = next((d for d in free if shape[d] % dp == 0), None)
    if even is not None:
        return even
    return min(free, key=lambda d: -(-shape[d] // dp) * math.prod(shape) // shape[d], default=None)


def _warn_replicated(prog: Program, replicated: list[str], level: int, dp: int, uneven_ok: bool) -> None:
    """A ``FxparWarning`` when ZeRO leaves 1% or more of the parameter bytes replicated (dp=3 on power-of-two
    widths with a batch dp does not divide keeps the whole model: plain data parallelism, and its memory, where
    ZeRO was asked for)."""
    size = {fqn: _nbytes(prog, name) for fqn, name in prog.signature.params}
    kept = sum(size[fqn] for fqn in replicated)
    if not kept or kept < 0.01 * sum(size.values()):
        return
    biggest = max(replicated, key=size.__getitem__)
    shape = tuple(prog.node(dict(prog.signature.params)[biggest]).meta["val"].shape)
    share = 100 * kept / sum(size.values())
    why = ("none of their dims that tp leaves whole has dp rows or more" if uneven_ok else
           "dp divides none of their dims that tp leaves whole, and ZeRO shards a dim unevenly only where dp "
           "divides the global batch; use a batch dp divides")
    warn_at_callers_line(
        f"fxpar: Plan(zero={level}) keeps {len(replicated)} of {len(size)} parameters ({share:.0f}% of the parameter "
        f"bytes) replicated over dp={dp}: {why} (the largest: {biggest!r} {shape}); their memory is data "
        "parallelism's (pm.memory counts it)")


def _nbytes(prog: Program, name: str) -> int:
    val = prog.node(name).meta["val"]
    return val.numel() * val.element_size()
