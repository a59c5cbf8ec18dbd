"""Lowering replays a repeated layer's nodes from their first copy (``fxpar.lower.replay``, issue 19).

With replay on (the default) and off (``FXPAR_REPLAY=0``), every rank's program, ledger and memory are
byte-identical across the features whose lowering replay covers (tensor, sequence, data and pipeline parallel,
ZeRO-1/2, both recompute policies, biases, fp8, a chosen plan), and most of the lowering is replayed there; where
it does not apply (ZeRO-3, mixed precision) nothing is. ``FXPAR_REPLAY_SWEEP=1`` also compares the two on every HF
family of ``fxpar.models.hf_families`` under five plans. The golden replay (``tests/test_golden.py``) checks the
same against the stored programs, and every gloo equivalence test runs with replay on.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.utils._pytree as pytree

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


def _texts(case: tuple, monkeypatch: pytest.MonkeyPatch, on: bool, inputs: tuple = TOKENS) -> list[str]:
    """Every rank's program, ledger and memory report, compiled with replay ``on`` or off."""
    build, axes, kw = case
    monkeypatch.setenv(replay.REPLAY_ENV, "1" if on else "0")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        pm = fxpar.parallelize(build(), fxpar.Mesh(axes, fake=True), inputs, **kw)
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


SWEEP_PLANS = {  # HF families under plans of their own tp plan (a family without one is skipped) and plain ZeRO-2
    "tp2_hf_sp": ({"tp": 2}, fxpar.Plan(tp="hf", sequence_parallel=True)),
    "dp2_tp2_hf_full_recompute": ({"dp": 2, "tp": 2}, fxpar.Plan(tp="hf", recompute="full")),
    "dp2_tp2_hf_zero1_selective": ({"dp": 2, "tp": 2}, fxpar.Plan(tp="hf", zero=1, recompute="selective")),
    "pp2_tp2_hf": ({"pp": 2, "tp": 2}, fxpar.Plan(tp="hf", stages=2, microbatches=2)),
    "dp2_zero2": ({"dp": 2}, fxpar.Plan(zero=2)),
}


def _sweep_cases() -> list[tuple[str, str]]:
    """(family, plan) pairs of the opt-in sweep (``FXPAR_REPLAY_SWEEP=1``; about 8 minutes on 2 cores)."""
    if os.environ.get("FXPAR_REPLAY_SWEEP") != "1":
        return []
    from fxpar.models import hf_families

    return [(f, p) for p in SWEEP_PLANS for f in hf_families.FAMILIES]


def _mean_square(out: object, targets: object = None) -> torch.Tensor:
    leaf = next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return leaf.float().pow(2).mean()


@pytest.mark.parametrize(("family", "plan_name"), _sweep_cases(), ids=[f"{f}-{p}" for f, p in _sweep_cases()])
def test_replay_on_equals_off_on_hf_families(family: str, plan_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxpar.models import hf_families

    monkeypatch.setenv("FXPAR_SHARE_MIN", "2")  # the families have 2 layers: the second is replayed
    axes, plan = SWEEP_PLANS[plan_name]
    kw = dict(plan=plan, loss_fn=_mean_square) if "pp" in axes else dict(plan=plan)
    case = (hf_families.builder(family), axes, kw)
    try:
        off = _texts(case, monkeypatch, on=False, inputs=hf_families.inputs(family))
    except fxpar.PlanError as e:
        pytest.skip(f"{family} under {plan_name}: {e}")
    assert _texts(case, monkeypatch, on=True, inputs=hf_families.inputs(family)) == off
