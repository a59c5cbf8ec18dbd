"""Which modules are shared as repeated blocks: layers grouped in nested lists are found through the lists (which
are never called); a model that holds repeated layers without calling them is captured whole, and says why."""

from __future__ import annotations

import warnings

import pytest
import torch

import fxpar
from fxpar.testing import assert_equivalent
from fxpar.testing.grouped_layers import GroupedLayers, WeightsOnlyLayers

INPUTS = (torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0)),)
MESHES = [({"dp": 2}, None), ({"dp": 2}, fxpar.Plan(zero=3)), ({"pp": 2}, fxpar.Plan(stages=2, microbatches=2))]


def _square(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target[..., :3]).pow(2).mean()


def _compile(build: type, axes: dict[str, int], plan: object, share: bool,
             monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], fxpar.ParallelModule]:
    monkeypatch.setenv("FXPAR_SHARING", "1" if share else "0")
    kw = dict(loss_fn=_square, example_targets=INPUTS[0]) if "pp" in axes else {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        pm = fxpar.parallelize(build(), fxpar.Mesh(axes, fake=True), INPUTS, plan=plan, **kw)
    return [pm.program(r) + pm.ledger_table(r) + str(pm.memory(r)) for r in range(2)], pm


@pytest.mark.parametrize(("axes", "plan"), MESHES, ids=["dp2", "dp2_zero3", "pp2"])
def test_layers_grouped_in_nested_lists_are_shared(axes: dict[str, int], plan: object,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The groups (``ModuleList``s) had been taken for the blocks: never called, so nothing was shared, and with the
    blocks' state taken off the export the layers inside read a placeholder (a ``CaptureError``, then whole)."""
    shared, pm = _compile(GroupedLayers, axes, plan, True, monkeypatch)
    whole, _ = _compile(GroupedLayers, axes, plan, False, monkeypatch)
    assert (pm.captures.whole, pm.captures.blocks, pm.captures.distinct) == (False, 8, 1), pm.captures
    assert shared == whole


def test_repeated_layers_the_model_never_calls_capture_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pipeline (whose export keeps the blocks' state) had reported ``whole=False`` with no block at all; without
    stages the export takes the blocks' state off, and the model's own read of a weight fails that trace first."""
    split_at_head = ({"pp": 2}, fxpar.Plan(stages=["head"], microbatches=2))  # (no layer call to split at)
    for axes, plan in [*MESHES[:2], split_at_head]:
        shared, pm = _compile(WeightsOnlyLayers, axes, plan, True, monkeypatch)
        whole, _ = _compile(WeightsOnlyLayers, axes, plan, False, monkeypatch)
        assert pm.captures.whole, pm.captures
        if "pp" in axes:
            assert "calls none of its repeated blocks" in pm.captures.reason, pm.captures
        assert shared == whole


def test_layers_grouped_in_nested_lists_train_like_the_single_device() -> None:
    """fp32, rtol 1e-5 (``assert_equivalent``): outputs, gradients and parameters after 2 AdamW steps."""
    assert_equivalent(GroupedLayers, {"dp": 2}, fxpar.Plan(zero=3), INPUTS, steps=2)
