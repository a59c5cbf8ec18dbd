"""Hugging Face architecture families, unmodified, through ``fxpar.parallelize`` (issue 10's sweep).

Every family (``fxpar.models.hf_families``: 23 models from 22 families, tiny random configs) compiles on fake
meshes:

* dp=2: the ledger is DDP's optimum, exactly the bytes of the parameters that get a gradient, all-reduced
  once in the backward, and nothing else moves over dp (no op gathers the batch: every rank computes only
  its own share);
* tp=2 with ``Plan(tp="hf")`` for each family whose config carries HF's own tensor-parallel plan (a
  Megatron plan by module glob, ``hf_families.TP_PLANS``, for the rest that run on gloo).

On real gloo ranks, a subset that covers each distinct class of model (attention kind, fused weights,
parallel blocks, encoder, encoder-decoder, MoE, learned positions) matches the single device at dp=2 and
at tp=2: outputs and gradients at fp32 rtol 1e-5, then parameters after 3 AdamW steps
(``fxpar.testing.tolerance``).
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

import fxpar
from fxpar.capture_memo import CaptureMemo
from fxpar.testing import assert_equivalent

pytest.importorskip("transformers")
from fxpar.models import hf_families, hf_families_wide  # noqa: E402

HF_PLAN = {"llama", "mistral", "gemma2", "gemma3", "qwen2", "qwen3", "phi3", "gpt_neox", "cohere", "mixtral",
           "mixtral_batched", "qwen2_moe", "qwen3_moe", "olmoe", "olmo2", "granite", "starcoder2"}
# families whose forward moves only k, v (per layer) and the logits over cp: every other activation stays a
# sequence shard (T5 and BART also return the encoder's output, gathered too). The rest also compile and match, but
# gather more: MoE experts run on flattened tokens. (OPT flattens its tokens itself before its MLP, and Falcon's
# 3-D matmul meets an in-place add as a flatten and un-flatten: fxpar.token_rows and round_trip_views keep both.)
CP_LEAN = {"llama", "mistral", "gemma2", "gemma3", "qwen2", "qwen3", "phi3", "gpt_neox", "cohere", "falcon", "gpt2",
           "opt", "bert", "olmo2", "stablelm", "granite", "starcoder2"}
ON_GLOO = ["llama", "gemma2", "phi3", "gpt_neox", "bert", "t5", "gpt2", "mixtral", "mixtral_batched", "qwen2_moe"]


def _call(model: torch.nn.Module, batch: tuple | dict) -> object:
    return model(**batch) if isinstance(batch, dict) else model(*batch)


def _params_with_grads(family: str) -> list[torch.Tensor]:
    model = hf_families.builder(family)()
    out = _call(model, hf_families.inputs(family))
    out.logits.float().pow(2).mean().backward()
    return [p for p in model.parameters() if p.grad is not None]


# each family is compiled under several meshes: its capture is reused by family name (fxpar.capture_memo;
# tests/test_capture_memo.py shows a reused capture compiles to the same programs)
CAPTURES = CaptureMemo(size=len(hf_families.FAMILIES) + 8)


def _compile(family: str, axes: dict[str, int], plan: fxpar.Plan | None = None) -> fxpar.ParallelModule:
    model = hf_families.builder(family)()
    with warnings.catch_warnings(), CAPTURES.vouching(model, key=family):
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        return fxpar.parallelize(model, fxpar.Mesh(axes, fake=True), hf_families.inputs(family), plan=plan)


@pytest.mark.parametrize("family", hf_families.FAMILIES)
def test_dp_moves_exactly_the_gradient_bytes_and_never_the_batch(family: str) -> None:
    pm = _compile(family, {"dp": 2})
    for rank in (0, 1):
        rows = pm.ledger(rank)
        assert [r for r in rows if r.op != "all_reduce" or r.phase != "bwd"] == []
        assert sum(r.bytes for r in rows) == sum(p.numel() * p.element_size() for p in _params_with_grads(family))


@pytest.mark.parametrize("family", sorted(HF_PLAN))
def test_hf_tensor_parallel_plan_compiles_and_shards(family: str) -> None:
    pm = _compile(family, {"tp": 2}, fxpar.Plan(tp="hf"))
    sharded = [r for r in pm.ledger(0) if r.axis == "tp"]
    assert sharded, "the HF plan sharded nothing"
    assert "tp:S(" in pm.program(0)


# one family per class for the suite's time (FXPAR_CP_SWEEP=all for every family; all 23 compile)
CP_SWEEP = hf_families.FAMILIES if os.environ.get("FXPAR_CP_SWEEP") == "all" else [
    "llama", "gemma2", "phi3", "gpt_neox", "falcon", "gpt2", "opt", "bert", "t5", "bart", "mixtral", "starcoder2"]


@pytest.mark.parametrize("family", CP_SWEEP)
def test_context_parallel_compiles_and_keeps_the_sequence_sharded(family: str) -> None:
    pm = _compile(family, {"cp": 2})
    rows = [r for r in pm.ledger(0) if r.axis == "cp"]
    forward = [r for r in rows if r.phase == "fwd"]
    assert forward and all(r.op == "all_gather" for r in forward)
    assert "cp:S(" in pm.program(0)
    if family in CP_LEAN:  # 2 layers: k and v each, then the logits for the output
        assert len(forward) == 2 * 2 + 1, [r.shape for r in forward]


MOE = ["mixtral", "mixtral_batched", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.mark.parametrize("family", [*MOE, "mixtral_eager_experts"])
def test_expert_parallel_compiles_and_routes_tokens(family: str) -> None:
    """At dp=2 x ep=2 each MoE layer routes with five all-to-alls over ep (three forward, two backward) and nothing
    gathers the batch. HF's eager experts (a data-dependent Python loop, a capture error at dp) trace as one op."""
    model = hf_families.builder(family)()
    with CAPTURES.vouching(model, key=family):
        pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2, "ep": 2}, fake=True),
                               hf_families.inputs(family.removesuffix("_eager_experts")))
    rows = pm.ledger(0)
    assert len([r for r in rows if r.op == "all_to_all" and r.axis == "ep"]) == 5 * hf_families.LAYERS
    assert not [r for r in rows if r.op == "all_gather"]
    assert "ep:S(0)" in pm.program(0)


