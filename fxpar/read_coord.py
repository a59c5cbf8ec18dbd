"""A mesh coordinate that records which axes were read: what makes a rank's lowering its role's (``fxpar.roles``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class ReadCoord(tuple):
    """A rank's mesh coordinate that records which axes were read (``read``: axis indices)."""

    read: set[int]

    def __new__(cls, coord: tuple[int, ...]) -> ReadCoord:
        obj = super().__new__(cls, coord)
        obj.read = set()
        return obj

    def peek(self, i: int) -> int:
        """Axis ``i``'s coordinate, not recorded as read: for a value that binding rewrites per rank
        (``fxpar.roles.bind``), such as the start of an even slice."""
        return tuple.__getitem__(self, i)

    def __getitem__(self, i: Any) -> Any:
        self.read.update(range(len(self))[i] if isinstance(i, slice) else [range(len(self))[i]])
        return super().__getitem__(i)

    def __iter__(self) -> Iterator[int]:
        self.read.update(range(len(self)))
        return super().__iter__()

    def __eq__(self, other: object) -> bool:
        self.read.update(range(len(self)))
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = tuple.__hash__
