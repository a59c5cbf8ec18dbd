"""Hold ``python -m fxpar.run`` to the in-process ``pm.step``: the same weights, batches and optimizer, bitwise.

``train_in_process`` runs on pool ranks: it compiles a model, saves the program folder (rank 0) and the initial
weights (``fxpar.checkpoint.save``), then trains ``steps`` steps with ``pm.step`` + AdamW on the batches
``fxpar.run`` reads from the same token file, and saves the final weights. ``launch`` starts ``torchrun -m
fxpar.run`` on the folder; ``read_checkpoint`` reads a DCP checkpoint as full tensors in one process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import fxpar
from fxpar import checkpoint
from fxpar.run import train_saved
from fxpar.saved import load_rank, read_manifest
from fxpar.split import rank_batch
from fxpar.testing.launch import free_port


def next_token_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a causal LM's logits (``out.logits`` or a tensor) against the next tokens."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def write_tokens(path: str, n: int, vocab: int, seed: int = 0, dtype: str = "uint16") -> None:
    """A flat token file of ``n`` random ids below ``vocab`` (nanoGPT's ``train.bin`` layout)."""
    rng = np.random.default_rng(seed)
    rng.integers(0, vocab, size=n).astype(dtype).tofile(path)


def token_batch(path: str, step: int, rows: int, seq: int, dtype: str = "uint16") -> torch.Tensor:
    """Step ``step``'s ``rows x (seq + 1)`` ids of a token file, as ``fxpar.run`` reads them."""
    tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    need = rows * (seq + 1)
    start = (step % (len(tokens) // need)) * need
    return torch.from_numpy(np.asarray(tokens[start:start + need], dtype=np.int64)).view(rows, seq + 1)


def train_in_process(build: Callable[[], torch.nn.Module], axes: dict[str, int], plan: fxpar.Plan, folder: str,
                     init_ckpt: str, final_ckpt: str, data: str, rows: int, seq: int, steps: int,
                     lr: float = 1e-3, clip: float | None = None,
                     buffers: dict[str, float] | None = None) -> list[float]:
    """On each pool rank: compile, save folder and initial weights, train ``steps`` steps (clipping the gradient
    norm to ``clip`` with ``pm.clip_grad_norm_`` if given); rank 0's losses. ``buffers``: values filled into the
    compiled module's buffers after the folder is saved, before the initial weights are (a checkpoint's buffers
    are what a replay must read, not the ones the folder was saved with)."""
    torch.manual_seed(0)
    model = build()
    mesh = fxpar.Mesh(axes)
    rank = dist.get_rank()
    example = (torch.zeros(rows, seq, dtype=torch.int64),)
    pm = fxpar.parallelize(model, mesh, example, plan, loss_fn=next_token_loss)
    if rank == 0:
        pm.save(folder)
    dist.barrier()  # the folder is written before any buffer below changes
    for name, value in (buffers or {}).items():
        pm.get_buffer(name).fill_(value)
    checkpoint.save(pm, None, init_ckpt)
    opt = torch.optim.AdamW(pm.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        tokens = token_batch(data, step, rows, seq)
        loss = pm.step(rank_batch(tokens[:, :-1], mesh, rank), rank_batch(tokens[:, 1:], mesh, rank))
        if clip is not None:
            pm.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    checkpoint.save(pm, opt, final_ckpt)
    dist.barrier()
    return losses


def train_both(build: Callable[[], torch.nn.Module], axes: dict[str, int], plan: fxpar.Plan, folder: str,
               data: str, rows: int, seq: int, steps: int, lr: float = 1e-3, clip: float | None = None,
               buffers: dict[str, float] | None = None) -> tuple[list[float], list[float], list[str]]:
    """On each pool rank: ``train_in_process``, then the same steps from the saved folder with ``fxpar.run``'s
    training loop (``train_saved``) in the same process group. Returns both losses and the parameters whose
    local shards differ after training (compared bitwise)."""
    losses = train_in_process(build, axes, plan, folder, f"{folder}.init", f"{folder}.trained", data, rows, seq,
                              steps, lr, clip, buffers)
    manifest = read_manifest(folder)
    saved = load_rank(folder, manifest, dist.get_rank())
    replayed = train_saved(saved, manifest, "cpu", f"{folder}.init", steps,
                           lambda step: token_batch(data, step, rows, seq), lr, save=f"{folder}.replayed", clip=clip)
    dist.barrier()
    want, got = read_checkpoint(f"{folder}.trained"), read_checkpoint(f"{folder}.replayed")
    different = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
    return losses, replayed, different


def launch(folder: str, nproc: int, *args: str, env: dict[str, str] | None = None,
           timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node nproc -m fxpar.run folder args...``; the process group is killed on timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "fxpar.run", folder, *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            raise AssertionError(f"fxpar.run did not finish within {timeout} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def logged_losses(stdout: str) -> list[float]:
    """The losses rank 0 printed (``step <i> loss <value>``), in step order."""
    return [float(line.split()[3]) for line in stdout.splitlines() if line.startswith("step ")]


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model tensors, full (unsharded), read in this process without a process group."""
    with tempfile.TemporaryDirectory() as tmp:
        target = os.path.join(tmp, "state.pt")
        dcp_to_torch_save(path, target)
        state = torch.load(target, weights_only=False)
    return {k: v for k, v in state["model"].items() if isinstance(v, torch.Tensor)}


def resume_both(build: Callable[[], torch.nn.Module], axes: dict[str, int], plan: fxpar.Plan, folder: str,
                data: str, rows: int, seq: int, before: int, after: int) -> tuple[list[float], list[float], list[str]]:
    """On each pool rank, with ``fxpar.run``'s training loop on the saved folder: ``before + after`` steps straight,
    then ``before`` steps saved with the optimizer's state and ``after`` more resumed from that checkpoint. Returns
    the straight losses, the interrupted run's, and the parameters whose shards differ at the end."""
    train_in_process(build, axes, plan, folder, f"{folder}.init", f"{folder}.unused", data, rows, seq, 0)
    manifest = read_manifest(folder)

    def run(start: str, steps: int, save: str) -> list[float]:
        saved = load_rank(folder, manifest, dist.get_rank())
        return train_saved(saved, manifest, "cpu", start, steps, lambda step: token_batch(data, step, rows, seq),
                           save=save)

    straight = run(f"{folder}.init", before + after, f"{folder}.straight")
    interrupted = run(f"{folder}.init", before, f"{folder}.mid") + run(f"{folder}.mid", after, f"{folder}.resumed")
    dist.barrier()
    want, got = read_checkpoint(f"{folder}.straight"), read_checkpoint(f"{folder}.resumed")
    return straight, interrupted, sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
