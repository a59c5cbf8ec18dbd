"""overlap: bucket the dp gradient all-reduces; lowering then issues collectives early and waits late."""

from __future__ import annotations

import math

import torch
from fxpar.passes.recompute import is_backward
from torch.distributed.tensor import Replicate

from fxpar.errors import PlanError
from fxpar.ir import Program
from fxpar.pass_context import Context
from fxpar.split import batch_ranks, splitter

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def overlap(prog: Program, ctx: Context) -> Program:
    """Group the parameter gradients all-reduced over the batch axes (dp, ep) into buckets of about
    ``plan.bucket_mb`` MB.

    Requires: placements and the ``zero`` pass's notes (ZeRO shards reduce-scatter per parameter instead).
    Ensures: with ``plan.overlap``, ``notes["overlap"] = {"buckets": [[fqn, ...], ...], "bucket_bytes": B,
    "in_backward": bool}``: parameters replicated over dp, in the order the backward produces their
    gradients, cut greedily so a bucket's local bytes on rank 0 exceed ``B`` only when one gradient alone
    does (DDP's rule); gradients produced after the backward's last matmul join one final bucket (no
    compute is left to hide them behind, so one collective is cheapest). Every rank uses the same
    buckets, so every rank issues the same collectives.
    ``in_backward``: one microbatch and one stage, so lowering puts the bucket all-reduces inside the
    backward graph, each issued as soon as its last gradient exists; otherwise they stay in the
    once-per-step ``reduce_grads`` graph (gradients are summed over microbatches first). Lowering's
    ``fxpar.overlap`` step then moves every issue up and every wait down (on gloo meshes keeping one collective
    in flight per process group). Without ``plan.overlap`` the
    Program is unchanged (one all-reduce per gradient, issued and waited back to back).
    """
    plan = ctx.plan
    if not plan.overlap:
        return prog
    if not isinstance(plan.bucket_mb, (int, float)) or plan.bucket_mb <= 0:
        raise PlanError(f"bucket_mb must be a positive number of megabytes, got {plan.bucket_mb!r}")
    mesh = prog.mesh
    bucket_bytes = int(plan.bucket_mb * 2**20)
    buckets: list[list[str]] = []
    if batch_ranks(mesh) > 1:
        buckets = _buckets(prog, bucket_bytes)
    single = prog.notes.get("stage") is None and (plan.microbatches or 1) == 1
    notes = {"buckets": buckets, "bucket_bytes": bucket_bytes, "in_backward": single}
    return prog.replace("overlap", notes={**prog.notes, "overlap": notes})


def _buckets(prog: Program, bucket_bytes: int) -> list[list[str]]:
    dp_ax = prog.mesh.axis_index("dp" if prog.mesh.axes.get("dp", 1) > 1 else "ep")  # the outer batch axis
    zero = prog.notes.get("zero", {})
    split = splitter(prog)
    coord = prog.mesh.coord(0)
    order = {n.name: i for i, n in enumerate(prog.graph.nodes)}
    grads = prog.graph.output_node().args[0]
    param_name = dict(prog.signature.params)
    produced: list[tuple[int, str, int, str]] = []
    for fqn, idx in prog.signature.grads:
        name = param_name[fqn]
        if fqn in zero or grads[idx] is None or not isinstance(prog.placements[name][dp_ax], Replicate):
            continue
        val = prog.node(name).meta["val"]
        local = split.local_shape(val.shape, prog.placements[name], coord)
        produced.append((order[grads[idx].name], fqn, val.element_size() * math.prod(local), str(val.dtype)))
    last_matmul = max((order[n.name] for n in prog.graph.nodes
                       if n.target in MATMULS and is_backward(prog, n)), default=-1)
    buckets: list[list[str]] = []
    size, dtype, tail = 0, "", False
    for at, fqn, nbytes, dt in sorted(produced):
        if buckets and (tail or (size + nbytes <= bucket_bytes and dt == dtype)):  # one dtype: one buffer
            buckets[-1].append(fqn)
            size += nbytes
        else:
            buckets.append([fqn])
            size, dtype = nbytes, dt
        tail = tail or (at > last_matmul and dt == dtype)
    return buckets
