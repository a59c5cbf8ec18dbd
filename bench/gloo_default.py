"""The gloo in-flight policy on a mesh with two process groups: step time of each setting, same run.

One command, one launch of 4 gloo ranks (``dp=2 x tp=2``), a few minutes on 2 cores::

    .venv/bin/python bench/gloo_default.py

``fxpar.lower.overlap`` keeps at most one collective in flight per rank program on gloo (``GLOO_IN_FLIGHT =
"process"``, section 12 says why). On a one-group mesh that is the same program as one per group; with dp and
tp both moving data it is not: a dp prefetch or bucket is waited before the next tp all-reduce is issued. This
measures what that costs. Systems, each the bundled Llama (seed 0) under ``Plan(tp=llama_plan(), zero=3,
bucket_mb=1)``:

* ``one per process`` (the default): ``GLOO_IN_FLIGHT = "process"``;
* ``wait at once``: ``"none"`` (``FXPAR_GLOO_IN_FLIGHT=none``): the overlap pass's buckets and flat ZeRO
  collectives, each waited right after its issue;
* ``one per group`` (the default before session 38): ``GLOO_IN_FLIGHT = "group"``;
* ``overlap off``: ``Plan(overlap=False)``, every wait right after its issue, and no buckets;
* ``one per process, functional ops``: the default order, its collectives through the functional ops as printed
  (``FXPAR_GLOO_COLLECTIVES=functional``; every other system runs them through the classic API, the gloo default
  since session 48: ``fxpar.backends.classic``).

Step time: ``pm.step`` + AdamW, max over ranks, median of ``STEPS`` steps in interleaved rounds. Each rank
program is lowered while its setting is in force (the first warm-up step), so each system runs its own order;
the losses of the first step must agree bitwise (overlap changes no arithmetic). Results go to
``bench/results/gloo_default.json`` and the ``gloo_default`` section of ``bench/README.md``.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from common import bench_args, interleaved_step_times, publish_gloo_run, step_time_table
from fxpar.backends import classic
from overlap import CONFIG, next_token_loss

import fxpar
import fxpar.lower.overlap as issue_order
from fxpar.models.llama import Llama, LlamaConfig, llama_plan

COMMAND = ".venv/bin/python bench/gloo_default.py"
MESH = {"dp": 2, "tp": 2}
BATCH, SEQ = 8, 64
WARMUP, STEPS, ROUNDS = 2, 24, 4
SYSTEMS = {"one per process (default)": ("process", True, "classic"),
           "one per process, functional ops": ("process", True, "functional"),
           "wait at once": ("none", True, "classic"), "one per group": ("group", True, "classic"),
           "overlap off": ("process", False, "classic")}


def rank_main() -> dict[str, Any]:
    dp_index = dist.get_rank() // MESH["tp"]
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    local = tokens.chunk(MESH["dp"])[dp_index]
    out: dict[str, Any] = {}
    runs = {}
    default = issue_order.GLOO_IN_FLIGHT
    os.environ.pop(issue_order.GLOO_ENV, None)  # each system sets its own
    for name, (in_flight, on, collectives) in SYSTEMS.items():
        torch.manual_seed(0)
        plan = fxpar.Plan(tp=llama_plan(), zero=3, overlap=on, bucket_mb=1)
        issue_order.GLOO_IN_FLIGHT = in_flight
        os.environ[classic.GLOO_COLLECTIVES_ENV] = collectives  # read when the first step binds the graphs
        try:
            pm = fxpar.parallelize(Llama(LlamaConfig(**CONFIG)), fxpar.Mesh(MESH), (tokens,), loss_fn=next_token_loss,
                                   example_targets=tokens, plan=plan)
            opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)
            losses = []
            for _ in range(WARMUP):  # the first step lowers this rank's program under ``in_flight``
                losses.append(pm.step(local, local).item())
                opt.step()
                opt.zero_grad()
        finally:
            issue_order.GLOO_IN_FLIGHT = default
            del os.environ[classic.GLOO_COLLECTIVES_ENV]
        out[name] = {"first_loss": losses[0]}
        runs[name] = ((lambda pm=pm: pm.step(local, local)), opt)
    for name, times in interleaved_step_times(runs, STEPS, ROUNDS).items():
        out[name]["times"] = times
    return out


def main() -> None:
    from fxpar.testing.launch import run_ranks

    args = bench_args(__doc__)
    t0 = time.perf_counter()
    results = run_ranks(rank_main, MESH["dp"] * MESH["tp"], timeout=900, collective_timeout=120)
    base = {name: "overlap off" for name in SYSTEMS if name != "overlap off"}
    lines = [f"`{COMMAND}` (dp=2 x tp=2, 4 gloo ranks; Llama {CONFIG['n_layers']} layers, hidden {CONFIG['hidden']}; "
             f"Megatron tp, zero=3, bucket_mb=1; batch {BATCH} x seq {SEQ}; step time max over ranks, median of "
             f"{STEPS} steps in {ROUNDS} interleaved rounds)", "", *step_time_table(results[0], base), ""]
    publish_gloo_run("gloo_default", "gloo_default", COMMAND, lines, results, t0, not args.no_readme, CONFIG, BATCH,
                     SEQ)


if __name__ == "__main__":
    main()
