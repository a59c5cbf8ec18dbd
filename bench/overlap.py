"""Overlap on vs off on real gloo ranks: step time, and the fraction of collective bytes hidden behind compute.

One command, one launch of 2 gloo ranks (``dp=2``), about a minute on 2 cores::

    .venv/bin/python bench/overlap.py

Same model (the bundled Llama, seed 0), same batch, fp32 AdamW, ``bucket_mb=1``. For DDP-style (zero 0, bucketed
gradient all-reduces issued during the backward) and FSDP-style (zero 3, the next block's gathers prefetched):

* **step time**: ``pm.step`` + AdamW, max over ranks, median of ``STEPS`` steps in interleaved rounds; overlap
  on vs off in the same run;
* **hidden bytes**: one more step runs the rank graphs node by node and times every ``wait``; a collective
  whose wait returns within ``HIDDEN_US`` had already finished behind the compute issued after it. The
  fraction is those collectives' ledger bytes over all collective bytes of the step. The waits are written
  as a Chrome trace (``bench/results/overlap_trace_rank0.json``, one event per wait, its bytes in ``args``).

Results go to ``bench/results/overlap.json`` and the ``overlap`` section of ``bench/README.md``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from common import BENCH_DIR, bench_args, interleaved_step_times, markdown_table, publish_gloo_run, step_time_table

import fxpar
from fxpar.models.llama import Llama, LlamaConfig

CONFIG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
          "max_seq": 64}
BATCH, SEQ, DP = 8, 64, 2
WARMUP, STEPS, ROUNDS = 2, 10, 4
HIDDEN_US = 50.0
COMMAND = ".venv/bin/python bench/overlap.py"
SYSTEMS = {f"zero={z} overlap {'on' if o else 'off'}": (z, o) for z in (0, 3) for o in (False, True)}
WAIT = torch.ops._c10d_functional.wait_tensor.default


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class WaitTimer(fx.Interpreter):
    """Runs a bound rank graph node by node, timing each wait and noting its collective's ledger bytes."""

    def __init__(self, gm: fx.GraphModule, events: list[dict[str, Any]], t0: float) -> None:
        super().__init__(gm)
        self.events, self.t0 = events, t0

    def run_node(self, n: fx.Node) -> Any:
        if n.target is not WAIT:
            return super().run_node(n)
        start = time.perf_counter()
        out = super().run_node(n)
        dur = (time.perf_counter() - start) * 1e6
        row = n.args[0].meta.get("ledger_row")
        self.events.append({"name": f"wait {n.args[0].name}", "ph": "X", "ts": (start - self.t0) * 1e6, "dur": dur,
                            "pid": 0, "tid": dist.get_rank(),
                            "args": {"bytes": row.bytes if row else 0, "op": row.op if row else "?"}})
        return out


def timed_step(pm: fxpar.ParallelModule, tokens: torch.Tensor) -> list[dict[str, Any]]:
    """One ``pm.step`` with every graph run by ``WaitTimer``; the wait events."""
    events: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    runner = pm._runners[0]
    graphs = {k: getattr(runner, k) for k in ("forward", "backward", "reduce") if getattr(runner, k) is not None}
    for key, run in graphs.items():  # the GraphModule under fxpar.direct_calls, interpreted node by node
        gm = getattr(run, "graph_module", run)
        setattr(runner, key, lambda *a, gm=gm: WaitTimer(gm, events, t0).run(*a))
    try:
        pm.step(tokens, tokens)
    finally:
        for key, gm in graphs.items():
            setattr(runner, key, gm)
    return events


def rank_main() -> dict[str, Any]:
    rank = dist.get_rank()
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    local = tokens.chunk(DP)[rank]
    out: dict[str, Any] = {}
    runs = {}
    for name, (zero, on) in SYSTEMS.items():
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**CONFIG))
        pm = fxpar.parallelize(model, fxpar.Mesh({"dp": DP}), (tokens,), loss_fn=next_token_loss,
                               example_targets=tokens, plan=fxpar.Plan(zero=zero, overlap=on, bucket_mb=1))
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
        losses = []
        for _ in range(WARMUP):
            losses.append(pm.step(local, local).item())
            opt.step()
            opt.zero_grad()
        events = timed_step(pm, local)
        opt.zero_grad()
        total = sum(e["args"]["bytes"] for e in events)
        hidden = sum(e["args"]["bytes"] for e in events if e["dur"] < HIDDEN_US)
        out[name] = {"first_loss": losses[0], "collectives": len(events), "bytes": total, "hidden_bytes": hidden,
                     "events": events}
        runs[name] = ((lambda pm=pm: pm.step(local, local)), opt)
    for name, times in interleaved_step_times(runs, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def report(res: dict[str, Any]) -> list[str]:
    rows = [[name, r["collectives"], r["bytes"], r["hidden_bytes"], f"{r['hidden_bytes'] / max(1, r['bytes']):.2f}"]
            for name, r in res.items()]
    base = {name: name.replace("on", "off") for name in res if name.endswith("on")}
    return [*markdown_table(["system", "collectives per step", "bytes", f"bytes hidden (wait < {HIDDEN_US:g} us)",
                             "fraction hidden"], rows), "",
            *step_time_table({n: {k: v for k, v in r.items() if k != "events"} for n, r in res.items()}, base), ""]


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(rank_main, DP, timeout=900, collective_timeout=120)
    trace = os.path.join(BENCH_DIR, "results", "overlap_trace_rank0.json")
    with open(trace, "w") as f:
        json.dump({"traceEvents": [e for r in results[0].values() for e in r["events"]]}, f)
    for r in results:
        for row in r.values():
            row.pop("events")
    lines = [f"`{COMMAND}` (dp=2, 2 gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}; "
             f"batch {BATCH} x seq {SEQ}; bucket_mb=1; rank 0's numbers; step time max over ranks, median of "
             f"{STEPS} steps in {ROUNDS} interleaved rounds; waits in `bench/results/overlap_trace_rank0.json`)", "",
             *report(results[0])]
    publish_gloo_run("overlap", "overlap", COMMAND, lines, results, t0, not args.no_readme, CONFIG, BATCH, SEQ)


if __name__ == "__main__":
    main()
