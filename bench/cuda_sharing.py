"""Shared block captures (issue 19) on the CUDA path: sharing on == sharing off where SDPA becomes CUDA's kernels.

Run on a machine with a CUDA GPU (``--smoke`` runs the same checks on the CPU, to check the script)::

    python3 bench/cuda_sharing.py --out bench/results/cuda_sharing.json

On a CUDA mesh a model's attention traces to CUDA's own SDPA kernels (memory-efficient in fp32, flash in bf16),
which return RNG bookkeeping the CPU kernel does not; the CPU suite never traces them. This checks that tracing a
repeated block once and stitching it is still invisible there:

1. **Process replay on fake CUDA meshes**: HF families at 4 layers (the default ``FXPAR_SHARE_MIN``) compiled on
   ``Mesh(..., device="cuda", fake=True)`` in fresh processes with ``FXPAR_SHARING=1`` and ``0``; the first and
   last rank's printed program, ledger and ``pm.memory`` must be the same text. Meshes: ``dp=2``; ``dp=2 x tp=2``
   with the family's HF tp plan, SP and ZeRO-3; the same in bf16 (``param_dtype=bf16``, ZeRO-1: flash attention);
   ``pp=2 x dp=2`` with 2 stages.
2. **Equivalence on a real 1-rank NCCL mesh**: fp32, ``pm(x)`` + ``loss.backward()`` and 3 AdamW steps against
   the same model on the same GPU, sharing on; and sharing on against sharing off, bitwise, in fp32 and in bf16.

Results: one JSON file (``--out``), printed as it goes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import copy
import difflib
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import init_one_rank, run_part

import fxpar
from fxpar.models import hf_families

FAMILIES = ["llama", "qwen2", "mistral", "gemma3", "qwen3", "phi3", "qwen2_moe", "mixtral", "bart"]
MESHES = {"dp": {"dp": 2}, "tp_sp_z3": {"dp": 2, "tp": 2}, "tp_sp_bf16": {"dp": 2, "tp": 2}, "pp": {"pp": 2, "dp": 2}}
EQUIVALENCE = ["llama", "gemma3", "qwen2_moe"]
LAYERS = 4


def causal_lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets[:, 1:].reshape(-1))


def build(family: str, layers: int = LAYERS) -> torch.nn.Module:
    hf_families.LAYERS = layers  # read by the builders' configs
    return hf_families.builder(family)()


def plan_for(mesh: str) -> fxpar.Plan | None:
    return {"dp": None,
            "tp_sp_z3": fxpar.Plan(tp="hf", sequence_parallel=True, zero=3),
            "tp_sp_bf16": fxpar.Plan(tp="hf", sequence_parallel=True, zero=1, param_dtype=torch.bfloat16,
                                     reduce_dtype=torch.float32),
            "pp": fxpar.Plan(stages=2, microbatches=2)}[mesh]


def compile_texts(family: str, mesh: str, device: str) -> dict[str, Any]:
    """One process's texts (run in a child with ``FXPAR_SHARING`` set)."""
    import warnings
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model, inputs = build(family), hf_families.inputs(family)
    targets = inputs["input_ids"] if isinstance(inputs, dict) else inputs[0]
    kw: dict[str, Any] = {"loss_fn": causal_lm_loss, "example_targets": targets} if mesh == "pp" else {}
    t = time.perf_counter()
    pm = fxpar.parallelize(model, fxpar.Mesh(MESHES[mesh], device=device, fake=True), inputs, plan=plan_for(mesh), **kw)
    n = pm._compiled.mesh.size
    texts = {f"rank {r}": "\n".join([pm.program(rank=r), pm.ledger_table(r), str(pm.memory(rank=r))])
             for r in (0, n - 1)}
    attention = sorted({w.rstrip(",)") for text in texts.values() for w in text.replace("(", " ").split()
                        if w.startswith("aten._scaled_dot_product")})
    captures = pm.captures
    return {"texts": texts, "captures": repr(captures), "attention_ops": attention,
            "compile_s": time.perf_counter() - t}


def child(spec: str) -> None:
    family, mesh, device = json.loads(spec)
    try:
        print(json.dumps(compile_texts(family, mesh, device)))
    except Exception as e:  # noqa: BLE001 - reported to the parent, which compares on and off
        print(json.dumps({"error": f"{type(e).__name__}: {e}"[:1500], "trace": traceback.format_exc()[-3000:]}))


def run_child(family: str, mesh: str, device: str, sharing: str) -> dict[str, Any]:
    env = {**os.environ, "FXPAR_SHARING": sharing, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, __file__, "--child", json.dumps([family, mesh, device])], capture_output=True,
                       text=True, env=env, timeout=600)
    last = r.stdout.strip().splitlines()[-1:] or ['{"error": "no output"}']
    try:
        return json.loads(last[0])
    except json.JSONDecodeError:
        return {"error": f"rc {r.returncode}: {r.stderr[-1500:]}"}


