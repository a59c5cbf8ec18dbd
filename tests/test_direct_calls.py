"""Eager rank graphs run with each op call bound to its C++ entry point (``fxpar.direct_calls``)."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.direct_calls import DIRECT_CALLS_ENV, direct_calls
from fxpar.models.llama import llama


def _rank_graphs() -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"dp": 2}, fake=True), (tokens,))
    rp = pm._compiled.rank_program(0)
    return rp.forward, rp.backward


def test_direct_calls_run_the_same_code_to_the_bit() -> None:
    forward, _ = _rank_graphs()
    run = direct_calls(forward)
    assert run is not forward and run.graph_module is forward
    assert "torch.ops.aten.mm.default(" in forward.code  # what the GraphModule looks up on every call
    torch.manual_seed(1)
    args = [torch.randn(n.meta["val"].shape, dtype=n.meta["val"].dtype) if n.meta["val"].is_floating_point()
            else torch.randint(0, 256, n.meta["val"].shape) for n in forward.graph.find_nodes(op="placeholder")]
    want, got = forward(*args), run(*args)
    assert len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    # an edit of the graph, then recompile(), is what the next call runs (fault injection edits executed graphs)
    out = forward.graph.output_node()
    first = out.args[0][0]
    with forward.graph.inserting_before(out):
        doubled = forward.graph.call_function(torch.ops.aten.mul.Tensor, (first, 2))
    out.args = ((doubled, *out.args[0][1:]),)
    forward.recompile()
    assert torch.equal(run(*args)[0], 2 * want[0])


def test_direct_calls_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    forward, _ = _rank_graphs()
    monkeypatch.setenv(DIRECT_CALLS_ENV, "0")
    assert direct_calls(forward) is forward
