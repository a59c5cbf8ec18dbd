"""What a pass may read besides the Program it is given (``def name(prog, ctx) -> Program``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from fxpar.plan import Plan


@dataclass
class Context:
    """What passes may read besides the Program: the user's model and plan, and timings."""

    model: torch.nn.Module
    plan: Plan
    timings: dict[str, float] = field(default_factory=dict)
    debug: int = int(os.environ.get("FXPAR_DEBUG", "0"))
