"""``fxpar.parallelize``: capture, run the pass pipeline, and return the rank's module."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from fxpar.capture import capture
from fxpar.ir import Program
from fxpar.mesh import Mesh
from fxpar.pipeline import Context, run_pipeline
from fxpar.runtime import ParallelModule


def parallelize(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...] | Any,
                plan: dict[str, str] | None = None) -> ParallelModule:
    """Compile ``model`` into one program per rank of ``mesh`` and return this rank's module.

    Requires: ``example_inputs`` with global (unsharded) shapes; on a real mesh, an initialized
    process group whose world size equals the mesh size. ``plan`` maps module-path globs to
    ``"colwise" | "rowwise" | "replicate"`` on the ``tp`` axis; an axis named ``dp`` shards the
    batch (dim 0 of every input) and averages gradients over it.
    Ensures: ``model`` is not modified; the returned module's parameters are DTensors named as
    in ``model``; ``pm.program(rank)`` / ``pm.ledger(rank)`` inspect any rank, also on a fake mesh.
    """
    rank = None
    if not mesh.fake:
        mesh.device_mesh()  # validates the world size before any work
        rank = dist.get_rank()
    prog = compile_program(model, mesh, example_inputs, plan)
    return ParallelModule(prog, None if mesh.fake else model, rank)


def compile_program(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...] | Any,
                    plan: dict[str, str] | None = None) -> Program:
    """The global program every rank lowers: capture, then the pass pipeline (no process group needed).

    ``fxpar.serialize`` turns it into bytes, so one rank can compile for all of them;
    ``ParallelModule(prog, model, rank)`` then builds a rank's module from it.
    Ensures: ``prog.notes["timings"]`` holds seconds per stage (capture and each pass).
    """
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    ctx = Context(model=model, plan=plan)
    start = time.perf_counter()
    prog = capture(model, mesh, example_inputs)
    ctx.timings["capture"] = time.perf_counter() - start
    prog = run_pipeline(prog, ctx)
    return prog.replace(notes={**prog.notes, "timings": dict(ctx.timings)})
