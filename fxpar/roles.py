"""Lower once per role: ranks whose programs differ only in their process groups share one lowering.

Lowering a stage for a rank reads the rank's mesh coordinate (which piece of an uneven dim it
holds, which slice of a sharded value, which cp chunks) and names the rank's process groups. A
``ReadCoord`` records which axes' coordinates were read. Another rank of the same stage whose
coordinate agrees on those axes would lower to the same graphs with other group names, so its
program is the role's, bound to its groups (``bind``): the graphs are copied with every group
name (``"tp[0,1]"`` -> ``"tp[2,3]"``), every ledger row's group and the start of every even slice
(a rank's own piece of a whole value, tagged ``COORD_SLICE``; lowering does not count it as a read)
rewritten. A role is a stage plus the coordinates its lowering read; ``pm.program(rank)`` of a
16,384-rank fake mesh lowers one role per stage and binds any rank to it in time linear in the program, not the mesh.
A stage that is an earlier stage over other layers (``fxpar.stage_twins``) lowers nothing: its roles are that
stage's, bound to the rank and renamed (126 layers on 16 stages: 3 stages lowered).

``FXPAR_SHARING=0`` lowers every rank on its own (the programs must be byte-identical).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from fxpar.backends.comm import group_arg_index
from fxpar.blocks import sharing_enabled
from fxpar.gc_pause import without_gc_pauses
from fxpar.ir import graph_module
from fxpar.lower import RankProgram, group_name
from fxpar.lower.collectives import COORD_SLICE
from fxpar.lower.program import LedgerRow
from fxpar.mesh import Mesh
from fxpar.read_coord import ReadCoord  # noqa: F401 - re-exported: the coordinate lowering records
from fxpar.stage_twins import Shift, shifted

BOUND_CACHE = 16  # bound rank programs kept (a fake mesh may have 16,384 ranks: the roles are kept, not the ranks)


@dataclass
class Role:
    """One lowering of a stage: the rank it was lowered for and the coordinate values it read."""

    rank: int
    read: dict[int, int]  # axis index -> coordinate value
    program: RankProgram

    def fits(self, coord: tuple[int, ...]) -> bool:
        return all(coord[a] == v for a, v in self.read.items())


class Roles:
    """The lowered programs of a compiled model, by role; ``program(rank, stage)`` lowers or binds."""

    def __init__(self, mesh: Mesh, lower: Callable[[int, int], RankProgram],
                 twin: Callable[[int, int], tuple[int, int, Shift] | None] | None = None) -> None:
        self.mesh, self._lower, self._twin = mesh, lower, twin
        self.roles: dict[int, list[Role]] = {}  # stage -> its roles so far
        self.read_axes: set[int] = set()  # axes whose coordinate any lowering so far read
        self._bound: OrderedDict[tuple[int, int], RankProgram] = OrderedDict()

    def program(self, rank: int, stage: int) -> RankProgram:
        key = (rank, stage)
        if key in self._bound:
            self._bound.move_to_end(key)
            return self._bound[key]
        rp = self._program(rank, stage)
        self._bound[key] = rp
        if len(self._bound) > BOUND_CACHE:
            self._bound.popitem(last=False)
        return rp

    @without_gc_pauses
    def _program(self, rank: int, stage: int) -> RankProgram:
        coord = self.mesh.coord(rank)
        if sharing_enabled():
            for role in self.roles.get(stage, []):
                if role.fits(coord):
                    return role.program if role.rank == rank else bind(role.program, rank, self.mesh)
            copied = self._from_twin(rank, stage)
            if copied is not None:
                return copied
        rp = self._lower(rank, stage)
        read = set(getattr(rp.coord, "read", range(len(coord))))
        self.read_axes |= read
        rp = dataclasses.replace(rp, coord=tuple(rp.coord), joint=None)  # lowering's intermediate: split, unread
        if sharing_enabled():
            self.roles.setdefault(stage, []).append(Role(rank, {a: coord[a] for a in sorted(read)}, rp))
        return rp

    def _from_twin(self, rank: int, stage: int) -> RankProgram | None:
        """``rank``'s program of ``stage`` copied from an earlier twin stage's role (``fxpar.stage_twins``), when
        that role's lowering read no pipeline coordinate; None when the stage has no twin."""
        found = self._twin(rank, stage) if self._twin is not None else None
        if found is None:
            return None
        twin, twin_rank, shift = found
        self.program(twin_rank, twin)
        twin_coord = self.mesh.coord(twin_rank)
        role = next(r for r in self.roles[twin] if r.fits(twin_coord))
        if "pp" in self.mesh.names and self.mesh.axis_index("pp") in role.read:
            return None
        rp = shifted(bind(role.program, rank, self.mesh), shift, stage)  # bind copies the graphs shifted renames
        self.roles.setdefault(stage, []).append(Role(rank, dict(role.read), rp))
        return rp

    def printable(self, rank: int, stage: int) -> tuple[RankProgram, RankProgram]:
        """(``rank``'s program without its graphs bound, the program whose graphs print as ``rank``'s): for a rank
        no one bound yet, its role's graphs, printed with ``rank``'s groups and slices (``fxpar.printer``), so
        printing a rank of a fake mesh copies no graph. Both are ``program(rank, stage)`` once that is built."""
        bound = self._bound.get((rank, stage))
        if bound is not None:
            return bound, bound
        coord = self.mesh.coord(rank)
        if sharing_enabled():
            for role in self.roles.get(stage, []):
                if role.fits(coord) and role.rank != rank:
                    return bind(role.program, rank, self.mesh, graphs=False), role.program
        rp = self.program(rank, stage)
        return rp, rp

    def count(self) -> int:
        """How many roles have been lowered (all stages)."""
        return sum(len(r) for r in self.roles.values())


