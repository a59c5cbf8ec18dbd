"""lower: interpret the annotated global program for one rank and retrace local ops.

Each global node becomes the same aten op on local shards (shape arguments rewritten to local
shapes); each planned placement change becomes ``torch.ops._c10d_functional`` collectives
with separate ``wait_tensor`` nodes. The result is one per-rank joint graph, then split into
a forward graph and a backward graph. Collectives name their group symbolically
(``"tp[2,3]"``); backends bind those names to process groups.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Replicate, Shard

from fxpar.ir import Placements, Program, Step, consumed_tensors, py_name
from fxpar.lower_context import CAUSAL_ATTENTION, ContextMask
from fxpar.lower_experts import EXPERT_AXIS, ExpertLowering
from fxpar.lower_grads import StepCollectives
from fxpar.overlap import inline_reduction, overlap
from fxpar.rules.experts import EXPERT_OPS
from fxpar.split import BATCH_AXIS, dp_share, splitter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
DROPPED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}
SHAPE_ARG = {
    aten.view.default: 1, aten._unsafe_view.default: 1, aten.reshape.default: 1, aten.expand.default: 1,
    aten.new_empty.default: 1, aten.new_zeros.default: 1, aten.new_ones.default: 1, aten.new_full.default: 1,
    aten.slice_backward.default: 1, aten.select_backward.default: 1,
    aten.empty.memory_format: 0, aten.zeros.default: 0, aten.ones.default: 0, aten.full.default: 0,
}
ARANGES = {aten.arange.default: 0, aten.arange.start: 1, aten.arange.start_step: 1}  # index of ``end``
SQUEEZES = {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
VIEWS = {aten.view.default, aten._unsafe_view.default}
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}


@dataclass(frozen=True)
class LedgerRow:
    """One collective (or point-to-point transfer) a rank issues. ``bytes`` is the full tensor it
    reduces or produces (for ``send``/``recv``: the tensor transferred)."""

    phase: str
    op: str
    axis: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes: int
    group: tuple[int, ...]
    stage: int = 0
    mb: int | None = None  # microbatch, in a step ledger; None for once-per-step collectives
    peer: int | None = None  # the other rank of a send/recv


@dataclass
class RankProgram:
    """One rank's lowered program: the joint graph, its forward/backward split, and the ledger."""

    rank: int
    coord: tuple[int, ...]
    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: list[str]
    ledger: list[LedgerRow] = field(default_factory=list)
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # symbolic name -> ranks
    # dp gradient reductions, deferred to once per step: backward output index -> parameter fqn, and the
    # graph that reduces those accumulated gradients (``None`` when there are none)
    deferred: list[tuple[int, str]] = field(default_factory=list)
    reduce_grads: fx.GraphModule | None = None
    stage: int = 0
    # ZeRO: parameters stored as dp shards (fqn -> shard dim), the graph that all-gathers them once per
    # step (shards in, this rank's tp-local parameters out, in ``zero`` order) and its ledger rows
    zero: dict[str, int] = field(default_factory=dict)
    gather_params: fx.GraphModule | None = None
    gather_ledger: list[LedgerRow] = field(default_factory=list)


def group_name(axis: str, ranks: list[int] | tuple[int, ...]) -> str:
    return f"{axis}[{','.join(map(str, ranks))}]"


class _LazyEnv(dict):
    """Local values by global node name. A ZeRO-3 parameter's gathered value is registered in ``lazy``
    and emitted where the walk first asks for it, so each all-gather sits right before its first use."""

    def __init__(self) -> None:
        super().__init__()
        self.lazy: dict[str, Any] = {}

    def __missing__(self, key: str) -> fx.Node:
        if key not in self.lazy:
            raise KeyError(key)
        value = self[key] = self.lazy.pop(key)()
        return value


