"""The quickstart job: parallelize the bundled Llama on a local dp=2 x tp=2 CPU mesh (4 gloo
processes), print rank 0's program and ledger, train a few steps next to the single-device
model, and report the equivalence check.

    python -m fxpar.demo [--steps 5] [--layers 2]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.testing.launch import run_ranks

MESH = {"dp": 2, "tp": 2}
LR, ADAM_EPS = 1e-3, 1e-6


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, mean over the (local) batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def train_rank(steps: int, layers: int) -> dict:
    """Runs in each of the 4 ranks: fxpar program and single-device reference side by side."""
    rank = dist.get_rank()
    cfg = LlamaConfig(n_layers=layers)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16))
    torch.manual_seed(1)
    reference = Llama(cfg)
    torch.manual_seed(1)
    model = Llama(cfg)
    mesh = fxpar.Mesh(MESH)
    pm = fxpar.parallelize(model, mesh, (tokens,), plan=llama_plan())
    local = tokens.chunk(MESH["dp"])[mesh.coord(rank)[0]]
    opt = torch.optim.AdamW(pm.parameters(), lr=LR, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR, eps=ADAM_EPS)
    losses = []
    for _ in range(steps):
        loss = _loss(pm(local), local)
        loss.backward()
        ref_loss = _loss(reference(tokens), tokens)
        ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)  # tp ranks hold equal losses: the world mean is the dp mean
        losses.append((global_loss.item() / dist.get_world_size(), ref_loss.item()))
    ref_params = dict(reference.named_parameters())
    param_diff = max((p.full_tensor() - ref_params[n]).abs().max().item() for n, p in pm.named_parameters())
    out = {"losses": losses, "param_diff": param_diff}
    if rank == 0:
        out.update(program=pm.program(0), ledger=pm.ledger_table(0))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    results = run_ranks(train_rank, 4, args.steps, args.layers, timeout=300, collective_timeout=60)
    first = results[0]
    print(first["program"])
    print("# ledger of rank 0 (one training step)")
    print(first["ledger"], "\n")
    print(f"{'step':>4}  {'fxpar loss':>12}  {'single-device':>13}  {'abs diff':>9}")
    for i, (got, ref) in enumerate(first["losses"]):
        print(f"{i + 1:>4}  {got:>12.6f}  {ref:>13.6f}  {abs(got - ref):>9.2e}")
    loss_diff = max(abs(a - b) for r in results for a, b in r["losses"])
    param_diff = max(r["param_diff"] for r in results)
    ok = loss_diff <= 1e-5 and param_diff <= 2e-2 * LR
    print(f"\nequivalence on mesh {MESH}: max |loss diff| {loss_diff:.2e} (tol 1e-5), max |param diff| after "
          f"{args.steps} AdamW steps {param_diff:.2e} (tol {2e-2 * LR:.0e}): {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
