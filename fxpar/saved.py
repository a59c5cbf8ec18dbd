"""Read a folder ``pm.save`` wrote and build one rank's step from it, without the model's code.

``read_manifest`` checks the folder's format and fxpar version; ``load_rank`` imports ``rank<r>.py`` as a
module (its functions are the stage graphs the executor runs), reads its ``SPEC``, ``EVENTS`` and ``PARAMS``
literals and ``rank<r>.pt``, and returns a ``SavedRank``; ``SavedRank.build`` makes the rank's parameters
(empty DTensors, to be filled from a checkpoint), binds its process groups and returns the step executor.
Nothing here imports the model's module or ``transformers``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from fxpar.backends import comm
from fxpar.backends.emit import FORMAT, stage_suffix_of, version
from fxpar.errors import SavedProgramError
from fxpar.executor import StageRunner, StepExecutor
from fxpar.mesh import Mesh
from fxpar.params import RankParameters, axis_group, param_mesh, register_param, stage_buffer_values
from fxpar.random_draws import sync_generators
from fxpar.rank_spec import RankSpec, events_from_data, spec_from_data
from fxpar.rank_step import StepEvent

GRAPHS = ("forward", "backward", "reduce_grads", "gather_params", "backward_b", "backward_w")


def read_manifest(folder: str) -> dict[str, Any]:
    """``folder``'s manifest, after checking it is a saved fxpar program of this format and fxpar version."""
    path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(path):
        raise SavedProgramError(f"{folder!r} is not a saved fxpar program: it has no manifest.json (write one with "
                                "pm.save(folder))")
    with open(path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise SavedProgramError(f"{path!r} is incomplete or corrupt ({e}): save the program again") from None
    if manifest.get("format") != FORMAT or manifest.get("fxpar") != version():
        raise SavedProgramError(f"{folder!r} was saved by fxpar {manifest.get('fxpar')} (format "
                                f"{manifest.get('format')}); this is fxpar {version()} (format {FORMAT}): save it "
                                "again with this version")
    return manifest


def manifest_mesh(manifest: dict[str, Any], device: str) -> Mesh:
    return Mesh({a: n for a, n in manifest["mesh"]}, device=device)


@dataclass
class SavedRank:
    """One rank of a saved folder: its module (the printed programs), step spec, events, parameters, tensors."""

    rank: int
    module: ModuleType
    spec: RankSpec
    events: list[StepEvent]
    params: list[dict[str, Any]]
    buffers: dict[str, torch.Tensor]

    def build(self, mesh: Mesh, manifest: dict[str, Any]) -> tuple[RankParameters, StepExecutor]:
        """The rank's parameters (uninitialized: load a checkpoint into them) and its step executor, on the real
        ``mesh``. Collective: every rank creates every process group in the manifest's order."""
        dm = mesh.device_mesh()
        for sym, ranks in manifest["groups"].items():  # the rank file's group variables name these
            if self.rank in ranks:
                comm.register_group(sym, axis_group(dm, sym))
        ties = _tie_groups(manifest, self.rank)
        state = RankParameters()
        device = _device(mesh)
        pmesh = param_mesh(mesh, dm)
        for p in self.params:
            register_param(state, p["fqn"], _empty_param(p, pmesh, device))
        for s, st in self.spec.stages.items():
            state._stage_buffers[s] = stage_buffer_values(state, st, self.buffers, device,
                                                          frozenset(manifest["non_persistent_buffers"]))
            state._runners[s] = StageRunner(st, self._graphs(s))
        executor = StepExecutor(state, state._runners, self.events, self.spec, self._loss(), ties)
        sync_generators(mesh.device)  # random ops (dropout) draw alike on every rank (fxpar.random_draws)
        return state, executor

    def _graphs(self, stage: int) -> dict[str, Any]:
        suffix = stage_suffix_of(self.spec.n_stages, stage)
        return {g: getattr(self.module, g + suffix) for g in GRAPHS if hasattr(self.module, g + suffix)}

    def _loss(self) -> Any:
        loss = getattr(self.module, "loss", None)
        if loss is None:
            if self.spec.n_stages - 1 not in self.spec.stages:
                return None  # this rank does not hold the last stage: it never computes the loss
            raise SavedProgramError(f"rank {self.rank}'s program has no loss function: "
                                    + _loss_note(self.module.__file__))
        def saved_loss(leaves: list[torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
            # traced on contiguous examples: its views assume contiguous tensors (contiguous() of one is itself)
            return loss(*[x.contiguous() for x in leaves], targets.contiguous())[0]

        return saved_loss


def load_rank(folder: str, manifest: dict[str, Any], rank: int) -> SavedRank:
    """Import ``rank<rank>.py`` of ``folder`` and read its literals and tensors."""
    entry = manifest["ranks"].get(str(rank))
    if entry is None:
        raise SavedProgramError(f"{folder!r} holds no program for rank {rank} (it has {len(manifest['ranks'])})")
    try:
        module = _import_rank(os.path.join(folder, entry["file"]), f"fxpar_saved_rank{rank}")
        tensors = torch.load(os.path.join(folder, entry["tensors"]), weights_only=True)
        module.constants.update(tensors["constants"])
        return SavedRank(rank, module, spec_from_data(module.SPEC), events_from_data(module.EVENTS), module.PARAMS,
                         tensors["buffers"])
    except (OSError, SyntaxError, AttributeError, KeyError, RuntimeError, EOFError) as e:
        said = str(e).splitlines()[0] if str(e) else ""
        raise SavedProgramError(f"{folder!r}: rank {rank}'s files ({entry['file']}, {entry['tensors']}) are missing, "
                                f"incomplete or corrupt ({type(e).__name__}: {said}): save the program again with "
                                "pm.save") from None


def _import_rank(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _tie_groups(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """Every tied-weight group, created on every rank in the manifest's order; this rank's, by weight."""
    out = {}
    for fqn, ranks in manifest["tie_groups"]:
        group = dist.new_group(ranks)
        if rank in ranks:
            out[fqn] = group
    return out


def _device(mesh: Mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device == "cuda" else torch.device("cpu")


def _placement(text: str) -> Any:
    if text == "R":
        return Replicate()
    match = re.fullmatch(r"S\((\d+)\)", text)
    if match is None:
        raise SavedProgramError(f"unknown parameter placement {text!r}")
    return Shard(int(match.group(1)))


def _empty_param(p: dict[str, Any], pmesh: Any, device: torch.device) -> torch.nn.Parameter:
    placements = [_placement(t) for t in p["placements"]]
    dtype = getattr(torch, p["dtype"])
    local_shape, _ = compute_local_shape_and_global_offset(p["shape"], pmesh, placements)
    local = torch.empty(local_shape, dtype=dtype, device=device)
    dt = DTensor.from_local(local, pmesh, placements, run_check=False, shape=torch.Size(p["shape"]),
                            stride=torch.empty(p["shape"], device="meta").stride())
    return torch.nn.Parameter(dt, requires_grad=p["requires_grad"])


def _loss_note(path: str) -> str:
    with open(path) as f:
        note = next((line.strip() for line in f if line.startswith("# loss: not saved")), "")
    return note.removeprefix("# loss: ") or "it was saved without one"
