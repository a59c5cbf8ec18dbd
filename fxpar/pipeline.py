"""The compiler, top to bottom: one ordered list of passes, one comment each."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from fxpar.ir import Program
from fxpar.pass_context import Context
from fxpar.passes.annotate import annotate
from fxpar.passes.fp8 import fp8
from fxpar.passes.fp8_gather import fp8_gather
from fxpar.passes.insert_collectives import insert_collectives
from fxpar.passes.mixed_precision import mixed_precision
from fxpar.passes.overlap import overlap
from fxpar.passes.propagate import propagate
from fxpar.passes.recompute import recompute
from fxpar.passes.sequence_parallel import sequence_parallel
from fxpar.passes.zero import zero

__all__ = ["Context", "Pass", "dump", "passes", "run_pipeline"]


Pass = Callable[[Program, Context], Program]


def passes() -> list[tuple[str, Pass]]:
    """The pass pipeline, in order."""
    return [
        ("fp8", fp8),  # Linear matmuls -> float8 _scaled_mm with dynamic scales (rewrites the joint graph)
        ("annotate", annotate),  # plan + mesh -> placements of params, buffers, inputs
        ("sequence_parallel", sequence_parallel),  # SP: the residual stream to keep sequence-sharded over tp
        ("propagate", propagate),  # sharding through every op of the joint graph (fxpar policy on DTensor rules)
        ("zero", zero),  # zero>=1: which dim each parameter's dp shard is stored on (lowering gathers/scatters)
        ("mixed_precision", mixed_precision),  # param_dtype/reduce_dtype: zero=3 weights cast on their shard
        ("fp8_gather", fp8_gather),  # zero=3 + fp8: weights cast to float8 on their shard, gathered as float8
        ("insert_collectives", insert_collectives),  # placement changes -> explicit collectives + ledger
        ("recompute", recompute),  # forward values the backward recomputes instead of saving (lowering copies them)
        ("overlap", overlap),  # dp gradient buckets; lowering issues collectives early and waits late
    ]


def run_pipeline(prog: Program, ctx: Context) -> Program:
    """Run every pass; time each; verify after each one in debug runs."""
    for name, fn in passes():
        start = time.perf_counter()
        prog = fn(prog, ctx)
        ctx.timings[name] = time.perf_counter() - start
        if ctx.debug:
            _verify(prog, name)
    return prog


def _verify(prog: Program, name: str) -> None:
    try:
        prog.verify()
    except AssertionError as e:
        raise AssertionError(f"Program invalid after pass {name!r}: {e}") from e


def dump(prog: Program, what: Any, tag: str) -> None:
    """With FXPAR_DEBUG>=2, write ``what`` to $FXPAR_DUMP_DIR/<tag>.txt."""
    folder = os.environ.get("FXPAR_DUMP_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{tag}.txt"), "w") as f:
            f.write(str(what))
