"""Sharding rules checked against running the op on real shards (one mesh axis)."""

from __future__ import annotations

import pytest
import torch
from fxpar.passes.propagate import is_plain_sum
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.rules import FXPAR_RULES, candidates
from fxpar.rules.validate import check_candidate

aten = torch.ops.aten


def _qkv(b: int = 2, h: int = 4, s: int = 8, d: int = 16, kv: int | None = None) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    kv = kv or h
    return (torch.randn(b, h, s, d, generator=g), torch.randn(b, kv, s, d, generator=g),
            torch.randn(b, kv, s, d, generator=g))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_cpu_forward_rules(n: int, causal: bool) -> None:
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q, k, v = _qkv(b=4)
    found = candidates(op, (q, k, v, 0.0, causal), {}, [Replicate()] * 3, n)
    assert {c.output[0] for c in found} == {Replicate(), Shard(0), Shard(1)}
    for cand in found:
        check_candidate(op, (q, k, v, 0.0, causal), {}, cand, n)


def test_sdpa_cpu_forward_with_broadcast_mask() -> None:
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q, k, v = _qkv(b=2)
    mask = torch.randn(2, 1, 8, 8)
    for cand in candidates(op, (q, k, v), {"attn_mask": mask}, [Replicate()] * 4, 2):
        check_candidate(op, (q, k, v), {"attn_mask": mask}, cand, 2)


def test_sdpa_cpu_backward_rules() -> None:
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    q, k, v = _qkv(b=2)
    out, lse = fwd(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    args = (grad, q, k, v, out, lse, 0.0, True)
    found = candidates(op, args, {}, [Replicate()] * 6, 2)
    assert len(found) == 3
    for cand in found:
        check_candidate(op, args, {}, cand, 2)


def test_fxpar_rules_are_registered_for_cpu_attention() -> None:
    assert aten._scaled_dot_product_flash_attention_for_cpu.default in FXPAR_RULES


ADAPTER_CASES = [
    (aten.mm.default, (torch.randn(8, 6), torch.randn(6, 4)), {}),
    (aten.add.Tensor, (torch.randn(4, 6), torch.randn(4, 6)), {}),
    (aten.mul.Tensor, (torch.randn(4, 6), torch.randn(6)), {}),
    (aten.sum.dim_IntList, (torch.randn(4, 6), [0]), {}),
    (aten.gelu.default, (torch.randn(4, 6),), {}),
    (aten.silu_backward.default, (torch.randn(4, 6), torch.randn(4, 6)), {}),
    (aten.embedding.default, (torch.randn(10, 6), torch.randint(0, 10, (4, 3))), {}),
    (aten.bmm.default, (torch.randn(4, 2, 6), torch.randn(4, 6, 2)), {}),
]


@pytest.mark.parametrize("op,args,kwargs", ADAPTER_CASES, ids=[str(c[0]) for c in ADAPTER_CASES])
def test_dtensor_adapter_candidates_hold_on_real_shards(op, args, kwargs) -> None:  # noqa: ANN001
    """Every candidate the adapter offers (that fxpar's policy could pick) computes the op."""
    n_tensors = sum(isinstance(a, torch.Tensor) for a in args)
    found = candidates(op, args, kwargs, [Replicate()] * n_tensors, 2)
    assert found, f"DTensor offers no strategy for {op}"
    checked = 0
    for cand in found:
        outs = cand.output if isinstance(cand.output, tuple) else (cand.output,)
        if any(isinstance(p, Partial) and not is_plain_sum(p) for p in (*cand.inputs, *outs) if p is not None):
            continue  # fxpar's policy never picks non-sum or masked partials
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(isinstance(p, Partial) and not a.is_floating_point() for p, a in zip(cand.inputs, tensors, strict=True)):
            continue  # integer inputs (indices) are never partial
        if any(isinstance(p, Shard) and a.shape[p.dim] % 2 for p, a in
               zip(cand.inputs, [a for a in args if isinstance(a, torch.Tensor)], strict=True)):
            continue
        check_candidate(op, args, kwargs, cand, 2)
        checked += 1
    assert checked > 0


def test_policy_refuses_masked_partial_from_vocab_sharded_embedding() -> None:
    """DTensor's embedding strategy returns a masked partial; a plain all-reduce would be wrong."""
    weight, idx = torch.randn(10, 6), torch.randint(0, 10, (4, 3))
    found = candidates(aten.embedding.default, (weight, idx), {}, [Shard(0), Replicate()], 2)
    masked = [c for c in found if isinstance(c.output, Partial) and not is_plain_sum(c.output)]
    assert masked, "expected DTensor to offer its masked partial for a vocab-sharded weight"


def test_scatter_add_of_row_shards_into_partial_zeros_holds_on_real_shards() -> None:
    # an MoE expert-weight gradient: index_put(zeros[E, ...], [expert of row], rows, accumulate=True)
    import torch.fx as fx

    from fxpar.rules.scatter_add import partial_zeros, scatter_add_candidate

    g = fx.Graph()
    like, idx, rows = g.placeholder("like"), g.placeholder("idx"), g.placeholder("rows")
    zeros = g.call_function(aten.new_zeros.default, (like, [4, 3, 5]))
    put = g.call_function(aten.index_put.default, (zeros, [idx], rows, True))
    sharded = {idx: Shard(0), rows: Shard(0)}
    assert partial_zeros(zeros, sharded.get, [Shard(0)]).output == Partial()
    assert partial_zeros(zeros, {idx: Replicate(), rows: Shard(0)}.get, [Shard(0)]) is None  # would count rows twice
    cand = scatter_add_candidate(put, [Partial(), Shard(0), Shard(0)])
    assert cand is not None and cand.output == Partial()
    assert scatter_add_candidate(put, [Partial(), Replicate(), Replicate()]) is None
    experts = torch.tensor([0, 2, 2, 1, 0, 3, 2, 0])  # repeats: the adds must accumulate
    check_candidate(aten.index_put.default, (torch.zeros(4, 3, 5), [experts], torch.randn(8, 3, 5), True), {}, cand, 2)


def test_bmm4_candidates_hold_on_real_shards() -> None:
    # fxpar::bmm4, the 4-D batched matmul eager attention is rewritten to (fxpar.simplify.bmm_over_heads)
    import fxpar.ops  # noqa: F401

    op = torch.ops.fxpar.bmm4.default
    args = (torch.randn(2, 4, 6, 8), torch.randn(2, 4, 8, 10))
    found = candidates(op, args, {}, [Replicate(), Replicate()], 2)
    assert {c.output for c in found} >= {Shard(0), Shard(1), Shard(2), Shard(3), Partial()}
    for cand in found:
        check_candidate(op, args, {}, cand, 2)
