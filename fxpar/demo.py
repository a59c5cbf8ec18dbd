"""The quickstart demo: parallelize the bundled Llama on a local dp=2 x tp=2 CPU mesh (4 gloo processes), print rank 0's
program and ledger, train a few AdamW steps next to the single-device model, and report the equivalence verdict.

    python -m fxpar.demo [--steps 5] [--layers 2]
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.testing.launch import run_ranks

MESH = {"dp": 2, "tp": 2}
WORLD = MESH["dp"] * MESH["tp"]
BATCH, SEQ, LR = 4, 16, 1e-3
# Adam divides by sqrt(v) + eps: with the default 1e-8 it amplifies float rounding noise in near-zero gradients
# (max param diff 9.6e-6 here, at the tolerance); 1e-6 keeps the check about the compiler, not that noise.
ADAM_EPS = 1e-6
RTOL = ATOL = LOSS_TOL = 1e-5


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next token, mean over the batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_rank(steps: int, layers: int) -> dict[str, Any]:
    """Runs in every rank: fxpar on this rank's dp shard next to the single-device model on the full batch."""
    rank = dist.get_rank()
    cfg = LlamaConfig(n_layers=layers)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    torch.manual_seed(1)
    model = Llama(cfg)
    torch.manual_seed(1)
    reference = Llama(cfg)
    mesh = fxpar.Mesh(MESH)
    pm = fxpar.parallelize(model, mesh, (tokens,), plan=llama_plan())
    local = tokens.chunk(MESH["dp"])[mesh.coord(rank)[0]]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)
    losses: list[tuple[float, float]] = []
    for _ in range(steps):
        for o in (opt, ref_opt):
            o.zero_grad()
        loss = next_token_loss(pm(local), local)
        loss.backward()
        ref_loss = next_token_loss(reference(tokens), tokens)
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # tp ranks hold equal losses, so the world mean is the mean over dp
        losses.append((global_loss.item() / WORLD, ref_loss.item()))
    ref_params = dict(reference.named_parameters())
    param_diff, params_close = 0.0, True
    for name, p in pm.named_parameters():
        got, want = p.full_tensor().detach(), ref_params[name].detach()
        param_diff = max(param_diff, (got - want).abs().max().item())
        params_close &= torch.allclose(got, want, rtol=RTOL, atol=ATOL)
    out: dict[str, Any] = {"losses": losses, "param_diff": param_diff, "params_close": params_close}
    if rank == 0:
        out.update(program=pm.program(0), ledger=pm.ledger_table(0))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="AdamW steps (default 5)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the bundled Llama (default 2)")
    args = parser.parse_args(argv)
    results = run_ranks(train_rank, WORLD, args.steps, args.layers, timeout=600, collective_timeout=120)
    first = results[0]
    print(first["program"])
    print("# communication ledger of rank 0 (one training step)")
    print(first["ledger"], "\n")
    print(f"{'step':>4}  {'fxpar loss':>12}  {'single-device':>13}  {'abs diff':>9}")
    for i, (got, want) in enumerate(first["losses"], 1):
        print(f"{i:>4}  {got:>12.6f}  {want:>13.6f}  {abs(got - want):>9.2e}")
    loss_diff = max((abs(got - want) for r in results for got, want in r["losses"]), default=0.0)
    param_diff = max(r["param_diff"] for r in results)
    ok = loss_diff <= LOSS_TOL and all(r["params_close"] for r in results)
    print(
        f"\nequivalence on mesh dp=2 x tp=2 after {args.steps} AdamW steps: max |loss diff| {loss_diff:.2e} "
        f"(tol {LOSS_TOL:.0e}), max |param diff| {param_diff:.2e} (rtol {RTOL:.0e}, atol {ATOL:.0e}): "
        f"{'PASS' if ok else 'FAIL'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
