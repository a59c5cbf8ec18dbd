"""ZeRO shards and flat buckets (a mixin of ``fxpar.lower.retrace.Lowerer``): one collective per bucket of dp shards.

``zero3_shard`` makes a ZeRO-3 parameter's placeholder its dp shard, gathered lazily where it is first read.

ZeRO-1/2's once-per-step ``gather_params`` and every ZeRO level's gradient reduce-scatter move one flat buffer per
bucket; under ZeRO-3 the first use of any parameter of a bucket gathers the whole bucket (in the forward, and again
where the backward reads one). Under mixed precision the bucket's casts (each run on its shard by the
``mixed_precision`` pass) are lowered together where the first is read whole, and their values gathered in one flat
``param_dtype`` buffer; fp8 weights are gathered one by one, as float8.

FSDP2 gathers and reduce-scatters one flat buffer per parameter group; so does fxpar per ``zero_buckets`` bucket
(``passes/overlap.py``: backward order, cut at ``bucket_mb`` and at every change of repeated block). Parameter ``p``
is sharded over dp on dim ``d``, so moving ``d`` to the front and viewing ``p`` as ``[n, k]`` (``n`` = dp, ``k`` =
its shard's elements) puts rank ``r``'s shard in row ``r``; a dim dp does not divide (DTensor's uneven split,
``fxpar.split``) is first padded with zero rows to ``n`` pieces of its largest, so every row has one size. A
bucket is the row-wise concatenation ``[n, sum k]``: rank ``r``'s row is its shards back to back, the layout both
``all_gather_into_tensor`` (of the rows) and ``reduce_scatter_tensor`` (into them) work on.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxpar.ir import Placements, Step
from fxpar.passes.overlap import block_units

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class FlatBuckets:
    """The methods ``Lowerer`` uses for flat ZeRO buckets (state lives on the lowerer)."""

    @functools.cached_property
    def zero_units(self) -> dict[str, str]:
        """Each parameter's ZeRO group (``fxpar.passes.overlap.block_units``), computed once per lowering."""
        return block_units([fqn for fqn, _ in self.prog.signature.params])

    def zero_total(self, fqn: str) -> int:
        """The size of ``fqn``'s ZeRO dim (no other axis shards it: global = tp-local)."""
        name = next(n for f, n in self.prog.signature.params if f == fqn)
        return self.prog.node(name).meta["val"].shape[self.zero[fqn]]

    def zero_sizes(self, total: int) -> list[int]:
        """Every dp rank's rows of a ZeRO dim of ``total`` (DTensor's split where dp does not divide it)."""
        return self.split.sizes(total, self.mesh.axis_index("dp"))

    def zero_rows(self, total: int) -> int:
        """This rank's rows of a ZeRO dim of ``total`` (its dp coordinate is read only where pieces differ)."""
        sizes = self.zero_sizes(total)
        return sizes[0] if len(set(sizes)) == 1 else sizes[self.coord[self.mesh.axis_index("dp")]]

    def zero_buckets(self, fqns: list[str]) -> list[list[str]]:
        """``fqns`` (ZeRO shards) as the overlap pass bucketed them; one per bucket otherwise (no overlap)."""
        planned = self.prog.notes.get("overlap", {}).get("zero_buckets")
        if not planned:
            return [[fqn] for fqn in fqns]
        wanted = set(fqns)
        out = [kept for bucket in planned if (kept := [fqn for fqn in bucket if fqn in wanted])]
        covered = {fqn for bucket in out for fqn in bucket}
        return out + [[fqn] for fqn in fqns if fqn not in covered]

    def zero3_bucket(self, fqn: str) -> list[str]:
        """ZeRO-3: the parameters gathered together with ``fqn`` in the forward (its bucket, less the weights cast on
        their shard and gathered as the cast value: ``notes["cast_gather"]``, ``notes["fp8_gather"]``)."""
        cast = {*self.prog.notes.get("cast_gather", ()), *self.prog.notes.get("fp8_gather", ())}
        if fqn in cast:
            return [fqn]
        plain = [f for f, _ in self._zero_params() if f not in cast]
        return next((b for b in self.zero_buckets(plain) if fqn in b), [fqn])

    def gathered_in_bucket(self, fqn: str, bucket: list[str]) -> fx.Node:
        """``fqn``'s gathered value; the first call gathers all of ``bucket`` (the others' lazy values then resolve
        to their pieces)."""
        names = dict(self._zero_params())
        if fqn not in self.bucket_gathered:
            pieces = self.gather_bucket([(f, self.shards[names[f]]) for f in bucket])
            for f, node in pieces.items():
                node.meta["placements"] = self.prog.placements[names[f]]
            self.bucket_gathered.update(pieces)
        return self.bucket_gathered[fqn]

    def cast_weights(self) -> dict[str, tuple[str, str]]:
        """ZeRO-3 under mixed precision: the cast node of each weight cast on its shard -> (fqn, placeholder), for
        weights with one placeholder read whose casts are placed alike (a tied table read by the embedding and the head
        is cast twice: one gather serves both)."""
        if self._cast_weights is None:
            self._cast_weights = {}
            dtype = self.prog.notes.get("mixed_precision", (None, None))[0]
            names: dict[str, list[str]] = {}
            for f, name in self.prog.signature.params:
                names.setdefault(f, []).append(name)
            for fqn in self.prog.notes.get("cast_gather", ()):
                read = [n for name in names[fqn] if (n := self.prog.node(name)).users]  # a tied table: one is read
                if len(read) != 1:
                    continue
                node = read[0]
                casts = [u for u in node.users if u.target is aten._to_copy.default and u.kwargs.get("dtype") is dtype]
                if casts and len({self.prog.placements[c.name] for c in casts}) == 1:
                    self._cast_weights.update((c.name, (fqn, node.name)) for c in casts)
        return self._cast_weights

    def gathered_cast(self, producer: str, dst: tuple, steps: tuple) -> fx.Node | None:
        """The dp all-gather of a ZeRO-3 weight's cast (``producer``), served from one flat all-gather of the casts
        of its whole bucket (emitted here, before their own place in the graph); None where that does not apply."""
        cached = self.cache.get((producer, dst))
        if cached is not None or producer not in self.cast_weights():
            return cached
        if len(steps) != 1 or steps[0].op != "all_gather" or steps[0].axis != "dp":
            return None
        fqn = self.cast_weights()[producer][0]
        casts_of: dict[str, list[str]] = {}
        for cast_name, (f, _) in self.cast_weights().items():
            casts_of.setdefault(f, []).append(cast_name)
        bucket = next((b for b in self.zero_buckets(list(casts_of)) if fqn in b), [fqn])
        if len(bucket) < 2 and len(casts_of[fqn]) < 2:
            return None
        ax = self.mesh.axis_index("dp")
        for f in bucket:
            first = self.prog.node(casts_of[f][0])
            if first.name not in self.env:  # lowered here, ahead of its place (``call`` then skips it)
                shard = self.shards[self.cast_weights()[first.name][1]]
                self.env[first.name] = self.emit(aten._to_copy.default, (shard,), dict(first.kwargs),
                                                 placements=self.prog.placements[first.name], module=f,
                                                 name=first.name)
            for other in casts_of[f][1:]:  # the same values: one cast, one gather
                self.env.setdefault(other, self.env[first.name])
        pieces = self.gather_bucket([(f, self.env[casts_of[f][0]]) for f in bucket])
        for f, piece in pieces.items():
            placed = list(self.prog.placements[casts_of[f][0]])
            placed[ax] = steps[0].dst
            piece.meta["placements"] = tuple(placed)
            for cast_name in casts_of[f]:
                self.cache[(cast_name, tuple(placed))] = piece
        return self.cache.get((producer, dst))

    def _bucket_name(self, fqns: list[str]) -> str:
        """The module a bucket's collective is attributed to: its block (``layers.3``), else what it holds."""
        if len(fqns) == 1:
            return fqns[0]
        blocks = {self.zero_units[fqn] for fqn in fqns}
        if len(blocks) == 1 and "" not in blocks:
            return blocks.pop()
        return f"bucket of {len(fqns)}: {fqns[0]} .. {fqns[-1]}"

    def _rows(self, x: fx.Node, d: int, n: int, module: str, rows: int | None = None) -> fx.Node:
        """``x`` with dim ``d`` moved to the front, padded with zero rows to ``rows`` there (uneven pieces: every
        rank's row of a bucket has one size), as ``[n, -1]`` (row ``r``: the piece rank ``r`` holds)."""
        x0 = self.emit(aten.movedim.int, (x, d, 0), module=module) if d else x
        if rows is not None and rows != x0.meta["val"].shape[0]:
            x0 = self._pad_rows(x0, rows, module)
        return self.emit(aten.reshape.default, (x0, [n, -1]), module=module)

    def _unrow(self, rows: fx.Node, start: int, like: list[int], d: int, module: str, keep: int | None = None
               ) -> fx.Node:
        """Columns ``start:`` of ``rows`` (``[m, total]``) as a tensor of shape ``like`` (dim ``d`` first, m rows
        of it stacked), its first ``keep`` rows (the padding of uneven pieces cut off), moved back to dim ``d`` and
        made contiguous."""
        k = 1
        for s in like[1:]:
            k *= s
        k *= like[0] // rows.meta["val"].shape[0]
        piece = self.emit(aten.slice.Tensor, (rows, 1, start, start + k), module=module)
        y = self.emit(aten.reshape.default, (piece, like), module=module)
        if keep is not None and keep != like[0]:
            y = self.emit(aten.slice.Tensor, (y, 0, 0, keep), module=module)
        if d:
            y = self.emit(aten.movedim.int, (y, 0, d), module=module)
        return self.emit(aten.clone.default, (y,), {"memory_format": torch.contiguous_format}, module=module)

    def scatter_bucket(self, grads: list[tuple[str, fx.Node]]) -> dict[str, fx.Node]:
        """One reduce-scatter over dp of the whole gradients ``grads``: each rank keeps its ZeRO shard of each (a
        dim dp does not divide is padded to ``dp`` pieces of its largest, and this rank's rows kept)."""
        n, fqns = self.mesh.axes["dp"], [fqn for fqn, _ in grads]
        module = self._bucket_name(fqns)
        rows = [self._rows(g, self.zero[fqn], n, fqn, n * max(self.zero_sizes(self.zero_total(fqn))))
                for fqn, g in grads]
        buf = self.emit(aten.cat.default, (rows, 1), module=module) if len(rows) > 1 else rows[0]
        y = self.emit(c10d.reduce_scatter_tensor.default, (buf, "sum", n, self.group("dp")), module=module,
                      name=f"bucket_{grads[0][1].name}_reducescatter")
        self.record("reduce_scatter", "dp", buf.meta["val"], y)
        mine = self.emit(c10d.wait_tensor.default, (y,), module=module, name=f"bucket_{grads[0][1].name}_scattered")
        out, start = {}, 0
        for (fqn, g), row in zip(grads, rows, strict=True):
            d, total = self.zero[fqn], self.zero_total(fqn)
            shape = list(g.meta["val"].shape)
            like = [max(self.zero_sizes(total)), *shape[:d], *shape[d + 1:]]
            out[fqn] = self._unrow(mine, start, like, d, fqn, keep=self.zero_rows(total))
            start += row.meta["val"].shape[1]
        return out

    def gather_bucket(self, shards: list[tuple[str, fx.Node]]) -> dict[str, fx.Node]:
        """One all-gather over dp of the ZeRO shards ``shards``: each parameter whole (tp-local), contiguous (an
        uneven shard is padded to the largest piece, and the padding cut off after)."""
        n, fqns = self.mesh.axes["dp"], [fqn for fqn, _ in shards]
        module = self._bucket_name(fqns)
        rows = [self._rows(s, self.zero[fqn], 1, fqn, max(self.zero_sizes(self.zero_total(fqn))))
                for fqn, s in shards]
        buf = self.emit(aten.cat.default, (rows, 1), module=module) if len(rows) > 1 else rows[0]
        c = self.emit(c10d.all_gather_into_tensor.default, (buf, n, self.group("dp")), module=module,
                      name=f"bucket_{shards[0][1].name}_allgather")
        gathered = self.emit(c10d.wait_tensor.default, (c,), module=module, name=f"bucket_{shards[0][1].name}_gathered")
        self.record("all_gather", "dp", gathered.meta["val"], c)
        out, start = {}, 0
        for (fqn, s), row in zip(shards, rows, strict=True):
            d, total = self.zero[fqn], self.zero_total(fqn)
            shape = list(s.meta["val"].shape)
            like = [n * max(self.zero_sizes(total)), *shape[:d], *shape[d + 1:]]
            out[fqn] = self._unrow(gathered, start, like, d, fqn, keep=total)
            start += row.meta["val"].shape[1]
        return out

    def zero3_shard(self, name: str, ph: fx.Node) -> None:
        """ZeRO-3: the placeholder takes this rank's dp shard; its all-gather is emitted at the first use.

        A tied weight's second placeholder uses the first one's gathered value. With overlap's ``zero_buckets``, the
        first use of any parameter of a bucket gathers the whole bucket at once (FSDP2's group per block).
        """
        fqn = self.param_fqn[name]
        first = next(n for f, n in self.prog.signature.params if f == fqn)
        del self.env[name]
        if first != name:
            self.env.lazy[name] = lambda: self.env[first]
            self.shards[name] = self.shards[first]
            return
        self.shards[name] = ph
        d, dp = self.zero[fqn], self.mesh.axes["dp"]
        full = ph.meta["val"]
        shape = list(full.shape)
        shape[d] = self.zero_rows(shape[d])
        with self.fake:
            ph.meta["val"] = torch.empty(shape, dtype=full.dtype, device=full.device)
        placements = list(ph.meta["placements"])
        placements[self.mesh.axis_index("dp")] = Shard(d)
        ph.meta.update(placements=tuple(placements), zero3_shard=True)
        after = self.prog.placements[name]
        bucket = self.zero3_bucket(fqn)
        if len(bucket) > 1:  # the first use gathers the whole bucket in one flat all-gather (``fxpar.lower.flat``)
            self.env.lazy[name] = lambda: self.gathered_in_bucket(fqn, bucket)
        else:
            self.env.lazy[name] = lambda: self.gather(ph, d, dp, self.group("dp"), "dp", after, fqn, contiguous=True,
                                                      total=full.shape[d])

    def is_own_shard(self, producer: str, dst: Placements, steps: tuple[Step, ...]) -> bool:
        """Whether ``producer`` is a ZeRO-3 parameter asked for as exactly the dp shard it is stored as."""
        if producer not in self.shards:
            return False
        d = self.zero[self.param_fqn[producer]]
        return steps == (Step("slice", "dp", Replicate(), Shard(d)),)
