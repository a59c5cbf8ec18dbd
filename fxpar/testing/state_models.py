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


class _Rotation(nn.Module):
    """A parameter-less module holding a frequency table (a rotary table's role)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("freq", torch.linspace(0.1, 1.0, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.cos(self.freq)


class _RotatedLayer(nn.Module):
    def __init__(self, width: int, rotation: _Rotation) -> None:
        super().__init__()
        self.rot, self.lin = rotation, nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(self.rot(x)))


class SharedTableStack(nn.Module):
    """Every layer holds the same ``_Rotation`` child: its buffer has one name per layer in the state dict
    (``layers.0.rot.freq`` .. ``layers.3.rot.freq``) and one tensor."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        rotation = _Rotation(width)
        self.inp, self.head = nn.Linear(width, width), nn.Linear(width, 4)
        self.layers = nn.ModuleList(_RotatedLayer(width, rotation) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def shared_table_stack() -> SharedTableStack:
    torch.manual_seed(0)
    return SharedTableStack()


class _SpareStateLayer(nn.Module):
    """A layer holding a parameter and two buffers (one persistent, one not) its forward never reads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.spare = nn.Parameter(torch.randn(3))
        self.register_buffer("spare_stat", torch.randn(3))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class SpareStateStack(nn.Module):
    """Layers with state their forward never reads, and an unread root parameter (``extra``): a pipeline stage
    holds the state its graph reads, so these need a stage chosen for them."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(width, width), nn.Linear(width, 4)
        self.layers = nn.ModuleList(_SpareStateLayer(width) for _ in range(layers))
        self.extra = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def spare_state_stack() -> SpareStateStack:
    torch.manual_seed(0)
    return SpareStateStack()
