"""``plan="auto"``: the search with the mesh fixed, and ``plan=None``'s meaning on a mesh that needs a plan."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch

from fxpar.cluster import Cluster
from fxpar.errors import CaptureError, FxparWarning, PlanError
from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.search import MESH_AXES, search


def needs_plan(mesh: Mesh) -> bool:
    """A mesh with an axis that does nothing without a plan: today ``tp`` (dp, cp, ep and pp work unplanned)."""
    return mesh.axes.get("tp", 1) > 1


def default_cluster(mesh: Mesh) -> Cluster:
    """Where ``mesh`` runs: this machine measured for CPU meshes, the GPU's preset for CUDA ones."""
    if mesh.device == "cuda" and torch.cuda.is_available():
        name = "a100-80g" if "A100" in torch.cuda.get_device_name() else "h100-sxm"
        return Cluster.preset(name, gpus=mesh.size)
    return Cluster.measure(ranks=mesh.size)


def auto_plan(model: torch.nn.Module, mesh: Mesh, example_inputs: Any, cluster: Cluster | None = None,
              loss_fn: Any = None, collective: bool = True) -> Plan:
    """``plan="auto"``: the search with every axis of ``mesh`` pinned; the plan's ``notes["auto"]`` says why.

    Mixed precision (bf16 on GPU clusters) applies only to a CUDA mesh. On a launched mesh every rank must
    choose the same plan: with ``collective`` (every rank calls this) the cluster (measured on rank 0 when not
    given) is broadcast before the search, and rank 0's choice after it (the search stops confirming candidates
    after ``budget_s`` seconds, so a rank slower than another could choose differently).
    """
    if collective:  # every rank of a launched mesh calls this: they must all cost on the same numbers
        cluster = _shared(cluster, mesh)
    cluster = cluster or default_cluster(mesh)
    if cluster.gpus != mesh.size:
        cluster = cluster.with_gpus(mesh.size)
    fixed: dict[str, Any] = {axis: mesh.axes.get(axis, 1) for axis in MESH_AXES}
    if mesh.device != "cuda":  # a CPU mesh computes in the model's own dtype, eagerly, whatever the cluster costed
        fixed.update(param_dtype=None, compile=False)

    def choose() -> Plan:
        best = search(model, example_inputs, cluster, loss_fn=loss_fn, fixed=fixed, top=3)[0]
        why = "\n    ".join([*best.explain().splitlines(), *_experts_note(model, mesh)])
        return dataclasses.replace(best.plan, notes={"auto": why})

    return _rank0_choice(choose, mesh) if collective else choose()


def _experts_note(model: torch.nn.Module, mesh: Mesh) -> list[str]:
    """What the plan leaves as it is and the reader should know: MoE experts without an ep axis run whole on every
    rank (fxpar shards experts over ``ep`` only), however the search shards the rest."""
    from fxpar.rules.token_local import is_hf_experts

    experts = [p for p, m in model.named_modules() if p and is_hf_experts(m)]
    if not experts or mesh.axes.get("ep", 1) > 1:
        return []
    return [f"experts: {len(experts)} experts modules ({experts[0]}, ...) run whole on every rank of this mesh: fxpar "
            "shards experts over an ep axis only (e.g. Mesh({'dp': ..., 'ep': ..., 'tp': ...}))"]


def _rank0_choice(choose: Callable[[], Plan], mesh: Mesh) -> Plan:
    """On a launched mesh, rank 0's ``choose()`` on every rank (each rank runs it, so all wait alike); what rank 0
    raised is raised on every rank."""
    import torch.distributed as dist

    if mesh.fake or not dist.is_initialized():
        return choose()
    try:
        box: list[Any] = [(choose(), None)]
    except Exception as e:  # noqa: BLE001 - rank 0's is raised below on every rank
        box = [(None, e)]
    dist.broadcast_object_list(box, src=0)
    plan, error = box[0]
    if error is not None:
        raise error
    return plan


def _shared(cluster: Cluster | None, mesh: Mesh) -> Cluster | None:
    """On a launched mesh, rank 0's cluster (measured there alone when not given) on every rank; a measurement that
    fails on rank 0 fails on every rank (the others would wait in the broadcast, then issue other collectives)."""
    import torch.distributed as dist

    if mesh.fake or not dist.is_initialized():
        return cluster
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [(cluster or default_cluster(mesh), None)]
        except Exception as e:  # noqa: BLE001 - raised below on every rank
            box = [(None, f"{type(e).__name__}: {e}")]
    dist.broadcast_object_list(box, src=0)
    found, error = box[0]
    if error is not None:
        raise RuntimeError(f"measuring this machine for the planner failed on rank 0: {error}")
    return found


def resolve_plan_arg(plan: Any, model: torch.nn.Module, mesh: Mesh, example_inputs: Any, cluster: Cluster | None,
                     loss_fn: Any, none_means_auto: bool = True) -> Any:
    """``parallelize``'s ``plan`` argument made concrete: ``"auto"`` searched; ``None`` searched too when the mesh
    needs a plan (and ``none_means_auto``), falling back to replication with a ``FxparWarning`` if the planner
    cannot handle the model; any other string is a PlanError."""
    if plan == "auto":  # compile_program (none_means_auto False) runs on one rank: no broadcast there
        return auto_plan(model, mesh, example_inputs, cluster, loss_fn, collective=none_means_auto)
    if isinstance(plan, str):
        raise PlanError(f"plan must be a fxpar.Plan, a dict of module globs to styles, 'auto' or None, got {plan!r}")
    if plan is None and none_means_auto and needs_plan(mesh):
        try:
            return auto_plan(model, mesh, example_inputs, cluster, loss_fn)
        except CaptureError:
            raise
        except Exception as e:  # noqa: BLE001  (plan=None must keep working where the planner does not)
            warnings.warn(f"fxpar: plan=None on a mesh with a tp axis {mesh.describe()} asks the planner, which "
                          f"could not choose ({type(e).__name__}: {str(e).splitlines()[0]}); every module is "
                          "replicated over tp. Pass a Plan(tp=...) or plan='auto' to see the error", FxparWarning,
                          stacklevel=3)
    return plan
