"""Models whose buffers carry state besides their weights: a buffer only read (its value comes with a checkpoint),
a buffer only written (a call counter). Module-level so that spawned ranks can unpickle them."""

from __future__ import annotations

import torch
from torch import nn


class ScaledStreamLM(nn.Module):
    """A language model whose stream is scaled by a persistent buffer it only reads (as a frozen BatchNorm's
    statistics are read): the buffer's value comes with the weights, from a checkpoint."""

    def __init__(self, vocab: int = 128, width: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.mix = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) * self.scale
        return self.head(h + torch.tanh(self.mix(h)))


class CallCounter(nn.Module):
    """Counts its forward calls in a buffer the output never reads (as BatchNorm's ``num_batches_tracked``)."""

    def __init__(self, vocab: int = 96, width: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1.0)
        h = torch.tanh(self.a(self.tok(ids)))
        return self.head(torch.tanh(self.b(h)))


def call_counter() -> CallCounter:
    torch.manual_seed(0)
    return CallCounter()
