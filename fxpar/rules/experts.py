"""Placements of ``fxpar::moe_experts`` and its backward (HF experts modules on an ep mesh, ``fxpar.moe``).

The op is token-wise: each token's output row depends on its own row, its routing and the expert weights. So:

* on a batch axis (``dp``, and ``ep``, which shards the batch too) tokens, routing and routing weights are
  ``Shard(0)``; the expert weights are replicated on ``dp`` (their gradients a ``Partial`` sum over the rank's
  tokens) and ``Shard(0)`` on ``ep`` (each rank holds ``E / ep`` experts, and ``fxpar.lower`` routes every token's
  rows to its experts' rank with all-to-alls: the weight gradients come back whole for the rank's own experts);
* on any other axis (``tp``) everything is replicated: the experts run whole on each rank.
"""

from __future__ import annotations

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.moe import MOE_BACKWARD, MOE_FORWARD
from fxpar.rules.registry import Candidate
from fxpar.split import BATCH_AXES

EXPERT_OPS = (MOE_FORWARD, MOE_BACKWARD)


def experts_candidate(node: fx.Node, axis: str) -> Candidate:
    """The one placement ``node`` (a ``moe_experts`` forward or backward) takes on mesh axis ``axis``."""
    r = Replicate()
    tokens = Shard(0)
    weights: Placement = Shard(0) if axis == "ep" else r
    grads: Placement = Shard(0) if axis == "ep" else Partial()
    backward = node.target is MOE_BACKWARD
    if axis not in BATCH_AXES:
        return Candidate((r,) * (6 if backward else 5), (r, r, r, r) if backward else r)
    if backward:  # (grad, x, top_k_index, top_k_weights, gate_up_proj, down_proj) -> (dx, dweights, dgate_up, ddown)
        return Candidate((tokens, tokens, tokens, tokens, weights, weights), (tokens, tokens, grads, grads))
    return Candidate((tokens, tokens, tokens, weights, weights), tokens)
