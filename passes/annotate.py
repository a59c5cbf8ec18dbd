"""annotate: seed placements for the program's inputs from the plan and the mesh."""

from __future__ import annotations

import fnmatch

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.errors import PlanError
from fxpar.ir import Program, batch_placements, sp_boundary
from fxpar.modules import ModuleTable
from fxpar.pass_context import Context
from fxpar.plan import check_axes, check_shardable, param_tp_placement, resolve_plan
from fxpar.split import CONTEXT_AXIS, sequence_length


def annotate(prog: Program, ctx: Context) -> Program:
    """Seed placements of parameters, buffers and user inputs.

    Requires: a captured Program; ``ctx.plan`` globs over the module paths of ``ctx.modules``.
    Ensures: every param/buffer/input placeholder has a placement per mesh axis: ``dp``
    shards inputs on dim 0 and replicates state; ``tp`` applies the plan (replicate otherwise);
    ``ep`` shards HF experts modules' weights on their experts dim (dim 0) and, like dp, the batch;
    ``pp`` replicates everything (each stage is its own program). A weight tied under several names takes the
    style of whichever of its modules the plan shards (PlanError if two shard it differently). Inputs are
    batch-sharded over dp (and ep) on dim 0 when dim 0 is the batch (the first input's dim 0); other inputs are
    replicated. A pipeline stage's received values are placed as the previous stage's outputs are
    (``batch_placements``).
    Raises PlanError for unknown axes, globs that match nothing and unsupported modules,
    ValueError for a parameter dim smaller than its axis and a batch smaller than dp (a rank would be
    empty). A dim its axis does not divide is split as ``fxpar.split`` says (DTensor's split for
    parameters; the first dp ranks one sample more for the batch).
    """
    mesh = prog.mesh
    check_axes(mesh.names)
    if "ep" in mesh.names and not ctx.modules.of_kind("experts"):
        raise PlanError(_no_expert_parallel(ctx.modules.model_type))
    _check_sequence(prog)
    styles = resolve_plan(ctx.modules, ctx.plan.tp)
    _refuse_styles_on_containers(ctx.modules, ctx.plan.tp)
    if styles and "tp" not in mesh.axes:
        raise PlanError("the plan shards modules over 'tp', but the mesh has no 'tp' axis")
    modules = ctx.modules
    placements = {}
    for fqn, name in prog.signature.params:
        path, _, pname = fqn.rpartition(".")
        per_axis = []
        for axis, n in mesh.axes.items():
            if axis == "ep" and n > 1:
                per_axis.append(Shard(0) if modules[path].kind == "experts" else Replicate())  # experts dim
            else:
                per_axis.append(_tp_placement(modules, styles, fqn) if axis == "tp" and n > 1 else Replicate())
        placements[name] = tuple(per_axis)  # a dim the axis does not divide is split as DTensor does
        check_shardable(prog.node(name).meta["val"].shape, placements[name], mesh.shape,
                        f"parameter {fqn!r} (module {path!r})")
    for _, name in prog.signature.buffers:
        placements[name] = tuple(Replicate() for _ in mesh.names)
    stage = prog.notes.get("stage")
    received = len(stage.received) if stage is not None else 0
    user = [prog.node(n).meta.get("val") for n in prog.signature.inputs[received:]]
    global_batch = next((v.shape[0] for v in user if isinstance(v, torch.Tensor) and v.ndim >= 1), None)
    for i, name in enumerate(prog.signature.inputs):
        val = prog.node(name).meta.get("val")
        if not isinstance(val, torch.Tensor):  # a non-tensor input (None, a flag): a constant, nothing to place
            continue
        if i < received:  # a stage boundary: placed as the previous stage's output was (batch_placements)
            placements[name] = batch_placements(val, mesh, batch=prog.notes.get("batch"), seq=sequence_length(prog),
                                                sp_seq=sp_boundary(prog, ctx))
            continue
        # the batch: dim 0 of the first input, and of every input as long (a [1, s] position table is not)
        batch = Shard(0) if val.ndim >= 1 and val.shape[0] == global_batch else Replicate()
        placements[name] = tuple(batch if (a in ("dp", "ep") and n > 1) else Replicate() for a, n in mesh.axes.items())
        dp, ep = mesh.axes.get("dp", 1), mesh.axes.get("ep", 1)
        if ep > 1 and batch == Shard(0) and val.shape[0] % (dp * ep):
            raise ValueError(f"input {i - received}: expert parallelism shards the batch over dp x ep = {dp * ep} "
                             f"ranks (as data parallelism does), but the batch of {val.shape[0]} is not a multiple "
                             f"of {dp * ep}; use a batch that dp x ep divides")
        if dp > 1 and batch == Shard(0) and val.shape[0] < dp:
            raise ValueError(f"input {i - received}: a batch of {val.shape[0]} over dp={dp} leaves some dp rank "
                             "without a sample (its batch-mean loss would be undefined); use a batch of at least "
                             f"{dp} or a smaller dp axis")
    return prog.replace("annotate", placements=placements, notes={**prog.notes, "plan": styles})