def replay_case(family: str, mesh: str, device: str) -> dict[str, Any]:
    on, off = run_child(family, mesh, device, "1"), run_child(family, mesh, device, "0")
    if "error" in on or "error" in off:
        same_error = on.get("error") == off.get("error")
        return {"status": "both fail (same error)" if same_error else "FAIL", "on": on.get("error"),
                "off": off.get("error"), "trace": on.get("trace") or off.get("trace")}
    out = {"status": "identical" if on["texts"] == off["texts"] else "DIFFER", "captures_on": on["captures"],
           "captures_off": off["captures"], "attention_ops": on["attention_ops"],
           "compile_s": {"on": round(on["compile_s"], 2), "off": round(off["compile_s"], 2)}}
    if out["status"] == "DIFFER":
        rank = next(r for r in on["texts"] if on["texts"][r] != off["texts"][r])
        diff = difflib.unified_diff(off["texts"][rank].splitlines(), on["texts"][rank].splitlines(), "sharing off",
                                    "sharing on", lineterm="")
        out["diff"] = "\n".join(list(diff)[:120])
    return out


def process_replay(device: str, families: list[str], workers: int) -> dict[str, Any]:
    cases = [(f, m) for f in families for m in MESHES]
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {c: pool.submit(replay_case, *c, device) for c in cases}
        results = {f"{f} {m}": futures[(f, m)].result() for f, m in cases}
    counts: dict[str, int] = {}
    for r in results.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return {"counts": counts, "cases": results}


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def train(model: torch.nn.Module, inputs: Any, targets: torch.Tensor, steps: int, fx: bool, device: torch.device,
          plan: fxpar.Plan | None = None) -> list[dict[str, Any]]:
    """Losses, gradients and parameters of ``steps`` AdamW steps, on one GPU or a 1-rank NCCL mesh (the first
    step's entry also says how the program was captured)."""
    captures = None
    if fx:
        model = fxpar.parallelize(model, fxpar.Mesh({"dp": 1}, device=device.type), inputs, plan=plan)
        captures = repr(model.captures)
    else:
        model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(
        x.to(device) for x in inputs)
    targets = targets.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        y = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        loss = causal_lm_loss(y, targets)
        loss.backward()
        grads = {n: local(p.grad).detach().clone() for n, p in model.named_parameters()}
        opt.step()
        out.append({"loss": loss.detach().clone(), "grads": grads,
                    "params": {n: local(p).detach().clone() for n, p in model.named_parameters()}})
    out[0]["captures"] = captures
    return out


def compare(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[dict[str, float]]:
    rows = []
    for sa, sb in zip(a, b, strict=True):
        grad_rel = max(float((sa["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                       for n, g in sb["grads"].items())
        param_abs = max(float((sa["params"][n] - p).abs().max()) for n, p in sb["params"].items())
        rows.append({"loss": float(sa["loss"]), "ref_loss": float(sb["loss"]), "max_grad_diff_rel": grad_rel,
                     "max_param_diff_abs": param_abs})
    rows[0].update(captures=a[0]["captures"], ref_captures=b[0]["captures"])
    return rows


def equivalence(device: torch.device, families: list[str]) -> dict[str, Any]:
    out = {}
    for family in families:
        torch.manual_seed(0)
        model, inputs = build(family), hf_families.inputs(family)
        targets = inputs["input_ids"] if isinstance(inputs, dict) else inputs[0]
        ref = train(copy.deepcopy(model), inputs, targets, 3, False, device)
        os.environ["FXPAR_SHARING"] = "1"
        on = train(copy.deepcopy(model), inputs, targets, 3, True, device)
        os.environ["FXPAR_SHARING"] = "0"
        off = train(copy.deepcopy(model), inputs, targets, 3, True, device)
        bf16 = fxpar.Plan(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        bf16_off = train(copy.deepcopy(model), inputs, targets, 3, True, device, bf16)
        os.environ["FXPAR_SHARING"] = "1"
        bf16_on = train(copy.deepcopy(model), inputs, targets, 3, True, device, bf16)
        out[family] = {"on_vs_single_device": compare(on, ref), "on_vs_off_fp32": compare(on, off),
                       "on_vs_off_bf16": compare(bf16_on, bf16_off)}
        print(f"{family}: {json.dumps(out[family])}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/cuda_sharing.json")
    p.add_argument("--smoke", action="store_true", help="the same checks on the CPU with gloo, fewer families")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--families", nargs="*", help=f"default: {' '.join(FAMILIES)}")
    p.add_argument("--equivalence", nargs="*", help=f"families checked on the 1-rank mesh (default: "
                   f"{' '.join(EQUIVALENCE)})")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child)
    smoke = args.smoke or not torch.cuda.is_available()
    device = torch.device("cpu") if smoke else torch.device("cuda", 0)
    families = args.families or (FAMILIES[:2] if smoke else FAMILIES)
    checked = args.equivalence or (EQUIVALENCE[:1] if smoke else EQUIVALENCE)
    res: dict[str, Any] = {"torch": torch.__version__,
                           "device": "cpu (smoke)" if smoke else torch.cuda.get_device_name(0)}

    run_part(res, "process_replay", lambda: process_replay(device.type, families, args.workers), args.out, shown=8000)
    init_one_rank(device, 29519)
    run_part(res, "equivalence", lambda: equivalence(device, checked), args.out, shown=8000)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
