"""A repeated block's own state, taken off it while the model is exported (``fxpar.blocks.opaque_blocks``).

``torch.export`` and AOTAutograd pay for every input they trace; a block's parameters and buffers are only handed
to its one call. So while the model is exported they are off the block (``BlockState.take_off``): the export
neither lifts nor passes them, and ``fxpar.block_state`` puts them back into the joint graph. They are back on
the block whenever its own code runs (``BlockState.on``), and a name read outside the block fails loudly
(``TakenOff``): such a model is captured whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fxpar.not_shared import NotShared


class BlockState:
    """A block's parameters and buffers (names relative to it, in ``named_parameters``/``named_buffers`` order),
    and the submodule dictionaries that hold them, to take them off the block and put them back in order.

    ``token``: the first parameter that requires grad stays on the block and in its calls, so that autograd still
    differentiates a call whose activations need no gradient (an RNN over input features). While the rest is off,
    each name reads as a ``TakenOff`` stand-in: code outside the block that reads it (even with a default, as
    ``getattr(layer, "bias", None)`` does) fails and the model is captured whole, instead of reading nothing."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = dict(module.named_parameters())
        self.buffers = dict(module.named_buffers())
        self.token = next((n for n, t in self.params.items() if t.requires_grad), None)
        self._held = [(m, d, dict(d)) for m in module.modules() for d in (m._parameters, m._buffers) if d]

    def take_off(self) -> None:
        token = self.params.get(self.token) if self.token else None
        for m, d, entries in self._held:
            d.clear()
            for k, t in entries.items():
                if token is not None and t is token:
                    d[k] = t
                elif t is not None:
                    m.__dict__[k] = TakenOff(k)

    def put_back(self) -> None:
        for m, d, entries in self._held:
            for k in entries:
                if isinstance(m.__dict__.get(k), TakenOff):
                    del m.__dict__[k]
            d.clear()
            d.update(entries)

    @contextmanager
    def on(self) -> Iterator[None]:
        """Inside: the state is on the block (its code runs); then as it was (the token as the export traces it)."""
        now = [(d, dict(d)) for _, d, _ in self._held]
        self.put_back()
        try:
            yield
        finally:
            self.take_off()
            for d, entries in now:
                d.clear()
                d.update(entries)


class TakenOff:
    """Where a repeated block's parameter or buffer was while the model is exported without it: any use fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        raise NotShared(f"a repeated block's {self._name!r} is read outside the block")

    def __repr__(self) -> str:
        return f"<{self._name}: taken off its block while the model is exported>"
