"""A pipeline backward in halves against a whole one, and both against ``torch.distributed.pipelining`` (section 4).

    .venv/bin/python bench/pp_halves.py

Under 1F1B and GPipe, fxpar runs the backward of a stage whose input gradient goes to another rank as ``B``
(that gradient), its send, then ``W`` (the weight gradients): ``fxpar.rank_step.backward_halves``. The previous
stage's backward then starts a ``W`` earlier. ``FXPAR_BACKWARD_HALVES=0`` (read when the model is compiled) keeps
the backward whole, as torch's schedules do. One launch of 2 gloo ranks builds, per schedule, fxpar with halves,
fxpar whole and torch's ``PipelineStage`` + schedule on the same hand-split stages (``compiled.py``'s pp pair:
the bundled Llama, split at ``layers.2``, 4 microbatches, AdamW), checks that the two fxpar programs give the same
losses to the bit, then times many rounds of a few steps each, the three systems' order rotating every round and
reversed every other round (``zero_grad`` + step + ``opt.step``, back to back, max over ranks). Each round gives a
ratio against torch's steps of the same round; the table shows the median over rounds (a robust ratio on a noisy
machine) and the median step times.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from common import bench_args, markdown_table, publish_gloo_run
from compiled import build_pp
from zero import BATCH, CONFIG, SEQ

from fxpar.compiled import HALVES_ENV
from fxpar.models.llama import Llama, LlamaConfig

COMMAND = ".venv/bin/python bench/pp_halves.py"
ROUNDS, STEPS, WARMUP = 40, 6, 3
SCHEDULES = ("1f1b", "gpipe")
SYSTEMS = ("fxpar halves", "fxpar whole", "torch.pipelining")


def build(system: str, schedule: str, model: Llama, tokens: torch.Tensor) -> tuple[Any, Any]:
    if system == "torch.pipelining":
        return build_pp(f"torch.pipelining {schedule}", model, tokens, False)
    os.environ[HALVES_ENV] = "1" if system == "fxpar halves" else "0"
    try:
        return build_pp(f"fxpar pp=2 {schedule}", model, tokens, False)
    finally:
        del os.environ[HALVES_ENV]


def rounds(runs: dict[str, tuple[Any, Any]]) -> dict[str, list[float]]:
    """Per system, the mean step time (s) of each round, max over ranks."""
    out: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(ROUNDS):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in (order if r % 2 == 0 else order[::-1]):
            step, opt = runs[name]
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                opt.zero_grad()
                step()
                opt.step()
            out[name].append((time.perf_counter() - t0) / STEPS)
    for name in names:
        times = torch.tensor(out[name], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out[name] = times.tolist()
    return out


def main() -> dict[str, Any]:
    torch.set_num_threads(1)
    res: dict[str, Any] = {}
    for schedule in SCHEDULES:
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**CONFIG))
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
        runs = {system: build(system, schedule, model, tokens) for system in SYSTEMS}
        losses: dict[str, list[float]] = {}
        for name, (step, opt) in runs.items():
            for _ in range(WARMUP):
                opt.zero_grad()
                losses.setdefault(name, []).append(step().item())
                opt.step()
        res[schedule] = {"losses": losses, "times": rounds(runs)}
    return res


def report(res: dict[str, Any]) -> list[str]:
    rows = []
    for schedule, r in res.items():
        times, torch_times = r["times"], r["times"]["torch.pipelining"]
        for name in SYSTEMS:
            per_round = [a / b for a, b in zip(times[name], torch_times, strict=True)]
            rows.append([schedule, name, f"{1e3 * statistics.median(times[name]):.1f}",
                         f"**{statistics.median(per_round):.3f}**", f"{min(per_round):.2f}-{max(per_round):.2f}"])
    same = all(r["losses"]["fxpar halves"] == r["losses"]["fxpar whole"] for r in res.values())
    return [f"`{COMMAND}` (2 gloo ranks, 1 thread each; Llama 4 layers, hidden 256, vocab 512; batch {BATCH} x seq "
            f"{SEQ}, 4 microbatches, split at `layers.2`; {ROUNDS} rounds of {STEPS} steps per system)", "",
            *markdown_table(["schedule", "system", "median step ms", "median of per-round ratios vs torch",
                             "per-round range"], rows), "",
            f"Losses of the first {WARMUP} steps, fxpar halves vs whole: {'equal to the bit' if same else 'DIFFER'}; "
            "torch.pipelining's first loss: " + ", ".join(f"{s} {r['losses']['torch.pipelining'][0]:.6f} "
                                                           f"(fxpar {r['losses']['fxpar halves'][0]:.6f})"
                                                           for s, r in res.items()) + "."]


if __name__ == "__main__":
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(main, 2, timeout=3000, collective_timeout=600)
    publish_gloo_run("pp_halves", "pp_halves", COMMAND, report(results[0]), results, t0, not args.no_readme,
                     CONFIG, BATCH, SEQ)
