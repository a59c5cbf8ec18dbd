"""Resharding checkpoints with ``torch.distributed.checkpoint`` (DCP).

Parameters of a ``ParallelModule`` are DTensors and the optimizer state follows them, so DCP saves
each rank's shards with their global layout and loads them onto any other mesh and plan (or into
the plain model in one process). ``save`` and ``load`` are the two calls a training script needs;
``load`` first checks that the checkpoint holds every parameter name the module expects, so a
renamed module is a clear error instead of a failure deep inside DCP (or a hang on other ranks).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fxpar.errors import CheckpointError, close_matches

# optimizer state keyed by parameter name, settings too (``optim.param_groups.<fqn>.lr``): a pipeline rank holds some
# parameters, and DCP's nested form stores one rank's list of a group's names, so the others found no settings
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def save(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> None:
    """Save ``module``'s (and ``optimizer``'s) state to the DCP folder ``path``; collective over the ranks.

    Without a process group it saves from this process alone: ``save(model, None, path)`` of the single-device
    model gives a checkpoint any mesh and plan loads (``fxpar.run --checkpoint``)."""
    _check_runs(module, "save")
    state = {"model": get_model_state_dict(module)}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=FLAT)
    if dist.is_available() and dist.is_initialized():
        dcp.save(state, checkpoint_id=path)
        return
    with warnings.catch_warnings():  # DCP warns that it assumes one process: that is what was asked
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def load(module: torch.nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> None:
    """Load ``path`` into ``module`` (and ``optimizer``), resharding to the module's mesh and plan.

    Raises ``CheckpointError`` on every rank, before any data moves, if the checkpoint lacks a
    parameter or buffer name the module has (the message names it and the closest saved names).
    """
    check_is_checkpoint(path)
    _check_runs(module, "load")
    if optimizer is not None and not has_optimizer(path):
        raise CheckpointError(f"{path!r} was saved without optimizer state (fxpar.checkpoint.save(model, None, "
                              "path)); load the weights alone with load(module, None, path)")
    check_names(module, path)
    full = get_model_state_dict(module)
    source = _one_name_per_tensor(module, full, set(saved_shapes(path)))
    state = {"model": {name: full[name] for name in set(source.values())}}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(module, optimizer, options=FLAT)
        _check_optimizer_state(state["optim"], optimizer, path)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(module, {name: state["model"][source[name]] for name in full})
    if optimizer is not None:
        set_optimizer_state_dict(module, optimizer, state["optim"], options=FLAT)


def _check_optimizer_state(wanted: dict[str, Any], optimizer: torch.optim.Optimizer, path: str) -> None:
    """Raise ``CheckpointError`` if ``optimizer`` keeps state or settings the checkpoint lacks (an AdamW checkpoint
    loaded into SGD with momentum): DCP raised an exception ``except Exception`` does not catch."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    keys = [(f"optim.{key}", key.rsplit(".", 1)[-1]) for key in wanted]  # flat: state.<fqn>.exp_avg, param_groups...
    missing = sorted({name for key, name in keys if key not in metadata})
    if missing:
        saved = sorted({k.rsplit(".", 1)[-1] for k in metadata if k.startswith("optim.state.")})
        raise CheckpointError(f"{type(optimizer).__name__} keeps {', '.join(missing)}, which {path!r} does not hold "
                              f"(its optimizer state holds {', '.join(saved) or 'nothing per parameter'}): load it "
                              "with the optimizer it was saved with, or the weights alone with load(module, None, "
                              "path)")


def check_is_checkpoint(path: str) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a folder ``save`` wrote (DCP's ``.metadata`` is in it)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r}: no such checkpoint folder")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path!r} is a folder but no checkpoint (it has no .metadata, which "
                              "fxpar.checkpoint.save writes)")


def _check_runs(module: torch.nn.Module, what: str) -> None:
    """A ParallelModule of a fake mesh holds no weights: saving or loading one is a ``CheckpointError``."""
    compiled = getattr(module, "_compiled", None)
    if compiled is not None and compiled.mesh.fake:
        raise CheckpointError(f"this ParallelModule was compiled for a fake mesh: it holds no weights to {what}; "
                              "compile on a real mesh (fxpar.Mesh(axes) under torchrun or a process group)")


