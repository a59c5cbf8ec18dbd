"""Retrace the annotated global program for one rank: its joint graph of local ops and collectives.

Each global node becomes the same aten op on local shards (shape arguments rewritten to local
shapes); each planned placement change becomes ``torch.ops._c10d_functional`` collectives
with separate ``wait_tensor`` nodes, each carrying its ledger row in ``meta["ledger_row"]``.
Collectives name their group symbolically (``"tp[2,3]"``); backends bind those names to
process groups. ``fxpar.lower`` turns the joint graph into what the rank runs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from fxpar.ir import Placements, Program, Step, consumed_tensors, fake_empty, graph_module, py_name
from fxpar.lower.collectives import CollectiveEmitter
from fxpar.lower.context import CAUSAL_ATTENTION, ContextMask
from fxpar.lower.emit import Site
from fxpar.lower.experts import EXPERT_AXIS, ExpertLowering
from fxpar.lower.flat import FlatBuckets
from fxpar.lower.grads import StepCollectives
from fxpar.lower.layout import TracedLayout
from fxpar.lower.program import RankProgram
from fxpar.lower.random_draws import WholeDraws, draws_numbers
from fxpar.lower.replay import LayerReplay
from fxpar.lower.shapes import LocalShapes, localize
from fxpar.mesh import Mesh
from fxpar.random_draws import DRAWS_ON_SHAPE, is_sharded
from fxpar.rules.experts import EXPERT_OPS
from fxpar.split import BATCH_AXIS, dp_share, splitter

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
DROPPED = {aten._assert_tensor_metadata.default, aten._assert_scalar.default}


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


class Lowerer(CollectiveEmitter, StepCollectives, FlatBuckets, ContextMask, WholeDraws, TracedLayout):
    """Retraces the global program for one rank (``retrace``) and builds its once-per-step graphs."""

    def __init__(self, prog: Program, rank: int) -> None:
        super().__init__(prog.mesh, rank, splitter(prog))
        self.prog = prog
        self.env = _LazyEnv()
        self.cache: dict[tuple[str, Placements], fx.Node] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self.root = torch.nn.Module()  # holds the constants every graph of the rank reads
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
        self.bucket_gathered: dict[str, fx.Node] = {}  # ZeRO-3: gathered parameters of the buckets gathered so far
        self._cast_weights: dict[str, tuple[str, str]] | None = None  # ZeRO-3 + mixed precision (``FlatBuckets``)
        self.recompute: frozenset[str] = prog.notes.get("recompute", frozenset())
        self.experts = ExpertLowering(self) if self.mesh.axes.get(EXPERT_AXIS, 1) > 1 else None
        self.planned = {name for name, _ in prog.notes.get("redistribute", {})}  # a placement change on an input
        self.replays = LayerReplay(self)  # a repeated layer's nodes lowered as their first copy was

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

    # -- the walk ---------------------------------------------------------------------------
    def retrace(self) -> RankProgram:
        """The rank's joint graph: every global node as local ops plus the collectives its placements need."""
        graph = self.run()
        for name, value in self.constants.items():
            setattr(self.root, name, value)
        stage = self.prog.notes.get("stage")
        return RankProgram(self.rank, self.coord, graph_module(self.root, graph), None, None, [],
                           groups=self.groups, stage=stage.index if stage is not None else 0, zero=dict(self.zero))

    def run(self) -> fx.Graph:
        """Lower every global node in order. The site's source line and global node are those of the last op
        lowered: placeholders and outputs keep them (and so do the once-per-step graphs built after the walk)."""
        plan = self.prog.notes["redistribute"]
        in_place = self.gradient_reductions_in_place(plan)
        last = Site()
        for node in self.prog.graph.nodes:
            prov = self.prog.provenance.get(node.name)
            if node.op == "call_function":
                last = Site(source=prov.source if prov else "",
                            for_node=last.for_node if node.target in DROPPED else node.name)
            with self.at_site(Site(phase=prov.phase if prov else "fwd", source=last.source, for_node=last.for_node)):
                if node.op == "placeholder":
                    self.placeholder(node)
                elif node.op == "get_attr":
                    self.get_attr(node)
                elif node.op == "call_function":
                    self.replays.call(node, plan, prov.module if prov else "", in_place)
                    for dst, steps in in_place.get(node.name, ()):
                        with self.at(phase="bwd"):
                            self.redistribute(node.name, dst, steps, "")
                elif node.op == "output":
                    self.output(node, plan)
        self.site = last
        return self.graph

    def placeholder(self, node: fx.Node) -> None:
        is_tangent = node.name.startswith("tangents")
        with self.at(phase="bwd" if is_tangent else "fwd"):
            self._placeholder(node, is_tangent)

    def _placeholder(self, node: fx.Node, is_tangent: bool) -> None:
        p = self.prog.placements[node.name]
        val = node.meta["val"]
        new = self.graph.placeholder(self.local_names.get(node.name, node.name))
        shape = self.split.local_shape(val.shape, p, self.coord)
        dtype = self.working_copy_dtype(node.name) or val.dtype  # ZeRO-1/2 mixed precision: gathered in it
        new.meta["val"] = fake_empty(self.fake, shape, None, dtype, val.device)
        new.meta.update(placements=p, module=self.prog.provenance[node.name].module, phase=self.site.phase)
        self.env[node.name] = new
        if self.zero3 and self.param_fqn.get(node.name) in self.zero:
            self.zero3_shard(node.name, new)
        n_dp, n_ep = batch_sharded(self.mesh, p, BATCH_AXIS), batch_sharded(self.mesh, p, EXPERT_AXIS)
        if is_tangent and n_dp * n_ep > 1 and self.loss_outputs:
            # Each dp rank differentiates its own local (batch-mean) loss; dividing the incoming gradient
            # by dp makes parameter gradients the mean over dp ranks, as DDP and FSDP do. With a batch dp
            # does not divide, rank r's loss is a mean over b_r of the B samples: its weight is b_r / B.
            # An ep axis shards the batch further (evenly: annotate refuses a batch dp x ep does not divide).
            even = self.split.batch is None or self.split.batch % n_dp == 0  # then the share reads no coordinate
            share = 1 / n_dp if even else dp_share(self.split, self.coord[self.mesh.axis_index(BATCH_AXIS)], self.mesh)
            share /= n_ep
            if share == 1 / (n_dp * n_ep):
                self.env[node.name] = self.emit(aten.div.Tensor, (new, n_dp * n_ep), placements=p,
                                                name=f"{node.name}_dp_mean")
            else:
                self.env[node.name] = self.emit(aten.mul.Tensor, (new, share), placements=p,
                                                name=f"{node.name}_dp_share")

    def get_attr(self, node: fx.Node) -> None:
        value = getattr(self.prog.gm, node.target)
        self.constants[node.target] = value
        new = self.graph.get_attr(node.target)
        new.meta.update(val=self.fake.from_tensor(value), placements=self.prog.placements[node.name],
                        phase=self.site.phase, module="")
        self.env[node.name] = new

    def call(self, node: fx.Node, plan: dict, module: str) -> None:
        if node.target in DROPPED or node.name in self.env:  # dropped, or lowered early (``FlatBuckets``)
            return
        if self.is_working_copy_cast(node, plan):
            self.env[node.name] = self.env[node.args[0].name]
            return
        placements = self.prog.placements.get(node.name)
        recompute = node.name in self.recompute
        if node.target is operator.getitem:
            src = self.env[node.args[0].name]
            if isinstance(src, tuple):  # a random op drawn whole (``draw_whole``)
                self.env[node.name] = src[node.args[1]]
                return
            with self.at(recompute=recompute):
                self.env[node.name] = self.emit(operator.getitem, (src, node.args[1]), placements=placements,
                                                module=module, name=node.name)
            return
        # "selective" saves what a collective returns (as torchtitan does); "full" runs the collectives again
        with self.at(recompute=recompute and self.prog.notes.get("recompute_policy") != "selective"):
            local_args = self.local_inputs(node, plan, module)
        args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: local_args[a.name])
        with self.at(recompute=recompute):
            if node.target in EXPERT_OPS and self.experts is not None:
                self.env[node.name] = self.experts.lower(node, args, module)
                return
            if node.target in DRAWS_ON_SHAPE and draws_numbers(node) and is_sharded(placements):
                self.env[node.name] = self.draw_whole(node, args, placements, module)
                return
            target, args = localize(node, args, placements, self.local_shapes())
            if target in CAUSAL_ATTENTION:
                args, kwargs = self.causal_on_context(node, args, kwargs)
            self.env[node.name] = self.emit(target, args, kwargs, placements=placements, module=module,
                                            name=node.name)

    def local_inputs(self, node: fx.Node, plan: dict, module: str) -> dict[str, fx.Node]:
        if node.name not in self.planned:  # most nodes: every input read as it is
            return {a.name: self.env[a.name] for a in node.all_input_nodes}
        out: dict[str, fx.Node] = {}
        for pos, arg in enumerate(consumed_tensors(node)):
            planned = plan.get((node.name, pos))
            if planned is None:
                out[arg.name] = self.env[arg.name]
            elif self.is_own_shard(*planned):  # fp8_gather: a ZeRO-3 weight read as its dp shard
                out[arg.name] = self.shards[arg.name]
            else:
                producer, dst, steps = planned
                out[arg.name] = self.gathered_cast(producer, dst, steps) or self.redistribute(producer, dst, steps,
                                                                                             module)
        for a in node.all_input_nodes:
            if a.name not in out:
                out[a.name] = self.env[a.name]
        return out

    def local_shapes(self) -> LocalShapes:
        return LocalShapes(self.split, self.coord, self.fake, self.prog.arg_placements, self.site.source)

    def output(self, node: fx.Node, plan: dict) -> None:
        num_outputs = self.prog.signature.num_outputs
        outs = []
        for pos, arg in enumerate(node.args[0]):
            with self.at(phase="fwd" if pos < num_outputs else "bwd"):
                outs.append(self.output_value(node, pos, arg, plan))
        self.graph.output(tuple(outs))

    def output_value(self, node: fx.Node, pos: int, arg: Any, plan: dict) -> fx.Node | None:
        """Output ``pos`` as this rank returns it (a parameter gradient keeps its batch-axis partial sum: deferred)."""
        planned = plan.get((node.name, pos))
        if arg is None:
            return None
        if planned is None:
            return self.own_zero_shard(pos, self.env[arg.name])
        producer, dst, steps = planned
        deferred = len(self.deferred)
        if pos in self.grad_fqn:
            dst, steps = self.defer_dp_reduction(pos, producer, dst, steps)
        value = self.redistribute(producer, dst, steps, "") if steps else self.env[producer]
        if len(self.deferred) == deferred:
            value = self.own_zero_shard(pos, value)
        return value



def batch_sharded(mesh: Mesh, p: Placements, axis: str) -> int:
    """The size of ``axis`` if ``p`` shards a value over it (a batch axis), else 1."""
    n = mesh.axes.get(axis, 1)
    return n if n > 1 and isinstance(p[mesh.axis_index(axis)], Shard) else 1
