"""Replay: lower a node of a repeated layer as an earlier copy of the same node was lowered, its inputs moved.

Stitching (``fxpar.stitch``) marks every node it copies from a shared block with ``TEMPLATE``: the block's
capture and the node it copies. Two copies share their op, their fake value and their arguments up to renaming.
When they also see the same lowering inputs (``LayerReplay.key``: their placements, the local layout of each input,
each planned redistribution of an input and whether it is already cached, recompute, phase and source line), the
lowering of the second emits what the first emitted, node for node: the same ops, arguments moved to the second's
inputs, the same requested names moved to its own names, the same meta with its module path and global node moved.
``LayerReplay`` records the first lowering (``Emitter.recording``) and replays it for every later copy, calling
``Graph.create_node`` exactly as the lowering would: the names ``torch.fx`` picks, and so the program's text, are
the ones the lowering gives. What it skips is the per-node work (localizing shapes, keying fake values, planning
inputs); it still creates every node: lowering a rank of an 80-layer Llama takes 0.80-0.92x as long with it
(``bench/compile_time.py``, the ``replay70`` worker).

Anything whose lowering reads more than those inputs is lowered as usual: ZeRO-3 (parameters gathered lazily,
buckets), mixed precision (working copies, bucketed casts), expert and context parallel axes, random ops, causal
attention, nodes with in-place gradient reductions, and any node whose recorded lowering reached something it
cannot name (a node it did not make and did not read). ``FXPAR_REPLAY=0`` turns replay off, for comparing the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.fx as fx
from torch.fx.node import map_aggregate

from fxpar.ir import consumed_tensors
from fxpar.lower.context import CAUSAL_ATTENTION
from fxpar.lower.emit import _arg_key, _Unkeyable
from fxpar.random_draws import DRAWS_ON_SHAPE
from fxpar.rules.experts import EXPERT_OPS
from fxpar.split import CONTEXT_AXIS
from fxpar.stitch import TEMPLATE

if TYPE_CHECKING:
    from fxpar.lower.retrace import Lowerer

REPLAY_ENV = "FXPAR_REPLAY"  # "0": lower every node itself
_SKIPPED = frozenset({*CAUSAL_ATTENTION, *DRAWS_ON_SHAPE, *EXPERT_OPS})


@dataclass(frozen=True)
class _Ref:
    """A local value a recorded lowering read or made: ``kind`` "made" (its ``index``-th emitted node), "input"
    (the local value of the node's ``index``-th input) or "cached" (the cached redistribution of its planned
    input at position ``index``)."""

    kind: str
    index: int


_OWN = _Ref("own", 0)  # in a requested name: the global node's own name


@dataclass(frozen=True)
class _Made:
    """One emitted node, with its arguments as ``_Ref``s and its requested name as a prefix and a suffix."""

    target: Any
    args: Any
    kwargs: Any
    name_from: _Ref | None  # None: no name asked for
    name_suffix: str
    meta: dict[str, Any]
    own_module: bool  # its meta names the lowered node's module (moved to the copy's)
    own_node: bool  # its meta names the lowered node (moved to the copy)


@dataclass(frozen=True)
class _Lowering:
    made: tuple[_Made, ...]
    result: _Ref
    cached: tuple[tuple[int, _Ref], ...]  # a planned input's position -> the value its redistribution cached


class LayerReplay:
    """The recorded lowerings of a rank's retrace, by ``key``; ``call`` lowers a node, replaying where it can."""

    def __init__(self, lw: Lowerer) -> None:
        self.lw = lw
        mesh = lw.mesh.axes
        self.on = (os.environ.get(REPLAY_ENV, "1") != "0" and not lw.zero3 and lw.experts is None
                   and not (lw.prog.notes.get("mixed_precision") or (None,))[0] and mesh.get(CONTEXT_AXIS, 1) == 1)
        self.recorded: dict[tuple[Any, ...], _Lowering | None] = {}  # None: this lowering cannot be replayed
        self.replayed = 0

    def call(self, node: fx.Node, plan: dict, module: str, in_place: dict) -> None:
        """Lower ``node`` (``Lowerer.call``), or replay the lowering of an earlier copy that saw the same inputs."""
        key = self.key(node, plan, in_place) if self.on else None
        if key is None:
            self.lw.call(node, plan, module)
            return
        known = self.recorded.get(key, _UNSEEN)
        if known is _UNSEEN:
            self.recorded[key] = self._record(node, plan, module)
        elif known is None:
            self.lw.call(node, plan, module)
        else:
            self._replay(node, plan, module, known)
            self.replayed += 1

    def key(self, node: fx.Node, plan: dict, in_place: dict) -> tuple[Any, ...] | None:
        """What the lowering of a copied block node reads besides the names of its inputs; None: not replayable."""
        template = node.meta.get(TEMPLATE)
        lw = self.lw
        if template is None or node.target in _SKIPPED or node.name in in_place or node.name in lw.env:
            return None
        prov = lw.prog.provenance.get(node.name)
        if prov is None:
            return None
        try:
            inputs = tuple(_local_key(lw.env[a.name]) for a in node.all_input_nodes)
        except (_Unkeyable, KeyError):
            return None
        planned = self._planned(node, plan) if node.name in lw.planned else ()
        if planned is None:
            return None
        return (template, lw.prog.placements.get(node.name), lw.prog.arg_placements.get(node.name), inputs, planned,
                node.name in lw.recompute, prov.phase, prov.source)

    def _planned(self, node: fx.Node, plan: dict) -> tuple[Any, ...] | None:
        """Each planned redistribution of an input: its position, target placements, steps, the input's placements
        and whether it is cached already; None where one is not of the input itself."""
        out = []
        for pos, arg in enumerate(consumed_tensors(node)):
            planned = plan.get((node.name, pos))
            if planned is not None:
                producer, dst, steps = planned
                if producer != arg.name:
                    return None
                out.append((pos, dst, steps, self.lw.prog.placements[producer], (producer, dst) in self.lw.cache))
        return tuple(out)

    # -- recording -------------------------------------------------------------------------
    def _record(self, node: fx.Node, plan: dict, module: str) -> _Lowering | None:
        lw = self.lw
        keys = self._cache_keys(node, plan)
        missing = {k: pos for pos, k in reversed(keys) if k not in lw.cache}  # the first position asking for each
        cached_before, nodes_before = len(lw.cache), len(lw.graph.nodes)
        lw.recording = made = []
        try:
            lw.call(node, plan, module)
        finally:
            lw.recording = None
        if (len(lw.graph.nodes) - nodes_before != len(made) or any(n.graph is not lw.graph for n, _ in made)
                or len(lw.cache) - cached_before != len(missing)):
            return None
        return self._lowering(node, module, made, keys, missing)

    def _lowering(self, node: fx.Node, module: str, made: list[tuple[fx.Node, str | None]],
                  keys: list[tuple[int, tuple[str, Any]]], missing: dict[tuple[str, Any], int]) -> _Lowering | None:
        """The recorded lowering of ``node`` with every local value it touched as a ``_Ref`` (None: one is not)."""
        lw = self.lw
        refs: dict[fx.Node, _Ref] = {}
        for j, a in enumerate(node.all_input_nodes):
            refs.setdefault(lw.env[a.name], _Ref("input", j))
        for pos, k in keys:
            if k not in missing:
                refs.setdefault(lw.cache[k], _Ref("cached", pos))
        names: dict[str, _Ref] = {n.name: r for n, r in refs.items()}
        names[node.name] = _OWN
        out: list[_Made] = []
        for i, (new, asked) in enumerate(made):
            try:
                args = map_aggregate(new.args, lambda a: refs[a] if isinstance(a, fx.Node) else a)
                kwargs = map_aggregate(new.kwargs, lambda a: refs[a] if isinstance(a, fx.Node) else a)
            except KeyError:  # it read a value it was not given
                return None
            prefix = None if asked is None else max((n for n in names if asked.startswith(n)), key=len, default=None)
            if asked is not None and prefix is None:
                return None
            out.append(_Made(new.target, args, kwargs, None if prefix is None else names[prefix],
                             "" if prefix is None else asked[len(prefix):], dict(new.meta),
                             new.meta.get("module") == module, new.meta.get("for_node") == node.name))
            refs[new] = names[new.name] = _Ref("made", i)
        result = lw.env.get(node.name)
        cached = [(pos, refs.get(lw.cache[k])) for k, pos in missing.items()]
        if not isinstance(result, fx.Node) or result not in refs or any(r is None for _, r in cached):
            return None
        return _Lowering(tuple(out), refs[result], tuple(cached))

    def _cache_keys(self, node: fx.Node, plan: dict) -> list[tuple[int, tuple[str, Any]]]:
        """The redistribution cache key of each planned input, by its position."""
        if node.name not in self.lw.planned:
            return []
        consumed = consumed_tensors(node)
        return [(pos, (consumed[pos].name, planned[1])) for pos in range(len(consumed))
                if (planned := plan.get((node.name, pos))) is not None]

    # -- replaying -------------------------------------------------------------------------
    def _replay(self, node: fx.Node, plan: dict, module: str, lowering: _Lowering) -> None:
        lw = self.lw
        inputs = [lw.env[a.name] for a in node.all_input_nodes]
        keys = dict(self._cache_keys(node, plan)) if node.name in lw.planned else {}
        made: list[fx.Node] = []

        def value(ref: _Ref) -> fx.Node:
            if ref.kind == "made":
                return made[ref.index]
            if ref.kind == "input":
                return inputs[ref.index]
            return lw.cache[keys[ref.index]]

        def moved(a: Any) -> Any:
            return value(a) if isinstance(a, _Ref) else a

        for m in lowering.made:
            if m.name_from is None:
                name = None
            else:
                name = (node.name if m.name_from is _OWN else value(m.name_from).name) + m.name_suffix
            new = lw.graph.create_node("call_function", m.target, map_aggregate(m.args, moved),
                                       map_aggregate(m.kwargs, moved), name=name)
            new.meta.update(m.meta)
            if m.own_module:
                new.meta["module"] = module
            if m.own_node:
                new.meta["for_node"] = node.name
            made.append(new)
        for pos, ref in lowering.cached:
            lw.cache[keys[pos]] = value(ref)
        lw.env[node.name] = value(lowering.result)


def _local_key(value: Any) -> Any:
    """The layout of an input's local value (a node with a tensor value; anything else is not replayed)."""
    if not isinstance(value, fx.Node):
        raise _Unkeyable
    return _arg_key(value)


_UNSEEN = object()
