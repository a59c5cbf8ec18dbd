"""``Plan(compile=True)``: every rank graph compiled by Inductor, collectives kept in the compiled graph.

Equivalence is against the single-device model at fp32 tolerance (rtol 1e-5): Inductor fuses pointwise ops and
reorders sums inside fused kernels, which moves results by rounding only. The harness also holds the ledger to
the collectives the compiled graphs issue (Inductor calls the in-place functional variants; they are counted).
"""

from __future__ import annotations

import shutil
from functools import partial

import pytest
import torch
import torch.fx as fx

import fxpar
from fxpar.errors import InductorError
from fxpar.inductor import compiled_graph
from fxpar.models.llama import llama, llama_plan
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="Inductor's CPU backend needs a C++ compiler")
TOKENS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))


def test_dp2_tp2_compiled_matches_the_single_device() -> None:
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), compile=True),
                      (TOKENS,), steps=2)


def test_zero3_compiled_matches_the_single_device() -> None:
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2}, fxpar.Plan(zero=3, compile=True), (TOKENS,), steps=2)


def test_pipeline_1f1b_compiled_matches_the_single_device() -> None:
    plan = fxpar.Plan(stages=2, microbatches=2, schedule="1f1b", compile=True)
    assert_equivalent(partial(llama, n_layers=2), {"pp": 2}, plan, (TOKENS,), steps=2, loss_fn=next_token_loss,
                      targets=TOKENS)


def test_a_compiler_failure_names_the_rank_graph_and_node(monkeypatch: pytest.MonkeyPatch) -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.mm(a, b).relu(),)

    gm = fx.symbolic_trace(f)

    def fails(gm: fx.GraphModule, args: list[torch.Tensor]) -> None:
        raise RuntimeError("LoweringException: no lowering for %mm while compiling")

    monkeypatch.setattr("fxpar.inductor.compile_fx", fails)
    run = compiled_graph(gm, "rank 3 stage 1 backward")
    with pytest.raises(InductorError, match=r"rank 3 stage 1 backward: RuntimeError: LoweringException.*\n  at node mm"
                       ):
        run(torch.randn(2, 2), torch.randn(2, 2))


def test_a_lowering_failure_names_the_node_being_executed_not_the_first_of_its_op(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor's lowering errors name the op (``target: aten.mm.default``) and end with the node fx was running:
    that node is the one named, not the graph's first ``mm``."""
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.mm(torch.mm(a, b), b).relu(),)

    gm = fx.symbolic_trace(f)
    gm.graph.eliminate_dead_code()
    second = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.mm][-1]

    def fails(gm: fx.GraphModule, args: list[torch.Tensor]) -> None:
        raise RuntimeError(f"LoweringException: NotImplementedError: no lowering\n  target: aten.mm.default\n"
                           f"  args[0]: TensorBox(...)\n\nWhile executing {second.format_node()}")

    monkeypatch.setattr("fxpar.inductor.compile_fx", fails)
    with pytest.raises(InductorError, match=rf"\n  at node {second.name}:"):
        compiled_graph(gm, "rank 0 stage 0 forward")(torch.randn(2, 2), torch.randn(2, 2))


def test_a_real_lowering_failure_names_the_rank_graphs_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inductor lowers its own retrace of a rank graph, and its ``LoweringException`` names only the op and its
    buffers: the error named no node. The node is now read off the lowering's stack (``from_node``); here the second
    ``addmm`` of an MLP's forward fails, and that one is named, not the first."""
    import torch._inductor.config as inductor_config
    import torch._inductor.lowering as lowering

    from fxpar.models.mlp import mlp

    pm = fxpar.parallelize(mlp(), fxpar.Mesh({"dp": 1}, fake=True), (torch.randn(8, 32),),
                           plan=fxpar.Plan(compile=True))
    gm = pm.rank_program(0).forward
    args = [torch.randn(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]
    original, calls = lowering.lowerings[torch.ops.aten.addmm.default], []

    def second_fails(*a: object, **k: object) -> object:
        calls.append(1)
        if len(calls) == 2:
            raise NotImplementedError("no lowering today")
        return original(*a, **k)

    monkeypatch.setitem(lowering.lowerings, torch.ops.aten.addmm.default, second_fails)
    addmms = [n.name for n in gm.graph.nodes if n.target is torch.ops.aten.addmm.default]
    with inductor_config.patch(fx_graph_cache=False), pytest.raises(  # (torch's config: not monkeypatch's to undo)
            InductorError, match=rf"rank 0 stage 0 forward: .*no lowering today(.|\n)*at node {addmms[1]}:"):
        compiled_graph(gm, "rank 0 stage 0 forward")(*args)


def test_compiled_graph_returns_what_the_graph_returns() -> None:
    def f(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.mm(a, b).relu(), a * 2 + b

    gm = fx.symbolic_trace(f)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    run = compiled_graph(gm, "rank 0 stage 0 forward")
    for _ in range(2):  # compiled on the first call, reused on the second
        got, want = run(a, b), gm(a, b)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_compiled_pipeline_with_zero1_full_recompute_and_mixed_precision() -> None:
    """Compiled mixed precision too (bf16 compute from fp32 masters, fp32 reductions), composed with pp, dp, ZeRO-1
    and full recompute, checked at the bf16 tolerance."""
    # full recompute tags nodes in their meta: torch's own "recompute" key must not be taken (Inductor reads it)
    plan = fxpar.Plan(stages=2, microbatches=2, zero=1, recompute="full", compile=True,
                      param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert_equivalent(partial(llama, n_layers=2), {"pp": 2, "dp": 2}, plan, (TOKENS,), steps=2,
                      loss_fn=next_token_loss, targets=TOKENS)
