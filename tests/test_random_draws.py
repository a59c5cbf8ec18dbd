"""Random ops (dropout, noise, stochastic activations) draw exactly what the single device draws (fxpar.random_draws):
a random op on a sharded value is drawn whole and each rank keeps its piece; one whose numbers depend on values runs
whole; every rank starts from rank 0's generator state."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fxpar
from fxpar.errors import FxparWarning
from fxpar.models.llama import llama, llama_plan
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.pool import default_pool
from fxpar.testing.probes import generator_states_after_build
from fxpar.testing.user_models import gpt2_with_dropout, stochastic

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
FEATURES = torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(1))
DROPOUT_LLAMA = partial(llama, n_layers=2, dropout=0.1)


@pytest.mark.parametrize(("model_fn", "axes", "plan", "inputs"), [
    (DROPOUT_LLAMA, {"dp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), sequence_parallel=True, zero=3), TOKENS),
    (DROPOUT_LLAMA, {"dp": 2}, fxpar.Plan(microbatches=2), TOKENS),
    (stochastic, {"dp": 2, "tp": 2}, fxpar.Plan(tp={"up": "colwise", "down": "rowwise"}), FEATURES),
], ids=["llama dropout, dp2 x tp2 SP ZeRO-3", "llama dropout, dp2, 2 microbatches",
        "rrelu, bernoulli(probs), normal, dropout on dp2 x tp2"])
def test_random_ops_draw_what_the_single_device_draws(model_fn: object, axes: dict, plan: fxpar.Plan,
                                                       inputs: torch.Tensor) -> None:
    # training mode, every rank seeded alike (and synced from rank 0): forward outputs, gradients and parameters
    # after three AdamW steps match the single device at the default fp32 tolerance (rtol 1e-5), which a mask
    # drawn on the local shard (each rank the same pattern, none the single device's) misses by far
    assert_equivalent(model_fn, axes, plan, (inputs,), steps=3)


GPT2_TP = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
           "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def lm_loss(out: object, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), tokens.flatten())


def test_hf_gpt2_with_its_default_dropouts_matches_the_single_device() -> None:
    pytest.importorskip("transformers")
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(2))
    assert_equivalent(gpt2_with_dropout, {"dp": 2, "tp": 2}, fxpar.Plan(tp=GPT2_TP, sequence_parallel=True),
                      (tokens,), steps=3, loss_fn=lm_loss, targets=tokens)


def test_a_sharded_dropout_is_drawn_whole_and_sliced_and_stays_in_the_sequence_parallel_region() -> None:
    pm = fxpar.parallelize(DROPOUT_LLAMA(), fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True))
    forward = pm.program(rank=3).split("def backward")[0].splitlines()
    draws = [line for line in forward if "aten.native_dropout(" in line]
    assert len(draws) == 4  # two per layer, each mask drawn on the whole (4, 16, 64) residual
    assert all("f32[4,16,64], b8[4,16,64]" in line and "_whole" in line for line in draws), draws
    # rank 3 keeps its piece: rows 2-3 over dp, then positions 8-15 over tp (sequence parallel), copied out of the
    # whole mask (a saved slice would keep the whole mask alive until the backward)
    slices = [line for line in forward if "aten.slice.Tensor(" in line and "b8[2,8,64]" in line]
    assert len(slices) == 4 and all(", 1, 8, 16)" in line for line in slices), slices
    pieces = [line for line in forward if "b8[2,8,64]   dp:S(0) tp:S(1)" in line]
    assert len(pieces) == 4 and all("aten.clone(" in line for line in pieces), pieces
    # Megatron SP: a rowwise output is reduce-scattered onto the sequence and dropped out there, not all-reduced
    forward_tp = {r.op for r in pm.ledger(3) if r.phase == "fwd" and r.axis == "tp"}
    assert forward_tp == {"all_gather", "reduce_scatter"}, forward_tp


def test_every_rank_starts_from_rank_0s_generator_state() -> None:
    # ranks seeded differently would draw different masks for copies of one value (a dropout after a tp
    # all-reduce): building the ParallelModule copies rank 0's state to all, as DTensor's RNG tracker does
    for agree in default_pool().run(generator_states_after_build, 2, {"dp": 2}, TOKENS, timeout=120):
        assert all(agree), agree


@pytest.mark.parametrize(("axes", "plan"), [({"pp": 2}, fxpar.Plan(stages=2)), ({"dp": 2}, fxpar.Plan(compile=True))],
                         ids=["pipeline stages", "compile=True"])
def test_where_the_numbers_are_not_the_single_devices_a_warning_says_so(axes: dict, plan: fxpar.Plan) -> None:
    with pytest.warns(FxparWarning, match="not the single device's"):
        fxpar.parallelize(DROPOUT_LLAMA(), fxpar.Mesh(axes, fake=True), (TOKENS,), plan=plan,
                          loss_fn=next_token_loss)
