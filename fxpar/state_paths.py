"""Dotted paths of a module's parameters and buffers (``layers.3.mlp.up.weight``): the submodule that holds one,
made where a rank's own module has none yet, and the buffers a ``state_dict`` leaves out."""

from __future__ import annotations

import torch


def owner_module(root: torch.nn.Module, fqn: str) -> tuple[torch.nn.Module, str]:
    """The submodule of ``root`` that holds the dotted path ``fqn`` (empty modules created on the way), and the
    path's last name."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), torch.nn.Module):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    return mod, leaf


def non_persistent_buffers(model: torch.nn.Module) -> frozenset[str]:
    """Paths of ``model``'s buffers that its ``state_dict`` leaves out (``register_buffer(..., persistent=False)``)."""
    return frozenset(f"{path}.{name}" if path else name for path, m in model.named_modules()
                     for name in m._non_persistent_buffers_set)
