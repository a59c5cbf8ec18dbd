"""The one adapter from DTensor's registered op strategies to fxpar candidates.

DTensor is asked about a single mesh axis (a backend-less 1-D ``DeviceMesh``), so its
single-dim strategies, strategy functions, decomposition strategies and legacy rules all
answer the same question: which input placements can produce which output placement.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._ops import OpOverload
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _expand_single_dim_strategy_to_mesh
from torch.distributed.tensor.placement_types import Placement

from fxpar.rules.registry import Candidate

_PROP = DTensor._op_dispatcher.sharding_propagator


@functools.cache
def axis_mesh(n: int) -> DeviceMesh:
    """A backend-less 1-D mesh of ``n`` ranks, for asking DTensor about one axis."""
    return DeviceMesh("cpu", torch.arange(n), _init_backend=False, _rank=0)


def to_schema(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], placements: list[Placement],
              mesh: DeviceMesh) -> OpSchema:
    """An OpSchema whose tensor args (in pytree order) carry ``placements``."""
    it = iter(placements)

    def spec(t: torch.Tensor) -> DTensorSpec:
        p = next(it)
        p = p if isinstance(p, tuple) else (p,)
        return DTensorSpec(mesh, p, TensorMeta(t.shape, t.stride(), t.dtype))

    a = pytree.tree_map_only(torch.Tensor, spec, args)
    k = pytree.tree_map_only(torch.Tensor, spec, kwargs)
    info = _PROP.op_to_schema_info.get(op) or _PROP.op_to_schema_info_for_single_dim_strategy.get(op)
    return OpSchema(op, a, k, schema_info=info)


def dtensor_candidates(
    op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], current: list[Placement], n: int
) -> list[Candidate] | None:
    """DTensor's strategies for ``op`` on one axis, or None if DTensor has none."""
    mesh = axis_mesh(n)
    for placements in (current, [Replicate()] * len(current)):
        try:
            strategy = _strategy(op, to_schema(op, args, kwargs, placements, mesh), mesh)
        except Exception:  # noqa: BLE001 - DTensor refuses these input placements; try replicated
            continue
        if strategy is not None:
            return strategy
    return None


def _strategy(op: OpOverload, schema: OpSchema, mesh: DeviceMesh) -> list[Candidate] | None:
    n_in = len(schema.args_spec)
    if op in _PROP.op_single_dim_strategy_funcs:
        info = _PROP.op_single_dim_strategy_funcs[op]
        out_meta = _PROP._propagate_tensor_meta_non_cached(schema)
        wrapped = _PROP._wrap_with_op_strategy(schema)
        expand = _expand_single_dim_strategy_to_mesh(mesh, wrapped, info, out_meta)
        return _from_op_strategy(expand(op, wrapped.args_meta, wrapped.kwargs_meta), n_in)
    if op in _PROP.op_strategy_funcs:
        return _from_op_strategy(_PROP.op_strategy_funcs[op](_PROP._wrap_with_op_strategy(schema)), n_in)
    if DecompShardingStrategy.has_decomp(op):
        _PROP.decomp_strategy.ensure_schema_info(op)
        return _from_op_strategy(_PROP.decomp_strategy.propagate_strategy(schema), n_in)
    if op in _PROP.op_to_rules:
        out = _PROP.propagate_op_sharding(schema)
        ins = (out.redistribute_schema or schema).args_spec
        return [Candidate(tuple(s.placements[0] for s in ins), _first(out.output_spec))]
    return None


def _from_op_strategy(strategy: Any, n_in: int) -> list[Candidate] | None:
    if not isinstance(strategy, OpStrategy):
        return None
    out = []
    for spec in strategy.strategies:
        output = _first(spec.output_specs)
        if spec.input_specs is None:
            ins = tuple(output for _ in range(n_in))
        else:
            ins = tuple(s.placements[0] for s in spec.input_specs)
        out.append(Candidate(ins, output))
    return out


def _first(specs: Any) -> Any:
    if isinstance(specs, DTensorSpec):
        return specs.placements[0]
    if isinstance(specs, (tuple, list)):
        return tuple(s.placements[0] if isinstance(s, DTensorSpec) else None for s in specs)
    return None
