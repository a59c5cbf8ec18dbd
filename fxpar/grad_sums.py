"""A rank's parameter gradients summed over microbatches, per stage, without copying one microbatch's.

The first microbatch's gradient is kept as the graph returned it (it may alias another output, e.g. a slice
of a reduced bucket); the second is added out of place, and only sums made that way are added to in place.
Gradients whose memory overlaps another of the same backward are copied first, so a user's in-place op on
one ``p.grad`` cannot reach another. A gradient cut from a buffer at least twice what the gradients viewing it
use (a rank's shard of a gradient computed whole on every rank) is copied too, so the rest of that buffer is
freed and ``.grad`` holds the shard's bytes, as ``pm.memory`` counts them; a bucket's slices, or a padded
bucket's, are kept as they are.
"""

from __future__ import annotations

from collections import defaultdict

import torch


class GradSums:
    """Stage -> parameter fqn -> its gradient summed over the microbatches seen so far."""

    def __init__(self, stages: list[int]) -> None:
        self.stages = sorted(stages)
        self._sums: dict[int, dict[str, torch.Tensor]] = {s: {} for s in self.stages}
        self._borrowed: set[tuple[int, str]] = set()  # sums that are still a graph's output, not a copy

    def stage(self, s: int) -> dict[str, torch.Tensor]:
        """Stage ``s``'s sums (a reduction may replace entries with its outputs)."""
        return self._sums[s]

    def add(self, s: int, grads: dict[str, torch.Tensor | None]) -> None:
        """Add one microbatch's gradients of stage ``s`` (``None``: the parameter got no gradient)."""
        acc = self._sums[s]
        first = any(fqn not in acc for fqn in grads)
        shared = overlapping(list(grads.values())) | cut_from_larger(list(grads.values())) if first else set()
        for fqn, g in grads.items():
            if g is None:
                continue
            if fqn not in acc:
                acc[fqn] = g.clone() if id(g) in shared else g
                self._borrowed.add((s, fqn))
            elif (s, fqn) in self._borrowed:
                acc[fqn] = acc[fqn] + g
                self._borrowed.discard((s, fqn))
            else:
                acc[fqn].add_(g)

    def replace(self, s: int, reduced: dict[str, torch.Tensor]) -> None:
        """Stage ``s``'s sums replaced by a reduction's outputs (copied where cut from a larger buffer)."""
        cut = cut_from_larger(list(reduced.values()))
        self._sums[s].update({fqn: g.clone() if id(g) in cut else g for fqn, g in reduced.items()})

    def totals(self) -> dict[str, torch.Tensor]:
        """Each gradient summed over the stages (a parameter tied across stages this rank holds adds up)."""
        out: dict[str, torch.Tensor] = {}
        for s in self.stages:
            for fqn, g in self._sums[s].items():
                out[fqn] = g if fqn not in out else out[fqn] + g
        return out


def overlapping(tensors: list[torch.Tensor | None]) -> set[int]:
    """The ids of the tensors among ``tensors`` whose memory overlaps another's (the same tensor twice, or a view of
    it); slices side by side in one buffer do not overlap."""
    spans = []
    for t in tensors:
        if t is not None and t.numel():
            start = t.data_ptr()
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
            spans.append((start, start + extent * t.element_size(), id(t)))
    spans.sort()
    out: set[int] = set()
    end, owner = -1, 0
    for start, stop, i in spans:
        if start < end:
            out.update((i, owner))
        if stop > end:
            end, owner = stop, i
    return out


def cut_from_larger(tensors: list[torch.Tensor | None]) -> set[int]:
    """The ids of the tensors among ``tensors`` that view a storage at least twice the bytes the tensors viewing it
    use: keeping them would keep the rest alive (the slices of one bucket, padded or not, are left alone)."""
    by_storage: dict[int, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t is not None and t.numel():
            by_storage[t.untyped_storage().data_ptr()].append(t)
    out: set[int] = set()
    for views in by_storage.values():
        if 2 * sum(t.numel() * t.element_size() for t in views) <= views[0].untyped_storage().nbytes():
            out.update(id(t) for t in views)
    return out
