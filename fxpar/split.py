"""How a dim is split over a mesh axis when the axis does not divide it.

Two rules, one per kind of axis:

* **Model axes** (``tp``) split as DTensor does (``torch.chunk``): pieces of ``ceil(size / n)`` first,
  then the remainder, then empty ones. fxpar's parameters are DTensors, so their local pieces must be
  the ones DTensor (and DCP) expects: vocab 130 at tp=4 is 33, 33, 33, 31.
* **The batch axis** (``dp``) splits as ``torch.tensor_split`` does: the first ranks hold one more
  sample (a batch of 6 at dp=4 is 2, 2, 1, 1), so no rank is left without data. A dim whose size is a
  multiple of the batch (tokens ``b * s`` after a flatten) follows the batch's split scaled by
  ``size / batch``, which is what each rank holds after flattening its own rows. Splitting every
  dp-sharded dim this way keeps pieces consistent through views, so gathers and slices along it are
  exact.
* **A ZeRO parameter shard** (``dp``, a dim dp does not divide) splits as DTensor does, like a model axis: the
  parameter is a DTensor ``Shard(d)`` over dp. That is only possible where dp divides the global batch
  (``Splitter.batch_even``): then no batch-derived dim is ever split unevenly over dp, so the two rules never
  meet on one dim (the ``zero`` pass shards no dim unevenly otherwise).

Even splits are the same under both rules.

* **The context axis** (``cp``) splits the sequence dim (the size ``seq`` of dim 1 of the first input) load-balanced
  for causal attention: the sequence is cut into ``2 * cp`` chunks and rank ``i`` holds chunks ``i`` and
  ``2 * cp - 1 - i`` (so every rank attends over the same number of earlier positions). Its pieces are not
  contiguous: slices, gathers and reduce-scatters along it reorder (``Splitter.indices``). ``annotate`` refuses a
  sequence ``2 * cp`` does not divide. Any other dim sharded over cp is split as tp splits it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import Shard

BATCH_AXIS = "dp"
CONTEXT_AXIS = "cp"
BATCH_AXES = ("dp", "ep")  # expert parallelism borrows the data-parallel ranks: ep shards the batch too (evenly)


def batch_ranks(mesh: Any) -> int:
    """How many pieces the batch is split into: ``dp * ep``."""
    return mesh.axes.get("dp", 1) * mesh.axes.get("ep", 1)


def rank_batch(x: torch.Tensor, mesh: Any, rank: int) -> torch.Tensor:
    """``rank``'s piece of a global batch ``x`` (dim 0): ``torch.tensor_split`` over dp, then over ep, in mesh
    order. It is what ``pm.step`` takes on that rank (every rank of a tp, cp or pp group takes the same piece)."""
    coord = mesh.coord(rank)
    for a in (a for a in mesh.names if a in BATCH_AXES and mesh.axes[a] > 1):
        x = x.tensor_split(mesh.axes[a])[coord[mesh.axis_index(a)]]
    return x


def rank_batch_size(batch: int, mesh: Any, rank: int) -> int:
    """How many rows of a global batch of ``batch`` rows ``rank_batch`` gives ``rank``."""
    coord = mesh.coord(rank)
    for a in (a for a in mesh.names if a in BATCH_AXES and mesh.axes[a] > 1):
        batch = balanced_sizes(batch, mesh.axes[a])[coord[mesh.axis_index(a)]]
    return batch


def chunk_sizes(total: int, n: int) -> list[int]:
    """DTensor's (``torch.chunk``'s) piece sizes of a dim of ``total`` over ``n`` ranks."""
    ceil = -(-total // n)
    return [max(0, min(ceil, total - i * ceil)) for i in range(n)]


def balanced_sizes(total: int, n: int) -> list[int]:
    """``torch.tensor_split``'s piece sizes: the first ``total % n`` ranks hold one more."""
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def batch_sizes(total: int, n: int, batch: int | None) -> list[int]:
    """Piece sizes of a dp-sharded dim of ``total``: the batch's split scaled, else balanced."""
    if batch and total % batch == 0:
        return [s * (total // batch) for s in balanced_sizes(batch, n)]
    return balanced_sizes(total, n)


def chunk_size(total: int, n: int, index: int) -> int:
    """Rows rank ``index`` of ``n`` holds of a tp-sharded dim of ``total`` (DTensor's split)."""
    return chunk_sizes(total, n)[index]


@dataclass(frozen=True)
class Splitter:
    """Piece sizes of any dim over any axis of one mesh, for a program whose global batch is ``batch``
    (``None`` when nothing is batch-sharded)."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    batch: int | None = None
    seq: int | None = None  # the sequence length a cp axis splits load-balanced
    # (total, axis) -> its piece sizes: lowering asks for the same few dims at every node of every layer
    _sizes: dict[tuple[int, int], tuple[int, ...]] = field(init=False, default_factory=dict, compare=False, repr=False)

    def balanced(self, total: int, ax: int) -> bool:
        """Whether a dim of ``total`` is split over axis ``ax`` in load-balanced chunk pairs (the cp sequence)."""
        return self.names[ax] == CONTEXT_AXIS and self.seq is not None and total == self.seq and self.shape[ax] > 1

    def indices(self, total: int, ax: int, index: int) -> list[int]:
        """The positions rank ``index`` holds of a dim of ``total`` split over axis ``ax``, in its local order."""
        if not self.balanced(total, ax):
            start, size = self.piece(total, ax, index)
            return list(range(start, start + size))
        n = self.shape[ax]
        c = total // (2 * n)
        return [*range(index * c, (index + 1) * c), *range((2 * n - 1 - index) * c, (2 * n - index) * c)]

    def sizes(self, total: int, ax: int) -> list[int]:
        known = self._sizes.get((total, ax))
        if known is None:
            known = self._sizes[total, ax] = tuple(self._piece_sizes(total, ax))
        return list(known)

    def _piece_sizes(self, total: int, ax: int) -> list[int]:
        n = self.shape[ax]
        if self.names[ax] == BATCH_AXIS and self.batch and total % self.batch == 0:
            return batch_sizes(total, n, self.batch)  # a multiple of the batch: even only if dp divides the batch
        if total % n == 0:
            return [total // n] * n
        if self.names[ax] == BATCH_AXIS and not self.batch_even(n):
            return balanced_sizes(total, n)
        return chunk_sizes(total, n)  # a model axis; or a ZeRO parameter shard over dp (see ``batch_even``)

    def batch_even(self, n: int) -> bool:
        """Whether dp (of ``n`` ranks) divides the known global batch. Then every batch-derived dim dp shards is a
        multiple of dp, and a dim dp does not divide can only be a parameter's ZeRO shard (or a value computed
        from one), split as DTensor splits it (``torch.chunk``)."""
        return self.batch is not None and self.batch % n == 0

    def piece(self, total: int, ax: int, index: int) -> tuple[int, int]:
        """(start, length) of rank ``index``'s piece of a dim of ``total`` split over axis ``ax`` (contiguous splits
        only: see ``balanced``)."""
        assert not self.balanced(total, ax), "a load-balanced cp piece is not contiguous: use indices()"
        sizes = self.sizes(total, ax)
        return sum(sizes[:index]), sizes[index]

    def local_shape(self, shape: torch.Size | tuple[int, ...], placements: Any, coord: tuple[int, ...]) -> list[int]:
        """The shape rank ``coord`` holds of a value of global ``shape`` placed as ``placements``."""
        out = list(shape)
        for ax, p in enumerate(placements):
            if isinstance(p, Shard):
                sizes = self.sizes(out[p.dim], ax)
                # even pieces: every coordinate holds the same (not reading it keeps ranks in one role, fxpar.roles)
                out[p.dim] = sizes[0] if sizes[0] == sizes[-1] else sizes[coord[ax]]
        return out

    def is_even(self, shape: torch.Size | tuple[int, ...], placements: Any) -> bool:
        """Whether every rank holds the same shape of this value."""
        return all(not isinstance(p, Shard) or len(set(self.sizes(shape[p.dim], ax))) == 1
                   for ax, p in enumerate(placements))


def sequence_length(prog: Any) -> int | None:
    """The sequence a cp axis splits (None without cp): ``notes["sequence"]`` where the compiler recorded it (dim 1
    of the first user input, for every pipeline stage), else dim 1 of the program's first input of two dims."""
    if prog.mesh.axes.get(CONTEXT_AXIS, 1) == 1:
        return None
    if "sequence" in prog.notes:
        return prog.notes["sequence"]
    for name in prog.signature.inputs:
        val = prog.node(name).meta.get("val")
        if isinstance(val, torch.Tensor) and val.ndim >= 2:
            return val.shape[1]
    return None


