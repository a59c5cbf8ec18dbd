"""Train with a saved program folder: ``torchrun --nproc_per_node N -m fxpar.run FOLDER --checkpoint CKPT --steps K``.

Each process runs its rank's file of ``FOLDER`` (``pm.save``): it builds the process groups from the manifest,
loads its parameter shards (and the optimizer state, when the checkpoint has it) from a checkpoint written
by ``fxpar.checkpoint.save``, and runs ``K`` training steps: the saved step events (forward, backward,
pipeline transfers, gradient reductions), then ``torch.optim.AdamW(lr=--lr)`` with torch's other defaults.

Data: ``--data PATH`` is a flat file of token ids (nanoGPT's ``train.bin``), read as ``numpy.memmap`` of
``--dtype``; step ``i`` takes the ``i``-th consecutive run of ``B x (S + 1)`` tokens (wrapping around at the
end of the file) as ``B`` rows, inputs the first ``S`` of each row and targets the next ``S``; each rank
takes its dp (and ep) piece of the rows. ``--synthetic`` draws random ids instead (step ``i`` from seed
``--seed + i``). A checkpoint whose optimizer state took ``k`` steps resumes at step ``k``. Rank 0 prints
``step <i> loss <value>`` per step (the value as Python prints the float, every digit). ``--clip-grad-norm MAX``
clips the model's gradient norm before each optimizer step, as ``pm.clip_grad_norm_``. ``--save CKPT2``
writes the trained weights and optimizer state back. It imports neither the model's code nor ``transformers``.

Bad input (another fxpar version, another world size, a short data file, a checkpoint of another model) is
an error on every rank and a non-zero exit; collectives time out after ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fxpar import checkpoint
from fxpar.clip import clip_grad_norm_
from fxpar.compiled import split_microbatches
from fxpar.errors import CheckpointError, SavedProgramError
from fxpar.saved import SavedRank, load_rank, manifest_mesh, read_manifest
from fxpar.split import rank_batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fxpar.run", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a folder written by pm.save")
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by fxpar.checkpoint.save")
    p.add_argument("--steps", type=int, required=True, help="training steps to run")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="flat binary file of token ids (as nanoGPT's train.bin)")
    source.add_argument("--synthetic", action="store_true", help="seeded random token ids")
    p.add_argument("--dtype", default="uint16", help="numpy dtype of the token file (default uint16)")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic data (default 0)")
    p.add_argument("--clip-grad-norm", type=float, metavar="MAX",
                   help="clip the whole model's gradient norm to MAX before each optimizer step (pm.clip_grad_norm_)")
    p.add_argument("--save", help="write the trained weights and optimizer state here")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: the device the folder was compiled for")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before a collective gives up")
    return p.parse_args(argv)


class Batches:
    """The global token batch of each step: ``B`` rows of ``S + 1`` consecutive ids."""

    def __init__(self, args: argparse.Namespace, batch: int, seq: int, vocab: int | None) -> None:
        self.rows, self.width = batch, seq + 1
        self.tokens: Any = None
        self.seed: int | None = None  # --synthetic: step i draws from a generator seeded seed + i
        self.vocab = vocab
        if args.synthetic:
            if vocab is None:
                raise SavedProgramError("--synthetic needs the vocabulary size, and this program has no embedding of "
                                        "its token ids to read it from: use --data")
            self.seed = args.seed
            return
        if not os.path.isfile(args.data):
            raise SavedProgramError(f"--data {args.data!r}: no such file")
        self.tokens = _token_file(args.data, args.dtype)
        need = self.rows * self.width
        if len(self.tokens) < need:
            raise SavedProgramError(f"--data {args.data!r} holds {len(self.tokens)} tokens of {args.dtype}, fewer than "
                                    f"one batch: {self.rows} rows x {self.width} (sequence + 1) = {need}")
        self(0)  # the first batch's ids, checked against the vocabulary before any process group exists

    def __call__(self, step: int) -> torch.Tensor:
        if self.seed is not None:  # each step's own seed: a resumed run draws what it would have drawn
            generator = torch.Generator().manual_seed(self.seed + step)
            return torch.randint(0, self.vocab, (self.rows, self.width), generator=generator)
        need = self.rows * self.width
        start = (step % (len(self.tokens) // need)) * need
        ids = torch.from_numpy(np.asarray(self.tokens[start:start + need], dtype=np.int64)).view(self.rows, self.width)
        if int(ids.min()) < 0:
            raise SavedProgramError(f"--data: step {step}'s batch holds token id {int(ids.min())}: token ids are "
                                    "non-negative (is --dtype right?)")
        if self.vocab is not None and int(ids.max()) >= self.vocab:
            raise SavedProgramError(f"--data: step {step}'s batch holds token id {int(ids.max())}, but the model's "
                                    f"vocabulary has {self.vocab} ids: is --dtype right, or the file another "
                                    "tokenizer's?")
        return ids


def _token_file(path: str, dtype: str) -> Any:
    """The token ids of ``path`` (a flat array of unsigned or signed integers of ``dtype``), memory-mapped."""
    try:
        kind = np.dtype(dtype)
    except TypeError as e:
        raise SavedProgramError(f"--dtype {dtype!r} is not a numpy dtype (uint16, uint32, int32, int64)") from e
    if kind.kind not in "ui":
        raise SavedProgramError(f"--dtype {dtype!r}: token ids are integers (uint16, uint32, int32, int64)")
    size = os.path.getsize(path)
    if size == 0:
        raise SavedProgramError(f"--data {path!r} is empty")
    if size % kind.itemsize:
        raise SavedProgramError(f"--data {path!r} holds {size} bytes, not a whole number of {dtype} ids "
                                f"({kind.itemsize} bytes each): is --dtype right, or the file cut short?")
    return np.memmap(path, dtype=kind, mode="r")


def check_launch(manifest: dict[str, Any], args: argparse.Namespace) -> tuple[int, int]:
    """This process's rank and the world size, checked against the manifest before any process group exists."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise SavedProgramError("RANK and WORLD_SIZE are not set: launch with torchrun --nproc_per_node N -m fxpar.run")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != manifest["world"]:
        mesh = " x ".join(f"{a}={n}" for a, n in manifest["mesh"])
        raise SavedProgramError(f"the program was saved for {manifest['world']} ranks (mesh {mesh}) but "
                                f"{world} were launched: use torchrun --nproc_per_node {manifest['world']}")
    if not manifest["loss"] or manifest["targets"] is None:
        raise SavedProgramError("this program was saved without a loss over next-token targets (pm.save needs a "
                                "model taking one tensor of token ids and a loss_fn given to fxpar.parallelize)")
    _check_checkpoint_paths(args)
    _check_numbers(args)
    return rank, world


