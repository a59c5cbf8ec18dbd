"""Collectives on local pieces: all-reduce, all-gather and reduce-scatter over one mesh axis, with the padding
uneven pieces need and the load-balanced order of a cp sequence (``fxpar.split`` says who holds what)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxpar.ir import Placements, Step
from fxpar.lower.emit import Emitter
from fxpar.mesh import Mesh
from fxpar.split import Splitter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
COORD_SLICE = "fxpar_coord_slice"  # node meta of an even slice ``(axis index, size)``: bind sets its start per rank


def _peek(coord: tuple[int, ...], ax: int) -> int:
    """Axis ``ax``'s coordinate, not recorded as read by a ``ReadCoord``."""
    return coord.peek(ax) if hasattr(coord, "peek") else coord[ax]


class CollectiveEmitter(Emitter):
    """An ``Emitter`` that also emits the collectives of a placement change on this rank's pieces."""

    def __init__(self, mesh: Mesh, rank: int, split: Splitter) -> None:
        super().__init__(mesh, rank)
        self.split = split
        self.coord = mesh.coord(rank)

    def apply_step(self, x: fx.Node, step: Step, after: Placements, module: str, like: torch.Tensor) -> fx.Node:
        """One placement change on one axis of a value whose global form is ``like``."""
        n = self.mesh.axes[step.axis]
        g = self.group(step.axis)
        if step.op == "slice":
            return self.own_piece(x, step.dst.dim, step.axis, after, module)
        if step.op == "all_reduce":
            op = step.src.reduce_op  # "sum", or "max" for an fp8 amax over shards
            y = self.emit(c10d.all_reduce.default, (x, op, g), placements=after, module=module,
                          name=f"{x.name}_allreduce")
            self.record("all_reduce" if op == "sum" else f"all_reduce_{op}", step.axis, x.meta["val"], y)
            return self.emit(c10d.wait_tensor.default, (y,), placements=after, module=module, name=f"{x.name}_reduced")
        if step.op == "all_gather":
            return self.gather(x, step.src.dim, n, g, step.axis, after, module, total=like.shape[step.src.dim])
        if step.op == "reduce_scatter":
            return self.scatter(x, step.dst.dim, n, g, step.axis, after, module)
        # all_to_all (shard dim i -> shard dim j), done as a gather then a local slice: the ledger lists the gather
        full = self.gather(x, step.src.dim, n, g, step.axis, None, module, total=like.shape[step.src.dim])
        return self.own_piece(full, step.dst.dim, step.axis, after, module)

    def own_piece(self, x: fx.Node, d: int, axis: str, after: Any, module: str) -> fx.Node:
        """This rank's piece of dim ``d`` of a value whole on ``axis`` (uneven sizes as ``fxpar.split`` says)."""
        ax = self.mesh.axis_index(axis)
        total = x.meta["val"].shape[d]
        if self.split.balanced(total, ax):  # the cp sequence: two chunks of consecutive positions
            positions = self.split.indices(total, ax, self.coord[ax])
            half = len(positions) // 2
            chunks = [self.emit(aten.slice.Tensor, (x, d, p[0], p[-1] + 1), module=module)
                      for p in (positions[:half], positions[half:])]
            return self.emit(aten.cat.default, (chunks, d), placements=after, module=module)
        sizes = self.split.sizes(total, ax)
        if len(set(sizes)) == 1:  # even: the start is bound per rank (COORD_SLICE), so the role need not read it
            start, size = _peek(self.coord, ax) * sizes[0], sizes[0]
            y = self.emit(aten.slice.Tensor, (x, d, start, start + size), placements=after, module=module)
            y.meta[COORD_SLICE] = (ax, size)
            return y
        start, size = self.split.piece(total, ax, self.coord[ax])
        return self.emit(aten.slice.Tensor, (x, d, start, start + size), placements=after, module=module)

    def balanced_order(self, x0: fx.Node, n: int, module: str, to_ranks: bool, after: Any = None) -> fx.Node:
        """Reorder dim 0 of ``x0`` (the whole cp sequence) between position order and rank order (rank ``i``'s
        chunks ``i`` and ``2n - 1 - i`` together, as a collective lays out its pieces)."""
        shape = list(x0.meta["val"].shape)
        c, rest = shape[0] // (2 * n), shape[1:]
        if to_ranks:  # [2, n, c] positions -> [n, 2, c]: rank i takes chunk i, then chunk 2n - 1 - i
            halves = self.emit(aten.view.default, (x0, [2, n, c, *rest]), module=module)
            first = self.emit(aten.select.int, (halves, 0, 0), module=module)
            second = self.emit(aten.flip.default, (self.emit(aten.select.int, (halves, 0, 1), module=module), [0]),
                               module=module)
            pairs = self.emit(aten.stack.default, ([first, second], 1), module=module)
            return self.emit(aten.reshape.default, (pairs, shape), placements=after, module=module)
        pairs = self.emit(aten.view.default, (x0, [n, 2, c, *rest]), module=module)
        first = self.emit(aten.select.int, (pairs, 1, 0), module=module)
        second = self.emit(aten.flip.default, (self.emit(aten.select.int, (pairs, 1, 1), module=module), [0]),
                           module=module)
        return self.emit(aten.reshape.default, (self.emit(aten.cat.default, ([first, second],), module=module), shape),
                         placements=after, module=module)

    def _pad_rows(self, x0: fx.Node, rows: int, module: str) -> fx.Node:
        """``x0`` with zero rows appended on dim 0 up to ``rows`` (all pieces of a collective have one size)."""
        have = x0.meta["val"].shape[0]
        if have == rows:
            return x0
        pad = [0, 0] * (x0.meta["val"].ndim - 1) + [0, rows - have]
        return self.emit(aten.constant_pad_nd.default, (x0, pad, 0.0), module=module)

    def _pieces(self, total: int, axis: str) -> tuple[list[int], list[int], int, bool]:
        """Piece sizes and starts of ``total`` over ``axis``, the padded piece size, and whether the padding is
        all at the end (DTensor's split: every piece but the last ones full)."""
        sizes = self.split.sizes(total, self.mesh.axis_index(axis))
        ceil = max(sizes)
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        tail_padded = all(st == i * ceil or size == 0 for i, (st, size) in enumerate(zip(starts, sizes, strict=True)))
        return sizes, starts, ceil, tail_padded

    def scatter(self, x: fx.Node, d: int, n: int, g: str, axis: str, after: Any, module: str,
                contiguous: bool = False) -> fx.Node:
        """Reduce-scatter ``x`` (a partial sum) over ``axis``, keeping this rank's slice of dim ``d``.

        Uneven pieces (``fxpar.split``: a ZeRO gradient shard of a dim dp does not divide among them) are laid out
        as ``n`` pieces padded with zero rows to one size; this rank then keeps its own rows of its piece.
        """
        total = x.meta["val"].shape[d]
        sizes, starts, ceil, tail_padded = self._pieces(total, axis)
        x0 = self.emit(aten.movedim.int, (x, d, 0), module=module) if d else x
        x0 = self.emit(aten.clone.default, (x0,), {"memory_format": torch.contiguous_format}, module=module)
        if self.split.balanced(total, self.mesh.axis_index(axis)):
            x0 = self.balanced_order(x0, n, module, to_ranks=True)
        elif tail_padded:
            x0 = self._pad_rows(x0, n * ceil, module)
        else:
            pieces = [self._pad_rows(self.emit(aten.slice.Tensor, (x0, 0, st, st + size), module=module), ceil, module)
                      for st, size in zip(starts, sizes, strict=True)]
            x0 = self.emit(aten.cat.default, (pieces,), module=module)
        y = self.emit(c10d.reduce_scatter_tensor.default, (x0, "sum", n, g), placements=after, module=module,
                      name=f"{x.name}_reducescatter")
        self.record("reduce_scatter", axis, x0.meta["val"], y)
        y = self.emit(c10d.wait_tensor.default, (y,), placements=after, module=module, name=f"{x.name}_scattered")
        mine = sizes[0] if sizes[0] == sizes[-1] else sizes[self.coord[self.mesh.axis_index(axis)]]
        if mine != ceil:
            y = self.emit(aten.slice.Tensor, (y, 0, 0, mine), placements=after, module=module)
            if contiguous and not d:  # a piece of its own (a ZeRO gradient shard holds only its rows)
                y = self.emit(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, module=module)
        return self._moved_back(y, d, after, module, contiguous)

    def gather(self, x: fx.Node, d: int, n: int, g: str, axis: str, after: Any, module: str,
               contiguous: bool = False, total: int | None = None) -> fx.Node:
        """All-gather ``x`` over ``axis`` along dim ``d``. When the pieces of ``total`` (the gathered size) differ
        in size, each is padded to the largest and the padding is cut out after."""
        sizes, _, ceil, tail_padded = self._pieces(total, axis) if total is not None else ([], [], 0, True)
        uneven = len(set(sizes)) > 1
        x0 = self.emit(aten.movedim.int, (x, d, 0), module=module) if d else x
        x0 = self.emit(aten.clone.default, (x0,), {"memory_format": torch.contiguous_format}, module=module)
        dtype = x0.meta["val"].dtype
        if dtype in FLOAT8:  # gloo has no float8 type: the bytes move as uint8 (and are padded as such)
            x0 = self.emit(aten.view.dtype, (x0, torch.uint8), module=module)
        if uneven:
            x0 = self._pad_rows(x0, ceil, module)
        c = self.emit(c10d.all_gather_into_tensor.default, (x0, n, g), placements=after, module=module,
                      name=f"{x.name}_allgather")
        y = self.emit(c10d.wait_tensor.default, (c,), placements=after, module=module, name=f"{x.name}_gathered")
        if dtype in FLOAT8:
            y = self.emit(aten.view.dtype, (y, dtype), placements=after, module=module)
        self.record("all_gather", axis, y.meta["val"], c)
        if total is not None and self.split.balanced(total, self.mesh.axis_index(axis)):
            y = self.balanced_order(y, n, module, to_ranks=False, after=after)
        if uneven and tail_padded:
            y = self.emit(aten.slice.Tensor, (y, 0, 0, total), placements=after, module=module)
            if contiguous and not d:  # a tensor of its own (a ZeRO working copy holds no padding)
                y = self.emit(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, module=module)
        elif uneven:
            rows = [self.emit(aten.slice.Tensor, (y, 0, i * ceil, i * ceil + size), module=module)
                    for i, size in enumerate(sizes) if size]
            y = self.emit(aten.cat.default, (rows,), placements=after, module=module)
        return self._moved_back(y, d, after, module, contiguous)

    def _moved_back(self, y: fx.Node, d: int, after: Any, module: str, contiguous: bool) -> fx.Node:
        if not d:
            return y
        y = self.emit(aten.movedim.int, (y, 0, d), placements=after, module=module)
        if contiguous:
            y = self.emit(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, module=module)
        return y
