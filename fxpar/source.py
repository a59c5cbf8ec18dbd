"""Where a traced node came from: the user's source line and module path, from the tracer's metadata."""

from __future__ import annotations

import os
import re

import torch

from fxpar.ir import Provenance

_TORCH_DIR = os.path.dirname(torch.__file__)
_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')


def user_source(stack_trace: str | None, skip: tuple[str, ...] = (), before: str | None = None) -> str:
    """``file.py:123`` of the innermost frame of ``stack_trace`` outside torch ("" if none): only frames after the
    last one in a ``skip`` file, and only those before the first one in the ``before`` file, count."""
    frames = _FRAME_RE.findall(stack_trace or "")
    if skip:
        last = max((i for i, f in enumerate(frames) if os.path.abspath(f[0]) in skip), default=-1)
        frames = frames[last + 1:]
    if before is not None:
        first = next((i for i, f in enumerate(frames) if os.path.abspath(f[0]) == before), len(frames))
        frames = frames[:first]
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)]
    return f"{os.path.basename(user[-1][0])}:{user[-1][1]}" if user else ""


def _clean_module_path(path: str) -> str:
    """``L['self'].layers[0].mlp`` / ``layers.0.mlp`` -> ``layers.0.mlp``."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return re.sub(r"\[(\d+)\]", r".\1", path).replace("._modules['", ".").replace("']", "")


def traced_provenance(n: torch.fx.Node) -> Provenance:
    """Where a traced node comes from: the innermost module of its ``nn_module_stack``, the user's line of its stack
    trace, and its phase (AOTAutograd tags the backward's nodes)."""
    phase = "bwd" if n.meta.get("partitioner_tag") == "is_backward" else "fwd"
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
    module = _clean_module_path(list(stack.values())[-1][0]) if stack else ""
    return Provenance(module=module, source=user_source(n.meta.get("stack_trace")), phase=phase)
