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


_SCALES = {"scale": 1.0}  # a module-level dict the model sets before each layer
_NESTED_SCALES = {"attn": {"scale": 1.0}}  # the same, two levels down
SCALE = 1.0  # a module-level float the model rebinds before each layer


class _Helper:
    """A plain object every layer holds (a config, a cache): the model sets its field before each layer."""

    def __init__(self) -> None:
        self.k = 1.0
        self.inner = _Inner()


class _Inner:
    scale = 1.0  # a class attribute the model sets (``_Inner.scale``); instances read it unless they set their own


class _Gain(nn.Module):
    """A parameterless module passed to every layer: the model sets its field before each layer."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = 1.0


_HELD = _Helper()  # a global object: the model sets a field two levels down


class OutsideStateBlock(nn.Module):
    """A block whose scale comes from outside its arguments and its own attributes: ``source`` says where."""

    def __init__(self, width: int, source: str, helper: _Helper, gain: _Gain) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.source, self.helper = source, helper
        object.__setattr__(self, "held_gain", gain)  # a module held, not a child

    def forward(self, x: torch.Tensor, gain: _Gain | None = None, options: _Helper | None = None) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.scale(gain, options)

    def scale(self, gain: _Gain | None, options: _Helper | None) -> float:
        reads = {
            "global_dict": lambda: _SCALES["scale"],
            "global_float": lambda: SCALE,
            "helper": lambda: self.helper.k,
            "module_arg": lambda: gain.gain,
            "dict_read": lambda: self.__dict__.get("gain", 1.0),  # an attribute only layer 2 has, read via its dict
            "class_attr": lambda: _Inner.scale,
            "nested_global": lambda: _HELD.inner.k,
            "nested_dict": lambda: _NESTED_SCALES["attn"]["scale"],
            "deep_attribute": lambda: self.helper.inner.k,
            "held_module": lambda: self.held_gain.gain,
            "nested_argument": lambda: options.inner.k,
        }
        return reads[self.source]()


class OutsideState(nn.Module):
    """Four ``OutsideStateBlock``s; the model sets layer ``i``'s scale to ``i + 1`` where ``source`` says."""

    def __init__(self, source: str, width: int = 16) -> None:
        super().__init__()
        helper = _Helper()
        self.inp = nn.Linear(width, width)
        self.gain = _Gain()
        self.layers = nn.ModuleList(OutsideStateBlock(width, source, helper, self.gain) for _ in range(4))
        self.head = nn.Linear(width, 4)
        self.source = source
        self.layers[2].__dict__["gain"] = 3.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global SCALE
        x = self.inp(x)
        helper = self.layers[0].helper
        for i, layer in enumerate(self.layers):
            value = float(i + 1)  # only where this source reads it: a change one level up would tell layers apart
            if self.source in ("global_dict", "global_float", "class_attr", "nested_dict"):
                _SCALES["scale"] = _NESTED_SCALES["attn"]["scale"] = SCALE = _Inner.scale = value
            elif self.source in ("helper", "module_arg", "held_module"):
                self.gain.gain = helper.k = value
            elif self.source == "nested_global":
                _HELD.inner.k = value
            else:
                helper.inner.k = value
            if self.source == "module_arg":
                x = layer(x, self.gain)
            else:
                x = layer(x, options=helper) if self.source == "nested_argument" else layer(x)
        return self.head(x)


class _GainBlock(nn.Module):
    def __init__(self, width: int, gain: _Gain) -> None:
        super().__init__()
        self.lin, self.gain = nn.Linear(width, width), gain  # ``gain``: one child every layer (and the root) holds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x)) * self.gain.gain


class SetsSharedChild(nn.Module):
    """Every layer holds the root's ``gain`` child; the model sets its field once, before the loop (``per_layer``:
    before each layer). torch.export puts the field back after the export, where each shared block is traced."""

    def __init__(self, per_layer: bool = False, width: int = 16) -> None:
        super().__init__()
        self.inp, self.head, self.gain = nn.Linear(width, width), nn.Linear(width, 4), _Gain()
        self.layers = nn.ModuleList(_GainBlock(width, self.gain) for _ in range(4))
        self.per_layer = per_layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.gain.gain = 2.0
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            if self.per_layer:
                self.gain.gain = float(i + 1)
            x = layer(x)
        return self.head(x)


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class WideHead(nn.Module):
    """Four residual blocks, then a head four times wider than the stream: a cost-balanced 2-stage split puts three
    blocks on the first stage (a block's outputs were counted twice when it was traced once: two)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(_Residual(width) for _ in range(4))
        self.head = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(self.head(x))


class CalledTwice(nn.Module):
    """Four residual blocks; the first two are called three times each, in turn (``layers[i % 2]``)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(_Residual(width) for _ in range(4))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i in range(6):
            x = self.layers[i % 2](x)
        for layer in self.layers[2:]:
            x = layer(x)
        return self.head(x)


