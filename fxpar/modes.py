"""Training and evaluation programs: ``pm.eval()`` runs the model as ``model.eval()`` would, ``pm.train()`` as compiled.

A rank program is captured with the model's modules in the modes they had (``module.training``), and a module's
mode changes what its forward does: dropout draws masks or passes its input through, BatchNorm normalizes by the
batch's statistics and writes its running ones, or reads the running ones, and any model code may branch on
``self.training``. So running the training program after ``pm.eval()`` would be a silent wrong answer on the
validation set (dropout still on, the running statistics overwritten by validation batches).

``pm.eval()`` therefore compiles the model again, once, with every module in eval mode (``model.eval()``; the
user's model gets its own modes back afterwards), and from then on ``pm(...)``, ``pm.step(...)``, ``pm.program``,
``pm.ledger``, ``pm.memory`` and ``pm.proof`` are that program's: what runs is what is reported. ``pm.train()``
switches back to the program compiled first (the model's modes as they were, a frozen BatchNorm included). Both
programs share the parameters (the same DTensors, which the optimizer holds) and the buffers the training program
writes (the evaluation program reads the running statistics training left). The second compile keeps the first
one's plan exactly, pipeline split points included, and refuses to run if it would store a parameter differently.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fxpar.compiled import Compiled, compile_model
from fxpar.plan import Plan


class ModeSource:
    """What compiling the model in another mode needs: the user's model (read, never left in another mode), and
    the example inputs and loss it was compiled with. The model is held weakly: a ``ParallelModule`` must not keep
    a whole unsharded copy of the weights alive after the user drops it (``del model`` frees it as before)."""

    def __init__(self, model: torch.nn.Module, example_inputs: Any, loss_fn: Callable[..., torch.Tensor] | None
                 ) -> None:
        self._model = weakref.ref(model)
        self.example_inputs, self.loss_fn = example_inputs, loss_fn

    @property
    def model(self) -> torch.nn.Module:
        model = self._model()
        if model is None:
            raise RuntimeError("pm.eval() / pm.train() compile the model again in the other mode, and the model given "
                               "to fxpar.parallelize has been freed: keep a reference to it until both modes have "
                               "run once, or parallelize the model in the mode you run")
        return model


@dataclass
class ModeRun:
    """One mode's compiled program and what this rank binds of it (``ParallelModule`` swaps these)."""

    compiled: Compiled
    stage_buffers: dict[int, list[torch.Tensor]]
    runners: dict[int, Any]
    executor: Any
    inputs: Any  # ``InputCheck`` of this program
    proof: Any


@contextmanager
def all_in_mode(model: torch.nn.Module, training: bool) -> Iterator[None]:
    """Every module of ``model`` in ``training`` mode inside the block; each module's own mode restored after."""
    before = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield
    finally:
        for m, mode in before:
            m.training = mode


def same_split(compiled: Compiled) -> Plan:
    """``compiled``'s resolved plan with its pipeline split points pinned (a cost-balanced split could move when
    the other mode's graph costs differ, and the parameters each rank holds must not)."""
    starts = compiled.plan.notes.get("stage starts")
    if len(compiled.stages) == 1 or not starts:
        return compiled.plan
    return compiled.plan.resolved(stages=starts.split(", "))


def compile_in_mode(source: ModeSource, compiled: Compiled, training: bool) -> Compiled:
    """``source.model`` compiled again for ``compiled``'s mesh and plan, every module in ``training`` mode."""
    with all_in_mode(source.model, training):
        return compile_model(source.model, compiled.mesh, source.example_inputs, same_split(compiled),
                             source.loss_fn)
