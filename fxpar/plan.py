"""Plans: module-path globs -> tensor-parallel styles, resolved against a model.

Styles are semantic: ``colwise`` shards a layer's output features, ``rowwise`` its input
features, whatever the weight layout (``nn.Linear`` is (out, in); HF ``Conv1D`` is (in, out)).
"""

from __future__ import annotations

import fnmatch

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.errors import PlanError, close_matches

STYLES = ("colwise", "rowwise", "replicate")
SUPPORTED_AXES = ("dp", "tp")


def resolve_plan(model: torch.nn.Module, plan: dict[str, str] | None) -> dict[str, str]:
    """Expand globs to ``{module path: style}``; every glob must match at least one module."""
    if plan is None:
        return {}
    if not isinstance(plan, dict):
        raise PlanError(f"plan must be a dict of module-path globs to styles, got {type(plan).__name__}")
    paths = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"plan[{pattern!r}] = {style!r}: style must be one of {STYLES}")
        matched = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            hint = close_matches(pattern, paths) or close_matches(pattern.replace("*", "0"), paths)
            raise PlanError(
                f"plan glob {pattern!r} matches no module of {type(model).__name__}"
                + (f"; did you mean: {', '.join(hint)}?" if hint else "")
            )
        for p in matched:
            resolved[p] = style
    return resolved


def param_tp_placement(module: torch.nn.Module, path: str, param: str, style: str) -> Placement:
    """The tensor-parallel placement of ``module.<param>`` under ``style``."""
    if style == "replicate":
        return Replicate()
    kind = type(module).__name__
    if isinstance(module, torch.nn.Linear):
        out_dim, in_dim = 0, 1
    elif kind == "Conv1D" and hasattr(module, "nf"):  # HF GPT-2 style: weight is (in, out)
        out_dim, in_dim = 1, 0
    elif isinstance(module, torch.nn.Embedding) and style == "colwise":
        return Shard(1)
    else:
        raise PlanError(f"{path} ({kind}): style {style!r} is supported on nn.Linear, HF Conv1D and "
                        "nn.Embedding (colwise) modules")
    if param == "bias":
        return Shard(0) if style == "colwise" else Replicate()
    return Shard(out_dim if style == "colwise" else in_dim)


def check_divisible(shape: torch.Size, placements: tuple[Placement, ...], sizes: tuple[int, ...],
                    what: str) -> None:
    """Refuse a shard that does not divide evenly, naming the tensor and dim."""
    for p, n in zip(placements, sizes, strict=True):
        if isinstance(p, Shard) and shape[p.dim] % n:
            raise ValueError(
                f"{what}: dim {p.dim} has size {shape[p.dim]}, which is not divisible by the mesh axis "
                f"size {n}; choose sizes that divide, or replicate it"
            )