class _WritesItsOutput(nn.Module):
    """A residual block that adds in place to a clone of its input and returns it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(self.norm(x))
        x = x.clone()
        x.add_(torch.relu(h))
        return x


class WritesItsOutput(nn.Module):
    """Four blocks whose output is written in place (``x.clone().add_(...)``): the whole-model trace names and orders
    the head's reads of it as a stitched block's output is not."""

    def __init__(self, width: int = 16, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_WritesItsOutput(width) for _ in range(4))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class FreshTableInPlace(nn.Module):
    """DeBERTa's relative-position pattern: a table built from ``arange`` (no input reaches it), written in place
    (``detach_``, ``mul_``) and read by every block, so by each pipeline stage."""

    def __init__(self, width: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.seq = seq
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = torch.arange(self.seq, dtype=x.dtype)
        table.detach_()
        table.mul_(0.1)
        bias = torch.log1p(table).unsqueeze(-1)
        for layer in self.layers:
            x = torch.tanh(layer(x) + bias)
        return x


class ConcatBySliceCopies(nn.Module):
    """DeepSeek-V3's MLA key concat (``modeling_deepseek_v3.py``): ``new_empty``, then two in-place slice copies,
    over ``[batch, heads, seq, dim]`` values (the backward makes the buffer's gradient with ``new_empty_strided``)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.o = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x).unsqueeze(1), self.b(x).unsqueeze(1)  # [batch, 1, seq, width]
        out = a.new_empty(*a.shape[:-1], 2 * a.shape[-1])
        out[..., : a.shape[-1]].copy_(a)
        out[..., a.shape[-1]:].copy_(b)
        return self.o(out.squeeze(1))


class _MlpBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class OneLayerApart(nn.Module):
    """Four blocks of the same code and shapes, of which the user set one apart without touching its code (the
    usual fine-tuning and debugging edits): ``variant`` is "forward_hook" (layer 2's output doubled by a hook),
    "pre_hook" (layer 1's input halved), "eval" (layer 1 in eval mode: no dropout), "frozen" (layer 0 needs no
    gradients), "frozen_weight" (one weight of layer 2), "tied" (layer 1 reads layer 0's ``up`` weight),
    "same_instance" (one block object listed four times, ALBERT-style) or "all" (the hooks, eval and frozen ones at
    once)."""

    VARIANTS = ("forward_hook", "pre_hook", "eval", "frozen", "frozen_weight", "tied", "same_instance", "all")

    def __init__(self, variant: str, width: int = 16) -> None:
        super().__init__()
        if variant not in self.VARIANTS:
            raise ValueError(f"unknown variant {variant!r}; one of {self.VARIANTS}")
        self.inp = nn.Linear(8, width)
        self.layers = nn.ModuleList(_MlpBlock(width) for _ in range(4))
        self.head = nn.Linear(width, 4)
        every = variant == "all"
        if variant == "forward_hook" or every:
            self.layers[2].register_forward_hook(_double_output)
        if variant == "pre_hook" or every:
            self.layers[1].register_forward_pre_hook(_halve_input)
        if variant == "eval" or every:
            self.layers[3 if every else 1].eval()
        if variant == "frozen" or every:
            self.layers[0].requires_grad_(False)
        if variant == "frozen_weight":
            self.layers[2].up.weight.requires_grad_(False)
        if variant == "tied":
            self.layers[1].up.weight = self.layers[0].up.weight
        if variant == "same_instance":
            self.layers = nn.ModuleList([self.layers[0]] * 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _double_output(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2.0


def _halve_input(module: nn.Module, args: tuple) -> tuple:
    return (args[0] * 0.5,)


def one_layer_apart(variant: str) -> OneLayerApart:
    torch.manual_seed(0)
    return OneLayerApart(variant)
