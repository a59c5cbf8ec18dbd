"""The shapes a rank's program takes its inputs in, checked where ``pm(...)`` and ``pm.step(...)`` receive them.

A rank program is compiled for this rank's share of the batch (``example_inputs`` hold the global one). Handing it
the global batch, or another sequence length, used to fail inside the first ``view`` of the rank graph ("shape
'[32, 64]' is invalid for input of size 4096"); ``check_local_inputs`` says instead which input, the shape it
has, the shape this rank's program takes and why.
"""

from __future__ import annotations

from typing import Any

import torch

from fxpar.compiled import Compiled

LocalShapes = list[tuple[int, tuple[int, ...], torch.dtype]]  # (flat user input, local shape per microbatch, dtype)


def local_input_shapes(compiled: Compiled, rank: int) -> LocalShapes:
    """Each flat user input a stage of ``rank`` reads, with the local shape of one microbatch of it (the rank
    forward's placeholder after the parameters, buffers and received values). Inputs no stage of the rank reads
    (a pipeline's later stages read none) are not listed."""
    shapes: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
    for s in compiled.stage_of_rank(rank):
        prog, rp = compiled.stages[s], compiled.rank_program(rank, s)
        info = prog.notes.get("stage")
        fixed = len(prog.signature.params) + len(prog.signature.buffers) + (len(info.received) if info else 0)
        placeholders = list(rp.forward.graph.find_nodes(op="placeholder"))[fixed:]
        reads = list(info.user_inputs) if info is not None else list(range(len(placeholders)))
        for i, node in zip(reads, placeholders, strict=False):
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                shapes.setdefault(i, (tuple(val.shape), val.dtype))
    return [(i, shape, dtype) for i, (shape, dtype) in sorted(shapes.items())]


def check_local_inputs(shapes: LocalShapes, flat: list[Any], microbatches: int, rank: int, dp: int,
                       call: str, device: str | None = None) -> None:
    """Raise ``ValueError`` naming the first tensor input of ``flat`` whose shape is not what ``rank``'s program
    takes (``microbatches`` of them along dim 0 for ``pm.step``), that is floating where the program takes
    integers or the other way round (float token ids failed inside the rank program, in torch's embedding), of
    another floating dtype, or on another device than ``device`` (both failed inside the rank program)."""
    for i, per_microbatch, dtype in shapes:
        x = flat[i] if i < len(flat) else None
        if not isinstance(x, torch.Tensor):
            continue
        if x.dtype.is_floating_point != dtype.is_floating_point or (x.dtype == torch.bool) != (dtype == torch.bool) \
                or (dtype.is_floating_point and x.dtype != dtype):  # integer widths may differ (token ids)
            raise ValueError(f"{call}: input {i} has dtype {x.dtype}, but rank {rank}'s program was compiled for "
                             f"{dtype} (the dtype example_inputs had)")
        if device is not None and x.device.type != device:
            raise ValueError(f"{call}: input {i} is on device {x.device}, but rank {rank}'s program runs on "
                             f"{device} (the mesh's device)")
        want = (per_microbatch[0] * microbatches, *per_microbatch[1:]) if per_microbatch else ()
        if tuple(x.shape) != want:
            share = (f"its share of the batch over dp={dp} (dim 0; example_inputs hold the global batch, and each "
                     "rank is called with its own rows, x.chunk(dp)[dp_index] where dp divides the batch)"
                     if dp > 1 else "the shape example_inputs had")
            raise ValueError(f"{call}: input {i} has shape {tuple(x.shape)}, but rank {rank}'s program was compiled "
                             f"for {want}: {share}")


class InputCheck:
    """``check_local_inputs`` for one rank, with the shapes read from its program on first use."""

    def __init__(self, compiled: Compiled, rank: int | None) -> None:
        self.compiled, self.rank = compiled, rank
        self.shapes: LocalShapes | None = None

    def check(self, flat: list[Any], call: str) -> None:
        c = self.compiled
        if self.shapes is None:
            self.shapes = local_input_shapes(c, self.rank)
        microbatches = c.microbatches if call == "pm.step" else 1
        check_local_inputs(self.shapes, flat, microbatches, self.rank, c.mesh.axes.get("dp", 1), call,
                           c.mesh.device)
