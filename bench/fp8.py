"""FP8 accuracy: SNR against fp32 of fxpar's float8 matmuls, and tensor-parallel FP8 against single-device FP8.

One command, two launches of 2 gloo ranks, a few seconds::

    .venv/bin/python bench/fp8.py

The bundled Llama MLP (hidden 64, intermediate 128, SwiGLU; seed 0) on a batch of 4 x 16 tokens, loss
``mean(out ** 2)``. For each recipe: the SNR (dB, torchao's ``compute_error``) of a cast (e4m3 and e5m2), of
the output and of each weight gradient against fp32, with torchao's thresholds (25, 18, 17 dB); and of
fxpar FP8 at tp=2 (gate/up colwise, down rowwise: every scale needs a max over shards) against fxpar FP8 at
dp=2 fed the same sample on both ranks (each rank runs the unsharded FP8 program), threshold 40 dB. CPU
``torch._scaled_mm``; no speed claim (no GPU was lent to this task). With ``zero=3`` the forward parameter
all-gathers move float8 (a quarter of fp32's bytes) plus the weights' scales (compile-only ledger counts).

Results go to ``bench/results/fp8.json`` and the ``fp8`` section of ``bench/README.md``.
"""

from __future__ import annotations

import time

import torch
from common import bench_args, environment, markdown_table, publish
from fxpar.passes.fp8 import E4M3, E5M2, quantize

import fxpar
from fxpar.models.llama import MLP, LlamaConfig
from fxpar.testing import default_pool
from fxpar.testing.probes import fp8_step

CONFIG = LlamaConfig(hidden=64, intermediate=128)
PLAN = {"gate": "colwise", "up": "colwise", "down": "rowwise"}
COMMAND = ".venv/bin/python bench/fp8.py"


def snr(ref: torch.Tensor, got: torch.Tensor) -> float:
    return float(20 * torch.log10(ref.norm() / (ref - got).norm()))


def zero3_gather_bytes(recipe: str) -> dict[str, int]:
    """Forward ZeRO-3 parameter traffic on dp=2 (rank 0's ledger, compile only): the fp32 gathers without fp8,
    and with fp8 the float8 gathers plus the scale traffic (max all-reduces of weight amaxes, gathered row
    scales). Activation amax all-reduces (one scalar or one vector per cast, fp8 with or without ZeRO) are
    counted apart."""
    x = torch.randn(4, 16, 64)
    mesh = fxpar.Mesh({"dp": 2}, fake=True)
    fp32 = fxpar.parallelize(MLP(CONFIG), mesh, (x,), plan=fxpar.Plan(zero=3)).ledger(0)
    f8 = fxpar.parallelize(MLP(CONFIG), mesh, (x,), plan=fxpar.Plan(zero=3, fp8=recipe)).ledger(0)
    no_zero = fxpar.parallelize(MLP(CONFIG), mesh, (x,), plan=fxpar.Plan(fp8=recipe)).ledger(0)

    def fwd(rows: list, op: str, dtype: torch.dtype | None = None) -> int:
        return sum(r.bytes for r in rows if r.phase == "fwd" and r.op == op and dtype in (None, r.dtype))
    activation_scales = fwd(no_zero, "all_reduce_max")
    return {"fp32_gather": fwd(fp32, "all_gather"), "float8_gather": fwd(f8, "all_gather", E4M3),
            "scales": fwd(f8, "all_gather", torch.float32) + fwd(f8, "all_reduce_max") - activation_scales}


def main() -> None:
    args = bench_args(__doc__)
    t0 = time.perf_counter()
    x = torch.randn(4, 16, 64, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = MLP(CONFIG)
    out = model(x)
    out.pow(2).mean().backward()
    pool = default_pool()
    rows, data = [], {}
    for recipe in ("tensorwise", "rowwise"):
        dims = [1] if recipe == "rowwise" else [0, 1]
        casts = {str(d).split(".")[-1]: snr(x, quantize(x, d, dims)[0].float() * quantize(x, d, dims)[1])
                 for d in (E4M3, E5M2)}
        tp = pool.run(fp8_step, 2, CONFIG, {"tp": 2}, fxpar.Plan(tp=PLAN, fp8=recipe), x, timeout=300)[0]
        same = torch.cat([x[:2], x[:2]])
        dp = pool.run(fp8_step, 2, CONFIG, {"dp": 2}, fxpar.Plan(fp8=recipe), same, timeout=300)[0]
        tp2 = pool.run(fp8_step, 2, CONFIG, {"tp": 2}, fxpar.Plan(tp=PLAN, fp8=recipe), x[:2], timeout=300)[0]
        grads = {n: snr(p.grad, tp["grads"][n]) for n, p in model.named_parameters()}
        tp_vs_dp = min([snr(dp["output"][:2], tp2["output"])] + [snr(dp["grads"][n], tp2["grads"][n])
                                                                 for n in dp["grads"]])
        gathered = zero3_gather_bytes(recipe)
        data[recipe] = {"casts": casts, "output": snr(out.detach(), tp["output"]), "grads": grads,
                        "tp_vs_dp_min": tp_vs_dp, "zero3_forward_bytes": gathered}
        rows.append([recipe, " / ".join(f"{v:.1f}" for v in casts.values()), f"{data[recipe]['output']:.1f}",
                     " / ".join(f"{v:.1f}" for v in grads.values()), f"{tp_vs_dp:.1f}",
                     f"{gathered['fp32_gather']} / {gathered['float8_gather']} + {gathered['scales']}"])
    pool.close()
    lines = [f"`{COMMAND}` (Llama MLP 64 -> 128 -> 64, batch 4 x 16; SNR in dB against fp32; fifth column the "
             "minimum over the output and every gradient of fxpar FP8 at tp=2 vs at dp=2 on the same sample; sixth, "
             "last, rank 0's forward ZeRO-3 parameter traffic on dp=2: fp32 gathers without fp8, then float8 "
             "gathers + scale bytes with fp8)", "",
             *markdown_table(["recipe", "cast e4m3 / e5m2 (>= 25)", "output (>= 18)",
                              "weight grads gate / up / down (>= 17)", "tp=2 vs single-device FP8 (>= 40)",
                              "zero=3 gather B: fp32 / float8 + scales"], rows), ""]
    env = {**environment(), "backend": "gloo", "wall_s": time.perf_counter() - t0}
    path = publish("fp8", "fp8", lines, {"env": env, "command": COMMAND, "results": data}, not args.no_readme)
    print(f"wrote {path} ({env['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
