"""Section 15: published training runs, their layouts compiled and estimated by fxpar, and what the search picks.

    .venv/bin/python bench/planner.py            # all three runs (about 5 minutes on 2 cores)
    .venv/bin/python bench/planner.py --quick    # the 8,192-GPU Llama run only

For each run: the published layout as an ``fxpar.Plan`` is compiled on a fake mesh of the run's size and costed
by ``pm.estimate`` on the matching preset (``fxpar.Cluster.preset``); the published step time is the run's model
FLOPs over its GPUs times its published TFLOP/s per GPU. Then ``fxpar.search`` runs on the same model, batch and
cluster with nothing fixed (timed: profile, closed forms, two or more full-scale confirmations).

Models are the bundled Llama (``fxpar.models.llama``, causal SDPA, so no mask tensor is traced) at the runs'
widths, on the meta device:

* **Llama 3 405B** (Llama 3 paper, Table 4): 126 layers, hidden 16384, intermediate 53248, 128 heads, 8 kv
  heads, vocab 128256, sequence 8192, 2048 sequences per step, bf16 on H100: TP 8, PP 16, DP 128 at 400
  TFLOP/s per GPU on 16,384 GPUs; DP 64 at 430 on 8,192. fxpar layout: Megatron tp (found by ``plan="auto"``'s
  tp search too) plus a colwise ``lm_head``, sequence parallel, ZeRO-1, interleaved 1F1B with 4 stages per
  rank, one sequence per microbatch, ``compile=True`` (costed as Inductor fuses pointwise chains, as Megatron's
  fused kernels do).
* **Megatron-LM 1T** (Narayanan et al. 2021, Table 1): GPT, 128 layers, hidden 25600, 160 heads, vocab 51200,
  sequence 2048, batch 3072 on 3,072 A100: TP 8, PP 64, DP 6 at 163 TFLOP/s per GPU counted with the paper's
  ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` (recompute included). fxpar layout: GELU MLP, LayerNorm, Megatron
  tp, full recompute, interleaved 1F1B with 2 stages per rank, one sequence per microbatch, ``compile=True``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from common import environment, markdown_table, publish

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.testing.error_models import next_token_loss

COMMAND = ".venv/bin/python bench/planner.py"
GELU_MLP_PLAN = {glob: style for glob, style in llama_plan().items() if "gate" not in glob}  # GPT's MLP: up, down


@dataclass(frozen=True)
class Run:
    name: str
    preset: str
    config: dict[str, Any]
    seq: int
    batch: int
    mesh: dict[str, int]
    plan: dict[str, Any]
    published_tflops: float  # per GPU, as the paper reports it
    paper_flops: float | None = None  # FLOPs per step by the paper's own count (None: fxpar's model FLOPs)


def llama405(gpus: int, tflops: float) -> Run:
    dp = gpus // 128
    return Run(f"Llama 3 405B, {gpus:,} H100", "h100-sxm",
               {"vocab_size": 128256, "hidden": 16384, "intermediate": 53248, "n_layers": 126, "n_heads": 128,
                "n_kv_heads": 8, "max_seq": 8192, "rope_theta": 500000.0},
               8192, 2048, {"pp": 16, "dp": dp, "tp": 8},
               {"tp": {**llama_plan(), "lm_head": "colwise"}, "sequence_parallel": True, "zero": 1,
                "stages": 64, "schedule": "interleaved-1f1b", "microbatches": 2048 // dp,
                "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "compile": True}, tflops)


def megatron_1t() -> Run:
    b, s, layers, h, v = 3072, 2048, 128, 25600, 51200
    paper = 96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    return Run("Megatron-LM GPT 1T, 3,072 A100", "a100-80g",
               {"vocab_size": v, "hidden": h, "intermediate": 4 * h, "n_layers": layers, "n_heads": 160,
                "n_kv_heads": 160, "max_seq": s, "norm": "layer", "mlp": "gelu", "bias": True},
               s, b, {"pp": 64, "dp": 6, "tp": 8},
               {"tp": {**GELU_MLP_PLAN, "lm_head": "colwise"}, "recompute": "full", "stages": 128,
                "schedule": "interleaved-1f1b", "microbatches": 512, "param_dtype": torch.bfloat16,
                "reduce_dtype": torch.float32, "compile": True}, 163.0, paper)


def build(run: Run) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    with torch.device("meta"):
        model = Llama(LlamaConfig(**run.config))
    return model, (torch.randint(0, run.config["vocab_size"], (run.batch, run.seq)),)


def published_layout(run: Run) -> dict[str, Any]:
    model, args = build(run)
    gpus = 1
    for size in run.mesh.values():
        gpus *= size
    cluster = fxpar.Cluster.preset(run.preset, gpus=gpus)
    t = time.perf_counter()
    pm = fxpar.parallelize(model, fxpar.Mesh(run.mesh, fake=True), args, fxpar.Plan(**run.plan),
                           loss_fn=next_token_loss)
    compiled_s = time.perf_counter() - t
    est = pm.estimate(cluster)
    flops = run.paper_flops or est.model_flops
    published_step = flops / (gpus * run.published_tflops * 1e12)
    return {"gpus": gpus, "compile_s": compiled_s, "estimate": str(est), "step_s": est.step_time,
            "published_step_s": published_step, "ratio": est.step_time / published_step, "mfu": est.mfu,
            "published_mfu": run.published_tflops * 1e12 / cluster.peak_flops[torch.bfloat16],
            "peak_memory_gib": est.peak_memory / 2**30, "fits": est.fits, "breakdown": est.breakdown}


def searched(run: Run, gpus: int) -> dict[str, Any]:
    model, args = build(run)
    cluster = fxpar.Cluster.preset(run.preset, gpus=gpus)
    t = time.perf_counter()
    cands = fxpar.search(model, args, cluster, loss_fn=next_token_loss, top=5)
    took = time.perf_counter() - t
    best = cands[0]
    return {"search_s": took, "mesh": best.mesh, "plan": str(best.plan).splitlines()[0],
            "step_s": best.step_time, "confirmed": best.confirmed, "fits": getattr(best.estimate, "fits", True),
            "explain": best.explain()}


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for name, r in results.items():
        p, s = r["published"], r["search"]
        same = s["mesh"] == r["mesh"]
        vs = s["step_s"] / p["step_s"]
        pick = (f"{'the published mesh' if same else s['mesh']}, {s['step_s']:.2f} s "
                f"({'compiled' if s['confirmed'] else 'closed form'}; {vs:.2f}x the published layout's estimate, "
                f"{'fits' if s['fits'] else 'over HBM'})")
        rows.append([name, f"{p['published_step_s']:.2f} s ({p['published_mfu']:.0%} MFU)",
                     f"{p['step_s']:.2f} s", f"{p['ratio']:.2f}", f"{p['mfu']:.0%}",
                     f"{p['peak_memory_gib']:.0f} GiB{'' if p['fits'] else ' (over HBM)'}", pick,
                     f"{s['search_s']:.0f} s"])
    header = ["run", "published step", "fxpar estimate of the published layout", "estimate / published",
              "estimated MFU", "estimated peak memory per rank", "fxpar.search's pick", "search time"]
    return [f"`{COMMAND}` (2 cores; fake meshes; presets from NVIDIA datasheets)", "",
            *markdown_table(header, rows)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 8,192-GPU Llama run only")
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    args = parser.parse_args()
    runs = [llama405(8192, 430.0)] if args.quick else [llama405(16384, 400.0), llama405(8192, 430.0), megatron_1t()]
    results = {}
    for run in runs:
        published = published_layout(run)
        print(f"{run.name}: {published['estimate']}", flush=True)
        results[run.name] = {"published": published, "search": searched(run, published["gpus"]), "mesh": run.mesh}
        print(results[run.name]["search"]["explain"], flush=True)
    publish("planner", "planner", table(results), {"env": environment(), "command": COMMAND, "runs": results},
            readme=not args.no_readme and not args.quick)


if __name__ == "__main__":
    sys.exit(main())
