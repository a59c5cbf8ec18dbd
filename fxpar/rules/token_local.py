"""Token-local regions: Hugging Face MoE experts modules run on each dp rank's own tokens.

HF's experts modules (classes decorated with ``transformers.integrations.moe.use_experts_implementation``:
Mixtral's, Qwen-MoE's, OLMoE's, ...) take ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``
and return ``[T, H]`` in which each token's row depends only on that token's inputs and the expert weights (HF
never drops tokens). Inside, the default ``grouped_mm`` implementation sorts all tokens by expert, counts tokens
per expert and runs a grouped matmul over the sorted rows: global ops over the token dim that no per-op rule can
shard (a sort of sharded rows is not the shards' sorts). As a whole, though, the module is token-wise, so each dp
rank may run it on its own tokens: exactly what data parallelism does with any token-wise module.

So on the dp axis every node of such a module (forward and backward) runs locally on its rank's tokens, with no
collective inside: values with a token-count first dim are ``Shard(0)`` (their local shapes follow the batch
split), values computed from parameters alone are replicated, and the rest (per-expert counts, the expert weights'
gradients: sums over this rank's tokens) are ``Partial("sum")``. Only the boundary matters to the rest of the
program: tokens in and out are batch-sharded as everywhere, and the weight gradients are partial, all-reduced once
like every dp gradient.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.ir import Program, tensor_val
from fxpar.rules.registry import Candidate


def is_hf_experts(module: torch.nn.Module) -> bool:
    """A module built by HF's ``use_experts_implementation`` (it sets these attributes in ``__init__``)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "is_concatenated")


class TokenLocal:
    """The nodes of each HF experts module, and the token count ``T`` each region's inputs carry."""

    def __init__(self, prog: Program, experts_paths: list[str]) -> None:
        paths = experts_paths
        self.region: dict[str, str] = {}
        for n in prog.graph.nodes:
            prov = prog.provenance.get(n.name)
            if n.op == "call_function" and prov is not None:
                path = next((p for p in paths if prov.module == p or prov.module.startswith(p + ".")), None)
                if path is not None:
                    self.region[n.name] = path
        self.tokens: dict[str, int | None] = {}
        self.params = {name for _, name in prog.signature.params}

    def __contains__(self, name: str) -> bool:
        return name in self.region

    def candidate(self, node: fx.Node, tensor_args: list[fx.Node], current: list[Placement]) -> Candidate | None:
        """The region's placements for ``node`` on the dp axis, or None when its tokens are not batch-sharded."""
        path = self.region[node.name]
        tokens = self.tokens.get(path)
        if tokens is None:
            # known from the first node that reads the tokens; a node before it (mixed precision's cast of an
            # expert weight, inside the module) reads parameters only and is placed by the usual rules
            tokens = self.tokens[path] = self._token_count(node, tensor_args, current)
        if tokens is None:
            return None
        inputs = tuple(self._input(a, p, tokens) for a, p in zip(tensor_args, current, strict=True))
        val = node.meta["val"]
        from_tokens = any(not isinstance(p, Replicate) for p in inputs)
        if isinstance(val, (tuple, list)):
            output = tuple(None if not isinstance(v, torch.Tensor) else _placement(v, tokens, from_tokens) for v in val)
        else:
            output = _placement(val, tokens, from_tokens)
        return Candidate(inputs, output)

    def _input(self, arg: fx.Node, current: Placement, tokens: int) -> Placement:
        if arg.name in self.region:
            return current  # produced inside: as the region placed it, never redistributed
        return Shard(0) if _token_shaped(tensor_val(arg), tokens) else Replicate()

    def _token_count(self, node: fx.Node, tensor_args: list[fx.Node], current: list[Placement]) -> int | None:
        """``T``: the first dim of the region's first batch-sharded input from outside (its hidden states)."""
        rows = Counter(tensor_val(a).shape[0] for a, p in zip(tensor_args, current, strict=True)
                       if a.name not in self.region and a.name not in self.params and isinstance(p, Shard)
                       and p.dim == 0 and tensor_val(a).ndim >= 1)
        return rows.most_common(1)[0][0] if rows else None


def _token_shaped(val: torch.Tensor | None, tokens: int) -> bool:
    return val is not None and val.ndim >= 1 and val.shape[0] > 0 and val.shape[0] % tokens == 0


def _placement(val: torch.Tensor, tokens: int, from_tokens: bool) -> Placement:
    if _token_shaped(val, tokens):
        return Shard(0)
    return Partial() if from_tokens else Replicate()
