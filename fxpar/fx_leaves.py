"""``torch.fx.Graph.create_node`` without its per-node pytree walk: the same leaves, found without generators.

torch 2.13's ``Graph.create_node`` walks every new node's arguments with ``pytree.tree_iter`` to warn about
raw ``SymInt`` arguments. ``tree_iter`` is a recursive generator that looks up each value's pytree node type:
about 15-20 us of the 36-39 us it takes to make or copy a node, which was 10-17% of ``parallelize`` on the
70B and 405B layouts of ``bench/compile_time.py`` (py-spy), spent in fxpar's own graph building (lowering,
stitching, copies) and in AOTAutograd's tracer alike. ``install`` points ``torch.fx.graph``'s ``pytree`` at a
view of ``torch.utils._pytree`` whose ``tree_iter`` yields exactly the same leaves in the same order: tuples,
lists, dicts and fx's immutable collections are walked in a loop (their registered flattening is their values
in order); any other registered container (namedtuples, ``OrderedDict``, user types) or an ``is_leaf`` goes to
the real ``tree_iter``; whether a class is a namedtuple is cached. Every other name resolves to
``torch.utils._pytree``'s own. ``tests/test_fx_leaves.py`` checks the leaves against ``pytree.tree_iter`` and
that the warning still fires.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from typing import Any

import torch.fx.graph as fx_graph
import torch.utils._pytree as pytree
from torch.fx.immutable_collections import immutable_dict, immutable_list

_SEQUENCES = (tuple, list, immutable_list)
_MAPPINGS = (dict, immutable_dict)
_LEAVES = frozenset({fx_graph.Node, int, float, bool, str, type(None)})  # never pytree nodes


def tree_iter(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """``torch.utils._pytree.tree_iter``, with the built-in containers walked in a loop."""
    if is_leaf is not None:
        return pytree.tree_iter(tree, is_leaf=is_leaf)
    out: list[Any] = []
    _collect(tree, out)
    return iter(out)


def _collect(tree: Any, out: list[Any]) -> None:
    kind = type(tree)
    if kind in _SEQUENCES:
        children: Any = tree
    elif kind in _MAPPINGS:
        children = tree.values()
    elif kind in pytree.SUPPORTED_NODES or _namedtuple_class(kind):
        out.extend(pytree.tree_iter(tree))
        return
    else:
        out.append(tree)
        return
    for child in children:
        if type(child) in _LEAVES:  # most arguments: a node or a number, no call needed
            out.append(child)
        else:
            _collect(child, out)


_NAMEDTUPLE: dict[type, bool] = {}  # whether a class is a namedtuple (a pytree node): fixed when it is made


def _namedtuple_class(kind: type) -> bool:
    known = _NAMEDTUPLE.get(kind)
    if known is None:
        known = _NAMEDTUPLE[kind] = pytree.is_namedtuple_class(kind)
    return known


class _PytreeView(types.ModuleType):
    """``torch.utils._pytree`` with ``tree_iter`` replaced."""

    def __init__(self) -> None:
        super().__init__(pytree.__name__, pytree.__doc__)
        self.tree_iter = tree_iter

    def __getattr__(self, name: str) -> Any:
        return getattr(pytree, name)


def install() -> None:
    """Make ``torch.fx.Graph.create_node`` find argument leaves with ``tree_iter`` above (idempotent)."""
    if isinstance(fx_graph.pytree, _PytreeView) or fx_graph.pytree is not pytree:
        return
    fx_graph.pytree = _PytreeView()


install()