def saved_names(path: str) -> list[str]:
    """The model state names a DCP checkpoint holds (its ``model.`` entries, prefix removed)."""
    return sorted(saved_shapes(path))


def saved_shapes(path: str) -> dict[str, tuple[int, ...] | None]:
    """Model state name -> the global shape the checkpoint holds (None for a non-tensor entry)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {k.removeprefix("model."): tuple(m.size) if hasattr(m, "size") else None
            for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}


def has_optimizer(path: str) -> bool:
    """Whether the checkpoint at ``path`` holds optimizer state (``save`` was given an optimizer)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return any(k.startswith("optim.") for k in metadata.state_dict_metadata)


def check_names(module: torch.nn.Module, path: str) -> None:
    """Raise ``CheckpointError`` unless ``path`` holds every name in ``module``'s state dict, each with its shape.

    A name no rank of the module holds is refused too (a checkpoint of a larger model would load with its extra
    layers dropped); a pipeline rank holds only its stages' names, so the ranks pool theirs. With
    ``torch.distributed`` initialized every rank learns whether any rank is missing names, so all
    raise together and none is left waiting inside DCP's collectives.
    """
    shapes = saved_shapes(path)
    have = sorted(shapes)
    expected = get_model_state_dict(module)
    missing = sorted(set(_one_name_per_tensor(module, expected, set(have)).values()) - set(have))
    message = _describe(missing, have, path) if missing else _wrong_shape(expected, shapes, path)
    known = set(expected) | {n for n, _ in (*module.named_parameters(remove_duplicate=False),
                                            *module.named_buffers(remove_duplicate=False))}
    if dist.is_available() and dist.is_initialized():
        views: list[tuple[str, list[str]]] = [("", [])] * dist.get_world_size()
        dist.all_gather_object(views, (message, sorted(known)))
        bad = [r for r, (m, _) in enumerate(views) if m]
        if bad and not message:
            message = f"rank(s) {bad} cannot load {path!r}: {views[bad[0]][0]}"
        known = {n for _, names in views for n in names}  # the whole model: each rank holds its stages' names
    extra = sorted(set(have) - known)
    if not message and extra:
        message = (f"checkpoint {path!r} holds {len(extra)} name(s) the model does not have, e.g. {extra[:3]}: it was "
                   "saved from another model (more layers or other modules), whose weights would be dropped")
    if message:
        raise CheckpointError(message)


def _one_name_per_tensor(module: torch.nn.Module, names: dict[str, object], saved: set[str]) -> dict[str, str]:
    """Each name of ``names`` -> the name its tensor is loaded under: a tied weight (``head.weight`` is
    ``embed.weight``) is one tensor under several names, and a ``ParallelModule`` saves it under one of them (the
    first ``named_parameters`` gives), so it loads from whichever of its names the checkpoint holds (the first
    name when none). The values of the returned mapping are the names to read; every other name is an alias."""
    groups: dict[int, list[str]] = {}
    for name, tensor in (*module.named_parameters(remove_duplicate=False),
                         *module.named_buffers(remove_duplicate=False)):
        if name in names:
            groups.setdefault(id(tensor), []).append(name)
    out = {name: name for name in names}
    for group in groups.values():
        source = next((n for n in group if n in saved), group[0])
        out.update(dict.fromkeys(group, source))
    return out


def _wrong_shape(expected: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...] | None], path: str) -> str:
    """A message naming the first parameter whose saved shape is not the module's ("" when all match)."""
    for name, value in sorted(expected.items()):
        want = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        if want is not None and shapes.get(name) is not None and shapes[name] != want:
            return (f"checkpoint {path!r} holds {name!r} with shape {list(shapes[name])}, the module's is "
                    f"{list(want)}: it was saved from another model")
    return ""


def _describe(missing: list[str], have: list[str], path: str) -> str:
    first = missing[0]
    hint = close_matches(first, have, n=3)
    more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
    return (f"checkpoint {path!r} has no parameter {first!r}{more}: the module's names do not match the saved ones"
            + (f"; closest saved names: {hint}" if hint else f"; it holds {len(have)} names, e.g. {have[:3]}"))
