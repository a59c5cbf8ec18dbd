"""Parallel programs vs the single-device model on real gloo ranks.

Each case compares forward outputs and every parameter gradient (rtol 1e-5, atol 1e-6: fp32
with a different summation order), then parameters after 3 AdamW steps (lr 1e-3, atol 1e-5:
see ``fxpar.testing.equivalence.param_atol`` for why Adam needs an absolute floor).
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_equivalent

from fxpar.models.llama import hf_llama_plan, llama_plan
from fxpar.models.mlp import mlp_plan

MESHES = [{"dp": 2}, {"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}]


def _ids(mesh: dict[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in mesh.items())


@pytest.mark.parametrize("mesh", MESHES, ids=_ids)
def test_mlp(mesh: dict[str, int]) -> None:
    torch.manual_seed(1)
    assert_equivalent("fxpar.models.mlp:mlp", {}, mesh, mlp_plan() if "tp" in mesh else None, (torch.randn(8, 32),))


@pytest.mark.parametrize("mesh", MESHES, ids=_ids)
def test_bundled_llama(mesh: dict[str, int]) -> None:
    torch.manual_seed(2)
    tokens = torch.randint(0, 256, (4, 16))
    config = {"n_heads": 4, "n_kv_heads": 4 if mesh.get("tp") == 4 else 2}
    assert_equivalent("fxpar.models.llama:llama", config, mesh, llama_plan() if "tp" in mesh else None, (tokens,))


@pytest.mark.parametrize("mesh", MESHES, ids=_ids)
def test_hf_llama(mesh: dict[str, int]) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(3)
    tokens = torch.randint(0, 128, (4, 16))
    config = {"kv_heads": 4 if mesh.get("tp") == 4 else 2}
    assert_equivalent("fxpar.models.hf:hf_llama", config, mesh, hf_llama_plan() if "tp" in mesh else None, (tokens,))


def test_tied_embeddings_bundled_llama() -> None:
    torch.manual_seed(4)
    tokens = torch.randint(0, 256, (4, 16))
    assert_equivalent("fxpar.models.llama:llama", {"tie_embeddings": True}, {"dp": 2, "tp": 2}, llama_plan(), (tokens,))
