"""The CUDA path on one GPU: a 1-rank NCCL mesh against the single device, step time of fxpar eager and
``Plan(compile=True)`` against PyTorch eager and ``torch.compile``, and FP8 ``_scaled_mm`` against bf16 matmuls.

Run on a machine with a CUDA GPU (``--smoke`` runs tiny shapes on the CPU with gloo, to check the script)::

    python3 bench/cuda_path.py --out bench/results/cuda_path.json

1. **Equivalence** on a 1-rank NCCL mesh (``Mesh({"dp": 1}, device="cuda")``): the bundled Llama of ``zero.py``
   (4 layers, hidden 256), fp32, ``pm.step`` against the same model on the same GPU; losses, the largest gradient
   difference relative to the gradient's largest entry, and parameters after 3 AdamW steps.
2. **Step time** at larger widths (4 layers, hidden 2048, GQA 16/8 heads, vocab 32,000, batch 4 x 2,048
   tokens), bf16 parameters and compute, fused AdamW (torch's CUDA default): PyTorch eager, ``torch.compile``,
   fxpar eager, fxpar ``compile=True``, and fxpar with ``Plan(fp8="tensorwise")`` eager and compiled. CUDA-event
   timing after warm-up steps (compilation included in the warm-up), median over interleaved rounds, and the peak
   memory each system allocated.
3. **FP8 matmuls**: ``torch._scaled_mm`` on e4m3 (tensorwise scales, bf16 out) against bf16 ``mm`` at square
   shapes, TFLOP/s from CUDA events.

Results: one JSON file (``--out``), printed as tables.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import init_one_rank, run_part

import fxpar
from fxpar.models.llama import Llama, LlamaConfig

SMALL = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
         "max_seq": 64}
BIG = {"n_layers": 4, "hidden": 2048, "intermediate": 5632, "n_heads": 16, "n_kv_heads": 8, "vocab_size": 32000,
       "max_seq": 2048}
TINY = {"n_layers": 2, "hidden": 64, "intermediate": 128, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 128,
        "max_seq": 32}


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Clock:
    """Wall time of a callable on ``device``: CUDA events on a GPU, ``perf_counter`` on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            t = time.perf_counter()
            fn()
            return time.perf_counter() - t
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def equivalence(device: torch.device, cfg: dict[str, int], mesh_device: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**cfg))
    ref = copy.deepcopy(model).to(device)
    tokens = torch.randint(0, cfg["vocab_size"], (8, cfg["max_seq"]), device=device)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 1}, device=mesh_device), (tokens,), loss_fn=next_token_loss,
                           example_targets=tokens)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    steps = []
    for _ in range(3):
        opt.zero_grad()
        ref_opt.zero_grad()
        loss = pm.step(tokens, tokens)
        ref_loss = next_token_loss(ref(tokens), tokens)
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        grad_rel = max(float((local(p.grad) - ref.get_parameter(n).grad).abs().max()
                             / ref.get_parameter(n).grad.abs().max().clamp_min(1e-30))
                       for n, p in pm.named_parameters())
        opt.step()
        ref_opt.step()
        param_abs = max(float((local(p) - ref.get_parameter(n)).abs().max()) for n, p in pm.named_parameters())
        steps.append({"loss": float(loss), "ref_loss": ref_loss.item(), "max_grad_diff_rel": grad_rel,
                      "max_param_diff_abs": param_abs})
    params_on = {str(local(p).device) for p in pm.parameters()}
    return {"steps": steps, "param_devices": sorted(params_on), "program_lines": len(pm.program(0).splitlines())}


