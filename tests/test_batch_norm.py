"""BatchNorm in training mode (fxpar.batch_norm, fxpar.buffer_writes): the whole batch's statistics on a
dp-sharded batch (SyncBatchNorm's semantics, the single device's), running statistics written into the rank's own
buffers, the user's model untouched; other buffers a forward writes (an EMA, a counter, spectral norm's vectors)
alike."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import fxpar
from fxpar.testing import assert_equivalent
from fxpar.testing.user_models import (
    frozen_channel_norm,
    hf_convnext_drop_path,
    hf_resnet,
    running_features,
    tiny_resnet,
)

IMAGES = torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(1))
LABELS = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(2))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


@pytest.mark.parametrize(("axes", "plan", "batch"), [
    ({"dp": 2}, fxpar.Plan(zero=3), 8),
    ({"dp": 3}, None, 7),
    ({"pp": 2, "dp": 2}, fxpar.Plan(stages=2, microbatches=2), 8),
], ids=["dp2 ZeRO-3", "dp3, uneven batch 7", "pp2 x dp2, 2 microbatches"])
def test_a_resnet_in_training_mode_matches_the_single_device(axes: dict, plan: fxpar.Plan | None,
                                                              batch: int) -> None:
    # outputs (loss), gradients, parameters and every running statistic after each of 3 steps, at the default fp32
    # tolerance (rtol 1e-5: the statistics are fp32 sums where torch's CPU kernel accumulates in fp64)
    assert_equivalent(tiny_resnet, axes, plan, (IMAGES[:batch],), steps=3, loss_fn=cross_entropy,
                      targets=LABELS[:batch])


def test_each_batch_norm_reduces_its_statistics_not_its_activations() -> None:
    pm = fxpar.parallelize(tiny_resnet(), fxpar.Mesh({"dp": 2}, fake=True), (IMAGES,))
    rows = Counter((r.phase, r.op, r.shape) for r in pm.ledger(0) if r.axis == "dp")
    # 10 BatchNorms: forward mean and variance sums, backward the two sums of the input gradient; C values each
    forward = sum(n for (phase, op, shape), n in rows.items() if phase == "fwd")
    assert forward == 20 and all(op == "all_reduce" and len(shape) == 4 and shape[1] in (8, 16)
                                 for (phase, op, shape) in rows if phase == "fwd"), rows
    backward = sum(n for (phase, op, shape), n in rows.items() if phase == "bwd" and shape in ((8,), (16,)))
    assert backward == 20, rows  # beside them one bucketed all-reduce of the gradients
    assert not [key for key in rows if key[1] == "all_gather"], rows  # no activation is gathered
    program = pm.program(rank=0)
    assert program.count("aten.copy_(layer1_0_bn1_running_mean") == 1
    assert "aten.copy_(stem_1_num_batches_tracked" in program


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_running_statistics_live_on_the_parallel_module_and_its_checkpoints(tmp_path: object) -> None:
    import fxpar.checkpoint
    from fxpar.testing.pool import default_pool
    from fxpar.testing.probes import running_statistics_after_a_step

    folder = str(tmp_path / "ckpt")
    ranks = default_pool().run(running_statistics_after_a_step, 2, IMAGES, LABELS, folder, timeout=120)
    for rank in ranks:
        assert rank["model_untouched"] and rank["in_state_dict"], rank
        assert rank["counter"] == 1 and rank["moved"], rank
    plain = tiny_resnet()  # the checkpoint loads into the plain model with the trained statistics, exactly
    fxpar.checkpoint.load(plain, None, folder)
    for name, value in plain.named_buffers():
        assert torch.equal(value, torch.tensor(ranks[0]["buffers"][name], dtype=value.dtype)), name


@pytest.mark.parametrize(("axes", "plan"), [({"dp": 2}, None), ({"tp": 2}, {"up": "colwise"})],
                         ids=["dp2", "tp2 colwise (the EMA sharded)"])
def test_other_buffers_the_forward_writes_match_the_single_device(axes: dict, plan: object) -> None:
    # the EMA reads a dp-sharded batch (a partial sum completed before the write) or tp-sharded features; every
    # written buffer is compared after each step, at the default fp32 tolerance
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    assert_equivalent(running_features, axes, plan, (x,), steps=3)


def image_cross_entropy(out: object, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, labels)


@pytest.mark.parametrize("model_fn", [hf_resnet, hf_convnext_drop_path], ids=["HF ResNet", "HF ConvNeXt, drop path"])
def test_hf_image_models_in_training_mode_match_the_single_device(model_fn: object) -> None:
    # ResNet: BatchNorm statistics and running statistics; ConvNeXt: stochastic depth's per-sample draws
    # (fxpar.random_draws) and LayerNorm over channels
    pytest.importorskip("transformers")
    images = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(4))
    assert_equivalent(model_fn, {"dp": 2}, None, {"pixel_values": images}, steps=3, loss_fn=image_cross_entropy,
                      targets=LABELS[:4] % 5)


def test_a_frozen_batch_norm_over_transposed_channels_runs_and_matches() -> None:
    """The frozen BatchNorm1d's CPU kernel lays out its output otherwise than its fake tensor: the rank program's
    ``view`` after it failed at the first step ("view size is not compatible"); it now copies there."""
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(5))
    assert_equivalent(frozen_channel_norm, {"dp": 2}, None, (x,), steps=3)
