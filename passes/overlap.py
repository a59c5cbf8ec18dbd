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

aten = torch.ops.aten
# the backward's compute that gradient buckets overlap with: after its last one, what remains is one tail bucket
MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten._scaled_mm.default,  # fp8's matmuls
           aten.convolution_backward.default}


def overlap(prog: Program, ctx: Context) -> Program:
    """Group the parameter gradients all-reduced over the batch axes (dp, ep) into buckets of about
    ``plan.bucket_mb`` MB.

    Requires: placements and the ``zero`` pass's notes.
    Ensures: with ``plan.overlap``, ``notes["overlap"] = {"buckets": [[fqn, ...], ...], "zero_buckets": [...],
    "bucket_bytes": B, "in_backward": bool}``: ``zero_buckets`` are the ZeRO shards' buckets, cut as below and at
    every change of repeated block (one flat reduce-scatter per bucket, and under ZeRO-1/2 one flat all-gather);
    ``buckets``: parameters replicated over dp, in the order the backward produces their
    gradients, cut greedily so a bucket's local bytes on rank 0 exceed ``B`` only when one gradient alone
    does (DDP's rule); gradients produced after the backward's last matmul join one final bucket (no
    compute is left to hide them behind, so one collective is cheapest). Every rank uses the same
    buckets, so every rank issues the same collectives.
    ``in_backward``: one microbatch and one stage, so lowering puts the bucket all-reduces inside the
    backward graph, each issued as soon as its last gradient exists; otherwise they stay in the
    once-per-step ``reduce_grads`` graph (gradients are summed over microbatches first). Lowering's
    ``fxpar.overlap`` step then moves every issue up and every wait down (on gloo meshes keeping one collective
    in flight per rank program). Without ``plan.overlap`` the
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
    zero_buckets: list[list[str]] = []
    if batch_ranks(mesh) > 1:
        buckets = _buckets(prog, bucket_bytes, sharded=False)
        zero_buckets = _with_frozen(prog, _buckets(prog, bucket_bytes, sharded=True)) if prog.notes.get("zero") else []
    single = prog.notes.get("stage") is None and (plan.microbatches or 1) == 1
    notes = {"buckets": buckets, "zero_buckets": zero_buckets, "bucket_bytes": bucket_bytes, "in_backward": single}
    return prog.replace("overlap", notes={**prog.notes, "overlap": notes})


def _buckets(prog: Program, bucket_bytes: int, sharded: bool) -> list[list[str]]:
    """Gradient buckets in backward order: of the parameters replicated over dp (``sharded=False``: all-reduced)
    or of the ZeRO shards (``sharded=True``: reduce-scattered, and gathered, one flat buffer per bucket; a bucket
    then also ends where the repeated block a parameter sits in changes, FSDP2's one group per block)."""
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
        if (fqn in zero) != sharded or grads[idx] is None or not isinstance(prog.placements[name][dp_ax], Replicate):
            continue
        val = prog.node(name).meta["val"]
        local = split.local_shape(val.shape, prog.placements[name], coord)
        produced.append((order[grads[idx].name], fqn, val.element_size() * math.prod(local), str(val.dtype)))
    last_matmul = max((order[n.name] for n in prog.graph.nodes
                       if n.target in MATMULS and is_backward(prog, n)), default=-1)
    unit = block_units([fqn for fqn, _ in prog.signature.params])
    buckets: list[list[str]] = []
    size, dtype, tail, block = 0, "", False, None
    for at, fqn, nbytes, dt in sorted(produced):
        same_block = not sharded or unit[fqn] == block
        if buckets and same_block and (tail or (size + nbytes <= bucket_bytes and dt == dtype)):  # one dtype
            buckets[-1].append(fqn)
            size += nbytes
        else:
            buckets.append([fqn])
            size, dtype, block = nbytes, dt, unit[fqn]
        tail = tail or (at > last_matmul and dt == dtype)
    return buckets


def _with_frozen(prog: Program, buckets: list[list[str]]) -> list[list[str]]:
    """``buckets`` (of ZeRO gradients) with every frozen ZeRO parameter in the first bucket of its block, or in a
    bucket of its block's frozen parameters: a ZeRO-3 block gathers its frozen weights with the rest (FSDP2's
    group holds them too); they have no gradient to reduce-scatter."""
    trainable = {fqn for fqn, _ in prog.signature.grads}
    unit = block_units([fqn for fqn, _ in prog.signature.params])
    frozen = [fqn for fqn in dict.fromkeys(f for f, _ in prog.signature.params)
              if fqn in prog.notes["zero"] and fqn not in trainable]
    out = [list(b) for b in buckets]
    for fqn in frozen:
        home = next((b for b in out if unit[b[0]] == unit[fqn]), None)
        if home is None:
            out.append(home := [])
        home.append(fqn)
    return out


def block_units(fqns: list[str]) -> dict[str, str]:
    """Each parameter's FSDP2 unit (``fully_shard`` per block): the outermost numbered component of its path whose
    container holds two children with the same parameter names, a list of alike blocks (``blocks.0`` for
    ``blocks.0.1.weight`` when ``blocks`` is a ``ModuleList`` of ``Sequential``s, ``layers.3`` for an expert
    ``layers.3.mlp.experts.5.w1``); else its outermost numbered component (a ResNet's ``layer2.0`` for its
    shortcut ``layer2.0.shortcut.0.weight``, where the stage's two blocks differ). A block's own numbered children
    (a ``Sequential``'s layers, T5's ``block.2.layer.1``) are not units of their own."""
    children: dict[str, dict[str, set[str]]] = {}
    for fqn in fqns:
        parts = fqn.split(".")
        for i, part in enumerate(parts[:-1]):
            if part.isdigit():
                children.setdefault(".".join(parts[:i]), {}).setdefault(part, set()).add(".".join(parts[i + 1:]))
    alike = {c for c, kids in children.items()
             if len({frozenset(s) for s in kids.values()}) < len(kids)}
    units = {}
    for fqn in fqns:
        parts = fqn.split(".")
        numbered = [i for i, part in enumerate(parts[:-1]) if part.isdigit()]
        outer = next((i for i in numbered if ".".join(parts[:i]) in alike), numbered[0] if numbered else None)
        units[fqn] = ".".join(parts[: outer + 1]) if outer is not None else ""
    return units


def block_of(fqn: str) -> str:
    """The repeated block a parameter sits in: its path up to the last numbered component (``layers.3`` for
    ``layers.3.mlp.up.weight``), or ``""`` outside any numbered container (embeddings, final norm, head)."""
    parts = fqn.split(".")
    numbered = [i for i, part in enumerate(parts[:-1]) if part.isdigit()]
    return ".".join(parts[: numbered[-1] + 1]) if numbered else ""