def bind(rp: RankProgram, rank: int, mesh: Mesh, graphs: bool = True) -> RankProgram:
    """``rp`` (lowered for another rank of the same role) as ``rank``'s program: its groups and ledger rows renamed;
    with ``graphs=False`` its graphs are left the role's (for printing them with ``rank``'s groups and slices)."""
    rename = {name: group_name(name[: name.index("[")], mesh.group_ranks(rank, name[: name.index("[")]))
              for name in rp.groups}
    groups = {rename[name]: tuple(mesh.group_ranks(rank, name[: name.index("[")])) for name in rp.groups}

    def row(r: LedgerRow) -> LedgerRow:
        return dataclasses.replace(r, group=tuple(mesh.group_ranks(rank, r.axis))) if r.axis in mesh.axes else r

    coord = mesh.coord(rank)

    def graph(gm: fx.GraphModule | None) -> fx.GraphModule | None:
        if gm is None or not graphs:
            return gm
        return _renamed(gm, rename, row, coord)

    return dataclasses.replace(
        rp, rank=rank, coord=mesh.coord(rank), joint=None, forward=graph(rp.forward),
        backward=graph(rp.backward), reduce_grads=graph(rp.reduce_grads), gather_params=graph(rp.gather_params),
        ledger=[row(r) for r in rp.ledger], gather_ledger=[row(r) for r in rp.gather_ledger], groups=groups)


def _renamed(gm: fx.GraphModule, rename: dict[str, str], row: Callable[[LedgerRow], LedgerRow],
             coord: tuple[int, ...]) -> fx.GraphModule:
    """A copy of ``gm`` with group names renamed, ledger rows rebound and even slices started at ``coord``'s piece."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = g.graph_copy(gm.graph, env)
    if out is not None:
        g.output(out)
    for n in g.nodes:
        i = group_arg_index(n.target)
        if i is not None:  # group names are the group argument of a collective, nowhere else
            n.update_arg(i, rename.get(n.args[i], n.args[i]))
        if "ledger_row" in n.meta:
            n.meta["ledger_row"] = row(n.meta["ledger_row"])
        if COORD_SLICE in n.meta and n.op == "call_function":  # this rank's piece of an even split
            n.args = coord_slice_args(n, coord)
    g._codegen = gm.graph._codegen
    return graph_module(gm, g)


def coord_slice_args(n: fx.Node, coord: tuple[int, ...]) -> tuple[Any, ...]:
    """The arguments of even-slice node ``n`` (tagged ``COORD_SLICE``) for the rank at ``coord``: its own piece."""
    ax, size = n.meta[COORD_SLICE]
    return (*n.args[:2], coord[ax] * size, (coord[ax] + 1) * size)
