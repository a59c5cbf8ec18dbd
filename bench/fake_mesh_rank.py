"""One rank of a large mesh on one GPU: rank 37 of ``dp=8 x tp=8`` at Llama-2-70B widths, eager against
``Plan(compile=True)`` (bf16 and FP8), and ``pm.memory`` against the storage the step really allocates.

Run on a machine with a CUDA GPU (``--smoke`` runs tiny shapes on the CPU, to check the script)::

    python3 bench/fake_mesh_rank.py --out bench/results/fake_mesh_rank.json

The process joins torch's fake process group (``torch.testing._internal.distributed.fake_pg``) as rank 37 of 64,
so ``fxpar.Mesh({"dp": 8, "tp": 8}, device="cuda")`` is a real 64-rank mesh to fxpar: it compiles, lowers and
runs rank 37's own program, with its real local shapes (a tp shard of every layer, one sequence of the global
batch, the sequence-parallel stretches an eighth long). Its collectives are issued to the fake group, which
completes them at once without moving a byte: the step time is the rank's compute and fxpar's own work, with
the network free, and the values are not meaningful (a gathered tensor is whatever memory held; losses are
reported, not checked). Equivalence is the CPU suite's job and ``cuda_path.py``'s on a real 1-rank NCCL mesh.

1. **Step time**: the bundled Llama at Llama-2-70B widths (hidden 8192, MLP 28,672, 64 query and 8 kv heads,
   vocab 32,000), 4 layers, global batch 8 x 4,096 tokens; ``Plan(tp=Megatron, sequence_parallel=True,
   zero=1, param_dtype=bf16, reduce_dtype=fp32)`` with ``compile`` off and on, and with ``fp8="tensorwise"``.
   fp32 master weights, fused AdamW. CUDA-event timing after warm-up steps (compilation included in the
   warm-up), median over interleaved rounds.
2. **Memory**: ``pm.memory(37)`` against (a) the storage held after ``opt.step()`` (parameters, gradients,
   optimizer state: ``memory_allocated`` above what was allocated before the system was built) and (b) the
   step's peak allocation above the same base. The loss runs outside the rank program on the logits (here
   1 x 4,096 x 32,000, with their fp32 copy and gradients), which ``pm.memory`` does not count: the JSON gives
   that analytic size beside the gap.

Results: one JSON file (``--out``), printed as it goes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from cuda_path import Clock, next_token_loss
from torch.testing._internal.distributed.fake_pg import FakeStore

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, llama_plan

LLAMA2_70B_4L = {"n_layers": 4, "hidden": 8192, "intermediate": 28672, "n_heads": 64, "n_kv_heads": 8,
                 "vocab_size": 32000, "max_seq": 4096}
TINY = {"n_layers": 2, "hidden": 64, "intermediate": 128, "n_heads": 8, "n_kv_heads": 8, "vocab_size": 128,
        "max_seq": 32}
MESH = {"dp": 8, "tp": 8}
RANK = 37


def systems_to_build(smoke: bool) -> dict[str, fxpar.Plan]:
    base = {"tp": llama_plan(), "sequence_parallel": True, "zero": 1, "param_dtype": torch.bfloat16,
            "reduce_dtype": torch.float32}
    out = {"fxpar eager": fxpar.Plan(**base), "fxpar compile=True": fxpar.Plan(**base, compile=True)}
    if not smoke:  # _scaled_mm needs a GPU with FP8 (sm_89 and later)
        out["fxpar fp8 tensorwise eager"] = fxpar.Plan(**base, fp8="tensorwise")
        out["fxpar fp8 tensorwise compile=True"] = fxpar.Plan(**base, fp8="tensorwise", compile=True)
    return out


def allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def memory_fields(m: Any) -> dict[str, int]:
    return {k: getattr(m, k) for k in ("params", "grads", "optimizer", "activations", "transient", "peak")}


class System:
    """One parallelized copy of the model on this rank, its optimizer and what was measured of it."""

    def __init__(self, model: torch.nn.Module, mesh: fxpar.Mesh, plan: fxpar.Plan, tokens: torch.Tensor,
                 device: torch.device) -> None:
        self.device = device
        self.base = allocated(device)
        t = time.perf_counter()
        self.pm = fxpar.parallelize(model, mesh, (tokens[:, :-1],), plan=plan, loss_fn=next_token_loss,
                                    example_targets=tokens[:, 1:])
        self.compile_s = time.perf_counter() - t
        self.opt = torch.optim.AdamW(self.pm.parameters(), lr=1e-5)
        coord = mesh.coord(RANK)[mesh.axis_index("dp")]
        per_dp = tokens.shape[0] // mesh.shape[mesh.axis_index("dp")]
        local = tokens[coord * per_dp:(coord + 1) * per_dp].to(device)
        self.x, self.y = local[:, :-1], local[:, 1:]
        self.stats: dict[str, Any] = {"compile_s": self.compile_s, "pm.memory": memory_fields(self.pm.memory(RANK)),
                                      "program_lines": len(self.pm.program(RANK).splitlines()), "times": []}

    def step(self) -> torch.Tensor:
        self.opt.zero_grad()
        loss = self.pm.step(self.x, self.y)
        self.opt.step()
        return loss

    def warm_up(self, steps: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        losses = [float(self.step()) for _ in range(steps)]
        self.stats.update(warmup_s=time.perf_counter() - t, losses=losses)
        if self.device.type == "cuda":
            self.stats["measured"] = {"resident_after_opt_step": allocated(self.device) - self.base,
                                      "peak": torch.cuda.max_memory_allocated() - self.base}


def loss_bytes(cfg: dict[str, int], batch: int) -> int:
    """What the loss adds outside the rank program on this rank: bf16 logits' fp32 copy, its log-softmax and the
    gradient of each (the logits themselves are the program's output, which ``pm.memory`` counts)."""
    n = batch * (cfg["max_seq"]) * cfg["vocab_size"]
    return n * (4 + 4 + 4 + 2)


def step_time(device: torch.device, cfg: dict[str, int], smoke: bool, warmup: int, steps: int,
              rounds: int) -> dict[str, Any]:
    torch.manual_seed(0)
    t = time.perf_counter()
    model = Llama(LlamaConfig(**cfg))
    out: dict[str, Any] = {"model_init_s": time.perf_counter() - t,
                           "params_total": sum(p.numel() for p in model.parameters()),
                           "loss_outside_program_bytes": loss_bytes(cfg, 1)}
    tokens = torch.randint(0, cfg["vocab_size"], (8, cfg["max_seq"] + 1))
    mesh = fxpar.Mesh(MESH, device=device.type)
    systems: dict[str, System] = {}
    for name, plan in systems_to_build(smoke).items():
        try:
            systems[name] = System(model, mesh, plan, tokens, device)
            systems[name].warm_up(warmup)
            out[name] = systems[name].stats
        except Exception as e:  # noqa: BLE001 - one system's failure is recorded, the others still run
            systems.pop(name, None)
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-4000:]}
        print(f"built {name}: {json.dumps(out[name], default=str)[:1500]}", flush=True)
    clock = Clock(device)
    for r in range(rounds):
        for name in list(systems) if r % 2 == 0 else list(systems)[::-1]:
            systems[name].stats["times"] += [clock(systems[name].step) for _ in range(steps // rounds)]
    for s in systems.values():
        s.stats["median_ms"] = 1e3 * statistics.median(s.stats["times"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/fake_mesh_rank.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    if not smoke:
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=MESH["dp"] * MESH["tp"])
    res: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                           "device": torch.cuda.get_device_name(0) if not smoke else "cpu (smoke)",
                           "mesh": MESH, "rank": RANK}
    t = time.perf_counter()
    try:
        res["step_time"] = step_time(device, TINY if smoke else LLAMA2_70B_4L, smoke, warmup=2 if smoke else 3,
                                     steps=2 if smoke else 8, rounds=2)
    except Exception as e:  # noqa: BLE001 - recorded in the JSON
        res["step_time"] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-4000:]}
    res["wall_s"] = time.perf_counter() - t
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1, default=str)[:8000], flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
