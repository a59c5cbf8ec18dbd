"""Plans: module-path globs -> tensor-parallel styles, resolved against a model.

Styles are semantic: ``colwise`` shards a layer's output features, ``rowwise`` its input
features, whatever the weight layout (``nn.Linear`` is (out, in); HF ``Conv1D`` is (in, out)).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.errors import PlanError, close_matches

if TYPE_CHECKING:
    from fxpar.modules import ModuleInfo, ModuleTable

STYLES = ("colwise", "rowwise", "replicate")
SUPPORTED_AXES = ("pp", "dp", "ep", "cp", "tp")


def check_axes(names: tuple[str, ...]) -> None:
    """Refuse a mesh axis fxpar does not know (before a plan search reads the mesh by the names it knows)."""
    for axis in names:
        if axis not in SUPPORTED_AXES:
            hint = close_matches(axis.lower(), list(SUPPORTED_AXES)) or [a for a in SUPPORTED_AXES if a in axis.lower()]
            raise PlanError(f"mesh axis {axis!r} is not supported; use {SUPPORTED_AXES}"
                            + (f" (did you mean {hint[0]!r}?)" if hint else ""))
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


@dataclass(frozen=True)
class Plan:
    """How to parallelize a model; every field has a single-device default.

    ``tp``: module-path globs -> ``"colwise" | "rowwise" | "replicate"`` on the ``tp`` axis.
    ``stages``: pipeline stages over the ``pp`` axis: an int (cost-balanced split) or module paths
    that each start a stage; ``None`` means one stage per pp rank. ``schedule``: one of
    ``SCHEDULE_NAMES``. ``microbatches``: splits dim 0 of the dp-local batch in ``pm.step``.
    ``param_dtype`` / ``reduce_dtype``: mixed precision with FSDP2's ``MixedPrecisionPolicy`` semantics
    (``fxpar.mixed_precision``): parameters and optimizer state keep their own dtype, each module computes
    on copies of its parameters cast to ``param_dtype`` (floating inputs are cast too), and gradients are
    reduced over the batch axes (dp, cp, ep) in ``reduce_dtype`` (default: ``param_dtype``) and handed over in
    the parameter's dtype; a tp partial sum (a norm weight's gradient under SP) is reduced in the dtype it is
    computed in, as DTensor's tensor parallelism under FSDP2's policy.
    ``compile``: each rank's graphs run compiled by Inductor (``fxpar.inductor``).
    The remaining fields are part of the API and refused with a clear error until implemented.
    """

    tp: dict[str, str] | str = field(default_factory=dict)  # or "hf": the model's own HF plan
    sequence_parallel: bool = False
    zero: int = 0
    stages: int | list[str] | tuple[str, ...] | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    recompute: str | int | None = None
    fp8: str | dict[str, str] | None = None
    overlap: bool = True
    bucket_mb: int = 25
    param_dtype: torch.dtype | None = None  # mixed precision: the dtype forward and backward compute in
    reduce_dtype: torch.dtype | None = None  # the dtype gradients are reduced in (None: param_dtype's)
    compile: bool = False
    notes: dict[str, Any] = field(default_factory=dict, compare=False)  # filled by the compiler (split, costs)

    def resolved(self, **changes: Any) -> Plan:
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        fields = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self)
                  if f.name != "notes" and getattr(self, f.name) != f.default
                  and not (f.default_factory is not dataclasses.MISSING and not getattr(self, f.name))]
        lines = [f"Plan({', '.join(fields)})"]
        lines += [f"  {k}: {v}" for k, v in self.notes.items()]
        return "\n".join(lines)


def as_plan(plan: Plan | dict[str, str] | None, axes: dict[str, int] | None = None) -> Plan:
    """``None`` -> ``Plan()``; a plain dict is shorthand for ``Plan(tp=dict)``.

    Refuses a field the mesh ``axes`` cannot serve (``zero`` without ``dp``, ``sequence_parallel``
    without ``tp``), then what is not built yet.
    """
    if plan is None:
        plan = Plan()
    if isinstance(plan, dict):
        plan = Plan(tp=dict(plan))
    if not isinstance(plan, Plan):
        raise PlanError("plan must be a fxpar.Plan or a dict of module-path globs to styles, "
                        f"got {type(plan).__name__}")
    if axes is not None:
        _check_axes(plan, axes)
    budget = isinstance(plan.recompute, int) and not isinstance(plan.recompute, bool) and plan.recompute >= 0
    if plan.recompute not in (None, "selective", "full") and not budget:
        raise PlanError(f"recompute must be None, 'selective', 'full' or a byte budget (int), got {plan.recompute!r}")
    if plan.schedule not in SCHEDULE_NAMES:
        hint = close_matches(plan.schedule, list(SCHEDULE_NAMES)) if isinstance(plan.schedule, str) else []
        raise PlanError(f"unknown schedule {plan.schedule!r}; choose one of {SCHEDULE_NAMES}"
                        + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    if plan.microbatches is not None and (not isinstance(plan.microbatches, int) or plan.microbatches < 1):
        raise PlanError(f"microbatches must be a positive int, got {plan.microbatches!r}")
    for name in ("param_dtype", "reduce_dtype"):
        dtype = getattr(plan, name)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
                                  or dtype.itemsize < 2):
            raise PlanError(f"{name} must be None or a floating dtype of 16 bits or more (torch.bfloat16, "
                            f"torch.float16, torch.float32), got {dtype!r}")
    _check_types(plan)
    return plan


def _check_types(plan: Plan) -> None:
    """Fields of the wrong type, refused by name (they failed deep in compilation, or were taken as something else:
    ``stages="model.layers.2"`` was read letter by letter, ``zero=True`` as ZeRO-1)."""
    for name in ("sequence_parallel", "overlap", "compile"):
        if not isinstance(getattr(plan, name), bool):
            raise PlanError(f"{name} must be True or False, got {getattr(plan, name)!r}")
    if type(plan.zero) is not int:
        raise PlanError(f"zero must be 0, 1, 2 or 3 (an int), got {plan.zero!r}")
    stages = plan.stages
    if isinstance(stages, str):
        raise PlanError(f"stages must be an int or a list of module paths, got the string {stages!r}; "
                        f"did you mean stages=[{stages!r}]?")
    if stages is not None and not (type(stages) is int and stages >= 1) and not (
            isinstance(stages, (list, tuple)) and all(isinstance(p, str) for p in stages)):
        raise PlanError(f"stages must be None, a positive int or a list of module paths (str), got {stages!r}")
    if plan.tp is not None and not isinstance(plan.tp, dict) and plan.tp != "hf":
        hint = " (did you mean 'hf'?)" if isinstance(plan.tp, str) and plan.tp.lower() == "hf" else ""
        raise PlanError(f"Plan(tp=...) must be a dict of module-path globs to styles or 'hf', got {plan.tp!r}{hint}")


def _check_axes(plan: Plan, axes: dict[str, int]) -> None:
    """Plan fields that need a mesh axis the mesh does not have."""
    have = ", ".join(f"{k}={v}" for k, v in axes.items())
    if plan.zero not in (0, 1, 2, 3):
        raise PlanError(f"zero must be 0, 1, 2 or 3, got {plan.zero!r}")
    if plan.zero and axes.get("dp", 1) < 2:
        raise PlanError(f"Plan(zero={plan.zero}) shards parameters, gradients and optimizer state over the dp "
                        f"axis, but the mesh ({have}) has no dp axis of size > 1")
    if plan.sequence_parallel and axes.get("tp", 1) < 2:
        raise PlanError(f"Plan(sequence_parallel=True) shards activations over the tp axis, but the mesh ({have}) "
                        "has no tp axis of size > 1")
    if axes.get("cp", 1) > 1:
        _check_context(plan, axes, have)
    if axes.get("ep", 1) > 1:
        _check_expert(plan, axes, have)


def _check_expert(plan: Plan, axes: dict[str, int], have: str) -> None:
    """What an ep axis does not compose with yet."""
    if axes.get("cp", 1) > 1:
        raise PlanError(f"an ep axis with 'cp' ({have}) is not supported yet; ep composes with dp, tp, pp and ZeRO")
    for name, value in (("fp8", plan.fp8), ("sequence_parallel", plan.sequence_parallel)):
        if value:
            raise PlanError(f"Plan({name}={value!r}) with an ep axis ({have}) is not supported yet")
    if plan.compile:  # the all-to-all's split sizes are read from the routing counts: Inductor compiles static shapes
        raise PlanError(f"Plan(compile=True) with an ep axis ({have}) is not supported yet: the expert all-to-alls' "
                        "sizes depend on the routing, which Inductor's static-shape graphs cannot read")


def _check_context(plan: Plan, axes: dict[str, int], have: str) -> None:
    """What a cp axis does not compose with yet."""
    if plan.fp8:
        raise PlanError(f"Plan(fp8=...) with a cp axis ({have}) is not supported yet")


def resolve_plan(modules: ModuleTable, plan: dict[str, str] | None) -> dict[str, str]:
    """Expand globs to ``{module path: style}``; every glob must match at least one module, and a module several
    globs match takes the last one's style (a specific override after a broad glob). ``"hf"`` is the model's own
    Hugging Face plan (``fxpar.hf_plan``, read when the module table was recorded)."""
    if plan is None:
        return {}
    if plan == "hf":
        plan = modules.hf_plan
    if not isinstance(plan, dict):
        raise PlanError(f"Plan(tp=...) must be a dict of module-path globs to styles, got {type(plan).__name__}")
    paths = modules.paths()
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            field_hint = (f"; a plain dict is Plan(tp=dict): did you mean fxpar.Plan({pattern}={style!r})?"
                          if pattern in Plan.__dataclass_fields__ else "")
            raise PlanError(f"plan[{pattern!r}] = {style!r}: style must be one of {STYLES}{field_hint}")
        matched = [p for p in paths if fnmatch.fnmatchcase(p, pattern)]
        if not matched:
            hint = close_matches(pattern, paths) or close_matches(pattern.replace("*", "0"), paths)
            raise PlanError(
                f"plan glob {pattern!r} matches no module of {modules.model_type}"
                + (f"; did you mean: {', '.join(hint)}?" if hint else "")
            )
        for p in matched:
            resolved[p] = style
    return resolved


def param_tp_placement(module: ModuleInfo, path: str, param: str, style: str) -> Placement:
    """The tensor-parallel placement of ``module.<param>`` under ``style``."""
    if style == "replicate":
        return Replicate()
    if module.kind == "linear":
        out_dim, in_dim = 0, 1
    elif module.kind == "conv1d":  # HF GPT-2 style: weight is (in, out)
        out_dim, in_dim = 1, 0
    elif module.kind == "embedding" and style == "colwise":
        return Shard(1)
    else:
        raise PlanError(f"{path} ({module.type_name}): style {style!r} is supported on nn.Linear, HF Conv1D and "
                        "nn.Embedding (colwise) modules")
    if param == "bias":
        return Shard(0) if style == "colwise" else Replicate()
    return Shard(out_dim if style == "colwise" else in_dim)


def check_shardable(shape: torch.Size, placements: tuple[Placement, ...], sizes: tuple[int, ...],
                    what: str) -> None:
    """Refuse a shard that would leave a rank empty. Uneven pieces are fine (DTensor's ``torch.chunk`` split)."""
    for p, n in zip(placements, sizes, strict=True):
        if isinstance(p, Shard) and shape[p.dim] < n:
            raise ValueError(
                f"{what}: dim {p.dim} has size {shape[p.dim]}, fewer than the mesh axis size {n}: some rank would "
                "hold an empty piece; replicate it or use a smaller axis"
            )
