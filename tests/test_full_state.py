"""``pm.load_state_dict(model.state_dict())`` loads a single-device state dict (``fxpar/full_state.py``).

Before, it failed in torch ("aten.copy_.default got mixed torch.Tensor and DTensor arguments"), and a buffer the
program only reads (a frozen BatchNorm's statistics) was not on the module at all. Checked on gloo ranks: after
loading another draw of the model (every parameter and buffer different), a step's loss and gradients are that
model's (fp32, rtol 1e-5).
"""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.testing.batches import IMAGES, LABELS, RTOL, TOKENS
from fxpar.testing.pool import default_pool
from fxpar.testing.state_probes import load_single_device_state
from fxpar.testing.titan_llama import TITAN_TP, titan_llama, token_cross_entropy
from fxpar.testing.user_models import tiny_resnet


def _check(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["loaded"] == "<All keys matched successfully>" and r["keys_are_the_models"], r
        assert r["loss_gap"] <= RTOL and r["grad_gap"] <= RTOL, r


def test_a_resnet_with_a_frozen_batch_norm_loads_on_zero3() -> None:
    """dp=2 ZeRO-3: each parameter's dp shard is taken from the whole tensor, and the frozen stem BatchNorm's
    running statistics (read, never written) load too."""
    _check(default_pool().run(load_single_device_state, 2, tiny_resnet, {"dp": 2}, fxpar.Plan(zero=3), IMAGES,
                              LABELS, torch.nn.functional.cross_entropy, "stem.1", timeout=240))


@pytest.mark.filterwarnings("ignore::fxpar.FxparWarning")
def test_each_pipeline_rank_takes_its_stages_entries_of_the_whole_state_dict() -> None:
    """pp=2 x tp=2, torchtitan's Llama: a rank holds its stage's layers, tp shards of them; the other stage's
    entries of the model's state dict are skipped, not unexpected keys."""
    plan = fxpar.Plan(tp=TITAN_TP, stages=2, microbatches=2)
    _check(default_pool().run(load_single_device_state, 4, titan_llama, {"pp": 2, "tp": 2}, plan, TOKENS, TOKENS,
                              token_cross_entropy, timeout=240))
