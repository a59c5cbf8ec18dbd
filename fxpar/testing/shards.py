"""Which piece of the single-device model's inputs, outputs and parameters a rank of a parallel program holds.

The reference runs on the whole batch; each rank runs on its own batch piece (``fxpar.split``'s rule: the first
dp ranks one more row when the batch does not divide) and holds its own shard of every output and parameter.
``assert_equivalent`` compares on those pieces, so a wrong rank is named as such.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

import fxpar
from fxpar.split import BATCH_AXES, Splitter, batch_weight, chunk_sizes, rank_batch


def dp_shard(inputs: tuple[Any, ...], mesh: fxpar.Mesh, rank: int) -> tuple[Any, ...]:
    """This rank's batch piece of each batched input (``fxpar.split.rank_batch``)."""
    if not any(a in BATCH_AXES and mesh.axes[a] > 1 for a in mesh.names):
        return inputs
    batch = batch_size(inputs)  # inputs whose dim 0 is not the batch (a [1, s] table) are replicated, as fxpar does

    def piece(x: Any) -> Any:
        if not (isinstance(x, torch.Tensor) and x.ndim and x.shape[0] == batch):
            return x
        return rank_batch(x, mesh, rank)

    return map_inputs(piece, inputs)


def input_values(inputs: tuple[Any, ...] | dict[str, Any]) -> list[Any]:
    return list(inputs.values()) if isinstance(inputs, dict) else list(inputs)


def map_inputs(fn: Callable[[Any], Any], inputs: tuple[Any, ...] | dict[str, Any]) -> Any:
    """``fn`` applied to each positional or keyword input."""
    return {k: fn(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(fn(x) for x in inputs)


def call_model(model: Any, inputs: tuple[Any, ...] | dict[str, Any]) -> Any:
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def batch_size(inputs: tuple[Any, ...] | dict[str, Any]) -> int | None:
    return next((x.shape[0] for x in input_values(inputs) if isinstance(x, torch.Tensor) and x.ndim), None)


def rank_batch_weight(mesh: fxpar.Mesh, rank: int, inputs: tuple[Any, ...]) -> float:
    dp = mesh.axes.get("dp", 1)
    if dp == 1:
        return 1.0
    return batch_weight(Splitter(mesh.names, mesh.shape, batch_size(inputs)), mesh.coord(rank)[mesh.axis_index("dp")],
                        mesh)


def param_coord(mesh: fxpar.Mesh, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's coordinate and the axis sizes of the mesh parameters live on (every axis but pp)."""
    keep = [i for i, a in enumerate(mesh.names) if a != "pp"]
    coord = mesh.coord(rank)
    if not keep:
        return (0,), (1,)
    return tuple(coord[i] for i in keep), tuple(mesh.shape[i] for i in keep)


def output_leaves(out: Any) -> tuple[list[str], list[Any]]:
    """Names (``output``, ``output[0]``, ``output.logits``) and leaves of the reference outputs."""
    flat, _ = pytree.tree_flatten_with_path(out)
    return [f"output{pytree.keystr(path)}" for path, _ in flat], [leaf for _, leaf in flat]


def shard_of(full: torch.Tensor, placements: Any, coord: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """This rank's piece of ``full`` under a DTensor's ``placements`` (DTensor's split, uneven and empty pieces)."""
    for p, c, n in zip(placements, coord, sizes, strict=True):
        if isinstance(p, Shard):
            pieces = chunk_sizes(full.shape[p.dim], n)
            full = full.narrow(p.dim, sum(pieces[:c]), pieces[c])
    return full


def output_shard(full: torch.Tensor, placements: Any, mesh: fxpar.Mesh, rank: int, batch: int | None) -> torch.Tensor:
    """This rank's piece of a model output (split as ``fxpar.split`` says: the batch's first dp ranks one more)."""
    split, coord = Splitter(mesh.names, mesh.shape, batch), mesh.coord(rank)
    for ax, p in enumerate(placements):
        if isinstance(p, Shard):
            start, size = split.piece(full.shape[p.dim], ax, coord[ax])
            full = full.narrow(p.dim, start, size)
    return full
