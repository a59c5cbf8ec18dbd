"""Every rank of a real mesh compiled the same program before any of them runs it.

Each rank traces the model in its own process. Model code whose trace depends on the process (iterating a set of
strings, whose order follows Python's per-process ``PYTHONHASHSEED`` under ``torchrun``; a branch on the rank or an
environment variable) can give two ranks programs that issue different collectives on a shared group: a hang at
best, mismatched reductions (a silent wrong answer) at worst. ``check_ranks_agree`` all-gathers a digest of the
collectives the compiled program issues and refuses disagreement on every rank, naming the ranks that differ.
"""

from __future__ import annotations

import hashlib

import torch.distributed as dist

from fxpar.compiled import Compiled
from fxpar.rank_step import rank_step, step_ledger
from fxpar.verify import VerifyError


def program_digest(compiled: Compiled) -> str:
    """A digest of every collective one rank per pipeline stage issues in a step (op, axis, shape, dtype, stage,
    microbatch, in order): equal on every rank that compiled the same program; the order of local computations
    that issue no collective (Gemma3 computes its two rotary tables in hash order) does not enter it."""
    digest = hashlib.sha256()
    seen_stages: set[tuple[int, ...]] = set()
    for rank in range(compiled.mesh.size):
        stages = tuple(compiled.stage_of_rank(rank))
        if stages in seen_stages:
            continue
        seen_stages.add(stages)
        for row in step_ledger(rank_step(compiled, rank)):
            digest.update(repr((row.phase, row.op, row.axis, row.shape, str(row.dtype), row.stage, row.mb)).encode())
    return digest.hexdigest()


def check_ranks_agree(compiled: Compiled) -> None:
    """Raise ``VerifyError`` on every rank unless every rank's ``program_digest`` equals rank 0's. Requires: an
    initialized default process group of the mesh's size; every rank calls it (it is a collective)."""
    digests: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, program_digest(compiled))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise VerifyError(f"ranks {differ} compiled programs whose collectives differ from rank 0's: the model traced "
                          "differently in their processes (code that branches on the rank or the environment, or "
                          "iterates a set of strings: give every rank the same PYTHONHASHSEED)")
