"""A random op whose output is sharded, lowered as its whole draw and the rank's piece (``fxpar.random_draws``)."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate

from fxpar.ir import Placements

aten = torch.ops.aten


class WholeDraws:
    """The methods ``Lowerer`` uses for random ops on sharded values (state lives on the lowerer)."""

    def draw_whole(self, node: fx.Node, local_args: tuple, placements: Any, module: str) -> Any:
        """``node`` drawn at its global shape on a stand-in input, then this rank's piece of it. For
        ``native_dropout``: ``(local input * piece of the whole mask * scale, piece of the mask)``, the single
        device's ``input.mul(mask).mul_(scale)`` on this rank's elements; getitem nodes read the tuple."""
        whole_p = tuple(Replicate() for _ in self.mesh.names)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: self.whole_stand_in(a, module))
        dropout = node.target is aten.native_dropout.default
        whole = self.emit(node.target, args, kwargs, placements=(whole_p, whole_p) if dropout else whole_p,
                          module=module, name=f"{node.name}_whole")
        if not dropout:
            return self.piece_of(whole, placements, module)
        out_p = placements[0]
        mask_whole = self.emit(operator.getitem, (whole, 1), placements=whole_p, module=module,
                               name=f"{node.name}_whole_mask")
        mask = self.piece_of(mask_whole, placements[1], module)
        p = float(node.args[1])
        scale = 0.0 if p == 1.0 else 1.0 / (1.0 - p)
        kept = self.emit(aten.mul.Tensor, (local_args[0], mask), placements=out_p, module=module)
        return self.emit(aten.mul.Tensor, (kept, scale), placements=out_p, module=module), mask

    def whole_stand_in(self, a: fx.Node, module: str) -> fx.Node:
        """An uninitialized tensor of ``a``'s global shape and dtype: what a shape-only random op draws on."""
        val = a.meta["val"]
        return self.emit(aten.empty.memory_format, (list(val.shape),), {"dtype": val.dtype, "device": val.device},
                         module=module)

    def piece_of(self, x: fx.Node, placements: Placements, module: str) -> fx.Node:
        """This rank's piece of the whole value ``x`` placed as ``placements`` (axes in mesh order, as DTensor
        nests shards of one dim), copied out of it: a saved slice would keep the whole draw alive until the
        backward (a dropout mask ``dp`` times the size of the rank's own)."""
        for ax, p in enumerate(placements):
            if p.is_shard():
                x = self.own_piece(x, p.dim, self.mesh.names[ax], None, module)
        return self.emit(aten.clone.default, (x,), {"memory_format": torch.contiguous_format},
                         placements=placements, module=module)


def draws_numbers(node: fx.Node) -> bool:
    """False for ``native_dropout`` in eval mode (``train=False``: no mask is drawn)."""
    return node.target is not aten.native_dropout.default or len(node.args) < 3 or node.args[2] is not False
