"""Compile a model for a mesh: one global Program per pipeline stage, plus the pipeline schedule.

Without a ``pp`` axis (and with ``stages`` unset) there is one stage: the whole model, captured
as one joint graph. With stages, the exported forward graph is split first (``fxpar.stages``)
and each stage is captured and run through the pass pipeline on its own. Every program is
compiled for one microbatch: dim 0 of the example inputs divided by ``microbatches``.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar.backward_split import split_backward
from fxpar.blocks import BLOCK_OPS
from fxpar.boundary_args import boundary_arg, carrying_gradients
from fxpar.capture import capture, capture_joint, export_fake
from fxpar.capture_memo import reused
from fxpar.capture_twins import CaptureTwins, moved_capture
from fxpar.errors import PlanError
from fxpar.gc_pause import without_gc_pauses
from fxpar.ir import Program
from fxpar.lower import RankProgram, lower
from fxpar.lower.recompute_budget import resolve_recompute_budget
from fxpar.mesh import Mesh
from fxpar.modules import module_table
from fxpar.pipeline import Context, run_pipeline
from fxpar.plan import Plan, as_plan
from fxpar.random_draws import warn_if_not_the_single_devices
from fxpar.roles import Roles
from fxpar.schedules import Schedule, make_schedule
from fxpar.sharing import Sharing, with_shared_blocks
from fxpar.split import CONTEXT_AXIS, batch_ranks
from fxpar.stage_state import warn_if_state_held_by_no_stage
from fxpar.stage_twins import Shift, find_twins
from fxpar.stages import Split, data_nodes, node_cost, split_stages

# "0": under a schedule without W actions, a backward whose input gradient goes to another rank runs whole (the
# gradient is sent after the weight gradients), as before; read when the model is compiled
HALVES_ENV = "FXPAR_BACKWARD_HALVES"


@dataclass(frozen=True)
class StageInfo:
    """Where a stage program sits in the pipeline (``Program.notes["stage"]``)."""

    index: int
    n_stages: int
    received: tuple[str, ...]  # boundary values from the previous stage (the first program inputs)
    user_inputs: tuple[int, ...]  # flat user inputs this stage reads (the program inputs after those)
    sent: tuple[str, ...]  # boundary values for the next stage (the forward outputs of a non-last stage)
    first_module: str
    cost: float


@dataclass
class Compiled:
    """Everything every rank lowers: the stage programs, the schedule and the resolved plan."""

    mesh: Mesh
    plan: Plan
    stages: list[Program]
    schedule: Schedule
    microbatches: int
    num_user_inputs: int
    input_kind: str  # "tuple" | "dict" (HF style ``model(**batch)``)
    out_spec: Any  # pytree spec of the model's outputs (the last stage's flat outputs rebuild it)
    input_keys: tuple[str, ...] = ()  # with keyword inputs: the tensor ones, in the order the program takes them
    timings: dict[str, float] = field(default_factory=dict)
    constants: dict[Any, Any] = field(default_factory=dict)  # non-tensor inputs (by name or position), baked in
    training: bool = True  # the mode the model's root module was in when captured (``fxpar.modes``)
    sent_backward_halves: bool = field(default_factory=lambda: os.environ.get(HALVES_ENV, "1") != "0")
    _lowered: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)  # backward halves, lazily
    _roles: Roles | None = field(default=None, repr=False, compare=False)  # rank programs by role, lowered lazily

    @property
    def pp(self) -> int:
        return self.mesh.axes.get("pp", 1)

    def stage_of_rank(self, rank: int) -> list[int]:
        """The stages ``rank`` holds (its pp coordinate's stages in the schedule)."""
        return self.schedule.stages_of(self.pp_coord(rank))

    def pp_coord(self, rank: int) -> int:
        return self.mesh.coord(rank)[self.mesh.axis_index("pp")] if "pp" in self.mesh.axes else 0

    def rank_program(self, rank: int, stage: int | None = None) -> RankProgram:
        """The lowered program of ``rank`` for ``stage`` (default: its first stage), built once and cached."""
        stage = self.stage_of_rank(rank)[0] if stage is None else stage
        if stage not in self.stage_of_rank(rank):
            raise ValueError(f"rank {rank} holds stages {self.stage_of_rank(rank)}, not stage {stage}")
        return self.roles.program(rank, stage)

    @property
    def roles(self) -> Roles:
        """The lowered programs, one per role (``fxpar.roles``); a rank's program is its role's, bound to its groups."""
        if self._roles is None:
            self._roles = Roles(self.mesh, lambda rank, stage: lower(self.stages[stage], rank), self.twin_of)
        return self._roles

    def twin_of(self, rank: int, stage: int) -> tuple[int, int, Shift] | None:
        """(an earlier stage whose lowering ``stage`` copies, the rank that holds it where ``rank`` holds ``stage``,
        the path shift between them), or None: ``fxpar.stage_twins``."""
        if "twins" not in self._lowered:
            self._lowered["twins"] = find_twins(self.stages)
        found = self._lowered["twins"].get(stage)
        if found is None:
            return None
        twin, shift = found
        pp = next(p for p in range(self.pp) if twin in self.schedule.stages_of(p))
        coord = list(self.mesh.coord(rank))
        coord[self.mesh.axis_index("pp")] = pp
        return twin, self.mesh.rank_of(tuple(coord)), shift

    def stage_graph(self, rank: int, stage: int, name: str) -> fx.GraphModule:
        """One graph of a rank's stage, by the name a step event runs it under (``fxpar.rank_step``):
        ``forward``, ``backward``, its halves ``backward_b``/``backward_w`` (zero-bubble schedules),
        ``reduce_grads`` or ``gather_params``."""
        rp = self.rank_program(rank, stage)
        if name in ("backward_b", "backward_w"):
            key = (rank, stage, "split")
            if key not in self._lowered:
                sig = self.stages[stage].signature
                self._lowered[key] = split_backward(rp.backward, {idx - sig.num_outputs for _, idx in sig.input_grads})
            return self._lowered[key][0 if name == "backward_b" else 1]
        graph = getattr(rp, name)
        if graph is None:
            raise ValueError(f"rank {rank} stage {stage} has no {name} graph")
        return graph


@without_gc_pauses
def compile_model(model: torch.nn.Module, mesh: Mesh, example_inputs: Any, plan: Any = None,
                  loss_fn: Any = None) -> Compiled:
    """Capture and compile ``model`` for ``mesh`` (no process group needed).

    Requires: ``example_inputs`` with global shapes (a tuple of positional inputs, or a dict of
    keyword inputs); with a ``pp`` axis, a ``loss_fn``. Ensures: one Program per stage, each with
    ``notes["stage"]`` set when there are several; timings of capture and each pass.
    """
    plan = as_plan(plan, mesh.axes)
    user_model = model
    kind, keys, flat = _flatten_inputs(example_inputs)
    n_user = len(flat)
    constants = {k: v for k, v in zip(keys or range(n_user), flat, strict=True) if not _is_tensor(v)}
    _refuse_nested_tensors(constants)
    if kind == "dict" or constants:  # traced through a stand-in taking the tensors; flags and None are constants
        model = input_adapter(model, kind, keys, constants, n_user)
        keys = tuple(k for k in keys if k not in constants)
        flat = [v for v in flat if _is_tensor(v)]
    pp = mesh.axes.get("pp", 1)
    if pp > 1 and loss_fn is None:
        raise PlanError("a mesh with a 'pp' axis needs loss_fn=...: the last pipeline stage computes the loss "
                        "(loss_fn(outputs, targets) -> a batch-mean scalar)")
    n_stages = _n_stages(plan, pp)
    m = plan.microbatches or (pp if pp > 1 else 1)
    mb_inputs = _microbatch_inputs(flat, mesh, m)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    ctx = Context(modules=module_table(model, plan.tp), plan=plan, timings=timings)
    if n_stages == 1:
        what = ("whole", kind, keys, repr(constants))
        programs = [reused(user_model, what, mesh, mb_inputs, plan.param_dtype,
                           lambda: capture(model, mesh, tuple(mb_inputs), plan.param_dtype)).replace(mesh=mesh)]
        timings["capture"] = time.perf_counter() - start
        programs = [run_pipeline(_with_sequence(programs[0], mb_inputs), ctx)]
        notes: dict[str, Any] = {}
        out_spec = programs[0].signature.out_spec
    else:
        what = ("stages", kind, keys, repr(constants), repr(plan.stages or n_stages))
        programs, notes, out_spec = _compile_stages(model, mesh, mb_inputs, plan.stages or n_stages, ctx,
                                                    lambda build: reused(user_model, what, mesh, mb_inputs,
                                                                         plan.param_dtype, build))
        if len(programs) % pp:
            raise PlanError(f"{len(programs)} stages is not a multiple of pp={pp}: each pp rank holds the same number "
                            "of stages (stages = v * pp)")
        warn_if_state_held_by_no_stage(user_model, programs)
    warn_if_not_the_single_devices([p.graph for p in programs], len(programs), plan.compile)
    schedule = _schedule(plan.schedule, pp, len(programs), m)
    resolved = plan.resolved(stages=len(programs) if isinstance(plan.stages, int) or plan.stages is None
                             else plan.stages, microbatches=m, notes={**plan.notes, **notes})
    start = time.perf_counter()
    programs = [resolve_recompute_budget(p) for p in programs]  # a byte budget is measured on a lowered program
    if plan.recompute is not None and not isinstance(plan.recompute, str):
        timings["recompute_budget"] = time.perf_counter() - start
    return Compiled(mesh, resolved, programs, schedule, m, n_user, kind, out_spec, keys, timings, constants,
                    training=user_model.training)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _refuse_nested_tensors(constants: dict[Any, Any]) -> None:
    """A non-tensor input is baked into the program as a constant: one that holds tensors (a dict or list of them)
    would be compiled unsharded, with its values frozen, so it is refused instead."""
    for key, value in constants.items():
        if any(_is_tensor(leaf) for leaf in pytree.tree_leaves(value)):
            what = f"keyword input {key!r}" if isinstance(key, str) else f"positional input {key}"
            raise TypeError(f"{what} is a {type(value).__name__} holding tensors: fxpar takes tensors as top-level "
                            "inputs (positional, or keywords of a dict batch); non-tensor inputs are constants of "
                            "the compiled program. Pass each tensor as its own input")


def input_adapter(model: torch.nn.Module, kind: str, keys: tuple[str, ...], constants: dict[Any, Any],
                  n_user: int) -> torch.nn.Module:
    """A shallow copy of ``model`` (the same submodules, parameters and names) whose ``forward`` takes only the
    tensor inputs, positionally, and calls the model with ``constants`` (non-tensor inputs, by keyword name or
    position) put back in their places."""
    adapter = copy.copy(model)
    forward = model.forward

    def tensors_only(*tensors: torch.Tensor) -> Any:
        given = iter(tensors)
        if kind == "dict":
            return forward(**{k: constants[k] if k in constants else next(given) for k in keys})
        return forward(*[constants[i] if i in constants else next(given) for i in range(n_user)])

    adapter.forward = tensors_only
    return adapter


def _n_stages(plan: Plan, pp: int) -> int:
    if plan.stages is None:
        return pp
    n = plan.stages if isinstance(plan.stages, int) else len(plan.stages) + 1
    if isinstance(plan.stages, int) and plan.stages < 1:
        raise PlanError(f"stages must be a positive int or a list of module paths, got {plan.stages!r}")
    if n % pp:
        raise PlanError(f"stages={plan.stages!r} gives {n} stages, not a multiple of pp={pp}: each pp rank must hold "
                        f"the same number of stages (stages = v * pp, e.g. {pp} or {2 * pp})")
    if n > 1 and pp == 1 and plan.stages is not None:
        raise PlanError(f"stages={plan.stages!r} needs a 'pp' mesh axis to place the stages on")
    return n


def _schedule(name: str, pp: int, n_stages: int, m: int) -> Schedule:
    """``make_schedule``; a schedule that cannot run this layout is the plan's error (``PlanError``)."""
    try:
        return make_schedule(name, pp, n_stages, m)
    except ValueError as e:
        raise PlanError(str(e)) from None


def _flatten_inputs(example_inputs: Any) -> tuple[str, tuple[str, ...], list[Any]]:
    if isinstance(example_inputs, dict):
        return "dict", tuple(example_inputs), list(example_inputs.values())
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    return "tuple", (), list(example_inputs)


def _microbatch_inputs(flat: list[Any], mesh: Mesh, m: int) -> list[Any]:
    """The example inputs of one microbatch: dim 0 of every batched tensor divided by ``m``."""
    dp = batch_ranks(mesh)
    batch = next((x.shape[0] for x in flat if isinstance(x, torch.Tensor) and x.ndim), None)
    if m == 1 or batch is None:
        return flat
    if batch % dp or (batch // dp) % m:
        over = "dp" if "ep" not in mesh.axes else "dp x ep"
        raise PlanError(f"microbatches={m} does not divide the local batch: the global batch {batch} over {over}={dp} "
                        f"is {batch / dp:g} per rank; choose microbatches that divide it (a batch dp does not "
                        "divide works with microbatches=1 only: every microbatch runs one compiled program, so "
                        "all of a rank's microbatches must have one size)")
    return [x[: batch // m] if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch else x for x in flat]


def _compile_stages(model: torch.nn.Module, mesh: Mesh, flat: list[Any], stages: Any, ctx: Context,
                    memo: Callable[[Callable[[], Any]], Any]) -> tuple[list[Program], dict[str, Any], Any]:
    """Capture the stages (through ``memo``: ``fxpar.capture_memo``), then run the passes on each."""
    captured, split, out_spec = memo(lambda: with_shared_blocks(
        lambda share: _capture_stages(model, mesh, flat, stages, ctx, share)))
    captured = [_with_batch(_with_sequence(prog.replace(mesh=mesh), flat), flat) for prog in captured]
    programs = [run_pipeline(prog, ctx) for prog in captured]
    total = sum(split.costs) or 1.0
    notes = {"stage starts": ", ".join(split.starts),
             "stage costs": ", ".join(f"{c / total:.0%}" for c in split.costs)}
    return programs, notes, out_spec


def _capture_stages(model: torch.nn.Module, mesh: Mesh, flat: list[Any], stages: Any, ctx: Context,
                    share: Sharing) -> tuple[list[Program], Split, Any]:
    """Export once, split into stages, capture each stage's joint (repeated blocks traced once when ``share``)."""
    start = time.perf_counter()
    keep = () if isinstance(stages, int) else tuple(stages)  # a stage starting inside a block keeps it whole
    exported = export_fake(model, mesh, tuple(flat), share=share, keep=keep, param_dtype=ctx.plan.param_dtype)
    split = split_stages(exported.gm, model, stages, cost=_cost_model(exported), op_of=_op_of(exported))
    ctx.timings["split_stages"] = time.perf_counter() - start
    programs: list[Program] = []
    twins = CaptureTwins(exported, model, len(split.stages))
    carry = carrying_gradients(exported.gm, model)
    for sg in split.stages:
        args = [boundary_arg(sg.gm, name, exported.fake_mode, name in carry) for name in sg.received]
        args += [exported.fake_args[i] for i in sg.user_inputs]
        t0 = time.perf_counter()
        info = StageInfo(sg.index, len(split.stages), tuple(sg.received), tuple(sg.user_inputs), tuple(sg.sent),
                         sg.first_module, sg.cost)
        notes = {"stage": info}
        twin = twins.find(sg, tuple(args))
        if twin is None:
            prog = capture_joint(sg.gm, exported, model, mesh, tuple(args))
            prog = prog.replace(notes={**prog.notes, **notes})
            twins.add(sg, tuple(args))
        else:
            prog = moved_capture(programs[twin[0]], twin[1], {**programs[twin[0]].notes, **notes})
        ctx.timings["capture"] = ctx.timings.get("capture", 0.0) + time.perf_counter() - t0
        programs.append(prog)
    captures = dataclasses.replace(exported.captures, stages_copied=len(twins.found))
    programs = [p.replace(notes={**p.notes, "captures": captures}) for p in programs]
    return programs, split, exported.out_spec


def _op_of(exported: Any) -> Callable[[fx.Node], Any]:
    """The op that computes a node's value: a repeated block's output is computed by an op inside the block."""
    blocks = exported.blocks

    def op_of(n: fx.Node) -> Any:
        if blocks is not None and n.target is operator.getitem and getattr(n.args[0], "target", None) is BLOCK_OPS[0]:
            return blocks.output_op(n.args[0].args[0], n.args[1])
        return n.target

    return op_of


def _cost_model(exported: Any) -> Callable[[fx.Node], float]:
    """``node_cost``, with a repeated block's call costing what its nodes would in a whole-model export."""
    blocks = exported.blocks
    if blocks is None:
        return node_cost
    data = data_nodes(exported.gm.graph)

    def cost(n: fx.Node) -> float:
        if n.target is operator.getitem and getattr(n.args[0], "target", None) is BLOCK_OPS[0]:
            return 0.0  # a block output: its node is counted in the call (a whole-model export has no getitem)
        if n.target is not BLOCK_OPS[0]:
            return node_cost(n)
        site = blocks.table.sites[n.args[0]]
        return blocks.cost(site.id, tuple(a in data for a in n.args[1][:site.n_args]), node_cost)

    return cost


def _with_sequence(prog: Program, user_inputs: list[Any]) -> Program:
    """Record the sequence length a cp axis, or sequence parallelism at a stage boundary, splits (dim 1 of the
    first user input of two or more dims) in ``notes["sequence"]``: every pipeline stage splits the same
    sequence, whatever it receives."""
    if prog.mesh.axes.get(CONTEXT_AXIS, 1) == 1 and prog.mesh.axes.get("tp", 1) == 1:
        return prog
    seq = next((x.shape[1] for x in user_inputs if isinstance(x, torch.Tensor) and x.ndim >= 2), None)
    return prog.replace(notes={**prog.notes, "sequence": seq})


def _with_batch(prog: Program, user_inputs: list[Any]) -> Program:
    """Record the global batch (dim 0 of the first user input) in ``notes["batch"]``: a later pipeline stage reads
    no user input, and a batch dp does not divide (5 on dp=2) is split as ``fxpar.split`` says only if the stage
    knows it is the batch (``passes.annotate`` places received values by it)."""
    batch = next((x.shape[0] for x in user_inputs if isinstance(x, torch.Tensor) and x.ndim >= 1), None)
    return prog.replace(notes={**prog.notes, "batch": batch})


def flat_user_inputs(compiled: Compiled, args: tuple[Any, ...], targets: bool = True) -> tuple[list[Any], Any]:
    """Split ``pm.step``/``pm(...)`` arguments into (flat inputs, targets) per ``compiled.input_kind``; ``targets``:
    whether one argument after the inputs may be the targets (``pm.step``), else none may follow (``pm(...)``)."""
    call = "pm.step(inputs..., targets)" if targets else "pm(inputs...)"
    inputs, rest = _user_inputs(compiled, args, targets, call)
    refuse_inputs_needing_grad(inputs)
    return inputs, rest


def _user_inputs(compiled: Compiled, args: tuple[Any, ...], targets: bool, call: str) -> tuple[list[Any], Any]:
    if compiled.input_kind == "dict":
        if not args or not isinstance(args[0], dict):
            raise TypeError("this model was compiled with keyword inputs: call pm(**batch) or pm.step(batch, targets)")
        _refuse_extra(args, 1, targets, call)
        batch = args[0]
        expected = set(compiled.input_keys) | set(compiled.constants)
        if set(batch) != expected:
            raise TypeError(f"keyword inputs {sorted(batch)} differ from the compiled ones {sorted(expected)}")
        _check_constants(compiled, batch)
        return [batch[k] for k in compiled.input_keys], (args[1] if len(args) > 1 else None)
    n = compiled.num_user_inputs
    if len(args) < n:
        raise TypeError(f"expected {n} model inputs (as in example_inputs), got {len(args)}")
    _refuse_extra(args, n, targets, call)
    _check_constants(compiled, dict(enumerate(args[:n])))
    tensors = [a for i, a in enumerate(args[:n]) if i not in compiled.constants]
    return tensors, (args[n] if len(args) > n else None)


def refuse_inputs_needing_grad(flat: list[Any]) -> None:
    """An input that requires grad (a soft prompt, an adapter's output before the model) would get no gradient:
    the rank programs differentiate parameters only. Refuse it rather than train it silently not at all."""
    if not torch.is_grad_enabled():
        return
    for i, x in enumerate(pytree.tree_leaves(flat)):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"model input {i} requires grad, but fxpar computes gradients of the model's parameters "
                             "only: it would get none. Make the trainable tensor a parameter of the model (a soft "
                             "prompt as an nn.Parameter of a wrapper module), or pass x.detach()")


def _refuse_extra(args: tuple[Any, ...], inputs: int, targets: bool, call: str) -> None:
    """An argument the program would not read is a mistake (a stray target, a wrong call): refuse it by name."""
    most = inputs + targets
    if len(args) > most:
        raise TypeError(f"{call} got {len(args)} arguments where the program takes at most {most} (the model was "
                        f"compiled with {inputs} input(s) as in example_inputs{', then the targets' if targets else ''}"
                        "); the extra ones would be ignored")


def _check_constants(compiled: Compiled, given: dict[Any, Any]) -> None:
    """A non-tensor input is part of the compiled program: refuse a different value instead of ignoring it."""
    for key, value in compiled.constants.items():
        got = given.get(key)
        same = got is value or (not _is_tensor(got) and type(got) is type(value) and got == value)
        if not same:
            what = f"keyword input {key!r}" if isinstance(key, str) else f"positional input {key}"
            raise ValueError(f"{what} is {got!r} here but was {value!r} when the program was compiled: non-tensor "
                             "inputs are constants of the compiled program; call fxpar.parallelize again with this "
                             "value")


def split_microbatches(values: Any, m: int) -> list[Any]:
    """``values`` (a pytree) cut into ``m`` pieces along dim 0 of every batched tensor."""
    if m == 1:
        return [values]
    leaves, spec = pytree.tree_flatten(values)
    pieces = [x.chunk(m) if isinstance(x, torch.Tensor) and x.ndim else [x] * m for x in leaves]
    for x, p in zip(leaves, pieces, strict=True):
        if isinstance(x, torch.Tensor) and x.ndim and x.shape[0] % m:
            raise ValueError(f"microbatches={m} does not divide the local batch dim {x.shape[0]}")
        assert len(p) == m
    return [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(m)]
