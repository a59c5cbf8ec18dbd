"""Lowering replays a repeated layer's nodes from their first copy (``fxpar.lower.replay``, issue 19).

With replay on (the default) and off (``FXPAR_REPLAY=0``), every rank's program, ledger and memory are
byte-identical across the features whose lowering replay covers (tensor, sequence, data and pipeline parallel,
ZeRO-1/2, both recompute policies, biases, fp8, a chosen plan), and most of the lowering is replayed there; where
it does not apply (ZeRO-3, mixed precision) nothing is. The golden replay (``tests/test_golden.py``) checks the
same against the stored programs, and every gloo equivalence test runs with replay on.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator

import pytest
import torch

import fxpar
from fxpar.lower import replay
from fxpar.models.llama import llama, llama_plan
from fxpar.testing.error_models import next_token_loss

TOKENS = (torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0)),)
SMALL = dict(vocab_size=64, hidden=32, intermediate=64, n_heads=4, n_kv_heads=2, max_seq=16, n_layers=4)


def _llama(**extra: object) -> Callable[[], torch.nn.Module]:
    return lambda: llama(**{**SMALL, **extra})


CASES = {
    "dp2_tp2": (_llama(), {"dp": 2, "tp": 2}, dict(plan=llama_plan())),
    "tp4_sp": (_llama(), {"tp": 4}, dict(plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True))),
    "tp2_bias_gelu": (_llama(bias=True, mlp="gelu", norm="layer"), {"dp": 2, "tp": 2},
                      dict(plan={k: v for k, v in llama_plan().items() if "gate" not in k})),
    "pp2_dp2": (_llama(), {"pp": 2, "dp": 2},
                dict(plan=fxpar.Plan(stages=2, microbatches=2), loss_fn=next_token_loss)),
    "pp2_tp2_sp_interleaved": (_llama(n_layers=8), {"pp": 2, "tp": 2},
                               dict(plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True, stages=4,
                                                    microbatches=4, schedule="interleaved-1f1b"),
                                    loss_fn=next_token_loss)),
    "zero2_dp4": (_llama(), {"dp": 4}, dict(plan=fxpar.Plan(zero=2))),
    "tp2_full_recompute": (_llama(), {"dp": 2, "tp": 2}, dict(plan=fxpar.Plan(tp=llama_plan(), recompute="full"))),
    "tp2_selective_sp": (_llama(), {"dp": 2, "tp": 2},
                         dict(plan=fxpar.Plan(tp=llama_plan(), recompute="selective", sequence_parallel=True))),
    "tp2_fp8": (_llama(), {"dp": 2, "tp": 2}, dict(plan=fxpar.Plan(tp=llama_plan(), fp8="tensorwise"))),
    "plan_none": (_llama(), {"dp": 2, "tp": 2}, dict(plan=None)),
}
NOT_REPLAYED = {
    "zero3_dp4": (_llama(), {"dp": 4}, dict(plan=fxpar.Plan(zero=3))),
    "bf16_zero2": (_llama(), {"dp": 2, "tp": 2},
                   dict(plan=fxpar.Plan(tp=llama_plan(), zero=2, param_dtype=torch.bfloat16))),
}


@pytest.fixture
def replays(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[replay.LayerReplay]]:
    """Every ``LayerReplay`` made while the test runs (one per rank lowering)."""
    made: list[replay.LayerReplay] = []
    init = replay.LayerReplay.__init__

    def recorded(self: replay.LayerReplay, lw: object) -> None:
        init(self, lw)  # type: ignore[arg-type]
        made.append(self)

    monkeypatch.setattr(replay.LayerReplay, "__init__", recorded)
    yield made


def _texts(case: tuple, monkeypatch: pytest.MonkeyPatch, on: bool) -> list[str]:
    """Every rank's program, ledger and memory report, compiled with replay ``on`` or off."""
    build, axes, kw = case
    monkeypatch.setenv(replay.REPLAY_ENV, "1" if on else "0")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        pm = fxpar.parallelize(build(), fxpar.Mesh(axes, fake=True), TOKENS, **kw)
    ranks = range(pm.mesh.size)
    return [f"{pm.program(rank=r)}\n{pm.ledger(r)}\n{pm.memory(r)}" for r in ranks]


@pytest.mark.parametrize("name", sorted(CASES))
def test_replayed_programs_are_the_lowered_ones(name: str, monkeypatch: pytest.MonkeyPatch,
                                                 replays: list[replay.LayerReplay]) -> None:
    off = _texts(CASES[name], monkeypatch, on=False)
    assert not any(r.replayed for r in replays)
    replays.clear()
    on = _texts(CASES[name], monkeypatch, on=True)
    assert on == off
    assert all(r.on for r in replays)
    lowered = sum(len(r.recorded) for r in replays)
    replayed = sum(r.replayed for r in replays)
    assert replayed >= lowered // 2  # 2-4 layers a rank: the later layers' nodes come from the first one's


@pytest.mark.parametrize("name", sorted(NOT_REPLAYED))
def test_lowerings_replay_cannot_cover_lower_every_node(name: str, monkeypatch: pytest.MonkeyPatch,
                                                        replays: list[replay.LayerReplay]) -> None:
    _texts(NOT_REPLAYED[name], monkeypatch, on=True)
    assert replays and not any(r.on or r.replayed for r in replays)
