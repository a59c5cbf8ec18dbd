"""zero: store parameters sharded over dp (ZeRO-1/2: gathered once per step; ZeRO-3: at each use)."""

from __future__ import annotations

from torch.distributed.tensor import Shard

from fxpar.errors import warn_at_callers_line
from fxpar.ir import Program
from fxpar.pass_context import Context


def zero(prog: Program, ctx: Context) -> Program:
    """Choose, per parameter, the dim its dp shard is taken on.

    Requires: an annotated Program (parameter placements per mesh axis, replicated over dp);
    ``ctx.plan.zero`` in (0, 1, 2, 3); with ``zero >= 1`` a dp axis of size > 1 (checked by the Plan).
    Ensures: with ``zero >= 1``, ``notes["zero"] = {fqn: dim}`` for every parameter stored as a dp
    shard: ``dim`` is the first dim that no other mesh axis shards and whose per-rank size (after
    tp) dp divides, so the dp shard of the tp shard is a plain ``Shard(dim)`` and needs no strided
    layout. Parameters without such a dim stay replicated over dp (DDP for them) and are listed
    in ``notes["zero_replicated"]`` (a ``FxparWarning`` when they hold 1% or more of the parameter bytes).
    Lowering reads the table. ZeRO-1/2: a ``gather_params`` graph
    all-gathers the shards once per step and ``reduce_grads`` reduce-scatters their gradients
    (ZeRO-1: once per step; ZeRO-2: after every microbatch's backward, in the executor). ZeRO-3
    (FSDP): the forward graph takes the shards and all-gathers each right before its first use,
    the backward graph all-gathers again what it reads (the gathered copy is not saved between
    the two), and gradients are reduce-scattered after every microbatch's backward, as ZeRO-2.
    With ``zero == 0`` the Program is returned unchanged.
    """
    if not ctx.plan.zero:
        return prog
    mesh = prog.mesh
    dp = mesh.axes["dp"]
    dims: dict[str, int] = {}
    replicated: list[str] = []
    for fqn, name in prog.signature.params:
        placements = prog.placements[name]
        shape = prog.node(name).meta["val"].shape  # the dims it may choose are not sharded: global = local
        taken = {p.dim for p in placements if isinstance(p, Shard)}
        dim = next((d for d in range(len(shape)) if d not in taken and shape[d] % dp == 0), None)
        if dim is None:
            replicated.append(fqn)
        else:
            dims[fqn] = dim
    _warn_replicated(prog, replicated, ctx.plan.zero, dp)
    return prog.replace("zero", notes={**prog.notes, "zero": dims, "zero_replicated": replicated,
                                                     "zero_level": ctx.plan.zero})


def _warn_replicated(prog: Program, replicated: list[str], level: int, dp: int) -> None:
    """A ``FxparWarning`` when ZeRO leaves 1% or more of the parameter bytes replicated (dp=3 on power-of-two
    widths keeps the whole model: plain data parallelism, and its memory, where ZeRO was asked for)."""
    size = {fqn: _nbytes(prog, name) for fqn, name in prog.signature.params}
    kept = sum(size[fqn] for fqn in replicated)
    if not kept or kept < 0.01 * sum(size.values()):
        return
    biggest = max(replicated, key=size.__getitem__)
    shape = tuple(prog.node(dict(prog.signature.params)[biggest]).meta["val"].shape)
    share = 100 * kept / sum(size.values())
    warn_at_callers_line(
        f"fxpar: Plan(zero={level}) keeps {len(replicated)} of {len(size)} parameters ({share:.0f}% of the parameter "
        f"bytes) replicated over dp={dp}: dp divides none of their dims that tp leaves whole (the largest: "
        f"{biggest!r} {shape}), and ZeRO shards a parameter on a dim dp divides; their memory is data parallelism's "
        "(pm.memory counts it). Use a dp size that divides the model's widths")


def _nbytes(prog: Program, name: str) -> int:
    val = prog.node(name).meta["val"]
    return val.numel() * val.element_size()
