"""``pm.save`` writes per-rank training executables; ``torchrun -m fxpar.run`` trains with them, without the model.

The launched run must equal the in-process one bitwise: the same initial weights (a checkpoint), the same token
batches, the same rank programs (printed code instead of GraphModules), the same step events and AdamW. Every
launched process runs with ``transformers``, ``fxpar.models`` and the tests' modules made unimportable.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import shutil
import subprocess
import sys
from functools import partial

import numpy as np
import pytest
import torch

import fxpar
from fxpar import checkpoint
from fxpar import run as fxpar_run
from fxpar.models import hf_families
from fxpar.models.hf import hf_llama
from fxpar.models.hf_families import TP_PLANS
from fxpar.models.llama import hf_llama_plan, llama, llama_plan
from fxpar.testing import default_pool, error_models, state_models
from fxpar.testing.launcher import (
    launch,
    logged_losses,
    next_token_loss,
    read_checkpoint,
    resume_both,
    train_both,
    train_in_process,
    write_tokens,
)

ROWS, SEQ, STEPS = 4, 16, 3
LLAMA = partial(hf_llama, layers=2, vocab=128)
GPT2 = partial(error_models.gpt2, layers=2, vocab=128)
# each launch starts 4 fresh processes: two cases cover both families, dp x tp with ZeRO-3 and SP, and pp x tp;
# every other plan kind is replayed from its saved folder on pool ranks (SWEEP below)
CASES = {
    "llama dp2 x tp2 zero3 sp": (LLAMA, {"dp": 2, "tp": 2},
                                 fxpar.Plan(tp=hf_llama_plan(), zero=3, sequence_parallel=True)),
    "gpt2 pp2 x tp2 1f1b": (GPT2, {"pp": 2, "tp": 2}, fxpar.Plan(tp=TP_PLANS["gpt2"], microbatches=2, schedule="1f1b")),
}
BLOCKER = '''
import importlib.abc
import sys

BLOCKED = ("transformers", "fxpar.models", "tests")


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} may not be imported by fxpar.run (blocked by the test)")
        return None


sys.meta_path.insert(0, _Block())
'''


@pytest.fixture(scope="module")
def no_model_code(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment under which importing ``transformers``, ``fxpar.models`` or ``tests`` raises ImportError."""
    folder = tmp_path_factory.mktemp("blocker")
    (folder / "sitecustomize.py").write_text(BLOCKER)
    env = {"PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    for module in ("transformers", "fxpar.models.hf"):  # the blocker works: these imports fail under env
        probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                               env={**os.environ, **env}, timeout=120)
        assert probe.returncode != 0 and "blocked by the test" in probe.stderr, probe.stderr[-2000:]
    return env


@pytest.mark.parametrize("case", list(CASES))
def test_launched_training_equals_in_process_training_bitwise(case: str, tmp_path: os.PathLike,
                                                              no_model_code: dict[str, str]) -> None:
    build, axes, plan = CASES[case]
    d = str(tmp_path)
    data = os.path.join(d, "tokens.bin")
    write_tokens(data, ROWS * (SEQ + 1) * STEPS + 5, vocab=128)
    world = 4
    losses = default_pool().run(train_in_process, world, build, axes, plan, f"{d}/prog", f"{d}/init", f"{d}/trained",
                                data, ROWS, SEQ, STEPS, timeout=300)[0]
    run = launch(f"{d}/prog", world, "--checkpoint", f"{d}/init", "--steps", str(STEPS), "--data", data,
                 "--save", f"{d}/launched", env=no_model_code)
    assert run.returncode == 0, run.stderr[-4000:]
    assert logged_losses(run.stdout) == losses  # every digit: the printed float is the step's loss exactly
    want, got = read_checkpoint(f"{d}/trained"), read_checkpoint(f"{d}/launched")
    assert sorted(got) == sorted(want)
    different = [k for k in want if not torch.equal(want[k], got[k])]
    assert not different, f"weights differ after {STEPS} steps: {different[:5]}"


