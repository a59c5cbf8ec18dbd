"""Models whose repeated blocks are laid out as users lay them out, for the block search, sharing and stage splits:
per-layer attributes, two lists of blocks (an encoder's and a decoder's; a U-Net's down and up blocks).

Module-level so that spawned gloo ranks can unpickle them; they import nothing from fxpar (they stand for user code).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class AttributeBlock(nn.Module):
    """A block whose code reads plain attributes some layers set on the instance: a class default one layer
    overrides, ``getattr`` with a default, a flag tuple, a signed zero."""

    scale = 1.0

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.flags = (1,)
        self.sign = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = getattr(self, "gate", 1.0)
        flag = 2.0 if self.flags[0] is True else 1.0
        return x + self.scale * gate * flag * math.copysign(1.0, self.sign) * self.lin(x)


class PerLayerAttributes(nn.Module):
    """Six ``AttributeBlock``s; layers 2 to 5 each change one attribute (layers 0 and 1 alike)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)  # so that layer 0's input needs a gradient, as layer 1's does
        self.layers = nn.ModuleList(AttributeBlock(width) for _ in range(6))
        self.head = nn.Linear(width, 4)
        self.layers[2].scale = 0.5
        self.layers[3].gate = 3.0
        self.layers[4].flags = (True,)
        self.layers[5].sign = -0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def per_layer_attributes() -> PerLayerAttributes:
    torch.manual_seed(0)
    return PerLayerAttributes()


class _CrossBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.own = nn.Linear(width, width)
        self.cross = nn.Linear(width, width)

    def forward(self, y: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return y + torch.tanh(self.own(y) + self.cross(memory).mean(1, keepdim=True))


class EncoderDecoder(nn.Module):
    """Two lists of repeated blocks, an encoder's and a decoder's that reads the encoder's output (BART, T5 and
    Whisper in small)."""

    def __init__(self, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.decoder = nn.ModuleList(_CrossBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            source = source + torch.tanh(layer(source))
        for layer in self.decoder:
            target = layer(target, source)
        return self.head(target)


def encoder_decoder() -> EncoderDecoder:
    torch.manual_seed(0)
    return EncoderDecoder()


class SkipStack(nn.Module):
    """U-Net-style skip connections between two lists of alike blocks: the up blocks pop what the down blocks
    pushed, so the model's code needs both lists whole (cut to fewer down blocks, the pops run out)."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.down = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.up = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, skips = self.inp(x), []
        for block in self.down:
            h = torch.tanh(block(h))
            skips.append(h)
        for block in self.up:
            h = torch.tanh(block(h + skips.pop()))
        return self.out(h)


def skip_stack() -> SkipStack:
    torch.manual_seed(0)
    return SkipStack()
