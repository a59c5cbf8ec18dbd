"""``fxpar.grad_sums``: microbatch gradient sums that copy nothing for one microbatch and never mutate a graph's
output or let one parameter's gradient alias another's."""

from __future__ import annotations

import torch

from fxpar.grad_sums import GradSums, cut_from_larger, overlapping


def test_one_microbatch_keeps_the_graphs_outputs_and_clones_only_overlapping_ones() -> None:
    bucket = torch.arange(10.0)
    a, b = bucket[:5], bucket[5:]  # slices side by side in one reduced bucket: kept as they are
    same = torch.ones(3)  # one tensor returned for two parameters: each gets its own copy
    sums = GradSums([0])
    sums.add(0, {"a": a, "b": b, "x": same, "y": same, "none": None})
    got = sums.totals()
    assert got["a"] is a and got["b"] is b and "none" not in got
    assert got["x"] is not got["y"] and torch.equal(got["x"], same) and torch.equal(got["y"], same)
    got["x"].mul_(2)
    assert torch.equal(got["y"], torch.ones(3))


def test_later_microbatches_add_without_touching_the_first_ones_output() -> None:
    first, second, third = torch.ones(4), torch.full((4,), 2.0), torch.full((4,), 3.0)
    sums = GradSums([0, 1])
    for g in (first, second, third):
        sums.add(0, {"w": g})
    sums.add(1, {"w": torch.full((4,), 10.0)})  # a weight tied across two stages this rank holds
    assert torch.equal(first, torch.ones(4)) and torch.equal(second, torch.full((4,), 2.0))
    assert torch.equal(sums.stage(0)["w"], torch.full((4,), 6.0))
    assert torch.equal(sums.totals()["w"], torch.full((4,), 16.0))


def test_overlap_is_by_memory_not_by_tensor() -> None:
    buf = torch.zeros(100)
    left, right, middle = buf[:50], buf[50:], buf[40:60]
    assert overlapping([left, right]) == set()
    assert overlapping([left, right, middle]) == {id(left), id(right), id(middle)}
    assert overlapping([buf.view(10, 10), buf[:10]]) != set()


def test_a_shard_cut_from_a_whole_gradient_is_copied_so_the_whole_is_freed() -> None:
    whole = torch.arange(40.0).view(4, 10)  # a gradient every rank computed whole; this rank keeps row 1
    shard = whole[1:2]
    padded = torch.arange(11.0)  # a reduced bucket with one element of padding: its slices are kept
    a, b = padded[:5], padded[5:10]
    sums = GradSums([0])
    sums.add(0, {"shard": shard, "a": a, "b": b})
    got = sums.totals()
    assert got["a"] is a and got["b"] is b
    assert torch.equal(got["shard"], whole[1:2])
    assert got["shard"].untyped_storage().nbytes() == shard.numel() * shard.element_size()
    sums.replace(0, {"shard": whole[2:3]})  # a reduction's outputs, as ZeRO-1's reduce_grads returns them
    assert sums.stage(0)["shard"].untyped_storage().nbytes() == 10 * 4
    assert cut_from_larger([whole[:2], whole[2:]]) == set()  # two halves that fill their buffer
