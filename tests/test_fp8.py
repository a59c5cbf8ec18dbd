"""FP8 (``Plan(fp8=...)``): Linear matmuls as ``torch._scaled_mm`` on float8, with sharding-aware scales.

Accuracy is torchao's: SNR against fp32 of at least 25 dB for a cast, 18 dB for outputs and 17 dB for weight
gradients. Tensor-parallel FP8 must compute what single-device FP8 computes (a tensorwise scale is the amax of
the whole tensor): tp=2 is checked against dp=2 fed the same sample on both ranks (each rank then runs the
whole, unsharded FP8 program), at 40 dB or better.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fxpar.passes.fp8 import E4M3, E5M2, quantize

import fxpar
from fxpar.models.llama import MLP as LlamaMLP
from fxpar.models.llama import LlamaConfig
from fxpar.testing import default_pool
from fxpar.testing.probes import fp8_step

CONFIG = LlamaConfig(hidden=64, intermediate=128)
MLP_PLAN = {"gate": "colwise", "up": "colwise", "down": "rowwise"}


def snr(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Signal-to-noise ratio in dB (torchao's ``compute_error``)."""
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


def reference(x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = LlamaMLP(CONFIG)
    out = model(x)
    out.pow(2).mean().backward()
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("rowwise", [False, True])
def test_casts_keep_25_db(dtype: torch.dtype, rowwise: bool) -> None:
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * 3
    x8, inverse = quantize(x, dtype, [1] if rowwise else [0, 1])
    assert x8.dtype == dtype
    assert snr(x, x8.float() * inverse) >= 25


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_llama_mlp_outputs_and_weight_grads_against_fp32(recipe: str) -> None:
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = reference(x)
    [r0, _] = default_pool().run(fp8_step, 2, CONFIG, {"tp": 2}, fxpar.Plan(tp=MLP_PLAN, fp8=recipe), x, timeout=300)
    assert snr(ref_out, r0["output"]) >= 18
    for name, g in ref_grads.items():
        assert snr(g, r0["grads"][name]) >= 17, name


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_tp2_fp8_equals_single_device_fp8(recipe: str) -> None:
    # dp=2 fed [x; x]: each rank runs the unsharded FP8 program on x, and the mean of equal gradients is that
    # gradient; tp=2 on x shards every Linear, so its scales need the max over shards
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    pool = default_pool()
    [tp, _] = pool.run(fp8_step, 2, CONFIG, {"tp": 2}, fxpar.Plan(tp=MLP_PLAN, fp8=recipe), x, timeout=300)
    [dp, _] = pool.run(fp8_step, 2, CONFIG, {"dp": 2}, fxpar.Plan(fp8=recipe), torch.cat([x, x]), timeout=300)
    assert snr(dp["output"][: len(x)], tp["output"]) >= 40
    for name, g in dp["grads"].items():
        assert snr(g, tp["grads"][name]) >= 40, name


def test_tensorwise_scale_of_a_sharded_weight_is_one_scalar_max_all_reduce() -> None:
    x = torch.randn(2, 16, 64)
    pm = fxpar.parallelize(LlamaMLP(CONFIG), fxpar.Mesh({"tp": 2}, fake=True), (x,),
                           plan=fxpar.Plan(tp=MLP_PLAN, fp8="tensorwise"))
    text = pm.program(0)
    assert text.count("aten._scaled_mm(") == 3 + 4  # forward gate, up, down; backward: 3 weight grads + down input grad
    maxes = [r for r in pm.ledger(0) if r.op == "all_reduce_max"]
    assert maxes and all(r.shape == () and r.bytes == 4 for r in maxes)


def test_fp8_errors_name_the_module() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 24))
    tokens = torch.randint(0, 32, (2, 8))
    mesh = fxpar.Mesh({"tp": 2}, fake=True)
    with pytest.raises(fxpar.PlanError, match=r"'0' is a Embedding, which has no fp8 path"):
        fxpar.parallelize(model, mesh, (tokens,), plan=fxpar.Plan(fp8={"0": "tensorwise"}))
    with pytest.raises(fxpar.PlanError, match=r"Linear '1' is 16 -> 24; torch._scaled_mm needs both dims"):
        fxpar.parallelize(model, mesh, (tokens,), plan=fxpar.Plan(fp8={"1": "tensorwise"}))
    with pytest.raises(fxpar.PlanError, match=r"the recipe must be one of"):
        fxpar.parallelize(model, mesh, (tokens,), plan=fxpar.Plan(fp8="blockwise"))
    with pytest.raises(fxpar.PlanError, match=r"fp8\['11'\] matches no module of the model; did you mean: 1\?"):
        fxpar.parallelize(model, mesh, (tokens,), plan=fxpar.Plan(fp8={"11": "tensorwise"}))
    convs = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(2, 8))  # it was a silent no-op
    with pytest.raises(fxpar.PlanError, match=r"fp8='tensorwise': the model has no nn.Linear"):
        fxpar.parallelize(convs, fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(2, 3, 8, 8),),
                          plan=fxpar.Plan(fp8="tensorwise"))


