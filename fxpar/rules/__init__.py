"""Per-op sharding knowledge, for one mesh axis at a time.

``candidates(op, args, kwargs, current, n)`` lists the valid ways to run ``op`` on an axis of
``n`` ranks: for each, the placement every tensor argument must have and the placement(s) of
the output. fxpar's own rules (``@register``) take precedence; otherwise DTensor's registered
strategies answer through ``dtensor_adapter``. ``None`` means nobody knows the op.

Answers are memoized: they depend only on the op, the arguments' shapes, strides, dtypes and
devices, the non-tensor arguments, the current placements and ``n``, and the repeated layers of
a model ask the same questions again (about 8x fewer lookups at 8 Llama layers).
"""

from __future__ import annotations

from typing import Any

from torch._ops import OpOverload
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.placement_types import Placement

from fxpar.global_means import MEAN
from fxpar.rules import attention, bmm4, copies, index, norms, scaled_mm, token_matmul  # noqa: F401  (each registers its rules)
from fxpar.rules.dtensor_adapter import dtensor_candidates
from fxpar.rules.registry import FXPAR_RULES, Candidate, Output, RuleFn, _memoized, register

__all__ = ["FXPAR_RULES", "Candidate", "Output", "RuleFn", "candidates", "register"]


@_memoized
def candidates(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], current: list[Placement], n: int
) -> list[Candidate] | None:
    """Valid strategies for ``op`` with fake global ``args`` on an axis of ``n`` ranks."""
    found = FXPAR_RULES[op](args, kwargs, n) if op in FXPAR_RULES else dtensor_candidates(op, args, kwargs, current, n)
    if found is not None and divides_by_local_count(op, args, kwargs):
        found = [c for c in found if all(isinstance(p, Replicate) for p in c.inputs)]
    return found


def divides_by_local_count(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A loss op (or its backward) with ``reduction=mean`` divides by the element count of the tensors it is given:
    on a shard that is the shard's count, not the whole tensor's, so it runs on whole inputs only. (DTensor offers
    ``mse_loss_backward`` on batch shards: each rank's gradient came out ``dp`` times too large.) Ops told the count
    (``total_weight``, ``nll_loss``'s backward) are exact on shards; ``fxpar.global_means`` rewrites the common
    means into sums, which shard."""
    names = [a.name for a in op._schema.arguments]
    if "reduction" not in names or "total_weight" in names:
        return False
    i = names.index("reduction")
    value = kwargs.get("reduction", args[i] if i < len(args) else op._schema.arguments[i].default_value)
    return value == MEAN
