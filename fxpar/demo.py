"""The quickstart demo: parallelize the bundled Llama on a local CPU mesh of gloo processes (default dp=2 x tp=2),
print rank 0's program and ledger (and the pipeline schedule with pp), train a few AdamW steps with ``pm.step`` next to
the single-device model, and report the equivalence verdict.

    python -m fxpar.demo [--mesh dp=2,tp=2] [--schedule 1f1b] [--microbatches M] [--steps 5] [--layers 2]
                         [--save demo_out]

It also saves every rank's program (``pm.save``) and the initial weights (``fxpar.checkpoint.save``) under
``--save``, and prints the ``torchrun -m fxpar.run`` command that trains them without the model's code.

``--mesh pp=2,dp=2,tp=2`` runs the 3D case on 8 ranks: two pipeline stages (one per pp rank) under ``--schedule``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar
from fxpar import checkpoint
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.split import rank_batch
from fxpar.testing.launch import run_ranks

BATCH_PER_DP, SEQ, LR = 4, 16, 1e-3
# Adam divides by sqrt(v) + eps: with the default 1e-8 it amplifies float rounding noise in near-zero gradients
# (max param diff 9.6e-6 here, at the tolerance); 1e-6 keeps the check about the compiler, not that noise.
ADAM_EPS = 1e-6
RTOL = ATOL = LOSS_TOL = 1e-5


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against its target (the next token), mean over the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parse_mesh(text: str) -> dict[str, int]:
    """``"pp=2,dp=2,tp=2"`` -> ``{"pp": 2, "dp": 2, "tp": 2}``."""
    axes = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not size.isdigit():
            raise argparse.ArgumentTypeError(f"--mesh wants name=size pairs like pp=2,dp=2,tp=2, got {part!r}")
        axes[name.strip()] = int(size)
    return axes


def demo_plan(axes: dict[str, int], schedule: str, microbatches: int | None) -> fxpar.Plan:
    """Megatron tp plan (with a tp axis), one stage per pp rank (with a pp axis)."""
    pp = axes.get("pp", 1)
    return fxpar.Plan(tp=llama_plan() if "tp" in axes else {}, stages=pp if pp > 1 else None,
                      schedule=schedule, microbatches=microbatches)


def train_rank(axes: dict[str, int], schedule: str, microbatches: int | None, steps: int,
               layers: int, save: str | None = None) -> dict[str, Any]:
    """Runs in every rank: ``pm.step`` on this rank's dp shard next to the single-device model on the full batch.
    With ``save``, first writes the program folder (``save/program``) and the initial weights (``save/init``)."""
    rank = dist.get_rank()
    cfg = LlamaConfig(n_layers=layers)
    dp = axes.get("dp", 1)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH_PER_DP * dp, SEQ + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each position predicts the next token
    torch.manual_seed(1)
    model = Llama(cfg)
    torch.manual_seed(1)
    reference = Llama(cfg)
    mesh = fxpar.Mesh(axes)
    pm = fxpar.parallelize(model, mesh, (inputs,), plan=demo_plan(axes, schedule, microbatches),
                           loss_fn=next_token_loss, example_targets=targets)
    if save:
        if rank == 0:
            pm.save(os.path.join(save, "program"))
        checkpoint.save(pm, None, os.path.join(save, "init"))
    local_inputs, local_targets = rank_batch(inputs, mesh, rank), rank_batch(targets, mesh, rank)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)
    losses: list[tuple[float, float]] = []
    for _ in range(steps):
        for o in (opt, ref_opt):
            o.zero_grad()
        loss = pm.step(local_inputs, local_targets)  # the global mean loss, on every rank
        ref_loss = next_token_loss(reference(inputs), targets)
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        losses.append((loss.item(), ref_loss.item()))
    ref_params = dict(reference.named_parameters())
    param_diff, params_close = 0.0, True
    for name, p in pm.named_parameters():
        got, want = p.full_tensor().detach(), ref_params[name].detach()
        param_diff = max(param_diff, (got - want).abs().max().item())
        params_close &= torch.allclose(got, want, rtol=RTOL, atol=ATOL)
    out: dict[str, Any] = {"losses": losses, "param_diff": param_diff, "params_close": params_close}
    if rank == 0:
        out.update(program=pm.program(0), ledger=pm.ledger_table(0),
                   schedule=str(pm.schedule) if "pp" in axes else "")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", type=parse_mesh, default={"dp": 2, "tp": 2},
                        help="mesh axes, e.g. dp=2,tp=2 (default) or pp=2,dp=2,tp=2")
    parser.add_argument("--schedule", default="1f1b", help="pipeline schedule with pp: gpipe, 1f1b (default), zb-h1")
    parser.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: pp)")
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (default 5)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the bundled Llama (default 2)")
    parser.add_argument("--save", default="demo_out", help="where to save the program folder and initial weights "
                        "for python -m fxpar.run (default demo_out; '' to skip)")
    args = parser.parse_args(argv)
    axes = args.mesh
    world = math.prod(axes.values())
    save = os.path.abspath(args.save) if args.save else None
    if save:
        shutil.rmtree(save, ignore_errors=True)
    results = run_ranks(train_rank, world, axes, args.schedule, args.microbatches, args.steps, args.layers, save,
                        timeout=600, collective_timeout=120)
    first = results[0]
    print(first["program"])
    if first["schedule"]:
        print("# pipeline schedule (steps x pp ranks)")
        print(first["schedule"], "\n")
    print("# communication ledger of rank 0 (one training step)")
    print(first["ledger"], "\n")
    print(f"{'step':>4}  {'fxpar loss':>12}  {'single-device':>13}  {'abs diff':>9}")
    for i, (got, want) in enumerate(first["losses"], 1):
        print(f"{i:>4}  {got:>12.6f}  {want:>13.6f}  {abs(got - want):>9.2e}")
    loss_diff = max((abs(got - want) for r in results for got, want in r["losses"]), default=0.0)
    param_diff = max(r["param_diff"] for r in results)
    ok = loss_diff <= LOSS_TOL and all(r["params_close"] for r in results)
    mesh_text = " x ".join(f"{k}={v}" for k, v in axes.items())
    print(
        f"\nequivalence on mesh {mesh_text} after {args.steps} AdamW steps: max |loss diff| {loss_diff:.2e} "
        f"(tol {LOSS_TOL:.0e}), max |param diff| {param_diff:.2e} (rtol {RTOL:.0e}, atol {ATOL:.0e}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    if save:
        print(f"\nsaved every rank's program to {args.save}/program and the initial weights to {args.save}/init; "
              f"train them without the model's code:\n  .venv/bin/torchrun --nproc_per_node {world} -m fxpar.run "
              f"{args.save}/program --checkpoint {args.save}/init --steps 3 --synthetic")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
