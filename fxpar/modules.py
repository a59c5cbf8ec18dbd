"""What the passes know about the user's modules, recorded once when the model is captured.

Passes read this table, never the live ``nn.Module``: a module's path, its class, what kind of
layer it is for the plan (``linear``, HF ``conv1d``, ``embedding``, an HF ``experts`` module) and a
Linear's widths. The Hugging Face ``tp="hf"`` plan is read off the model here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxpar.hf_plan import hf_tp_plan
from fxpar.rules.token_local import is_hf_experts


@dataclass(frozen=True)
class ModuleInfo:
    """One module of the model, as the plan sees it."""

    type_name: str  # its class name
    kind: str  # "linear" | "conv1d" (HF GPT-2 style, weight (in, out)) | "embedding" | "experts" | "other"
    in_features: int | None = None  # a Linear's (or Conv1D's) widths
    out_features: int | None = None


@dataclass(frozen=True)
class ModuleTable:
    """Every module of a model by path (the root is ``""``), plus what the ``tp="hf"`` plan says, if asked."""

    model_type: str
    modules: dict[str, ModuleInfo] = field(default_factory=dict)
    hf_plan: dict[str, str] | None = None
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)  # a parameter's name -> its other names (aliases)

    def __getitem__(self, path: str) -> ModuleInfo:
        return self.modules[path]

    def get(self, path: str) -> ModuleInfo | None:
        return self.modules.get(path)

    def paths(self) -> list[str]:
        """Every module path but the root's, in ``named_modules`` order."""
        return [p for p in self.modules if p]

    def of_kind(self, kind: str) -> dict[str, ModuleInfo]:
        return {p: m for p, m in self.modules.items() if p and m.kind == kind}


def module_table(model: torch.nn.Module, tp_plan: object = None) -> ModuleTable:
    """The table of ``model`` (``tp_plan == "hf"`` also reads its Hugging Face tp plan)."""
    modules = {path: _info(m) for path, m in model.named_modules()}
    return ModuleTable(type(model).__name__, modules, hf_tp_plan(model) if tp_plan == "hf" else None,
                       _tied_names(model))


def _tied_names(model: torch.nn.Module) -> dict[str, tuple[str, ...]]:
    """Each parameter held under several names (a tied head): its first name -> the others."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {first: tuple(rest) for first, *rest in names.values() if rest}


def _info(module: torch.nn.Module) -> ModuleInfo:
    name = type(module).__name__
    if is_hf_experts(module):
        return ModuleInfo(name, "experts")
    if isinstance(module, torch.nn.Linear):
        return ModuleInfo(name, "linear", module.in_features, module.out_features)
    if name == "Conv1D" and hasattr(module, "nf"):
        return ModuleInfo(name, "conv1d", module.weight.shape[0], module.nf)
    if isinstance(module, torch.nn.Embedding):
        return ModuleInfo(name, "embedding")
    return ModuleInfo(name, "other")
