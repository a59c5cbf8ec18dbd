"""Models that compute their own loss (``model(x, labels) -> loss``, Hugging Face's ``labels=``).

The loss is a mean over the batch, which dp and cp shard: each rank sums its own rows and the sums are
all-reduced as scalars (``fxpar.global_means``), never the logits. The loss is the global one, ignored targets
included (a mean of per-rank means would not be), and a parameter no token reaches gets a gradient that is
already whole on every rank: under ZeRO each rank keeps its shard of it.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch

import fxpar
from fxpar.testing import assert_equivalent, default_pool
from fxpar.testing.loss_models import (
    contrastive_encoder,
    contrastive_loss,
    logits_only_loss,
    mean_square,
    regression_loss,
    self_loss_batch,
    self_loss_lm,
    summed_square,
    value_head_lm,
)


def _forward_rows(pm: fxpar.ParallelModule, rank: int = 0) -> list[object]:
    return [r for r in pm.ledger(rank) if r.phase == "fwd"]


def test_hf_labels_loss_moves_scalars_not_logits() -> None:
    """HF Llama with ``labels`` on dp=2: the forward's only collectives are two scalar all-reduces (the summed
    loss and the count of targets not ignored); it used to all-gather the log-softmax of every token."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    ids = torch.randint(0, hf_families.VOCAB, (4, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        pm = fxpar.parallelize(hf_families.llama(), fxpar.Mesh({"dp": 2}, fake=True),
                               {"input_ids": ids, "labels": ids})
    rows = _forward_rows(pm)
    assert [(r.op, r.axis, r.bytes) for r in rows] == [("all_reduce", "dp", 4)] * 2
    assert "nll_loss_forward" in pm.program(0)


