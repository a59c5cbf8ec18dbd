"""Collectives as they appear in printed and saved rank programs, and group binding.

Lowered graphs call ``torch.ops._c10d_functional`` with a symbolic group name such as
``"tp[2,3]"``; ``bind_groups`` rewrites those names to the real process groups of a launched
mesh. Saved standalone programs call the thin wrappers below instead; on gloo they run through the classic API
(``fxpar.backends.classic``), as bound rank graphs do.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from fxpar.backends import classic
from fxpar.backends.classic import CLASSIC, gloo_collectives
from torch.distributed.distributed_c10d import _resolve_process_group

c10d = torch.ops._c10d_functional
COLLECTIVES = {
    c10d.all_reduce.default: "all_reduce",
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.wait_tensor.default: "wait",
}
_GROUPS: dict[str, str] = {}


_GROUP_ARG = {c10d.all_reduce.default: 2, c10d.all_gather_into_tensor.default: 2,
              c10d.reduce_scatter_tensor.default: 3, c10d.all_to_all_single.default: 3}


def group_arg_index(target: object) -> int | None:
    """Position of the group-name argument of a lowered collective, if ``target`` is one."""
    return _GROUP_ARG.get(target) if isinstance(target, torch._ops.OpOverload) else None


def bind_groups(gm: fx.GraphModule, names: dict[str, str], reinplace: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` whose collectives use real process-group names (``names[symbolic]``).

    ``reinplace``: an all-reduce of a buffer nothing else reads (a gradient bucket's ``cat``) reduces it in place
    (``all_reduce_``): the same collective and bytes, without the functional op's copy of the buffer (3 ms of a
    10 MB bucket on CPU). The printed program, ledger and proof keep the functional op: the result is the same."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        new = g.node_copy(n, lambda a: env[a])
        i = group_arg_index(n.target)
        if i is not None:
            args = list(new.args)
            args[i] = names[args[i]]
            new.args = tuple(args)
        if reinplace and _reduces_a_private_buffer(n):
            new.target = c10d.all_reduce_.default
        env[n] = new
    out = fx.GraphModule(gm, g)
    out.recompile()
    return out


def register_group(symbolic: str, pg: dist.ProcessGroup) -> None:
    """Make ``symbolic`` usable by saved programs (``comm.all_reduce(x, "sum", TP)``)."""
    _GROUPS[symbolic] = pg.group_name


def _resolve(group: str) -> str:
    return _GROUPS.get(group, group)


def _classic(name: str) -> bool:
    """Whether collectives on process group ``name`` go through the classic API (gloo, by default)."""
    return gloo_collectives() == "classic" and dist.get_backend(_resolve_process_group(name)) == "gloo"


def _call(op: torch._ops.OpOverload, group: str, *args: object) -> torch.Tensor:
    name = _resolve(group)
    return (CLASSIC[op] if _classic(name) else op)(*args, name)


def _reduces_a_private_buffer(n: fx.Node) -> bool:
    """An all-reduce whose input is a fresh ``cat`` that only it reads."""
    if n.target is not c10d.all_reduce.default:
        return False
    x = n.args[0]
    return isinstance(x, fx.Node) and x.target is torch.ops.aten.cat.default and len(x.users) == 1


def all_reduce(x: torch.Tensor, op: str, group: str) -> torch.Tensor:
    return _call(c10d.all_reduce.default, group, x, op)


def all_gather(x: torch.Tensor, n: int, group: str) -> torch.Tensor:
    return _call(c10d.all_gather_into_tensor.default, group, x, n)


def reduce_scatter(x: torch.Tensor, op: str, n: int, group: str) -> torch.Tensor:
    return _call(c10d.reduce_scatter_tensor.default, group, x, op, n)


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
               group: str) -> torch.Tensor:
    return _call(c10d.all_to_all_single.default, group, x, output_split_sizes, input_split_sizes)


def rank_sizes(counts: torch.Tensor, ranks: int) -> list[int]:
    """The split sizes of an all-to-all of expert-sorted rows: ``counts`` (rows per expert, experts in contiguous
    blocks of ``E / ranks`` per rank) summed per rank. It reads real counts, a host sync, as every EP dispatch does."""
    return counts.view(ranks, -1).sum(dim=1).tolist()


def wait(x: torch.Tensor) -> torch.Tensor:
    return classic.wait_tensor(x)  # the functional wait for a tensor the classic API did not issue
