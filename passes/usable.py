"""Whether a sharding rule's candidate can be used for a node: its shape matches the op, lowering implements its
placements, and it shards no dim an earlier mesh axis already shards (``passes.propagate`` asks)."""

from __future__ import annotations

import warnings

import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.errors import FxparWarning
from fxpar.rules import Candidate

Taken = tuple[dict[int, set[int]], dict[int, set[int]]]  # tensor input / output index -> sharded dims


def fits(node: fx.Node, cand: Candidate, n_inputs: int) -> bool:
    """Whether a rule's candidate has ``node``'s structure: one placement per tensor input and, for an op with several
    outputs, one per output. A rule that answers in another shape (seen with torch 2.11's DTensor, on a GPU image
    outside fxpar's pinned torch: one input spec for ``aten.index.Tensor``'s two tensors, one output spec for
    ``aten.native_layer_norm``'s three outputs) cannot be read safely: it is ignored, with a warning naming the
    op, and the node runs as another candidate (at worst replicated)."""
    val = node.meta.get("val")
    fits = len(cand.inputs) == n_inputs
    if isinstance(val, (tuple, list)):
        fits = fits and isinstance(cand.output, tuple) and len(cand.output) == len(val)
    if not fits:
        outs = len(cand.output) if isinstance(cand.output, tuple) else 1
        warnings.warn(f"fxpar: a sharding rule for {node.target} answered with {len(cand.inputs)} input and {outs} "
                      f"output placements where the op has {n_inputs} tensor inputs and "
                      f"{len(val) if isinstance(val, (tuple, list)) else 1} outputs; that strategy is ignored",
                      FxparWarning, stacklevel=2)
    return fits


def plain(cand: Candidate) -> bool:
    """Whether ``cand`` uses only placements lowering implements (not DTensor's ``_StridedShard``, which a
    flatten of a tensor sharded on an inner dim yields: fxpar gathers before such a view instead)."""
    outs = cand.output if isinstance(cand.output, tuple) else (cand.output,)
    return all(p is None or type(p) in (Shard, Replicate, Partial) for p in (*cand.inputs, *outs))


def disjoint(cand: Candidate, taken: Taken) -> bool:
    """Whether ``cand`` shards no dim that an earlier mesh axis already shards (fxpar keeps one axis per dim)."""
    ins, outs = taken
    for i, p in enumerate(cand.inputs):
        if isinstance(p, Shard) and p.dim in ins.get(i, ()):
            return False
    for i, p in enumerate(cand.output if isinstance(cand.output, tuple) else (cand.output,)):
        if isinstance(p, Shard) and p.dim in outs.get(i, ()):
            return False
    return True
