"""Models outside the transformer mould, written as users write them, train like the single device."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpar
from fxpar.testing import assert_equivalent
from fxpar.testing.block_models import encoder_decoder
from fxpar.testing.loss_models import mean_square
from fxpar.testing.state_models import call_counter, shared_table_stack
from fxpar.testing.titan_llama import TITAN_TP, titan_llama, token_cross_entropy
from fxpar.testing.user_models import (
    SHARED_LAYERS_TP,
    logits_square,
    optional_loss,
    residual_stack,
    segmentation_net,
    shared_layers,
    stacked_lstm,
    temporal_conv,
    tied_transposed_head,
    weight_normed_convs,
)


def test_stacked_lstm_matches_single_device() -> None:
    """``nn.LSTM`` at dp=2 with ZeRO-3 (fp32, rtol 1e-5). Capture traces with oneDNN off: torch's decomposition of
    an LSTM otherwise picks oneDNN's inference-only kernel (the input needs no gradient, the weights do), whose
    backward failed at run time on an undefined workspace. Four layers: repeated blocks, each its own capture."""
    x = torch.randn(6, 5, 8, generator=torch.Generator().manual_seed(0))
    assert_equivalent(stacked_lstm, {"dp": 2}, fxpar.Plan(zero=3), (x,), steps=2)


def test_group_norm_on_a_sharded_batch_matches_single_device() -> None:
    """GroupNorm passes its input's sizes as ints (N, C, HxW): lowering gives it the local batch, where the global
    one made the kernel reshape 4 rows as 8 (dp=2, ZeRO-2, fp32, rtol 1e-5)."""
    x = torch.randn(8, 8, 12, generator=torch.Generator().manual_seed(0))
    assert_equivalent(temporal_conv, {"dp": 2}, fxpar.Plan(zero=2), (x,), steps=2)


def test_blocks_of_a_root_sequential_are_recomputed_and_printed_as_ranges() -> None:
    """An ``nn.Sequential`` model's blocks have paths ``1`` .. ``4``: recompute finds them, the stage header prints
    them as ranges, and recomputed steps match the single device (dp=2, ZeRO-1, fp32, rtol 1e-5)."""
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(residual_stack(), fxpar.Mesh({"pp": 2}, fake=True), (x,),
                           plan=fxpar.Plan(stages=2, microbatches=2, recompute="full"),
                           loss_fn=lambda out, y: out.square().mean(), example_targets=x[:, :5])
    assert "# holds   0-2" in pm.program(0) and "# holds   3-5" in pm.program(1)
    assert "recompute" in pm.program(0).split("def backward")[1]
    assert_equivalent(residual_stack, {"dp": 2}, fxpar.Plan(zero=1, recompute="full"), (x,), steps=2)


def test_a_segmentation_net_keeps_its_batch_sharded_and_matches_single_device() -> None:
    """A U-Net in training mode: BatchNorm (its statistics all-reduced), a transposed convolution, bilinear
    ``F.interpolate`` (``_unsafe_index`` and its backward ``_unsafe_index_put`` keep the dp-sharded batch: no
    activation is gathered) and ``Dropout2d`` (whole draws, fxpar.random_draws); dp=2 ZeRO-3, fp32, rtol 1e-5,
    per-pixel cross-entropy."""
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 2, (4, 8, 8), generator=torch.Generator().manual_seed(1))
    pm = fxpar.parallelize(segmentation_net(), fxpar.Mesh({"dp": 2}, fake=True), (images,))
    assert {r.op for r in pm.ledger(0)} == {"all_reduce"}, pm.ledger(0)
    assert "aten._unsafe_index.Tensor" in pm.program(0) and "dp:S(0)" in next(
        line for line in pm.program(0).splitlines() if "aten._unsafe_index.Tensor" in line)
    assert_equivalent(segmentation_net, {"dp": 2}, fxpar.Plan(zero=3), (images,), steps=3,
                      loss_fn=torch.nn.functional.cross_entropy, targets=labels)


def test_a_torchtitan_llama_with_layers_in_a_module_dict_splits_into_stages_and_matches() -> None:
    """torchtitan's Llama keeps its layers in an ``nn.ModuleDict`` (``layers.0`` ..) and rotates q and k as complex
    numbers. The ModuleDict's children are the repeated blocks: traced once (one distinct capture for 4 layers),
    split into cost-balanced pipeline stages (stages=2 was a PlanError: "no nn.ModuleList or nn.Sequential"), and
    the complex rotary embedding keeps heads sharded over tp. pp=2 x tp=2 with 2 microbatches matches the single
    device (fp32, rtol 1e-5)."""
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    loss = token_cross_entropy
    plan = fxpar.Plan(tp=TITAN_TP, stages=2, microbatches=2)
    pm = fxpar.parallelize(titan_llama(), fxpar.Mesh({"pp": 2, "tp": 2}, fake=True), (tokens,), plan=plan,
                           loss_fn=loss, example_targets=tokens)
    assert "# holds   tok_embeddings, layers.0-1" in pm.program(0)
    assert "# holds   layers.2-3, norm, output" in pm.program(2)
    assert pm.captures.distinct == 1
    assert {r.axis for r in pm.ledger(0)} == {"tp", "pp"}
    assert_equivalent(titan_llama, {"pp": 2, "tp": 2}, plan, (tokens,), steps=3, loss_fn=loss, targets=tokens)


def test_a_model_returning_none_beside_its_logits_compiles_and_matches() -> None:
    """nanoGPT's ``return logits, loss`` with ``loss = None`` when no targets are passed: the ``None`` output crashed
    lowering (``KeyError: None`` in the forward/backward split). It is returned as ``None``; dp=2 ``pm(x)`` and
    ``pm.step`` with 2 microbatches match the single device (fp32, rtol 1e-5)."""
    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    assert_equivalent(optional_loss, {"dp": 2}, None, (x,), steps=2)
    assert_equivalent(optional_loss, {"dp": 2}, fxpar.Plan(microbatches=2), (x,), steps=2, loss_fn=logits_square)


def test_a_block_shared_by_every_layer_leaves_the_model_as_it_was_and_matches() -> None:
    """ALBERT-style sharing, ``nn.ModuleList([block] * 4)``: torch's ``_reparametrize_module`` (tie_weights=True)
    restores a module that sits under several paths with the fake tensor it swapped in last, so compiling left the
    user's block holding fake parameters, and the rank programs ran on them (a gloo size mismatch, or garbage).
    ``fxpar.reparametrize.swapped_in`` puts back the very objects. dp=2 ZeRO-1 and tp=2 on the shared block's
    projections (its gradient sums four layers' contributions) match the single device (fp32, rtol 1e-5). Under
    pipeline stages the uses split at their call boundaries (``layers.2``): both stages hold the block, whose
    gradient is summed across them as a tied weight's is; pp=2 matches too."""
    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    model = shared_layers()
    before = {name: p for name, p in model.named_parameters()}
    fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (tokens,), plan=fxpar.Plan(zero=1))
    assert all(p is before[name] for name, p in model.named_parameters())
    assert_equivalent(shared_layers, {"dp": 2}, fxpar.Plan(zero=1), (tokens,), steps=2)
    assert_equivalent(shared_layers, {"tp": 2}, fxpar.Plan(tp=SHARED_LAYERS_TP), (tokens,), steps=2)
    pm = fxpar.parallelize(model, fxpar.Mesh({"pp": 2}, fake=True), (tokens,), plan=fxpar.Plan(stages=2),
                           loss_fn=mean_square)
    assert pm.plan.notes["stage starts"] == "layers.2"
    assert_equivalent(shared_layers, {"pp": 2}, fxpar.Plan(stages=2, microbatches=2), (tokens,), loss_fn=mean_square,
                      steps=2)


