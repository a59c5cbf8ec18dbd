"""The Llama 3 405B layout on a fake 16,384-rank mesh, at small widths (issue 19).

HF ``LlamaForCausalLM`` with 126 layers on meta, fake ``pp=16 x dp=128 x tp=8``, Megatron tp with
sequence parallelism, ZeRO-1, 16 stages and 16 microbatches: the compile (``verify`` included) must cover
every group without lowering or simulating ranks one by one, any rank's program must come from its role,
its ledger must hold exactly its stage boundaries' transfers and its layers' tp and dp collectives, and
each stage's program must say which layers it holds. ``bench/compile_time.py`` times the same case at
Llama-3-405B widths.
"""

from __future__ import annotations

import re

import pytest
import torch

import fxpar
from fxpar.models.llama import hf_llama_plan
from fxpar.testing.error_models import next_token_loss

transformers = pytest.importorskip("transformers")

LAYERS, PP, DP, TP, MB = 126, 16, 128, 8, 16
MESH = {"pp": PP, "dp": DP, "tp": TP}


@pytest.fixture(scope="module")
def pm() -> fxpar.ParallelModule:
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                                   num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                                   rope_theta=500000.0, attn_implementation="sdpa", use_cache=False)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    tokens = torch.randint(0, 512, (DP * MB, 16))
    plan = fxpar.Plan(tp=hf_llama_plan(), sequence_parallel=True, zero=1, stages=PP, microbatches=MB)
    return fxpar.parallelize(model, fxpar.Mesh(MESH, fake=True), (tokens,), plan, loss_fn=next_token_loss)


def _rank(pp: int, dp: int, tp: int) -> int:
    return (pp * DP + dp) * TP + tp


def _held_layers(text: str) -> list[int]:
    """The layer indices a printed stage program says it holds (``model.layers.0-6`` -> 0..6)."""
    holds = next(line for line in text.splitlines() if line.startswith("# holds"))
    layers: list[int] = []
    for lo, hi in re.findall(r"model\.layers\.(\d+)(?:-(\d+))?", holds):
        layers.extend(range(int(lo), int(hi or lo) + 1))
    return layers


def test_every_layer_is_held_by_exactly_one_stage_in_order(pm: fxpar.ParallelModule) -> None:
    held = [_held_layers(pm.program(rank=_rank(s, 0, 0))) for s in range(PP)]
    assert [layer for stage in held for layer in stage] == list(range(LAYERS))  # 126 layers, 16 stages: uneven
    assert all(held), "a stage holds no layer"
    assert len({len(h) for h in held}) > 1


def test_proof_covers_every_group_by_role(pm: fxpar.ParallelModule) -> None:
    proof = pm.proof
    assert proof.mesh_size == PP * DP * TP
    assert len(proof.ranks) < 100  # one rank per role, not 16,384
    assert proof.roles >= PP and proof.transfers > 0 and proof.collectives > 0
    assert pm._compiled.roles.count() <= 2 * PP  # lowered once per role (stage), bound for any other rank


def _peer_ranks(rank: int) -> set[int]:
    pp, dp, tp = rank // (DP * TP), rank // TP % DP, rank % TP
    return {_rank(p, dp, tp) for p in (pp - 1, pp + 1) if 0 <= p < PP}


@pytest.mark.parametrize("rank", [_rank(0, 5, 3), _rank(9, 103, 1), _rank(15, 127, 7)])
def test_ledger_is_stage_boundaries_plus_tp_and_dp_collectives(pm: fxpar.ParallelModule, rank: int) -> None:
    ledger = pm.ledger(rank)
    pp = rank // (DP * TP)
    transfers = [r for r in ledger if r.op in ("send", "recv")]
    boundaries = len(_peer_ranks(rank))
    # per microbatch and boundary: the activation one way in the forward, its gradient back in the backward
    assert len(transfers) == 2 * boundaries * MB
    assert {r.peer for r in transfers} == _peer_ranks(rank)
    assert sorted(r.mb for r in transfers) == sorted(list(range(MB)) * 2 * boundaries)
    collectives = [r for r in ledger if r.op not in ("send", "recv")]
    assert {r.axis for r in collectives} <= {"tp", "dp"}
    assert all(r.stage == pp for r in ledger if r.op != "recv")
    assert {r.stage for r in transfers if r.op == "recv"} == {p for p in (pp - 1, pp + 1) if 0 <= p < PP}  # sender
    for r in collectives:  # each in this rank's own tp or dp group
        assert rank in r.group and len(r.group) == (TP if r.axis == "tp" else DP)
    dp_rows = [r for r in collectives if r.axis == "dp"]
    assert dp_rows and all(r.mb is None for r in dp_rows)  # ZeRO-1: once per step (buckets), not per microbatch
    tp_rows = [r for r in collectives if r.axis == "tp"]
    assert tp_rows and all(r.mb is not None for r in tp_rows)  # per microbatch: the layers' activations


def test_tp_collectives_scale_with_the_layers_a_stage_holds(pm: fxpar.ParallelModule) -> None:
    """Middle stages hold only decoder layers: their tp collectives per microbatch are the same count per layer."""
    per_layer = set()
    for s in (3, 7, 8, 12):
        rank = _rank(s, 17, 2)
        layers = len(_held_layers(pm.program(rank=rank)))
        tp_rows = [r for r in pm.ledger(rank) if r.axis == "tp" and r.mb == 0]
        per_layer.add(len(tp_rows) / layers)
    assert len(per_layer) == 1 and per_layer.pop() >= 4  # SP: gather and reduce-scatter around attention and MLP


_GC_SEEN: list[bool] = []  # module-level: fxpar traces a copy of the model


class _GcProbe(torch.nn.Module):
    """Records, while it is traced, whether the cyclic collector may run."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.lin, self.fail = torch.nn.Linear(8, 8), fail

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import gc

        _GC_SEEN.append(gc.isenabled())
        if self.fail:
            raise RuntimeError("the user's code fails")
        return self.lin(x)


def test_compiling_pauses_the_cyclic_collector_and_restores_it() -> None:
    # full collections walk every fake tensor and fx node a compile has made: 15-30% of parallelize at 80 layers
    import gc

    x = (torch.randn(4, 8),)
    assert gc.isenabled()
    _GC_SEEN.clear()
    pm = fxpar.parallelize(_GcProbe(), fxpar.Mesh({"dp": 2}, fake=True), x)
    assert _GC_SEEN and not any(_GC_SEEN)
    assert gc.isenabled()
    pm.program(1)
    assert gc.isenabled()
    with pytest.raises(Exception, match="the user's code fails"):
        fxpar.parallelize(_GcProbe(fail=True), fxpar.Mesh({"dp": 2}, fake=True), x)
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    try:
        fxpar.parallelize(_GcProbe(), fxpar.Mesh({"dp": 2}, fake=True), x)
        assert not gc.isenabled()
    finally:
        gc.enable()
