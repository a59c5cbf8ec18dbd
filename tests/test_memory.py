"""``pm.memory(rank)``: predicted bytes per rank against the formula and against what a real step holds."""

from __future__ import annotations

from fnmatch import fnmatch
from functools import partial

import pytest
import torch

import fxpar
from fxpar.memory import largest_live_set
from fxpar.models.llama import LlamaConfig, llama, llama_plan
from fxpar.testing import default_pool
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.probes import held_between_events, measured_memory

TOKENS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))


def _local_elements(model: torch.nn.Module, plan: dict[str, str], tp: int) -> int:
    """Psi per rank in elements: a parameter of a colwise/rowwise module holds 1/tp of its elements."""
    total = 0
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        sharded = any(fnmatch(module, glob) and style in ("colwise", "rowwise") for glob, style in plan.items())
        total += p.numel() // tp if sharded else p.numel()
    return total


def test_zero0_formula_on_a_fake_mesh() -> None:
    # DDP with fp32 AdamW: 4 (param) + 4 (grad) + 8 (two Adam states) bytes per local element = 16 Psi
    model = llama(n_layers=2)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (TOKENS,), plan=llama_plan())
    psi = _local_elements(model, llama_plan(), tp=2)
    for rank in (0, 3):
        mem = pm.memory(rank)
        assert (mem.params, mem.grads, mem.optimizer) == (4 * psi, 4 * psi, 8 * psi)
        assert mem.params + mem.grads + mem.optimizer == 16 * psi
        assert mem.activations > 0 and mem.transient > 0
        assert mem.buffers == sum(b.numel() * b.element_size() for b in model.buffers()) > 0  # the rotary tables
        assert mem.peak == mem.params + mem.grads + mem.optimizer + mem.activations + mem.transient + mem.buffers
    assert "peak" in str(pm.memory(0))


def test_tied_weight_counts_once_per_rank() -> None:
    model = llama(n_layers=2, tie_embeddings=True)
    pm = fxpar.parallelize(model, fxpar.Mesh({"tp": 2}, fake=True), (TOKENS,), plan=llama_plan())
    assert pm.memory(0).params == 4 * _local_elements(model, llama_plan(), tp=2)


def test_prediction_equals_local_storage_after_a_real_step() -> None:
    results = default_pool().run(measured_memory, 4, llama, {"dp": 2, "tp": 2}, llama_plan(), TOKENS,
                                 next_token_loss, timeout=300)
    for r in results:
        mem = r["predicted"]
        assert (mem.params, mem.grads, mem.optimizer) == (r["params"], r["grads"], r["optimizer"])
        # one microbatch, one set in flight, and the logits' gradient pm.step makes with the loss and holds until
        # the backward reads it (dp=2: half the rows; the head is not tp-sharded)
        logits_grad = TOKENS.shape[0] // 2 * TOKENS.shape[1] * LlamaConfig().vocab_size * 4
        assert mem.activations == r["saved_per_microbatch"] + logits_grad == r["held"]
        assert mem.buffers == r["buffers"] > 0  # the module's copies of the rotary tables


def test_a_piece_tp_splits_unevenly_holds_only_its_own_elements() -> None:
    """Intermediate 101 on tp=2 splits 51 / 50: the second rank's pieces of the MLP weights held a view of a padded
    51-row buffer (``distribute_tensor`` pads, scatters and narrows), more than ``pm.memory`` counts."""
    model = partial(llama, intermediate=101, bias=True)
    results = default_pool().run(measured_memory, 2, model, {"tp": 2}, llama_plan(), TOKENS, next_token_loss,
                                 timeout=300)
    assert results[0]["params"] > results[1]["params"]  # the uneven piece is smaller
    for r in results:
        assert (r["predicted"].params, r["predicted"].grads) == (r["params"], r["grads"])


