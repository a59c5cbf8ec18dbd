"""``Plan(tp="hf")``: the model's own Hugging Face tensor-parallel plan, mapped onto fxpar's styles."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fxpar
from fxpar.hf_plan import hf_tp_plan
from fxpar.models.llama import hf_llama_plan
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

transformers = pytest.importorskip("transformers")
TOKENS = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))


def _hf(**kwargs: int) -> torch.nn.Module:
    from fxpar.models.hf import hf_llama

    return hf_llama(**kwargs)


def test_hf_llama_plan_maps_onto_megatron_styles_and_names_what_it_cannot_honour() -> None:
    with pytest.warns(fxpar.FxparWarning, match=r"model.embed_tokens \(embedding_rowwise: a vocab-parallel"):
        plan = hf_tp_plan(_hf())
    assert plan == {**hf_llama_plan(), "lm_head": "colwise"}  # colwise_gather_output: fxpar gathers where needed


def test_plan_tp_hf_matches_single_device_at_tp2() -> None:
    assert_equivalent(partial(_hf, layers=2), {"tp": 2}, fxpar.Plan(tp="hf"), (TOKENS,), steps=2,
                      loss_fn=next_token_loss, targets=TOKENS)


def test_a_model_without_an_hf_plan_is_a_clear_error() -> None:
    from fxpar.models.mlp import mlp

    with pytest.raises(fxpar.PlanError, match="has no Hugging Face tensor-parallel plan"):
        fxpar.parallelize(mlp(), fxpar.Mesh({"tp": 2}, fake=True), (torch.randn(4, 32),), plan=fxpar.Plan(tp="hf"))
