"""Context parallelism: the sequence of every activation sharded over the ``cp`` axis, attention by all-gathered k/v.

Three pieces of knowledge, used by ``propagate`` on the cp axis only:

* **Only the sequence is sharded.** The cp axis splits the sequence load-balanced (``fxpar.split``: rank ``i`` holds
  chunks ``i`` and ``2 * cp - 1 - i``), which is not the contiguous split DTensor's view rules assume. So on cp a
  candidate may shard only dims of exactly the sequence length: elementwise ops, matmuls over rows, reductions
  over other dims and views that carry the sequence dim through unchanged all keep the same positions on the same
  rank, whatever order those positions are in. A view that splits or merges the sequence (``[B, S] -> [B * S]``)
  has no such candidate and gathers first; ``fxpar.simplify.tokens_unflattened`` removes Linear's flattens.
* **Sharding is preferred.** Every cp rank is called with the same batch, so nothing would shard it by itself: a
  value with a sequence dim that stays whole on cp costs its bytes, as if it moved them.
* **Attention** runs each rank's queries against the whole sequence's keys and values, all-gathered over cp (as
  Llama 3's context parallelism does; ring attention would overlap the k/v transfers with compute but needs an
  online-softmax merge of partial outputs). The backward's k and v gradients are partial sums, reduce-scattered
  back to their sequence shards. A causal kernel (``is_causal=True``) is lowered with an explicit mask of this
  rank's query positions (``fxpar.lower``): its queries are not a prefix of the sequence.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.ir import tensor_val
from fxpar.rules.registry import Candidate

aten = torch.ops.aten
# the ops of GQA's repeat_kv and of eager attention's k transpose: none has fewer elements than its input
REPEATS = {aten.unsqueeze.default, aten.expand.default, aten.clone.default, aten.view.default,
           aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.permute.default}
SDPA_FORWARD = {aten._scaled_dot_product_flash_attention_for_cpu.default}
SDPA_BACKWARD = {aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
QUERY_DIM = 2  # [batch, heads, seq, head_dim]


class ContextPolicy:
    """What the cp axis allows and prefers, for a program whose sequence length is ``seq``."""

    def __init__(self, seq: int) -> None:
        self.seq = seq

    def allowed(self, cand: Candidate, tensor_args: list[fx.Node], node: fx.Node) -> bool:
        """Whether every dim ``cand`` shards, input or output, is a sequence dim."""
        for arg, p in zip(tensor_args, cand.inputs, strict=False):
            if isinstance(p, Shard) and tensor_val(arg).shape[p.dim] != self.seq:
                return False
        return all(not isinstance(p, Shard) or v.shape[p.dim] == self.seq for p, v in _outputs(cand, node))

    def sequence_shard(self, arg: fx.Node) -> Placement:
        """``Shard`` on ``arg``'s sequence dim (its first dim of the sequence length), or ``Partial`` without one."""
        shape = tensor_val(arg).shape
        return Shard(list(shape).index(self.seq)) if self.seq in shape else Partial()

    def penalty(self, cand: Candidate, node: fx.Node) -> float:
        """Bytes of ``cand``'s outputs that have a sequence dim but are not sharded on one."""
        total = 0.0
        for p, v in _outputs(cand, node):
            if self.seq in v.shape and not isinstance(p, (Shard, Partial)):
                total += v.numel() * v.element_size()
        return total

    def attention(self, node: fx.Node) -> Candidate | None:
        """Queries (and outputs) sharded on the sequence, keys and values whole: the all-gather k/v strategy."""
        if node.target in SDPA_FORWARD:
            q, k, v = node.args[:3]
            mask = node.kwargs.get("attn_mask")
            if tensor_val(q).shape[QUERY_DIM] != self.seq or tensor_val(k).shape[QUERY_DIM] != self.seq:
                return None
            seq, whole = Shard(QUERY_DIM), Replicate()
            return Candidate((seq, whole, whole, *_mask(mask)), (seq, seq))
        if node.target in SDPA_BACKWARD:
            grad_out, q, k, v, out, lse = node.args[:6]
            if tensor_val(q).shape[QUERY_DIM] != self.seq:
                return None
            seq, whole = Shard(QUERY_DIM), Replicate()
            inputs = (seq, seq, whole, whole, seq, seq, *_mask(node.kwargs.get("attn_mask")))
            return Candidate(inputs, (seq, Partial(), Partial()))
        return None


def gather_before_repeat(graph: fx.Graph, placements: dict, arg_placements: dict, ax: int) -> int:
    """Move each cp all-gather of a value made by a chain of ``REPEATS`` (GQA's ``repeat_kv``: unsqueeze, expand,
    clone, view; eager attention's ``k.transpose``) to the chain's input: the chain then runs on the whole
    sequence, the gather moves the kv heads instead of the repeated query heads, and two layouts of one k share
    one gather; a chain that starts from a whole value (a saved, gathered k in the backward) needs no gather at all.
    Returns how many chains were moved.

    Requires: ``placements``/``arg_placements`` from ``propagate``. Ensures: the same values on every rank; no
    gather moves more bytes than before.
    """
    moved = 0
    for node in graph.nodes:
        args = node.args[0] if node.op == "output" else _tensor_args(node)  # as propagate lists them
        for arg, want in zip(args, arg_placements.get(node.name, ()), strict=False):
            if want is None or not isinstance(want[ax], Replicate) or not isinstance(_on(placements, arg, ax), Shard):
                continue
            top = arg
            while top.target in REPEATS and isinstance(source := _on(placements, top.args[0], ax), (Shard, Replicate)):
                _set(placements, top.name, ax, Replicate())
                arg_placements[top.name] = (_with(arg_placements[top.name][0], ax, Replicate()),
                                            *arg_placements[top.name][1:])
                top = top.args[0]
                if isinstance(source, Replicate):  # sliced from a whole value only to be gathered again: no gather
                    break
            moved += top is not arg
    return moved


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    import torch.utils._pytree as pytree

    return [a for a in pytree.tree_leaves((node.args, node.kwargs)) if tensor_val(a) is not None]


def _on(placements: dict, node: fx.Node | None, ax: int) -> Placement | None:
    p = placements.get(node.name) if isinstance(node, fx.Node) else None
    return p[ax] if isinstance(p, tuple) and p and not isinstance(p[0], tuple) else None


def _with(per_axis: tuple, ax: int, p: Placement) -> tuple:
    return (*per_axis[:ax], p, *per_axis[ax + 1:])


def _set(placements: dict, name: str, ax: int, p: Placement) -> None:
    placements[name] = _with(placements[name], ax, p)


def _mask(mask: fx.Node | None) -> tuple[Placement, ...]:
    """An attention mask's placement: its query rows sharded, or replicated where that dim is a broadcast 1."""
    if mask is None:
        return ()
    rows = tensor_val(mask).shape[-2]
    return (Shard(tensor_val(mask).ndim - 2) if rows > 1 else Replicate(),)


def _outputs(cand: Candidate, node: fx.Node) -> list[tuple[Placement, torch.Tensor]]:
    """(placement, value) of each tensor output of ``node`` under ``cand``."""
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    outs = cand.output if isinstance(cand.output, tuple) else (cand.output,)
    return [(p, v) for p, v in zip(outs, vals, strict=False) if isinstance(v, torch.Tensor) and p is not None]
