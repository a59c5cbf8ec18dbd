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

import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fxpar.compiled import Compiled, compile_model
from fxpar.errors import FxparWarning
from fxpar.input_shapes import InputCheck
from fxpar.params import bind_runners
from fxpar.plan import Plan
from fxpar.stage_state import STATE_HELD_BY_NO_STAGE
from fxpar.state_paths import non_persistent_buffers
from fxpar.verify import verify


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
    with all_in_mode(source.model, training), warnings.catch_warnings():
        # the module keeps the state the first program registered: that program's warning said what it lacks
        warnings.filterwarnings("ignore", message=STATE_HELD_BY_NO_STAGE, category=FxparWarning)
        return compile_model(source.model, compiled.mesh, source.example_inputs, same_split(compiled),
                             source.loss_fn)


class ModeSwitching:
    """Mixin of ``ParallelModule``: ``train(mode)`` swaps in the program (and what the rank binds of it) compiled
    in ``mode``, compiling it on the first switch. Reads the module's ``_compiled``, ``_stage_buffers``,
    ``_runners``, ``_executor``, ``_inputs``, ``proof``, ``_rank``, ``_source`` and ``_modes``."""

    def train(self, mode: bool = True) -> Any:
        """Run the program compiled in ``mode``: ``pm.eval()`` the model as ``model.eval()`` runs it (compiled on
        the first switch, every module in eval mode), ``pm.train()`` the program compiled first (``fxpar.modes``).
        Call it on every rank, as the step itself."""
        if "_modes" in self.__dict__:  # not while ``nn.Module`` sets itself up; a failed switch leaves the mode
            self._switch_to(mode)
        return super().train(mode)

    def _switch_to(self, mode: bool) -> None:
        current = self._compiled.training
        if mode == current:
            return
        self._modes[current] = ModeRun(self._compiled, self._stage_buffers, self._runners, self._executor,
                                       self._inputs, self.proof)
        run = self._modes.get(mode) or self._compile_mode(mode)
        self._compiled, self._stage_buffers, self._runners = run.compiled, run.stage_buffers, run.runners
        self._executor, self._inputs, self.proof = run.executor, run.inputs, run.proof

    def _compile_mode(self, mode: bool) -> ModeRun:
        source = self._source
        if source is None:
            raise RuntimeError(f"this ParallelModule holds only the program compiled in {_mode_name(not mode)} mode "
                               f"and cannot compile the {_mode_name(mode)} one: build it with fxpar.parallelize "
                               "(or pass example_inputs= with the model), or compile the model in the mode you run")
        compiled = compile_in_mode(source, self._compiled, mode)
        stage_buffers: dict[int, list[torch.Tensor]] = {}
        runners: dict[int, Any] = {}
        if self._rank is not None:
            buffers = {**dict(source.model.named_buffers(remove_duplicate=False)),  # trained statistics
                       **dict(self.named_buffers())}
            stage_buffers, runners = bind_runners(self, compiled, buffers, self._rank,
                                                  non_persistent_buffers(source.model))
        run = ModeRun(compiled, stage_buffers, runners, None, InputCheck(compiled, self._rank), None)
        held = self._compiled
        self._compiled = compiled  # ``verify`` reads the module's program
        try:
            run.proof = verify(self)
        finally:
            self._compiled = held
        return run


def _mode_name(training: bool) -> str:
    return "training" if training else "evaluation"
