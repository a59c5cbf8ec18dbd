"""Serialize a compiled model (its global stage ``Program``s, schedule and plan) to bytes and back, exactly.

Compiling (capture + passes) gives every rank the same global program, so one rank can compile
and send it to the others, which then only lower their own rank program. ``torch.fx``'s own
pickling re-traces the generated code (node names may change, metadata is lost), and the
fake tensors in ``node.meta["val"]`` do not pickle, so the graph is written node by node:
names, targets and arguments as they are, each value as (shape, stride, dtype, device).
Side tables (placements, provenance, the collective plan) are keyed by node name and pickle
as they are.
"""

from __future__ import annotations

import dataclasses
import operator
import pickle
import warnings
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.compiled import Compiled
from fxpar.ir import SPLIT_ADDMM, Program
from fxpar.mesh import Mesh

_FUNCTIONS = {"getitem": operator.getitem}
KEPT_META = (SPLIT_ADDMM,)  # node meta lowering reads, beside ``val``


@dataclasses.dataclass(frozen=True)
class _Ref:
    """A reference to an earlier node, by name."""

    name: str


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str


def dumps(compiled: Compiled) -> bytes:
    """``compiled`` as bytes; ``loads`` gives back equal stage programs, schedule and plan."""
    fields = {f.name: getattr(compiled, f.name) for f in dataclasses.fields(compiled)
              if f.name not in ("mesh", "stages", "_lowered", "_roles")}
    mesh = (compiled.mesh.axes, compiled.mesh.device, compiled.mesh.fake)
    return pickle.dumps((fields, [dump_program(p) for p in compiled.stages], mesh))


def loads(data: bytes, mesh: Mesh | None = None) -> Compiled:
    """The compiled model ``dumps`` wrote; ``mesh`` (same axes) replaces the saved one (a real mesh for a fake one)."""
    with warnings.catch_warnings():  # torch's own TreeSpec unpickling warns about its LeafSpec internals
        warnings.simplefilter("ignore", FutureWarning)
        fields, stages, (axes, device, fake) = pickle.loads(data)
    mesh = mesh or Mesh(axes, device=device, fake=fake)
    return Compiled(mesh=mesh, stages=[load_program(p, mesh) for p in stages], **fields)


def dump_program(prog: Program) -> bytes:
    """``prog`` as bytes; ``load_program`` gives back an equal program (same node names, values, tables)."""
    nodes = []
    for n in prog.graph.nodes:
        args, kwargs = pytree.tree_map_only(fx.Node, lambda a: _Ref(a.name), (n.args, n.kwargs))
        kept = {k: n.meta[k] for k in KEPT_META if k in n.meta}
        nodes.append((n.op, n.name, _encode_target(n), args, kwargs, _encode_val(n.meta.get("val")), kept))
    constants = {n.target: getattr(prog.gm, n.target) for n in prog.graph.nodes if n.op == "get_attr"}
    notes = {k: v for k, v in prog.notes.items() if not k.startswith("_")}
    state = {f.name: getattr(prog, f.name) for f in dataclasses.fields(prog) if f.name not in ("gm", "mesh", "notes")}
    mesh = (prog.mesh.axes, prog.mesh.device, prog.mesh.fake)
    return pickle.dumps((nodes, constants, notes, state, mesh))


def load_program(data: bytes, mesh: Mesh | None = None) -> Program:
    """The program ``dump_program`` wrote; ``mesh`` (same axes) replaces the saved one."""
    with warnings.catch_warnings():  # torch's own TreeSpec unpickling warns about its LeafSpec internals
        warnings.simplefilter("ignore", FutureWarning)
        nodes, constants, notes, state, (axes, device, fake) = pickle.loads(data)
    mesh = mesh or Mesh(axes, device=device, fake=fake)
    if mesh.axes != axes:
        raise ValueError(f"program was compiled for mesh {axes}, not {mesh.axes}")
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    for op, name, target, args, kwargs, val, *kept in nodes:  # files written before KEPT_META have no ``kept``
        args, kwargs = pytree.tree_map_only(_Ref, lambda r: env[r.name], (args, kwargs))
        node = graph.create_node(op, _decode_target(op, target), args, kwargs, name=name)
        assert node.name == name, f"node {name} was renamed to {node.name}"
        node.meta["val"] = _decode_val(val, fake)
        node.meta.update(*kept)
        env[name] = node
    root = torch.nn.Module()
    for attr, value in constants.items():
        setattr(root, attr, value)
    return Program(gm=fx.GraphModule(root, graph), mesh=mesh, notes=notes, **state)


def _encode_target(n: fx.Node) -> Any:
    if n.op != "call_function":
        return n.target
    if isinstance(n.target, torch._ops.OpOverload):
        return ("op", n.target.name())
    if n.target is operator.getitem:
        return ("fn", "getitem")
    raise NotImplementedError(f"cannot serialize call target {n.target} of node {n.name}")


def _decode_target(op: str, target: Any) -> Any:
    if op != "call_function":
        return target
    kind, name = target
    if kind == "fn":
        return _FUNCTIONS[name]
    namespace, rest = name.split("::")
    packet, _, overload = rest.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _encode_val(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return _TensorSpec(tuple(val.shape), tuple(val.stride()), val.dtype, str(val.device))
    if isinstance(val, (tuple, list)):
        return type(val)(_encode_val(v) for v in val)
    return val


def _decode_val(val: Any, fake: FakeTensorMode) -> Any:
    if isinstance(val, _TensorSpec):  # a meta tensor wrapped directly: 6x cheaper than a factory call under the mode
        meta = torch.empty_strided(val.shape, val.stride, dtype=val.dtype, device="meta")
        return fake.fake_tensor_converter.from_meta_and_device(fake, meta, torch.device(val.device))
    if isinstance(val, (tuple, list)):
        return type(val)(_decode_val(v, fake) for v in val)
    return val
