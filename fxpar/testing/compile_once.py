"""One compile for all the ranks of a test's mesh: rank 0 compiles, every rank runs what it sent.

``fxpar.parallelize`` compiles on every rank, as each process of a launched job must; the programs are
identical. On a small test machine, where four ranks share two cores, compiling once and sending the
global program (``fxpar.serialize``) makes a many-rank check several times cheaper. Every rank, rank 0
too, runs the deserialized program, so all ranks take the same path; a compile error is raised on all.
Rank 0 also keeps its latest captures (``fxpar.capture_memo``) by the pickled ``model_fn``, which builds
the same model every time: a model checked under several meshes and plans is traced once per capture key.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import fxpar
from fxpar import serialize
from fxpar.api import compile_program
from fxpar.capture_memo import CaptureMemo
from fxpar.compiled import Compiled

_CAPTURES = CaptureMemo(size=16)  # rank 0's, across the tasks a pool worker runs


def compile_once(model: torch.nn.Module, mesh: fxpar.Mesh, inputs: Any, plan: Any, loss_fn: Any,
                 model_fn: Callable[[], torch.nn.Module]) -> Compiled:
    """The global program of ``model`` (built by ``model_fn``), compiled on rank 0 and sent to every rank.

    Requires: an initialized process group of ``mesh.size`` ranks, every rank calling with equal arguments.
    """
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            with _CAPTURES.vouching(model, key=pickle.dumps(model_fn)):
                compiled = compile_program(model, mesh, inputs, plan, loss_fn=loss_fn)
            payload[0] = serialize.dumps(compiled)
        except Exception as e:  # noqa: BLE001 - sent to every rank, then raised everywhere
            payload[0] = e
    dist.broadcast_object_list(payload, src=0)
    if isinstance(payload[0], BaseException):
        raise payload[0]
    return serialize.loads(payload[0], mesh)


def parallelize_once(model_fn: Callable[[], torch.nn.Module], mesh: fxpar.Mesh, inputs: Any, plan: Any = None, *,
                     loss_fn: Any = None) -> fxpar.ParallelModule:
    """What ``fxpar.parallelize(model_fn(), mesh, inputs, plan, loss_fn=loss_fn)`` returns on this rank (verified),
    from one compile on rank 0. ``model_fn`` is called once here, under the caller's RNG state."""
    model = model_fn()
    inputs = inputs if isinstance(inputs, (tuple, dict)) else (inputs,)
    pm = fxpar.ParallelModule(compile_once(model, mesh, inputs, plan, loss_fn, model_fn), model, dist.get_rank(),
                              loss_fn=loss_fn, example_inputs=inputs)
    pm.proof = fxpar.verify(pm)
    return pm
