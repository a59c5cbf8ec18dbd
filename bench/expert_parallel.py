"""Expert parallelism: parameter memory per rank, all-to-all and all-reduce bytes against their formulas, and
what real routing sends.

One command, compile-only (fake meshes, no process is started), under a minute on 2 cores::

    .venv/bin/python bench/expert_parallel.py

HF Mixtral (4 layers, hidden 128, 8 experts of intermediate 256, top-2, vocab 512), a global batch of 8 sequences
of 64 tokens, fp32, on four ranks: dp=4 (MoE data parallel, every rank holds every expert), dp=2 x ep=2 and ep=4.
Per row, all exact and machine-independent:

* **params**: ``pm.memory(0).params`` against ``Psi_dense + Psi_experts / ep``;
* **all-to-all bytes** from rank 0's ledger against the formula at uniform routing: per MoE layer the forward moves
  the per-expert counts (``E`` int64) and twice the rank's ``T k`` rows of ``H`` floats (dispatch, combine), the
  backward twice those rows (``T = B S / (dp ep)`` tokens per rank);
* **all-reduce bytes** per axis against the formula: dense gradients over dp and over ep (both shard the batch),
  the rank's expert gradients over dp only (the all-to-alls bring each expert all of its rows);
* **real routing**: the rows the single-device model's routers (random init, random tokens) would send off each
  rank, max over ranks and layers, against the uniform ``T k (ep - 1) / ep``: the ledger's all-to-all bytes are the
  uniform case; real ones differ by routing (their total per rank is always ``T k`` rows, nothing is dropped).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import bench_args, environment, markdown_table, publish

import fxpar

CONFIG = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
          "max_position_embeddings": 64, "use_cache": False, "tie_word_embeddings": False}
BATCH, SEQ = 8, 64
MESHES = [{"dp": 4}, {"dp": 2, "ep": 2}, {"ep": 4}]
COMMAND = ".venv/bin/python bench/expert_parallel.py"


def build() -> torch.nn.Module:
    import transformers

    config = transformers.MixtralConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(dense, experts) parameter bytes."""
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    return sum(p.numel() * 4 for p in model.parameters()) - experts, experts


def formula(axes: dict[str, int], dense: int, experts: int) -> dict[str, int]:
    dp, ep = axes.get("dp", 1), axes.get("ep", 1)
    layers, e, k, h = (CONFIG[n] for n in ("num_hidden_layers", "num_local_experts", "num_experts_per_tok",
                                          "hidden_size"))
    rows = BATCH * SEQ // (dp * ep) * k * h * 4
    a2a = layers * (e * 8 + 4 * rows) if ep > 1 else 0
    return {"params": dense + experts // ep, "a2a": a2a, "ar_dp": dense + experts // ep if dp > 1 else 0,
            "ar_ep": dense if ep > 1 else 0}


def routed_off_rank(model: torch.nn.Module, tokens: torch.Tensor, axes: dict[str, int]) -> tuple[int, int]:
    """(max over ranks and layers of the rows routing sends to other ep ranks, the uniform-routing value)."""
    dp, ep = axes.get("dp", 1), axes.get("ep", 1)
    if ep == 1:
        return 0, 0
    chosen: list[torch.Tensor] = []
    hooks = [layer.mlp.experts.register_forward_hook(lambda m, args, out: chosen.append(args[1]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(tokens)
    for hook in hooks:
        hook.remove()
    per_rank = BATCH // (dp * ep)
    local_experts = CONFIG["num_local_experts"] // ep
    worst = 0
    for experts in chosen:
        for r in range(dp * ep):
            rows = experts.view(BATCH, SEQ, -1)[r * per_rank:(r + 1) * per_rank].flatten()
            worst = max(worst, int((rows // local_experts != r % ep).sum()))
    k = CONFIG["num_experts_per_tok"]
    return worst, per_rank * SEQ * k * (ep - 1) // ep


def row(axes: dict[str, int], model: torch.nn.Module, tokens: torch.Tensor) -> dict[str, Any]:
    pm = fxpar.parallelize(model, fxpar.Mesh(axes, fake=True), (tokens,))
    ledger = pm.ledger(0)
    dense, experts = param_bytes(model)
    got = {"params": pm.memory(0).params, "a2a": sum(r.bytes for r in ledger if r.op == "all_to_all"),
           "ar_dp": sum(r.bytes for r in ledger if r.op == "all_reduce" and r.axis == "dp"),
           "ar_ep": sum(r.bytes for r in ledger if r.op == "all_reduce" and r.axis == "ep")}
    real, uniform = routed_off_rank(model, tokens, axes)
    return {"mesh": " x ".join(f"{a}={n}" for a, n in axes.items()), "got": got, "want": formula(axes, dense, experts),
            "off_rank_rows_max": real, "off_rank_rows_uniform": uniform}


def main() -> None:
    args = bench_args(__doc__)
    t0 = time.perf_counter()
    model = build()
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    results = [row(axes, model, tokens) for axes in MESHES]
    header = ["mesh", "params B (rank 0)", "formula", "all-to-all B", "formula (uniform routing)",
              "all-reduce B over dp", "formula", "over ep", "formula", "rows sent off-rank: real max", "uniform"]
    table = [[r["mesh"], r["got"]["params"], r["want"]["params"], r["got"]["a2a"], r["want"]["a2a"],
              r["got"]["ar_dp"], r["want"]["ar_dp"], r["got"]["ar_ep"], r["want"]["ar_ep"],
              r["off_rank_rows_max"], r["off_rank_rows_uniform"]] for r in results]
    lines = [f"`{COMMAND}` (fake meshes, compile only; HF Mixtral {CONFIG['num_hidden_layers']} layers, hidden "
             f"{CONFIG['hidden_size']}, {CONFIG['num_local_experts']} experts of {CONFIG['intermediate_size']}, "
             f"top-{CONFIG['num_experts_per_tok']}; global batch {BATCH} x {SEQ} tokens; fp32)", "",
             *markdown_table(header, table), ""]
    exact = all(r["got"] == r["want"] for r in results)
    env = {**environment(), "config": CONFIG, "batch": BATCH, "seq": SEQ, "wall_s": time.perf_counter() - t0}
    publish("expert_parallel", "expert_parallel", lines, {"env": env, "command": COMMAND, "rows": results},
            not args.no_readme, [f"ledger and memory equal the formulas on every row: {exact}"])
    if not exact:
        raise SystemExit("an ep ledger or parameter count differs from its formula")


if __name__ == "__main__":
    main()
