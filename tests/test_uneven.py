"""Uneven shards: a dim its mesh axis does not divide is split as DTensor splits it (``torch.chunk``: pieces of
``ceil(size / n)`` first) and computes what the single device computes."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fxpar
from fxpar.models.llama import hf_llama_plan, llama, llama_plan
from fxpar.models.mlp import mlp
from fxpar.split import chunk_size
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

TOKENS = torch.randint(0, 130, (8, 16), generator=torch.Generator().manual_seed(0))


def _check(model_fn, axes: dict[str, int], plan: fxpar.Plan) -> None:  # noqa: ANN001
    assert_equivalent(model_fn, axes, plan, (TOKENS,), steps=3, loss_fn=next_token_loss, targets=TOKENS)


def test_chunk_sizes_are_dtensors() -> None:
    for total, n in [(102, 4), (130, 4), (100, 3), (5, 4), (8, 4)]:
        sizes = [chunk_size(total, n, i) for i in range(n)]
        assert sizes == [len(c) for c in torch.arange(total).chunk(n)] + [0] * (n - len(torch.arange(total).chunk(n)))


def test_hf_llama_intermediate_102_and_lm_head_vocab_130_at_tp4_matches_single_device() -> None:
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    plan = fxpar.Plan(tp={**hf_llama_plan(), "lm_head": "colwise"})
    _check(partial(hf_llama, layers=2, intermediate=102, vocab=130), {"tp": 4}, plan)


def test_tp3_with_zero3_on_dp2_matches_single_device() -> None:
    # hidden 96 at tp=3 (6 heads, 3 kv heads), intermediate 100 (pieces 34, 34, 32), vocab 130
    model_fn = partial(llama, n_layers=2, vocab_size=130, hidden=96, n_heads=6, n_kv_heads=3, intermediate=100)
    _check(model_fn, {"dp": 2, "tp": 3}, fxpar.Plan(tp=llama_plan(), zero=3))


def test_local_shapes_follow_torch_chunk_and_gathers_pad_to_equal_pieces() -> None:
    plan = fxpar.Plan(tp={**llama_plan(), "lm_head": "colwise"})
    pm = fxpar.parallelize(llama(n_layers=1, vocab_size=130, intermediate=102), fxpar.Mesh({"tp": 4}, fake=True),
                           (TOKENS,), plan=plan)
    for rank, (inter, vocab) in enumerate([(26, 33), (26, 33), (26, 33), (24, 31)]):
        shapes = {n.name: tuple(n.meta["val"].shape) for n in pm.rank_program(rank).forward.graph.nodes
                  if n.op == "placeholder"}
        assert shapes["layers_0_mlp_up_weight"][0] == inter and shapes["layers_0_mlp_down_weight"][1] == inter
        assert shapes["lm_head_weight"][0] == vocab
        # the logits all-gather moves 4 equal pieces of 33 rows (the last rank pads 2), then drops the padding
        logits = [r for r in pm.ledger(rank) if r.op == "all_gather" and 132 in r.shape]
        assert len(logits) == 1 and logits[0].bytes == 132 * TOKENS.numel() * 4


def test_batch_of_6_at_dp4_matches_single_device() -> None:
    # the first dp ranks hold one more sample (2, 2, 1, 1): each rank's mean loss weighs b_r / B
    tokens = TOKENS[:6]
    model_fn = partial(llama, n_layers=2, vocab_size=130, intermediate=102)
    assert_equivalent(model_fn, {"dp": 4}, None, (tokens,), steps=3, loss_fn=next_token_loss, targets=tokens)


def test_uneven_batch_and_uneven_widths_with_zero2_forward_backward_path() -> None:
    # pm(x) + loss.backward() (no loss_fn): the program scales its incoming gradient by b_r / B
    x = torch.randn(5, 20, generator=torch.Generator().manual_seed(1))
    # hidden 22 at tp=3 (8, 8, 6) with a LayerNorm over it: a mean and a variance over an uneven dim
    model_fn = partial(mlp, dim=20, hidden=22, out=10, norm="layer")
    assert_equivalent(model_fn, {"dp": 2, "tp": 3}, fxpar.Plan(tp={"up": "colwise", "down": "rowwise"}, zero=2),
                      (x,), steps=3)


def test_uneven_batch_pieces_are_tensor_split() -> None:
    pm = fxpar.parallelize(llama(n_layers=1, vocab_size=130), fxpar.Mesh({"dp": 4}, fake=True), (TOKENS[:6],))
    for rank, rows in enumerate([2, 2, 1, 1]):
        inputs = [n for n in pm.rank_program(rank).forward.graph.nodes if n.op == "placeholder" and "input" in n.name]
        assert tuple(inputs[0].meta["val"].shape) == (rows, 16)
        assert f"mul(tangents_1, {rows / 6})" in pm.program(rank).replace("aten.mul.Tensor", "mul")


def test_batch_of_5_on_pp2_x_dp2_splits_the_received_activations_as_the_first_stage_does() -> None:
    """The second stage reads no user input, so it did not know dim 0 of what it receives is the batch: a batch dp
    does not divide (5 on dp=2) was compiled replicated there (f32[5, ...]) while the first stage sent 3 and 2 rows,
    and the step failed in a reshape. Every stage now records the global batch (``notes["batch"]``) and places
    received values by it; the step matches the single device (fp32, rtol 1e-5)."""
    tokens = torch.randint(0, 130, (5, 16), generator=torch.Generator().manual_seed(0))
    model_fn = partial(llama, n_layers=2, vocab_size=130)
    pm = fxpar.parallelize(model_fn(), fxpar.Mesh({"pp": 2, "dp": 2}, fake=True), (tokens,),
                           plan=fxpar.Plan(stages=2, microbatches=1), loss_fn=next_token_loss)
    assert "f32[5," not in pm.program(rank=2)
    assert_equivalent(model_fn, {"pp": 2, "dp": 2}, fxpar.Plan(stages=2, microbatches=1), (tokens,), steps=2,
                      loss_fn=next_token_loss, targets=tokens)
