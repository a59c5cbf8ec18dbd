"""Blocks shared across pipeline stages: a stage of shared blocks captures as the whole model's stage does.

A layer that takes an argument it never reads and returns a view (OPT's decoder layer) had made every OPT pipeline
fall back to the whole-model capture (``KeyError: alias``). Fixed, the stages print as the whole model's: the
boundary copies the view as the whole stage does, and what only unread inputs need takes no name. Where the
unread argument depends on the input (a whole-model stage would not receive it), the model is captured whole.
A float the layers read that no parameter flows into (a mask from the input) crosses a boundary without a gradient:
it had been received as needing one, so the stage computed and sent back a gradient nobody reads, and a shared
block, traced as the whole model calls it, had no such gradient (the pipeline fell back to the whole capture).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpar
from fxpar.testing import assert_equivalent
from fxpar.testing.stage_blocks import InputMaskIgnored, InputMaskRead, PositionsIgnored, stage_loss

INPUTS = (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0)),)
PIPELINES = [({"pp": 2}, 2), ({"pp": 2, "dp": 2}, 2), ({"pp": 4}, 4)]


@pytest.fixture(autouse=True)
def _share_from_two(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPAR_SHARE_MIN", "2")


def _programs(build: type, axes: dict[str, int], stages: int, share: bool,
              monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], fxpar.ParallelModule]:
    monkeypatch.setenv("FXPAR_SHARING", "1" if share else "0")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        pm = fxpar.parallelize(build(), fxpar.Mesh(axes, fake=True), INPUTS,
                               plan=fxpar.Plan(stages=stages, microbatches=2), loss_fn=stage_loss,
                               example_targets=INPUTS[0])
    world = 1
    for size in axes.values():
        world *= size
    return [pm.program(r) + pm.ledger_table(r) + str(pm.memory(r)) for r in range(world)], pm


@pytest.mark.parametrize(("axes", "stages"), PIPELINES, ids=["pp2", "pp2_dp2", "pp4"])
def test_layers_ignoring_an_argument_share_across_stages_as_the_whole_model(
        axes: dict[str, int], stages: int, monkeypatch: pytest.MonkeyPatch) -> None:
    shared, pm = _programs(PositionsIgnored, axes, stages, True, monkeypatch)
    whole, _ = _programs(PositionsIgnored, axes, stages, False, monkeypatch)
    captures = pm.captures
    assert (captures.whole, captures.blocks, captures.distinct) == (False, 4, 1), captures
    assert shared == whole


def test_an_ignored_argument_from_the_input_captures_the_pipeline_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    shared, pm = _programs(InputMaskIgnored, {"pp": 2}, 2, True, monkeypatch)
    whole, _ = _programs(InputMaskIgnored, {"pp": 2}, 2, False, monkeypatch)
    captures = pm.captures
    assert captures.whole and "read only by blocks that ignore it" in captures.reason, captures
    assert shared == whole


def test_layers_ignoring_an_argument_train_like_the_single_device_on_a_pipeline() -> None:
    """fp32, rtol 1e-5 (``assert_equivalent``): outputs, gradients and parameters after 2 AdamW steps."""
    assert_equivalent(PositionsIgnored, {"pp": 2}, fxpar.Plan(stages=2, microbatches=2), INPUTS, steps=2,
                      loss_fn=stage_loss, targets=INPUTS[0])


def test_a_mask_from_the_input_crosses_a_stage_without_a_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    shared, pm = _programs(InputMaskRead, {"pp": 2}, 2, True, monkeypatch)
    whole, _ = _programs(InputMaskRead, {"pp": 2}, 2, False, monkeypatch)
    assert not pm.captures.whole, pm.captures
    assert shared == whole
    boundary = pm._compiled.stages[1].notes["stage"].received
    with_grad = [name for name, _ in pm._compiled.stages[1].signature.input_grads]
    assert len(boundary) == 2 and len(with_grad) == 1, (boundary, with_grad)  # the activation's, not the mask's
    sends = [row for row in pm.ledger(1) if row.op == "send"]
    assert len(sends) == 2 and all(row.shape == (2, 6, 8) for row in sends), sends  # one per microbatch


def test_a_mask_from_the_input_trains_like_the_single_device_on_a_pipeline() -> None:
    assert_equivalent(InputMaskRead, {"pp": 2}, fxpar.Plan(stages=2, microbatches=2), INPUTS, steps=2,
                      loss_fn=stage_loss, targets=INPUTS[0])
