"""The rule table: fxpar's per-op sharding rules register here (``@register(op)``), answers are memoized.

Answers depend only on the op, the arguments' shapes, strides, dtypes and devices, the non-tensor
arguments, the current placements and ``n``, and the repeated layers of a model ask the same
questions again (about 8x fewer lookups at 8 Llama layers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch
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


_CACHE: dict[Hashable, list[Candidate] | None] = {}
_CACHE_MAX = 1 << 16  # entries are small (placements, no tensors); cleared when full


def _key(x: Any) -> Hashable:
    """A hashable stand-in for a rule's argument: tensors by metadata, scalars with their type."""
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype, x.device)
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, tuple(_key(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v)) for k, v in sorted(x.items())))
    return (type(x).__name__, x)  # 1, 1.0 and True compare equal; keep them apart


def _memoized(fn: Callable[..., list[Candidate] | None]) -> Callable[..., list[Candidate] | None]:
    """Cache ``fn(op, args, kwargs, current, n)`` on a metadata key; ``fn.__wrapped__`` is the uncached lookup.

    Arguments that cannot be hashed (symbolic sizes) skip the cache; a raising lookup is not cached.
    """

    @functools.wraps(fn)
    def cached(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], current: list[Placement],
               n: int) -> list[Candidate] | None:
        try:
            key = (op, _key(args), _key(kwargs), tuple(current), n)
            found = _CACHE.get(key, _CACHE)
        except TypeError:  # unhashable, e.g. a SymInt size
            return fn(op, args, kwargs, current, n)
        if found is _CACHE:
            if len(_CACHE) >= _CACHE_MAX:
                _CACHE.clear()
            found = _CACHE[key] = fn(op, args, kwargs, current, n)
        return None if found is None else list(found)

    return cached
