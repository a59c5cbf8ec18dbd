"""``fxpar.serialize``: a compiled program survives bytes exactly (compile once, send to every rank)."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar import serialize
from fxpar.api import compile_program
from fxpar.models.llama import llama, llama_plan
from fxpar.models.mlp import mlp
from fxpar.printer import print_rank_program
from fxpar.runtime import ParallelModule


def test_round_trip_prints_the_same_rank_programs() -> None:
    mesh = fxpar.Mesh({"dp": 2, "tp": 2}, fake=True)
    torch.manual_seed(0)
    compiled = compile_program(llama(n_layers=1, tie_embeddings=True), mesh, (torch.randint(0, 256, (4, 16)),),
                               llama_plan())
    again_compiled = serialize.loads(serialize.dumps(compiled))
    prog, again = compiled.stages[0], again_compiled.stages[0]
    assert [n.name for n in again.graph.nodes] == [n.name for n in prog.graph.nodes]
    assert again.placements == prog.placements and again.signature == prog.signature
    for rank in (0, 3):
        before, after = ParallelModule(compiled, None, None), ParallelModule(again_compiled, None, None)
        text = print_rank_program(again, after.rank_program(rank))
        assert text == print_rank_program(prog, before.rank_program(rank))
        assert after.ledger(rank) == before.ledger(rank)


def test_round_trip_of_a_pipeline_keeps_stages_and_schedule() -> None:
    mesh = fxpar.Mesh({"pp": 2, "tp": 2}, fake=True)
    plan = fxpar.Plan(tp=llama_plan(), stages=4, schedule="interleaved-1f1b", microbatches=2)
    compiled = compile_program(llama(n_layers=4), mesh, (torch.randint(0, 256, (4, 16)),), plan,
                               loss_fn=lambda out: out.pow(2).mean())
    again = serialize.loads(serialize.dumps(compiled))
    assert again.schedule == compiled.schedule and again.plan == compiled.plan
    for rank in range(4):
        before, after = ParallelModule(compiled, None, None), ParallelModule(again, None, None)
        assert after.program(rank) == before.program(rank)
        assert after.ledger(rank) == before.ledger(rank)


def test_loading_for_another_mesh_is_refused() -> None:
    prog = compile_program(mlp(), fxpar.Mesh({"tp": 2}, fake=True), (torch.randn(8, 32),))
    with pytest.raises(ValueError, match=r"compiled for mesh \{'tp': 2\}"):
        serialize.loads(serialize.dumps(prog), fxpar.Mesh({"tp": 4}, fake=True))
