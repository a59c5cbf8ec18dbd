"""Context parallelism: activation memory per rank, cp bytes against the all-gather formula, causal balance.

One command, compile-only (fake meshes, no process is started), well under a minute on 2 cores::

    .venv/bin/python bench/context_parallel.py

The bundled Llama (4 layers, hidden 256, 4 query and 2 kv heads, vocab 512), one sequence per dp rank, fp32,
at cp = 1, 2, 4 and two sequence lengths. Per row, all exact and machine-independent:

* **activations**: ``fxpar.memory.saved_per_microbatch``, what rank 0's forward saves for its backward, and its
  ratio to cp=1 (the point of context parallelism: it falls as 1/cp, except what attention keeps whole: k and v);
* **cp bytes** from rank 0's ledger against the formula of all-gathered k/v attention (Llama 3's context
  parallelism): per layer the forward all-gathers k and v, ``2 b S h_kv d 4`` bytes, and the backward
  reduce-scatters their gradients, the same bytes; the logits are gathered once for the output, ``b S V 4``; every
  parameter gradient is all-reduced over cp, ``Psi`` bytes, as data parallelism would;
* **causal balance**: the (query, key) pairs a causal mask lets each rank compute, max over ranks / mean, for
  fxpar's load-balanced split (rank i holds chunks i and 2 cp - 1 - i) and for a contiguous split.

Results go to ``bench/results/context_parallel.json`` and the ``context_parallel`` section of ``bench/README.md``.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from common import bench_args, environment, markdown_table, publish, ratio

import fxpar
from fxpar.memory import saved_per_microbatch
from fxpar.models.llama import Llama, LlamaConfig
from fxpar.split import Splitter

CONFIG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
          "max_seq": 2048}
BATCH = 1
COMMAND = ".venv/bin/python bench/context_parallel.py"


def formula(cfg: LlamaConfig, seq: int, params: int) -> dict[str, int]:
    kv = BATCH * seq * cfg.n_kv_heads * (cfg.hidden // cfg.n_heads) * 4
    return {"fwd": 2 * cfg.n_layers * kv + BATCH * seq * cfg.vocab_size * 4, "bwd_rs": 2 * cfg.n_layers * kv,
            "bwd_ar": params}


def causal_pairs(positions: list[int]) -> int:
    return sum(p + 1 for p in positions)


def balance(seq: int, cp: int) -> tuple[float, float]:
    """max / mean causal work over ranks: load-balanced split, contiguous split."""
    split = Splitter(("cp",), (cp,), seq=seq)
    balanced = [causal_pairs(split.indices(seq, 0, r)) for r in range(cp)]
    chunk = seq // cp
    contiguous = [causal_pairs(list(range(r * chunk, (r + 1) * chunk))) for r in range(cp)]
    return max(balanced) * cp / sum(balanced), max(contiguous) * cp / sum(contiguous)


def row(cfg: LlamaConfig, seq: int, cp: int, base: dict[int, int]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, seq))
    pm = fxpar.parallelize(model, fxpar.Mesh({"cp": cp}, fake=True), (tokens,))
    acts = saved_per_microbatch(pm._compiled, 0)
    base.setdefault(seq, acts)
    rows = [r for r in pm.ledger(0) if r.axis == "cp"]
    params = sum(p.numel() * 4 for p in model.parameters())
    want = formula(cfg, seq, params) if cp > 1 else {"fwd": 0, "bwd_rs": 0, "bwd_ar": 0}
    got = {"fwd": sum(r.bytes for r in rows if r.phase == "fwd"),
           "bwd_rs": sum(r.bytes for r in rows if r.op == "reduce_scatter"),
           "bwd_ar": sum(r.bytes for r in rows if r.op == "all_reduce")}
    balanced, contiguous = balance(seq, cp)
    return {"seq": seq, "cp": cp, "activations": acts, "vs_cp1": ratio(acts, base[seq]), "got": got, "want": want,
            "balanced": balanced, "contiguous": contiguous}


def main() -> None:
    args = bench_args(__doc__)
    t0 = time.perf_counter()
    cfg = LlamaConfig(**CONFIG)
    base: dict[int, int] = {}
    results = [row(cfg, seq, cp, base) for seq in (512, 2048) for cp in (1, 2, 4)]
    header = ["seq", "cp", "activations B (rank 0)", "vs cp=1", "fwd all-gather B", "formula", "bwd reduce-scatter B",
              "formula", "bwd all-reduce B", "Psi", "causal work max/mean: balanced", "contiguous"]
    table = [[r["seq"], r["cp"], r["activations"], r["vs_cp1"], r["got"]["fwd"], r["want"]["fwd"],
              r["got"]["bwd_rs"], r["want"]["bwd_rs"], r["got"]["bwd_ar"], r["want"]["bwd_ar"],
              f"{r['balanced']:.3f}", f"{r['contiguous']:.3f}"] for r in results]
    lines = [f"`{COMMAND}` (fake meshes, compile only; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}, "
             f"{CONFIG['n_heads']} heads / {CONFIG['n_kv_heads']} kv heads, vocab {CONFIG['vocab_size']}; "
             f"batch {BATCH} per dp rank; fp32)", "", *markdown_table(header, table), ""]
    exact = all(r["got"] == r["want"] for r in results)
    env = {**environment(), "config": CONFIG, "batch": BATCH, "wall_s": time.perf_counter() - t0}
    publish("context_parallel", "context_parallel", lines, {"env": env, "command": COMMAND, "rows": results},
            not args.no_readme, [f"ledger equals the formula on every row: {exact}"])
    if not exact:
        raise SystemExit("a cp ledger differs from the all-gather formula")


if __name__ == "__main__":
    main()
