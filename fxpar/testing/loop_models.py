"""Models whose loops over repeated layers do more than hand each layer the last one's output: picklable factories
for the runs of calls exported as one op (``fxpar.block_chain``).

* ``plain_loop``: ``h = layer(h, pos)`` over every layer, ``pos`` a buffer every layer reads (one run).
* ``kept_states``: every layer's output kept in a list and averaged at the end (no run: each output is read).
* ``middle_out``: the output after layer 2 returned beside the last (two runs, split there).
* ``scaled_between``: ``h = 0.5 * layer(h, pos)`` (no run: an op reads each output).
* ``trained_context``: every layer reads a context computed from a parameter (no run: its gradient sums over the
  layers).
* ``eager_between``: ``h = 0.5 * h`` between layers only when not exported (``torch.compiler.is_exporting()``, as
  Hugging Face's MoE layers pick their kernel): exported, one run.
"""

from __future__ import annotations

import torch
from torch import nn


class _Layer(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.proj(self.norm(h))) * context


class _Loop(nn.Module):
    def __init__(self, width: int, layers: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Linear(width, width)
        self.layers = nn.ModuleList(_Layer(width) for _ in range(layers))
        self.context = nn.Linear(width, width)
        self.register_buffer("pos", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x)
        context = self.context(x) if self.kind == "trained_context" else self.pos
        kept, middle = [], None
        for i, layer in enumerate(self.layers):
            h = layer(h, context)
            if self.kind == "scaled_between" or self.kind == "eager_between" and not torch.compiler.is_exporting():
                h = 0.5 * h
            kept.append(h)
            if i == 2:
                middle = h
        if self.kind == "kept_states":
            return torch.stack(kept).mean(0)
        if self.kind == "middle_out":
            return h, middle
        return h


def plain_loop(width: int = 16, layers: int = 6) -> nn.Module:
    return _Loop(width, layers, "plain")


def kept_states(width: int = 16, layers: int = 6) -> nn.Module:
    return _Loop(width, layers, "kept_states")


def middle_out(width: int = 16, layers: int = 6) -> nn.Module:
    return _Loop(width, layers, "middle_out")


def scaled_between(width: int = 16, layers: int = 6) -> nn.Module:
    return _Loop(width, layers, "scaled_between")


def trained_context(width: int = 16, layers: int = 6) -> nn.Module:
    return _Loop(width, layers, "trained_context")


def eager_between(width: int = 16, layers: int = 6) -> nn.Module:
    return _Loop(width, layers, "eager_between")
