"""Runs of block calls the model's loop makes exported as one op (``fxpar.block_chain``, issue 19).

Each model compiles with sharing on (runs where the model's run proves them) to the programs and ledgers a
whole-model capture gives (``FXPAR_SHARING=0``); the expected run layout is checked through ``Captures.chained``.
A plan the export does not follow falls back to a call per layer; one model trains like the single device on gloo.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

import fxpar
import fxpar.capture
from fxpar.block_chain import Chain, plan_chains
from fxpar.testing import assert_equivalent, loop_models

INPUTS = (torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0)),)


def _compile(build: Callable[[], torch.nn.Module], monkeypatch: pytest.MonkeyPatch, sharing: bool = True,
             axes: dict[str, int] | None = None) -> fxpar.ParallelModule:
    with monkeypatch.context() as m:
        m.setenv("FXPAR_SHARING", "1" if sharing else "0")
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", fxpar.FxparWarning)
            return fxpar.parallelize(build(), fxpar.Mesh(axes or {"dp": 2}, fake=True), INPUTS)


def _assert_as_whole(pm: fxpar.ParallelModule, build: Callable[[], torch.nn.Module],
                     monkeypatch: pytest.MonkeyPatch) -> None:
    whole = _compile(build, monkeypatch, sharing=False, axes=dict(pm._compiled.mesh.axes))
    assert whole.captures.whole
    for rank in (0, pm._compiled.mesh.size - 1):
        assert pm.program(rank, verbosity=2) == whole.program(rank, verbosity=2)
        assert pm.ledger(rank) == whole.ledger(rank)


@pytest.mark.parametrize(("build", "chained"), [
    (loop_models.plain_loop, 6),  # one run of all six calls
    (loop_models.middle_out, 6),  # two runs: layers 0-2 and 3-5 (layer 2's output is returned)
    (loop_models.kept_states, 0),  # every output is read at the end
    (loop_models.scaled_between, 0),  # an op reads every output
    (loop_models.eager_between, 6),  # the op between layers runs only outside an export: the plan run sees that too
], ids=["plain", "middle_out", "kept_states", "scaled_between", "eager_between"])
def test_runs_are_exported_as_one_call_only_where_the_model_proves_them(build: Callable[[], torch.nn.Module],
                                                                      chained: int,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pm = _compile(build, monkeypatch, axes={"dp": 2, "tp": 2})
    captures = pm.captures
    assert (captures.whole, captures.blocks, captures.distinct, captures.chained) == (False, 6, 1, chained), captures
    _assert_as_whole(pm, build, monkeypatch)


def test_a_shared_input_needing_a_gradient_makes_no_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer reads a context computed from a parameter: its gradient is a sum over the calls, which a run's
    one op would hide, so each layer is its own call. Each layer's contribution is added onto the sum where the
    whole-model trace adds it, right after the op backward that computes it (``fxpar.grad_accumulation``; it was
    added after the layer's whole backward: the same numbers, another program), so the program is the whole
    capture's."""
    pm = _compile(loop_models.trained_context, monkeypatch, axes={"dp": 2, "tp": 2})
    assert pm.captures.chained == 0
    _assert_as_whole(pm, loop_models.trained_context, monkeypatch)


def test_the_runs_split_where_an_output_leaves_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """``middle_out`` returns layer 2's output: the plan ends a run there and starts the next at layer 3."""
    seen: list[list[Chain]] = []

    def planned(*args: object) -> list[Chain]:
        seen.append(plan_chains(*args))
        return seen[-1]

    monkeypatch.setattr(fxpar.capture, "plan_chains", planned)
    _compile(loop_models.middle_out, monkeypatch)
    assert [chain.paths for chain in seen[0]] == [("layers.0", "layers.1", "layers.2"),
                                                  ("layers.3", "layers.4", "layers.5")]


def test_a_run_the_export_does_not_call_as_planned_falls_back_to_a_call_per_layer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A (wrong) plan of one run over ``scaled_between``'s layers: the export's second call gets ``0.5 * h``, not
    the run's output, so the export is redone with a call per layer, and the program is the whole-model one."""

    def wrong(table: object, run_model: object) -> list[Chain]:
        plan_chains(table, run_model)  # (the sites and fake runs a plan leaves)
        return [Chain(fxpar.blocks.new_site_id(), tuple(f"layers.{i}" for i in range(6)), (0,), 2,
                      next(iter(table._runs)) + (0,))]

    monkeypatch.setattr(fxpar.capture, "plan_chains", wrong)
    pm = _compile(loop_models.scaled_between, monkeypatch)
    captures = pm.captures
    assert (captures.whole, captures.blocks, captures.chained) == (False, 6, 0), captures
    _assert_as_whole(pm, loop_models.scaled_between, monkeypatch)


def test_runs_escape_hatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FXPAR_CHAINS=0`` exports a call per layer, to the same program."""
    on = _compile(loop_models.plain_loop, monkeypatch)
    monkeypatch.setenv("FXPAR_CHAINS", "0")
    off = _compile(loop_models.plain_loop, monkeypatch)
    chained = [pm.captures.chained for pm in (on, off)]
    assert chained == [6, 0]
    assert on.program(1, verbosity=2) == off.program(1, verbosity=2)


def test_two_runs_train_like_the_single_device() -> None:
    """fp32, rtol 1e-5: outputs, gradients and parameters after 3 AdamW steps on dp=2 x tp=1 gloo ranks."""
    assert_equivalent(loop_models.middle_out, {"dp": 2}, None, INPUTS, steps=3)
