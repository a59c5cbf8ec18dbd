"""Lowering for a context-parallel (``cp``) axis: the causal mask of this rank's query positions (methods of
``fxpar.lower.retrace.Lowerer``).

A causal attention kernel over queries that are this rank's load-balanced pieces of the sequence cannot use
``is_causal`` (it masks as if the queries were positions ``0..len-1``); it gets an explicit additive mask of the
rank's own positions instead, built in the program and rebuilt in the backward rather than saved.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from fxpar.rules.context import SDPA_BACKWARD
from fxpar.split import CONTEXT_AXIS

aten = torch.ops.aten
CAUSAL_ATTENTION = {  # kernel -> index of its is_causal argument
    aten._scaled_dot_product_flash_attention_for_cpu.default: 4,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: 7,
}


class ContextMask:
    """The methods ``_Lowerer`` uses for causal attention on a cp axis (state lives on the lowerer)."""

    def causal_on_context(self, node: fx.Node, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A causal attention kernel whose queries are this rank's cp pieces of the sequence: ``is_causal`` masks
        as if the queries were positions ``0..len-1``, so it is replaced by an explicit mask of their positions."""
        flag = CAUSAL_ATTENTION[node.target]
        if CONTEXT_AXIS not in self.mesh.names or len(args) <= flag or args[flag] is not True:
            return args, kwargs
        ax = self.mesh.axis_index(CONTEXT_AXIS)
        q = 1 if node.target in SDPA_BACKWARD else 0
        q_placement = self.prog.arg_placements[node.name][q][ax]
        if q_placement != Shard(2):  # queries whole, or sharded on batch or heads: is_causal holds as it is
            return args, kwargs
        seq = node.args[q].meta["val"].shape[q_placement.dim]
        keys = node.args[q + 1].meta["val"].shape[q_placement.dim]
        assert "attn_mask" not in kwargs and keys == seq, "a causal kernel over the whole sequence, without a mask"
        name = "cp_causal_mask"
        if name not in self.env:
            self.env[name] = self.causal_mask(seq, ax, node.args[q].meta["val"])
        return (*args[:flag], False, *args[flag + 1:]), {**kwargs, "attn_mask": self.env[name]}

    def causal_mask(self, seq: int, ax: int, like: torch.Tensor) -> fx.Node:
        """``[local, seq]`` additive mask: 0 where this rank's query position may see a key position, else -inf."""
        positions = self.split.indices(seq, ax, self.coord[ax])
        with self.at(recompute=True):  # the backward rebuilds it rather than saving it
            return self._causal_mask(positions, seq, like)

    def _causal_mask(self, positions: list[int], seq: int, like: torch.Tensor) -> fx.Node:
        half = len(positions) // 2  # two chunks of consecutive positions (fxpar.split)
        ints = {"dtype": torch.int64, "device": like.device}
        pieces = [self.emit(aten.arange.start, (p[0], p[-1] + 1), ints) for p in (positions[:half], positions[half:])]
        rows = self.emit(aten.unsqueeze.default, (self.emit(aten.cat.default, (pieces,)), 1))
        cols = self.emit(aten.unsqueeze.default, (self.emit(aten.arange.default, (seq,), ints), 0))
        hidden = self.emit(aten.lt.Tensor, (rows, cols))  # a key after the query
        zeros = self.emit(aten.zeros.default, ([len(positions), seq],), {"dtype": like.dtype, "device": like.device})
        mask = self.emit(aten.masked_fill.Scalar, (zeros, hidden, float("-inf")), name="cp_causal_mask",
                         placements=tuple(Replicate() for _ in self.mesh.names))
        return mask
