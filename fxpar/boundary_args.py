"""The fake inputs a pipeline stage is captured on for the values it receives from the stage before.

A received floating value requires grad when a trainable parameter flows into it: the receiving stage computes its
gradient and sends it back (``signature.input_grads``; the sender reads that list). A value computed from the
model's inputs alone (a mask) carries no parameter's gradient and is received without one.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx


def boundary_arg(gm: fx.GraphModule, name: str, fake_mode: Any, carries: bool) -> torch.Tensor:
    """A fake tensor for a received boundary value; a floating value a trainable parameter flows into (``carries``)
    requires grad: its gradient is sent back. (A mask computed from the inputs alone has none to send.)"""
    ph = next(p for p in gm.graph.nodes if p.op == "placeholder" and p.name == re.sub(r"\W", "_", name))
    val = ph.meta["val"]
    with fake_mode:
        t = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)
    return t.requires_grad_(val.is_floating_point() and carries)


def carrying_gradients(gm: fx.GraphModule, model: torch.nn.Module) -> set[str]:
    """The exported forward's values a trainable parameter flows into: only these can carry a parameter's gradient
    (the model's inputs never require grad: ``refuse_inputs_needing_grad``). Flowing through an op that has no
    derivative still counts: the set may hold too much (a gradient of zeros sent), never too little."""
    trainable = {fqn for fqn, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    carry: set[str] = set()
    for n in gm.graph.nodes:
        if (n.op == "get_attr" and n.target in trainable) or \
                (n.op != "get_attr" and any(a.name in carry for a in n.all_input_nodes)):
            carry.add(n.name)
    return carry
