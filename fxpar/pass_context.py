"""What a pass may read besides the Program it is given (``def name(prog, ctx) -> Program``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from fxpar.modules import ModuleTable
from fxpar.plan import Plan


@dataclass
class Context:
    """What passes may read besides the Program: the module table and the plan, and timings."""

    modules: ModuleTable  # what the passes know of the user's modules (recorded at capture; never the live model)
    plan: Plan
    timings: dict[str, float] = field(default_factory=dict)
    # propagate's decisions for copies of repeated-block nodes, shared by the pipeline stages of one compile
    block_decisions: dict = field(default_factory=dict, repr=False)
    debug: int = int(os.environ.get("FXPAR_DEBUG", "0"))
