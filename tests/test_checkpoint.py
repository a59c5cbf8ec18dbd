"""Resharding checkpoints: ``torch.distributed.checkpoint`` of ``pm``'s DTensor state, saved on one mesh and plan,
loaded on another (and into the plain model in one process)."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fxpar
from fxpar import checkpoint
from fxpar.models.llama import llama, llama_plan
from fxpar.testing import default_pool
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.probes import checkpoint_round

TOKENS = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))
MODEL = partial(llama, n_layers=2, vocab_size=128)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """2 AdamW steps on dp=2 x tp=2 with ZeRO-3, then a DCP save of model and optimizer; then 2 more steps."""
    folder = str(tmp_path_factory.mktemp("ckpt"))
    results = default_pool().run(checkpoint_round, 4, folder, True, MODEL, {"dp": 2, "tp": 2},
                                 fxpar.Plan(tp=llama_plan(), zero=3), TOKENS, next_token_loss, 2, 2, timeout=300)
    return folder, results[0]


@pytest.mark.parametrize(("axes", "plan"), [
    ({"tp": 4}, fxpar.Plan(tp=llama_plan())),
    ({"pp": 2, "dp": 2}, fxpar.Plan(zero=2, microbatches=2)),
    ({"dp": 3}, fxpar.Plan(zero=3)),  # DTensor's uneven shards of the 128-row weights (43, 43, 42)
], ids=["tp4", "pp2xdp2-zero2", "dp3-zero3-uneven"])
def test_load_on_another_mesh_is_bit_identical_and_trains_on(saved: tuple[str, dict], axes: dict[str, int],
                                                             plan: fxpar.Plan) -> None:
    folder, before = saved
    results = default_pool().run(checkpoint_round, math.prod(axes.values()), folder, False, MODEL, axes, plan,
                                 TOKENS, next_token_loss, 0, 2, timeout=300)
    after = {"params": {k: v for r in results for k, v in r["params"].items()}, "losses": results[0]["losses"]}
    assert before["params"].keys() == after["params"].keys()  # with pp, each rank holds its stages' parameters
    for name, t in before["params"].items():
        assert torch.equal(t, after["params"][name]), name
    # the optimizer state came along: the next steps match training without the reload (another mesh sums in
    # another order, hence rtol 1e-5 rather than equality)
    assert after["losses"] == pytest.approx(before["losses"], rel=1e-5)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP's notice that it loads in one process
def test_load_into_the_plain_model_in_one_process(saved: tuple[str, dict]) -> None:
    folder, before = saved
    model = MODEL()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=folder)
    model.load_state_dict(state["model"])
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before["params"][name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_whose_names_do_not_match_is_a_clear_error(saved: tuple[str, dict]) -> None:
    folder, _ = saved

    class Wrapped(torch.nn.Module):  # the same model one level deeper: every name gains a "net." prefix
        def __init__(self) -> None:
            super().__init__()
            self.net = MODEL()

    with pytest.raises(fxpar.CheckpointError, match=r"has no parameter 'net\.\S+' \(and \d+ more\).*closest saved"):
        checkpoint.load(Wrapped(), None, folder)
    checkpoint.load(MODEL(), None, folder)  # the right names load


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_no_optimizer_state_and_no_checkpoint_are_clear_errors(tmp_path) -> None:  # noqa: ANN001
    """An optimizer asked of a checkpoint saved without one failed in DCP ("Missing key in checkpoint state_dict:
    optim.state..."), and a folder that is no checkpoint with a FileNotFoundError of its ``.metadata``."""
    model = MODEL()
    checkpoint.save(model, None, f"{tmp_path}/weights")
    with pytest.raises(fxpar.CheckpointError, match=r"was saved without optimizer state .* load\(module, None, path\)"):
        checkpoint.load(model, torch.optim.AdamW(model.parameters()), f"{tmp_path}/weights")
    (tmp_path / "empty").mkdir()
    with pytest.raises(fxpar.CheckpointError, match=r"is a folder but no checkpoint \(it has no .metadata"):
        checkpoint.load(model, None, f"{tmp_path}/empty")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_optimizer_keeping_state_the_checkpoint_lacks_is_a_clear_error(tmp_path) -> None:  # noqa: ANN001
    """AdamW's state loaded into SGD with momentum: DCP raised its CheckpointException ("Missing key ...
    momentum"), which ``except Exception`` does not catch."""
    model = MODEL()
    adam = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 128, (2, 8))).sum().backward()
    adam.step()
    checkpoint.save(model, adam, f"{tmp_path}/adam")
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(fxpar.CheckpointError, match=r"SGD keeps dampening, momentum, nesterov, which .* does not "
                                                    r"hold \(its optimizer state holds exp_avg, exp_avg_sq, step\)"):
        checkpoint.load(model, sgd, f"{tmp_path}/adam")
    checkpoint.load(model, torch.optim.AdamW(model.parameters()), f"{tmp_path}/adam")  # the same kind loads


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_tied_weight_saved_under_one_name_loads_into_the_plain_model(tmp_path) -> None:  # noqa: ANN001
    """A ``ParallelModule`` holds a tied weight once (``embed.weight``; the head's ``lm_head.weight`` is the same
    tensor), so its checkpoint has one name for it, and ``checkpoint.load`` into the plain model (whose state dict
    lists both) failed: "no parameter 'lm_head.weight'". Whisper, XLM-R and GPT-2 tie their heads. The tied tensor
    loads from whichever of its names the checkpoint holds, bit-identical to the trained one."""
    tied = partial(llama, n_layers=2, vocab_size=128, tie_embeddings=True)
    folder = str(tmp_path / "ckpt")
    before = default_pool().run(checkpoint_round, 2, folder, True, tied, {"dp": 2}, fxpar.Plan(zero=3), TOKENS,
                                next_token_loss, 2, 0, timeout=300)[0]
    model = tied()
    assert len(model.state_dict()) > len(before["params"])  # the plain model names the tied weight twice
    checkpoint.load(model, None, folder)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before["params"][name]), name


def test_a_checkpoint_of_a_larger_model_is_refused(tmp_path) -> None:  # noqa: ANN001
    """A 4-layer checkpoint loaded into a 2-layer model: every name the model has is there, so it loaded, and layers
    2 and 3 were dropped without a word."""
    checkpoint.save(llama(n_layers=4), None, str(tmp_path))
    with pytest.raises(fxpar.CheckpointError, match=r"holds \d+ name\(s\) the model does not have, e.g. \['layers\.2"):
        checkpoint.load(llama(n_layers=2), None, str(tmp_path))
