"""``pm.eval()`` runs the model as ``model.eval()`` does, ``pm.train()`` as compiled (``fxpar.modes``).

Before, a ``ParallelModule`` ran its training program whatever its mode: after ``pm.eval()`` a validation forward
still drew dropout masks and normalized by the batch's statistics while overwriting BatchNorm's running ones.
Checked on gloo ranks against the single device: two training steps, eval forwards, then a training step again
(fp32: relative gaps at most 1e-5, the equivalence harness's tolerance; BatchNorm's all-reduced statistics sum in
another order than the single device's, so bitwise equality is not expected).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

import fxpar
from fxpar.api import compile_program
from fxpar.models.hf_families import TP_PLANS
from fxpar.models.llama import llama
from fxpar.testing.batches import IMAGES, LABELS, RTOL, TOKENS
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.mode_probes import token_loss, train_evaluate_train, validate_between_steps
from fxpar.testing.pool import default_pool
from fxpar.testing.user_models import gpt2_with_dropout, tiny_resnet


def _check(ranks: list[dict]) -> None:
    for r in ranks:
        assert r["eval"] <= RTOL and r["eval_again"] == 0.0 and r["buffers_untouched"], r
        assert r["params"] <= RTOL and r["buffers"] <= RTOL and r["training"], r
        assert not r["eval_program_draws"] and not r["eval_program_writes"], r


def test_batch_norm_evaluates_with_the_running_statistics_training_left() -> None:
    """TinyResNet on dp=2 ZeRO-3: eval outputs are the single device's eval outputs (running statistics, no
    writes), and training resumes where it stopped (parameters and running statistics)."""
    ranks = default_pool().run(train_evaluate_train, 2, tiny_resnet, {"dp": 2}, fxpar.Plan(zero=3), IMAGES, LABELS,
                               torch.nn.functional.cross_entropy, timeout=240)
    _check(ranks)


@pytest.mark.filterwarnings("ignore::fxpar.FxparWarning")
def test_dropout_is_off_in_eval_and_on_again_in_training() -> None:
    """HF GPT-2 with its default dropouts on dp=2 x tp=2 (Megatron's plan, sequence parallel, ZeRO-3):
    the eval program draws nothing (two eval forwards agree exactly), stores every parameter as the training
    program does and equals the single device in eval mode; the training step after it draws the single device's
    masks again."""
    ranks = default_pool().run(train_evaluate_train, 4, gpt2_with_dropout, {"dp": 2, "tp": 2},
                               fxpar.Plan(tp=TP_PLANS["gpt2"], sequence_parallel=True, zero=3), TOKENS, TOKENS,
                               token_loss, timeout=240)
    _check(ranks)


def test_the_eval_program_is_what_the_module_reports_and_keeps_the_pipeline_split() -> None:
    """On a fake mesh: after ``pm.eval()`` the printed program, ledger and proof are the eval program's (no dropout,
    no running-statistics writes), the pipeline stages hold the same layers, the user's model keeps its modes
    (a frozen BatchNorm included), and ``pm.train()`` brings back the first program exactly."""
    model = tiny_resnet()
    model.stem[1].eval()  # a frozen BatchNorm inside a model in training mode: the compiled mode keeps it
    mesh = fxpar.Mesh({"pp": 2, "dp": 2}, fake=True)
    pm = fxpar.parallelize(model, mesh, (IMAGES,), plan=fxpar.Plan(stages=2, microbatches=2),
                           loss_fn=torch.nn.functional.cross_entropy, example_targets=LABELS)
    trained = pm.program(0), pm.program(2)
    holds = [line for p in trained for line in p.splitlines() if line.startswith("# holds")]
    assert "aten.copy_(layer1_0_bn1_running_mean" in trained[0]
    assert "aten.copy_(stem_1_running_mean" not in trained[0]  # frozen: reads its running statistics
    pm.eval()
    assert not pm.training and "aten.copy_(" not in pm.program(0) + pm.program(2)
    assert holds == [line for r in (0, 2) for line in pm.program(r).splitlines() if line.startswith("# holds")]
    assert {r.op for r in pm.ledger(0) if r.axis == "dp"} <= {"all_reduce"}
    assert pm.proof is not None and "no deadlock" in str(pm.proof)
    assert model.training and not model.stem[1].training and model.layer1[0].bn1.training
    pm.train()
    assert pm.training and (pm.program(0), pm.program(2)) == trained


def test_a_module_without_its_example_inputs_says_it_cannot_switch() -> None:
    """A ``ParallelModule`` built from a compiled program alone cannot compile the other mode: a clear error."""
    model = tiny_resnet()
    compiled = compile_program(model, fxpar.Mesh({"dp": 2}, fake=True), (IMAGES,))
    pm = fxpar.ParallelModule(compiled, model, None)
    with pytest.raises(RuntimeError, match="only the program compiled in training mode"):
        pm.eval()


def test_a_validation_step_under_no_grad_runs_forwards_only_in_a_pipeline() -> None:
    """``pm.step`` under ``torch.no_grad()`` evaluates: the bundled Llama with dropout on pp=2 x dp=2 (1F1B, 2
    microbatches) gives the single device's eval-mode loss and leaves no gradient behind (before, it ran the
    backward too and its gradients joined the next training step's). The training steps around it are not compared
    with the single device: under pipeline stages dropout draws other numbers (``fxpar.random_draws``)."""
    plan = fxpar.Plan(stages=2, microbatches=2)
    ranks = default_pool().run(validate_between_steps, 4, partial(llama, dropout=0.1), {"pp": 2, "dp": 2}, plan, TOKENS,
                               TOKENS, next_token_loss, timeout=240)
    for r in ranks:
        assert r["validation"] <= RTOL and r["grads_untouched"], r


def test_the_module_does_not_keep_the_users_model_alive() -> None:
    """``pm`` holds the model weakly (a whole unsharded copy of the weights must be freeable after
    ``fxpar.parallelize``): once the user drops it, it is freed, and ``pm.eval()`` says why it cannot compile."""
    import gc
    import weakref

    model = tiny_resnet()
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (IMAGES,))
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None
    with pytest.raises(RuntimeError, match="has been freed"):
        pm.eval()
    assert pm.training
