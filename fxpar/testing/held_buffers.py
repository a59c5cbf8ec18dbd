"""Buffers the single-device model's steps write must be held by some rank of the parallel program.

``assert_equivalent`` compares each rank's buffers with the reference's; a buffer no rank holds (a pipeline stage
that dropped its write) was never compared. Each rank records what it holds and which reference buffers changed;
the union of the first must cover the second.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch


@contextmanager
def written_buffers(model: torch.nn.Module) -> Iterator[list[str]]:
    """Inside: ``model`` runs; after: the yielded list names the buffers whose values changed."""
    initial = {name: b.clone() for name, b in model.named_buffers()}
    written: list[str] = []
    yield written
    written += sorted(name for name, b in model.named_buffers() if not torch.equal(b, initial[name]))


def lost_buffers(held: Iterable[Iterable[str]], written: Iterable[Iterable[str]]) -> list[str]:
    """The written buffers (per rank) that no rank holds (per rank)."""
    return sorted({name for names in written for name in names} - {name for names in held for name in names})
