"""Sharding rule for ``lift_fresh_copy``: the copy the export makes of a tensor the model's forward creates
(``torch.tensor(...)`` in Falcon's attention, for one). DTensor has no strategy for it, so without this rule it ran
replicated with a warning; it is a copy, so any placement carries through unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules.registry import Candidate, register


@register(torch.ops.aten.lift_fresh_copy.default)
def lift_fresh_copy(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
    """Replicated, a partial sum, or sharded on any dim with at least ``n`` entries: the output as the input."""
    x = args[0]
    out = [Candidate((Replicate(),), Replicate()), Candidate((Partial(),), Partial())]
    return out + [Candidate((Shard(d),), Shard(d)) for d in range(x.ndim) if x.shape[d] >= n]