def _check_checkpoint_paths(args: argparse.Namespace) -> None:
    """``--checkpoint`` is a folder ``fxpar.checkpoint.save`` wrote; ``--save`` is no file (found before training,
    not after it)."""
    checkpoint.check_is_checkpoint(args.checkpoint)
    if args.save and os.path.exists(args.save) and not os.path.isdir(args.save):
        raise CheckpointError(f"--save {args.save!r} is an existing file; a checkpoint is a folder")
    if args.save and not os.path.exists(args.save):
        parent = os.path.dirname(os.path.abspath(args.save))
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            raise CheckpointError(f"--save {args.save!r} cannot be created ({parent!r} is not a writable folder): "
                                  "the trained state would be lost after the last step")


def _check_numbers(args: argparse.Namespace) -> None:
    """Step count, learning rate, clipping norm and timeout are in range (each is torch's error, or a hang, late)."""
    if args.steps < 1:
        raise SavedProgramError(f"--steps must be at least 1, got {args.steps}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise SavedProgramError(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.clip_grad_norm is not None and not (math.isfinite(args.clip_grad_norm) and args.clip_grad_norm > 0):
        raise SavedProgramError(f"--clip-grad-norm must be a finite number > 0, got {args.clip_grad_norm}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise SavedProgramError(f"--timeout must be a finite number of seconds > 0, got {args.timeout}")


def train(args: argparse.Namespace) -> None:
    manifest = read_manifest(args.folder)
    rank, world = check_launch(manifest, args)
    device = args.device or manifest["device"]
    if device != manifest["device"]:
        raise SavedProgramError(f"the program was compiled for {manifest['device']}; compile it on a "
                                f"Mesh(..., device={device!r}) to run on {device}")
    batches = Batches(args, manifest["inputs"][0]["shape"][0] * manifest["microbatches"],
                      manifest["inputs"][0]["shape"][1], manifest["vocab"])
    saved = load_rank(args.folder, manifest, rank)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    losses = train_saved(saved, manifest, device, args.checkpoint, args.steps, batches, args.lr, args.save,
                         log=rank == 0, clip=args.clip_grad_norm)
    assert len(losses) == args.steps


def train_saved(saved: SavedRank, manifest: dict[str, Any], device: str, checkpoint_path: str, steps: int,
                batches: Callable[[int], torch.Tensor], lr: float = 1e-3, save: str | None = None,
                log: bool = False, clip: float | None = None) -> list[float]:
    """Train a loaded rank for ``steps`` steps (the process group exists); return the step losses.

    Loads the checkpoint (its optimizer state too, if it has one), runs each step's saved events on this rank's
    piece of ``batches(step)`` (global ``B x (S + 1)`` ids; a checkpoint whose optimizer took ``k`` steps resumes at
    step ``k``, so a run saved and resumed reads the batches uninterrupted training reads), clips the model's
    gradient norm to ``clip`` (as ``pm.clip_grad_norm_``: over the pipeline's stages, a tied weight counted once),
    steps AdamW, and saves to ``save`` at the end.
    """
    mesh = manifest_mesh(manifest, device)
    rank, m = saved.rank, manifest["microbatches"]
    state, executor = saved.build(mesh, manifest)
    optimizer = torch.optim.AdamW(state.parameters(), lr=lr)
    checkpoint.load(state, optimizer if checkpoint.has_optimizer(checkpoint_path) else None, checkpoint_path)
    clip_step = _clipper(state, manifest, mesh, rank, clip) if clip is not None else None
    start = completed_steps(optimizer)  # a resumed run continues the data where the checkpoint's run stopped
    losses = []
    for step in range(start, start + steps):
        tokens = batches(step).to(_device(device))
        inputs, targets = rank_batch(tokens[:, :-1], mesh, rank), rank_batch(tokens[:, 1:], mesh, rank)
        try:
            loss = executor.run(split_microbatches([inputs], m), split_microbatches(targets, m), None)
        finally:
            state.release_params()
        if clip_step is not None:
            clip_step()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if log:
            print(f"step {step} loss {losses[-1]!r}", flush=True)
    if save:
        checkpoint.save(state, optimizer, save)
    return losses


def completed_steps(optimizer: torch.optim.Optimizer) -> int:
    """The optimizer steps taken before (AdamW's per-parameter ``step``, equal on every parameter; 0 for a checkpoint
    without optimizer state)."""
    steps = {int(s["step"]) for s in optimizer.state.values() if "step" in s}
    if len(steps) > 1:
        raise SavedProgramError(f"the checkpoint's optimizer state holds different step counts {sorted(steps)}: it "
                                "was not saved by one training run")
    return steps.pop() if steps else 0


def _clipper(state: Any, manifest: dict[str, Any], mesh: Any, rank: int, max_norm: float) -> Callable[[], Any]:
    """What ``pm.clip_grad_norm_(max_norm)`` does, for a rank loaded from a saved folder: the norm summed over the
    pipeline group, a weight tied across stages counted by the first rank of its tie group (``fxpar.clip``)."""
    elsewhere = [state.param(fqn) for fqn, ranks in manifest["tie_groups"] if rank in ranks and ranks[0] != rank]
    pp_group = mesh.device_mesh().get_group("pp") if mesh.axes.get("pp", 1) > 1 else None
    return lambda: clip_grad_norm_(state.parameters(), max_norm, pp_group=pp_group, counted_elsewhere=elsewhere)


def _device(name: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device("cpu")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        train(args)
    except (SavedProgramError, CheckpointError) as e:
        print(f"fxpar.run: error on rank {os.environ.get('RANK', '?')}: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
