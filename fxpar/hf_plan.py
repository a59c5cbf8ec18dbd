"""``Plan(tp="hf")``: a Hugging Face model's own tensor-parallel plan, mapped onto fxpar's styles.

HF declares ``model._tp_plan`` (full module paths) or ``config.base_model_tp_plan`` (paths under the base
model). Its styles differ from fxpar's mostly in where outputs are gathered, which fxpar's propagation decides
anyway: every colwise variant is fxpar's ``colwise``, every rowwise one ``rowwise``, ``embedding_colwise`` shards
the embedding dim (fxpar's ``colwise`` on an Embedding). What fxpar cannot honour is replicated and named in one
``FxparWarning`` (never dropped silently): vocab-parallel embeddings, packed (fused) weights, MoE and
expert-parallel styles, ``sequence_parallel`` entries (fxpar's is the plan-wide ``sequence_parallel=True``),
and entries that name parameters rather than modules.
"""

from __future__ import annotations

import fnmatch
import warnings

import torch

from fxpar.errors import FxparWarning, PlanError

AS_FXPAR = {
    "colwise": "colwise", "colwise_rep": "colwise", "colwise_gather_output": "colwise", "local_colwise": "colwise",
    "rowwise": "rowwise", "rowwise_rep": "rowwise", "rowwise_split_input": "rowwise", "local_rowwise": "rowwise",
    "embedding_colwise": "colwise", "replicate": "replicate", "replicated_with_grad_allreduce": "replicate",
    "local": "replicate", "local_params": "replicate", "gather": "replicate", "all_reduce": "replicate",
}
WHY_NOT = {
    "embedding_rowwise": "a vocab-parallel embedding (fxpar shards embeddings on the embedding dim only)",
    "packed_colwise": "a packed (fused) weight", "packed_rowwise": "a packed (fused) weight",
    "local_packed_rowwise": "a packed (fused) weight",
    "sequence_parallel": "fxpar's sequence parallelism is plan-wide: use Plan(sequence_parallel=True)",
}


def hf_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's HF tensor-parallel plan as an fxpar plan (module globs -> fxpar styles)."""
    raw = dict(getattr(model, "_tp_plan", None) or {})
    config = getattr(model, "config", None)
    if not raw and getattr(config, "base_model_tp_plan", None):
        prefix = getattr(model, "base_model_prefix", "")
        has_base = prefix and hasattr(model, prefix)
        raw = {(f"{prefix}.{k}" if has_base else k): v for k, v in config.base_model_tp_plan.items()}
    if not raw:
        raise PlanError(f"Plan(tp='hf'): {type(model).__name__} has no Hugging Face tensor-parallel plan "
                        "(model._tp_plan or config.base_model_tp_plan); give a dict of module globs to styles")
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    plan: dict[str, str] = {}
    skipped: list[str] = []
    for glob, style in raw.items():
        if not any(fnmatch.fnmatchcase(m, glob) for m in modules):
            if any(fnmatch.fnmatchcase(p, glob) for p in params):
                skipped.append(f"{glob} ({style}: names a parameter; fxpar plans modules)")
            else:
                skipped.append(f"{glob} ({style}: matches no module)")
        elif style in AS_FXPAR:
            plan[glob] = AS_FXPAR[style]
        else:
            skipped.append(f"{glob} ({style}: {WHY_NOT.get(style, 'a style fxpar has no equivalent for')})")
    if skipped:
        warnings.warn("fxpar: Plan(tp='hf') replicates what it cannot honour: " + "; ".join(skipped), FxparWarning,
                      stacklevel=3)
    return plan
