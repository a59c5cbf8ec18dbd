"""The functional collectives of a rank program, run through the classic ``torch.distributed`` API on gloo.

Lowered graphs, printed programs and ledgers call ``torch.ops._c10d_functional`` (``all_reduce`` returns a new
tensor; ``wait_tensor`` waits for it). On gloo, that path lost a rank to a native abort inside gloo's worker
threads about once per 200,000-790,000 batches of collectives, whatever fxpar kept in flight, while the same loop
through the classic API (``async_op=True``, then ``Work.wait()``: how DDP and FSDP2 call gloo) ran a million
batches without one (bench/README.md section 12). ``CLASSIC[op]`` does what ``op`` does (same reduction, same
output tensor shape and values) through that API; its ``wait_tensor`` waits for the ``Work`` the issue returned,
and falls back to the functional wait for a tensor it did not issue.

``FXPAR_GLOO_COLLECTIVES=functional`` runs gloo rank programs through the functional ops as they are printed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

c10d = torch.ops._c10d_functional
GlooCollectives = Literal["classic", "functional"]
GLOO_COLLECTIVES: GlooCollectives = "classic"
GLOO_COLLECTIVES_ENV = "FXPAR_GLOO_COLLECTIVES"
_PENDING: dict[int, tuple[torch.Tensor, dist.Work]] = {}  # id(output) -> (output, its work)
_ISSUED = [0]  # collectives issued through this module since the process started


def gloo_collectives() -> GlooCollectives:
    """Which API runs a gloo rank program's collectives: ``$FXPAR_GLOO_COLLECTIVES``, else ``GLOO_COLLECTIVES``."""
    value = os.environ.get(GLOO_COLLECTIVES_ENV, GLOO_COLLECTIVES)
    if value not in get_args(GlooCollectives):
        raise ValueError(f"{GLOO_COLLECTIVES_ENV}={value!r}: expected one of {', '.join(get_args(GlooCollectives))}")
    return value  # type: ignore[return-value]


def _group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)  # not cached: a later process group may reuse a destroyed one's name


def _reduce_op(op: str) -> dist.ReduceOp:
    return getattr(dist.ReduceOp, op.upper())


def _issued(out: torch.Tensor, work: dist.Work | None) -> torch.Tensor:
    _ISSUED[0] += 1
    if work is not None:
        _PENDING[id(out)] = (out, work)
    return out


def all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    """``_c10d_functional.all_reduce``: a reduced copy of ``x``."""
    return all_reduce_(x.clone(memory_format=torch.contiguous_format), op, group)


def all_reduce_(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    """``_c10d_functional.all_reduce_``: ``x`` reduced in place."""
    return _issued(x, dist.all_reduce(x, _reduce_op(op), group=_group(group), async_op=True))


def all_gather_into_tensor(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    """``_c10d_functional.all_gather_into_tensor``: the ``n`` ranks' ``x`` stacked along dim 0."""
    out = x.new_empty((x.shape[0] * n, *x.shape[1:]))
    return all_gather_into_tensor_out(x, n, group, out=out)


def all_gather_into_tensor_out(x: torch.Tensor, n: int, group: str, *, out: torch.Tensor) -> torch.Tensor:
    """``_c10d_functional.all_gather_into_tensor_out``: the gather written into ``out``."""
    return _issued(out, dist.all_gather_single(out, x.contiguous(), group=_group(group), async_op=True))


def reduce_scatter_tensor(x: torch.Tensor, op: str, n: int, group: str) -> torch.Tensor:
    """``_c10d_functional.reduce_scatter_tensor``: this rank's ``1/n`` of dim 0 of the reduced ``x``."""
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    work = dist.reduce_scatter_single(out, x.contiguous(), _reduce_op(op), group=_group(group), async_op=True)
    return _issued(out, work)


def all_to_all_single(x: torch.Tensor, output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                      group: str) -> torch.Tensor:
    """``_c10d_functional.all_to_all_single``: rows exchanged by the given split sizes (even when ``None``)."""
    rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=_group(group),
                                  async_op=True)
    return _issued(out, work)


def wait_tensor(x: torch.Tensor) -> torch.Tensor:
    """``_c10d_functional.wait_tensor``: ``x`` once the collective that produces it has finished."""
    pending = _PENDING.pop(id(x), None)
    if pending is None:  # issued by a functional op (an Inductor graph, a saved program's other path)
        return c10d.wait_tensor.default(x)
    pending[1].wait()
    return x


def pending() -> int:
    """How many classic collectives were issued and not yet waited (0 after every complete rank graph)."""
    return len(_PENDING)


def issued() -> int:
    """How many collectives this process issued through the classic API."""
    return _ISSUED[0]


CLASSIC: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    c10d.all_reduce.default: all_reduce,
    c10d.all_reduce_.default: all_reduce_,
    c10d.all_gather_into_tensor.default: all_gather_into_tensor,
    c10d.all_gather_into_tensor_out.default: all_gather_into_tensor_out,
    c10d.reduce_scatter_tensor.default: reduce_scatter_tensor,
    c10d.all_to_all_single.default: all_to_all_single,
    c10d.wait_tensor.default: wait_tensor,
}
