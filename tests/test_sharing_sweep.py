"""Opt-in sweep (``FXPAR_SHARING_SWEEP=1``; about 5 minutes on 2 cores): for every HF family of
``fxpar.models.hf_families`` under a pipeline, ZeRO-3 and the planner's own plan, every rank's program, ledger and
``pm.memory`` are equal with repeated blocks shared and with ``FXPAR_SHARING=0``, and the blocks are shared where
they can be (issue 19). A family a plan does not apply to (a clear ``PlanError``) is skipped. The README's "Compile
time" section reports its last run."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.utils._pytree as pytree

import fxpar

pytest.importorskip("transformers")
from fxpar.models import hf_families  # noqa: E402

PLANS = {
    "pp2_dp2": ({"pp": 2, "dp": 2}, fxpar.Plan(stages=2, microbatches=2)),
    "dp4_zero3": ({"dp": 4}, fxpar.Plan(zero=3)),
    "dp2_tp2_auto": ({"dp": 2, "tp": 2}, None),
}
WHOLE = {  # captured whole, and why: Falcon's attention makes tensors in its forward; T5's first layer differs
    "falcon": "a block's graph reads constants", "t5": "no repeated blocks"}
CASES = [(f, p) for p in PLANS for f in hf_families.FAMILIES] if os.environ.get("FXPAR_SHARING_SWEEP") == "1" else []


def _first_float_mean_square(out: object, targets: object = None) -> torch.Tensor:
    leaf = next(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())
    return leaf.float().pow(2).mean()


def _texts(family: str, plan_name: str, share: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[str], object]:
    axes, plan = PLANS[plan_name]
    monkeypatch.setenv("FXPAR_SHARING", "1" if share else "0")
    inputs = hf_families.inputs(family)
    kw = dict(loss_fn=_first_float_mean_square) if "pp" in axes else {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)
        try:
            pm = fxpar.parallelize(hf_families.builder(family)(), fxpar.Mesh(axes, fake=True), inputs, plan=plan, **kw)
        except fxpar.PlanError as e:
            pytest.skip(f"{family} under {plan_name}: {e}")
    world = pm.mesh.size
    return [pm.program(r) + pm.ledger_table(r) + str(pm.memory(r)) for r in range(world)], pm.captures


@pytest.mark.parametrize(("family", "plan_name"), CASES, ids=[f"{f}-{p}" for f, p in CASES])
def test_sharing_on_equals_off(family: str, plan_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FXPAR_SHARE_MIN", "2")  # the families have 2 layers
    shared, captures = _texts(family, plan_name, True, monkeypatch)
    whole, _ = _texts(family, plan_name, False, monkeypatch)
    assert shared == whole, f"{family} under {plan_name}: programs differ ({captures})"
    assert captures.whole == (family in WHOLE) and WHOLE.get(family, "") in captures.reason, captures