def test_fp8_composes_with_zero3_tp_and_sequence_parallel() -> None:
    # the fp8 program trains like the fp32 one (the same losses to FP8's precision) on dp=2 x tp=2
    from fxpar.models.llama import llama_plan
    from fxpar.testing.probes import llama_losses

    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    plan = fxpar.Plan(tp=llama_plan(), zero=3, sequence_parallel=True)
    pool = default_pool()
    fp32 = pool.run(llama_losses, 4, {"dp": 2, "tp": 2}, plan, tokens, 3, timeout=300)[0]
    fp8 = pool.run(llama_losses, 4, {"dp": 2, "tp": 2}, dataclasses.replace(plan, fp8="tensorwise"), tokens, 3,
                   timeout=300)[0]
    assert fp8 == pytest.approx(fp32, rel=2e-2) and fp8[-1] < fp8[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_zero3_gathers_weights_in_float8_at_a_quarter_of_the_bytes(recipe: str) -> None:
    # the ZeRO-3 all-gather of each weight moves its float8 cast (1 byte per element) instead of fp32; what
    # remains is the scales: a one-scalar max all-reduce (tensorwise) or the gathered row scales (rowwise)
    x = torch.randn(4, 16, 64)
    mesh = fxpar.Mesh({"dp": 2}, fake=True)
    fp32 = fxpar.parallelize(LlamaMLP(CONFIG), mesh, (x,), plan=fxpar.Plan(zero=3))
    pm = fxpar.parallelize(LlamaMLP(CONFIG), mesh, (x,), plan=fxpar.Plan(zero=3, fp8=recipe))
    full = [r for r in fp32.ledger(0) if r.op == "all_gather" and r.phase == "fwd"]
    f8 = [r for r in pm.ledger(0) if r.op == "all_gather" and r.dtype == E4M3 and r.phase == "fwd"]
    assert sum(r.bytes * 4 for r in f8) == sum(r.bytes for r in full)  # fp32: one flat gather of the block
    assert len(f8) == 3 and len(full) == 1  # float8: one gather per weight (each cast on its shard)
    fp32_gathers = [r for r in pm.ledger(0) if r.op == "all_gather" and r.dtype == torch.float32]
    out_features = [128, 128, 64]  # gate, up, down: one fp32 scale per weight row
    if recipe == "tensorwise":
        assert not fp32_gathers
    else:
        assert [r.bytes for r in fp32_gathers if r.phase == "fwd"] == [4 * n for n in out_features]
    assert "fp8_gather" in pm.program(0).splitlines()[2]  # the passes line of the header


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("axes", [{"dp": 2}, {"dp": 2, "tp": 2}], ids=["dp2", "dp2xtp2"])
def test_zero3_float8_gather_computes_what_the_unsharded_cast_computes(recipe: str, axes: dict[str, int]) -> None:
    # casting a shard with the global amax (a max over dp and tp shards), then gathering, is exactly gathering
    # then casting: outputs bitwise equal, gradients up to the reduce-scatter's vs the all-reduce's order
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(3))
    tp = MLP_PLAN if "tp" in axes else {}
    world = 2 * axes.get("tp", 1)
    pool = default_pool()
    z3 = pool.run(fp8_step, world, CONFIG, axes, fxpar.Plan(tp=tp, zero=3, fp8=recipe), x, timeout=300)[0]
    dp = pool.run(fp8_step, world, CONFIG, axes, fxpar.Plan(tp=tp, fp8=recipe), x, timeout=300)[0]
    torch.testing.assert_close(z3["output"], dp["output"], rtol=0, atol=0)
    for name, g in dp["grads"].items():
        torch.testing.assert_close(z3["grads"][name], g, rtol=1e-6, atol=0, msg=name)


