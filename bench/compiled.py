"""Step time against every baseline, eager and compiled: fxpar with and without ``Plan(compile=True)`` against
DDP, FSDP2 (ZeRO-2 and ZeRO-3 modes) and ``torch.distributed.pipelining``, each with and without
``torch.compile``, on real gloo ranks.

One command, two launches of 2 gloo ranks (``dp=2``, then ``pp=2``); a few minutes on 2 cores, most of it
Inductor compiling::

    .venv/bin/python bench/compiled.py

Same model and batch as ``zero.py`` (the bundled Llama, seed 0), fp32, each system's own ``AdamW(lr=1e-3)``
with torch's default implementation (``--foreach`` for the multi-tensor one, torch's default on CUDA).

* **dp=2**: fxpar ``zero=0`` vs DDP; ``zero=1`` and ``zero=2`` vs FSDP2 with ``reshard_after_forward=False``
  (ZeRO-2's schedule); ``zero=3`` vs FSDP2 with ``reshard_after_forward=True``. FSDP2 runs one ``fully_shard``
  per block plus the root. Compiled: fxpar ``Plan(compile=True)`` (every rank graph compiled by Inductor on its
  first call); DDP under ``torch.compile`` (Dynamo's DDP optimizer splits the graph at bucket boundaries);
  FSDP2 with each block compiled before it is sharded (``block.compile()``, torchtitan's recipe; the
  parameter gathers stay outside the compiled regions).
* **pp=2**, 1F1B, 4 microbatches, split at ``layers.2``: fxpar against ``PipelineStage`` + ``Schedule1F1B`` on
  the hand-split stage modules of ``pipeline.py``; compiled: fxpar ``Plan(compile=True)``, torch with each block
  of its stage compiled.

Step time: ``zero_grad`` + forward + backward + ``opt.step``, max over ranks, median over interleaved rounds
(every system's turn alternates direction each round), after warm-up steps that include every compilation;
each system's first-step loss is printed next to the others'.

Results go to ``bench/results/compiled.json`` and the ``compiled`` section of ``bench/README.md``.
"""

from __future__ import annotations

import copy
import time
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from common import bench_args, interleaved_step_times, markdown_table, publish_gloo_run
from pipeline import MICROBATCHES, SPLIT, StageModule
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.nn.parallel import DistributedDataParallel
from zero import BATCH, CONFIG, SEQ, next_token_loss

import fxpar
from fxpar.models.llama import Llama, LlamaConfig

COMMAND = ".venv/bin/python bench/compiled.py"
WARMUP = 3
STEPS, ROUNDS = 48, 8  # 6 steps per system per round: a round's ratio pairs steps seconds apart
WORLD = 2
COMPILED = " + torch.compile"
# (fxpar system, its baseline); a compiled pair follows each eager pair
PAIRS = [("fxpar zero=0", "DDP"), ("fxpar zero=1", "FSDP2 (ZeRO-2 mode)"), ("fxpar zero=2", "FSDP2 (ZeRO-2 mode)"),
         ("fxpar zero=3", "FSDP2 (ZeRO-3 mode)")]
PP_PAIRS = [("fxpar pp=2 1f1b", "torch.pipelining 1f1b")]


def systems(pairs: list[tuple[str, str]], eager_only: bool = False) -> dict[str, str]:
    """Every fxpar system, eager and (unless ``eager_only``) compiled, mapped to its baseline in the same mode."""
    base = {}
    for fx, torch_name in pairs:
        base[fx] = torch_name
        if not eager_only:
            base[f"{fx} compile=True"] = torch_name + COMPILED
    return base


def _optimizer(params: Any, foreach: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, foreach=True if foreach else None)


def _global_mean(loss: torch.Tensor) -> torch.Tensor:
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value / dist.get_world_size()


def _eager_step(run: Any, local: torch.Tensor) -> torch.Tensor:
    loss = next_token_loss(run(local), local)
    loss.backward()
    return _global_mean(loss)


def build_dp(name: str, model: Llama, tokens: torch.Tensor, foreach: bool) -> tuple[Any, Any]:
    """(step function, optimizer) of one dp=2 system on this rank."""
    local = tokens.chunk(WORLD)[dist.get_rank()]
    m = copy.deepcopy(model)
    compiled = name.endswith("compile=True") or name.endswith(COMPILED)
    if name.startswith("fxpar"):
        zero = int(name.split("zero=")[1][0])
        pm = fxpar.parallelize(m, fxpar.Mesh({"dp": WORLD}), (tokens,), plan=fxpar.Plan(zero=zero, compile=compiled),
                               loss_fn=next_token_loss, example_targets=tokens)
        return (lambda: pm.step(local, local)), _optimizer(pm.parameters(), foreach)
    if name.startswith("DDP"):
        ddp = DistributedDataParallel(m)
        return partial(_eager_step, torch.compile(ddp) if compiled else ddp, local), _optimizer(ddp.parameters(),
                                                                                             foreach)
    reshard = "ZeRO-3" in name
    for layer in m.layers:
        if compiled:
            layer.compile()
        fully_shard(layer, reshard_after_forward=reshard)
    fully_shard(m, reshard_after_forward=reshard)
    return partial(_eager_step, m, local), _optimizer(m.parameters(), foreach)


