"""``assert_equivalent``: a parallel program computes what the single-device model computes.

Each rank of a real gloo mesh (from a reusable ``RankPool``) builds the model twice from
``model_fn`` under the same seed: once as the single-device reference, run on the whole batch,
and once through ``fxpar.parallelize``, run on this rank's dp shard. For ``steps`` AdamW steps
it compares, on this rank's own shard of each tensor (so a wrong rank is named as such):

1. every forward output,
2. every parameter gradient,
3. every parameter after the optimizer step.

It also holds the ledger to what runs: every step is run under a ``CollectiveCounter``, and the
collectives and transfers the rank issued (kind and dtype, in order) must be exactly
``pm.ledger(rank)``'s (plus ``pm.step``'s loss all-reduce).

Tolerances depend on the dtype (``fxpar.testing.tolerance``). A mismatch raises
``EquivalenceError`` naming the tensor (output path or parameter FQN), the rank, the max
absolute and relative error, the first step where the program diverged, and how to replay.
"""

from __future__ import annotations

import functools
import inspect
import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

import fxpar
from fxpar.capture import without_kv_cache
from fxpar.mixed_precision import computing_in
from fxpar.split import batch_ranks
from fxpar.testing.collectives import LOSS_REPORT, CollectiveCounter, ledger_mismatch
from fxpar.testing.compile_once import compile_once
from fxpar.testing.held_buffers import lost_buffers, written_buffers
from fxpar.testing.pool import RankPool, RemoteError, default_pool
from fxpar.testing.shards import (
    batch_size,
    call_model,
    dp_shard,
    input_values,
    map_inputs,
    output_leaves,
    output_shard,
    param_coord,
    rank_batch_weight,
    shard_of,
)
from fxpar.testing.tolerance import ADAM_EPS, Tolerance, adam_sensitivity, as_float64, default_tolerance

ModelFn = Callable[[], torch.nn.Module]
LossFn = Callable[[Any], torch.Tensor]
RankHook = Callable[[fxpar.ParallelModule, int], None]
USER_ERRORS = (ValueError, TypeError, NotImplementedError, fxpar.CaptureError)


class EquivalenceError(AssertionError):
    """The parallel program and the single-device model disagree beyond tolerance."""

    def __init__(self, message: str, mismatches: list[Mismatch]) -> None:
        super().__init__(message)
        self.mismatches = mismatches


@dataclass(frozen=True)
class Mismatch:
    """One tensor on one rank at one step that is out of tolerance."""

    tensor: str
    rank: int
    step: int
    max_abs: float
    max_rel: float
    rtol: float
    atol: float

    def __str__(self) -> str:
        return (f"{self.tensor} on rank {self.rank} at step {self.step}: max abs err {self.max_abs:.3g}, "
                f"max rel err {self.max_rel:.3g} (rtol {self.rtol:.1g}, atol {self.atol:.2g})")


@dataclass
class RankReport:
    """What one rank found: losses per step, mismatches, the worst error seen, and optionally its program."""

    rank: int
    losses: list[tuple[float, float]] = field(default_factory=list)  # (fxpar, reference) per step
    mismatches: list[Mismatch] = field(default_factory=list)
    worst_abs: float = 0.0
    compared: int = 0
    program: str = ""
    ledger_errors: list[str] = field(default_factory=list)  # steps whose issued collectives differ from the ledger
    buffers_held: list[str] = field(default_factory=list)  # this rank's ``pm.named_buffers()``
    buffers_written: list[str] = field(default_factory=list)  # the single-device model's buffers its steps changed


@dataclass(frozen=True)
class Case:
    """Everything a rank needs to run one equivalence check (picklable)."""

    model_fn: ModelFn
    mesh_axes: dict[str, int]
    plan: Any
    inputs: tuple[Any, ...]
    steps: int
    rtol: float | None
    atol: float | None
    lr: float
    seed: int
    loss_fn: LossFn | None
    rank_hook: RankHook | None
    want_program: bool
    targets: Any = None


