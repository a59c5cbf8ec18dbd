"""fxpar mixed precision vs FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` on real gloo ranks.

One command, one launch of 2 gloo ranks (``dp=2``)::

    .venv/bin/python bench/mixed_precision.py

Same model as ``zero.py`` (the bundled Llama, seed 0), same global batch, fp32 AdamW over fp32 master weights.
fxpar ``Plan(zero=2 | 3, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` against FSDP2 (one
``fully_shard`` per block plus the root) with the same policy, ``reshard_after_forward=False`` (ZeRO-2's schedule)
and ``True`` (ZeRO-3). Per system and rank, after warm-up:

* **dp bytes per step by op and dtype** against the optimum (Psi_e = parameter elements): all-gather 2 Psi_e
  (bf16) per gather (once per step for ZeRO-2, on both sides: fxpar casts each shard to bf16, gathers it and keeps
  that bf16 working copy for the step), reduce-scatter 4 Psi_e (fp32). fxpar's from its ledger; FSDP2's counted by
  wrapping the ``torch.distributed`` functions its default collectives call.
* **step time** as in ``zero.py`` (max over ranks, median over interleaved rounds) and the first-step loss.

Results go to ``bench/results/mixed_precision.json`` and the ``mixed_precision`` section of ``bench/README.md``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
from common import bench_args, interleaved_step_times, markdown_table, publish_gloo_run, ratio, step_time_table
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from zero import BATCH, CONFIG, DP, ROUNDS, SEQ, STEPS, WARMUP, Counter, _eager_step, counted_warm_up, next_token_loss

import fxpar
from fxpar.models.llama import Llama, LlamaConfig

COMMAND = ".venv/bin/python bench/mixed_precision.py"
BF16, FP32 = torch.bfloat16, torch.float32
SYSTEMS = ["fxpar zero=2 bf16", "FSDP2 (ZeRO-2 mode) bf16", "fxpar zero=3 bf16", "FSDP2 (ZeRO-3 mode) bf16"]
BASE = {"fxpar zero=2 bf16": "FSDP2 (ZeRO-2 mode) bf16", "fxpar zero=3 bf16": "FSDP2 (ZeRO-3 mode) bf16"}


class DtypeCounter(Counter):
    """``Counter`` that keys bytes by op and dtype."""

    def add(self, op: str, t: torch.Tensor) -> None:
        super().add(f"{op} {str(t.dtype).removeprefix('torch.')}", t)


def build(name: str, model: Llama, tokens: torch.Tensor) -> tuple[Any, Any, Any]:
    """(step function, optimizer, the module holding the parameters) for one system on this rank."""
    local = tokens.chunk(DP)[dist.get_rank()]
    m = copy.deepcopy(model)
    zero = 3 if "3" in name else 2
    if name.startswith("fxpar"):
        plan = fxpar.Plan(zero=zero, param_dtype=BF16, reduce_dtype=FP32)
        pm = fxpar.parallelize(m, fxpar.Mesh({"dp": DP}), (tokens,), plan=plan, loss_fn=next_token_loss,
                               example_targets=tokens)
        return (lambda: pm.step(local, local)), torch.optim.AdamW(pm.parameters(), lr=1e-3), pm
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)
    for layer in m.layers:
        fully_shard(layer, reshard_after_forward=zero == 3, mp_policy=policy)
    fully_shard(m, reshard_after_forward=zero == 3, mp_policy=policy)
    return (lambda: _eager_step(m, local)), torch.optim.AdamW(m.parameters(), lr=1e-3), m


def rank_main() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    counter = DtypeCounter()
    counter.patch_fsdp()
    runs = {name: build(name, model, tokens) for name in SYSTEMS}
    out: dict[str, Any] = {}
    for name, (step, opt, holder) in runs.items():
        row: dict[str, Any] = {"first_loss": counted_warm_up(step, opt, counter, WARMUP), "times": []}
        if name.startswith("fxpar"):
            rows = [r for r in holder.ledger(dist.get_rank()) if r.axis == "dp"]
            keys = {(r.op, str(r.dtype).removeprefix("torch.")) for r in rows}
            row["bytes"] = {f"{op} {dt}": sum(r.bytes for r in rows if (r.op, str(r.dtype).removeprefix("torch."))
                                              == (op, dt)) for op, dt in keys}
        else:
            row["bytes"] = dict(counter.bytes)
        out[name] = row
    for name, times in interleaved_step_times({n: runs[n][:2] for n in SYSTEMS}, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def report(res: dict[str, Any], elements: int) -> list[str]:
    gathers = {name: 2 if "3" in name else 1 for name in SYSTEMS}  # bf16 all-gathers per step, then one fp32 RS
    optimum = {name: 2 * elements * gathers[name] + 4 * elements for name in SYSTEMS}
    rows = []
    for name in SYSTEMS:
        sent = sum(res[name]["bytes"].values())
        ops = ", ".join(f"{op} {b:,}" for op, b in sorted(res[name]["bytes"].items()))
        rows.append([name, ops, f"{sent:,}", f"{optimum[name]:,}", ratio(sent, optimum[name])])
    return [*markdown_table(["system", "dp bytes per step by op and dtype", "total", "optimum", "total / optimum"],
                            rows), "", *step_time_table({name: res[name] for name in SYSTEMS}, BASE), ""]


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(rank_main, DP, timeout=900, collective_timeout=120)
    elements = sum(p.numel() for p in Llama(LlamaConfig(**CONFIG)).parameters())
    lines = [f"`{COMMAND}` (dp=2, 2 gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, "
             f"vocab {CONFIG['vocab_size']}; batch {BATCH} x seq {SEQ}; {elements:,} parameters; param_dtype bf16, "
             f"reduce_dtype fp32; rank 0's numbers; step time max over ranks, median of {STEPS} steps in {ROUNDS} "
             "interleaved rounds)", "", *report(results[0], elements)]
    publish_gloo_run("mixed_precision", "mixed_precision", COMMAND, lines, results, t0, not args.no_readme, CONFIG,
                     BATCH, SEQ, elements=elements)


if __name__ == "__main__":
    main()
