"""What a rank needs to run its training step, as plain data.

``StageSpec`` says how one stage's graphs are called (argument order, which results are outputs,
saved values, parameter gradients, input gradients); ``RankSpec`` holds the rank's stages and the
facts of the step around them (microbatches, where boundary values come from, the loss weight).
The step executor reads only these, the stage graphs and ``fxpar.rank_step``'s events, so the same
executor runs an in-process ``ParallelModule`` (graphs lowered from ``Compiled``) and a saved rank
file under ``python -m fxpar.run`` (graphs imported from the file, the spec and events read from it).

``spec_data``/``spec_from_data`` and ``events_data``/``events_from_data`` turn them into Python
literals (ints, strings, lists, dicts; dtypes by name) and back, which is how ``pm.save`` writes them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from fxpar.buffer_writes import written_buffers
from fxpar.rank_step import Boundary, Comm, StepEvent, boundary_meta
from fxpar.split import BATCH_AXES, BATCH_AXIS, batch_weight, splitter

if TYPE_CHECKING:
    from fxpar.compiled import Compiled


@dataclass
class StageSpec:
    """How a rank calls one stage's graphs, and what their results mean."""

    stage: int
    param_fqns: list[str]  # the forward's first arguments: one per parameter use, in order
    buffer_fqns: list[str]  # then the buffers
    zero_fqns: list[str]  # dp-sharded parameters gathered for the step (ZeRO), once each
    zero_positions: list[int]  # positions in ``param_fqns`` of ZeRO parameters
    num_outputs: int  # forward results before the saved values
    tangent_outputs: list[int]  # outputs whose gradient the backward takes, in order
    grad_fqn: dict[int, str]  # backward result position -> parameter it is the gradient of
    input_grad_pos: dict[str, int]  # received placeholder -> backward result position of its gradient
    deferred: list[tuple[int, str]]  # backward result positions reduced by ``reduce_grads`` (and their fqns)
    received: list[str]  # boundary values from the previous stage (the forward's inputs after the buffers)
    user_inputs: list[int] | None  # flat user inputs this stage reads (None: every one, no pipeline)
    sent: list[str]  # boundary values for the next stage, as the forward's outputs
    out_meta: list[tuple[list[int], torch.dtype] | None]  # local shape and dtype of each output
    written_buffers: list[str] = field(default_factory=list)  # buffers the forward writes in place (BatchNorm's)


@dataclass
class RankSpec:
    """One rank's step around its stages."""

    rank: int
    world: int
    microbatches: int
    n_stages: int
    reduce_each_microbatch: bool  # ZeRO-2: a reduce event follows every backward
    local_next: list[int]  # stages whose next stage is on this rank (values are handed over, not sent)
    recv_meta: dict[int, list[Boundary]]  # stage -> the boundary values it receives on this rank
    loss_divisor: int  # ranks whose losses the world all-reduce sums (world / pp)
    batch_weight: float  # this rank's batch-mean loss weight against 1 / dp (uneven batches)
    stages: dict[int, StageSpec] = field(default_factory=dict)
    batch_ranks: int = 1  # ranks the batch is split over (dp x ep): the loss is averaged over them