def test_an_encoder_decoder_with_its_kv_cache_on_compiles_matches_and_keeps_its_configs() -> None:
    """T5's decoder stack holds its own copy of the config and returns an ``EncoderDecoderCache`` while
    ``use_cache`` is on there: compiling turns every config's cache off for the trace (and back on after), and the
    equivalence harness runs the reference as the compiled step runs (dp=2, ZeRO-2, fp32)."""
    model = hf_families.t5_with_cache()
    fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), hf_families.inputs("t5"))
    assert model.config.use_cache and model.decoder.config.use_cache
    assert_equivalent(hf_families.t5_with_cache, {"dp": 2}, fxpar.Plan(zero=2), hf_families.inputs("t5", seed=1),
                      steps=2)


def test_families_without_an_hf_plan_say_so() -> None:
    with pytest.raises(fxpar.PlanError, match="tp_plan"):
        _compile("gpt2", {"tp": 2}, fxpar.Plan(tp="hf"))


@pytest.mark.parametrize("family", ON_GLOO)
def test_matches_single_device_at_dp2(family: str) -> None:
    torch.manual_seed(0)
    assert_equivalent(hf_families.builder(family), {"dp": 2}, None, hf_families.inputs(family, seed=1))


@pytest.mark.parametrize("family", ON_GLOO)
def test_matches_single_device_at_tp2(family: str) -> None:
    # HF's own plan where the config has one, else a Megatron plan by module glob
    plan = fxpar.Plan(tp="hf" if family in HF_PLAN else hf_families.TP_PLANS[family])
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        assert_equivalent(hf_families.builder(family), {"tp": 2}, plan, hf_families.inputs(family, seed=1))


def test_data_dependent_model_code_is_a_capture_error_at_its_line() -> None:
    # HF's eager MoE loops in Python over the experts that received tokens: the error names that line
    with pytest.raises(fxpar.CaptureError, match=r"modeling_mixtral\.py:\d+: for expert_idx in expert_hit"):
        fxpar.parallelize(hf_families.mixtral_eager_experts(), fxpar.Mesh({"dp": 2}, fake=True),
                          hf_families.inputs("mixtral"))


@pytest.mark.parametrize("axes,plan", [({"dp": 2, "tp": 2}, fxpar.Plan(tp="hf")), ({"dp": 2}, fxpar.Plan(zero=3))],
                         ids=["dp2xtp2", "dp2_zero3"])
