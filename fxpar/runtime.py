"""ParallelModule: runs one rank's lowered forward and backward graphs.

Parameters are DTensors (so optimizers, ``state_dict`` and DCP work unchanged); compute runs
on their local shards through the generated graphs, with explicit collectives inside them.
No DTensor dispatch happens in the step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar.backends.emit import SaveSources, save_programs
from fxpar.clip import clip_grad_norm_, counted_on_another_stage
from fxpar.cluster import Cluster
from fxpar.compiled import Compiled, flat_user_inputs, split_microbatches
from fxpar.estimate import Estimate
from fxpar.estimate import estimate as estimate_step
from fxpar.executor import LossFn, StageRunner, StepExecutor
from fxpar.full_state import FullStateLoading
from fxpar.grad_sums import cut_from_larger
from fxpar.input_shapes import InputCheck
from fxpar.ir import Program
from fxpar.lower import LedgerRow, RankProgram
from fxpar.memory import Memory
from fxpar.memory import predict as predict_memory
from fxpar.mesh import Mesh
from fxpar.modes import ModeRun, ModeSource, ModeSwitching
from fxpar.params import RankParameters, materialize
from fxpar.plan import Plan
from fxpar.printer import ledger_table, print_rank_programs
from fxpar.rank_spec import rank_spec
from fxpar.rank_step import StepEvent, rank_step, step_ledger
from fxpar.schedules import Schedule
from fxpar.stages import stage_costs
from fxpar.state_paths import non_persistent_buffers
from fxpar.stitch import Captures
from fxpar.unreached import decide_unreached, watch_unreached


class _RankStep(torch.autograd.Function):
    """Forward graph in ``forward``; backward graph, fed the saved values, in ``backward``."""

    @staticmethod
    def forward(ctx: Any, runner: StageRunner, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if runner.gather is not None:  # ZeRO: the parameters come in as dp shards (a tied one maybe twice)
            flat = list(flat)
            first = {runner.param_fqns[p]: p for p in reversed(runner.zero_positions)}
            shards = [flat[first[fqn]] for fqn in runner.zero_fqns]
            full = dict(zip(runner.zero_fqns, runner.gather(*shards), strict=True))
            for pos in runner.zero_positions:
                flat[pos] = full[runner.param_fqns[pos]]
        results = runner.forward(*flat)
        ctx.set_materialize_grads(False)  # an output the loss does not read comes back None (``fxpar.unreached``)
        n = runner.num_outputs
        ctx.runner, ctx.saved = runner, results[n:]
        ctx.n_inputs = len(flat)
        ctx.out_like = [o.detach() if isinstance(o, torch.Tensor) else o for o in results[:n]]
        return tuple(results[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        runner = ctx.runner
        tangents = [grads[idx] if grads[idx] is not None else torch.zeros_like(ctx.out_like[idx])
                    for idx in runner.tangent_outputs]
        dead = frozenset(idx for idx in runner.tangent_outputs if grads[idx] is None)
        unreached = runner.unreached(dead) if dead and runner.unreached is not None else frozenset()
        param_grads = list(runner.backward(*ctx.saved, *tangents))
        ctx.saved = None
        if runner.reduce is not None:  # the dp reduction, once per backward on this path
            positions = [pos for pos, _ in runner.spec.deferred]
            for pos, g in zip(positions, runner.reduce(*[param_grads[p] for p in positions]), strict=True):
                param_grads[pos] = g
        out: list[torch.Tensor | None] = [None] * ctx.n_inputs
        order = {fqn: i for i, fqn in enumerate(runner.param_fqns)}
        cut = cut_from_larger([param_grads[pos] for pos in runner.grad_fqn])  # keep a shard, not its whole
        for pos, fqn in runner.grad_fqn.items():
            g = param_grads[pos]
            if fqn not in unreached:  # a parameter the loss does not reach keeps its .grad (``fxpar.unreached``)
                out[order[fqn]] = g.clone() if id(g) in cut else g
        return (None, *out)


def structured_loss(loss_fn: Callable[..., torch.Tensor], out_spec: Any) -> LossFn:
    """``loss_fn(outputs, targets)`` (or ``loss_fn(outputs)`` without targets) on the output leaves the last stage
    returns, rebuilt into the model's output structure."""
    def flat_loss(leaves: list[Any], targets: Any) -> torch.Tensor:
        outputs = pytree.tree_unflatten(leaves, out_spec)
        return loss_fn(outputs, targets) if targets is not None else loss_fn(outputs)

    return flat_loss