def test_fp8_under_bf16_mixed_precision_keeps_fp32_scales_and_matches_unsharded() -> None:
    # param_dtype=bf16: the casts feed float8 from bf16 (scales stay fp32, _scaled_mm outputs bf16); tp=2 and
    # zero=3 against the unsharded program on each dp rank, at 30 dB (bf16 partial sums round before the all-reduce)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2))
    mixed = {"fp8": "tensorwise", "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    pool = default_pool()
    [tp, _] = pool.run(fp8_step, 2, CONFIG, {"tp": 2}, fxpar.Plan(tp=MLP_PLAN, **mixed), x, timeout=300)
    [z3, _] = pool.run(fp8_step, 2, CONFIG, {"dp": 2}, fxpar.Plan(zero=3, **mixed), torch.cat([x, x]), timeout=300)
    [dp, _] = pool.run(fp8_step, 2, CONFIG, {"dp": 2}, fxpar.Plan(**mixed), torch.cat([x, x]), timeout=300)
    # ZeRO-1 feeds float8 from its bf16 working copy (cast on the shard): the same values as casting the master
    [z1, _] = pool.run(fp8_step, 2, CONFIG, {"dp": 2}, fxpar.Plan(zero=1, **mixed), torch.cat([x, x]), timeout=300)
    assert dp["output"].dtype == torch.bfloat16
    torch.testing.assert_close(z1["output"], dp["output"], rtol=0, atol=0)
    for got in (tp, z3, z1):
        assert snr(dp["output"][: len(x)].float(), got["output"][: len(x)].float()) >= 30
        for name, g in dp["grads"].items():
            assert g.dtype == torch.float32 and snr(g, got["grads"][name]) >= 30, name


def test_an_equivalence_mismatch_under_fp8_says_the_reference_is_full_precision() -> None:
    from fxpar.testing.equivalence import Case, Mismatch, _explain

    x = torch.randn(4, 16, 64)
    mismatch = [Mismatch("output[0]", rank=0, step=0, max_abs=0.1, max_rel=0.05, rtol=1e-5, atol=1e-6)]
    for fp8, said in [("tensorwise", True), (None, False)]:
        case = Case(LlamaMLP, {"tp": 2}, fxpar.Plan(tp=MLP_PLAN, fp8=fp8), (x,), 1, None, None, 1e-3, 0, None, None,
                    False)
        assert ("single-device reference computes in full precision" in _explain(case, mismatch)) is said


def test_a_row_parallel_fp8_linear_runs_on_its_shards_and_all_reduces_its_output() -> None:
    """The float8 operands of a row-parallel Linear cost fewer bytes to gather than its fp32 partial product costs to
    all-reduce, so the propagation used to gather the activation and the whole weight over tp and run ``down`` whole on
    every rank (tp times its FLOPs). A weight's fp8 cast now counts as the weight: the output is all-reduced, as
    without fp8."""
    x = torch.randn(4, 16, 64)
    for recipe in ("tensorwise", "rowwise"):
        pm = fxpar.parallelize(LlamaMLP(CONFIG), fxpar.Mesh({"tp": 2}, fake=True), (x,),
                               plan=fxpar.Plan(tp=MLP_PLAN, fp8=recipe))
        rows = [r for r in pm.ledger(0) if r.op != "all_reduce_max"]
        assert [(r.phase, r.op, r.shape) for r in rows] == [("fwd", "all_reduce", (4, 16, 64))], (recipe, rows)
