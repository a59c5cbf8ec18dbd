"""Passes are pure: each returns a new Program and leaves the one it was given as it was.

Every pass of ``fxpar.pipeline.passes()`` runs, in order, on a captured Program under a plan that
gives each of them work (fp8 with ZeRO-3, sequence parallel, selective recompute, tp on a dp x tp
mesh); before and after each one the input Program's graph code, node metadata keys and side tables
(placements, arg placements, notes, provenance, signature) are compared.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import fxpar
from fxpar.capture import capture
from fxpar.compiled import _with_sequence
from fxpar.ir import Program
from fxpar.models.llama import llama, llama_plan
from fxpar.modules import module_table
from fxpar.pipeline import Context, passes

PLANS = {
    "fp8_zero3_sp_recompute": fxpar.Plan(tp=llama_plan(), sequence_parallel=True, zero=3, fp8="tensorwise",
                                         recompute="selective"),
    "zero1_recompute_budget": fxpar.Plan(tp=llama_plan(), zero=1, recompute=4000),
}


def snapshot(prog: Program) -> dict[str, Any]:
    """Everything a later reader of ``prog`` sees, as comparable text."""
    return {
        "code": prog.graph.python_code("self").src,
        "meta": {n.name: (n.op, str(n.target), sorted(n.meta)) for n in prog.graph.nodes},
        "placements": repr(prog.placements),
        "arg_placements": repr(prog.arg_placements),
        "notes": repr(prog.notes),
        "provenance": repr(prog.provenance),
        "signature": repr(prog.signature),
        "passes": prog.passes,
    }


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_every_pass_leaves_its_input_unchanged(plan_name: str) -> None:
    torch.manual_seed(0)
    plan = PLANS[plan_name]
    model = llama(n_layers=2, hidden=32, n_heads=2, n_kv_heads=2)
    tokens = torch.randint(0, 256, (4, 16))
    mesh = fxpar.Mesh({"dp": 2, "tp": 2}, fake=True)
    prog = _with_sequence(capture(model, mesh, (tokens,)), [tokens])
    ctx = Context(modules=module_table(model, plan.tp), plan=plan)
    changed = []
    for name, fn in passes():
        before = snapshot(prog)
        out = fn(prog, ctx)
        after = snapshot(prog)
        assert after == before, f"pass {name} changed its input: {[k for k in before if before[k] != after[k]]}"
        if out is not prog:
            changed.append(name)
        prog = out
    assert {"annotate", "propagate", "insert_collectives", "recompute", "overlap"} <= set(changed)
    if plan.fp8 is not None:
        assert {"fp8", "sequence_parallel", "zero", "fp8_gather"} <= set(changed)