class ParallelModule(ModeSwitching, FullStateLoading, RankParameters):
    """The model compiled for one rank of a mesh.

    ``pm.step(inputs..., targets)`` runs forward and backward of every microbatch per the pipeline
    schedule and leaves gradients in ``p.grad``; without pipeline stages (and with one microbatch)
    ``pm(inputs...)`` plus ``loss.backward()`` works too. Call either with this rank's dp shard.
    """

    def __init__(self, compiled: Compiled, model: torch.nn.Module | None, rank: int | None,
                 loss_fn: Callable[..., torch.Tensor] | None = None, *, example_inputs: Any = None) -> None:
        super().__init__()
        self._compiled = compiled
        self._loss_fn = loss_fn
        self._executor: StepExecutor | None = None
        self._rank = rank
        self._inputs = InputCheck(compiled, rank)  # the shapes this rank's program takes its inputs in
        self._tie_groups: list[tuple[str, Any]] = []
        self._pp_group: Any = None
        self.timings: dict[str, float] = dict(compiled.timings)
        self._save_sources = SaveSources({}, {}, loss_fn)
        if model is not None:  # what pm.save writes beside the programs (references, no copies)
            self._save_sources = SaveSources(dict(model.named_buffers(remove_duplicate=False)),
                                             {fqn: p.requires_grad for fqn, p in model.named_parameters()}, loss_fn,
                                             non_persistent_buffers(model))
        if rank is not None and model is not None:
            self._materialize(model)
            self._save_sources.buffers.update(self.named_buffers())  # written buffers: this module's copies
        # pm.train() / pm.eval(): the program of each mode (fxpar.modes); the model's own mode is the compiled one
        self.training = compiled.training
        self._source = ModeSource(model, example_inputs, loss_fn) \
            if model is not None and example_inputs is not None else None
        self._modes: dict[bool, ModeRun] = {}
        self.proof: Any = None

    # -- inspection --------------------------------------------------------------------------
    @property
    def mesh(self) -> Mesh:
        return self._compiled.mesh

    @property
    def plan(self) -> Plan:
        """The resolved plan: stage split points and costs, microbatches, schedule."""
        return self._compiled.plan

    @property
    def schedule(self) -> Schedule:
        """The pipeline schedule: ``print(pm.schedule)`` draws steps x pipeline ranks."""
        return self._compiled.schedule

    @property
    def captures(self) -> Captures:
        """How the model was captured: ``blocks`` calls of repeated blocks traced as ``distinct`` captures, or the
        whole model traced (``whole``, with the ``reason`` when sharing was tried); ``stages_copied``: pipeline
        stages captured as an earlier identical stage with paths moved; ``chained``: block calls exported as runs."""
        return self._compiled.stages[0].notes.get("captures", Captures())

    @property
    def _prog(self) -> Program:  # the single stage's program (tools written before pipelines use it)
        return self._compiled.stages[0]

    def stages_of(self, rank: int) -> list[int]:
        return self._compiled.stage_of_rank(rank)

    def rank_program(self, rank: int, stage: int | None = None) -> RankProgram:
        """The lowered program of ``rank`` for ``stage`` (default: its first stage), built once and cached."""
        return self._compiled.rank_program(rank, stage)

    def step_events(self, rank: int | None = None) -> list[StepEvent]:
        """What ``rank`` (default: this one) does in one ``pm.step``, in order (``fxpar.rank_step``). On this
        rank it is the very list the step executor runs."""
        if rank is None or rank == self._rank:
            if self._runners:
                return self.step_executor().events
            rank = 0 if rank is None else rank
        return rank_step(self._compiled, rank)

    def program(self, rank: int = 0, verbosity: int = 1) -> str:
        """The rank's programs as readable, runnable Python: per stage it holds, forward, backward and reduce_grads.

        ``verbosity``: 1 (default) every node; 2 adds each node's source line; 0 folds runs of identical layers
        (``# model.layers.1-7: as model.layers.0 above, ...``)."""
        return print_rank_programs(self._compiled, rank, verbosity)

    def ledger(self, rank: int = 0) -> list[LedgerRow]:
        """Every collective and point-to-point transfer the rank issues in one ``pm.step`` (see ``ledger_table``).

        With one stage and one microbatch this is exactly the program's collectives (``pm(x)`` then backward).
        """
        return step_ledger(self.step_events(rank))

    def stage_costs(self) -> dict[tuple[str, int], float]:
        """Cost-model seconds per (action kind, stage) for ``pm.schedule.simulate(costs=...)`` (``stage_costs``)."""
        return stage_costs(self._compiled.stages, self._compiled.schedule.has_w)

    def memory(self, rank: int = 0) -> Memory:
        """Predicted bytes per rank for one step: ``.params .grads .optimizer .activations .transient .peak``."""
        return predict_memory(self._compiled, rank)

    def estimate(self, cluster: Cluster) -> Estimate:
        """Predicted step on ``cluster`` (``fxpar.estimate``): ``.step_time .mfu .tokens_per_s .peak_memory``;
        ``print`` shows the breakdown (compute, exposed communication per axis, bubble, recompute, memory)."""
        return estimate_step(self._compiled, cluster)

    def ledger_table(self, rank: int = 0) -> str:
        return ledger_table(self.ledger(rank))

    def output_placements(self) -> list[Any]:
        """Placements (one per mesh axis) of each forward output, as this rank returns them."""
        prog = self._compiled.stages[-1]
        out = prog.graph.output_node()
        return list(prog.arg_placements[out.name][: prog.signature.num_outputs])

    def executed_graphs(self) -> dict[str, fx.GraphModule]:
        """The graphs this rank runs for its first stage, with process groups bound.

        Keys: ``forward``, ``backward`` and, where gradients are dp-reduced once per step,
        ``reduce_grads``. Editing them (then ``recompile()``) changes what runs: fault-injection
        tests use this.
        """
        if not self._runners:
            raise RuntimeError("this ParallelModule was compiled for a fake mesh (or no rank): it has no bound graphs")
        runner = self._runners[min(self._runners)]
        graphs = {"forward": runner.forward, "backward": runner.backward}
        if runner.reduce is not None:
            graphs["reduce_grads"] = runner.reduce
        return {name: getattr(g, "graph_module", g) for name, g in graphs.items()}  # under ``fxpar.direct_calls``

    def save(self, folder: str) -> list[str]:
        """Write every rank's training executable into ``folder``: ``rank<r>.py`` (its programs, step events and
        parameter layout), ``rank<r>.pt`` (buffers, constants) and ``manifest.json``; ``python -m fxpar.run
        folder --checkpoint ...`` trains with them, without the model's code. Returns the ``.py`` paths.

        Any rank (or a fake-mesh module built from a model with real buffers) may call it; saving the same
        compiled model twice writes the same bytes. Weights are not in the folder: ``fxpar.checkpoint.save``.
        """
        return save_programs(self._compiled, folder, self._save_sources)

    # -- execution ----------------------------------------------------------------------------
    def _materialize(self, model: torch.nn.Module) -> None:
        """This rank's parameters as DTensors (registered under their model paths), its buffers and bound graphs."""
        self._stage_buffers, self._runners, self._tie_groups, self._pp_group = materialize(
            self, self._compiled, model, self._rank)
        watch_unreached(self._compiled, self._runners)

    def _check_runnable(self) -> None:
        if not self._runners:
            raise RuntimeError("this ParallelModule was compiled for a fake mesh (or no rank): it cannot run")

    def forward(self, *inputs: Any, **kw_inputs: Any) -> Any:
        self._check_runnable()
        c = self._compiled
        if kw_inputs:  # pm(**batch) for a model compiled with keyword inputs
            inputs = (kw_inputs, *inputs)
        if len(c.stages) > 1 or c.microbatches > 1:
            raise RuntimeError(f"this program has {len(c.stages)} pipeline stages and {c.microbatches} microbatches: "
                               "run a training step with pm.step(inputs..., targets) instead of pm(inputs)")
        runner = self._runners[0]
        flat, _ = flat_user_inputs(c, inputs, targets=False)
        self._inputs.check(flat, "pm(...)")
        local = [self.local_param(fqn, differentiable=True) for fqn in runner.param_fqns]
        tensors = [x for x in pytree.tree_leaves(flat) if isinstance(x, torch.Tensor)]
        outs = _RankStep.apply(runner, *local, *self.stage_buffers(0), *tensors)
        return pytree.tree_unflatten(list(outs), c.out_spec)

    def step(self, *args: Any, trace: str | None = None) -> torch.Tensor:
        """One training step: forward and backward of every microbatch per the schedule; grads in ``p.grad``.

        Under ``torch.no_grad()`` (or ``inference_mode``) it evaluates instead: the forwards and the loss only, no
        backward and no gradient (a validation step; with ``pm.eval()`` the model runs as ``model.eval()``).

        Takes this rank's dp shard of the inputs (as in ``example_inputs``) then the targets, if any.
        Returns the mean loss over microbatches and dp ranks (the single-device loss), on every rank.
        ``trace="step.json"`` writes a Chrome trace (Perfetto) of every rank's actions (from rank 0).
        """
        c = self._compiled
        flat, targets = flat_user_inputs(c, args)
        executor = self.step_executor()
        self._inputs.check(flat, "pm.step")
        mb_inputs = split_microbatches(flat, c.microbatches)
        mb_targets = split_microbatches(targets, c.microbatches) if targets is not None else [None] * c.microbatches
        decide_unreached(executor, c, self._loss_fn, targets)
        try:
            return executor.run(mb_inputs, mb_targets, trace, forward_only=not torch.is_grad_enabled())
        finally:
            self.release_params()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: scale every gradient so that the norm of the
        model's gradient is at most ``max_norm``; return that norm (before clipping), equal on every rank. Call it on
        every rank, between ``pm.step`` and ``opt.step()``. With pipeline stages torch's own function would see only
        this rank's stages (``fxpar.clip``); without them the two agree."""
        self._check_runnable()
        elsewhere = [self.get_parameter(fqn) for fqn in counted_on_another_stage(self._compiled, self._rank)]
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, pp_group=self._pp_group,
                               counted_elsewhere=elsewhere, error_if_nonfinite=error_if_nonfinite, foreach=foreach)

    def step_executor(self) -> StepExecutor:
        """The rank's step executor, built on first use: ``.events`` is what ``pm.step`` runs (fault-injection
        tests wrap its ``dispatch``)."""
        self._check_runnable()
        if self._loss_fn is None:
            raise ValueError("pm.step needs a loss: pass loss_fn=... to fxpar.parallelize")
        if self._executor is None:
            c = self._compiled
            self._executor = StepExecutor(self, self._runners, rank_step(c, self._rank), rank_spec(c, self._rank),
                                          structured_loss(self._loss_fn, c.out_spec), dict(self._tie_groups))
        return self._executor
