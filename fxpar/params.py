"""A rank's state from the user's model: parameters as DTensors (sharded as the plan says), buffers, the bound
stage graphs, and the process groups of tied weights. ``ParallelModule`` calls ``materialize`` once."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from fxpar.backends.classic import CLASSIC, gloo_collectives
from fxpar.backends.comm import bind_groups
from fxpar.compiled import Compiled
from fxpar.direct_calls import direct_calls
from fxpar.executor import StageRunner
from fxpar.inductor import compiled_graph
from fxpar.ir import Program
from fxpar.local_optimizer import own_parameter
from fxpar.mesh import Mesh
from fxpar.random_draws import draws_random, sync_generators
from fxpar.rank_spec import StageSpec, stage_spec
from fxpar.rank_step import backward_halves, tie_holders, tie_ranks
from fxpar.state_paths import non_persistent_buffers, owner_module


class RankParameters(torch.nn.Module):
    """A rank's parameters (DTensors registered under their model paths), its stage buffers and bound stage
    runners: what the step executor reads and writes (``fxpar.executor.RankState``). ``ParallelModule`` is one;
    ``fxpar.run`` builds one from a saved folder, without the model."""

    def __init__(self) -> None:
        super().__init__()
        self._runners: dict[int, StageRunner] = {}
        self._stage_buffers: dict[int, list[torch.Tensor]] = {}
        self._gathered: dict[str, torch.Tensor] = {}  # ZeRO: tp-local parameters gathered for the current step
        self._owners: dict[str, tuple[torch.nn.Module, str]] = {}  # fqn -> (module, name): get_parameter's walk, once
        self._grad_specs: dict[tuple[str, torch.dtype], DTensorSpec] = {}

    def param(self, fqn: str) -> torch.Tensor:
        """The parameter at ``fqn``: read from its module's ``_parameters`` each time (so a parameter replaced by
        ``load_state_dict(assign=True)`` is seen), the module found once."""
        owner = self._owners.get(fqn)
        if owner is None:
            path, _, leaf = fqn.rpartition(".")
            owner = self._owners[fqn] = (self.get_submodule(path) if path else self, leaf)
        return owner[0]._parameters[owner[1]]

    def local_param(self, fqn: str, differentiable: bool = False) -> torch.Tensor:
        """What the rank's graphs compute with: the local shard, or (ZeRO, inside ``pm.step``) the gathered one.

        ``differentiable``: a view autograd connects to the DTensor parameter (``pm(x)`` then ``loss.backward()``);
        ``pm.step`` computes its own gradients and hands them to ``add_local_grad``, so it takes the shard itself."""
        if fqn in self._gathered:
            return self._gathered[fqn]
        p = self.param(fqn)
        if not isinstance(p, DTensor):
            return p
        return p.to_local() if differentiable else p._local_tensor

    def gather_params(self) -> None:
        """ZeRO-1/2: all-gather every dp-sharded parameter this rank holds (its stages' ``gather_params`` graphs)."""
        for runner in self._runners.values():
            if runner.gather is not None:
                self.gather_stage_params(runner)

    def gather_stage_params(self, runner: StageRunner) -> None:
        """ZeRO-1/2: run one stage's ``gather_params`` graph on this rank's shards; keep the working copies."""
        shards = [self.param(f)._local_tensor for f in runner.zero_fqns]
        self._gathered.update(zip(runner.zero_fqns, runner.gather(*shards), strict=True))

    def release_params(self) -> None:
        """Drop the gathered copies (after a step: the optimizer updates the shards)."""
        self._gathered.clear()

    def stage_buffers(self, stage: int) -> list[torch.Tensor]:
        """The buffers ``stage``'s forward takes after the parameters (``StageSpec.buffer_fqns``)."""
        return self._stage_buffers[stage]

    def add_local_grad(self, fqn: str, g: torch.Tensor) -> None:
        """Accumulate a local gradient shard into the parameter's ``.grad`` (a DTensor like the parameter).

        The DTensor is built from a spec cached per parameter and dtype, and an existing gradient is summed on
        the local shards: ``DTensor.from_local`` and a DTensor ``+`` per parameter and step cost more than a
        small model's whole backward on CPU."""
        p = self.param(fqn)
        if not isinstance(p, DTensor):
            p.grad = g if p.grad is None else p.grad + g
            return
        if p.grad is not None:
            g = p.grad._local_tensor + g
        p.grad = DTensor(g, self._grad_spec(fqn, p, g), requires_grad=False)

    def _grad_spec(self, fqn: str, p: DTensor, g: torch.Tensor) -> DTensorSpec:
        key = (fqn, g.dtype)
        spec = self._grad_specs.get(key)
        if spec is None or spec.mesh is not p.device_mesh or spec.placements != tuple(p.placements):
            spec = self._grad_specs[key] = DTensorSpec(p.device_mesh, tuple(p.placements),
                                                       TensorMeta(p.shape, p.stride(), g.dtype))
        return spec


def register_param(root: torch.nn.Module, fqn: str, param: torch.nn.Parameter) -> None:
    """Register ``param`` on ``root`` under the dotted path ``fqn`` (creating empty submodules on the way); optimizer
    steps over it compute on its local shard (``fxpar.local_optimizer``)."""
    mod, leaf = owner_module(root, fqn)
    mod.register_parameter(leaf, param)
    own_parameter(param)


def stage_buffer_values(root: torch.nn.Module, st: StageSpec, buffers: dict[str, torch.Tensor],
                        device: torch.device, non_persistent: frozenset[str] | None = None) -> list[torch.Tensor]:
    """The buffers a stage's forward takes (``st.buffer_fqns``), from ``buffers``. One it writes (BatchNorm's
    running statistics) is a copy, registered on ``root`` under its path (``pm.named_buffers()``, ``state_dict``,
    checkpoints; ``fxpar.run``'s too): the user's model is not mutated, and the trained statistics are where the
    model keeps its own. With ``non_persistent`` (the model's buffers kept out of its ``state_dict``) every buffer
    is such a copy, persistent as in the model: the module's ``state_dict`` then holds what the model's does, and
    ``pm.load_state_dict`` reaches a buffer the program only reads (a frozen BatchNorm's statistics)."""
    out = []
    for fqn in st.buffer_fqns:
        held = buffer_at(root, fqn)  # a buffer two stages of this rank read or write is one tensor
        if held is not None and (non_persistent is not None or fqn in st.written_buffers):
            out.append(held)
            continue
        value = buffers[fqn].detach().to(device)
        if fqn in st.written_buffers or non_persistent is not None:
            value = register_buffer(root, fqn, value.clone(), persistent=fqn not in (non_persistent or ()))
        out.append(value)
    return out


def register_buffer(root: torch.nn.Module, fqn: str, value: torch.Tensor, persistent: bool = True) -> torch.Tensor:
    """Register ``value`` as a buffer on ``root`` under the dotted path ``fqn``; return it."""
    mod, leaf = owner_module(root, fqn)
    mod.register_buffer(leaf, value, persistent=persistent)
    return value


def materialize(root: torch.nn.Module, compiled: Compiled, model: torch.nn.Module, rank: int
                ) -> tuple[dict[int, list[torch.Tensor]], dict[int, StageRunner], list[tuple[str, Any]],
                           dist.ProcessGroup | None]:
    """Register ``rank``'s parameters on ``root`` (each once, as a DTensor on the mesh without ``pp``; a ZeRO
    parameter as its dp shard); return its buffers and bound stage runners per stage, its tied-weight groups and
    its pipeline group (``None`` without stages)."""
    mesh = compiled.mesh
    pmesh = param_mesh(mesh, mesh.device_mesh())
    state = dict(model.named_parameters())
    for s in compiled.stage_of_rank(rank):
        prog = compiled.stages[s]
        for fqn, name in prog.signature.params:
            if _has_path(root, fqn):
                continue
            p = state[fqn]
            if p.is_meta:
                raise ValueError(f"parameter {fqn!r} is on the meta device: initialize it before running")
            dt = compact(distribute_tensor(p.detach().to(_device(mesh)), pmesh, param_placements(prog, fqn, name)))
            register_param(root, fqn, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
    stage_buffers, runners = bind_runners(root, compiled, dict(model.named_buffers(remove_duplicate=False)), rank,
                                          non_persistent_buffers(model))
    pp_group = mesh.device_mesh().get_group("pp") if mesh.axes.get("pp", 1) > 1 else None
    return stage_buffers, runners, _tie_groups(compiled, rank), pp_group


def compact(dt: DTensor) -> DTensor:
    """``dt`` with a local piece that holds only its own elements: ``distribute_tensor`` pads a dim that does not
    divide evenly, scatters, and narrows, so the last rank's smaller piece kept a view of the padded buffer (more
    storage than ``pm.memory`` counts, and than the piece needs)."""
    local = dt._local_tensor
    if local.untyped_storage().nbytes() <= local.numel() * local.element_size():
        return dt
    return DTensor.from_local(local.clone(), dt.device_mesh, dt.placements, run_check=False, shape=dt.shape,
                              stride=dt.stride())


def bind_runners(root: torch.nn.Module, compiled: Compiled, buffers: dict[str, torch.Tensor], rank: int,
                 non_persistent: frozenset[str]) -> tuple[dict[int, list[torch.Tensor]], dict[int, StageRunner]]:
    """``rank``'s buffers and bound stage runners per stage of ``compiled``, over the parameters registered on
    ``root`` (a second program of the same model, ``fxpar.modes``, must store each one as the first does)."""
    mesh = compiled.mesh
    dm = mesh.device_mesh()
    stage_buffers: dict[int, list[torch.Tensor]] = {}
    runners: dict[int, StageRunner] = {}
    for s in compiled.stage_of_rank(rank):
        _check_stored_alike(root, compiled.stages[s])
        spec = stage_spec(compiled, rank, s)
        stage_buffers[s] = stage_buffer_values(root, spec, buffers, _device(mesh), non_persistent)
        rp = compiled.rank_program(rank, s)
        names = {sym: group_name(dm, sym) for sym in rp.groups}
        runners[s] = StageRunner(spec, bound_graphs(compiled, rank, s, names))
    if draws_random([prog.graph for prog in compiled.stages]):  # every rank decides alike: the global programs
        sync_generators(mesh.device)  # copies of a random value must agree on every rank (fxpar.random_draws)
    return stage_buffers, runners


def _device(mesh: Mesh) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if mesh.device == "cuda" else torch.device("cpu")


def _check_stored_alike(root: torch.nn.Module, prog: Program) -> None:
    """Every parameter ``prog`` reads is registered on ``root`` with the placements ``prog`` stores it in."""
    for fqn, name in prog.signature.params:
        if not _has_path(root, fqn):
            raise RuntimeError(f"parameter {fqn!r} is not held by this rank's module: the program was compiled with "
                               "another pipeline split than the one its parameters were placed by")
        p = root.get_parameter(fqn)
        wanted = tuple(param_placements(prog, fqn, name))
        if isinstance(p, DTensor) and tuple(p.placements) != wanted:
            raise RuntimeError(f"parameter {fqn!r} is stored as {tuple(p.placements)} but this program reads it as "
                               f"{wanted}: the two programs of one module (fxpar.modes: training and evaluation) "
                               "must place each parameter alike")


def bound_graphs(compiled: Compiled, rank: int, stage: int, names: dict[str, str]) -> dict[str, Any]:
    """Every graph a step event of ``rank``'s ``stage`` may run, with its collectives bound to real groups
    (``GraphModule``s; with ``Plan(compile=True)`` each compiled by Inductor on its first call). Eager graphs
    call ops directly (``fxpar.direct_calls``) and, on gloo, run their collectives through the classic API
    (``fxpar.backends.classic``)."""
    rp = compiled.rank_program(rank, stage)
    graphs = {"forward": rp.forward, "backward": rp.backward, "reduce_grads": rp.reduce_grads,
              "gather_params": rp.gather_params}
    if stage in backward_halves(compiled, rank):
        graphs["backward_b"] = compiled.stage_graph(rank, stage, "backward_b")
        graphs["backward_w"] = compiled.stage_graph(rank, stage, "backward_w")
    eager = not compiled.plan.compile  # Inductor reinplaces collectives itself
    bound = {name: bind_groups(gm, names, reinplace=eager) for name, gm in graphs.items() if gm is not None}
    if not eager:  # Inductor, on each graph's first call
        return {name: compiled_graph(gm, f"rank {rank} stage {stage} {name}") for name, gm in bound.items()}
    overrides = CLASSIC if compiled.mesh.device == "cpu" and gloo_collectives() == "classic" else None
    return {name: direct_calls(gm, overrides) for name, gm in bound.items()}


def param_placements(prog: Program, fqn: str, name: str) -> list[Placement]:
    """How parameter ``fqn`` (placeholder ``name`` of ``prog``) is stored on ``param_mesh``: its placements on
    every axis but ``pp`` (``[Replicate()]`` when ``pp`` is the only axis), dp-sharded under ZeRO."""
    names = prog.mesh.names
    placements = [pl for pl, a in zip(prog.placements[name], names, strict=True) if a != "pp"] or [Replicate()]
    if fqn in prog.notes.get("zero", {}):  # ZeRO: stored as this rank's dp shard
        placements[[a for a in names if a != "pp"].index("dp")] = Shard(prog.notes["zero"][fqn])
    return placements


def param_mesh(mesh: Mesh, dm: DeviceMesh) -> DeviceMesh:
    """The mesh parameters live on: every axis but ``pp`` (a stage's ranks)."""
    names = tuple(n for n in mesh.names if n != "pp")
    if len(names) == len(mesh.names):
        return dm
    if names:
        return dm[names]
    pp = mesh.axes["pp"]
    solo = DeviceMesh(mesh.device, torch.arange(mesh.size).reshape(pp, 1), mesh_dim_names=("pp", "stage"))
    return solo["stage"]  # a mesh of this rank alone: parameters replicated on it


def axis_group(dm: DeviceMesh, symbolic: str) -> dist.ProcessGroup:
    """The process group of a lowered graph's symbolic group (``"tp[2,3]"``: this rank's group of axis ``tp``)."""
    return dm.get_group(symbolic.split("[")[0])


def group_name(dm: DeviceMesh, symbolic: str) -> str:
    return axis_group(dm, symbolic).group_name


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


def buffer_at(root: torch.nn.Module, fqn: str) -> torch.Tensor | None:
    try:
        return root.get_buffer(fqn)
    except AttributeError:
        return None
