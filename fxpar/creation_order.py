"""The order in which a trace created its nodes' names, dead code included.

A whole-model trace numbers ``getitem``, ``getitem_1``, ... in the order it creates nodes, and keeps the names of
nodes it then drops as dead code (a norm without weights gives its backward's unused outputs names, a causal mask
builds an ``expand`` nothing reads). ``fxpar.stitch`` rebuilds that numbering from traces of parts of the model, so
it must take each dropped name where the trace made it: before a block's call, not at the next node of the same
base after it. ``recording_names`` keeps, on each graph's namespace, the names it handed out, in order.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx as fx
from torch.fx.graph import _Namespace

from fxpar.blocks import base_name

_RECORD = "_fxpar_created"


@contextmanager
def recording_names() -> Iterator[None]:
    """Inside, every graph namespace lists the names it creates (``created_names``)."""
    original = _Namespace.create_name

    def create_name(self: _Namespace, candidate: str, obj: Any | None) -> str:
        name = original(self, candidate, obj)
        self.__dict__.setdefault(_RECORD, []).append(name)
        return name

    _Namespace.create_name = create_name  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Namespace.create_name = original  # type: ignore[method-assign]


def created_names(graph: fx.Graph) -> list[str]:
    """The names ``graph``'s namespace created while ``recording_names`` was on, in order (empty if it was off)."""
    return list(graph._graph_namespace.__dict__.get(_RECORD, ()))


def dead_names_before(graph: fx.Graph, opaque: Callable[[fx.Node], bool] = lambda n: False
                      ) -> tuple[dict[str, list[str]], list[str], set[str]]:
    """For each live node's name, the dropped names created after the previous live node and before it; the
    dropped names created after the last live node; and the dropped ``getitem`` names of ``opaque`` nodes' outputs
    (a whole-model trace has no such node: the op stands for nodes whose outputs have their own names)."""
    live = {n.name: n for n in graph.nodes}
    before: dict[str, list[str]] = {}
    pending: list[str] = []
    unpacked: set[str] = set()
    unpacking = False  # the last node made was an opaque op or one of its outputs
    for name in created_names(graph):
        node = live.get(name)
        if node is not None:
            if pending:
                before[name], pending = pending, []
            unpacking = opaque(node) or (node.target is operator.getitem and isinstance(node.args[0], fx.Node) and
                                         opaque(node.args[0]))
        else:
            pending.append(name)
            if unpacking and base_name(name) == "getitem":
                unpacked.add(name)
            else:
                unpacking = False
    return before, pending, unpacked


def put_first(graph: fx.Graph, names: list[str], dropping: set[str]) -> None:
    """Record ``names`` as the first ``graph`` created, in order, and forget the names in ``dropping`` (placeholders
    renamed or added after the trace: a trace creates every placeholder before any other node)."""
    record = graph._graph_namespace.__dict__.get(_RECORD)
    if record is not None:
        record[:] = names + [x for x in record if x not in dropping]