def assert_equivalent(model_fn: ModelFn, mesh_axes: dict[str, int], plan: Any, inputs: tuple[Any, ...] | Any,
                      steps: int = 3, rtol: float | None = None, atol: float | None = None, *, lr: float = 1e-3,
                      seed: int = 0, loss_fn: LossFn | None = None, pool: RankPool | None = None,
                      timeout: float = 300.0, rank_hook: RankHook | None = None,
                      want_program: bool = False, targets: Any = None) -> list[RankReport]:
    """Check ``fxpar.parallelize(model_fn(), Mesh(mesh_axes), inputs, plan)`` against the single-device model.

    Requires: ``model_fn`` a picklable zero-argument callable (module-level function,
    ``functools.partial``, or a spec object from ``fxpar.testing.strategies``) whose parameters depend
    only on ``torch.manual_seed``; ``inputs`` with global shapes (dim 0 is the batch, divisible by
    ``dp``). ``loss_fn(outputs) -> scalar`` must be a mean over the batch (default: mean of squares of
    every floating output), so that dp ranks' local losses average to the global one.
    ``rtol``/``atol`` override the step-0 tolerance (default by dtype, see ``fxpar.testing.tolerance``).
    ``rank_hook(pm, rank)`` runs in each rank before the first step (e.g. to inject a fault).
    With pipeline stages, several microbatches or ``targets`` (global shapes, sharded like the inputs),
    each step is ``pm.step(inputs, targets)`` and ``loss_fn(outputs, targets)`` (or ``loss_fn(outputs)``
    without targets) is compared with the single-device loss instead of the outputs.
    Ensures: returns one ``RankReport`` per rank when every output, gradient and updated parameter
    matches on every rank at every step; raises ``EquivalenceError`` naming the first diverging tensor,
    rank and step otherwise; a user error while compiling (``PlanError``, ``ValueError``, ...) is
    re-raised with its own type; a hung or dead rank raises ``RankFailure`` within ``timeout``.
    """
    inputs = inputs if isinstance(inputs, (tuple, dict)) else (inputs,)  # a dict: keyword inputs, model(**batch)
    case = Case(model_fn, dict(mesh_axes), plan, inputs, steps, rtol, atol, lr, seed, loss_fn, rank_hook, want_program,
                targets)
    _check_picklable(case)
    world = math.prod(mesh_axes.values())
    pool = pool or default_pool()
    try:
        reports = pool.run(check_rank, world, case, timeout=timeout)
    except RemoteError as e:
        if isinstance(e.original, USER_ERRORS):  # the same mistake on every rank: show it as the user's
            e.original.args = (f"{e.original}\n(raised on every rank of the mesh; {_replay(case)})",)
            raise e.original from e
        raise
    ledger_errors = [f"rank {r.rank}: {e}" for r in reports for e in r.ledger_errors]
    if ledger_errors:
        raise EquivalenceError(f"pm.ledger(rank) is not what the step issued ({_replay(case)}):\n  "
                               + "\n  ".join(ledger_errors), [])
    mismatches = sorted((m for r in reports for m in r.mismatches), key=lambda m: (m.step, m.rank))
    if mismatches:
        raise EquivalenceError(_explain(case, mismatches), mismatches)
    lost = lost_buffers((r.buffers_held for r in reports), (r.buffers_written for r in reports))
    if lost:  # never compared: a rank holding none of them had nothing to compare
        raise EquivalenceError(f"the single-device model's steps change buffers {lost} that no rank of the parallel "
                               f"program holds: their updates are lost ({_replay(case)})", [])
    return reports


def _check_picklable(case: Case) -> None:
    for what in ("model_fn", "loss_fn", "rank_hook", "plan"):
        try:
            pickle.dumps(getattr(case, what))
        except Exception as e:  # noqa: BLE001 - lambdas, closures, local classes
            raise TypeError(f"assert_equivalent: {what} must be picklable to reach the rank processes "
                            f"(a module-level function or functools.partial, not a lambda or closure): {e}") from e


def _explain(case: Case, mismatches: list[Mismatch]) -> str:
    first_step = min(m.step for m in mismatches)
    ordered = mismatches  # by step, then rank
    shown = "\n".join(f"  {m}" for m in ordered[:12])
    more = f"\n  ... and {len(ordered) - 12} more" if len(ordered) > 12 else ""
    ranks = sorted({m.rank for m in mismatches})
    return (f"parallel program differs from the single-device model on mesh {case.mesh_axes}: "
            f"{len(mismatches)} mismatches on ranks {ranks}, first at step {first_step}\n"
            f"first: {ordered[0]}\n{shown}{more}\n{_replay(case)}{_fp8_hint(case)}")


def _fp8_hint(case: Case) -> str:
    """Under ``Plan(fp8=...)`` the reference stays fp32 (it makes no float8 casts): say so beside a mismatch."""
    if getattr(case.plan, "fp8", None) is None:
        return ""
    return ("\nnote: the plan has fp8=..., which rounds every Linear's inputs to float8; the single-device reference "
            "computes in full precision, so outputs differ by design (about 20 dB SNR, torchao's bound). Check an FP8 "
            "plan against the same plan with fewer shards (tests/test_fp8.py) or with rtol/atol for float8.")