SWEEP = {  # every other plan kind, replayed from the saved folder by fxpar.run's training loop on pool ranks
    "pp2 x tp2 zb-h1": (partial(llama, n_layers=2, vocab_size=128), {"pp": 2, "tp": 2},
                        fxpar.Plan(tp=llama_plan(), microbatches=2, schedule="zb-h1")),
    "pp2 x dp2 interleaved, 4 stages": (partial(llama, n_layers=4, vocab_size=128), {"pp": 2, "dp": 2},
                                        fxpar.Plan(stages=4, microbatches=2, schedule="interleaved-1f1b")),
    "pp4 gpipe": (partial(llama, n_layers=4, vocab_size=128), {"pp": 4}, fxpar.Plan(microbatches=2, schedule="gpipe")),
    "dp2 x tp2 zero1 fp8": (partial(llama, n_layers=1, vocab_size=128), {"dp": 2, "tp": 2},
                            fxpar.Plan(tp=llama_plan(), zero=1, fp8="tensorwise")),
    "dp4 zero2": (partial(llama, n_layers=1, vocab_size=128), {"dp": 4}, fxpar.Plan(zero=2)),
    "dp2 x cp2": (partial(llama, n_layers=1, vocab_size=128), {"dp": 2, "cp": 2}, fxpar.Plan()),
    "mixtral dp2 x ep2": (hf_families.mixtral, {"dp": 2, "ep": 2}, fxpar.Plan()),
}


@pytest.mark.parametrize("case", list(SWEEP))
def test_every_plan_kind_trains_from_its_saved_folder_bitwise(case: str, tmp_path: os.PathLike) -> None:
    build, axes, plan = SWEEP[case]
    data = os.path.join(str(tmp_path), "tokens.bin")
    write_tokens(data, ROWS * (SEQ + 1) * STEPS, vocab=128)
    results = default_pool().run(train_both, 4, build, axes, plan, f"{tmp_path}/prog", data, ROWS, SEQ, STEPS,
                                 timeout=300)
    in_process, replayed, different = results[0]
    assert replayed == in_process
    assert not different, f"weights differ after {STEPS} steps: {different[:5]}"


def test_a_resumed_run_continues_the_data_and_the_pipeline_optimizer_exactly(tmp_path: os.PathLike) -> None:
    """Saved after 2 steps and resumed for 2 more, a run trains as 4 uninterrupted steps do. It used to start the
    data again at batch 0; and a pipeline rank's optimizer settings were lost in the checkpoint (DCP keeps one rank's
    names per parameter group), so ``opt.step()`` after loading raised ``KeyError: 'betas'``."""
    data = os.path.join(str(tmp_path), "tokens.bin")
    write_tokens(data, ROWS * (SEQ + 1) * 4, vocab=128)
    build = partial(llama, n_layers=2, vocab_size=128)
    results = default_pool().run(resume_both, 4, build, {"pp": 2, "dp": 2}, fxpar.Plan(zero=1, microbatches=2),
                                 f"{tmp_path}/prog", data, ROWS, SEQ, 2, 2, timeout=300)
    straight, interrupted, different = results[0]
    assert interrupted == straight
    assert not different, f"weights differ after a resume: {different[:5]}"


def test_a_replay_reads_the_checkpoints_buffers_and_saves_them(tmp_path: os.PathLike) -> None:
    """A buffer the program only reads (a frozen BatchNorm's statistics, here a scale) comes from the checkpoint,
    as the weights do: the replay used the value baked into ``rank<r>.pt`` at ``pm.save`` and left the buffer out
    of ``--save`` (a checkpoint the plain model could not load)."""
    data = os.path.join(str(tmp_path), "tokens.bin")
    write_tokens(data, ROWS * (SEQ + 1) * STEPS, vocab=128)
    results = default_pool().run(train_both, 2, state_models.ScaledStreamLM, {"dp": 2}, fxpar.Plan(),
                                 f"{tmp_path}/prog", data, ROWS, SEQ, STEPS, 1e-3, None, {"scale": 0.5}, timeout=300)
    in_process, replayed, different = results[0]
    assert replayed == in_process
    assert not different, f"weights or buffers differ after {STEPS} steps: {different[:5]}"
    assert read_checkpoint(f"{tmp_path}/prog.replayed")["scale"].eq(0.5).all()


