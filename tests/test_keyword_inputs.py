"""Keyword inputs (``model(**batch)``, HF style): ``example_inputs`` as a dict, ``pm(**batch)`` and
``pm.step(batch, targets)``; non-tensor inputs are constants of the compiled program."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fxpar
from fxpar.models.llama import hf_llama_plan
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

TOKENS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
MASK = torch.ones(4, 16, dtype=torch.long)
MASK[1, 12:] = 0  # a padded row: the mask changes the attention, so it must reach the program
BATCH = {"input_ids": TOKENS, "attention_mask": MASK, "use_cache": False}


class Scaled(torch.nn.Module):
    """``down(up(x) * scale)``, masked where ``mask`` is given: a tensor, an optional tensor and a float."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
        h = self.up(x) * scale
        return self.down(h if mask is None else h * mask)


def _hf(**kwargs: int) -> torch.nn.Module:
    from fxpar.models.hf import hf_llama

    return hf_llama(**kwargs)


@pytest.mark.parametrize("axes,plan", [({"dp": 2}, None), ({"tp": 2}, fxpar.Plan(tp=hf_llama_plan()))],
                         ids=["dp2", "tp2"])
def test_hf_llama_with_keyword_inputs_matches_single_device(axes: dict[str, int], plan: object) -> None:
    pytest.importorskip("transformers")
    assert_equivalent(partial(_hf, layers=2), axes, plan, BATCH, steps=2, loss_fn=next_token_loss, targets=TOKENS)


def test_keyword_inputs_through_the_forward_path_match_single_device() -> None:
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    batch = {"x": x, "mask": (torch.rand(8, 64, generator=torch.Generator().manual_seed(2)) > 0.3).float(),
             "scale": 0.5}
    assert_equivalent(Scaled, {"dp": 2}, None, batch, steps=2)
    assert_equivalent(Scaled, {"tp": 2}, {"up": "colwise", "down": "rowwise"}, batch, steps=2)


def test_a_constant_that_differs_at_run_time_is_a_clear_error() -> None:
    from fxpar.compiled import flat_user_inputs

    x = torch.randn(8, 32)
    pm = fxpar.parallelize(Scaled(), fxpar.Mesh({"tp": 2}, fake=True), {"x": x, "mask": None, "scale": 2.0})
    c = pm._compiled
    assert c.input_keys == ("x",) and c.constants == {"mask": None, "scale": 2.0}
    assert flat_user_inputs(c, ({"x": x, "mask": None, "scale": 2.0},))[0][0] is x
    with pytest.raises(ValueError, match=r"keyword input 'scale' is 3.0 here but was 2.0 when the program was"):
        flat_user_inputs(c, ({"x": x, "mask": None, "scale": 3.0},))
    with pytest.raises(ValueError, match=r"keyword input 'mask' is tensor"):
        flat_user_inputs(c, ({"x": x, "mask": torch.ones(8, 64), "scale": 2.0},))
    with pytest.raises(TypeError, match=r"keyword inputs \['x'\] differ from the compiled ones"):
        flat_user_inputs(c, ({"x": x},))
    positional = fxpar.parallelize(Scaled(), fxpar.Mesh({"tp": 2}, fake=True), (x, None, 2.0))._compiled
    with pytest.raises(ValueError, match=r"positional input 2 is 1.0 here but was 2.0"):
        flat_user_inputs(positional, (x, None, 1.0))


@pytest.mark.parametrize("nested", [{"mask": [torch.ones(8, 64)]}, {"mask": {"m": torch.ones(8, 64)}}],
                         ids=["list", "dict"])
def test_tensors_nested_in_an_input_are_a_clear_error(nested: dict) -> None:
    """A container of tensors would be baked in as a constant (unsharded, its values frozen, and compared with
    ``==`` at run time, which crashed): it is refused when compiling, naming the input."""
    with pytest.raises(TypeError, match=r"keyword input 'mask' is a (list|dict) holding tensors"):
        fxpar.parallelize(Scaled(), fxpar.Mesh({"dp": 2}, fake=True), {"x": torch.randn(8, 32), **nested})
    with pytest.raises(TypeError, match=r"positional input 1 is a list holding tensors"):
        fxpar.parallelize(Scaled(), fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(8, 32), [torch.ones(8, 64)]))
