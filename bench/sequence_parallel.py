"""fxpar tensor + sequence parallelism vs DTensor's ``SequenceParallel`` on real gloo ranks (tp=2).

One command, one launch of 2 gloo ranks, about a minute on 2 cores::

    .venv/bin/python bench/sequence_parallel.py

Same model (the bundled Llama, seed 0), same batch, next-token cross-entropy, fp32 AdamW. Four systems:
fxpar ``Plan(tp=llama_plan())`` and the same with ``sequence_parallel=True``; DTensor Megatron TP
(``ColwiseParallel``/``RowwiseParallel`` on q, k, v, gate, up / o, down) and the same plus Megatron SP
the torchtitan way (``SequenceParallel`` on the norms, ``PrepareModuleInput`` gathering the sequence
before attention and MLP, ``RowwiseParallel(output_layouts=Shard(1))`` on o and down, the embedding's
output sliced to ``Shard(1)`` and gathered before ``lm_head``). Embedding and ``lm_head`` stay replicated
in all four. Per system and rank:

* **tp bytes per step** by op, in the ledger's definition (the full tensor a collective reduces or
  produces): fxpar's from its ledger, DTensor's counted by ``CommDebugMode`` (``dtensor_baseline``),
  next to the Megatron per-layer optimum (without SP: 4 all-reduces of ``b*s*h`` per layer; with SP:
  4 all-gathers + 4 reduce-scatters of ``b*s*h`` per layer, plus the norm weights' gradients).
* **saved activations per rank**: fxpar's ``fxpar.memory.saved_per_microbatch`` (the tests check it equals
  the storage a real forward saves); DTensor's measured with ``saved_tensors_hooks`` (distinct local
  storages the autograd graph saves, parameters excluded).
* **step time**: ``zero_grad`` + forward + backward + ``opt.step``, max over ranks, median over
  ``STEPS`` steps in interleaved rounds; each system's first-step loss.

Results go to ``bench/results/sequence_parallel.json`` and the ``sp`` section of ``bench/README.md``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import bench_args, interleaved_step_times, markdown_table, publish_gloo_run, step_time_table
from dtensor_baseline import count_collectives, dtensor_megatron
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fxpar
from fxpar.memory import saved_per_microbatch
from fxpar.models.llama import Llama, LlamaConfig, llama_plan

CONFIG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
          "max_seq": 64}
BATCH, SEQ, TP = 8, 64, 2
WARMUP, STEPS, ROUNDS = 2, 12, 4
COMMAND = ".venv/bin/python bench/sequence_parallel.py"
SYSTEMS = ["fxpar tp", "DTensor tp", "fxpar tp+SP", "DTensor tp+SP"]


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def dtensor_sequence_parallel(model: Llama, mesh: Any) -> Llama:
    """Megatron TP + SP on the bundled Llama with ``parallelize_module`` (torchtitan's recipe, replicated
    embedding and ``lm_head``)."""
    plan: dict[str, Any] = {
        "embed": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "lm_head": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                      use_local_output=True),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}"
        plan |= {
            f"{p}.attn_norm": SequenceParallel(), f"{p}.mlp_norm": SequenceParallel(),
            f"{p}.attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            f"{p}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{p}.attn.q": ColwiseParallel(), f"{p}.attn.k": ColwiseParallel(), f"{p}.attn.v": ColwiseParallel(),
            f"{p}.attn.o": RowwiseParallel(output_layouts=Shard(1)),
            f"{p}.mlp.gate": ColwiseParallel(), f"{p}.mlp.up": ColwiseParallel(),
            f"{p}.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        }
    parallelize_module(model, mesh, plan)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build(name: str, model: Llama, tokens: torch.Tensor) -> tuple[Any, Any, Any]:
    """(step function, optimizer, the fxpar module or None) for one system on this rank."""
    m = copy.deepcopy(model)
    if name.startswith("fxpar"):
        plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=name.endswith("SP"))
        pm = fxpar.parallelize(m, fxpar.Mesh({"tp": TP}), (tokens,), plan=plan, loss_fn=next_token_loss,
                               example_targets=tokens)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        return (lambda: pm.step(tokens, tokens)), opt, pm
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    m = dtensor_sequence_parallel(m, mesh) if name.endswith("SP") else dtensor_megatron(m, mesh, llama_plan())
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)

    def step() -> torch.Tensor:
        loss = next_token_loss(m(tokens), tokens)
        loss.backward()
        return loss.detach()
    step.model = m  # type: ignore[attr-defined]
    return step, opt, None


def dtensor_saved_bytes(step: Any) -> int:
    """Distinct local storages the autograd graph of one forward saves (parameters excluded)."""
    params = {_local(p.data if isinstance(p, DTensor) else p).untyped_storage().data_ptr()
              for p in step.model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = _local(t).untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step.model(torch.zeros(BATCH, SEQ, dtype=torch.long))
    return sum(seen.values())


def rank_main() -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    runs = {name: build(name, model, tokens) for name in SYSTEMS}
    out: dict[str, Any] = {}
    for name, (step, opt, pm) in runs.items():
        losses = []
        for _ in range(WARMUP):
            opt.zero_grad()
            losses.append(step().item())
            opt.step()
        opt.zero_grad()
        row: dict[str, Any] = {"first_loss": losses[0], "times": []}
        if pm is not None:
            rows = [r for r in pm.ledger(dist.get_rank()) if r.axis == "tp"]
            row["bytes"] = {op: sum(r.bytes for r in rows if r.op == op) for op in sorted({r.op for r in rows})}
            row["saved"] = saved_per_microbatch(pm._compiled, dist.get_rank())
        else:
            counts = count_collectives(step)
            scale = {"all_gather": TP}  # CommDebugMode counts an all-gather's input shard
            row["bytes"] = {k: b * scale.get(k, 1) for k, b in sorted(counts["bytes"].items()) if b}
            row["saved"] = dtensor_saved_bytes(step)
        opt.zero_grad()
        out[name] = row
    for name, times in interleaved_step_times({n: runs[n][:2] for n in SYSTEMS}, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def report(res: dict[str, Any]) -> list[str]:
    bsh = BATCH * SEQ * CONFIG["hidden"] * 4
    layers = CONFIG["n_layers"]
    optimum = {"tp": f"all_reduce {4 * layers * bsh:,}",
               "tp+SP": f"all_gather {4 * layers * bsh:,}, reduce_scatter {4 * layers * bsh:,}"}
    base = {"fxpar tp": "DTensor tp", "fxpar tp+SP": "DTensor tp+SP"}
    byte_rows = []
    for name in SYSTEMS:
        r = res[name]
        ops = ", ".join(f"{op} {b:,}" for op, b in r["bytes"].items())
        byte_rows.append([name, ops, f"{sum(r['bytes'].values()):,}", optimum[name.split()[-1]], f"{r['saved']:,}"])
    return [*markdown_table(["system", "tp bytes per step by op", "total", f"Megatron optimum in the {layers} layers",
                             "saved activations B"], byte_rows), "",
            *step_time_table({name: res[name] for name in SYSTEMS}, base),
            ""]


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(rank_main, TP, timeout=600, collective_timeout=120)
    bsh = BATCH * SEQ * CONFIG["hidden"] * 4
    lines = [f"`{COMMAND}` (tp=2, 2 gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, "
             f"vocab {CONFIG['vocab_size']}; batch {BATCH} x seq {SEQ}; b*s*h*4 = {bsh:,} B; rank 0's numbers; "
             f"step time max over ranks, median of {STEPS} steps in {ROUNDS} interleaved rounds)",
             "", *report(results[0])]
    publish_gloo_run("sequence_parallel", "sp", COMMAND, lines, results, t0, not args.no_readme, CONFIG, BATCH, SEQ)


if __name__ == "__main__":
    main()
