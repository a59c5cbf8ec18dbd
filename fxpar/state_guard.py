"""The user's model leaves a trace as it entered it: no parameter, buffer, submodule or tensor attribute its code
creates while traced on fake tensors stays on it.

A forward that creates a parameter (``if not hasattr(self, "w"): self.w = nn.Parameter(...)``) left a fake
parameter on the user's model (whose own calls then returned fake tensors), and the compiled program read it as a
constant: never in ``pm.parameters()``, never trained, without a word. Such a parameter (or a submodule holding
one) is now a ``CaptureError``; a buffer, submodule or tensor attribute created while tracing (a cache) is taken
off again, as the values it was traced with are the program's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fxpar.errors import CaptureError


def uninitialized(model: torch.nn.Module) -> None:
    """Raise ``CaptureError`` for a lazy module's parameter or buffer that has no shape yet."""
    lazy = torch.nn.parameter.UninitializedTensorMixin
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if isinstance(t, lazy):
            raise CaptureError(f"{name!r} is uninitialized (a lazy module's): run the model once on an example "
                               "input before fxpar.parallelize, so that it has a shape to shard")


@contextmanager
def model_state_unchanged(model: torch.nn.Module) -> Iterator[None]:
    """Inside: trace ``model``. After: what its code added to any of its modules is removed and a tensor attribute
    it rebound is put back; a parameter among what it added (directly or in an added submodule) is a
    ``CaptureError`` naming where."""
    modules = list(model.named_modules())
    before = {id(m): (set(m._parameters), set(m._buffers), set(m._modules), dict(m.__dict__)) for _, m in modules}
    try:
        yield
    finally:
        created = []
        for path, m in modules:
            params, buffers, children, attrs = before[id(m)]
            for name in (set(m._parameters) - params) | (set(m._buffers) - buffers) | (set(m._modules) - children):
                value = getattr(m, name)
                if isinstance(value, torch.nn.Parameter) or (
                        isinstance(value, torch.nn.Module) and any(True for _ in value.parameters())):
                    created.append(f"{path + '.' if path else ''}{name}")
                delattr(m, name)
            for name, value in list(m.__dict__.items()):  # a cache the code set: back to what it was
                if isinstance(value, torch.Tensor) and (name not in attrs or attrs[name] is not value):
                    if name in attrs:
                        m.__dict__[name] = attrs[name]
                    else:
                        del m.__dict__[name]
        if created:
            raise CaptureError(f"the model's forward creates parameters while it runs ({', '.join(created)}): "
                               "fxpar traces it once and could not train them; create them in __init__")