def test_clipped_training_replays_bitwise_with_a_weight_tied_across_stages(tmp_path: os.PathLike) -> None:
    """``fxpar.run --clip-grad-norm`` clips as ``pm.clip_grad_norm_`` does: GPT-2 (embedding and head tied, on the
    two pipeline stages) on pp2 x dp2, clipped hard (to 1e-3) every step, trains bitwise alike from its saved folder
    (an unclipped replay would not)."""
    args = fxpar_run.parse_args(["prog", "--checkpoint", "c", "--steps", "1", "--synthetic", "--clip-grad-norm", "1"])
    assert args.clip_grad_norm == 1.0
    data = os.path.join(str(tmp_path), "tokens.bin")
    write_tokens(data, ROWS * (SEQ + 1) * STEPS, vocab=128)
    plan = fxpar.Plan(microbatches=2, schedule="1f1b")
    results = default_pool().run(partial(train_both, clip=1e-3), 4, GPT2, {"pp": 2, "dp": 2}, plan,
                                 f"{tmp_path}/prog", data, ROWS, SEQ, STEPS, timeout=300)
    in_process, replayed, different = results[0]
    assert replayed == in_process
    assert not different, f"weights differ after {STEPS} steps: {different[:5]}"


def _fake_save(folder: str, axes: dict[str, int], plan: fxpar.Plan, build: object = LLAMA) -> fxpar.ParallelModule:
    torch.manual_seed(0)
    model = build()
    pm = fxpar.parallelize(model, fxpar.Mesh(axes, fake=True), (torch.zeros(ROWS, SEQ, dtype=torch.int64),), plan,
                           loss_fn=next_token_loss)
    pm.save(folder)
    return pm


def _names_used_but_undefined(source: str) -> set[str]:
    """Names a module's functions read that neither the module nor builtins define."""
    tree = ast.parse(source)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
            defined.update(a.arg for a in node.args.args) if isinstance(node, ast.FunctionDef) else None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update((a.asname or a.name).split(".")[0] for a in node.names)
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return used - defined


