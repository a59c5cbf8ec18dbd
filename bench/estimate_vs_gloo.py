"""Section 16: ``pm.estimate`` on ``Cluster.measure()`` against measured gloo step times, 8+ plans on 4 ranks.

    .venv/bin/python bench/estimate_vs_gloo.py

The bundled Llama (4 layers, hidden 256, vocab 512, batch 8 x 128 tokens, fp32) runs each plan on 4 gloo ranks
of this machine: 3 warm-up steps, then the median of 8 timed steps (``pm.step`` + AdamW, a barrier before
each, the time is the slowest rank's). The estimate of the same plan comes from compiling it on a fake mesh
and ``pm.estimate(Cluster.measure(ranks=4))``: this machine as 4 one-thread ranks sharing its cores see it (matmul
and copy rates of 4 workers at once, op dispatch, gloo all-reduce fits, what a blocking collective costs while the
other ranks compute, AdamW's per-tensor cost, and the fraction of those rates a reference one-layer block
achieves; ``fxpar/measure.py``, ``fxpar/calibrate.py``). Nothing in the measurement sees the plans or this
model's 4 layers. Reported: each plan's ratio, the Spearman rank correlation of estimate and measurement over the
plans, and the median absolute relative error.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from common import environment, markdown_table, publish

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.launch import run_ranks

COMMAND = ".venv/bin/python bench/estimate_vs_gloo.py"
CFG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 8, "n_kv_heads": 4, "vocab_size": 512,
       "max_seq": 128}
BATCH, SEQ, WARMUP, STEPS = 8, 128, 3, 8
TP = llama_plan()
PLANS: list[tuple[str, dict[str, int], dict[str, Any]]] = [
    ("dp=4", {"dp": 4}, {}),
    ("dp=4 ZeRO-3", {"dp": 4}, {"zero": 3}),
    ("tp=4", {"tp": 4}, {"tp": TP}),
    ("dp=2 x tp=2", {"dp": 2, "tp": 2}, {"tp": TP}),
    ("dp=2 x tp=2 SP", {"dp": 2, "tp": 2}, {"tp": TP, "sequence_parallel": True}),
    ("dp=2 x tp=2 full recompute", {"dp": 2, "tp": 2}, {"tp": TP, "recompute": "full"}),
    ("pp=2 x dp=2 1f1b", {"pp": 2, "dp": 2}, {"microbatches": 4, "schedule": "1f1b"}),
    ("pp=2 x dp=2 gpipe", {"pp": 2, "dp": 2}, {"microbatches": 4, "schedule": "gpipe"}),
    ("pp=4 1f1b", {"pp": 4}, {"microbatches": 4, "schedule": "1f1b"}),
    ("pp=2 x tp=2 SP", {"pp": 2, "tp": 2}, {"tp": TP, "sequence_parallel": True, "microbatches": 2}),
]


def tokens() -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def measure_rank(axes: dict[str, int], plan: dict[str, Any]) -> float:
    """One rank: compile, warm up, then the median of ``STEPS`` timed steps (max over ranks, via all-reduce)."""
    torch.manual_seed(0)
    x = tokens()
    mesh = fxpar.Mesh(axes)
    pm = fxpar.parallelize(Llama(LlamaConfig(**CFG)), mesh, (x,), fxpar.Plan(**plan), loss_fn=next_token_loss)
    dp = axes.get("dp", 1)
    coord = mesh.coord(dist.get_rank())[mesh.axis_index("dp")] if "dp" in axes else 0
    local = x.chunk(dp)[coord]
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-4)
    times = []
    for i in range(WARMUP + STEPS):
        dist.barrier()
        t0 = time.perf_counter()
        pm.step(local, local)
        opt.step()
        opt.zero_grad()
        took = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= WARMUP:
            times.append(float(took))
    return statistics.median(times)


def estimate(axes: dict[str, int], plan: dict[str, Any], cluster: fxpar.Cluster) -> fxpar.ParallelModule:
    pm = fxpar.parallelize(Llama(LlamaConfig(**CFG)), fxpar.Mesh(axes, fake=True), (tokens(),), fxpar.Plan(**plan),
                           loss_fn=next_token_loss)
    return pm.estimate(cluster)


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for r, i in enumerate(order):
            out[i] = float(r)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def main() -> None:
    t_start = time.perf_counter()
    os.environ.setdefault("FXPAR_REMEASURE", "1")  # this run's machine, not a measurement kept from another day
    cluster = fxpar.Cluster.measure(ranks=4)
    rows, measured, predicted, data = [], [], [], []
    for name, axes, plan in PLANS:
        est = estimate(axes, plan, cluster)
        step = max(run_ranks(measure_rank, 4, axes, plan, timeout=600))
        measured.append(step)
        predicted.append(est.step_time)
        ratio = est.step_time / step
        rows.append([name, f"{step * 1e3:.1f}", f"{est.step_time * 1e3:.1f}", f"{ratio:.2f}"])
        data.append({"plan": name, "mesh": axes, "measured_s": step, "estimate_s": est.step_time,
                     "breakdown": est.breakdown})
        print(f"{name}: measured {step * 1e3:.1f} ms, estimated {est.step_time * 1e3:.1f} ms", flush=True)
    rho = spearman(predicted, measured)
    errors = sorted(abs(p / m - 1) for p, m in zip(predicted, measured, strict=True))
    median_error = statistics.median(errors)
    lines = [f"`{COMMAND}` (4 gloo ranks on {environment()['cpus']} cores; Llama {CFG['n_layers']} layers, hidden "
             f"{CFG['hidden']}, batch {BATCH} x {SEQ}; fp32; median of {STEPS} steps after {WARMUP})", "",
             *markdown_table(["plan", "measured step ms", "estimated ms", "estimate / measured"], rows), "",
             f"Spearman rank correlation {rho:.2f}; median absolute error {median_error:.0%}. Cluster: {cluster}; "
             f"op dispatch {cluster.op_overhead * 1e6:.1f} us."]
    data = {"env": environment(), "command": COMMAND, "cluster": str(cluster), "plans": data, "spearman": rho,
            "median_error": median_error, "wall_s": time.perf_counter() - t_start}
    publish("estimate_vs_gloo", "estimate_vs_gloo", lines, data, readme="--no-readme" not in sys.argv)


if __name__ == "__main__":
    main()
