"""Per-op sharding knowledge, for one mesh axis at a time.

``candidates(op, args, kwargs, current, n)`` lists the valid ways to run ``op`` on an axis of
``n`` ranks: for each, the placement every tensor argument must have and the placement(s) of
the output. fxpar's own rules (``@register``) take precedence; otherwise DTensor's registered
strategies answer through ``dtensor_adapter``. ``None`` means nobody knows the op.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch._ops import OpOverload
from torch.distributed.tensor.placement_types import Placement

Output = Placement | tuple[Placement | None, ...]


@dataclass(frozen=True)
class Candidate:
    """One way to run an op on one axis: input placements (tensor args, flattened) -> output."""

    inputs: tuple[Placement, ...]
    output: Output


RuleFn = Callable[[tuple[Any, ...], dict[str, Any], int], list[Candidate]]
FXPAR_RULES: dict[OpOverload, RuleFn] = {}


def register(*ops: OpOverload) -> Callable[[RuleFn], RuleFn]:
    """Register an fxpar rule for ``ops`` (used where DTensor has none, or is wrong)."""

    def deco(fn: RuleFn) -> RuleFn:
        for op in ops:
            FXPAR_RULES[op] = fn
        return fn

    return deco


def candidates(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], current: list[Placement], n: int
) -> list[Candidate] | None:
    """Valid strategies for ``op`` with fake global ``args`` on an axis of ``n`` ranks."""
    from fxpar.rules import attention  # noqa: F401  (registers rules)
    from fxpar.rules.dtensor_adapter import dtensor_candidates

    if op in FXPAR_RULES:
        return FXPAR_RULES[op](args, kwargs, n)
    return dtensor_candidates(op, args, kwargs, current, n)
