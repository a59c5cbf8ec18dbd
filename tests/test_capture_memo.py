"""Captures reused within a scope that vouches for the model (``fxpar.capture_memo``).

A compile that reuses a capture prints the same rank programs and ledgers as one that traces afresh, for
whole-model and pipeline-stage captures alike; anything capture reads (input shapes, a cp axis, the
pipeline's stage starts, ``param_dtype``) makes a new capture; a model the scope does not vouch for is never
served from it; and outside any scope every compile traces.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxpar
from fxpar.api import compile_program
from fxpar.capture_memo import CaptureMemo
from fxpar.models.llama import llama, llama_plan
from fxpar.testing.error_models import next_token_loss

MESHES_AND_PLANS = [  # one capture serves each group: the mesh's dp/tp sizes and the plan are the passes' business
    ({"dp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan())),
    ({"tp": 4}, fxpar.Plan(tp=llama_plan(), sequence_parallel=True, zero=0)),
    ({"dp": 4}, fxpar.Plan(zero=3, recompute="full")),
]
PIPELINES = [
    ({"pp": 2, "dp": 2}, fxpar.Plan(zero=1, microbatches=2)),
    ({"pp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), microbatches=2, schedule="gpipe")),
]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return llama(n_layers=2, hidden=32, n_heads=2, n_kv_heads=2)


def _tokens(batch: int = 8, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))


def _texts(model: torch.nn.Module, axes: dict[str, int], plan: fxpar.Plan, tokens: torch.Tensor,
           loss_fn: Any = None) -> list[str]:
    pm = fxpar.parallelize(model, fxpar.Mesh(axes, fake=True), (tokens,), plan, loss_fn=loss_fn)
    ranks = range(pm.mesh.size)
    return [pm.program(r) for r in ranks] + [repr(pm.ledger(r)) for r in ranks]


@pytest.mark.parametrize("cases,loss_fn", [(MESHES_AND_PLANS, None), (PIPELINES, next_token_loss)],
                         ids=["whole", "stages"])
def test_a_reused_capture_compiles_to_the_same_programs_and_ledgers(cases: list, loss_fn: Any) -> None:
    model, tokens, memo = _model(), _tokens(), CaptureMemo()
    fresh = [_texts(model, axes, plan, tokens, loss_fn) for axes, plan in cases]
    with memo.vouching(model):
        reused = [_texts(model, axes, plan, tokens, loss_fn) for axes, plan in cases]
    assert (memo.misses, memo.hits) == (1, len(cases) - 1)
    assert reused == fresh


def test_what_capture_reads_makes_a_new_capture() -> None:
    model, memo = _model(), CaptureMemo()
    mesh = fxpar.Mesh({"dp": 2}, fake=True)
    with memo.vouching(model):
        compile_program(model, mesh, (_tokens(),))
        compile_program(model, mesh, (_tokens(batch=4),))  # another batch
        compile_program(model, mesh, (_tokens(seq=8),))  # another sequence length
        compile_program(model, fxpar.Mesh({"cp": 2}, fake=True), (_tokens(),))  # tokens kept un-flattened
        compile_program(model, mesh, (_tokens(),), fxpar.Plan(param_dtype=torch.bfloat16))  # computes in bf16
        compile_program(model, fxpar.Mesh({"pp": 2}, fake=True), (_tokens(),), fxpar.Plan(stages=["layers.1"]),
                        loss_fn=next_token_loss)
        compile_program(model, fxpar.Mesh({"pp": 2}, fake=True), (_tokens(),), loss_fn=next_token_loss)
        assert (memo.misses, memo.hits) == (7, 0)
        compile_program(model, mesh, (_tokens(),), fxpar.Plan(zero=2))
    assert (memo.misses, memo.hits) == (7, 1)


def test_only_the_vouched_model_is_served() -> None:
    vouched, other, memo = _model(), _model(), CaptureMemo()
    mesh = fxpar.Mesh({"dp": 2}, fake=True)
    with memo.vouching(vouched):
        compile_program(vouched, mesh, (_tokens(),))
        compile_program(other, mesh, (_tokens(),))  # same structure, another object: traced, not looked up
    compile_program(vouched, mesh, (_tokens(),))  # outside the scope
    assert (memo.misses, memo.hits) == (1, 0)


def test_parallelize_alone_captures_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxpar.compiled

    calls = []
    real = fxpar.compiled.capture
    monkeypatch.setattr(fxpar.compiled, "capture", lambda *a, **k: calls.append(1) or real(*a, **k))
    model, mesh = _model(), fxpar.Mesh({"dp": 2}, fake=True)
    fxpar.parallelize(model, mesh, (_tokens(),))
    fxpar.parallelize(model, mesh, (_tokens(),), fxpar.Plan(zero=1))
    assert len(calls) == 2
