"""The global program: one joint forward+backward ``torch.fx`` graph plus typed side tables.

Passes never mutate a ``Program``. Passes that only annotate return ``prog.replace(...)``:
the same graph with new side tables (placements, redistributions), so the program before
each pass stays printable and diffable without copying a large graph.
"""

from __future__ import annotations

import dataclasses
import functools
import keyword
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor.placement_types import Placement
from torch.fx._lazy_graph_module import _LazyGraphModule

from fxpar.mesh import Mesh

# Placements of one tensor: one Placement per mesh axis.
Placements = tuple[Placement, ...]

SPLIT_ADDMM = "split_addmm"  # node meta: an add capture took out of an addmm (fxpar.lower.fuse_bias)


# the first ``name.<index>`` in a module path: one entry of a repeated block (``layers.3`` of ``layers.3.mlp.up``;
# ``3`` of ``3.mlp.up`` in a root ``nn.Sequential``)
BLOCK = re.compile(r"^(?:(.*?)\.)?(\d+)(?:\.|$)")


def block_entry(path: str) -> tuple[str, int] | None:
    """The repeated block ``path`` sits in, as (container path, index): ``("layers", 3)`` for ``layers.3.mlp.up``,
    ``("", 3)`` for ``3.mlp.up`` under a root ``nn.Sequential``; ``None`` outside any numbered container."""
    m = BLOCK.match(path)
    return (m.group(1) or "", int(m.group(2))) if m else None


def entry_path(prefix: str, index: int) -> str:
    """The module path of entry ``index`` of the container at ``prefix`` (``block_entry``'s inverse)."""
    return f"{prefix}.{index}" if prefix else str(index)


@dataclass(frozen=True)
class Provenance:
    """Where a node came from in the user's model."""

    module: str  # module path, e.g. "layers.3.mlp.up" ("" for the root)
    source: str  # "file.py:123" of the user's line, "" when unknown
    phase: str  # "fwd" | "bwd"


@dataclass(frozen=True)
class Signature:
    """How the joint graph's placeholders and outputs map to the user's model."""

    params: tuple[tuple[str, str], ...]  # (fqn, placeholder name), in placeholder order
    buffers: tuple[tuple[str, str], ...]
    inputs: tuple[str, ...]  # placeholder names of the user's (flattened) inputs
    tangents: tuple[tuple[str, int], ...]  # (placeholder name, index of the forward output)
    num_outputs: int  # forward outputs come first in the output node
    grads: tuple[tuple[str, int], ...]  # (param fqn, index in the output node)
    out_spec: Any  # pytree spec of the forward outputs
    in_spec: Any  # pytree spec of the user's inputs
    input_grads: tuple[tuple[str, int], ...] = ()  # (input placeholder, index in the output node): stage boundaries


@dataclass(frozen=True)
class Redistribution:
    """Changing one argument of a node from ``src`` to ``dst`` placements."""

    producer: str  # node name whose value is redistributed
    src: Placements
    dst: Placements


@dataclass(frozen=True)
class Step:
    """One collective (or local slice) on one mesh axis."""

    op: str  # "all_reduce" | "all_gather" | "reduce_scatter" | "all_to_all" | "slice"
    axis: str
    src: Placement
    dst: Placement


@dataclass(frozen=True)
class Program:
    """A captured model as a global (unsharded) joint graph with annotations."""

    gm: fx.GraphModule
    mesh: Mesh
    signature: Signature
    provenance: dict[str, Provenance]
    placements: dict[str, Any] = field(default_factory=dict)  # node -> Placements | tuple[...]
    arg_placements: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # node -> per arg
    passes: tuple[str, ...] = ("capture",)
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    def replace(self, pass_name: str | None = None, **changes: Any) -> Program:
        """A new Program sharing the graph, with some side tables replaced."""
        if pass_name is not None:
            changes["passes"] = (*self.passes, pass_name)
        return dataclasses.replace(self, **changes)

    def node(self, name: str) -> fx.Node:
        return self._nodes_by_name[name]

    @functools.cached_property
    def _nodes_by_name(self) -> dict[str, fx.Node]:
        """Built once per Program object, outside its fields: ``replace`` starts a new one, and the graph of a
        Program is never edited in place (a pass that rewrites it returns a Program with a new graph)."""
        return {n.name: n for n in self.graph.nodes}

    def verify(self) -> None:
        """Check the invariants every pass must keep; raise AssertionError naming the node."""
        self.graph.lint()
        for n in self.graph.nodes:
            if n.op in ("placeholder", "call_function", "get_attr"):
                assert n.name in self.provenance, f"node {n.name} has no provenance"
            if self.placements and _is_tensor(n):
                p = self.placements.get(n.name)
                assert p is not None, f"tensor node {n.name} has no placement after {self.passes[-1]}"


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)


