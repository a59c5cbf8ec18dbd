"""``fxpar.parallelize``: capture, run the pass pipeline, and return the rank's module."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fxpar.capture import capture
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
    if not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    rank = None
    if not mesh.fake:
        mesh.device_mesh()  # validates the world size before any work
        rank = dist.get_rank()
    ctx = Context(model=model, plan=plan)
    prog = capture(model, mesh, example_inputs)
    prog = run_pipeline(prog, ctx)
    pm = ParallelModule(prog, None if mesh.fake else model, rank)
    pm.timings = dict(ctx.timings)
    return pm