def splitter(prog: Any) -> Splitter:
    """The ``Splitter`` of a Program: its mesh, the global batch (dim 0 of its first dp-sharded input) and the
    sequence a cp axis splits."""
    mesh = prog.mesh
    batch = None
    if BATCH_AXIS in mesh.names:
        ax = mesh.axis_index(BATCH_AXIS)
        for name in prog.signature.inputs:
            p = prog.placements.get(name)
            if p is not None and p[ax] == Shard(0):
                batch = prog.node(name).meta["val"].shape[0]
                break
    return Splitter(mesh.names, mesh.shape, batch, sequence_length(prog))


def dp_share(split: Splitter, index: int, mesh: Any) -> float:
    """The weight of dp rank ``index``'s batch-mean loss in the global one: ``b_index / B`` (``1 / dp`` when
    dp divides the batch)."""
    n = mesh.axes.get(BATCH_AXIS, 1)
    if split.batch is None or split.batch % n == 0:
        return 1 / n
    return balanced_sizes(split.batch, n)[index] / split.batch


def batch_weight(split: Splitter, index: int, mesh: Any) -> float:
    """``dp * b_index / B``: how much dp rank ``index``'s batch-mean loss weighs against ``1 / dp`` (1 when dp
    divides the batch)."""
    n = mesh.axes.get(BATCH_AXIS, 1)
    share = dp_share(split, index, mesh)
    return 1.0 if share == 1 / n else share * n
