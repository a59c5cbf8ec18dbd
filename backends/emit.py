"""Emit a compiled model as a folder of per-rank training executables (``pm.save``; ``python -m fxpar.run`` runs it).

A saved folder holds, for every rank ``r``:

- ``rank<r>.py``: the rank's programs as readable Python (the ``pm.program(r)`` text: per stage it holds,
  forward, backward, gradient reduction, ZeRO gathers; the backward's B and W halves where the step runs them
  (``fxpar.rank_step.backward_halves``); the loss on the last stage), then what running a step needs as
  literals: ``SPEC`` (how each stage's functions are called, ``fxpar.rank_spec``), ``EVENTS`` (the rank's
  ordered step events, exact tags and peers, ``fxpar.rank_step``) and ``PARAMS`` (each parameter's global
  shape, dtype and placements). Every name the file uses is defined in it or imported by it from torch and fxpar.
- ``rank<r>.pt``: its stages' buffers and lifted constants (``torch.load(..., weights_only=True)``).

and one ``manifest.json``: the fxpar version and file format, the mesh, device and world size, the plan,
schedule and microbatches, the user inputs (per-microbatch global shapes and dtypes), the targets the
loss takes, every process group (symbolic name -> ranks) and the tied-weight groups in creation order.
Saving the same compiled model twice writes the same bytes.
"""

from __future__ import annotations

import io
import json
import os
import pprint
import tempfile
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from fxpar.compiled import Compiled
from fxpar.params import param_placements
from fxpar.printer import graph_source, group_vars, print_rank_programs
from fxpar.rank_spec import events_data, rank_spec, spec_data
from fxpar.rank_step import backward_halves, rank_step, step_ledger, tie_holders, tie_ranks
from fxpar.split import rank_batch_size

FORMAT = 2  # bump when the folder's layout or a literal's meaning changes (fxpar.run refuses others)

PRELUDE = '''import torch

import fxpar.ops  # registers fxpar's own ops (fxpar.bmm4, ...) with torch
from fxpar.backends import comm

aten = torch.ops.aten
fxpar = torch.ops.fxpar
inf = float("inf")
nan = float("nan")
constants: dict = {{}}  # lifted tensor constants: fxpar.run fills it from {tensors}
{groups}
'''


def version() -> str:
    """The fxpar version a saved folder records (the installed distribution's)."""
    try:
        return dist_version("fxpar")
    except PackageNotFoundError:
        return "0+unknown"


class SaveSources:
    """What a saved folder needs beyond the compiled programs: buffer values, which parameters train, the loss."""

    def __init__(self, buffers: dict[str, torch.Tensor], requires_grad: dict[str, bool],
                 loss_fn: Callable[..., torch.Tensor] | None, non_persistent: frozenset[str] = frozenset()) -> None:
        self.buffers, self.requires_grad, self.loss_fn = buffers, requires_grad, loss_fn
        self.non_persistent = non_persistent  # the model's buffers its state_dict leaves out (a checkpoint too)