@pytest.mark.parametrize("zero", [0, 3])
def test_frozen_parameters_hold_no_optimizer_state(zero: int) -> None:
    """AdamW keeps no state for a parameter that never gets a gradient; ``optimizer`` counted one for each."""
    from fxpar.testing.user_models import frozen_backbone

    results = default_pool().run(measured_memory, 2, frozen_backbone, {"dp": 2}, fxpar.Plan(zero=zero), TOKENS,
                                 next_token_loss, timeout=300)
    trainable = sum(p.numel() for p in frozen_backbone().parameters() if p.requires_grad)
    for r in results:
        mem = r["predicted"]
        assert mem.optimizer == r["optimizer"] == 8 * trainable // (2 if zero else 1)
        assert (mem.params, mem.grads) == (r["params"], r["grads"])


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_prediction_equals_local_storage_after_a_real_step(zero: int) -> None:
    # ZeRO-1: shards plus the step's gathered working copies; ZeRO-3: the shards alone (16 Psi / N)
    plan = fxpar.Plan(tp=llama_plan(), zero=zero)
    results = default_pool().run(measured_memory, 4, llama, {"dp": 2, "tp": 2}, plan, TOKENS, next_token_loss,
                                 timeout=300)
    psi = 4 * _local_elements(llama(), llama_plan(), tp=2)
    for r in results:
        mem = r["predicted"]
        assert (mem.optimizer, r["optimizer"]) == (psi, psi)  # 8 Psi / N with N = dp = 2, in local fp32 bytes
        assert mem.activations == r["held"] > r["saved_per_microbatch"]  # the logits' gradient besides
        if zero == 3:
            assert (mem.params, mem.grads) == (r["params"], r["grads"]) == (psi // 2, psi // 2)
        else:  # the gathered working copy lives only inside pm.step: the measured storage is the shards
            assert (mem.params - psi, mem.grads - psi) == (r["params"], r["grads"]) == (psi // 2, psi // 2)


@pytest.mark.parametrize("zero", [1, 3])
def test_uneven_zero_shards_are_predicted_as_held(zero: int) -> None:
    """dp=3 on widths it does not divide (hidden 40, intermediate 100, vocab 128): each rank holds DTensor's piece
    of every parameter (14 or 13 rows of 40; 34, 34 or 32 of 100), and ``pm.memory`` says so on each rank."""
    model_fn = partial(llama, n_layers=2, vocab_size=128, hidden=40, intermediate=100)
    tokens = TOKENS[:6, :8] % 128
    results = default_pool().run(measured_memory, 3, model_fn, {"dp": 3}, fxpar.Plan(zero=zero), tokens,
                                 next_token_loss, timeout=300)
    full = 4 * sum(p.numel() for p in model_fn().parameters())
    assert sum(r["params"] for r in results) == full  # the pieces add up to the model, no padding held
    for r in results:
        mem, copy = r["predicted"], full if zero == 1 else 0
        assert r["working_copy"] == copy
        assert (mem.params - copy, mem.grads - copy, mem.optimizer) == (r["params"], r["grads"], r["optimizer"])
    assert len({r["params"] for r in results}) == 2  # the last rank's pieces are smaller


def test_pipeline_activations_are_the_sets_the_schedule_keeps_in_flight() -> None:
    # 1f1b on pp=2 with 4 microbatches: stage 0 holds 2 activation sets at once (gpipe would hold 4)
    plan = fxpar.Plan(stages=["layers.1"], schedule="1f1b", microbatches=4)
    results = default_pool().run(measured_memory, 2, partial(llama, n_layers=2), {"pp": 2}, plan, TOKENS,
                                 next_token_loss, timeout=300)
    first = results[0]
    assert first["in_flight"] == 2
    # a microbatch's hidden state: held by its send until the gradient (of the same size) comes back; at that
    # receive, two saved sets, two sent states and the gradient are alive
    hidden = TOKENS.shape[0] // 4 * TOKENS.shape[1] * 64 * 4
    assert first["predicted"].activations == 2 * (first["saved_per_microbatch"] + hidden) + hidden
    for r in results:
        mem = r["predicted"]
        assert (mem.params, mem.grads, mem.optimizer) == (r["params"], r["grads"], r["optimizer"])


@pytest.mark.parametrize("axes,plan", [
    ({"pp": 2}, fxpar.Plan(stages=2, schedule="gpipe", microbatches=2)),
    ({"pp": 2}, fxpar.Plan(stages=2, schedule="1f1b", microbatches=4, recompute="full")),
    ({"pp": 2}, fxpar.Plan(stages=2, schedule="zb-h1", microbatches=4)),
    ({"pp": 2}, fxpar.Plan(stages=4, schedule="interleaved-1f1b", microbatches=4)),
    ({"pp": 2, "dp": 2}, fxpar.Plan(stages=2, microbatches=2, zero=1, recompute="selective")),
], ids=["gpipe", "1f1b-full", "zb-h1", "interleaved", "dp2-zero1-selective"])
def test_pipeline_activations_equal_what_every_stage_holds(axes: dict[str, int], plan: fxpar.Plan) -> None:
    """Stages after the first were under-counted (the last by its logits' gradient per microbatch in flight): a
    received activation the forward saves was taken as freed at its forward, the last stage's output gradients
    (made with the loss at F, read by the backward) were not counted, nor a backward's input gradients beside its
    saved set when it returns. Every rank's prediction now equals the peak of what its executor holds between
    graphs (``held_between_events``), byte for byte."""
    world = 4 if "dp" in axes else 2
    results = default_pool().run(held_between_events, world, partial(llama, n_layers=4), axes, plan, TOKENS,
                                 next_token_loss, timeout=300)
    for rank, (predicted, held) in enumerate(results):
        assert predicted == held, (rank, predicted, held)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_sent_gradient_the_weight_half_reads_is_counted_once(schedule: str) -> None:
    """A long skip's gradient passes the head's adds unchanged: the tensor a stage's B half sends is also in the
    stash its W half reads. It was counted in both (one to two activations too many under halves)."""
    from fxpar.testing.user_models import LongSkip

    plan = fxpar.Plan(stages=2, schedule=schedule, microbatches=4)
    for rank, (predicted, held) in enumerate(default_pool().run(held_between_events, 2, LongSkip, {"pp": 2}, plan,
                                                                TOKENS, next_token_loss, timeout=300)):
        assert predicted == held, (rank, predicted, held)


def test_a_backward_output_cut_from_a_larger_buffer_keeps_the_rest_alive() -> None:
    """A gradient shard sliced from a gradient computed whole is an output of the backward, counted in ``grads`` at
    its own size; the rest of the whole buffer stays alive until the graph returns and counts as transient. Slices
    that together fill their buffer (a reduced bucket) add nothing."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def shard_of_whole(x: torch.Tensor) -> tuple[torch.Tensor]:
        return ((x * 2)[:1],)  # 4 x 16 floats computed, 1 x 16 kept (a rank graph returns a tuple)

    def bucket_slices(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * 2
        return y[:1], y[1:]

    x = torch.randn(4, 16)
    cut, filled = make_fx(shard_of_whole)(x), make_fx(bucket_slices)(x)
    assert largest_live_set(cut) == 0 and largest_live_set(filled) == 0  # outputs are counted elsewhere
    assert largest_live_set(cut, output_excess=True) == 3 * 16 * 4
    assert largest_live_set(filled, output_excess=True) == 0


def test_transient_counts_the_outputs_of_an_op_that_nobody_takes() -> None:
    """``native_dropout`` allocates its whole float output beside the mask even where a rank program keeps only the
    mask (``fxpar.random_draws``): the largest live set counts it while the op's tuple lives, and an op whose
    outputs nobody reads at all counts them at its own position (allocated, then freed at once)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def mask_only(x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.ops.aten.native_dropout(x, 0.5, True)[1],)

    def nothing_read(x: torch.Tensor) -> tuple[torch.Tensor]:
        torch.ops.aten.native_dropout(x, 0.5, True)
        return (x * 2,)

    x = torch.randn(8, 64)
    assert largest_live_set(make_fx(mask_only)(x)) == 8 * 64 * 4  # the float output; the mask is the graph's output
    gm = make_fx(nothing_read)(x)
    assert any(n.target is torch.ops.aten.native_dropout.default for n in gm.graph.nodes)
    assert largest_live_set(gm) == 8 * 64 * 4 + 8 * 64  # both outputs, for an instant


@pytest.mark.parametrize(("axes", "plan"), [
    ({"dp": 2}, fxpar.Plan(microbatches=2)),
    ({"pp": 2}, fxpar.Plan(microbatches=4, schedule="1f1b")),
], ids=["dp2-m2", "pp2-1f1b-m4"])
def test_the_peak_bounds_what_a_step_with_microbatches_has_alive(axes: dict[str, int], plan: fxpar.Plan) -> None:
    """With several microbatches each backward after the first returns its gradients beside the running sums,
    and the dp reduction runs once after them on its own bucket: ``pm.memory`` counted neither, and a real step
    held 1.2x its ``peak`` (``fxpar.testing.live_bytes`` watches every storage the step makes). The loss runs
    eagerly beside the rank program and is not counted (README: about two copies of its microbatch's logits)."""
    from fxpar.testing.live_bytes import step_peak

    model_fn = partial(llama, n_layers=2, vocab_size=256)
    logits = TOKENS.numel() // plan.microbatches * 256 * 4
    for rank, (measured, predicted) in enumerate(default_pool().run(step_peak, 2, model_fn, axes, plan, TOKENS,
                                                                    next_token_loss, timeout=300)):
        loss_room = 2 * logits + 1024 if rank == 1 or "dp" in axes else 0
        assert measured <= predicted + loss_room, (rank, measured, predicted)
