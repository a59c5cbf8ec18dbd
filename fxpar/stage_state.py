"""Every parameter and buffer of a pipelined model is held by exactly one stage.

The stage split gives each stage the state its graph reads (``fxpar.stages``). State the forward never reads (a
spare parameter, a frozen BatchNorm's ``num_batches_tracked``) is read by no stage; ``hold_unread_state`` gives it
to the stage of its module's neighbours, so the rank holding that stage holds it, as a whole-model capture holds
every parameter. ``warn_if_state_held_by_no_stage`` is the guard behind it: it names any state still on no stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxpar.errors import warn_at_callers_line
from fxpar.state_paths import non_persistent_buffers, owner_module

if TYPE_CHECKING:
    from fxpar.ir import Program
    from fxpar.stages import StageGraph

STATE_HELD_BY_NO_STAGE = "held by no pipeline stage"  # the warning's words (``fxpar.modes`` filters it)


def hold_unread_state(gm: fx.GraphModule, graphs: list[StageGraph]) -> None:
    """Give each parameter and buffer of ``gm`` that no stage's graph reads to one stage: the stage whose graph
    reads the state with the longest module path in common with it (stage 0 where none shares a prefix).

    Requires: ``graphs`` are ``gm``'s stage graphs, which read state through ``get_attr``. Ensures: every tensor of
    ``gm``'s ``named_parameters()`` and ``named_buffers()`` is an attribute of exactly one stage module (tied
    tensors once), so a stage's trace takes it as an input and the rank holds it, as a whole-model capture holds
    every parameter: its gradient is None, and ``pm.state_dict()`` and checkpoints keep it."""
    reads = [{x.target for x in g.gm.graph.nodes if x.op == "get_attr"} for g in graphs]
    held = {id(t) for g in graphs for t in (*g.gm.parameters(), *g.gm.buffers())}
    non_persistent = non_persistent_buffers(gm)
    state = [*((True, name, t) for name, t in gm.named_parameters()),
             *((False, name, t) for name, t in gm.named_buffers())]
    for is_param, fqn, t in state:
        if id(t) in held:
            continue
        held.add(id(t))
        s = max(range(len(graphs)), key=lambda k: (max((_common_prefix(fqn, r) for r in reads[k]), default=0), -k))
        owner, leaf = owner_module(graphs[s].gm, fqn)
        if is_param:
            owner.register_parameter(leaf, t)
        else:
            owner.register_buffer(leaf, t, persistent=fqn not in non_persistent)


def _common_prefix(a: str, b: str) -> int:
    """How many leading module names the dotted paths ``a`` and ``b`` share (their last names excluded)."""
    n = 0
    for x, y in zip(a.split(".")[:-1], b.split(".")[:-1], strict=False):
        if x != y:
            break
        n += 1
    return n


def warn_if_state_held_by_no_stage(model: torch.nn.Module, programs: list[Program]) -> None:
    """Say which of ``model``'s parameters and persistent buffers no pipeline stage's program holds (none, after
    ``hold_unread_state``): ``pm.state_dict()``, ``pm.parameters()`` and checkpoints would leave them out."""
    held = {fqn for p in programs for fqn, _ in (*p.signature.params, *p.signature.buffers)}
    skipped = non_persistent_buffers(model)
    missing = [fqn for fqn, _ in (*model.named_parameters(), *model.named_buffers())
               if fqn not in held and fqn not in skipped]
    if missing:
        shown = ", ".join(repr(f) for f in missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        warn_at_callers_line(f"fxpar: {len(missing)} parameters or buffers are {STATE_HELD_BY_NO_STAGE}, because "
                             f"the model's forward reads none of them: {shown}. pm.parameters(), pm.state_dict() "
                             "and fxpar.checkpoint leave them out (the model keeps its own values); without "
                             "stages every rank holds them")


def constants_stay_constants(sub: fx.GraphModule, gm: fx.GraphModule) -> None:
    """Tensors the export lifted out of the model's code (``torch.tensor(...)`` in a forward) are plain attributes of
    ``gm``, which AOTAutograd bakes into the graph as constants; ``fx.GraphModule`` registers every copied tensor
    attribute as a buffer, which would make each one a stage input named like a model buffer the model does not
    have. Put them back as plain attributes, as in the whole-model capture."""
    buffers = dict(gm.named_buffers())
    for n in sub.graph.nodes:
        if n.op == "get_attr" and n.target not in buffers:
            owner_path, _, leaf = n.target.rpartition(".")
            owner = sub.get_submodule(owner_path)
            value = owner._buffers.pop(leaf, None)
            if value is not None:
                setattr(owner, leaf, value)
