"""Eager rank graphs run with each op call bound to its C++ entry point (``fxpar.direct_calls``)."""

from __future__ import annotations

import pytest
import torch
from fxpar.backends import classic
from fxpar.backends.classic import CLASSIC

import fxpar
from fxpar.direct_calls import DIRECT_CALLS_ENV, _bound_forward, direct_calls
from fxpar.models.llama import llama, llama_plan
from fxpar.testing.pool import default_pool
from fxpar.testing.probes import gloo_apis_against_each_other

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


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


def test_gloo_rank_graphs_bind_their_collectives_to_the_classic_api() -> None:
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=llama_plan(), zero=3))
    backward = pm._compiled.rank_program(0).backward
    run = direct_calls(backward, CLASSIC)
    scope = _bound_forward(backward, backward.code, CLASSIC, direct=True).__globals__
    assert scope["_op__c10d_functional_wait_tensor_default"] is classic.wait_tensor
    assert scope["_op__c10d_functional_reduce_scatter_tensor_default"] is classic.reduce_scatter_tensor
    assert scope["_op_aten_mm_default"] is torch.ops.aten.mm.default._op
    assert run.graph_module is backward and "comm.wait(" in pm.program(0)  # printed as is


@pytest.mark.parametrize(("axes", "plan"), [
    ({"dp": 2, "tp": 2}, {"zero": 3, "overlap": True, "bucket_mb": 0.05, "sequence_parallel": True}),
    ({"pp": 2, "dp": 2}, {"stages": 2, "microbatches": 2, "zero": 1})], ids=["zero3+sp+overlap", "pp2xdp2"])
def test_gloo_collectives_through_the_classic_api_compute_what_the_functional_ops_do(axes: dict, plan: dict) -> None:
    # gloo lost ranks through the functional ops and never through the classic API (bench/README.md section 12):
    # the classic path is the default and must be bitwise the functional one (same collectives, same order)
    plan = fxpar.Plan(tp=llama_plan() if "tp" in axes else {}, **plan)
    runs = default_pool().run(gloo_apis_against_each_other, 4, axes, plan, TOKENS, timeout=300)
    for rank in runs:
        classic_run, functional_run = rank["classic"], rank["functional"]
        assert classic_run["issued"] > 0 and functional_run["issued"] == 0
        assert classic_run["pending"] == functional_run["pending"] == 0
        assert classic_run["losses"] == functional_run["losses"]
        assert all(torch.equal(classic_run["grads"][n], g) for n, g in functional_run["grads"].items())