class _Lowerer(StepCollectives, ContextMask):
    def __init__(self, prog: Program, rank: int) -> None:
        self.prog, self.rank, self.mesh = prog, rank, prog.mesh
        self.coord = self.mesh.coord(rank)
        self.split = splitter(prog)
        self.graph = fx.Graph()
        self.env = _LazyEnv()
        self.cache: dict[tuple[str, Placements], fx.Node] = {}
        self.ledger: list[LedgerRow] = []
        self.groups: dict[str, tuple[int, ...]] = {}
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.constants: dict[str, torch.Tensor] = {}
        self.phase = "fwd"
        self.source = ""
        stage = prog.notes.get("stage")
        # tangents of the model's own outputs (not of a stage boundary) are divided by dp: see placeholder()
        self.loss_outputs = stage is None or stage.index == stage.n_stages - 1
        sig = prog.signature
        self.grad_fqn = {idx: fqn for fqn, idx in sig.grads}
        self.deferred: list[tuple[int, str, fx.Node]] = []
        self.deferred_axes: dict[str, tuple[str, ...]] = {}  # the batch axes each deferred gradient is reduced over
        # a tied weight can appear as two placeholders; the second keeps its graph name
        self.local_names: dict[str, str] = {}
        for fqn, name in (*sig.params, *sig.buffers):
            if py_name(fqn) not in self.local_names.values():
                self.local_names[name] = py_name(fqn)
        self.local_names.update({name: f"input_{i}" for i, name in enumerate(sig.inputs)})
        self.zero: dict[str, int] = prog.notes.get("zero", {})
        self.zero3 = prog.notes.get("zero_level", 0) == 3
        self.param_fqn = {name: fqn for fqn, name in sig.params}
        self.shards: dict[str, fx.Node] = {}  # ZeRO-3: each parameter's dp-shard placeholder, by graph name
        self.gather_rows: list[LedgerRow] = []
        self.recompute: frozenset[str] = prog.notes.get("recompute", frozenset())
        self.recomputing = False  # lowering a node the backward recomputes: mark everything emitted for it
        self.for_node = ""  # the global node being lowered (the recompute budget measures trials by it)
        self.experts = ExpertLowering(self) if self.mesh.axes.get(EXPERT_AXIS, 1) > 1 else None

    # -- emission helpers -------------------------------------------------------------------
    def emit(self, target: Any, args: tuple, kwargs: dict | None = None, placements: Any = None,
             module: str = "", name: str | None = None) -> fx.Node:
        kwargs = kwargs or {}
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        vals = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
        with self.fake:
            node.meta["val"] = target(*vals[0], **vals[1])
        node.meta.update(placements=placements, module=module, phase=self.phase, source=self.source)
        node.meta["for_node"] = self.for_node
        if self.recomputing:
            node.meta["recompute"] = True
        return node

    def group(self, axis: str) -> str:
        ranks = tuple(self.mesh.group_ranks(self.rank, axis))
        name = group_name(axis, ranks)
        self.groups[name] = ranks
        return name

    def record(self, op: str, axis: str, val: torch.Tensor, node: fx.Node) -> None:
        """Add a ledger row for the collective ``node`` (kept in its meta: a recomputed copy re-issues it)."""
        ranks = tuple(self.mesh.group_ranks(self.rank, axis))
        row = LedgerRow(self.phase, op, axis, tuple(val.shape), val.dtype, val.numel() * val.element_size(), ranks)
        self.ledger.append(row)
        node.meta["ledger_row"] = row

    # -- redistribution ------------------------------------------------------------------
    def redistribute(self, producer: str, dst: Placements, steps: tuple[Step, ...], module: str) -> fx.Node:
        key = (producer, dst)
        if key not in self.cache:
            x = self.env[producer]
            current = list(self.prog.placements[producer])
            for step in steps:
                current[self.mesh.axis_index(step.axis)] = step.dst
                x = self.apply_step(x, step, tuple(current), module, self.prog.node(producer).meta["val"])
            self.cache[key] = self.restore_layout(x, self.prog.node(producer).meta["val"], dst, module)
        return self.cache[key]

    def restore_layout(self, x: fx.Node, like: torch.Tensor, placements: Placements, module: str) -> fx.Node:
        """``x`` laid out in the dim order of the global value ``like``.

        A gather along dim d returns the collective's buffer moved back by ``movedim``, so its
        memory order differs from the global tensor's; kernels called below the dispatcher (the
        CPU flash-attention kernel reads the last dim as contiguous) assume the traced layout.
        A slice of a contiguous value on a dim other than the first is not contiguous either, and
        ``native_layer_norm_backward`` reads its ``mean``/``rstd`` as if it were: a value traced
        contiguous is made contiguous again.
        """
        val = x.meta["val"]
        big = [i for i in range(val.ndim) if val.shape[i] > 1 and like.shape[i] > 1]
        order = stride_order(like)
        same_order = [i for i in stride_order(val) if i in big] == [i for i in order if i in big]
        if same_order and (val.is_contiguous() or not like.is_contiguous()):
            return x
        contiguous = {"memory_format": torch.contiguous_format}
        if order == list(range(like.ndim)):
            return self.emit(aten.clone.default, (x,), contiguous, placements=placements, module=module)
        y = self.emit(aten.permute.default, (x, order), module=module)
        y = self.emit(aten.clone.default, (y,), contiguous, module=module)
        inverse = [order.index(i) for i in range(like.ndim)]
        return self.emit(aten.permute.default, (y, inverse), placements=placements, module=module)

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
                contiguous: bool = False, zero_shard: bool = False) -> fx.Node:
        """Reduce-scatter ``x`` (a partial sum) over ``axis``, keeping this rank's slice of dim ``d``.

        Uneven pieces are laid out as ``n`` pieces padded with zero rows to one size; this rank then keeps
        its own rows of its piece. A ZeRO gradient shard (``zero_shard``) is split evenly: ZeRO shards a
        parameter only on a dim dp divides.
        """
        total = x.meta["val"].shape[d]
        even = ([total // n] * n, [i * (total // n) for i in range(n)], total // n, True)
        sizes, starts, ceil, tail_padded = even if zero_shard else self._pieces(total, axis)
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
        mine = sizes[self.coord[self.mesh.axis_index(axis)]]
        if mine != ceil:
            y = self.emit(aten.slice.Tensor, (y, 0, 0, mine), placements=after, module=module)
        return self._moved_back(y, d, after, module, contiguous)

    def gather(self, x: fx.Node, d: int, n: int, g: str, axis: str, after: Any, module: str,
               contiguous: bool = False, total: int | None = None) -> fx.Node:
        """All-gather ``x`` over ``axis`` along dim ``d``. When the pieces of ``total`` (the gathered size) differ
        in size, each is padded to the largest and the padding is cut out after."""
        sizes, _, ceil, tail_padded = self._pieces(total, axis) if total is not None else ([], [], 0, True)
        uneven = len(set(sizes)) > 1
        x0 = self.emit(aten.movedim.int, (x, d, 0), module=module) if d else x
        x0 = self.emit(aten.clone.default, (x0,), {"memory_format": torch.contiguous_format}, module=module)
        if uneven:
            x0 = self._pad_rows(x0, ceil, module)
        dtype = x0.meta["val"].dtype
        if dtype in FLOAT8:  # gloo has no float8 type: the bytes move as uint8
            x0 = self.emit(aten.view.dtype, (x0, torch.uint8), module=module)
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

    # -- the walk ---------------------------------------------------------------------------
    def run(self) -> fx.Graph:
        plan = self.prog.notes["redistribute"]
        for node in self.prog.graph.nodes:
            prov = self.prog.provenance.get(node.name)
            self.phase = prov.phase if prov else "fwd"
            if node.op == "placeholder":
                self.placeholder(node)
            elif node.op == "get_attr":
                self.get_attr(node)
            elif node.op == "call_function":
                self.source = prov.source if prov else ""
                self.call(node, plan, prov.module if prov else "")
            elif node.op == "output":
                self.output(node, plan)
        return self.graph

    def placeholder(self, node: fx.Node) -> None:
        is_tangent = node.name.startswith("tangents")
        self.phase = "bwd" if is_tangent else "fwd"
        p = self.prog.placements[node.name]
        val = node.meta["val"]
        new = self.graph.placeholder(self.local_names.get(node.name, node.name))
        with self.fake:
            shape = self.split.local_shape(val.shape, p, self.coord)
            new.meta["val"] = torch.empty(shape, dtype=val.dtype, device=val.device)
        new.meta.update(placements=p, module=self.prog.provenance[node.name].module, phase=self.phase)
        self.env[node.name] = new
        if self.zero3 and self.param_fqn.get(node.name) in self.zero:
            self.zero3_shard(node.name, new)
        n_dp, n_ep = self.batch_sharded(p, BATCH_AXIS), self.batch_sharded(p, EXPERT_AXIS)
        if is_tangent and n_dp * n_ep > 1 and self.loss_outputs:
            # Each dp rank differentiates its own local (batch-mean) loss; dividing the incoming gradient
            # by dp makes parameter gradients the mean over dp ranks, as DDP and FSDP do. With a batch dp
            # does not divide, rank r's loss is a mean over b_r of the B samples: its weight is b_r / B.
            # An ep axis shards the batch further (evenly: annotate refuses a batch dp x ep does not divide).
            share = dp_share(self.split, self.coord[self.mesh.axis_index(BATCH_AXIS)], self.mesh) if n_dp > 1 else 1
            share /= n_ep
            if share == 1 / (n_dp * n_ep):
                self.env[node.name] = self.emit(aten.div.Tensor, (new, n_dp * n_ep), placements=p,
                                                name=f"{node.name}_dp_mean")
            else:
                self.env[node.name] = self.emit(aten.mul.Tensor, (new, share), placements=p,
                                                name=f"{node.name}_dp_share")

    def batch_sharded(self, p: Placements, axis: str) -> int:
        """The size of ``axis`` if ``p`` shards a value over it (a batch axis), else 1."""
        n = self.mesh.axes.get(axis, 1)
        return n if n > 1 and isinstance(p[self.mesh.axis_index(axis)], Shard) else 1

    def zero3_shard(self, name: str, ph: fx.Node) -> None:
        """ZeRO-3: the placeholder takes this rank's dp shard; its all-gather is emitted at the first use.

        A tied weight's second placeholder uses the first one's gathered value.
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
        shape[d] //= dp
        with self.fake:
            ph.meta["val"] = torch.empty(shape, dtype=full.dtype, device=full.device)
        placements = list(ph.meta["placements"])
        placements[self.mesh.axis_index("dp")] = Shard(d)
        ph.meta.update(placements=tuple(placements), zero3_shard=True)
        after = self.prog.placements[name]
        self.env.lazy[name] = lambda: self.gather(ph, d, dp, self.group("dp"), "dp", after, fqn, contiguous=True)

    def get_attr(self, node: fx.Node) -> None:
        value = getattr(self.prog.gm, node.target)
        self.constants[node.target] = value
        new = self.graph.get_attr(node.target)
        new.meta.update(val=self.fake.from_tensor(value), placements=self.prog.placements[node.name], phase=self.phase,
                        module="")
        self.env[node.name] = new

    def call(self, node: fx.Node, plan: dict, module: str) -> None:
        if node.target in DROPPED:
            return
        placements = self.prog.placements.get(node.name)
        self.for_node = node.name
        if node.target is operator.getitem:
            src = self.env[node.args[0].name]
            self.recomputing = node.name in self.recompute
            self.env[node.name] = self.emit(operator.getitem, (src, node.args[1]), placements=placements,
                                            module=module, name=node.name)
            self.recomputing = False
            return
        # "selective" saves what a collective returns (as torchtitan does); "full" runs the collectives again
        self.recomputing = node.name in self.recompute and self.prog.notes.get("recompute_policy") != "selective"
        local_args = self.local_inputs(node, plan, module)
        self.recomputing = node.name in self.recompute
        args, kwargs = pytree.tree_map_only(fx.Node, lambda a: local_args[a.name], (node.args, node.kwargs))
        if node.target in EXPERT_OPS and self.experts is not None:
            self.env[node.name] = self.experts.lower(node, args, module)
            self.recomputing = False
            return
        target, args = self.localize(node, args, placements)
        if target in CAUSAL_ATTENTION:
            args, kwargs = self.causal_on_context(node, args, kwargs)
        self.env[node.name] = self.emit(target, args, kwargs, placements=placements, module=module, name=node.name)
        self.recomputing = False

    def is_own_shard(self, producer: str, dst: Placements, steps: tuple[Step, ...]) -> bool:
        """Whether ``producer`` is a ZeRO-3 parameter asked for as exactly the dp shard it is stored as."""
        if producer not in self.shards:
            return False
        d = self.zero[self.param_fqn[producer]]
        return steps == (Step("slice", "dp", Replicate(), Shard(d)),)

    def local_inputs(self, node: fx.Node, plan: dict, module: str) -> dict[str, fx.Node]:
        out: dict[str, fx.Node] = {}
        for pos, arg in enumerate(consumed_tensors(node)):
            planned = plan.get((node.name, pos))
            if planned is None:
                out[arg.name] = self.env[arg.name]
            elif self.is_own_shard(*planned):  # fp8_gather: a ZeRO-3 weight read as its dp shard
                out[arg.name] = self.shards[arg.name]
            else:
                producer, dst, steps = planned
                out[arg.name] = self.redistribute(producer, dst, steps, module)
        for a in pytree.tree_leaves((node.args, node.kwargs)):
            if isinstance(a, fx.Node) and a.name not in out:
                out[a.name] = self.env[a.name]
        return out

    def localize(self, node: fx.Node, args: tuple, placements: Any) -> tuple[Any, tuple]:
        """Rewrite global shape arguments to this rank's local shapes."""
        target = node.target
        if target in SHAPE_ARG and isinstance(placements, tuple) and any(isinstance(p, Shard) for p in placements):
            i = SHAPE_ARG[target]
            shape = self.split.local_shape(node.meta["val"].shape, placements, self.coord)
            args = (*args[:i], shape, *args[i + 1:])
        if target in ARANGES and isinstance(placements, tuple) and any(isinstance(p, Shard) for p in placements):
            # only inside a token-local region (fxpar.rules.token_local): this rank's own row indices
            i = ARANGES[target]
            assert i == 0 or args[0] == 0, "a sharded arange starts at 0"
            size = self.split.local_shape(node.meta["val"].shape, placements, self.coord)[0]
            args = (*args[:i], size, *args[i + 1:])
        if target in VIEWS:
            self.check_uneven_view(node, placements)
        if target in VIEWS and not _viewable(args[0].meta["val"], args[1], self.fake):
            # a layout that was viewable globally may not be locally (a gathered tensor is laid out
            # as the collective wrote it): the graph is functional, so a copying reshape is exact
            target = aten.reshape.default
        if target in SQUEEZES:
            shape = node.args[0].meta["val"].shape
            dims = [args[1]] if target is aten.squeeze.dim else (args[1] if len(args) > 1 else range(len(shape)))
            keep = [d for d in dims if shape[d] == 1]
            target, args = aten.squeeze.dims, (args[0], keep)
        return target, args

    def check_uneven_view(self, node: fx.Node, placements: Any) -> None:
        """Refuse a view whose uneven pieces would not line up on some rank of an axis (e.g. splitting a
        tp-sharded dim of 100 into 4 x 25 at tp=3): no local view computes the global one there."""
        src = node.args[0]
        src_p = (self.prog.arg_placements.get(node.name) or (None,))[0]  # as the view consumes it
        if not all(isinstance(p, tuple) and all(hasattr(q, "is_shard") for q in p) for p in (placements, src_p)):
            return
        out_val, in_val = node.meta["val"], src.meta["val"]
        if self.split.is_even(out_val.shape, placements) and self.split.is_even(in_val.shape, src_p):
            return
        for ax, n in enumerate(self.mesh.shape):
            for i in range(n):
                coord = (*self.coord[:ax], i, *self.coord[ax + 1:])
                have = math.prod(self.split.local_shape(in_val.shape, src_p, coord))
                want = math.prod(self.split.local_shape(out_val.shape, placements, coord))
                if have != want:
                    raise NotImplementedError(
                        f"{self.source or node.name}: viewing {tuple(in_val.shape)} as {tuple(out_val.shape)} "
                        f"with uneven pieces over {self.mesh.names[ax]!r} ({tuple(src_p)} -> {tuple(placements)}): "
                        f"rank {i} of that axis would hold {have} elements but need {want}; choose sizes the "
                        "axis divides, or replicate the module that makes this value")

    def output(self, node: fx.Node, plan: dict) -> None:
        num_outputs = self.prog.signature.num_outputs
        outs = []
        for pos, arg in enumerate(node.args[0]):
            self.phase = "fwd" if pos < num_outputs else "bwd"
            planned = plan.get((node.name, pos))
            if arg is None:
                outs.append(None)
            elif planned is not None:
                producer, dst, steps = planned
                if pos in self.grad_fqn:
                    dst, steps = self.defer_dp_reduction(pos, producer, dst, steps)
                outs.append(self.redistribute(producer, dst, steps, "") if steps else self.env[producer])
            else:
                outs.append(self.env[arg.name])
        self.graph.output(tuple(outs))



def stride_order(t: torch.Tensor) -> list[int]:
    """Dims from outermost to innermost in memory (ties, e.g. size-1 dims, by index)."""
    return sorted(range(t.ndim), key=lambda i: (-t.stride()[i], i))


def _viewable(x: torch.Tensor, shape: list[int], fake: FakeTensorMode) -> bool:
    """Whether ``x.view(shape)`` is valid for ``x``'s strides."""
    try:
        with fake:
            x.view(shape)
        return True
    except (RuntimeError, ValueError):
        return False


def lower(prog: Program, rank: int) -> RankProgram:
    """Lower ``prog`` for ``rank``: a local joint graph, split into forward and backward."""
    lowerer = _Lowerer(prog, rank)
    graph = lowerer.run()
    root = torch.nn.Module()
    for name, value in lowerer.constants.items():
        setattr(root, name, value)
    joint = fx.GraphModule(root, graph)
    fwd, bwd, saved = split_joint(joint, prog.signature.num_outputs, root)
    reduce_graph = lowerer.reduce_grads_graph(bwd)
    gather_graph = lowerer.gather_params_graph()
    settings = prog.notes.get("overlap")
    deferred = [(pos - prog.signature.num_outputs, fqn) for pos, fqn, _ in lowerer.deferred]
    if settings is not None:
        if settings["in_backward"] and reduce_graph is not None:  # bucket all-reduces issued inside the backward
            inline_reduction(bwd.graph, reduce_graph, [pos for pos, _ in deferred])
            reduce_graph, deferred = None, []
        one_per_group = prog.mesh.device == "cpu"  # gloo: see fxpar.overlap
        overlap(fwd.graph, one_per_group)
        overlap(bwd.graph, one_per_group)
        fwd.recompile()
        bwd.recompile()
    # the ledger in the order the graphs issue: forward, backward (recomputed collectives re-issued there), reduction
    lowerer.ledger = [*_rows(fwd.graph, "fwd"), *_rows(bwd.graph, "bwd"),
                      *(_rows(reduce_graph, "bwd") if reduce_graph is not None else [])]
    stage = prog.notes.get("stage")
    return RankProgram(rank, lowerer.coord, joint, fwd, bwd, saved, lowerer.ledger, lowerer.groups,
                       deferred=deferred,
                       reduce_grads=fx.GraphModule(root, reduce_graph) if reduce_graph is not None else None,
                       stage=stage.index if stage is not None else 0, zero=dict(lowerer.zero),
                       gather_params=fx.GraphModule(root, gather_graph) if gather_graph is not None else None,
                       gather_ledger=lowerer.gather_rows)


def _rows(graph: fx.Graph, phase: str) -> list[LedgerRow]:
    return [replace(n.meta["ledger_row"], phase=phase) for n in graph.nodes if "ledger_row" in n.meta]


def split_joint(joint: fx.GraphModule, num_outputs: int, root: torch.nn.Module
                ) -> tuple[fx.GraphModule, fx.GraphModule, list[str]]:
    """Forward graph: fwd-phase nodes, returning user outputs + saved values. Backward graph:
    saved values + tangents -> gradients.

    A forward value computed from ZeRO-3 parameter shards alone (their all-gather, a transpose of the
    gathered weight) is not saved: the backward recomputes it from the shards (FSDP's re-gather). So
    is every node the ``recompute`` pass chose (``meta["recompute"]``, with the collectives lowering
    emitted for it). Recomputed copies carry ``meta["recomputed"]``.
    """
    out_node = joint.graph.output_node()
    outs = out_node.args[0]
    fwd_g, bwd_g = fx.Graph(), fx.Graph()
    fenv: dict[fx.Node, fx.Node] = {}
    benv: dict[fx.Node, fx.Node] = {}
    saved: list[fx.Node] = []

    from_shards = from_zero3_shards(joint.graph) | {n for n in joint.graph.nodes if n.meta.get("recompute")}

    def bwd_arg(n: fx.Node) -> fx.Node:
        if n not in benv and n in from_shards:  # recompute it in the backward instead of saving it
            benv[n] = bwd_g.node_copy(n, bwd_arg)
            benv[n].meta.update(phase="bwd", recomputed=True)
        elif n not in benv:  # a forward value the backward needs: saved across the two graphs
            ph = bwd_g.placeholder(f"saved_{n.name}")
            ph.meta.update(n.meta)
            benv[n] = ph
            saved.append(n)
        return benv[n]

    for n in joint.graph.nodes:
        if n.op == "output":
            continue
        is_bwd = n.meta.get("phase") == "bwd"
        if not is_bwd:
            fenv[n] = fwd_g.node_copy(n, lambda a: fenv[a])
        else:
            benv[n] = bwd_g.node_copy(n, bwd_arg)
    # tangents first in the backward signature: move saved placeholders before them by order of use
    fwd_g.output((*[fenv[o] for o in outs[:num_outputs]], *[fenv[s] for s in saved]))
    bwd_g.output(tuple(None if o is None else (benv[o] if o in benv else bwd_arg(o)) for o in outs[num_outputs:]))
    _placeholders_first(bwd_g)
    return fx.GraphModule(root, fwd_g), fx.GraphModule(root, bwd_g), [s.name for s in saved]


def from_zero3_shards(graph: fx.Graph) -> set[fx.Node]:
    """Forward nodes computed from ZeRO-3 parameter shards alone (the shard placeholders excluded)."""
    shards = {n for n in graph.nodes if n.op == "placeholder" and n.meta.get("zero3_shard")}
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "call_function" and n.meta.get("phase") != "bwd" and n.all_input_nodes \
                and all(a in shards or a in derived for a in n.all_input_nodes):
            derived.add(n)
    return derived


def _placeholders_first(g: fx.Graph) -> None:
    phs = [n for n in g.nodes if n.op == "placeholder"]
    first = next(iter(g.nodes))
    for ph in phs:
        first.prepend(ph)
    saved = [p for p in phs if p.name.startswith("saved_")]
    tangents = [p for p in phs if not p.name.startswith("saved_")]
    anchor = next(iter(g.nodes))
    for ph in saved + tangents:
        anchor.append(ph) if ph is not anchor else None
        anchor = ph