def test_weight_normalized_convolutions_reduce_their_gradients_with_the_others() -> None:
    """Weight normalization's backward had no sharding rule: a warning, and on dp each weight's partial gradient
    was all-reduced before the op ran replicated. Now the op keeps it partial, and ZeRO-2 reduce-scatters every
    gradient in one bucket (the ledger's only backward collective); dp=2 matches the single device (fp32, rtol
    1e-5)."""
    x = torch.randn(4, 4, 12, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxpar.FxparWarning)
        pm = fxpar.parallelize(weight_normed_convs(), fxpar.Mesh({"dp": 2}, fake=True), (x,), plan=fxpar.Plan(zero=2))
    assert [(r.phase, r.op) for r in pm.ledger(0)] == [("fwd", "all_gather"), ("bwd", "reduce_scatter")]
    assert_equivalent(weight_normed_convs, {"dp": 2}, fxpar.Plan(zero=2), (x,), steps=2)


def test_a_tied_weight_read_transposed_gets_its_whole_gradient_across_stages() -> None:
    """MobileBERT's head reads the tied embedding as ``cat([w.t(), extra])``: on the last stage the tied weight's
    gradient is a transposed view, and the pipeline's tied all-reduce summed its storage in memory order (gloo),
    so each rank added the other's elements at transposed positions (relative error 1e10 on the embedding's
    gradient, silently). pp=2 and pp=2 x dp=2 ZeRO-3 match the single device (fp32, rtol 1e-5)."""
    g = torch.Generator().manual_seed(0)
    tokens, targets = torch.randint(0, 32, (4, 6), generator=g), torch.randint(0, 32, (4, 6), generator=g)
    for axes, plan in (({"pp": 2}, fxpar.Plan(stages=2, microbatches=2)),
                       ({"pp": 2, "dp": 2}, fxpar.Plan(stages=2, microbatches=2, zero=3))):
        assert_equivalent(tied_transposed_head, axes, plan, (tokens,), loss_fn=token_cross_entropy, targets=targets,
                          steps=2)


