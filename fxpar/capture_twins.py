"""Pipeline stages whose forward is an earlier stage's over other blocks: captured once, copied with paths moved.

At the 405B layout (126 layers on 16 stages), stages 2-14 each hold 8 decoder layers that are stage 1's, moved;
capturing each stage's joint forward+backward (AOTAutograd over the stage's ``fxpar::block`` calls, then
``fxpar.stitch``) cost about 0.6 s a stage, most of what ``parallelize`` spends beyond a bare ``torch.export``
(issue 19). Stage ``b`` is a *capture twin* of an earlier stage ``a`` when ``b``'s exported forward is ``a``'s with
every module path under the blocks' list moved by ``k`` blocks (``export_shift``): node for node the same ops,
arguments, shapes, strides, module stacks and source lines, each block call of the same distinct block (the same
traced representative, the same outputs read), each parameter of the same shape, dtype and tying, and the same
boundary and user inputs. Capture reads nothing else of a stage, and names the joint's nodes per stage
(``primals_1``, ``mm_12``), so ``b``'s joint is ``a``'s with the paths it carries moved (``moved_capture``):
the signature's parameter names, the provenance table and the node meta that hold paths. The rest of the node
meta (shapes, autograd tags, the traced-block template) is ``a``'s; only tracing history (``from_node``,
``torch_fn``, ``seq_nr``: object ids and export-wide counters nothing downstream reads) is not what a capture
of ``b`` would have said.

Only stages exported with shared blocks are compared (``FXPAR_SHARING=0`` captures every stage on its own), never
the last stage against another (it holds the loss). ``tests/test_sharing.py`` checks a copy against a fresh
capture of the same stage, meta included.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from fxpar.blocks import BLOCK_OPS
from fxpar.capture import canonical_names
from fxpar.ir import Program, Signature, graph_module
from fxpar.stage_twins import PATHLESS, Shift
from fxpar.stages import StageGraph
from fxpar.stitch import Blocks

MOVED_META = ("fxpar_provenance", "desc", "nn_module_stack", "fwd_nn_module_stack")  # node meta that holds paths


class CaptureTwins:
    """The stages captured so far (templates) and the stages found to be one of them over other blocks
    (``fxpar.capture_twins``): those are copied, not captured."""

    def __init__(self, exported: Any, model: torch.nn.Module, n_stages: int) -> None:
        self.exported, self.n_stages = exported, n_stages
        self.canonical = canonical_names(model) if exported.blocks is not None else {}
        self.templates: list[tuple[StageGraph, tuple[Any, ...]]] = []
        self.found: dict[int, tuple[int, Shift]] = {}

    def find(self, sg: StageGraph, args: tuple[Any, ...]) -> tuple[int, Shift] | None:
        """(the template stage, the shift) that ``sg`` is a twin of, or None (capture it)."""
        if self.exported.blocks is None or sg.index == self.n_stages - 1:
            return None
        for t, t_args in self.templates:
            shift = export_shift(t, sg, t_args, args, self.exported.blocks, self.canonical)
            if shift is not None:
                self.found[sg.index] = (t.index, shift)
                return t.index, shift
        return None

    def add(self, sg: StageGraph, args: tuple[Any, ...]) -> None:
        self.templates.append((sg, args))


def export_shift(a: StageGraph, b: StageGraph, args_a: tuple[Any, ...], args_b: tuple[Any, ...], blocks: Blocks,
                 canonical: dict[str, str]) -> Shift | None:
    """The shift that makes stage ``a``'s exported forward into ``b``'s, if ``b`` is provably ``a`` over other
    blocks (so their captured joints differ only in the paths they carry), else None. ``args_*``: the fake
    inputs each stage is captured with; ``canonical``: each parameter name -> the name its tensor is known by."""
    ma, mb = (re.fullmatch(r"(.+)\.(\d+)", s.first_module) for s in (a, b))
    if ma is None or mb is None or ma.group(1) != mb.group(1) or ma.group(2) == mb.group(2):
        return None
    if a.user_inputs != b.user_inputs or len(a.received) != len(b.received) or len(a.sent) != len(b.sent):
        return None
    if not all(_same_input(x, y) for x, y in zip(args_a, args_b, strict=False)) or len(args_a) != len(args_b):
        return None
    shift = Shift(ma.group(1), int(mb.group(2)) - int(ma.group(2)))
    return shift if _Compare(shift, a.gm, b.gm, blocks, canonical).graphs() else None


def _same_input(x: Any, y: Any) -> bool:
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return False
    return (x.shape, x.stride(), x.dtype, x.device, x.requires_grad) == (y.shape, y.stride(), y.dtype, y.device,
                                                                         y.requires_grad)


class _Compare:
    """Node-by-node comparison of two stages' exported forwards, ``a``'s paths moved by the shift."""

    def __init__(self, shift: Shift, ga: fx.GraphModule, gb: fx.GraphModule, blocks: Blocks,
                 canonical: dict[str, str]) -> None:
        self.shift, self.ga, self.gb, self.blocks, self.canonical = shift, ga, gb, blocks, canonical
        self.pair: dict[fx.Node, fx.Node] = {}
        self.tensors_a: dict[int, int] = {}  # id(attribute tensor) -> the first get_attr that read it, per side
        self.tensors_b: dict[int, int] = {}

    def graphs(self) -> bool:
        na, nb = list(self.ga.graph.nodes), list(self.gb.graph.nodes)
        if len(na) != len(nb):
            return False
        for i, (x, y) in enumerate(zip(na, nb, strict=True)):
            if not self._node(i, x, y):
                return False
            self.pair[x] = y
        return True

    def _node(self, i: int, x: fx.Node, y: fx.Node) -> bool:  # noqa: PLR0911 - one refusal per difference
        if x.op != y.op or x.op == "call_module" or not self._arg(x.kwargs, y.kwargs):
            return False
        if x.op == "get_attr":
            return self._attribute(i, x, y)
        if x.op == "placeholder":  # a boundary value (named as in the whole export) or a user input, by position
            return self._meta(x, y)
        if x.op == "call_function" and x.target is BLOCK_OPS[0]:
            if y.target is not x.target or not self._block(x.args[0], y.args[0]) or not self._arg(x.args[1:],
                                                                                                   y.args[1:]):
                return False
        elif x.target != y.target or not self._arg(x.args, y.args):
            return False
        return self._meta(x, y)

    def _block(self, site_a: int, site_b: int) -> bool:
        """Two calls of the same traced representative, at paths the shift moves one onto the other."""
        pa, pb = self.blocks.table.sites[site_a].path, self.blocks.table.sites[site_b].path
        return self.blocks.key(site_a) == self.blocks.key(site_b) and self.shift.path(pa) == pb

    def _attribute(self, i: int, x: fx.Node, y: fx.Node) -> bool:
        if self.shift.path(x.target) != y.target:
            return False
        ta, tb = _fetch(self.ga, x.target), _fetch(self.gb, y.target)
        if not (isinstance(ta, torch.Tensor) and isinstance(tb, torch.Tensor)) or type(ta) is not type(tb):
            return False
        if self.tensors_a.setdefault(id(ta), i) != self.tensors_b.setdefault(id(tb), i):
            return False  # tied differently
        if self.shift.path(self.canonical.get(x.target, x.target)) != self.canonical.get(y.target, y.target):
            return False
        meta = (ta.shape, ta.stride(), ta.dtype, ta.device, ta.requires_grad) == (
            tb.shape, tb.stride(), tb.dtype, tb.device, tb.requires_grad)
        return meta and _same_values(ta, tb)

    def _meta(self, x: fx.Node, y: fx.Node) -> bool:
        if x.meta.get("stack_trace") != y.meta.get("stack_trace") or not self._arg(x.meta.get("val"),
                                                                                   y.meta.get("val")):
            return False
        sa, sb = (list((n.meta.get("nn_module_stack") or {}).values()) for n in (x, y))
        return self._arg(sa, sb)

    def _arg(self, x: Any, y: Any) -> bool:  # noqa: PLR0911 - one case per kind of value
        if type(x) is not type(y):
            return False
        if isinstance(x, fx.Node):
            return self.pair.get(x) is y
        if isinstance(x, str):
            return self.shift.path(x) == y
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(self._arg(u, v) for u, v in zip(x, y, strict=True))
        if isinstance(x, dict):
            return list(x) == list(y) and all(self._arg(x[k], y[k]) for k in x)
        if isinstance(x, torch.Tensor):
            return (x.shape, x.stride(), x.dtype, x.device) == (y.shape, y.stride(), y.dtype, y.device)
        if isinstance(x, (*PATHLESS, slice, torch.device, torch.memory_format, torch.layout, type)):
            return bool(x == y)
        return False  # a value this check cannot compare: capture the stage


def _fetch(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


def _same_values(ta: torch.Tensor, tb: torch.Tensor) -> bool:
    """Parameters and buffers are the captured joint's inputs (their values are not in it); any other tensor
    attribute is a constant the joint holds, so it must have the same values (a fake one cannot be compared)."""
    if isinstance(ta, (torch.nn.Parameter, FakeTensor)):  # capture swaps fake tensors in for parameters, buffers
        return True
    return ta.device.type != "meta" and bool(torch.equal(ta, tb))


def moved_capture(prog: Program, shift: Shift, notes: dict[str, Any]) -> Program:
    """``prog`` (a stage's captured joint) as its twin's: a copy of the graph whose path-bearing meta, provenance
    and signature are moved by ``shift``, with ``notes``."""
    move = _Mover(shift)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(prog.graph, env)
    old_out = prog.graph.output_node()
    g.output(out).meta.update(old_out.meta)
    g._codegen = prog.graph._codegen
    for n in g.nodes:
        for key in MOVED_META:
            if key in n.meta:
                n.meta[key] = move(n.meta[key]) if "nn_module_stack" not in key else _moved_stack(move,
                                                                                                  n.meta[key])
    provenance = {name: move(p) for name, p in prog.provenance.items()}
    return dataclasses.replace(prog, gm=graph_module(prog.gm, g), signature=_moved_signature(move, prog.signature),
                               provenance=provenance, notes=notes)


def _moved_signature(move: _Mover, sig: Signature) -> Signature:
    return dataclasses.replace(sig, params=move(sig.params), buffers=move(sig.buffers), grads=move(sig.grads))


def _moved_stack(move: _Mover, stack: dict[str, tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """An ``nn_module_stack`` (tracer key -> (path, class)) with each path moved, in its key too."""
    out = {}
    for key, (path, cls) in stack.items():
        moved = move(path)
        out[key.replace(path, moved) if path and key.endswith(path) else key] = (moved, cls)
    return out


class _Mover:
    """``move(x)``: ``x`` with every path in its strings moved, containers and dataclasses rebuilt (tensors, numbers
    and any other value shared)."""

    def __init__(self, shift: Shift) -> None:
        self.shift = shift

    def __call__(self, x: Any) -> Any:
        if isinstance(x, str):
            return self.shift.path(x) if self.shift.mentioned(x) else x
        if type(x) in (list, tuple):
            return type(x)(self(v) for v in x)
        if type(x) is dict:
            return {self(k): self(v) for k, v in x.items()}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {f.name: self(getattr(x, f.name)) for f in dataclasses.fields(x) if f.init}
            return dataclasses.replace(x, **changes)
        return x
