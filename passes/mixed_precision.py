"""mixed_precision: record the plan's dtypes; under ZeRO-3 cast each weight on its dp shard before the all-gather."""

from __future__ import annotations

import torch
import torch.fx as fx
from fxpar.passes.fp8_gather import shard_casts, zero3_dims

from fxpar.ir import Program
from fxpar.pass_context import Context

aten = torch.ops.aten


def mixed_precision(prog: Program, ctx: Context) -> Program:
    """Mixed precision (``Plan(param_dtype=..., reduce_dtype=...)``) after propagation.

    Requires: a Program captured under ``fxpar.mixed_precision.computing_in`` (each module's parameters cast
    to ``param_dtype`` where the module reads them; the backward of each cast returns the gradient in the
    parameter's dtype); ``propagate`` placed every node; ``zero`` chose ``notes["zero"]``; ``insert_collectives``
    has not run yet.
    Ensures: ``notes["mixed_precision"] = (param_dtype, reduce_dtype)`` (``reduce_dtype`` defaults to
    ``param_dtype``, as FSDP2's policy does), which lowering reads to reduce the batch axes' gradients in
    ``reduce_dtype``. With ``zero=3``, each weight's casts to ``param_dtype`` (its direct users) run on the
    weight's dp shard, so the all-gather where the cast value is read whole moves ``param_dtype`` bytes, in the
    forward and again in the backward (casting is elementwise: the gathered value is the same).
    ``notes["cast_gather"]`` lists those weights. Without ``param_dtype`` or ``reduce_dtype`` the Program is
    unchanged.
    """
    param_dtype, reduce_dtype = ctx.plan.param_dtype, ctx.plan.reduce_dtype
    if param_dtype is None and reduce_dtype is None:
        return prog
    notes = {**prog.notes, "mixed_precision": (param_dtype, reduce_dtype or param_dtype)}
    if param_dtype is None or prog.notes.get("zero_level") != 3 or "dp" not in prog.mesh.names:
        return prog.replace("mixed_precision", notes=notes)
    dims = zero3_dims(prog)
    casts = {name: _casts_of(prog.node(name), param_dtype) for name in dims}
    placements, arg_placements, done = shard_casts(prog, {w: c for w, c in casts.items() if c}, dims)
    notes["cast_gather"] = [fqn for fqn, name in prog.signature.params if name in done]
    return prog.replace("mixed_precision", placements=placements, arg_placements=arg_placements, notes=notes)


def _casts_of(weight: fx.Node, dtype: torch.dtype) -> list[fx.Node]:
    """The users of ``weight`` that cast it to ``dtype``."""
    return [u for u in weight.users if u.target is aten._to_copy.default and u.kwargs.get("dtype") is dtype
            and u.args[0] is weight]