@pytest.mark.parametrize("axes,plan", [
    ({"pp": 2, "tp": 2}, fxpar.Plan(tp=hf_llama_plan(), microbatches=2, schedule="zb-h1")),
    ({"dp": 2, "tp": 2}, fxpar.Plan(tp=hf_llama_plan(), zero=2)),
], ids=["pp2 x tp2 zb-h1", "dp2 x tp2 zero2"])
def test_saved_rank_files_define_every_name_and_save_the_same_bytes_twice(tmp_path: os.PathLike, axes: dict,
                                                                          plan: fxpar.Plan) -> None:
    pm = _fake_save(f"{tmp_path}/a", axes, plan)
    pm.save(f"{tmp_path}/b")
    names = sorted(os.listdir(f"{tmp_path}/a"))
    assert names == sorted(os.listdir(f"{tmp_path}/b"))
    for name in names:
        with open(f"{tmp_path}/a/{name}", "rb") as a, open(f"{tmp_path}/b/{name}", "rb") as b:
            assert a.read() == b.read(), f"{name} differs between two saves"
    manifest = json.load(open(f"{tmp_path}/a/manifest.json"))
    assert manifest["world"] == 4 and manifest["mesh"] == [[a, n] for a, n in axes.items()]
    assert manifest["inputs"] == [{"shape": [ROWS // manifest["microbatches"], SEQ], "dtype": "int64"}]
    for r in range(4):
        source = open(f"{tmp_path}/a/rank{r}.py").read()
        assert not _names_used_but_undefined(source), r
        namespace: dict = {}
        exec(compile(source, f"rank{r}.py", "exec"), namespace)  # imports only torch and fxpar
        events = [e["kind"] for e in namespace["EVENTS"]]
        assert events[-1] == "loss" and "F" in events
        if plan.schedule == "zb-h1":
            assert any(k.startswith("backward_w") for k in namespace), "zero-bubble halves are saved"
    last = [r for r in range(4) if 1 in manifest["ranks"][str(r)]["stages"]] if "pp" in axes else range(4)
    assert all("def loss(" in open(f"{tmp_path}/a/rank{r}.py").read() for r in last)


def _bad_input_folder(tmp: str) -> tuple[str, str, str]:
    """A dp=2 folder saved from a fake mesh, the single-device model's weights as its checkpoint, a token file."""
    _fake_save(f"{tmp}/prog", {"dp": 2}, fxpar.Plan())
    torch.manual_seed(0)
    checkpoint.save(LLAMA(), None, f"{tmp}/init")  # one process, no process group: the plain model's weights
    write_tokens(f"{tmp}/tokens.bin", 1000, vocab=128)
    return f"{tmp}/prog", f"{tmp}/init", f"{tmp}/tokens.bin"


def _assert_fails_on_every_rank(run: object, world: int, message: str) -> None:
    """Every rank checks the input itself and exits non-zero with the message; torchrun stops the job at the
    first such exit (SIGTERM to the others), so the message is asserted once, and each rank either said it or
    was stopped, none hung."""
    assert run.returncode != 0
    assert "error on rank " in run.stderr and message in run.stderr, run.stderr[-3000:]
    for r in range(world):
        said = f"fxpar.run: error on rank {r}:" in run.stderr
        stopped = f"rank      : {r} (local_rank: {r})" in run.stderr
        assert said or stopped, f"rank {r} neither failed nor was stopped:\n{run.stderr[-3000:]}"


def test_bad_input_is_a_clear_error_on_every_rank(tmp_path: os.PathLike, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prog, init, data = _bad_input_folder(str(tmp_path))
    _assert_fails_on_every_rank(launch(prog, 1, "--checkpoint", init, "--steps", "1", "--data", data), 1,
                                "saved for 2 ranks (mesh dp=2) but 1 were launched")
    short = f"{tmp_path}/short.bin"
    write_tokens(short, ROWS * (SEQ + 1) - 1, vocab=128)
    old = f"{tmp_path}/old"
    shutil.copytree(prog, old)
    manifest = json.load(open(f"{old}/manifest.json"))
    json.dump({**manifest, "fxpar": "0.0.1"}, open(f"{old}/manifest.json", "w"))
    empty, wide = f"{tmp_path}/empty.bin", f"{tmp_path}/wide.bin"
    open(empty, "wb").close()
    write_tokens(wide, 1000, vocab=1000)  # another tokenizer's ids: the model has 128 (an IndexError in its embedding)
    odd, negative = f"{tmp_path}/odd.bin", f"{tmp_path}/negative.bin"
    with open(odd, "wb") as f:  # a file cut mid-id (numpy's memmap raised)
        f.write(open(data, "rb").read()[:-1])
    np.full(ROWS * (SEQ + 1), -3, dtype=np.int16).tofile(negative)  # ids under 0 (read as uint16: wrap; as int16: -3)
    cut, broken = f"{tmp_path}/cut", f"{tmp_path}/broken"  # a rank file cut short; a manifest cut short
    shutil.copytree(prog, cut)
    shutil.copytree(prog, broken)
    for path in (f"{cut}/rank1.py", f"{cut}/rank0.py", f"{broken}/manifest.json"):
        text = open(path).read()
        open(path, "w").write(text[: len(text) // 2])
    cases = ((prog, short, "fewer than one batch", []), (old, data, "saved by fxpar 0.0.1", []),
             (prog, empty, "is empty", []), (prog, wide, "but the model's vocabulary has 128 ids", []),
             (prog, data, "token ids are integers", ["--dtype", "float32"]),
             (prog, data, "--lr must be a finite number >= 0", ["--lr", "-1"]),
             (prog, data, "--clip-grad-norm must be a finite number > 0", ["--clip-grad-norm", "0"]),
             (prog, data, "is an existing file; a checkpoint is a folder", ["--save", data]),
             (prog, data, "is a folder but no checkpoint", ["--checkpoint", prog]),
             (prog, odd, "not a whole number of uint16 ids", []),
             (prog, negative, "token ids are non-negative", ["--dtype", "int16"]),
             (prog, data, "cannot be created", ["--save", f"{data}/sub"]),
             (cut, data, "are missing, incomplete or corrupt", []), (broken, data, "is incomplete or corrupt", []))
    for folder, tokens, message, extra in cases:
        for rank in range(2):  # each rank refuses by itself, before any process group exists
            monkeypatch.setenv("RANK", str(rank))
            monkeypatch.setenv("WORLD_SIZE", "2")
            assert fxpar_run.main([folder, "--checkpoint", init, "--steps", "1", "--data", tokens, *extra]) == 2
            err = capsys.readouterr().err
            assert f"fxpar.run: error on rank {rank}:" in err and message in err, err


def test_a_checkpoint_of_another_model_is_refused_on_every_rank(tmp_path: os.PathLike) -> None:
    prog, _, data = _bad_input_folder(str(tmp_path))
    torch.manual_seed(0)
    checkpoint.save(hf_llama(layers=2, vocab=128, hidden=32, intermediate=64), None, f"{tmp_path}/narrow")
    _assert_fails_on_every_rank(launch(prog, 2, "--checkpoint", f"{tmp_path}/narrow", "--steps", "1", "--data", data),
                                2, "saved from another model")
