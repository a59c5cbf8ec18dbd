"""Parallel programs vs the single-device model on real gloo ranks (``fxpar.testing.assert_equivalent``).

Each case compares forward outputs and every parameter gradient (fp32: rtol 1e-5, atol 1e-6 times the
tensor's magnitude: a different summation order), then parameters after 3 AdamW steps (atol 2% of lr: see
``fxpar.testing.tolerance`` for why Adam needs an absolute floor), each on every rank's own shard.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fxpar
from fxpar.models.llama import hf_llama_plan, llama, llama_plan
from fxpar.models.mlp import mlp, mlp_plan
from fxpar.testing import assert_equivalent

MESHES = [{"dp": 2}, {"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}]


def _ids(mesh: dict[str, int]) -> str:
    return "x".join(f"{k}{v}" for k, v in mesh.items())


@pytest.mark.parametrize("mesh", MESHES, ids=_ids)
def test_mlp(mesh: dict[str, int]) -> None:
    torch.manual_seed(1)
    assert_equivalent(mlp, mesh, mlp_plan() if "tp" in mesh else None, (torch.randn(8, 32),))


@pytest.mark.parametrize("mesh", MESHES, ids=_ids)
def test_bundled_llama(mesh: dict[str, int]) -> None:
    torch.manual_seed(2)
    tokens = torch.randint(0, 256, (4, 16))
    model_fn = partial(llama, n_heads=4, n_kv_heads=4 if mesh.get("tp") == 4 else 2)
    assert_equivalent(model_fn, mesh, llama_plan() if "tp" in mesh else None, (tokens,))


@pytest.mark.parametrize("mesh", MESHES, ids=_ids)
def test_hf_llama(mesh: dict[str, int]) -> None:
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    torch.manual_seed(3)
    tokens = torch.randint(0, 128, (4, 16))
    model_fn = partial(hf_llama, kv_heads=4 if mesh.get("tp") == 4 else 2)
    assert_equivalent(model_fn, mesh, hf_llama_plan() if "tp" in mesh else None, (tokens,))


def test_tied_embeddings_bundled_llama() -> None:
    """The head is the tied table's second name: its style shards the one weight (it used to be ignored silently,
    leaving the table replicated); the embedding then reads the gathered table."""
    torch.manual_seed(4)
    tokens = torch.randint(0, 256, (4, 16))
    plan = {**llama_plan(), "lm_head": "colwise"}
    pm = fxpar.parallelize(llama(tie_embeddings=True), fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (tokens,), plan=plan)
    assert pm.program(0).count("# embed_weight: f32[128,64]") == 1  # vocab 256 in halves over tp
    assert_equivalent(partial(llama, tie_embeddings=True), {"dp": 2, "tp": 2}, plan, (tokens,))