def save_programs(c: Compiled, folder: str, sources: SaveSources, ranks: list[int] | None = None) -> list[str]:
    """Write ``rank<r>.py`` and ``rank<r>.pt`` for each rank (all by default) and ``manifest.json``; return the
    ``.py`` paths. Each file is written whole and then renamed into place, so every rank of a job may save."""
    os.makedirs(folder, exist_ok=True)
    ranks = list(range(c.mesh.size)) if ranks is None else ranks
    targets = _targets_meta(c)
    losses: dict[Any, str] = {}  # one trace per distinct local output signature
    manifest = _manifest(c, targets, sources.loss_fn is not None)
    manifest["non_persistent_buffers"] = sorted(sources.non_persistent)
    paths = []
    for r in ranks:
        source, tensors = rank_file(c, r, sources, targets, losses)
        paths.append(_write(folder, f"rank{r}.py", source.encode()))
        _write(folder, f"rank{r}.pt", _tensor_bytes(tensors))
        manifest["ranks"][str(r)] = _rank_entry(c, r)
    _write(folder, "manifest.json", (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return paths


def rank_file(c: Compiled, rank: int, sources: SaveSources, targets: dict[str, Any] | None,
              losses: dict[Any, str] | None = None) -> tuple[str, dict[str, Any]]:
    """The text of ``rank<rank>.py`` and the tensors of ``rank<rank>.pt``."""
    groups: dict[str, str] = {}
    for stage in c.stage_of_rank(rank):
        groups.update(group_vars(c.rank_program(rank, stage)))
    group_lines = "\n".join(f"{v} = {s!r}" for s, v in sorted(groups.items(), key=lambda kv: kv[1]))
    parts = [PRELUDE.format(groups=group_lines, tensors=f"rank{rank}.pt"), print_rank_programs(c, rank)]
    spec = rank_spec(c, rank)
    halves = backward_halves(c, rank)
    for s in [s for s in c.stage_of_rank(rank) if s in halves]:
        for half in ("backward_b", "backward_w"):
            parts.append(graph_source(f"{half}{stage_suffix(c, s)}", c.stage_graph(rank, s, half), c.mesh.names,
                                      group_vars(c.rank_program(rank, s))) + "\n")
    last = len(c.stages) - 1
    if last in spec.stages:
        parts.append(_loss_source(c, rank, sources, spec.stages[last].out_meta, targets, losses))
    parts.append(_literal("SPEC", spec_data(spec)))
    parts.append(_literal("EVENTS", events_data(rank_step(c, rank))))
    parts.append(_literal("PARAMS", param_table(c, rank, sources.requires_grad)))
    tensors = {"buffers": _buffers(c, rank, sources.buffers), "constants": _constants(c, rank)}
    return "\n\n".join(p.rstrip("\n") for p in parts) + "\n", tensors


def stage_suffix(c: Compiled, stage: int) -> str:
    return stage_suffix_of(len(c.stages), stage)


def stage_suffix_of(n_stages: int, stage: int) -> str:
    """How a stage's functions are named in a rank file: ``forward`` alone, ``forward_stage1`` in a pipeline."""
    return "" if n_stages == 1 else f"_stage{stage}"


def param_table(c: Compiled, rank: int, requires_grad: dict[str, bool]) -> list[dict[str, Any]]:
    """Each parameter ``rank`` holds, once, in the order ``ParallelModule`` registers them: fqn, global shape,
    dtype, placements on the parameter mesh (``R``, ``S(d)``) and whether it trains."""
    out, seen = [], set()
    for s in c.stage_of_rank(rank):
        prog = c.stages[s]
        for fqn, name in prog.signature.params:
            if fqn in seen:
                continue
            seen.add(fqn)
            val = prog.node(name).meta["val"]
            out.append({"fqn": fqn, "shape": list(val.shape), "dtype": str(val.dtype).removeprefix("torch."),
                        "placements": [_placement(p) for p in param_placements(prog, fqn, name)],
                        "requires_grad": requires_grad.get(fqn, True)})
    return out


def _placement(p: Any) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    assert isinstance(p, Replicate), f"a parameter is stored sharded or replicated, not {p}"
    return "R"


def _targets_meta(c: Compiled) -> dict[str, Any] | None:
    """The targets ``fxpar.run`` feeds the loss: the next token of each input position (int64, shaped as the
    first user input), when the program takes a single integer input (token ids). None otherwise."""
    inputs = _user_inputs(c)
    if len(inputs) != 1 or inputs[0]["dtype"] not in ("int64", "int32") or len(inputs[0]["shape"]) != 2:
        return None
    return {"shape": inputs[0]["shape"], "dtype": "int64"}


def _user_inputs(c: Compiled) -> list[dict[str, Any]]:
    """Per-microbatch global shape and dtype of each tensor input of the program, in the order it takes them."""
    first = c.stages[0]
    info = first.notes.get("stage")
    names = first.signature.inputs[len(info.received):] if info is not None else first.signature.inputs
    out = []
    for name in names:
        val = first.node(name).meta["val"]
        out.append({"shape": list(val.shape), "dtype": str(val.dtype).removeprefix("torch.")})
    return out


def _manifest(c: Compiled, targets: dict[str, Any] | None, has_loss: bool) -> dict[str, Any]:
    groups: dict[str, list[int]] = {}
    for r in range(c.mesh.size):
        for s in c.stage_of_rank(r):
            groups.update({sym: list(g) for sym, g in c.rank_program(r, s).groups.items()})
    ties = []
    for fqn, pps in tie_holders(c).items():
        for r in range(c.mesh.size):
            if c.pp_coord(r) == pps[0]:
                ties.append([fqn, list(dict(tie_ranks(c, r))[fqn])])
    return {
        "format": FORMAT, "fxpar": version(), "torch": torch.__version__.split("+")[0],
        "mesh": [[a, n] for a, n in c.mesh.axes.items()], "device": c.mesh.device, "world": c.mesh.size,
        "plan": repr(c.plan), "schedule": c.schedule.name, "microbatches": c.microbatches, "stages": len(c.stages),
        "input_kind": c.input_kind, "input_keys": list(c.input_keys), "inputs": _user_inputs(c), "targets": targets,
        "loss": has_loss and targets is not None, "vocab": _vocab(c),
        "groups": dict(sorted(groups.items())), "tie_groups": ties, "ranks": {},
    }


def _rank_entry(c: Compiled, r: int) -> dict[str, Any]:
    rp = c.rank_program(r)
    return {"file": f"rank{r}.py", "tensors": f"rank{r}.pt", "coord": list(rp.coord), "stages": c.stage_of_rank(r),
            "collectives": len(step_ledger(rank_step(c, r)))}


def _vocab(c: Compiled) -> int | None:
    """Rows of the embedding table the token ids index (``--synthetic`` draws ids below it), if there is one."""
    prog = c.stages[0]
    params = {name for _, name in prog.signature.params}
    for n in prog.graph.nodes:
        if n.target is torch.ops.aten.embedding.default and getattr(n.args[0], "name", None) in params:
            return int(n.args[0].meta["val"].shape[0])
    return None


def _loss_source(c: Compiled, rank: int, sources: SaveSources, out_meta: list[Any], targets: dict[str, Any] | None,
                 losses: dict[Any, str] | None) -> str:
    """``def loss(<output leaves>, targets): return (value,)``: the user's loss traced to aten ops on this rank's
    local microbatch shapes (a comment saying why when it cannot be)."""
    if sources.loss_fn is None or targets is None:
        why = "no loss_fn was given to fxpar.parallelize" if sources.loss_fn is None else \
            "fxpar.run feeds token ids and next-token targets; this program takes other inputs"
        return f"# loss: not saved ({why})\n"
    batch = rank_batch_size(targets["shape"][0] * c.microbatches, c.mesh, rank) // c.microbatches
    shape = [batch, *targets["shape"][1:]]
    key = (tuple((tuple(m[0]), m[1]) for m in out_meta), tuple(shape))
    if losses is not None and key in losses:
        return losses[key]
    try:
        gm = trace_loss(sources.loss_fn, c.out_spec, out_meta, shape)
        text = graph_source("loss", gm, (), {}) + "\n"
    except Exception as e:  # noqa: BLE001 - any tracing failure means: no saved loss, and say why
        text = f"# loss: not saved (tracing loss_fn failed: {type(e).__name__}: {str(e).splitlines()[0][:200]})\n"
    if losses is not None:
        losses[key] = text
    return text


def trace_loss(loss_fn: Callable[..., torch.Tensor], out_spec: Any, out_meta: list[Any],
               target_shape: list[int]) -> fx.GraphModule:
    """``loss_fn(outputs, targets)`` as an aten graph over the output leaves and the targets (it returns a
    1-tuple). Run eagerly on tensors that require grad, its backward is the one autograd gives ``loss_fn``."""
    if any(m is None for m in out_meta):
        raise ValueError("the last stage returns a non-tensor output")

    def flat_loss(*args: torch.Tensor) -> tuple[torch.Tensor]:
        *leaves, targets = args
        return (loss_fn(pytree.tree_unflatten(list(leaves), out_spec), targets),)

    examples = [torch.zeros(shape, dtype=dtype) for shape, dtype in out_meta]
    examples.append(torch.zeros(target_shape, dtype=torch.int64))
    return make_fx(flat_loss, tracing_mode="fake")(*examples)


def _buffers(c: Compiled, rank: int, buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for s in c.stage_of_rank(rank):
        for fqn, _ in c.stages[s].signature.buffers:
            b = buffers.get(fqn)
            if b is None:
                raise ValueError(f"cannot save buffer {fqn!r}: the ParallelModule was built without the model")
            if b.is_meta:
                raise ValueError(f"cannot save buffer {fqn!r}: it is on the meta device (initialize the model first)")
            out[fqn] = b.detach().cpu().clone()
    return out


def _constants(c: Compiled, rank: int) -> dict[str, torch.Tensor]:
    """Lifted tensor constants of the rank's graphs, by the name the printed code reads them under."""
    out: dict[str, torch.Tensor] = {}
    for s in c.stage_of_rank(rank):
        rp = c.rank_program(rank, s)
        for gm in (rp.forward, rp.backward, rp.reduce_grads, rp.gather_params):
            for n in gm.graph.nodes if gm is not None else ():
                if n.op != "get_attr":
                    continue
                value = getattr(gm, n.target)
                if n.target in out and not torch.equal(out[n.target], value):
                    raise ValueError(f"two stages of rank {rank} hold different constants named {n.target!r}")
                out[n.target] = value.detach().cpu().clone()
    return out


def _literal(name: str, value: Any) -> str:
    return f"{name} = {pprint.pformat(value, width=120, sort_dicts=True)}\n"


def _tensor_bytes(tensors: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def _write(folder: str, name: str, data: bytes) -> str:
    path = os.path.join(folder, name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path
