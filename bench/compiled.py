"""``Plan(compile=True)`` on real gloo ranks: fxpar compiled vs fxpar eager vs DDP eager vs DDP + ``torch.compile``.

One command, one launch of 2 gloo ranks (``dp=2``)::

    .venv/bin/python bench/compiled.py

Same model and batch as ``zero.py`` (the bundled Llama, seed 0), fp32 ``AdamW(foreach=True)`` on every system:
the multi-tensor update is torch's default on CUDA, where these systems train; on CPU torch defaults to a loop
over parameters, which costs DTensor parameters (fxpar's, FSDP2's) one DTensor dispatch per op and parameter
(measured here: 16.4 ms per step against DDP's 9.9 ms with the loop, 12.5 against 11.2 with ``foreach``).
fxpar ``zero=0`` eager and with ``compile=True`` (every rank graph compiled by Inductor on its first call)
against DDP eager and DDP under ``torch.compile`` (Dynamo's DDP optimizer splits the graph at bucket boundaries).
Step time as in ``zero.py``: max over ranks, median over interleaved rounds, after warm-up steps that include
every compilation; each system's first-step loss is printed next to the others'.

Results go to ``bench/results/compiled.json`` and the ``compiled`` section of ``bench/README.md``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from common import bench_args, interleaved_step_times, publish_gloo_run, step_time_table
from torch.nn.parallel import DistributedDataParallel
from zero import BATCH, CONFIG, DP, ROUNDS, SEQ, STEPS, next_token_loss

import fxpar
from fxpar.models.llama import Llama, LlamaConfig

COMMAND = ".venv/bin/python bench/compiled.py"
WARMUP = 3
SYSTEMS = ["fxpar eager", "fxpar compile=True", "DDP eager", "DDP + torch.compile"]
BASE = {"fxpar eager": "DDP eager", "fxpar compile=True": "DDP + torch.compile"}


def build(name: str, model: Llama, tokens: torch.Tensor) -> tuple[Any, Any]:
    """(step function, optimizer) for one system on this rank."""
    local = tokens.chunk(DP)[dist.get_rank()]
    m = copy.deepcopy(model)
    if name.startswith("fxpar"):
        pm = fxpar.parallelize(m, fxpar.Mesh({"dp": DP}), (tokens,), plan=fxpar.Plan(compile="compile" in name),
                               loss_fn=next_token_loss, example_targets=tokens)
        return (lambda: pm.step(local, local)), torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
    ddp = DistributedDataParallel(m)
    run = torch.compile(ddp) if "compile" in name else ddp
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3, foreach=True)

    def step() -> torch.Tensor:
        loss = next_token_loss(run(local), local)
        loss.backward()
        value = loss.detach().clone()
        dist.all_reduce(value)
        return value / dist.get_world_size()

    return step, opt


def rank_main() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    runs = {name: build(name, model, tokens) for name in SYSTEMS}
    out: dict[str, Any] = {}
    for name, (step, opt) in runs.items():
        first, t0 = None, time.perf_counter()
        for _ in range(WARMUP):
            opt.zero_grad()
            loss = step()
            opt.step()
            first = loss.item() if first is None else first
        out[name] = {"first_loss": first, "warmup_s": time.perf_counter() - t0, "times": []}
    for name, times in interleaved_step_times(runs, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(rank_main, DP, timeout=1200, collective_timeout=600)
    res = results[0]
    lines = [f"`{COMMAND}` (dp=2, 2 gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, "
             f"vocab {CONFIG['vocab_size']}; batch {BATCH} x seq {SEQ}; fp32, AdamW(foreach=True); rank 0's numbers; "
             f"step time max over ranks, median of {STEPS} steps in {ROUNDS} interleaved rounds after {WARMUP} "
             "warm-up steps)", "",
             *step_time_table({name: res[name] for name in SYSTEMS}, BASE), "",
             "Warm-up (first " + str(WARMUP) + " steps, compilation included): "
             + ", ".join(f"{name} {res[name]['warmup_s']:.1f} s" for name in SYSTEMS) + ".", ""]
    publish_gloo_run("compiled", "compiled", COMMAND, lines, results, t0, not args.no_readme, CONFIG, BATCH, SEQ)


if __name__ == "__main__":
    main()
