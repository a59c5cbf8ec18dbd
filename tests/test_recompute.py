"""Activation recompute (``Plan(recompute="full" | "selective")``): equivalence with the single device, the
printed backward, the ledger's re-issued collectives, and saved bytes predicted = measured."""

from __future__ import annotations

import functools
from functools import partial

import pytest
import torch

import fxpar
from fxpar.memory import saved_per_microbatch
from fxpar.models.llama import llama, llama_plan
from fxpar.models.mlp import mlp
from fxpar.testing import assert_equivalent, default_pool
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.probes import measured_memory

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


@functools.cache
def _activations(policy: str | int | None, layers: int = 4) -> int:
    """Rank 0's saved bytes on a fake tp=2 mesh, Llama with ``layers`` layers (hidden 64): what its forward saves
    (``pm.memory(0).activations`` adds the logits' gradient ``pm.step`` holds)."""
    pm = fxpar.parallelize(llama(n_layers=layers), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=llama_plan(), recompute=policy))
    return saved_per_microbatch(pm._compiled, 0)


POLICIES = ["full", "selective", 200_000]  # 200 kB: between full (~60 kB at 2 layers) and none


@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_at_tp2_matches_single_device(policy: str | int) -> None:
    plan = fxpar.Plan(tp=llama_plan(), recompute=policy)
    assert_equivalent(partial(llama, n_layers=2), {"tp": 2}, plan, (TOKENS,), steps=2, loss_fn=next_token_loss,
                      targets=TOKENS)


@pytest.mark.parametrize("policy", POLICIES)
def test_recompute_with_zero3_tp2_and_sequence_parallel_matches_single_device(policy: str | int) -> None:
    plan = fxpar.Plan(tp=llama_plan(), zero=3, sequence_parallel=True, recompute=policy)
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2, "tp": 2}, plan, (TOKENS,), steps=2,
                      loss_fn=next_token_loss, targets=TOKENS)


@pytest.mark.parametrize("budget", [120_000, 150_000, 300_000, 2_000_000])
def test_budget_is_respected_and_spends_it_on_matmuls(budget: int) -> None:
    saved = _activations(budget)
    assert _activations("full") <= saved <= budget
    assert saved <= _activations("selective")  # beyond selective's bytes only cheap ops are left to save
    if budget >= _activations("selective"):
        assert saved == _activations("selective")


def test_budget_below_the_block_inputs_is_a_clear_error() -> None:
    with pytest.raises(fxpar.PlanError, match=r"recompute budget 1,000 B is below the minimum .* B \(every block's"):
        _activations(1000)
    # with stages, the budget holds for each stage's forward of one microbatch: the error names the stage
    with pytest.raises(fxpar.PlanError, match=r"minimum stage 1's forward \(one microbatch, on its first rank\)"):
        fxpar.parallelize(llama(n_layers=4), fxpar.Mesh({"pp": 2}, fake=True), (TOKENS,),
                          plan=fxpar.Plan(stages=2, microbatches=2, recompute=20_000), loss_fn=next_token_loss)


def test_saved_activations_full_at_most_a_quarter_of_none_and_selective_between() -> None:
    none, selective, full = (_activations(p) for p in (None, "selective", "full"))
    assert full * 4 <= none, (full, none)
    assert full < selective < none, (full, selective, none)


def test_full_saves_one_block_input_per_layer() -> None:
    # four layers save 2 more block inputs than two: b_local * s * hidden fp32 each (hidden 64)
    per_layer = (_activations("full", 4) - _activations("full", 2)) // 2
    assert per_layer == TOKENS.numel() * 64 * 4


def test_recomputed_ops_and_collectives_show_in_backward_and_ledger() -> None:
    plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=True, recompute="full")
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,), plan=plan)
    backward = pm.program(0).split("def backward", 1)[1]
    assert "recomputed" in backward
    base = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,),
                             plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True))

    def gathers(p: fxpar.ParallelModule) -> int:
        return sum(1 for r in p.ledger(0) if r.phase == "bwd" and r.op == "all_gather")

    assert gathers(pm) > gathers(base)  # the SP all-gathers inside each block run again in backward
    fxpar.verify(pm)


def test_predicted_saved_bytes_equal_measured() -> None:
    plan = fxpar.Plan(tp=llama_plan(), recompute="selective")
    for r in default_pool().run(measured_memory, 2, llama, {"tp": 2}, plan, TOKENS, next_token_loss, timeout=300):
        assert r["predicted"].activations == r["held"] > r["saved_per_microbatch"]  # the logits' gradient besides


def test_bad_recompute_values_are_clear_errors() -> None:
    with pytest.raises(fxpar.PlanError, match="recompute must be None"):
        fxpar.parallelize(llama(n_layers=1), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,),
                          plan=fxpar.Plan(recompute="everything"))
    with pytest.raises(fxpar.PlanError, match="no repeated blocks"):
        fxpar.parallelize(mlp(), fxpar.Mesh({"tp": 2}, fake=True), (torch.randn(4, 32),),
                          plan=fxpar.Plan(recompute="full"))


@pytest.mark.parametrize("policy", ["full", 150_000])
def test_recompute_in_pipeline_stages_matches_single_device(policy: str | int) -> None:
    # each stage recomputes its own blocks; the budget holds per stage program
    plan = fxpar.Plan(stages=2, schedule="1f1b", microbatches=2, recompute=policy)
    assert_equivalent(partial(llama, n_layers=4), {"pp": 2}, plan, (TOKENS,), steps=2, loss_fn=next_token_loss,
                      targets=TOKENS)



class _Stack(torch.nn.Module):
    """Residual blocks of ``make()`` over ``layers`` (recompute acts on repeated blocks)."""

    def __init__(self, make: object, layers: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(make() for _ in range(layers))  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_selective_saves_a_biased_linear_of_2d_rows_and_convolutions() -> None:
    """A biased Linear over ``[rows, features]`` is fused back to one ``addmm`` after lowering; the fused node took the
    bias add's meta, "recompute me", so selective re-ran the matmul and no byte budget could save it. Convolutions are
    saved like matmuls."""
    mlp2d = _Stack(lambda: torch.nn.Sequential(torch.nn.Linear(26, 42), torch.nn.GELU(), torch.nn.Linear(42, 26)))
    conv = _Stack(lambda: torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.GELU(),
                                              torch.nn.Conv2d(8, 3, 3, padding=1)))
    heavy = {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.convolution.default}
    for model, x in ((mlp2d, torch.randn(8, 26)), (conv, torch.randn(4, 3, 8, 8))):
        pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (x,), plan=fxpar.Plan(recompute="selective"))
        rerun = [n for n in pm.rank_program(0).backward.graph.nodes if n.meta.get("fxpar_recompute")]
        assert rerun and not [n.name for n in rerun if n.target in heavy], [n.name for n in rerun]