def build_pp(name: str, model: Llama, tokens: torch.Tensor, foreach: bool) -> tuple[Any, Any]:
    """(step function, optimizer) of one pp=2 system on this rank (1F1B, or GPipe where ``name`` says ``gpipe``);
    the step returns the global mean loss."""
    rank = dist.get_rank()
    compiled = name.endswith("compile=True") or name.endswith(COMPILED)
    schedule = "gpipe" if "gpipe" in name else "1f1b"
    if name.startswith("fxpar"):
        plan = fxpar.Plan(stages=SPLIT, schedule=schedule, microbatches=MICROBATCHES, compile=compiled)
        pm = fxpar.parallelize(copy.deepcopy(model), fxpar.Mesh({"pp": WORLD}), (tokens,), plan=plan,
                               loss_fn=next_token_loss, example_targets=tokens)
        return (lambda: pm.step(tokens, tokens)), _optimizer(pm.parameters(), foreach)
    cut, layers = int(SPLIT[0].split(".")[1]), len(model.layers)
    submod = StageModule(copy.deepcopy(model), *((0, cut) if rank == 0 else (cut, layers)))
    if compiled:
        for layer in submod.layers.values():
            layer.compile()
    sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(
        PipelineStage(submod, rank, WORLD, torch.device("cpu")), n_microbatches=MICROBATCHES, loss_fn=next_token_loss)

    def step() -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(tokens)
        else:
            sched.step(target=tokens, losses=losses, return_outputs=False)
        loss = torch.stack(losses).detach().mean() if losses else torch.zeros(())
        dist.all_reduce(loss)  # only the last stage has the losses: the sum is its mean
        return loss

    return step, _optimizer(submod.parameters(), foreach)


def measure(builder: Any, names: list[str], foreach: bool) -> dict[str, Any]:
    """Run in every rank: build each system, warm it up (compilation included), then time interleaved rounds."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    runs = {name: builder(name, model, tokens, foreach) for name in names}
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


def dp_main(foreach: bool, eager_only: bool) -> dict[str, Any]:
    base = systems(PAIRS, eager_only)
    return measure(build_dp, list(dict.fromkeys(n for pair in base.items() for n in pair)), foreach)


def pp_main(foreach: bool, eager_only: bool) -> dict[str, Any]:
    base = systems(PP_PAIRS, eager_only)
    return measure(build_pp, list(dict.fromkeys(n for pair in base.items() for n in pair)), foreach)


def report(res: dict[str, Any], base: dict[str, str]) -> list[str]:
    """One row per fxpar system: eager and compiled medians against the baseline's, in the same mode."""
    import statistics

    def med(name: str) -> float:
        return statistics.median(res[name]["times"])

    def per_round(name: str) -> list[float]:
        times, n = res[name]["times"], STEPS // ROUNDS
        return [statistics.mean(times[i:i + n]) for i in range(0, len(times), n)]

    rows = []
    for fx, baseline in base.items():
        paired = statistics.median(a / b for a, b in zip(per_round(fx), per_round(baseline), strict=True))
        rows.append([fx, f"{1e3 * med(fx):.1f}", baseline, f"{1e3 * med(baseline):.1f}",
                     f"**{med(fx) / med(baseline):.2f}**", f"{paired:.2f}", f"{res[fx]['first_loss']:.6f}",
                     f"{res[baseline]['first_loss']:.6f}"])
    return markdown_table(["fxpar", "median ms", "baseline", "median ms", "ratio", "median of per-round ratios",
                           "first-step loss fxpar", "baseline"], rows)


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__, flags=(("--foreach", "AdamW(foreach=True) on every system"),
                                       ("--eager-only", "leave out the compiled systems (a quick second sample)")))
    foreach, eager = args.foreach, args.eager_only
    t0 = time.perf_counter()
    dp = run_ranks(dp_main, WORLD, foreach, eager, timeout=1800, collective_timeout=900)
    pp = run_ranks(pp_main, WORLD, foreach, eager, timeout=1200, collective_timeout=900)
    res = {**dp[0], **pp[0]}
    base = {**systems(PAIRS, eager), **systems(PP_PAIRS, eager)}
    warm = ", ".join(f"{name} {r['warmup_s']:.1f} s" for name, r in res.items())
    optimizer = "AdamW(foreach=True)" if foreach else "AdamW (torch's default implementation)"
    flags = (" --foreach" if foreach else "") + (" --eager-only" if eager else "")
    lines = [f"`{COMMAND}{flags}` (2 gloo ranks: dp=2, then pp=2 1F1B with "
             f"{MICROBATCHES} microbatches; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, vocab "
             f"{CONFIG['vocab_size']}; batch {BATCH} x seq {SEQ}; fp32, {optimizer}; step time max over ranks, "
             f"median of {STEPS} steps in {ROUNDS} interleaved rounds after {WARMUP} warm-up steps)", "",
             *report(res, base), "",
             f"Warm-up (first {WARMUP} steps, compilation included): {warm}.", ""]
    publish_gloo_run("compiled", "compiled", COMMAND, lines, {"dp": dp, "pp": pp}, t0, not args.no_readme,
                     CONFIG, BATCH, SEQ, foreach=foreach, eager_only=eager)


if __name__ == "__main__":
    main()
