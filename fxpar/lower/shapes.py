"""Per-op shape handling when a global op runs on local pieces: shape arguments become local shapes.

``localize`` is the handler lowering calls for every op: view-like ops and factories get this rank's
shape (``SHAPE_ARG``), a sharded ``arange`` its own row count (``ARANGES``), GroupNorm its input's local
sizes (``SIZE_ARGS``), a view that is not
viewable on the local layout becomes a ``reshape``, and ``squeeze`` names the dims it removes. A view
whose uneven pieces would not line up on some rank is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Shard

from fxpar.split import Splitter

aten = torch.ops.aten
SHAPE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.new_empty.default: 1, aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_full.default: 1,
    aten.slice_backward.default: 1, aten.select_backward.default: 1,
    aten.empty.memory_format: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0,
    aten.new_empty_strided.default: 1, aten.empty_strided.default: 0,  # and their strides, the argument after
}
STRIDED = {aten.new_empty_strided.default, aten.empty_strided.default}
ARANGES = {aten.arange.default: 0, aten.arange.start: 1, aten.arange.start_step: 1}  # index of ``end``
SQUEEZES = {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
# ops that take their input's sizes as ints: op -> (index of the input, index of N; C and HxW follow it)
SIZE_ARGS = {aten.native_group_norm.default: (0, 3), aten.native_group_norm_backward.default: (1, 5)}
VIEWS = {aten.view.default, aten._unsafe_view.default}
_HANDLED = frozenset({*SHAPE_ARG, *ARANGES, *SQUEEZES, *SIZE_ARGS, *VIEWS})


def strides_like(strides: list[int], shape: list[int]) -> list[int]:
    """Dense strides over ``shape`` that order its dims as ``strides`` does (innermost: the smallest stride)."""
    out = [0] * len(shape)
    step = 1
    for d in sorted(range(len(shape)), key=lambda d: (strides[d], -d)):
        out[d] = step
        step *= max(shape[d], 1)
    return out


@dataclass(frozen=True)
class LocalShapes:
    """What localizing a node needs: how values split, this rank's coordinate, and the user's line (for errors)."""

    split: Splitter
    coord: tuple[int, ...]
    fake: FakeTensorMode
    arg_placements: dict[str, Any]
    source: str


def localize(node: fx.Node, args: tuple, placements: Any, at: LocalShapes) -> tuple[Any, tuple]:
    """Rewrite global shape arguments to this rank's local shapes."""
    target = node.target
    if target not in _HANDLED:  # most ops: one lookup (an op's hash is a Python call)
        return target, args
    if target in SHAPE_ARG and isinstance(placements, tuple) and any(isinstance(p, Shard) for p in placements):
        i = SHAPE_ARG[target]
        shape = at.split.local_shape(node.meta["val"].shape, placements, at.coord)
        args = (*args[:i], shape, *args[i + 1:])
        if target in STRIDED:  # the same dim order, dense over the local sizes
            args = (*args[:i + 1], strides_like(args[i + 1], shape), *args[i + 2:])
    if target in ARANGES and isinstance(placements, tuple) and any(isinstance(p, Shard) for p in placements):
        # only inside a token-local region (fxpar.rules.token_local): this rank's own row indices
        i = ARANGES[target]
        assert i == 0 or args[0] == 0, "a sharded arange starts at 0"
        size = at.split.local_shape(node.meta["val"].shape, placements, at.coord)[0]
        args = (*args[:i], size, *args[i + 1:])
    if target in VIEWS:
        check_uneven_view(node, placements, at)
    if target in VIEWS and not _viewable(args[0].meta["val"], args[1], at.fake):
        # a layout that was viewable globally may not be locally (a gathered tensor is laid out
        # as the collective wrote it): the graph is functional, so a copying reshape is exact
        target = aten.reshape.default
    if target in SIZE_ARGS:  # GroupNorm's N, C, HxW: the local input's (dp shards N)
        x, n = SIZE_ARGS[target]
        shape = args[x].meta["val"].shape
        args = (*args[:n], shape[0], shape[1], math.prod(shape[2:]), *args[n + 3:])
    if target in SQUEEZES:
        shape = node.args[0].meta["val"].shape
        dims = [args[1]] if target is aten.squeeze.dim else (args[1] if len(args) > 1 else range(len(shape)))
        keep = [d for d in dims if shape[d] == 1]
        target, args = aten.squeeze.dims, (args[0], keep)
    return target, args

def check_uneven_view(node: fx.Node, placements: Any, at: LocalShapes) -> None:
    """Refuse a view whose uneven pieces would not line up on some rank of an axis (e.g. splitting a
    tp-sharded dim of 100 into 4 x 25 at tp=3): no local view computes the global one there."""
    src = node.args[0]
    src_p = (at.arg_placements.get(node.name) or (None,))[0]  # as the view consumes it
    if not all(isinstance(p, tuple) and all(hasattr(q, "is_shard") for q in p) for p in (placements, src_p)):
        return
    out_val, in_val = node.meta["val"], src.meta["val"]
    if at.split.is_even(out_val.shape, placements) and at.split.is_even(in_val.shape, src_p):
        return
    for ax, n in enumerate(at.split.shape):
        for i in range(n):
            coord = (*at.coord[:ax], i, *at.coord[ax + 1:])
            have = math.prod(at.split.local_shape(in_val.shape, src_p, coord))
            want = math.prod(at.split.local_shape(out_val.shape, placements, coord))
            if have != want:
                raise NotImplementedError(
                    f"{at.source or node.name}: viewing {tuple(in_val.shape)} as {tuple(out_val.shape)} "
                    f"with uneven pieces over {at.split.names[ax]!r} ({tuple(src_p)} -> {tuple(placements)}): "
                    f"rank {i} of that axis would hold {have} elements but need {want}; choose sizes the "
                    "axis divides, or replicate the module that makes this value")


def _viewable(x: torch.Tensor, shape: list[int], fake: FakeTensorMode) -> bool:
    """Whether ``x.view(shape)`` is valid for ``x``'s strides (it depends on sizes and strides alone)."""
    key = (tuple(x.shape), x.stride(), tuple(shape))
    if key not in _VIEWABLE:
        try:
            with fake:
                x.view(shape)
            _VIEWABLE[key] = True
        except (RuntimeError, ValueError):
            _VIEWABLE[key] = False
    return _VIEWABLE[key]


_VIEWABLE: dict[tuple[Any, ...], bool] = {}