def stage_spec(compiled: Compiled, rank: int, stage: int) -> StageSpec:
    """``rank``'s calling convention for ``stage`` (from its lowered program)."""
    prog, rp = compiled.stages[stage], compiled.rank_program(rank, stage)
    sig = prog.signature
    info = prog.notes.get("stage")
    outputs = rp.forward.graph.output_node().args[0][: sig.num_outputs]
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in outputs]
    return StageSpec(
        stage=stage,
        param_fqns=[fqn for fqn, _ in sig.params],
        buffer_fqns=[fqn for fqn, _ in sig.buffers],
        zero_fqns=list(dict.fromkeys(fqn for fqn, _ in sig.params if fqn in rp.zero)),
        zero_positions=[i for i, (fqn, _) in enumerate(sig.params) if fqn in rp.zero],
        num_outputs=sig.num_outputs,
        tangent_outputs=[idx for _, idx in sig.tangents],
        grad_fqn={idx - sig.num_outputs: fqn for fqn, idx in sig.grads},
        input_grad_pos={name: idx - sig.num_outputs for name, idx in sig.input_grads},
        deferred=[(pos, fqn) for pos, fqn in rp.deferred],
        received=list(info.received) if info is not None else [],
        user_inputs=list(info.user_inputs) if info is not None else None,
        sent=list(info.sent) if info is not None else [],
        out_meta=[(list(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in vals],
        written_buffers=[fqn for fqn, name in sig.buffers if name in written_buffers(prog.graph)],
    )


def rank_spec(compiled: Compiled, rank: int) -> RankSpec:
    """Everything but the graphs that ``rank``'s step executor needs."""
    mesh = compiled.mesh
    coord = mesh.coord(rank)
    stages = compiled.stage_of_rank(rank)
    weight = 1.0
    if mesh.axes.get(BATCH_AXIS, 1) > 1:
        weight = batch_weight(splitter(compiled.stages[-1]), coord[mesh.axis_index(BATCH_AXIS)], mesh)
    n = len(compiled.stages)
    return RankSpec(
        rank=rank, world=mesh.size, microbatches=compiled.microbatches, n_stages=n,
        reduce_each_microbatch=compiled.plan.zero >= 2,
        local_next=[s for s in range(n - 1) if compiled.schedule.stage_rank(s + 1) == compiled.schedule.stage_rank(s)],
        recv_meta={s: boundary_meta(p, coord) for s, p in enumerate(compiled.stages) if s > 0},
        loss_divisor=mesh.size // compiled.pp, batch_weight=weight,
        stages={s: stage_spec(compiled, rank, s) for s in stages},
        batch_ranks=math.prod(mesh.axes.get(a, 1) for a in BATCH_AXES),
    )


# -- as Python literals (what a saved rank file holds) ------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return value


def spec_data(spec: RankSpec) -> dict[str, Any]:
    """``spec`` as ints, floats, strings, lists and dicts (dtypes by name): ``spec_from_data`` reads it back."""
    data = asdict(spec)
    data["recv_meta"] = {s: [{**asdict(b), "dtype": _dtype_name(b.dtype)} for b in bs]
                         for s, bs in spec.recv_meta.items()}
    for s, st in spec.stages.items():
        data["stages"][s]["out_meta"] = [None if m is None else [m[0], _dtype_name(m[1])] for m in st.out_meta]
        data["stages"][s]["deferred"] = [list(d) for d in st.deferred]
    return data


def spec_from_data(data: dict[str, Any]) -> RankSpec:
    """The ``RankSpec`` that ``spec_data`` wrote."""
    stages = {}
    for s, st in data["stages"].items():
        stages[int(s)] = StageSpec(**{
            **st,
            "grad_fqn": {int(k): v for k, v in st["grad_fqn"].items()},
            "deferred": [(int(p), f) for p, f in st["deferred"]],
            "out_meta": [None if m is None else (list(m[0]), _dtype(m[1])) for m in st["out_meta"]],
        })
    recv = {int(s): [Boundary(**{**b, "dtype": _dtype(b["dtype"])}) for b in bs] for s, bs in data["recv_meta"].items()}
    return RankSpec(**{**data, "recv_meta": recv, "stages": stages})


def events_data(events: list[StepEvent]) -> list[dict[str, Any]]:
    """The events as literals; a communication keeps what running it needs (its ledger row is left out)."""
    out = []
    for e in events:
        comms = [{"op": c.op, "ranks": list(c.ranks), "shape": list(c.shape), "dtype": _dtype_name(c.dtype),
                  "tag": c.tag} for c in e.comms]
        out.append({"kind": e.kind, "stage": e.stage, "mb": e.mb, "graph": e.graph, "comms": comms,
                    "label": e.label, "fqn": e.fqn})
    return out


def events_from_data(data: list[dict[str, Any]]) -> list[StepEvent]:
    """The events ``events_data`` wrote (without ledger rows: what runs, not what is reported)."""
    events = []
    for e in data:
        comms = tuple(Comm(c["op"], tuple(c["ranks"]), tuple(c["shape"]), _dtype(c["dtype"]), None, c["tag"])
                      for c in e["comms"])
        events.append(StepEvent(e["kind"], e["stage"], e["mb"], e["graph"], comms, e["label"], e["fqn"]))
    return events