def _replay(case: Case) -> str:
    shapes = ", ".join(f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else repr(x)
                       for x in input_values(case.inputs))
    return (f"replay: fxpar.testing.assert_equivalent({describe(case.model_fn)}, {case.mesh_axes!r}, {case.plan!r}, "
            f"inputs, steps={case.steps}, seed={case.seed})  # inputs: ({shapes})")


def describe(fn: Any) -> str:
    """``fn`` as Python that rebuilds it: ``pkg.module.name``, ``partial(pkg.f, k=v)`` or its repr."""
    if isinstance(fn, functools.partial):
        args = [describe(fn.func), *map(repr, fn.args), *(f"{k}={v!r}" for k, v in fn.keywords.items())]
        return f"functools.partial({', '.join(args)})"
    if inspect.isfunction(fn) or inspect.isclass(fn):
        return f"{fn.__module__}.{fn.__qualname__}"
    return repr(fn)


# -- inside each rank ---------------------------------------------------------------------------


def check_rank(case: Case) -> RankReport:
    """Run in every rank of the mesh; see the module docstring."""
    rank = dist.get_rank()
    mesh = fxpar.Mesh(case.mesh_axes)
    reference, model = _build_twice(case)
    # the reference makes the plan's casts (mixed precision) and, as the compiled step, returns no KV cache
    with written_buffers(reference) as written, computing_in(reference, _param_dtype(case)), \
            without_kv_cache(reference):
        report = _check_rank(case, mesh, rank, reference, model)
    report.buffers_written = written
    return report


def _param_dtype(case: Case) -> torch.dtype | None:
    return getattr(case.plan, "param_dtype", None)


def _compute_dtype(case: Case, reference: torch.nn.Module) -> torch.dtype:
    """The dtype the tolerance is for: the least precise of the plan's ``param_dtype`` and ``reduce_dtype`` and the
    model's floating parameters (one bf16 ``Linear`` in an fp32 model, or gradients reduced in bf16, round the whole
    comparison at bf16)."""
    dtypes = {p.dtype for p in reference.parameters() if p.is_floating_point()}
    dtypes |= {d for d in (_param_dtype(case), getattr(case.plan, "reduce_dtype", None)) if d is not None}
    return max(dtypes or {torch.float32}, key=lambda d: torch.finfo(d).eps)


def _check_rank(case: Case, mesh: fxpar.Mesh, rank: int, reference: torch.nn.Module,
                model: torch.nn.Module) -> RankReport:
    loss_fn = case.loss_fn or mean_square
    compiled = compile_once(model, mesh, case.inputs, case.plan, loss_fn, case.model_fn)  # on rank 0, sent to all
    pm = fxpar.ParallelModule(compiled, model, rank, loss_fn=loss_fn, example_inputs=case.inputs)
    fxpar.verify(pm)
    if case.rank_hook is not None:
        case.rank_hook(pm, rank)
    report = RankReport(rank, program=pm.program(rank) if case.want_program else "")
    report.buffers_held = sorted(name for name, _ in pm.named_buffers())
    if len(pm._compiled.stages) > 1 or pm._compiled.microbatches > 1 or case.targets is not None:
        return _check_steps(case, pm, reference, report)
    tol = default_tolerance(_compute_dtype(case, reference), case.rtol, case.atol)
    local_inputs = dp_shard(case.inputs, mesh, rank)
    opt = torch.optim.AdamW(pm.parameters(), lr=case.lr, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=case.lr, eps=ADAM_EPS)
    pcoord, psizes = param_coord(mesh, rank)
    slack: dict[str, torch.Tensor] = {}
    ledger = pm.ledger(rank)
    for step in range(case.steps):
        rng = torch.get_rng_state()  # the reference draws (dropout) from the generator state the program drew from
        with CollectiveCounter() as issued:
            out = call_model(pm, local_inputs)
            loss = loss_fn(out)
            loss.backward()
        _check_ledger(ledger, issued.calls, [], step, report)
        torch.set_rng_state(rng)
        ref_out = call_model(reference, case.inputs)
        names, ref_leaves = output_leaves(ref_out)
        for name, got, want, placements in zip(names, pytree.tree_leaves(out), ref_leaves, pm.output_placements(),
                                               strict=True):
            if isinstance(want, torch.Tensor):
                _compare(name, got, output_shard(want, placements, mesh, rank, batch_size(case.inputs)), step, tol,
                         report)
        ref_loss = loss_fn(ref_out)
        ref_loss.backward()
        report.losses.append((_global_mean(loss, mesh, rank_batch_weight(mesh, rank, case.inputs)), ref_loss.item()))
        _compare_grads_and_step(case, pm, reference, opt, ref_opt, step, tol, report, pcoord, psizes, slack)
    return report


