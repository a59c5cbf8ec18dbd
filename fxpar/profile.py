"""What the planner's closed forms need to know about a model, read off small compiles of it.

``profile_model`` compiles the model on a one-rank fake mesh for one sample, twice: with its repeated
blocks cut to one and to two (a shallow copy; the user's model is untouched). From those programs:

* forward seconds per sample on the cluster of one block, and of the rest (embeddings, head, loss), and
  the part of a block's time that tensor parallelism divides (the nodes of the groups ``fxpar.tp_styles``
  finds, and attention between them): FLOPs and the bytes of activations, what grows with the batch
  (weights are read once per microbatch whatever its size, and each node's dispatch overhead is counted
  apart, once per microbatch, from the number of compute nodes);
* the activation one block hands the next (bytes per sample), the bytes one block saves for its backward
  (the difference of the two compiles' ``pm.memory``), and what the rest saves;
* parameters per block and in total, and the model FLOPs per sample (6 N plus attention, no recompute).

Everything is per sample and scales with the microbatch: the closed forms in ``fxpar.search`` multiply.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from fxpar.cluster import Cluster
from fxpar.compiled import Compiled, compile_model
from fxpar.costs import node_bytes, node_flops, sample_time, weight_nodes
from fxpar.errors import CaptureError, PlanError
from fxpar.memory import nbytes
from fxpar.memory import predict as predict_memory
from fxpar.mesh import Mesh
from fxpar.modules import module_table
from fxpar.plan import Plan
from fxpar.stages import block_paths
from fxpar.structure import structure_of
from fxpar.tp_styles import TpGroup, find_groups

_ONE_RANK = Mesh({"dp": 1}, fake=True)


@dataclass
class ModelProfile:
    """Per-sample costs of one block and of the rest (module docstring)."""

    n_blocks: int
    block_parent: str | None  # "model.layers": the groups' globs go under it (None: the model is one block)
    groups: list[TpGroup]
    params_total: int  # trainable elements
    params_block: int
    param_bytes: int  # bytes per master-weight element
    block_time: float  # forward seconds per sample on one device
    block_shardable: float  # the part of it tensor parallelism divides
    rest_time: float
    block_ops: int  # compute nodes of one block's forward: each costs the per-op overhead once per microbatch
    rest_ops: int
    boundary_bytes: int  # one block's output, per sample
    reduced_bytes: int  # the groups' rowwise outputs (what tp reduces once each in forward and backward), per sample
    block_saved: int  # bytes one block saves for its backward, per sample
    rest_saved: int
    flops_per_sample: float  # model FLOPs (forward x 3) of one sample
    tokens_per_sample: int
    batch: int  # global samples per step
    seconds: dict[str, float] = field(default_factory=dict)  # how long profiling took
    working_bytes: int = 0  # bytes per working-copy element (``param_dtype``'s); 0: the master's


def profile_model(model: torch.nn.Module, example_inputs: Any, cluster: Cluster, *, loss_fn: Any = None,
                  param_dtype: torch.dtype | None = None) -> ModelProfile:
    """Profile ``model`` for ``cluster`` (module docstring). Raises PlanError for a model without repeated blocks."""
    blocks = block_paths(model)
    alike = representative_blocks(model, blocks)
    if len(alike) < 2:
        blocks = alike = [""]  # no repeated blocks: the whole model is one
    batch = _batch(example_inputs)
    one = _slice_batch(example_inputs)
    plan = Plan(param_dtype=param_dtype)
    cut = (lambda k: _truncated(model, blocks, alike[:k])) if len(blocks) > 1 else None
    try:
        small = compile_model(cut(1), _ONE_RANK, one, plan, loss_fn) if cut else None
        two_model = cut(2) if cut and (len(blocks) > 2 or alike != blocks) else model
        two = compile_model(two_model, _ONE_RANK, one, plan, loss_fn)
    except CaptureError:
        if cut is None:
            raise
        # the model's own code needs every block (a U-Net pops its skip connections): profile it as one block
        blocks = alike = [""]
        small, two_model = None, model
        two = compile_model(model, _ONE_RANK, one, plan, loss_fn)
    prog = two.stages[0]
    block = _first_kept(model, blocks, alike)
    groups = find_groups(prog, module_table(two_model), block)
    times = _forward_times(two, block, groups, cluster)
    saved2 = predict_memory(two, 0).activations
    saved1 = predict_memory(small, 0).activations if small is not None else 0
    block_saved = max(saved2 - saved1, 0) if small is not None else saved2
    params_block = _mean_block_params(model, blocks)
    parent = blocks[0].rpartition(".")[0] if blocks[0] else None
    params_total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    master = next((p for p in model.parameters() if p.is_floating_point()), None)
    return ModelProfile(
        n_blocks=len(blocks), block_parent=parent, groups=groups,
        params_total=params_total, params_block=params_block,
        param_bytes=master.element_size() if master is not None else 4,
        block_time=times["block"], block_shardable=times["shardable"], rest_time=times["rest"],
        block_ops=times["block_ops"], rest_ops=times["rest_ops"],
        boundary_bytes=times["boundary"], reduced_bytes=times["reduced"], block_saved=block_saved,
        rest_saved=max(saved1 - block_saved, 0) if small is not None else 0,
        flops_per_sample=_model_flops(two, block, len(blocks)), tokens_per_sample=_tokens(one),
        batch=batch, working_bytes=param_dtype.itemsize if param_dtype is not None else 0,
    )


def representative_blocks(model: torch.nn.Module, blocks: list[str]) -> list[str]:
    """The blocks of the most common structure (class and parameter shapes), in order: all of ``blocks`` when they
    are alike; the MoE layers of a model whose first layers are dense (DeepSeek's ``first_k_dense_replace``,
    Qwen3-MoE's ``mlp_only_layers``), the most common kind of a hybrid's (Jamba). The closed forms price every block
    as one of these; fewer than two: the model has no repeated blocks."""
    kinds = Counter(structure_of(model.get_submodule(b)) for b in blocks)
    if not kinds:
        return []
    common, _ = kinds.most_common(1)[0]
    return [b for b in blocks if structure_of(model.get_submodule(b)) == common]


def _first_kept(model: torch.nn.Module, blocks: list[str], alike: list[str]) -> str:
    """The path of the first representative block in the cut model: a ``ModuleDict`` keeps its keys, a list
    renumbers from 0."""
    parent = blocks[0].rpartition(".")[0]
    keeps_names = isinstance(model.get_submodule(parent) if parent else model, torch.nn.ModuleDict)
    return alike[0] if keeps_names else blocks[0]


def _mean_block_params(model: torch.nn.Module, blocks: list[str]) -> int:
    """Trainable elements per block, averaged over ``blocks`` (so that the rest is the model less all of them)."""
    total = sum(p.numel() for b in blocks for p in model.get_submodule(b).parameters() if p.requires_grad)
    return round(total / len(blocks))


def _truncated(model: torch.nn.Module, blocks: list[str], kept: list[str]) -> torch.nn.Module:
    """A shallow copy of ``model`` whose block list holds only the blocks ``kept`` (modules shared, not copied)."""
    parent_path = blocks[0].rpartition(".")[0]
    root = copy.copy(model)
    root._modules = dict(model._modules)
    holder = root
    parts = parent_path.split(".") if parent_path else []
    for name in parts[:-1]:
        child = copy.copy(holder._modules[name])
        child._modules = dict(child._modules)
        holder._modules[name] = child
        holder = child
    listed = holder._modules[parts[-1]] if parts else root
    names = {b.rpartition(".")[2] for b in kept}
    items = [(name, child) for name, child in listed.named_children() if name in names]
    if isinstance(listed, torch.nn.ModuleDict):
        cut: torch.nn.Module = torch.nn.ModuleDict(items)
    elif isinstance(listed, torch.nn.Sequential):
        cut = type(listed)(*[child for _, child in items])
    else:
        cut = torch.nn.ModuleList([child for _, child in items])
    if not parts:
        return cut
    holder._modules[parts[-1]] = cut
    return root


def _forward_times(c: Compiled, block: str, groups: list[TpGroup], cluster: Cluster) -> dict[str, Any]:
    prog = c.stages[0]
    prefix = block + "." if block else ""
    mine = {prefix + r for g in groups for r in g.regions()}
    out = {"block": 0.0, "shardable": 0.0, "rest": 0.0, "boundary": 0, "reduced": 0, "block_ops": 0, "rest_ops": 0}
    rowwise = {prefix + g.rowwise for g in groups}
    colwise = {prefix + c for g in groups for c in g.colwise}
    undivided = 0  # bytes every tp rank still moves in full: the colwise modules' inputs, the rowwise outputs
    last_of: dict[str, Any] = {}
    weights = weight_nodes(list(prog.graph.nodes), {name for _, name in prog.signature.params})
    for n in prog.graph.nodes:
        prov = prog.provenance.get(n.name)
        if n.op != "call_function" or prov is None or prov.phase != "fwd":
            continue
        seconds = sample_time(n, cluster, weights)
        op = int(bool(node_flops(n) or node_bytes(n)))
        if _inside(prov.module, block):
            out["block"] += seconds
            out["block_ops"] += op
            inside = any(prov.module == m or prov.module.startswith(m + ".") for m in mine)
            if inside:  # the groups' modules and what runs between them (attention, activations)
                out["shardable"] += seconds
            if prov.module == block and "add" in str(n.target):
                out["boundary"] = nbytes(n)
            if prov.module in rowwise:
                last_of[prov.module] = n
            if prov.module in colwise:
                undivided += sum(nbytes(a) for a in n.all_input_nodes
                                 if a not in weights and _module(prog, a) != prov.module)
        elif not _in_other_block(prov.module, block):
            out["rest"] += seconds
            out["rest_ops"] += op
    out["reduced"] = sum(nbytes(n) for n in last_of.values())  # each group's rowwise output, reduced over tp
    out["boundary"] = out["boundary"] or max((nbytes(n) for n in last_of.values()), default=0)
    out["shardable"] = max(out["shardable"] - (undivided + out["reduced"]) / cluster.memory_bandwidth, 0.0)
    return out


def _module(prog: Any, n: Any) -> str | None:
    prov = prog.provenance.get(n.name)
    return prov.module if prov is not None else None



def _inside(module: str, block: str) -> bool:
    return not block or module == block or module.startswith(block + ".")


def _in_other_block(module: str, block: str) -> bool:
    parent = block.rpartition(".")[0]
    return bool(parent) and module.startswith(parent + ".") and not module.startswith(block)


def _model_flops(c: Compiled, block: str, n_blocks: int) -> float:
    """Forward FLOPs x 3 of the whole model for one sample: the rest once, one block ``n_blocks`` times."""
    prog = c.stages[0]
    per_block = rest = 0.0
    parent = block.rpartition(".")[0]
    for n in prog.graph.nodes:
        prov = prog.provenance.get(n.name)
        if n.op != "call_function" or prov is None or prov.phase != "fwd":
            continue
        f = node_flops(n)
        if _inside(prov.module, block):
            per_block += f
        elif not (parent and prov.module.startswith(parent + ".")):
            rest += f
    return 3.0 * (rest + per_block * n_blocks)


def _batch(inputs: Any) -> int:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    for v in values:
        if isinstance(v, torch.Tensor) and v.dim():
            return int(v.shape[0])
    raise PlanError("example_inputs hold no tensor with a batch dim: the planner splits dim 0 over dp and microbatches")


def _slice_batch(inputs: Any) -> Any:
    def one(v: Any) -> Any:
        return v[:1] if isinstance(v, torch.Tensor) and v.dim() else v

    return {k: one(v) for k, v in inputs.items()} if isinstance(inputs, dict) else tuple(one(v) for v in inputs)


def _tokens(inputs: Any) -> int:
    values = inputs.values() if isinstance(inputs, dict) else inputs
    for v in values:
        if isinstance(v, torch.Tensor) and not v.is_floating_point() and v.dim() >= 1:
            return int(v.numel())
    return 1
