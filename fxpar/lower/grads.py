"""Lowering's once-per-step collectives of parameters and gradients (a mixin of ``fxpar.lower.retrace.Lowerer``).

``gather_params``: ZeRO-1/2's all-gather of the dp-sharded parameters before a step. ``reduce_grads``: the batch
axes' gradient reductions (dp, and ep for dense parameters) deferred out of the backward so that microbatches'
gradients are summed first, then all-reduced in the overlap pass's buckets (or reduce-scattered under ZeRO), in the
plan's ``reduce_dtype`` when it has one (cast there, and back to the gradient's dtype after).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from fxpar.ir import Placements, Step, py_name
from fxpar.split import BATCH_AXES, BATCH_AXIS

aten = torch.ops.aten
_CHECKS = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}  # dropped by lowering: not reads
c10d = torch.ops._c10d_functional


def without_batch_reductions(axis_index: Any, dst: Placements, steps: tuple[Step, ...]
                             ) -> tuple[Placements, tuple[Step, ...]]:
    """``dst`` and ``steps`` of a parameter gradient less its batch-axis all-reduces (deferred to once a step)."""
    batch = [st for st in steps if st.axis in BATCH_AXES and st.op == "all_reduce"]
    placed = list(dst)
    for st in batch:
        placed[axis_index(st.axis)] = st.src
    return tuple(placed), tuple(st for st in steps if st not in batch)


class StepCollectives:
    """The methods ``_Lowerer`` uses for ``gather_params`` and ``reduce_grads`` (state lives on the lowerer)."""

    def _zero_params(self) -> list[tuple[str, str]]:
        """(fqn, graph name) of each dp-sharded parameter, once per fqn (a tied weight can appear twice)."""
        first: dict[str, str] = {}
        for fqn, name in self.prog.signature.params:
            if fqn in self.zero:
                first.setdefault(fqn, name)
        return list(first.items())

    def gather_params_graph(self) -> fx.Graph | None:
        """``gather_params(shard...)``: ZeRO's once-per-step all-gather of the dp-sharded parameters (fqn order), in
        flat buckets; under mixed precision a parameter only ever read through its cast to ``param_dtype`` is cast on
        its shard, gathered and kept in ``param_dtype`` (FSDP2's bytes on the wire and 2 bytes per parameter while
        gathered): the graphs read that working copy where they cast the parameter (``working_copy_dtype``)."""
        if not self.zero or self.zero3:
            return None
        with self.into(fx.Graph(), phase="fwd") as graph:
            dp = self.mesh.axes["dp"]
            shards = {}
            for fqn, name in self._zero_params():
                val = self.prog.node(name).meta["val"]
                shape = self.split.local_shape(val.shape, self.prog.placements[name], self.coord)
                shape[self.zero[fqn]] = self.zero_rows(shape[self.zero[fqn]])
                shards[fqn] = ph = self.graph.placeholder(f"shard_{py_name(fqn)}")
                with self.fake:
                    ph.meta["val"] = torch.empty(shape, dtype=val.dtype)
            results = {}
            compute = self.prog.notes.get("mixed_precision", (None, None))[0]
            for whole in self.zero_buckets(list(shards)):
                cast_only = [fqn for fqn in whole if compute is not None and self._read_only_as(fqn, compute)]
                for bucket in (cast_only, [fqn for fqn in whole if fqn not in cast_only]):
                    moved = {fqn: self._cast(shards[fqn], compute, fqn) if fqn in cast_only else shards[fqn]
                             for fqn in bucket}
                    if len(bucket) == 1:
                        fqn = bucket[0]
                        results[fqn] = self.gather(moved[fqn], self.zero[fqn], dp, self.group("dp"), "dp", None,
                                                   fqn, contiguous=True, total=self.zero_total(fqn))
                    elif bucket:
                        results.update(self.gather_bucket(list(moved.items())))
            self.graph.output(tuple(results[fqn] for fqn in shards))
        return graph

    def working_copy_dtype(self, name: str) -> torch.dtype | None:
        """ZeRO-1/2 under mixed precision: ``param_dtype`` for a parameter placeholder whose every read is its cast to
        it (its working copy is gathered in that dtype, and the graphs read it in place of the cast), else None."""
        compute = self.prog.notes.get("mixed_precision", (None, None))[0]
        fqn = self.param_fqn.get(name)
        if compute is None or self.zero3 or fqn not in self.zero or not self._read_only_as(fqn, compute):
            return None
        return compute

    def is_working_copy_cast(self, node: fx.Node, plan: dict) -> bool:
        """Whether ``node`` casts a parameter to the dtype its working copy already has, with no redistribution in
        between: it lowers to the working copy itself (the values are the same: the copy was cast on the shard)."""
        src = node.args[0] if node.target is aten._to_copy.default and node.args else None
        return (isinstance(src, fx.Node) and src.op == "placeholder" and plan.get((node.name, 0)) is None
                and set(node.kwargs) == {"dtype"} and self.working_copy_dtype(src.name) is node.kwargs["dtype"])

    def _read_only_as(self, fqn: str, dtype: torch.dtype) -> bool:
        """Mixed precision: whether every read of parameter ``fqn`` in the step is its cast to ``dtype`` (then its
        working copy may be cast on its shard, gathered and kept in ``dtype``: the casts read the same values)."""
        names = [name for f, name in self.prog.signature.params if f == fqn]
        users = [u for name in names for u in self.prog.node(name).users if u.target not in _CHECKS]
        return bool(users) and all(u.target is aten._to_copy.default and u.kwargs.get("dtype") is dtype
                                   and set(u.kwargs) == {"dtype"} for u in users)

    def defer_dp_reduction(self, pos: int, producer: str, dst: Placements, steps: tuple[Step, ...]
                           ) -> tuple[Placements, tuple[Step, ...]]:
        """Keep a parameter gradient partial over the batch axes (dp, and ep for dense parameters): it is summed
        over microbatches, then reduced once per step.

        Partial sums commute with the other axes' steps, so deferring the batch all-reduces is exact.
        """
        batch = [st for st in steps if st.axis in BATCH_AXES and st.op == "all_reduce"]
        if not batch:
            return dst, steps
        self.deferred.append((pos, self.grad_fqn[pos], self.prog.node(producer)))
        self.deferred_axes[self.grad_fqn[pos]] = tuple(st.axis for st in batch)
        return without_batch_reductions(self.mesh.axis_index, dst, steps)

    def gradient_reductions_in_place(self, plan: dict) -> dict[str, list[tuple[Placements, tuple[Step, ...]]]]:
        """By producer: each parameter gradient's steps that run inside the backward (all but the deferred batch
        reductions: a norm weight's tp all-reduce under sequence parallelism). ``run`` issues them as soon as the
        gradient is computed, where the output would issue them only after the whole backward: the dp buckets
        holding that gradient would wait for them, and each tp collective would queue behind every one before it."""
        out: dict[str, list[tuple[Placements, tuple[Step, ...]]]] = {}
        output = self.prog.graph.output_node()
        for pos in self.grad_fqn:
            planned = plan.get((output.name, pos))
            if planned is None:
                continue
            producer, dst, steps = planned
            dst, steps = without_batch_reductions(self.mesh.axis_index, dst, steps)
            if steps and self.prog.node(producer).op == "call_function":
                out.setdefault(producer, []).append((dst, steps))
        return out

    def own_zero_shard(self, pos: int, grad: fx.Node) -> fx.Node:
        """A ZeRO parameter's gradient that is already whole over dp (computed on every rank from gathered values,
        so no reduction is deferred): this rank keeps its shard, as a reduce-scatter would have left it."""
        fqn = self.grad_fqn.get(pos)
        if fqn not in self.zero:
            return grad
        d = self.zero[fqn]
        piece = self.own_piece(grad, d, BATCH_AXIS, None, fqn)
        return self.emit(aten.clone.default, (piece,), {"memory_format": torch.contiguous_format}, module=fqn) \
            if d else piece

    def reduce_grads_graph(self, backward: fx.GraphModule) -> fx.Graph | None:
        """``reduce_grads(g...)``: the deferred dp all-reduces of accumulated gradients, in backward output order."""
        if not self.deferred:
            return None
        with self.into(fx.Graph(), phase="bwd") as graph:
            outs = backward.graph.output_node().args[0]
            num_outputs = self.prog.signature.num_outputs
            placeholders = {}
            for pos, fqn, _ in self.deferred:
                placeholders[fqn] = ph = self.graph.placeholder(f"grad_{fqn.replace('.', '_')}")
                ph.meta.update(outs[pos - num_outputs].meta)
            results = {fqn: self._in_reduce_dtype(ph, fqn) for fqn, ph in placeholders.items()}
            for axis in (a for a in self.mesh.names if a in BATCH_AXES):  # dp, then ep: each sums its own partial
                reduced = {fqn: results[fqn] for fqn in placeholders if axis in self.deferred_axes[fqn]}
                for bucket in self.buckets(reduced):
                    if bucket[0] not in self.zero or axis != "dp":  # (ep sums a ZeRO shard: an all-reduce of it)
                        results.update(self.all_reduce_bucket([(fqn, results[fqn]) for fqn in bucket], axis))
                    elif len(bucket) == 1:  # ZeRO: each rank keeps its parameter's shard
                        results[bucket[0]] = self.scatter(results[bucket[0]], self.zero[bucket[0]],
                                                          self.mesh.axes["dp"], self.group("dp"), "dp", None, bucket[0],
                                                          contiguous=True)
                    else:  # one flat reduce-scatter of the bucket (``fxpar.lower.flat``)
                        results.update(self.scatter_bucket([(fqn, results[fqn]) for fqn in bucket]))
            self.graph.output(tuple(self._cast(results[fqn], placeholders[fqn].meta["val"].dtype, fqn)
                                    for _, fqn, _ in self.deferred))
        return graph

    def _in_reduce_dtype(self, grad: fx.Node, fqn: str) -> fx.Node:
        """``grad`` cast to the plan's ``reduce_dtype`` (``notes["mixed_precision"]``), if it has another dtype."""
        reduce_dtype = self.prog.notes.get("mixed_precision", (None, None))[1]
        return grad if reduce_dtype is None else self._cast(grad, reduce_dtype, fqn)

    def _cast(self, x: fx.Node, dtype: torch.dtype, fqn: str) -> fx.Node:
        if x.meta["val"].dtype == dtype:
            return x
        return self.emit(aten._to_copy.default, (x,), {"dtype": dtype}, module=fqn)

    def buckets(self, placeholders: dict[str, fx.Node]) -> list[list[str]]:
        """The gradients this graph reduces, one collective per list: the overlap pass's buckets of ZeRO shards
        (reduce-scattered), then of all-reduced ones (without it, one collective per gradient, in order)."""
        planned = self.prog.notes.get("overlap", {}).get("buckets")
        if planned is None:
            return [[fqn] for fqn in placeholders]
        return self.zero_buckets([fqn for fqn in placeholders if fqn in self.zero]) + [
            kept for bucket in planned if (kept := [fqn for fqn in bucket if fqn in placeholders])]

    def all_reduce_bucket(self, grads: list[tuple[str, fx.Node]], axis: str = BATCH_AXIS) -> dict[str, fx.Node]:
        """One all-reduce over ``axis`` of the gradients ``grads`` (flattened into one buffer when more than one)."""
        if len(grads) == 1:
            fqn, ph = grads[0]
            y = self.emit(c10d.all_reduce.default, (ph, "sum", self.group(axis)), module=fqn,
                          name=f"{ph.name}_allreduce")
            self.record("all_reduce", axis, ph.meta["val"], y)
            return {fqn: self.emit(c10d.wait_tensor.default, (y,), module=fqn, name=f"{ph.name}_reduced")}
        module = f"bucket of {len(grads)}: {grads[0][0]} .. {grads[-1][0]}"
        flat = [self.emit(aten.reshape.default, (ph, [-1]), module=fqn) for fqn, ph in grads]
        buf = self.emit(aten.cat.default, (flat,), module=module)
        y = self.emit(c10d.all_reduce.default, (buf, "sum", self.group(axis)), module=module,
                      name=f"bucket_{grads[0][1].name}_allreduce")
        self.record("all_reduce", axis, buf.meta["val"], y)
        reduced = self.emit(c10d.wait_tensor.default, (y,), module=module, name=f"bucket_{grads[0][1].name}_reduced")
        out, start = {}, 0
        for fqn, ph in grads:
            n = ph.meta["val"].numel()
            piece = self.emit(aten.slice.Tensor, (reduced, 0, start, start + n), module=fqn)
            out[fqn] = self.emit(aten.view.default, (piece, list(ph.meta["val"].shape)), module=fqn)
            start += n
        return out