def _tp_placement(modules: ModuleTable, styles: dict[str, str], fqn: str) -> Placement:
    """The tp placement of parameter ``fqn``: its module's style, or, for a weight tied under several names (a head
    tied to the embedding), the style of whichever of its modules the plan shards (two that shard it differently
    are refused: a tied weight has one layout; ``replicate`` on one of them gives way to the other's style)."""
    chosen: dict[Placement, str] = {}
    for name in (fqn, *modules.tied.get(fqn, ())):
        path, _, pname = name.rpartition(".")
        if styles.get(path, "replicate") != "replicate":
            chosen.setdefault(param_tp_placement(modules[path], path, pname, styles[path]), f"{path} {styles[path]!r}")
    if len(chosen) > 1:
        raise PlanError(f"parameter {fqn!r} is tied under the names {', '.join((fqn, *modules.tied[fqn]))}, and the "
                        f"plan gives it two layouts ({' and '.join(f'{s} -> {p}' for p, s in chosen.items())}); a "
                        "tied weight has one: style one of its modules, or give both styles that place it alike")
    return next(iter(chosen), Replicate())


def _check_sequence(prog: Program) -> None:
    """A cp axis needs a sequence (dim 1 of the inputs) that ``2 * cp`` load-balanced chunks divide."""
    cp = prog.mesh.axes.get(CONTEXT_AXIS, 1)
    if cp == 1:
        return
    seq = sequence_length(prog)
    if seq is None:
        raise PlanError(f"the cp axis (cp={cp}) shards the sequence, dim 1 of the inputs, but no input has two dims")
    if seq % (2 * cp):
        raise ValueError(f"cp={cp} splits the sequence into 2 * cp = {2 * cp} load-balanced chunks, but the sequence "
                         f"length {seq} (dim 1 of the inputs) is not a multiple of {2 * cp}; pad the sequence to a "
                         f"multiple of {2 * cp} (with the padding masked out of the loss) or use a smaller cp axis")


def _no_expert_parallel(model_type: str) -> str:
    return (f"mesh axis 'ep' shards the experts of MoE layers, but {model_type} has no experts module "
            "(Hugging Face MoE experts, e.g. Mixtral's); use 'dp' to shard the batch")


SHARDABLE_KINDS = ("linear", "conv1d", "embedding", "experts")


def _refuse_styles_on_containers(modules: ModuleTable, plan: dict[str, str] | str | None) -> None:
    """A glob whose modules hold no shardable weight themselves (blocks, attention or MLP modules) would shard
    nothing, silently: name the Linears under them instead. (A glob that also matches Linears, as
    ``attention.self.*`` does beside a dropout, styles those.)"""
    plan = modules.hf_plan if plan == "hf" else plan
    for pattern, style in (plan or {}).items():
        matched = [p for p in modules.paths() if fnmatch.fnmatchcase(p, pattern)]
        if style == "replicate" or not matched or any(modules[p].kind in SHARDABLE_KINDS for p in matched):
            continue
        path, info = matched[0], modules[matched[0]]
        inner = [p for p, m in modules.modules.items() if p.startswith(path + ".") and m.kind in SHARDABLE_KINDS]
        hint = (f", and {path!r} holds none itself; style its modules instead: {', '.join(inner[:6])}"
                f"{', ...' if len(inner) > 6 else ''}") if inner else ""
        raise PlanError(f"{path} ({info.type_name}): style {style!r} is supported on nn.Linear, HF Conv1D and "
                        f"nn.Embedding (colwise) modules{hint}")