def tensor_val(n: Any) -> torch.Tensor | None:
    """The fake global value of an fx node, if it is a tensor."""
    if isinstance(n, fx.Node):
        v = n.meta.get("val")
        return v if isinstance(v, torch.Tensor) else None
    return None


def fake_empty(fake_mode: Any, shape: Any, stride: Any, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A fresh fake tensor of ``shape``, ``stride`` (None: contiguous) and ``dtype`` on ``device``, as ``fake_mode``
    wraps an op's meta output: about 18 us, where running ``torch.empty_strided`` in the mode takes about 90 us (a
    compile makes one per parameter of the model, and so does lowering a role)."""
    with unset_fake_temporarily():
        if stride is None:
            meta = torch.empty(shape, dtype=dtype, device="meta")
        else:
            meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, torch.device(device))


def batch_placements(val: torch.Tensor, mesh: Mesh, batch: int | None = None, seq: int | None = None,
                     sp_seq: int | None = None) -> Placements:
    """Placements of a model output or a stage boundary value: batch-sharded (dim 0) on ``dp`` (and ``ep``) where
    dp divides it or it is a multiple of the global ``batch`` (split as ``fxpar.split`` says), sequence-sharded
    (dim 1) on ``cp`` where dim 1 is the sequence ``seq`` (stage boundaries: a model output is whole over cp),
    and on ``tp`` where sequence parallelism holds a ``[batch, sp_seq, hidden]`` stage boundary (so each tp rank
    sends its sequence piece, Megatron's scatter-gather), replicated on every other axis."""
    from torch.distributed.tensor import Replicate, Shard

    def batched(n: int) -> bool:
        return bool(val.ndim) and (val.shape[0] % n == 0 or bool(batch) and val.shape[0] % batch == 0)

    def placed(axis: str, n: int) -> Placement:
        if axis in ("dp", "ep") and n > 1 and batched(n):
            return Shard(0)
        if axis == "cp" and n > 1 and seq is not None and val.ndim >= 2 and val.shape[1] == seq:
            return Shard(1)
        if axis == "tp" and n > 1 and sp_seq is not None and val.ndim == 3 and val.shape[1] == sp_seq >= n:
            return Shard(1)
        return Replicate()

    return tuple(placed(a, n) for a, n in mesh.axes.items())


def sp_boundary(prog: Program, ctx: Any) -> int | None:
    """The sequence length a pipeline stage boundary is sharded on over tp (sequence parallelism without a cp
    axis, which holds the sequence dim itself); None otherwise."""
    mesh = prog.mesh
    if not ctx.plan.sequence_parallel or mesh.axes.get("tp", 1) < 2 or mesh.axes.get("cp", 1) > 1:
        return None
    return prog.notes.get("sequence")


def py_name(fqn: str) -> str:
    """A Python identifier for a parameter path: ``layers.0.up.weight`` -> ``layers_0_up_weight``;
    ``nn.Sequential``'s ``0.weight`` -> ``p_0_weight``."""
    name = re.sub(r"\W", "_", fqn)
    return name if name.isidentifier() and not keyword.iskeyword(name) else f"p_{name}"


def consumed_tensors(node: fx.Node) -> list[fx.Node | None]:
    """The tensor arguments of ``node`` in the order ``arg_placements`` uses."""
    if node.op == "output":
        return [a if tensor_val(a) is not None else None for a in node.args[0]]
    return [a for a in node_leaves((node.args, node.kwargs)) if tensor_val(a) is not None]


def node_leaves(args: Any, out: list[fx.Node] | None = None) -> list[fx.Node]:
    """The fx nodes in ``args`` (nested tuples, lists and dicts), in ``pytree.tree_leaves`` order, repeats kept
    (the same order as pytree's, without its per-leaf type dispatch)."""
    out = [] if out is None else out
    if isinstance(args, fx.Node):
        out.append(args)
    elif isinstance(args, (tuple, list)):
        for a in args:
            node_leaves(a, out)
    elif isinstance(args, dict):
        for a in args.values():
            node_leaves(a, out)
    return out


def graph_module(root: torch.nn.Module | dict[str, Any], graph: fx.Graph) -> fx.GraphModule:
    """An ``fx.GraphModule`` of ``graph`` whose Python code is generated when it is first run or printed, not when
    it is built or ``recompile()`` is called (torch's ``_LazyGraphModule``): compiling an 80-layer model builds and
    rewrites dozens of graphs of tens of thousands of nodes, most of which are never run."""
    return _LazyGraphModule(root, graph)


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform: Any) -> fx.Node:
    """``graph.node_copy(node, arg_transform)``, its meta a shallow copy as there, filled in place: assigning a
    node's ``meta`` makes fx re-index the node (about 6 us; lowering copies every node of a rank's joint graph)."""
    new = graph.create_node(node.op, node.target, fx.map_arg(node.args, arg_transform),
                            fx.map_arg(node.kwargs, arg_transform), node.name, node.type)
    new.meta.update(node.meta)
    return new