def build_systems(device: torch.device, cfg: dict[str, int], batch: int, mesh_device: str,
                  fp8: bool) -> tuple[dict[str, tuple[Callable[[], Any], Any]], torch.Tensor]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**cfg)).to(torch.bfloat16)
    tokens = torch.randint(0, cfg["vocab_size"], (batch, cfg["max_seq"]), device=device)
    systems: dict[str, tuple[Callable[[], Any], Any]] = {}

    def torch_system(compiled: bool) -> tuple[Callable[[], Any], Any]:
        m = copy.deepcopy(model).to(device)
        run = torch.compile(m) if compiled else m

        def step() -> torch.Tensor:
            loss = next_token_loss(run(tokens), tokens)
            loss.backward()
            return loss

        return step, torch.optim.AdamW(m.parameters(), lr=1e-4)

    def fxpar_system(plan: fxpar.Plan) -> tuple[Callable[[], Any], Any]:
        pm = fxpar.parallelize(copy.deepcopy(model), fxpar.Mesh({"dp": 1}, device=mesh_device), (tokens,),
                               plan=plan, loss_fn=next_token_loss, example_targets=tokens)

        def step() -> torch.Tensor:
            return pm.step(tokens, tokens)

        step.memory = pm.memory(0)  # type: ignore[attr-defined]
        return step, torch.optim.AdamW(pm.parameters(), lr=1e-4)

    systems["PyTorch eager"] = torch_system(False)
    systems["torch.compile"] = torch_system(True)
    systems["fxpar eager"] = fxpar_system(fxpar.Plan())
    systems["fxpar compile=True"] = fxpar_system(fxpar.Plan(compile=True))
    if fp8:
        systems["fxpar fp8 tensorwise eager"] = fxpar_system(fxpar.Plan(fp8="tensorwise"))
        systems["fxpar fp8 tensorwise compile=True"] = fxpar_system(fxpar.Plan(fp8="tensorwise", compile=True))
    return systems, tokens


def step_time(device: torch.device, cfg: dict[str, int], batch: int, mesh_device: str, fp8: bool,
              warmup: int = 3, steps: int = 8, rounds: int = 2) -> dict[str, Any]:
    clock = Clock(device)
    out: dict[str, Any] = {}
    systems, tokens = build_systems(device, cfg, batch, mesh_device, fp8)

    def one(step: Callable[[], Any], opt: Any) -> Callable[[], Any]:
        def run() -> Any:
            opt.zero_grad()
            loss = step()
            opt.step()
            return loss
        return run

    for name, (step, opt) in systems.items():
        try:
            base = 0
            if device.type == "cuda":
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()  # every system's parameters, earlier systems' state
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            losses = [float(one(step, opt)()) for _ in range(warmup)]
            out[name] = {"warmup_s": time.perf_counter() - t, "first_loss": losses[0], "times": []}
            if device.type == "cuda":  # the step's own peak above what was allocated before its first step
                out[name]["peak_above_params_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            predicted = getattr(step, "memory", None)
            if predicted is not None:
                out[name]["pm.memory"] = {"params": predicted.params, "grads": predicted.grads,
                                          "optimizer": predicted.optimizer, "activations": predicted.activations,
                                          "transient": predicted.transient,
                                          "peak_above_params_gib": (predicted.peak - predicted.params) / 2**30}
        except Exception as e:  # noqa: BLE001 - one system's failure is recorded, the others still run
            out[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-4000:]}
    ok = [n for n in systems if "error" not in out[n]]
    for r in range(rounds):
        for name in ok if r % 2 == 0 else ok[::-1]:
            run = one(*systems[name])
            out[name]["times"] += [clock(run) for _ in range(steps // rounds)]
    tokens_per_step = tokens.numel()
    for name in ok:
        med = statistics.median(out[name]["times"])
        out[name].update(median_ms=1e3 * med, tokens_per_s=tokens_per_step / med)
    return out


def fp8_matmuls(device: torch.device, sizes: list[int], iters: int = 30) -> dict[str, Any]:
    clock = Clock(device)
    out = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm's second operand
        one = torch.ones((), device=device)
        runs = {"bf16 mm": lambda a=a, b=b: torch.mm(a, b),
                "fp8 _scaled_mm": lambda a8=a8, b8=b8, one=one: torch._scaled_mm(a8, b8, one, one,
                                                                               out_dtype=torch.bfloat16)}
        row = {}
        for name, fn in runs.items():
            for _ in range(3):
                fn()
            t = clock(lambda fn=fn: [fn() for _ in range(iters)]) / iters
            row[name] = {"ms": 1e3 * t, "tflops": 2 * n**3 / t / 1e12}
        row["speedup"] = row["bf16 mm"]["ms"] / row["fp8 _scaled_mm"]["ms"]
        out[str(n)] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/cuda_path.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo")
    args = p.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    init_one_rank(device, 29517)
    mesh_device = device.type
    res: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0],
                           "device": torch.cuda.get_device_name(0) if not smoke else "cpu (smoke)"}

    run_part(res, "equivalence", lambda: equivalence(device, TINY if smoke else SMALL, mesh_device), args.out)
    run_part(res, "fp8_matmuls", lambda: fp8_matmuls(device, [64] if smoke else [4096, 8192]), args.out)
    run_part(res, "step_time", lambda: step_time(device, TINY if smoke else BIG, 2 if smoke else 4, mesh_device,
                                        fp8=True, warmup=2 if smoke else 3, steps=2 if smoke else 8), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
