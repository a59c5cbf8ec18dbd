"""Where a pp=2 1F1B step's time goes, fxpar against ``torch.distributed.pipelining`` (a diagnostic for section 14).

    .venv/bin/python bench/pp_parts.py

The systems of ``compiled.py``'s pp pair (eager), on 2 gloo ranks, each step split into ``zero_grad``, the
step itself and ``opt.step``, with a barrier before every step so that no rank's step overlaps another's
(``compiled.py`` runs its steps back to back). Medians over 4 interleaved rounds of 10 steps, per rank, in ms.
Prints only; the numbers and their reading are in bench/README.md, section 14.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from compiled import build_pp
from zero import BATCH, CONFIG, SEQ

from fxpar.models.llama import Llama, LlamaConfig

NAMES = ["fxpar pp=2 1f1b", "torch.pipelining 1f1b"]
ROUNDS, STEPS, WARMUP = 4, 10, 3


def parts(step: Any, opt: Any, n: int) -> list[float]:
    """Median ms of ``zero_grad``, the step and ``opt.step`` over ``n`` steps, a barrier before each."""
    times: list[list[float]] = [[], [], []]
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        t1 = time.perf_counter()
        step()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2)):
            times[i].append(dt)
    return [1e3 * statistics.median(x) for x in times]


def main() -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    runs = {name: build_pp(name, model, tokens, False) for name in NAMES}
    for step, opt in runs.values():
        for _ in range(WARMUP):
            opt.zero_grad()
            step()
            opt.step()
    out: dict[str, list[list[float]]] = {name: [] for name in NAMES}
    for r in range(ROUNDS):
        for name in (NAMES if r % 2 == 0 else NAMES[::-1]):
            out[name].append(parts(*runs[name], n=STEPS))
    return {name: [round(statistics.median(v[i] for v in out[name]), 2) for i in range(3)] for name in NAMES}


if __name__ == "__main__":
    from fxpar.testing.launch import run_ranks

    for rank, res in enumerate(run_ranks(main, 2, timeout=1200, collective_timeout=600)):
        print(f"rank {rank}: " + "; ".join(f"{name}: zero_grad {z} ms, step {s} ms, opt.step {o} ms"
                                          for name, (z, s, o) in res.items()))
