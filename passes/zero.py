"""zero: store parameters sharded over dp (ZeRO-1/2: gathered once per step; ZeRO-3: at each use)."""

from __future__ import annotations

from torch.distributed.tensor import Shard

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
    in ``notes["zero_replicated"]``. Lowering reads the table. ZeRO-1/2: a ``gather_params`` graph
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
    return prog.replace("zero", notes={**prog.notes, "zero": dims, "zero_replicated": replicated,
                                                     "zero_level": ctx.plan.zero})
