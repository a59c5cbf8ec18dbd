"""Saved activations per rank vs the recompute policy: predicted (``pm.memory``), measured, and the formula.

One command, one launch of 2 gloo ranks (``tp=2``), about a minute on 2 cores::

    .venv/bin/python bench/recompute.py

Same model (the bundled Llama, seed 0), same batch, fp32. Per policy (none, selective, full, and byte budgets):

* **saved bytes** on rank 0: ``fxpar.memory.saved_per_microbatch`` (predicted at compile time;
  ``pm.memory(0).activations`` adds the logits' gradient ``pm.step`` holds) and the distinct local
  storages one real forward of the rank program returns for its backward (measured; parameters and inputs
  excluded), and their ratio to no recompute;
* **per layer**: the same prediction differenced between 2 and 4 layers, beside Korthikanti et al.'s formula
  for tensor parallelism without SP (``s b h (10 + 24 / t + 5 a s / (h t))`` bytes per layer at fp16 with
  dropout masks; full recompute ``2 s b h``). fxpar runs fp32 without dropout, so the formula is quoted in
  fp32 terms (x2, masks kept) as an upper reference, not an identity;
* **step time** (``pm.step`` + AdamW, max over ranks, median of ``STEPS`` steps in interleaved rounds) and
  its ratio to no recompute: the price of the recomputed forward.

Results go to ``bench/results/recompute.json`` and the ``recompute`` section of ``bench/README.md``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import bench_args, interleaved_step_times, markdown_table, publish_gloo_run, step_time_table

import fxpar
from fxpar.memory import saved_per_microbatch
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.testing.probes import storage_bytes

CONFIG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
          "max_seq": 64}
BATCH, SEQ, TP = 8, 64, 2
WARMUP, STEPS, ROUNDS = 1, 8, 4
COMMAND = ".venv/bin/python bench/recompute.py"
POLICIES: list[Any] = [None, "selective", "full", 6_000_000, 10_000_000]


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def label(policy: Any) -> str:
    return "none" if policy is None else f"budget {policy:,} B" if isinstance(policy, int) else policy


def build(policy: Any, tokens: torch.Tensor, layers: int, mesh: fxpar.Mesh) -> fxpar.ParallelModule:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**{**CONFIG, "n_layers": layers}))
    return fxpar.parallelize(model, mesh, (tokens,), plan=fxpar.Plan(tp=llama_plan(), recompute=policy),
                             loss_fn=next_token_loss, example_targets=tokens)


def measured_saved(pm: fxpar.ParallelModule, tokens: torch.Tensor) -> int:
    """Distinct local storages one forward of the rank program saves for its backward."""
    runner = pm._runners[0]
    inputs = [pm.local_param(f) for f in runner.param_fqns]
    bufs = pm.stage_buffers(0)
    with torch.no_grad():
        results = runner.forward(*inputs, *bufs, tokens)
    saved = [t for t in results[runner.num_outputs:] if isinstance(t, torch.Tensor)]
    return storage_bytes(saved, {t.untyped_storage().data_ptr() for t in [*inputs, *bufs, tokens]})


def rank_main() -> dict[str, Any]:
    rank = dist.get_rank()
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mesh = fxpar.Mesh({"tp": TP})
    out: dict[str, Any] = {}
    runs = {}
    for policy in POLICIES:
        pm = build(policy, tokens, CONFIG["n_layers"], mesh)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        losses = []
        for _ in range(WARMUP):
            losses.append(pm.step(tokens, tokens).item())
            opt.step()
            opt.zero_grad()
        fake = fxpar.Mesh({"tp": TP}, fake=True)
        two = saved_per_microbatch(build(policy, tokens, 2, fake)._compiled, rank)
        four = saved_per_microbatch(build(policy, tokens, 4, fake)._compiled, rank)
        out[label(policy)] = {"predicted": saved_per_microbatch(pm._compiled, rank),
                              "measured": measured_saved(pm, tokens), "per_layer": (four - two) // 2,
                              "first_loss": losses[0]}
        runs[label(policy)] = ((lambda pm=pm: pm.step(tokens, tokens)), opt)
    for name, times in interleaved_step_times(runs, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def report(res: dict[str, Any]) -> list[str]:
    s, b, h, a = SEQ, BATCH, CONFIG["hidden"], CONFIG["n_heads"]
    formula = {"none": s * b * h * (10 + 24 / TP + 5 * a * s / (h * TP)) * 2, "full": 2 * s * b * h * 2}
    none = res["none"]["predicted"]
    rows = []
    for name, r in res.items():
        ref = formula.get(name)
        rows.append([name, r["predicted"], r["measured"], "yes" if r["predicted"] == r["measured"] else "NO",
                     f"{r['predicted'] / none:.3f}", r["per_layer"], f"{ref:,.0f}" if ref else "-"])
    return [*markdown_table(["policy", "saved B (predicted)", "saved B (measured)", "equal", "vs none",
                             "per layer (4 - 2 layers) / 2", "Korthikanti per layer, fp32 terms"], rows), "",
            *step_time_table(res, {name: "none" for name in res if name != "none"}), ""]


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(rank_main, TP, timeout=900, collective_timeout=120)
    lines = [f"`{COMMAND}` (tp=2, 2 gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, "
             f"{CONFIG['n_heads']} heads; batch {BATCH} x seq {SEQ}; rank 0's numbers; step time max over ranks, "
             f"median of {STEPS} steps in {ROUNDS} interleaved rounds)", "", *report(results[0])]
    publish_gloo_run("recompute", "recompute", COMMAND, lines, results, t0, not args.no_readme, CONFIG, BATCH, SEQ)


if __name__ == "__main__":
    main()
