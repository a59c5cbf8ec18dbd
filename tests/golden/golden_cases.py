"""The golden cases: a fixed set of (model, mesh, plan, rank) whose printed programs are checked in.

This is the one list used by both ``tests/test_golden.py`` (which diffs) and
``tests/golden/regen.py`` (which rewrites ``tests/golden/<case>.txt``). Each golden file is the
rank's program at verbosity 1 (no source paths, so nothing machine-dependent) followed by its
communication ledger, so a change in collectives shows in the diff.

Cases compile on fake meshes only: no processes, a few seconds in all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import fxpar
from fxpar.models.llama import llama, llama_plan
from fxpar.models.mlp import mlp, mlp_plan

GOLDEN_DIR = Path(__file__).resolve().parent
REGEN_COMMAND = "make golden  (or: .venv/bin/python tests/golden/regen.py)"

# Small shapes keep the files readable; GQA (4 query heads, 2 kv heads) keeps repeat_interleave in.
MLP_SHAPE = {"dim": 8, "hidden": 16, "out": 4}
LLAMA_SHAPE = {"n_layers": 1, "vocab_size": 32, "hidden": 16, "intermediate": 32, "n_heads": 4,
               "n_kv_heads": 2, "max_seq": 8}


@dataclass(frozen=True)
class Case:
    """One golden program: ``build`` returns the model and its example inputs (global shapes)."""

    name: str
    about: str
    build: Callable[[], tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]
    axes: dict[str, int]
    plan: dict[str, str] | None
    rank: int

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.txt"


def _mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return mlp(**MLP_SHAPE), (torch.zeros(4, MLP_SHAPE["dim"]),)


def _llama() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return llama(**LLAMA_SHAPE), (torch.zeros(2, LLAMA_SHAPE["max_seq"], dtype=torch.long),)


_MLP_ABOUT = f"mlp({', '.join(f'{k}={v}' for k, v in MLP_SHAPE.items())}), x f32[4,{MLP_SHAPE['dim']}]"
_LLAMA_ABOUT = (f"llama({', '.join(f'{k}={v}' for k, v in LLAMA_SHAPE.items())}), "
                f"tokens i64[2,{LLAMA_SHAPE['max_seq']}]")

CASES: list[Case] = [
    Case("mlp_tp2_rank0", f"{_MLP_ABOUT}, plan mlp_plan()", _mlp, {"tp": 2}, mlp_plan(), 0),
    Case("mlp_dp2_rank1", f"{_MLP_ABOUT}, no plan", _mlp, {"dp": 2}, None, 1),
    Case("mlp_dp2_tp2_rank0", f"{_MLP_ABOUT}, plan mlp_plan()", _mlp, {"dp": 2, "tp": 2}, mlp_plan(), 0),
    Case("llama_tp2_rank0", f"{_LLAMA_ABOUT}, plan llama_plan()", _llama, {"tp": 2}, llama_plan(), 0),
    Case("llama_dp2_tp2_rank3", f"{_LLAMA_ABOUT}, plan llama_plan()", _llama, {"dp": 2, "tp": 2}, llama_plan(), 3),
]


def render(case: Case) -> str:
    """The golden text of ``case``: a one-line case header, the rank's program, then its ledger."""
    model, inputs = case.build()
    pm = fxpar.parallelize(model, fxpar.Mesh(case.axes, fake=True), inputs, plan=case.plan)
    return (f"# golden case {case.name}: {case.about}\n"
            f"{pm.program(case.rank, verbosity=1)}\n"
            f"{pm.ledger_table(case.rank)}\n")
