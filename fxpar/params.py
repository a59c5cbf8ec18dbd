"""A rank's state from the user's model: parameters as DTensors (sharded as the plan says), buffers, the bound
stage graphs, and the process groups of tied weights. ``ParallelModule`` calls ``materialize`` once."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fxpar.compiled import Compiled
from fxpar.executor import StageRunner
from fxpar.mesh import Mesh
from fxpar.rank_step import tie_holders, tie_ranks


def materialize(root: torch.nn.Module, compiled: Compiled, model: torch.nn.Module, rank: int
                ) -> tuple[dict[int, list[torch.Tensor]], dict[int, StageRunner], list[tuple[str, Any]]]:
    """Register ``rank``'s parameters on ``root`` (each once, as a DTensor on the mesh without ``pp``; a ZeRO
    parameter as its dp shard); return its buffers and bound stage runners per stage, and its tied-weight groups."""
    mesh = compiled.mesh
    dm = mesh.device_mesh()
    param_mesh, keep = _param_mesh(mesh, dm)
    on_cuda = mesh.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    state = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    stage_buffers: dict[int, list[torch.Tensor]] = {}
    runners: dict[int, StageRunner] = {}
    for s in compiled.stage_of_rank(rank):
        prog = compiled.stages[s]
        for fqn, name in prog.signature.params:
            if _has_path(root, fqn):
                continue
            p = state[fqn]
            if p.is_meta:
                raise ValueError(f"parameter {fqn!r} is on the meta device: initialize it before running")
            placements = [pl for pl, k in zip(prog.placements[name], keep, strict=True) if k] or [Replicate()]
            if fqn in prog.notes.get("zero", {}):  # ZeRO: stored as this rank's dp shard
                dp_index = [a for a in mesh.names if a != "pp"].index("dp")
                placements[dp_index] = Shard(prog.notes["zero"][fqn])
            dt = distribute_tensor(p.detach().to(device), param_mesh, placements)
            _register_path(root, fqn, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
        stage_buffers[s] = [buffers[fqn].detach().to(device) for fqn, _ in prog.signature.buffers]
        rp = compiled.rank_program(rank, s)
        names = {sym: _group_name(dm, sym) for sym in rp.groups}
        runners[s] = StageRunner(compiled, rank, s, names)
    return stage_buffers, runners, _tie_groups(compiled, rank)


def _param_mesh(mesh: Mesh, dm: DeviceMesh) -> tuple[DeviceMesh, list[bool]]:
    """The mesh parameters live on (every axis but ``pp``: a stage's ranks) and which axes it keeps."""
    keep = [name != "pp" for name in mesh.names]
    names = tuple(n for n in mesh.names if n != "pp")
    if len(names) == len(mesh.names):
        return dm, keep
    if names:
        return dm[names], keep
    pp = mesh.axes["pp"]
    solo = DeviceMesh(mesh.device, torch.arange(mesh.size).reshape(pp, 1), mesh_dim_names=("pp", "stage"))
    return solo["stage"], keep  # a mesh of this rank alone: parameters replicated on it


def _group_name(dm: DeviceMesh, symbolic: str) -> str:
    return dm.get_group(symbolic.split("[")[0]).group_name


def _tie_groups(compiled: Compiled, rank: int) -> list[tuple[str, Any]]:
    """The process groups of ``tie_ranks``. Every rank creates every group (``new_group`` is collective),
    in one deterministic order."""
    mesh = compiled.mesh
    mine = dict(tie_ranks(compiled, rank))
    out = []
    for fqn, pps in tie_holders(compiled).items():
        group_of_rank = None
        for r in range(mesh.size):
            if compiled.pp_coord(r) != pps[0]:
                continue
            ranks = dict(tie_ranks(compiled, r))[fqn]
            group = dist.new_group(list(ranks))
            if rank in ranks:
                group_of_rank = group
        if fqn in mine:
            out.append((fqn, group_of_rank))
    return out


def _has_path(root: torch.nn.Module, fqn: str) -> bool:
    try:
        root.get_parameter(fqn)
        return True
    except AttributeError:
        return False


def _register_path(root: torch.nn.Module, fqn: str, param: torch.nn.Parameter) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), torch.nn.Module):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)
