"""Pipeline stages that are one program over other layers: lowered once, copied with the layers renamed.

A 126-layer model on 16 stages has 14 middle stages of 8 (or 7) identical decoder layers each; lowering each
for its role repeated the same work 14 times (issue 19: 12 of the 405B layout's 36 s). Stage ``t`` is a *twin*
of an earlier stage ``s`` when its global program is ``s``'s with every module path under the blocks'
``ModuleList`` moved by ``k`` blocks (``model.layers.3`` -> ``model.layers.7``): the same nodes in the same
order, with the same names, ops, arguments, shapes, strides, placements, provenance, signature, plan notes
and pass list, paths moved. Lowering reads nothing else of a stage but the mesh and the rank's coordinate,
so ``t``'s rank program is ``s``'s with paths and names moved and the stage index set (``shifted``).
Anything the check cannot prove (another prefix, a note that differs, the last stage against another) falls
back to lowering; ``FXPAR_SHARING=0`` lowers every stage on its own, and the printed programs and ledgers
must be byte-identical either way (``tests/test_sharing.py``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement

from fxpar.ir import Program, graph_module, py_name
from fxpar.lower.program import RankProgram

PATHLESS = (int, float, bool, type(None), torch.dtype, Placement)  # values that hold no path: compared with ==
NOT_READ_BY_LOWERING = {"stage", "plan"}  # notes lowering never reads (the stage index; the whole model's plan)


@dataclass(frozen=True)
class Shift:
    """Module paths under ``prefix`` moved by ``by`` blocks: ``model.layers.3.mlp`` -> ``model.layers.7.mlp``."""

    prefix: str
    by: int

    @cached_property
    def _path(self) -> re.Pattern[str]:
        return re.compile(rf"(?<![\w.]){re.escape(self.prefix)}\.(\d+)(?!\d)")

    @cached_property
    def _py_prefix(self) -> str:
        return py_name(self.prefix)

    @cached_property
    def _name(self) -> re.Pattern[str]:
        return re.compile(rf"(?<![A-Za-z0-9]){re.escape(self._py_prefix)}_(\d+)(?=_|$)")

    def mentioned(self, s: str) -> bool:
        """Whether ``s`` may hold a path this shift moves."""
        return self.prefix in s or self._py_prefix in s

    def path(self, s: str) -> str:
        """``s`` with every path in it moved, dotted (``bucket of 9: model.layers.3.mlp.up_proj.weight .. ``) and
        inside identifiers (``saved_model_layers_3_mlp_up_proj_weight``)."""
        if self.prefix in s:
            s = self._path.sub(lambda m: f"{self.prefix}.{int(m.group(1)) + self.by}", s)
        if self._py_prefix in s:
            s = self._name.sub(lambda m: f"{self._py_prefix}_{int(m.group(1)) + self.by}", s)
        return s


def find_twins(stages: list[Program]) -> dict[int, tuple[int, Shift]]:
    """Each stage that is an earlier one over other blocks -> (that stage, the shift). Each stage is compared with
    the stages found no twin so far (the first stage, a template middle stage, the last), not with every stage."""
    templates: list[int] = []
    twins: dict[int, tuple[int, Shift]] = {}
    for t in range(len(stages)):
        found = next(((s, sh) for s in templates if (sh := shift_between(stages[s], stages[t])) is not None), None)
        if found is None:
            templates.append(t)
        else:
            twins[t] = found
    return twins


def shift_between(a: Program, b: Program) -> Shift | None:
    """The shift that makes stage program ``a`` into ``b``, if ``b`` is provably ``a`` over other blocks, else None."""
    sa, sb = a.notes.get("stage"), b.notes.get("stage")
    if sa is None or sb is None or (sa.index == sa.n_stages - 1) != (sb.index == sb.n_stages - 1):
        return None
    ma, mb = (re.fullmatch(r"(.+)\.(\d+)", s.first_module) for s in (sa, sb))
    if ma is None or mb is None or ma.group(1) != mb.group(1) or ma.group(2) == mb.group(2):
        return None
    shift = Shift(ma.group(1), int(mb.group(2)) - int(ma.group(2)))
    return shift if _same_up_to(shift, a, b) else None


def _same_up_to(shift: Shift, a: Program, b: Program) -> bool:
    if a.mesh != b.mesh or a.passes != b.passes or len(a.graph.nodes) != len(b.graph.nodes):
        return False
    if set(a.notes) != set(b.notes) or not _names_move_with_paths(shift, a):
        return False
    same = _MovedEqual(shift)
    pairs = [(a.notes[k], b.notes[k]) for k in a.notes.keys() - NOT_READ_BY_LOWERING]
    pairs += [(a.signature, b.signature), (a.provenance, b.provenance), (a.placements, b.placements),
              (a.arg_placements, b.arg_placements)]
    if not all(same(x, y) for x, y in pairs):
        return False
    return all(_same_node(same, x, y, a.gm, b.gm) for x, y in zip(a.graph.nodes, b.graph.nodes, strict=True))


def _names_move_with_paths(shift: Shift, a: Program) -> bool:
    """Moving a parameter's graph name (``layers_3_mlp_up_weight``, which lowered names embed) gives the name of
    its moved path: not so when another list's paths end like the prefix (``encoder.layers.3`` under ``layers``)."""
    fqns = [fqn for fqn, _ in (*a.signature.params, *a.signature.buffers)]
    return all(shift.path(py_name(fqn)) == py_name(shift.path(fqn)) for fqn in fqns)