def _check_steps(case: Case, pm: fxpar.ParallelModule, reference: torch.nn.Module, report: RankReport) -> RankReport:
    """``pm.step`` (pipeline schedule, microbatches) against the single-device loss, gradients and parameters."""
    mesh, rank = pm.mesh, report.rank
    tol = default_tolerance(_compute_dtype(case, reference), case.rtol, case.atol)
    local_inputs = dp_shard(case.inputs, mesh, rank)
    local_targets = dp_shard((case.targets,), mesh, rank)[0] if case.targets is not None else None
    opt = torch.optim.AdamW(pm.parameters(), lr=case.lr, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=case.lr, eps=ADAM_EPS)
    loss_fn = case.loss_fn or mean_square
    pcoord, psizes = param_coord(mesh, rank)
    slack: dict[str, torch.Tensor] = {}
    ledger = pm.ledger(rank)
    for step in range(case.steps):
        model_args = (local_inputs,) if isinstance(local_inputs, dict) else local_inputs
        args = (*model_args, local_targets) if local_targets is not None else model_args
        rng = torch.get_rng_state()
        with CollectiveCounter() as issued:
            loss = pm.step(*args)
        _check_ledger(ledger, issued.calls, [LOSS_REPORT], step, report)
        torch.set_rng_state(rng)
        ref_loss = _reference_step(case, reference, loss_fn, batch_ranks(mesh), pm._compiled.microbatches)
        report.losses.append((loss.item(), ref_loss.item()))
        _compare("loss", loss.reshape(1), ref_loss.detach().reshape(1), step, tol, report)
        _compare_grads_and_step(case, pm, reference, opt, ref_opt, step, tol, report, pcoord, psizes, slack)
    return report


def _check_ledger(ledger: list[Any], issued: list[Any], extra: list[Any], step: int, report: RankReport) -> None:
    problem = ledger_mismatch(ledger, issued, extra)
    if problem is not None:
        report.ledger_errors.append(f"step {step}: {problem}")


def _reference_step(case: Case, reference: torch.nn.Module, loss_fn: LossFn, dp: int, m: int) -> torch.Tensor:
    """Forward and backward of the single-device model over the global batch, in the microbatches ``pm.step`` uses.

    Microbatch ``j`` is every batch shard's ``j``-th slice (``dp``: how many pieces the batch is split into, over
    dp and ep); each loss is scaled by ``1/m`` before backward and the returned loss is their mean. In exact
    arithmetic that is the full-batch loss and gradient; in fp32 it also
    sums in the parallel program's grouping, so the comparison tests the compiler, not the reordering (a
    full-batch reference differs from a microbatched one by up to ~3e-5 relative on small gradients).
    """
    def microbatch(x: Any, j: int) -> Any:
        if not isinstance(x, torch.Tensor) or not x.ndim:
            return x
        return torch.cat([shard.chunk(m)[j] for shard in x.chunk(dp)])

    losses = []
    for j in range(m):
        out = call_model(reference, map_inputs(functools.partial(microbatch, j=j), case.inputs))
        loss = loss_fn(out, microbatch(case.targets, j)) if case.targets is not None else loss_fn(out)
        (loss / m).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def _compare_grads_and_step(case: Case, pm: fxpar.ParallelModule, reference: torch.nn.Module, opt: Any,
                            ref_opt: Any, step: int, tol: Tolerance, report: RankReport, coord: tuple[int, ...],
                            sizes: tuple[int, ...], slack: dict[str, torch.Tensor]) -> None:
    """Every gradient this rank holds, one AdamW step on both sides, then every parameter.

    ``slack`` (kept across steps) adds up, element by element, how far the gradient differences seen so far can
    move a parameter under Adam, in steps of ``lr`` (``fxpar.testing.tolerance``)."""
    ref_params = dict(reference.named_parameters())
    for name, p in pm.named_parameters():
        _compare_param(f"grad of {name}", p.grad, ref_params[name].grad, step, tol, report, coord, sizes)
        pair = _local_pair(p.grad, ref_params[name].grad, coord, sizes)
        if pair is not None and pair[0].shape == pair[1].shape:
            moved = adam_sensitivity(pair[1].double(), (pair[0].double() - pair[1].double()).abs())
            slack[name] = slack[name] + moved if name in slack else moved
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    # each step taken can move an element at the rounding floor its own way: the bound grows with the steps
    param_tol = Tolerance(tol.rtol, tol.param_lr_fraction * case.lr * (step + 1), tol.later_steps,
                          tol.param_lr_fraction)
    for name, p in pm.named_parameters():
        extra = case.lr * slack[name] if name in slack else None
        _compare_param(f"{name} after step {step + 1}", p.data, ref_params[name].data, step, param_tol, report,
                       coord, sizes, absolute=True, extra_atol=extra)
    ref_buffers = dict(reference.named_buffers(remove_duplicate=False))
    for name, b in pm.named_buffers():  # the buffers the forward writes (BatchNorm's running statistics)
        _compare(f"buffer {name} after step {step + 1}", b, ref_buffers[name], step, tol, report)


