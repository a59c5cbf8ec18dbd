"""Emission: append a node to the graph being built, with its fake value and where it comes from.

``Site`` is that "where" as one explicit value: the phase, the user's source line, the global node
being lowered and whether the backward recomputes what is emitted. ``with em.at(phase="bwd"):``
changes it for a scope and restores it after; nothing else reassigns it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.lower.program import LedgerRow, group_name
from fxpar.mesh import Mesh


@dataclass(frozen=True)
class Site:
    """Where emitted nodes come from; every node emitted while it is current carries it in its meta."""

    phase: str = "fwd"  # "fwd" | "bwd"
    source: str = ""  # the user's source line of the global node being lowered
    for_node: str = ""  # the global node being lowered (the recompute budget measures trials by it)
    recompute: bool = False  # the backward recomputes what is emitted here (``split_joint`` copies it there)


class Emitter:
    """Builds one rank's graphs: ``emit`` appends a node, ``group`` names a process group, ``record`` a ledger row."""

    def __init__(self, mesh: Mesh, rank: int) -> None:
        self.mesh, self.rank = mesh, rank
        self.graph = fx.Graph()
        self.fake = _FAKE.mode
        self.groups: dict[str, tuple[int, ...]] = {}  # symbolic name -> ranks, of every group emitted
        self.site = Site()
        self._values = _FAKE.values()  # fake outputs by op and input metadata (``fake_value``)
        self.recording: list[tuple[fx.Node, str | None]] | None = None  # what ``emit`` makes, with the name asked

    def at(self, **changes: Any) -> AbstractContextManager[None]:
        """Emit with ``site`` changed by ``changes`` inside the ``with`` block (lowering enters a few per node:
        where nothing changes, nothing is made)."""
        site = self.site
        for field, value in changes.items():
            if getattr(site, field) != value:
                return _SiteScope(self, dataclasses.replace(site, **changes))
        return _UNCHANGED

    def at_site(self, site: Site) -> AbstractContextManager[None]:
        """Emit at ``site`` inside the ``with`` block."""
        return _SiteScope(self, site)

    @contextmanager
    def into(self, graph: fx.Graph, **changes: Any) -> Iterator[fx.Graph]:
        """Emit into another graph (a once-per-step graph of the rank) inside the ``with`` block."""
        outer = self.graph
        self.graph = graph
        try:
            with self.at(**changes):
                yield graph
        finally:
            self.graph = outer

    def emit(self, target: Any, args: tuple, kwargs: dict | None = None, placements: Any = None,
             module: str = "", name: str | None = None) -> fx.Node:
        kwargs = kwargs or {}
        node = self.graph.create_node("call_function", target, args, kwargs, name=name)
        node.meta["val"] = self.fake_value(target, args, kwargs)
        site = self.site
        node.meta.update(placements=placements, module=module, phase=site.phase, source=site.source)
        node.meta["for_node"] = site.for_node
        if site.recompute:
            node.meta["fxpar_recompute"] = True
        if self.recording is not None:  # ``fxpar.lower.replay``
            self.recording.append((node, name))
        return node

    def fake_value(self, target: Any, args: tuple, kwargs: dict) -> Any:
        """``target`` run on the fake values of ``args``: computed once per op and input metadata (a repeated
        layer's ops see the same shapes: an 80-layer rank graph runs each distinct op once, not 80 times)."""
        key = _fake_key(target, args, kwargs)
        known = self._values.get(key, _MISSING) if key is not None else _MISSING  # (a key's hash is not cached)
        if known is not _MISSING:
            return known
        vals = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (args, kwargs))
        with self.fake:
            val = target(*vals[0], **vals[1])
        if key is not None:
            self._values[key] = val
        return val

    def group(self, axis: str) -> str:
        ranks = tuple(self.mesh.group_ranks(self.rank, axis))
        name = group_name(axis, ranks)
        self.groups[name] = ranks
        return name

    def record(self, op: str, axis: str, val: torch.Tensor, node: fx.Node) -> None:
        """Put the ledger row of the collective ``node`` in its meta (a recomputed copy re-issues it)."""
        ranks = tuple(self.mesh.group_ranks(self.rank, axis))
        node.meta["ledger_row"] = LedgerRow(self.site.phase, op, axis, tuple(val.shape), val.dtype,
                                            val.numel() * val.element_size(), ranks)


class _SiteScope:
    """``with emitter.at(...)`` where the site changes: ``site`` inside the block, the outer site restored after."""

    __slots__ = ("emitter", "outer", "site")

    def __init__(self, emitter: Emitter, site: Site) -> None:
        self.emitter, self.site = emitter, site

    def __enter__(self) -> None:
        self.outer = self.emitter.site
        self.emitter.site = self.site

    def __exit__(self, *exc: object) -> None:
        self.emitter.site = self.outer


_UNCHANGED = nullcontext()
_MISSING = object()


class _SharedFake:
    """The fake-tensor mode every lowering in this process runs its ops in, and the outputs computed so far by op
    and input metadata: the stages and roles of one compile (and later compiles) see the same layers' shapes."""

    LIMIT = 200_000  # entries kept before the memo starts over (each a small meta-only fake tensor)

    def __init__(self) -> None:
        self._values: dict[tuple[Any, ...], Any] = {}

    @functools.cached_property
    def mode(self) -> FakeTensorMode:
        """Made on first use: a fake mode imports ``torch._dynamo`` (about 1 s), which a process that only runs
        printed rank programs never needs."""
        return FakeTensorMode(allow_non_fake_inputs=True)

    def values(self) -> dict[tuple[Any, ...], Any]:
        if len(self._values) > self.LIMIT:
            self._values = {}
        return self._values


_FAKE = _SharedFake()
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)
_PLAIN_TYPES = frozenset(_PLAIN)


def _fake_key(target: Any, args: tuple, kwargs: dict) -> tuple[Any, ...] | None:
    """What an op's fake output depends on: the op, its tensors' metadata and its other arguments (None when an
    argument is not plain data: then the op is run every time)."""
    try:
        return (target, _arg_key(args), _arg_key(tuple(sorted(kwargs.items()))))
    except _Unkeyable:
        return None


class _Unkeyable(Exception):
    pass


# id(fake value) -> (the value, its metadata key): a value is read as an argument by several ops, and reading a fake
# tensor's shape, strides, offset, dtype, device and requires_grad costs about 3.5 us
_TENSOR_KEYS: dict[int, tuple[torch.Tensor, tuple[Any, ...]]] = {}


def _tensor_key(v: torch.Tensor) -> tuple[Any, ...]:
    return ("T", tuple(v.shape), v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad)


def _arg_key(a: Any) -> Any:
    if isinstance(a, fx.Node):
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise _Unkeyable
        known = _TENSOR_KEYS.get(id(v))
        if known is None or known[0] is not v:  # the entry holds its tensor, so no other can take its id meanwhile
            known = _TENSOR_KEYS[id(v)] = (v, _tensor_key(v))
            if len(_TENSOR_KEYS) > _SharedFake.LIMIT:
                _TENSOR_KEYS.clear()
        return known[1]
    kind = type(a)
    if kind in _PLAIN_TYPES:
        return (kind, a)
    if isinstance(a, (tuple, list)):
        if all(type(x) is int for x in a):  # a shape: its ints are their own key (no other key holds bare ints)
            return (kind, tuple(a))
        return (kind, tuple([_arg_key(x) for x in a]))
    if isinstance(a, _PLAIN):
        return (kind, a)
    raise _Unkeyable
