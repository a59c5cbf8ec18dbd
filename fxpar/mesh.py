"""Named device meshes: a thin layer over torch ``DeviceMesh``.

A ``Mesh`` names its axes (``{"dp": 2, "tp": 2}``). Compilation only needs axis sizes and
coordinates, so it works for any world size in one process; execution needs a real
``DeviceMesh`` whose size equals the launched world size (``Mesh.device_mesh()``).
"""

from __future__ import annotations

import math
from functools import cached_property

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


class Mesh:
    """A named mesh of ``prod(axes.values())`` ranks laid out row-major (last axis fastest).

    ``fake=True`` marks a compile-only mesh: programs can be built and printed for any rank,
    but nothing can run. ``device`` is ``"cpu"`` (gloo) or ``"cuda"`` (nccl).
    """

    def __init__(self, axes: dict[str, int], device: str = "cpu", fake: bool = False) -> None:
        if not isinstance(axes, dict):
            raise TypeError(f"Mesh takes a dict of axis names to sizes, e.g. Mesh({{'dp': 2, 'tp': 2}}), got "
                            f"{type(axes).__name__} {axes!r}")
        if not axes:
            raise ValueError("Mesh needs at least one axis, e.g. Mesh({'dp': 2})")
        for name, size in axes.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"mesh axis {name!r} must have a positive int size, got {size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.axes: dict[str, int] = dict(axes)
        self.device = device
        self.fake = fake

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.axes.values())

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_index(self, name: str) -> int:
        return self.names.index(name)

    def coord(self, rank: int) -> tuple[int, ...]:
        """Coordinate of ``rank`` along each axis (row-major)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        coord = []
        for size in reversed(self.shape):
            coord.append(rank % size)
            rank //= size
        return tuple(reversed(coord))

    def rank_of(self, coord: tuple[int, ...]) -> int:
        rank = 0
        for c, size in zip(coord, self.shape, strict=True):
            rank = rank * size + c
        return rank

    def group_ranks(self, rank: int, axis: str) -> list[int]:
        """The ranks that share every coordinate of ``rank`` except along ``axis``."""
        ax = self.axis_index(axis)
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        stride = math.prod(self.shape[ax + 1:])  # row-major: the rank step between neighbours on ``axis``
        first = rank - (rank // stride % self.shape[ax]) * stride
        return list(range(first, first + self.shape[ax] * stride, stride))

    def describe(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in self.axes.items()) + ")"

    @cached_property
    def compile_mesh(self) -> DeviceMesh:
        """A backend-less ``DeviceMesh`` used only for DTensor metadata (specs, local shapes)."""
        ids = torch.arange(self.size).reshape(self.shape)
        return DeviceMesh("cpu", ids, mesh_dim_names=self.names, _init_backend=False, _rank=0)

    def device_mesh(self) -> DeviceMesh:
        """The real ``DeviceMesh`` for execution; the process group must already exist. Made once per default
        process group: every ``DeviceMesh`` creates process groups of its own for its dims, so each call making one
        would open new communicators (a module and its second program, a launcher and its clipping)."""
        if self.fake:
            raise ValueError("a fake Mesh compiles only; build Mesh(..., fake=False) to run")
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: launch with torchrun (or run_ranks)")
        world = dist.get_world_size()
        if world != self.size:
            raise ValueError(
                f"mesh {self.describe()} has {self.size} ranks but the world size is {world}: "
                f"launch {self.size} processes or change the mesh"
            )
        world_group = dist.group.WORLD
        made = self.__dict__.get("_device_mesh")
        if made is None or made[0] is not world_group:
            dm = DeviceMesh(self.device, torch.arange(self.size).reshape(self.shape), mesh_dim_names=self.names)
            made = self._device_mesh = (world_group, dm)
        return made[1]

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_device_mesh", None)  # its process groups belong to this process
        return state

    def __repr__(self) -> str:
        return f"Mesh({self.axes}, device={self.device!r}{', fake=True' if self.fake else ''})"
