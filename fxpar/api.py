"""``fxpar.parallelize``: capture, run the pass pipeline, and return the rank's module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fxpar.auto import resolve_plan_arg
from fxpar.capture_memo import one_call
from fxpar.cluster import Cluster
from fxpar.compiled import Compiled, compile_model
from fxpar.gc_pause import without_gc_pauses
from fxpar.mesh import Mesh
from fxpar.plan import Plan, check_axes
from fxpar.rank_agreement import check_ranks_agree
from fxpar.runtime import ParallelModule
from fxpar.verify import verify


@without_gc_pauses
def parallelize(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...] | Any,
                plan: Plan | dict[str, str] | str | None = None, *,
                loss_fn: Callable[..., torch.Tensor] | None = None, example_targets: Any = None,
                cluster: Cluster | None = None) -> ParallelModule:
    """Compile ``model`` into one program per rank of ``mesh`` and return this rank's module.

    Requires: ``example_inputs`` with global (unsharded) shapes; on a real mesh, an initialized
    process group whose world size equals the mesh size. ``plan`` is a ``fxpar.Plan`` (a plain
    dict is ``Plan(tp=dict)``). An axis named ``dp`` shards the batch (dim 0 of every input) and
    averages gradients over it; an axis named ``pp`` runs ``plan.stages`` pipeline stages under
    ``plan.schedule`` and needs ``loss_fn(outputs, targets)`` (a batch mean), computed by the last
    stage. ``example_targets`` (global shapes) documents the targets ``pm.step`` will get.
    ``plan="auto"`` runs ``fxpar.search`` with the mesh fixed, costed on ``cluster`` (default: this
    machine measured for a CPU mesh, the GPU's preset for a CUDA one); ``plan=None`` means ``"auto"``
    when the mesh has an axis that needs a plan (``tp``), else the single-device defaults.
    Ensures: ``model`` is not modified; the returned module's parameters are DTensors named as in
    ``model`` (each rank holds its stages' parameters); ``pm.program(rank)`` / ``pm.ledger(rank)``
    inspect any rank, also on a fake mesh; ``fxpar.verify(pm)`` has passed
    (``pm.proof`` says what it checked).
    """
    check_arguments(model, mesh)
    rank = None
    if not mesh.fake:
        mesh.device_mesh()  # validates the world size before any work
        rank = dist.get_rank()
    with one_call(model):  # a plan search and the final compile capture the model once
        plan = resolve_plan_arg(plan, model, mesh, example_inputs, cluster, loss_fn)
        compiled = compile_program(model, mesh, example_inputs, plan, loss_fn=loss_fn)
    if rank is not None and mesh.size > 1:
        check_ranks_agree(compiled)  # before any rank runs a collective of it
    pm = ParallelModule(compiled, model, rank, loss_fn=loss_fn, example_inputs=example_inputs)
    pm.proof = verify(pm)  # what the collective-order proof checked (ranks, roles, groups, events)
    return pm


def compile_program(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...] | Any,
                    plan: Plan | dict[str, str] | None = None, *, loss_fn: Callable[..., torch.Tensor] | None = None
                    ) -> Compiled:
    """The global programs every rank lowers: capture, then the pass pipeline (no process group needed).

    ``plan="auto"`` is searched here too (``plan=None`` keeps its single-device defaults).
    ``fxpar.serialize`` turns the result into bytes, so one rank can compile for all of them;
    ``ParallelModule(compiled, model, rank, loss_fn)`` then builds a rank's module from it.
    Ensures: ``compiled.timings`` holds seconds per stage of compilation (capture and each pass).
    """
    check_arguments(model, mesh)
    with one_call(model):
        plan = resolve_plan_arg(plan, model, mesh, example_inputs, None, loss_fn, none_means_auto=False)
        return compile_model(model, mesh, example_inputs, plan, loss_fn)


def check_arguments(model: torch.nn.Module, mesh: Mesh) -> None:
    """``model`` an ``nn.Module`` and ``mesh`` a ``Mesh`` (a dict is named), on a device torch has, of known axes."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"parallelize takes an nn.Module, got {type(model).__name__} (wrap a function in a Module "
                        "whose forward calls it)")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"parallelize takes a fxpar.Mesh, got {type(mesh).__name__}"
                        + (f": did you mean fxpar.Mesh({mesh!r})?" if isinstance(mesh, dict) else ""))
    check_device(mesh)
    check_axes(mesh.names)


def check_device(mesh: Mesh) -> None:
    """A CUDA mesh, fake or real, is traced on CUDA's own kernels (attention, grouped matmuls): torch must see a GPU.
    Without one, tracing would abort the whole process inside torch."""
    if mesh.device == "cuda" and not torch.cuda.is_available():
        build = "this torch is a CPU-only build" if not torch.backends.cuda.is_built() else "no GPU is visible"
        raise ValueError(f"Mesh(..., device='cuda') needs a CUDA GPU that torch can see ({build}): a CUDA mesh is "
                         "traced on CUDA's own kernels. To inspect a CUDA plan on this machine, compile it on "
                         "Mesh(..., device='cpu', fake=True): the programs differ only in those kernels "
                         "(e.g. the attention op).")