def test_moe_experts_run_on_each_ranks_own_tokens_with_tp_and_zero3(axes: dict[str, int], plan: fxpar.Plan) -> None:
    # HF's experts module is token-wise: each dp rank sorts and groups only its own tokens
    # (fxpar.rules.token_local), its weight gradients are partial sums all-reduced (or reduce-scattered) once
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        assert_equivalent(hf_families.mixtral, axes, plan, hf_families.inputs("mixtral", seed=1))


def test_moe_experts_stay_on_each_ranks_own_tokens_in_mixed_precision() -> None:
    """Mixed precision casts each expert weight inside the experts module, before any node that reads the tokens.
    The region's token count was once taken from that cast (none: it reads a parameter), so in bf16 the whole module
    ran replicated on all dp ranks' tokens, all-gathered: dp times the experts' work and three all-gathers per layer.
    Now bf16 DDP's only dp collective is the fp32 gradient all-reduce, and ZeRO-3 gathers bf16 parameters only."""
    mixed = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}

    def dp_collectives(zero: int) -> set[tuple[str, torch.dtype]]:
        pm = fxpar.parallelize(hf_families.mixtral(), fxpar.Mesh({"dp": 2}, fake=True), hf_families.inputs("mixtral"),
                               plan=fxpar.Plan(zero=zero, **mixed))
        return {(r.op, r.dtype) for r in pm.ledger(0) if r.axis == "dp"}

    assert dp_collectives(0) == {("all_reduce", torch.float32)}
    assert dp_collectives(3) == {("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32)}
    torch.manual_seed(0)
    batch = hf_families.inputs("mixtral", seed=1)
    assert_equivalent(hf_families.mixtral, {"dp": 2}, fxpar.Plan(zero=3, **mixed), batch)


@pytest.mark.parametrize("family", ["gemma2", "t5"])
def test_eager_attention_stays_head_sharded_at_tp(family: str) -> None:
    # eager attention's matmuls over flattened batch x heads run as fxpar::bmm4 on the 4-D tensors
    plan = fxpar.Plan(tp="hf" if family in HF_PLAN else hf_families.TP_PLANS[family])
    text = _compile(family, {"tp": 2}, plan).program(0)
    assert "fxpar.bmm4(" in text and "aten.bmm(" not in text
    gathers = [line for line in text.splitlines() if "_gathered = comm.wait(" in line]
    assert not [line for line in gathers if "self_attn" in line or "Attention" in line]


# opt-in: 24 more families (FXPAR_HF_SWEEP=wide; about 5 minutes), all matched when last run (see README)
WIDE = hf_families_wide.WIDE_FAMILIES if os.environ.get("FXPAR_HF_SWEEP") == "wide" else []


@pytest.mark.parametrize("family", WIDE)
def test_wide_sweep_matches_single_device_at_dp2_and_tp2(family: str) -> None:
    build = hf_families_wide.BUILDERS[family]
    torch.manual_seed(0)
    assert_equivalent(build, {"dp": 2}, None, hf_families_wide.inputs(family, seed=1))
    if getattr(build().config, "base_model_tp_plan", None):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxpar.FxparWarning)
            assert_equivalent(build, {"tp": 2}, fxpar.Plan(tp="hf"), hf_families_wide.inputs(family, seed=1))


def _logits_mean_square(out: object, targets: object = None) -> torch.Tensor:
    return out.logits.float().pow(2).mean()


def test_falcon_pipeline_keeps_the_tensors_its_forward_makes_as_constants() -> None:
    """Falcon's attention makes tensors in its forward (``torch.tensor``), which the export lifts as constants. A
    pipeline stage bakes them into its graph as the whole-model capture does: they are no stage inputs named like
    buffers the model lacks (each rank failed to find them), and pp=2 matches the single device (fp32, rtol 1e-5)."""
    plan = fxpar.Plan(stages=2, microbatches=2)
    model = hf_families.builder("falcon")()
    pm = fxpar.parallelize(model, fxpar.Mesh({"pp": 2}, fake=True), hf_families.inputs("falcon"), plan=plan,
                           loss_fn=_logits_mean_square)  # and no warning: their copies keep their placement
    buffers = {name for name, _ in model.named_buffers()}
    for stage in pm._compiled.stages:
        assert {fqn for fqn, _ in stage.signature.buffers} <= buffers, stage.signature.buffers
    torch.manual_seed(0)
    assert_equivalent(hf_families.builder("falcon"), {"pp": 2}, plan, hf_families.inputs("falcon", seed=1),
                      loss_fn=_logits_mean_square)