def mean_square(outputs: Any) -> torch.Tensor:
    """The default loss: the mean of squares of every floating-point output, summed over outputs."""
    leaves = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor) and o.is_floating_point()]
    return sum(o.float().pow(2).mean() for o in leaves)


def _build_twice(case: Case) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(case.seed)
    reference = case.model_fn()
    torch.manual_seed(case.seed)
    model = case.model_fn()
    for (name, a), b in zip(reference.state_dict().items(), model.state_dict().values(), strict=True):
        if not torch.equal(a, b):
            raise ValueError(f"model_fn is not deterministic under torch.manual_seed: {name!r} differs between "
                             "two builds; initialize every parameter from torch's RNG")
    if getattr(getattr(reference, "config", None), "use_cache", False):
        reference.config.use_cache = False  # as fxpar compiles HF models: a training step, no KV cache out
    return reference, model


def _compare_param(name: str, got: torch.Tensor | None, want: torch.Tensor | None, step: int, tol: Tolerance,
                   report: RankReport, coord: tuple[int, ...], sizes: tuple[int, ...], absolute: bool = False,
                   extra_atol: torch.Tensor | None = None) -> None:
    pair = _local_pair(got, want, coord, sizes)
    if pair is None:
        if got is not want:
            report.mismatches.append(Mismatch(f"{name} is None on one side only", report.rank, step, math.inf,
                                              math.inf, tol.rtol, tol.atol))
        return
    _compare(name, *pair, step, tol, report, absolute, extra_atol)


def _local_pair(got: torch.Tensor | None, want: torch.Tensor | None, coord: tuple[int, ...],
                sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """This rank's piece of a parameter (or gradient) and the same piece of the reference's; None if either is."""
    if got is None or want is None:
        return None
    if isinstance(got, DTensor):
        return got.to_local(), shard_of(want, got.placements, coord, sizes)
    return got, want


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, step: int, tol: Tolerance, report: RankReport,
             absolute: bool = False, extra_atol: torch.Tensor | None = None) -> None:
    got, want = as_float64(got), as_float64(want)
    report.compared += 1
    if got.shape != want.shape:
        report.mismatches.append(Mismatch(f"{name} (shape {tuple(got.shape)}, expected {tuple(want.shape)})",
                                          report.rank, step, math.inf, math.inf, tol.rtol, tol.atol))
        return
    rtol, atol = tol.rtol, tol.atol
    if step > 0 and not absolute:
        rtol, atol = max(rtol, tol.later_steps), max(atol, tol.later_steps)
    if not absolute:  # sums of k terms err by ~k*eps*max|term|: scale the floor with the tensor
        atol *= max(1.0, want.abs().max().item() if want.numel() else 1.0)
    err = (got - want).abs()
    max_abs = err.max().item() if err.numel() else 0.0
    report.worst_abs = max(report.worst_abs, max_abs)
    if extra_atol is not None and extra_atol.shape == err.shape:  # element by element (``_compare_grads_and_step``)
        close = bool(((err <= atol + extra_atol + rtol * want.abs()) | (got.isnan() & want.isnan())).all())
    else:
        close = torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
    if not close:
        max_rel = (err / want.abs().clamp_min(1e-12)).max().item()
        report.mismatches.append(Mismatch(name, report.rank, step, max_abs, max_rel, rtol, atol))


def _global_mean(loss: torch.Tensor, mesh: fxpar.Mesh, weight: float) -> float:
    """The mean over dp ranks of the local losses, each weighed by ``weight`` (``dp * b_r / B``: 1 when dp
    divides the batch); every tp rank holds its dp shard's loss."""
    total = loss.detach().clone().float() * weight
    dist.all_reduce(total)
    return total.item() / mesh.size
