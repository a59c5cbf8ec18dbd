"""``fxpar.fx_leaves``: ``torch.fx.Graph.create_node`` finds argument leaves faster, and finds the same ones."""

from __future__ import annotations

import collections
import warnings

import torch
import torch.fx as fx
import torch.fx.graph as fx_graph
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st
from torch.fx.immutable_collections import immutable_dict, immutable_list

import fxpar  # noqa: F401  (installs the view)
from fxpar.fx_leaves import tree_iter

Point = collections.namedtuple("Point", "x y")
LEAVES = st.one_of(st.integers(), st.none(), st.text(max_size=3), st.just(torch.float32), st.just(slice(1, 4)))


def _containers(inner: st.SearchStrategy) -> st.SearchStrategy:
    items, mapping = st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=2), inner, max_size=3)
    return st.one_of(items, items.map(tuple), items.map(immutable_list), mapping, mapping.map(immutable_dict),
                     mapping.map(collections.OrderedDict), st.tuples(inner, inner).map(lambda t: Point(*t)))


TREES = st.recursive(LEAVES, _containers, max_leaves=12)


@given(TREES)
def test_the_same_leaves_in_the_same_order(tree: object) -> None:
    assert list(tree_iter(tree)) == list(pytree.tree_iter(tree))
    assert list(tree_iter(tree, is_leaf=lambda x: isinstance(x, tuple))) == list(
        pytree.tree_iter(tree, is_leaf=lambda x: isinstance(x, tuple)))


def test_create_node_uses_it_and_still_warns_on_a_raw_symint() -> None:
    assert fx_graph.pytree.tree_iter is tree_iter and fx_graph.pytree.tree_map is pytree.tree_map
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    sym = env.create_unbacked_symint()
    g = fx.Graph()
    x = g.placeholder("x")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g.call_function(torch.ops.aten.view.default, (x, [2, (sym,)]))
    assert any("Raw SymInt" in str(w.message) for w in caught)