def _same_node(same: _MovedEqual, x: fx.Node, y: fx.Node, gx: fx.GraphModule, gy: fx.GraphModule) -> bool:
    if x.op != y.op or x.target != y.target or not same(x.name, y.name) or not same((x.args, x.kwargs),
                                                                                  (y.args, y.kwargs)):
        return False
    if x.op == "get_attr":
        vx, vy = getattr(gx, x.target), getattr(gy, y.target)
        if not (isinstance(vx, torch.Tensor) and isinstance(vy, torch.Tensor)):
            return False
        return vx.shape == vy.shape and vx.dtype == vy.dtype and bool(torch.equal(vx, vy))
    return same(x.meta.get("val"), y.meta.get("val"))


class _MovedEqual:
    """``same(x, y)``: ``x``, every path in its strings moved by the shift, equals ``y``. Nodes compare by name,
    tensors by shape, dtype, strides and device, dataclasses field by field, containers element by element;
    values that hold no path (numbers, dtypes, placements) with ``==``."""

    def __init__(self, shift: Shift) -> None:
        self.shift = shift
        self._kinds: dict[type, str] = {}

    def _kind(self, t: type) -> str:
        kind = self._kinds.get(t)
        if kind is None:
            kind = self._kinds[t] = _kind_of(t)
        return kind

    def __call__(self, x: Any, y: Any) -> bool:  # noqa: PLR0911 - one case per kind of value
        if type(x) is not type(y):
            return False
        kind = self._kind(type(x))
        if kind == "plain":
            return bool(x == y)
        if kind == "str":
            return (self.shift.path(x) if self.shift.mentioned(x) else x) == y
        if kind == "seq":
            return len(x) == len(y) and all(self(u, v) for u, v in zip(x, y, strict=True))
        if kind == "dict":
            return len(x) == len(y) and all(self(ku, kv) and self(x[ku], y[kv]) for ku, kv in zip(x, y, strict=True))
        if kind == "node":
            return self(x.name, y.name)
        if kind == "tensor":
            return (x.shape, x.dtype, x.stride(), x.device) == (y.shape, y.dtype, y.stride(), y.device)
        if kind == "set":
            return len(x) == len(y) and {self.shift.path(v) if isinstance(v, str) else v for v in x} == y
        if kind == "dataclass":
            return all(self(getattr(x, f.name), getattr(y, f.name)) for f in dataclasses.fields(x))
        return bool(x == y)


def _kind_of(t: type) -> str:  # noqa: PLR0911 - one case per kind of value
    if issubclass(t, PATHLESS):
        return "plain"
    if issubclass(t, str):
        return "str"
    if issubclass(t, (list, tuple)):
        return "seq"
    if issubclass(t, dict):
        return "dict"
    if issubclass(t, fx.Node):
        return "node"
    if issubclass(t, torch.Tensor):
        return "tensor"
    if issubclass(t, (set, frozenset)):
        return "set"
    return "dataclass" if dataclasses.is_dataclass(t) else "other"


def shifted(rp: RankProgram, shift: Shift, stage: int) -> RankProgram:
    """``rp`` as stage ``stage``'s program, names and module paths moved by ``shift``: its graphs are renamed
    in place, so ``rp`` must own them (a fresh ``fxpar.roles.bind`` copy of the twin stage's role)."""

    def graph(gm: fx.GraphModule | None) -> fx.GraphModule | None:
        return None if gm is None else _moved_graph(gm, shift)

    return dataclasses.replace(
        rp, joint=None, forward=graph(rp.forward), backward=graph(rp.backward), reduce_grads=graph(rp.reduce_grads),
        gather_params=graph(rp.gather_params), saved=[shift.path(s) for s in rp.saved],
        deferred=[(pos, shift.path(fqn)) for pos, fqn in rp.deferred], stage=stage,
        zero={shift.path(fqn): dim for fqn, dim in rp.zero.items()})


def _moved_graph(gm: fx.GraphModule, shift: Shift) -> fx.GraphModule:
    for n in gm.graph.nodes:
        old, name = n.name, shift.path(n.name)
        if name != old:
            n._rename(name)
            assert n.name == name, f"renaming {name} clashed in the twin stage's graph"
            if n.op == "placeholder" and n.target == old:
                n.target = name
        module = n.meta.get("module")
        if module and shift.mentioned(module):
            n.meta["module"] = shift.path(module)
    return graph_module(gm, gm.graph)
