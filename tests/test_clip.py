"""``pm.clip_grad_norm_``: clipping by the whole model's gradient norm, pipeline stages included, equals clipping
the single-device model with ``torch.nn.utils.clip_grad_norm_`` (fxpar.clip)."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.models.llama import llama_plan
from fxpar.testing.pool import default_pool
from fxpar.testing.probes import clipped_against_single_device

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("axes", "plan", "tie"), [
    ({"pp": 2}, fxpar.Plan(stages=4, microbatches=2, schedule="interleaved-1f1b"), True),
    ({"pp": 2, "dp": 2}, fxpar.Plan(stages=2, microbatches=2, zero=3), False),
    ({"pp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), stages=2, microbatches=2), True),
], ids=["pp2 interleaved, tied embeddings", "pp2 x dp2 zero3", "pp2 x tp2, tied embeddings"])
def test_clipping_over_pipeline_stages_matches_the_single_device(axes: dict, plan: fxpar.Plan, tie: bool) -> None:
    # a rank holds only its stages' parameters: torch's clip_grad_norm_(pm.parameters()) would clip each stage by
    # its own norm; pm.clip_grad_norm_ sums the stages' norms over pp and counts a tied weight once. fp32, one
    # step: norms and clipped gradients agree to 1e-5 relative (reduction order across ranks and microbatches)
    world = 1
    for n in axes.values():
        world *= n
    for rank in default_pool().run(clipped_against_single_device, world, axes, plan, TOKENS, tie, 0.5, timeout=300):
        assert rank["norm"] == pytest.approx(rank["want"], rel=1e-5)
        assert rank["want"] > 0.5  # the clip is active: the gradients were scaled
        assert rank["grad_diff"] < 1e-5, rank