def test_self_loss_model_ledger_has_no_activation_gather() -> None:
    """The custom model's three means (cross-entropy with ignored targets, an activation penalty) reduce
    scalars; its 2-D attention mask stays whole on every rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        pm = fxpar.parallelize(self_loss_lm(), fxpar.Mesh({"dp": 2}, fake=True), self_loss_batch())
    assert {(r.op, r.bytes) for r in _forward_rows(pm)} == {("all_reduce", 4)}
    assert not any("slice" in line and "where" in line for line in pm.program(0).splitlines())


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_self_loss_model_matches_single_device(zero: int) -> None:
    """dp=2, fp32, rtol 1e-5: loss, every gradient (the penalty's whole one included) and parameters after the
    steps; under ZeRO each rank's gradient of ``temperature`` is its shard of the whole one."""
    assert_equivalent(self_loss_lm, {"dp": 2}, fxpar.Plan(zero=zero), self_loss_batch(), steps=2)


def test_self_loss_model_uneven_batch_matches_single_device() -> None:
    """dp=2 over a batch of 5: the ranks hold 3 and 2 rows and different counts of ignored targets."""
    assert_equivalent(self_loss_lm, {"dp": 2}, None, self_loss_batch(batch=5), steps=2)


@pytest.mark.parametrize("loss", ["mse", "smooth_l1", "huber", "soft_margin"])
def test_fused_mean_losses_match_single_device(loss: str) -> None:
    """``mse_loss_backward(..., reduction=mean)`` and its kin divide by the count of the elements they are given:
    DTensor ran them on batch shards, and every gradient came out dp times too large (a silent wrong answer, found
    with ``F.mse_loss`` inside a model). Such ops now run on whole inputs (``fxpar.rules.divides_by_local_count``).
    dp=2 over a batch of 7 (4 and 3 rows), fp32, rtol 1e-5."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 8, generator=g), torch.randn(7, 4, generator=g)
    assert_equivalent(functools.partial(regression_loss, loss), {"dp": 2}, fxpar.Plan(zero=1), (x, y), steps=2)


@pytest.mark.parametrize("padded", [3, 0], ids=["padding ignored on rank 0: warned", "nothing ignored: silent"])
def test_an_eager_loss_that_ignores_targets_warns_once(padded: int) -> None:
    """An eager ``loss_fn`` averaging over the targets it keeps (cross-entropy's ``ignore_index``) is not a batch
    mean: dp=2 averages two means over different counts, which the single device does not (the equivalence check
    fails: loss and gradients off by the uneven counts). ``pm.step`` says so once, on a rank that sees ignored
    targets (``fxpar.loss_watch``), and stays silent when none are ignored."""
    from fxpar.testing.pool import default_pool
    from fxpar.testing.probes import warnings_of_a_padded_loss

    inputs = torch.randn(8, 10, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(1))
    targets[:padded] = -100  # rank 0's first targets are padding
    ranks = default_pool().run(warnings_of_a_padded_loss, 2, inputs, targets, -100, timeout=120)
    assert [len(messages) for messages in ranks] == ([1, 0] if padded else [0, 0]), ranks
    assert not padded or "not a batch mean" in ranks[0][0]


@pytest.mark.parametrize(("loss_fn", "axes", "microbatches", "warned"), [
    (contrastive_loss, {"dp": 2}, 1, True),
    (summed_square, {"dp": 1}, 2, True),
    (mean_square, {"dp": 2}, 2, False),
], ids=["contrastive on dp=2: warned", "summed over 2 microbatches: warned", "a batch mean: silent"])
def test_an_eager_loss_that_is_not_a_mean_over_rows_warns_once(loss_fn: object, axes: dict, microbatches: int,
                                                                warned: bool) -> None:
    """A contrastive ``loss_fn`` (CLIP's ``a @ b.T`` against ``arange`` labels) compares rows with each other, and a
    summed one scales with the rows: split over dp ranks or microbatches, the mean of the shares' losses is not
    the single device's, and no kernel says so. ``pm.step`` tests the definition on its first microbatch (the
    loss of its rows against the mean of its halves' losses) and warns once per rank; a batch mean stays silent."""
    from fxpar.testing.pool import default_pool
    from fxpar.testing.probes import warnings_of_a_loss

    inputs = torch.randn(8, 10, generator=torch.Generator().manual_seed(0))
    world = axes["dp"]
    ranks = default_pool().run(warnings_of_a_loss, world, inputs, loss_fn, axes, microbatches, timeout=120)
    assert [len(messages) for messages in ranks] == [int(warned)] * world, ranks
    assert not warned or all("not a mean over the batch's rows" in messages[0] for messages in ranks)


def test_a_contrastive_loss_inside_the_model_is_exact_on_dp() -> None:
    """What the warning above recommends: CLIP's loss in the model's forward is traced, so the ``a @ b.T`` over
    dp-sharded rows is planned like any other op and the loss, gradients and parameters match the single device
    (dp=2 ZeRO-1, fp32, rtol 1e-5)."""
    images = torch.randn(8, 10, generator=torch.Generator().manual_seed(0))
    texts = torch.randn(8, 10, generator=torch.Generator().manual_seed(1))
    assert_equivalent(contrastive_encoder, {"dp": 2}, fxpar.Plan(zero=1), (images, texts), steps=2)


@pytest.mark.parametrize(("axes", "plan", "with_targets"), [
    ({"dp": 2}, fxpar.Plan(zero=3), True),  # pm.step
    ({"pp": 2}, fxpar.Plan(schedule="gpipe", microbatches=2), True),  # the head on the last stage
    ({"dp": 2}, fxpar.Plan(), False),  # pm(x) then loss.backward()
], ids=["dp2-zero3-step", "pp2-step", "dp2-backward"])
def test_parameters_the_loss_does_not_reach_keep_no_gradient(axes: dict[str, int], plan: fxpar.Plan,
                                                              with_targets: bool) -> None:
    """The loss reads only the logits: on one device the value head's ``.grad`` stays None and AdamW leaves it
    alone. fxpar fed its output a zero gradient and handed the head zeros, which AdamW decayed (``fxpar.unreached``
    now keeps them None); the harness compares gradients None for None, and parameters after 3 steps."""
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    assert_equivalent(value_head_lm, axes, plan, (tokens,), steps=3, loss_fn=logits_only_loss,
                      targets=targets if with_targets else None)


def test_a_loss_that_starts_reading_an_output_it_left_out_is_refused() -> None:
    # which parameters the loss reaches is decided at the first step: a later read would lose their gradients
    from fxpar.testing.loss_models import switch_the_outputs_the_loss_reads

    for message in default_pool().run(switch_the_outputs_the_loss_reads, 2, timeout=120):
        assert message.startswith("loss_fn made a gradient for model output(s) [1], which it did not read"), message