def test_a_model_without_repeated_blocks_splits_at_the_modules_its_data_flows_through() -> None:
    """``Plan(stages=2)`` on a model with no list of repeated layers was a PlanError, or (a U-Net, whose
    ``Sequential(conv, BatchNorm, ReLU)`` won the search for a block list) a split inside its first convolution
    block. Such a model now splits, cost-balanced, at the boundaries of the submodules its data flows through, at
    the shallowest depth that balances within 10%: the U-Net after its upsampling, a convolution-GroupNorm classifier
    after the convolution; the classifier at pp=2 matches the single device (fp32, rtol 1e-5)."""
    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 2, (4, 8, 8), generator=torch.Generator().manual_seed(1))
    with pytest.warns(fxpar.FxparWarning, match="draws random numbers"):  # its Dropout2d, under pipeline stages
        pm = fxpar.parallelize(segmentation_net(), fxpar.Mesh({"pp": 2}, fake=True), (images,),
                               plan=fxpar.Plan(stages=2, microbatches=2), loss_fn=torch.nn.functional.cross_entropy,
                               example_targets=labels)
    assert pm.plan.notes["stage starts"] == "drop"
    x = torch.randn(4, 8, 10, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(1))
    assert_equivalent(temporal_conv, {"pp": 2}, fxpar.Plan(stages=2, microbatches=2), (x,),
                      loss_fn=torch.nn.functional.cross_entropy, targets=y, steps=2)


def test_an_encoder_and_a_decoder_split_across_both_lists_of_layers() -> None:
    """Stage splits saw only the first list of repeated blocks: ``stages=2`` on BART cut inside its encoder (28% /
    72%) and ``stages=4`` was refused ("more than the 2 splittable blocks"). Every list of repeated blocks that is
    not inside another's entries now offers its entries as stage starts, in call order; interleaved 4 stages on
    pp=2 matches the single device (fp32, rtol 1e-5)."""
    source = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(0))
    target = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
    pm = fxpar.parallelize(encoder_decoder(), fxpar.Mesh({"pp": 2}, fake=True), (source, target),
                           plan=fxpar.Plan(stages=2, microbatches=2), loss_fn=mean_square)
    assert pm.plan.notes["stage starts"] == "decoder.0"
    plan = fxpar.Plan(stages=4, schedule="interleaved-1f1b", microbatches=2)
    assert_equivalent(encoder_decoder, {"pp": 2}, plan, (source, target), loss_fn=mean_square, steps=2)


def test_a_counter_no_input_reaches_is_kept_by_its_pipeline_stage() -> None:
    """A buffer write whose value no input reaches (``calls += 1``; BatchNorm's ``num_batches_tracked``) was in no
    pipeline stage and was dropped: the counter stayed 0 and a pp checkpoint lacked it. ``assert_equivalent`` now
    also fails a buffer the single device writes that no rank holds (it passed this case)."""
    tokens = torch.randint(0, 96, (8, 17), generator=torch.Generator().manual_seed(1))
    assert_equivalent(call_counter, {"pp": 2}, fxpar.Plan(stages=["b"]), (tokens[:, :-1],), steps=2,
                      loss_fn=token_cross_entropy, targets=tokens[:, 1:])


def test_a_buffer_every_layer_shares_is_found_under_each_of_its_names() -> None:
    """A table module held by every layer: the program reads its buffer under each layer's name, while the model's
    ``named_buffers()`` lists it once; building the rank's module failed with ``KeyError: 'layers.1.rot.freq'``."""
    assert_equivalent(shared_table_stack, {"dp": 2}, None, (torch.randn(8, 16),), steps=2)
