"""Megatron sequence parallelism (``Plan(sequence_parallel=True)`` with tp): ledger per layer, equivalence, memory."""

from __future__ import annotations

from collections import Counter
from functools import partial

import pytest
import torch

import fxpar
from fxpar.errors import FxparWarning
from fxpar.models.llama import hf_llama_plan, llama, llama_plan
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

TOKENS = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
HIDDEN = 64


def _hf_llama(layers: int) -> torch.nn.Module:
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    return hf_llama(layers=layers, hidden=HIDDEN)


def _tp_rows(layers: int, axes: dict[str, int], sp: bool = True) -> Counter:
    pm = fxpar.parallelize(_hf_llama(layers), fxpar.Mesh(axes, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=hf_llama_plan(), sequence_parallel=sp))
    return Counter((r.phase, r.op, r.bytes) for r in pm.ledger(0) if r.axis == "tp")


@pytest.mark.parametrize("axes", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_per_layer_two_all_gathers_and_two_reduce_scatters_each_way(axes: dict[str, int]) -> None:
    # compiling 2 and 4 layers and differencing leaves one layer's collectives (embedding and lm_head cancel)
    two, four = _tp_rows(2, axes), _tp_rows(4, axes)
    per_layer = {k: (four[k] - two[k]) / 2 for k in four | two if four[k] != two[k]}
    b, s = TOKENS.shape[0] // axes.get("dp", 1), TOKENS.shape[1]
    stream = b * s * HIDDEN * 4  # b_local * s * h fp32 elements, gathered whole / reduced whole
    assert per_layer == {
        ("fwd", "all_gather", stream): 2, ("fwd", "reduce_scatter", stream): 2,  # no tp all-reduce in forward
        ("bwd", "all_gather", stream): 2, ("bwd", "reduce_scatter", stream): 2,  # the conjugates
        # the two norm weights' gradients are sums over the sharded sequence: all-reduced, as Megatron does
        ("bwd", "all_reduce", HIDDEN * 4): 2,
    }
    without = _tp_rows(4, axes, sp=False)  # plain tp: 2 all-reduces of the stream per layer each way
    assert {k: v for k, v in without.items() if k[1] != "all_reduce"} == {}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_embedding_gradient_all_gathers_the_stream_not_the_table(tie: bool) -> None:
    """The embedding's gradient is a sum over the sharded sequence: all-gathering its incoming b x s x h gradient
    (then computing the whole table gradient on every rank) moves 8x fewer bytes here than all-reducing the
    V x h table (31x at Llama-3-70B widths). No tp all-reduce may be larger than a norm weight, tied or not."""
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    vocab, tokens = 1024, torch.randint(0, 1024, (8, 16), generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(hf_llama(layers=2, hidden=HIDDEN, vocab=vocab, tie=tie), fxpar.Mesh({"tp": 4}, fake=True),
                           (tokens,), plan=fxpar.Plan(tp=hf_llama_plan(), sequence_parallel=True))
    rows = [r for r in pm.ledger(0) if r.axis == "tp"]
    assert max(r.bytes for r in rows if r.op == "all_reduce") == HIDDEN * 4
    assert max(r.bytes for r in rows) == tokens.numel() * HIDDEN * 4  # the stream, gathered or scattered whole


def test_a_small_table_reads_the_stream_gradient_the_word_embedding_gathers() -> None:
    """BERT's token-type table (2 x h) all-reduced its gradient over tp (2 h elements: more than a norm weight) though
    the word embedding's backward gathers the same incoming gradient anyway: both now read the one gather."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    pm = fxpar.parallelize(hf_families.bert(), fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), hf_families.inputs("bert"),
                           plan=fxpar.Plan(tp=hf_families.TP_PLANS["bert"], sequence_parallel=True))
    tp = [r for r in pm.ledger(0) if r.axis == "tp"]
    assert max(r.bytes for r in tp if r.op == "all_reduce") == hf_families.HIDDEN * 4
    assert not [r for r in pm.ledger(0) if r.axis == "dp" and r.op == "all_gather"]  # dp still defers, as DDP


def test_an_unplanned_head_under_cp_x_tp_is_not_all_reduced_over_tp() -> None:
    """cp x tp with SP and a replicated ``lm_head``: the head's weight gradient reaches the program's output through
    transposes (cp's weight path), and a partial sum there must be completed: the head then computes its gradient
    whole rather than on a tp-sharded batch all-reduced as V x h afterwards (it was: 32,768 B here)."""
    pytest.importorskip("transformers")
    import warnings

    from fxpar.models import hf_families

    plan = {"model.layers.*.self_attn.[qkv]_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
            "model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
            "model.layers.*.mlp.down_proj": "rowwise"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FxparWarning)
        pm = fxpar.parallelize(hf_families.qwen3(), fxpar.Mesh({"cp": 2, "tp": 2}, fake=True),
                               hf_families.inputs("qwen3"), plan=fxpar.Plan(tp=plan, sequence_parallel=True))
    reduced = [r.bytes for r in pm.ledger(0) if r.axis == "tp" and r.op == "all_reduce"]
    assert reduced and max(reduced) <= hf_families.HIDDEN * 4


def test_hf_gpt2_conv1d_plan_runs_sequence_parallel() -> None:
    """HF GPT-2's projections are ``Conv1D`` (a Linear with its weight transposed): their widths name the residual
    stream as a Linear's do, so SP is on (it used to warn and turn itself off). Every boundary reduce-scatters and
    all-gathers; no tp all-reduce is larger than a LayerNorm's gradient, the learned position table's included
    (its gradient gathers the s x h stream, not the table), and the program matches the single device on gloo."""
    pytest.importorskip("transformers")
    import warnings

    from fxpar.models import hf_families

    batch, plan = hf_families.inputs("gpt2"), fxpar.Plan(tp=hf_families.TP_PLANS["gpt2"], sequence_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FxparWarning)
        pm = fxpar.parallelize(hf_families.gpt2(), fxpar.Mesh({"tp": 2}, fake=True), batch, plan=plan)
    rows = [r for r in pm.ledger(0) if r.axis == "tp"]
    assert max(r.bytes for r in rows if r.op == "all_reduce") == hf_families.HIDDEN * 4
    assert Counter(r.op for r in rows if r.phase == "fwd")["reduce_scatter"] == 2 * hf_families.LAYERS
    assert_equivalent(hf_families.gpt2, {"tp": 2}, plan, batch, steps=2)


def test_a_biased_row_parallel_linear_reduce_scatters_its_product() -> None:
    """HF Starcoder2's o_proj and c_proj are row-parallel with a bias. The bias is added on the flattened product,
    where only an all-reduce could resolve the partial sum; fxpar adds it after the view back to [b, s, h]
    (``fxpar.simplify.bias_after_token_view``), so each layer reduce-scatters, as without a bias."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    batch = hf_families.inputs("starcoder2")
    with pytest.warns(FxparWarning, match="vocab-parallel embedding"):  # HF's plan shards the vocab; fxpar cannot
        pm = fxpar.parallelize(hf_families.starcoder2(), fxpar.Mesh({"tp": 4}, fake=True), batch,
                               plan=fxpar.Plan(tp="hf", sequence_parallel=True))
    rows = [r for r in pm.ledger(0) if r.axis == "tp"]
    hidden, stream = hf_families.HIDDEN, batch[0].numel() * hf_families.HIDDEN * 4
    assert max(r.bytes for r in rows if r.op == "all_reduce") == hidden * 4  # a norm's or a bias's gradient
    per_way = 2 * hf_families.LAYERS  # o_proj and c_proj of each layer
    assert Counter((r.phase, r.op) for r in rows if r.bytes == stream)[("fwd", "reduce_scatter")] == per_way
    assert Counter((r.phase, r.op) for r in rows if r.bytes == stream)[("bwd", "all_gather")] >= per_way


def test_hf_starcoder2_biased_rows_with_sequence_parallel_match_single_device() -> None:
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    assert_equivalent(hf_families.starcoder2, {"dp": 2, "tp": 2}, fxpar.Plan(tp="hf", sequence_parallel=True),
                      hf_families.inputs("starcoder2"), steps=2)


def test_a_model_that_flattens_its_tokens_keeps_them_sequence_sharded() -> None:
    """HF OPT's decoder layer flattens the stream to ``[b * s, h]`` itself and runs its MLP and residual add there;
    that flatten of a sequence shard is no plain shard, so every layer gathered the tokens, all-reduced ``fc2``'s
    product and left the stream replicated (1.75x Megatron's bytes). ``fxpar.token_rows`` keeps the row-wise
    stretch un-flattened: no tp all-reduce is larger than a norm's gradient, every layer reduce-scatters twice
    each way, and dp=2 x tp=2 matches the single device (fp32, the default rtol 1e-5)."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    batch, plan = hf_families.inputs("opt"), fxpar.Plan(tp=hf_families.TP_PLANS["opt"], sequence_parallel=True)
    pm = fxpar.parallelize(hf_families.opt(), fxpar.Mesh({"tp": 4}, fake=True), batch, plan=plan)
    rows = [r for r in pm.ledger(0) if r.axis == "tp"]
    stream = batch[0].numel() * hf_families.HIDDEN * 4
    assert max(r.bytes for r in rows if r.op == "all_reduce") == hf_families.HIDDEN * 4
    assert Counter((r.phase, r.op) for r in rows if r.bytes == stream)[("fwd", "reduce_scatter")] \
        == 2 * hf_families.LAYERS
    assert_equivalent(hf_families.opt, {"dp": 2, "tp": 2}, plan, batch, steps=2)


def test_saved_activations_shrink() -> None:
    mems = {sp: fxpar.parallelize(_hf_llama(2), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,),
                                  plan=fxpar.Plan(tp=hf_llama_plan(), sequence_parallel=sp)).memory(0)
            for sp in (False, True)}
    assert mems[True].activations < mems[False].activations


def test_printed_program_keeps_the_stream_sequence_sharded() -> None:
    pm = fxpar.parallelize(llama(n_layers=1, vocab_size=128), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True))
    forward = pm.program(0).split("def backward")[0]
    assert "comm.reduce_scatter" in forward and "comm.all_reduce" not in forward
    assert "tp:S(1)" in forward


def test_a_sequence_tp_does_not_divide_turns_it_off_with_a_warning() -> None:
    tokens = TOKENS[:, :15]
    with pytest.warns(fxpar.FxparWarning, match="sequence length 15 is not divisible by tp=2"):
        pm = fxpar.parallelize(llama(n_layers=1, vocab_size=128), fxpar.Mesh({"tp": 2}, fake=True), (tokens,),
                               plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True))
    assert not [r for r in pm.ledger(0) if r.op == "reduce_scatter"]


def _check(model_fn, axes: dict[str, int], plan: fxpar.Plan) -> None:  # noqa: ANN001
    assert_equivalent(model_fn, axes, plan, (TOKENS,), steps=3, loss_fn=next_token_loss, targets=TOKENS)


def test_zero3_with_tp_and_sequence_parallel_at_dp2_matches_single_device() -> None:
    _check(partial(llama, n_layers=2, vocab_size=128), {"dp": 2, "tp": 2},
           fxpar.Plan(tp=llama_plan(), zero=3, sequence_parallel=True))


def test_hf_llama_tp2_sequence_parallel_matches_single_device() -> None:
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    _check(partial(hf_llama, layers=2), {"tp": 2}, fxpar.Plan(tp=hf_llama_plan(), sequence_parallel=True))


def test_sequence_parallel_with_pipeline_stages_matches_single_device() -> None:
    _check(partial(llama, n_layers=2, vocab_size=128), {"pp": 2, "tp": 2},
           fxpar.Plan(tp=llama_plan(), sequence_parallel=True, microbatches=2, schedule="1f1b"))


def test_a_plan_without_tp_linears_turns_it_off_with_a_warning() -> None:
    with pytest.warns(fxpar.FxparWarning, match="sequence_parallel is off: it needs"):
        fxpar.parallelize(llama(n_layers=1, vocab_size=128), fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,),
                          plan=fxpar.Plan(sequence_parallel=True))


def test_the_sequence_length_is_read_from_the_stream_not_from_the_first_input() -> None:
    """An image encoder's first input is ``[batch, channels, h, w]``: SP took its dim 1 (3 channels) for the
    sequence length, warned "the sequence length 3 is not divisible by tp=2" and stayed off (with 4 channels it
    stayed off silently). The lengths come from the ``[batch, seq, hidden]`` values now: 4 patches, so every block
    boundary reduce-scatters and all-gathers, and tp=2 and dp=2 x tp=2 match the single device (fp32, rtol 1e-5)."""
    import warnings

    from fxpar.testing.user_models import patch_encoder

    image = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    plan = fxpar.Plan(tp={"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, sequence_parallel=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxpar.FxparWarning)
        pm = fxpar.parallelize(patch_encoder(), fxpar.Mesh({"tp": 2}, fake=True), (image,), plan=plan)
    ops = {(r.op, r.phase) for r in pm.ledger(0)}
    assert {("reduce_scatter", "fwd"), ("all_gather", "fwd")} <= ops
    for axes in ({"tp": 2}, {"dp": 2, "tp": 2}):
        assert_equivalent(patch_encoder, axes, plan, (image,), steps=2)
