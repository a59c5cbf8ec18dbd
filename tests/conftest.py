"""Shared helpers for fxpar tests."""

from __future__ import annotations

import pytest
import torch

from fxpar.testing.equivalence import RankReport, check_rank
from fxpar.testing.launch import run_ranks


def assert_equivalent(factory: str, model_kwargs: dict, mesh_axes: dict[str, int], plan: dict | None,
                      inputs: tuple[torch.Tensor, ...], steps: int = 3, timeout: float = 240) -> list[RankReport]:
    """Run ``check_rank`` on real gloo ranks and fail with the first mismatching tensor and rank."""
    world = 1
    for n in mesh_axes.values():
        world *= n
    reports = run_ranks(check_rank, world, factory, model_kwargs, mesh_axes, plan, inputs, steps,
                        timeout=timeout, collective_timeout=60)
    bad = [m for r in reports for m in r.mismatches]
    if bad:
        first = min(bad, key=lambda m: (m.step, m.rank))
        pytest.fail(f"{len(bad)} mismatches; first: {first.tensor} on rank {first.rank} at step {first.step}: "
                    f"max abs {first.max_abs:.3g}, max rel {first.max_rel:.3g}")
    return reports
