"""Sharding rules checked against running the op on real shards (one mesh axis)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from fxpar.passes.propagate import is_plain_sum
from torch._subclasses.fake_tensor import FakeTensorMode
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


@pytest.mark.parametrize("shape", [(8, 8), (1, 8), (2, 4, 8, 8), (1, 4, 8, 8), (2, 1, 8, 8)])
def test_sdpa_cpu_mask_broadcasts_from_the_right(shape: tuple[int, ...]) -> None:
    """A mask lines up with ``[batch, heads, q, k]`` from the right, as torch broadcasts it: a 2-D causal mask
    has no batch or heads dim to shard (it once got sliced to the local batch on its query rows; the CPU kernel
    takes 2-D and 4-D masks). Every candidate runs on real shards, and batch and heads sharding stay available."""
    op = aten._scaled_dot_product_flash_attention_for_cpu.default
    q, k, v = _qkv(b=2)
    mask = torch.randn(shape)
    found = candidates(op, (q, k, v), {"attn_mask": mask}, [Replicate()] * 4, 2)
    assert {c.output[0] for c in found} == {Replicate(), Shard(0), Shard(1)}
    for cand in found:
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


def _cuda_attention_calls(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          bias: torch.Tensor | None = None) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    """Each CUDA attention kernel's forward and backward call on ``q, k, v`` (the backward's arguments come from
    the forward's outputs), keyed by name."""
    flash, eff, cudnn = (aten._scaled_dot_product_flash_attention.default,
                         aten._scaled_dot_product_efficient_attention.default,
                         aten._scaled_dot_product_cudnn_attention.default)
    f = flash(q, k, v, 0.0, True)
    e = eff(q, k, v, bias, True, 0.0, bias is None)
    c = cudnn(q, k, v, None, True, 0.0, True)
    g = torch.ones_like(f[0])
    mask = [True, True, True, bias is not None and bias.requires_grad]
    return {
        "flash": (flash, (q, k, v, 0.0, True)),
        "flash_backward": (aten._scaled_dot_product_flash_attention_backward.default,
                           (g, q, k, v, f[0], f[1], f[2], f[3], f[4], f[5], 0.0, True, f[6], f[7])),
        "efficient": (eff, (q, k, v, bias, True, 0.0, bias is None)),
        "efficient_backward": (aten._scaled_dot_product_efficient_attention_backward.default,
                               (g, q, k, v, bias, e[0], e[1], e[2], e[3], 0.0, mask, bias is None)),
        "cudnn": (cudnn, (q, k, v, None, True, 0.0, True)),
        "cudnn_backward": (aten._scaled_dot_product_cudnn_attention_backward.default,
                           (g, q, k, v, c[0], c[1], c[6], c[7], None, c[2], c[3], c[4], c[5], 0.0, True)),
    }


@pytest.mark.parametrize("kernel", ["flash", "flash_backward", "efficient", "efficient_backward", "cudnn",
                                    "cudnn_backward"])
def test_cuda_attention_rules_shard_heads_and_batch(kernel: str) -> None:
    """CUDA's attention kernels (what SDPA becomes on a GPU) shard on heads or batch like the CPU kernel, and
    their RNG seed and offset stay replicated (on fake tensors: the kernels have no CPU implementation)."""
    with FakeTensorMode():
        op, args = _cuda_attention_calls(*_qkv(b=4, h=8, s=16, d=16))[kernel]
    tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    found = candidates(op, args, {}, [Replicate()] * len(tensors), 4)
    assert [c.output[0] for c in found] == [Replicate(), Shard(1), Shard(0)]
    assert [c.output[0] for c in candidates(op, args, {}, [Replicate()] * len(tensors), 3)] == [Replicate(), Shard(0)]
    for cand in found[1:]:
        for t, p in zip(tensors, cand.inputs, strict=True):
            assert p == (Replicate() if t.dim() < 3 else cand.output[0]), (kernel, tuple(t.shape), p)


def test_cuda_attention_bias_broadcast_on_heads() -> None:
    """A bias broadcast over heads stays whole when heads shard; when its gradient is wanted, heads cannot shard
    (each rank would hold a partial sum of it)."""
    with FakeTensorMode():
        q, k, v = _qkv(b=4, h=8, s=16, d=16)
        no_grad = _cuda_attention_calls(q, k, v, torch.randn(4, 1, 16, 16))
        with_grad = _cuda_attention_calls(q, k, v, torch.randn(4, 1, 16, 16, requires_grad=True))
    op, args = no_grad["efficient"]
    heads = [c for c in candidates(op, args, {}, [Replicate()] * 4, 2) if c.output[0] == Shard(1)]
    assert heads and heads[0].inputs == (Shard(1), Shard(1), Shard(1), Replicate())
    op, args = with_grad["efficient_backward"]
    found = candidates(op, args, {}, [Replicate()] * 9, 2)
    assert [c.output[0] for c in found] == [Replicate(), Shard(0)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's attention kernels need a GPU")
@pytest.mark.parametrize("kernel", ["flash", "flash_backward", "efficient", "efficient_backward", "cudnn",
                                    "cudnn_backward"])
def test_cuda_attention_rules_on_real_shards(kernel: str) -> None:
    """Each sharded candidate computes the kernel's per-head outputs from the shards (on the GPU), as a rank
    program runs it: each rank's backward reads its own forward's outputs (layout and RNG state included)."""
    q, k, v = (t.to("cuda", torch.bfloat16) for t in _qkv(b=4, h=8, s=128, d=64))
    op, args = _cuda_attention_calls(q, k, v)[kernel]
    tensors = [a for a in pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
    full = op(*args)
    for cand in candidates(op, args, {}, [Replicate()] * len(tensors), 2)[1:]:
        dim = cand.output[0].dim
        outs = [op(*_cuda_attention_calls(*(t.chunk(2, dim)[r].contiguous() for t in (q, k, v)))[kernel][1])
                for r in range(2)]
        for j, (f, p) in enumerate(zip(full, cand.output, strict=True)):
            if isinstance(p, Shard):  # seeds and offsets differ per call; per-head outputs must match
                torch.testing.assert_close(torch.cat([o[j] for o in outs], p.dim), f, rtol=2e-2, atol=2e-2,
                                           msg=lambda m, j=j, p=p: f"{kernel} output {j} on {p}: {m}")


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


def test_a_rule_answering_in_another_shape_is_ignored_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch 2.11's DTensor (a GPU image's) answered aten.index.Tensor with one input spec for two tensors, and
    # aten.native_layer_norm with one output spec for three outputs: propagation crashed (zip / "'Shard' object is
    # not subscriptable"). Such a strategy is ignored and the node takes another candidate.
    import warnings

    import fxpar
    from fxpar.rules import registry
    from fxpar.rules.registry import Candidate

    def short(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
        return [Candidate((Shard(0),), Shard(0))]  # one input placement: mm has two tensors

    def single(args: tuple[Any, ...], kwargs: dict[str, Any], n: int) -> list[Candidate]:
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return [Candidate(tuple(Shard(0) for _ in tensors), Shard(0))]  # layer norm returns three tensors

    monkeypatch.setattr(registry, "_CACHE", {})
    monkeypatch.setitem(FXPAR_RULES, aten.mm.default, short)
    monkeypatch.setitem(FXPAR_RULES, aten.native_layer_norm.default, single)
    model = torch.nn.Sequential(torch.nn.Linear(24, 24, bias=False), torch.nn.LayerNorm(24))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(8, 24),))
    said = " ".join(str(w.message) for w in caught)
    assert "aten.mm.default answered with 1 input and 1 output placements where the op has 2 tensor inputs" in said
    assert "aten.native_layer_norm.default answered with 3 input and 1 output placements" in said
    assert "all_gather" in pm.program(0)  # the batch is gathered for the replicated nodes, as for an unknown op


@pytest.mark.parametrize("shape", [(1,), (4, 6)])
def test_a_copy_of_a_tensor_made_in_forward_keeps_any_placement(shape: tuple[int, ...]) -> None:
    """``lift_fresh_copy`` (``torch.tensor(...)`` in a model's forward, e.g. Falcon's attention) had no rule and ran
    replicated with a warning; every candidate of its rule computes the copy on real shards."""
    op = aten.lift_fresh_copy.default
    x = torch.randn(shape)
    found = candidates(op, (x,), {}, [Replicate()], 2)
    assert {c.output for c in found} >= {Replicate(), Partial()} | {Shard(d) for d in range(len(shape))
                                                                   if shape[d] >= 2}
    for cand in found:
        check_candidate(op, (x,), {}, cand, 2)


@pytest.mark.parametrize(("dst", "src"), [((4, 6), (4, 6)), ((4, 6), (6,)), ((4, 6), (4, 1))],
                         ids=["same shape", "broadcast rows", "broadcast columns"])
def test_a_functional_copy_holds_on_real_shards(dst: tuple[int, ...], src: tuple[int, ...]) -> None:
    """``copy(self, src)`` (an EMA's ``buf.mul_(0.9)``, functionalized) had no rule: replicated with a warning."""
    op = aten.copy.default
    args = (torch.randn(dst), torch.randn(src))
    found = candidates(op, args, {}, [Replicate(), Replicate()], 2)
    assert Shard(0) in {c.output for c in found}
    for cand in found:
        check_candidate(op, args, {}, cand, 2)


def test_interpolations_index_ops_keep_batch_and_channels_sharded_on_real_shards() -> None:
    """``F.interpolate`` decomposes into ``_unsafe_index`` on the spatial dims (forward) and ``_unsafe_index_put``
    (backward): the batch and channel dims may stay sharded, the index tensors whole."""
    x = torch.randn(4, 6, 5, 5)
    rows = torch.tensor([0, 0, 1, 2, 3, 4, 4, 4]).unsqueeze(-1)
    cols = torch.tensor([0, 1, 1, 2, 3, 3, 4, 4])
    index = (x, [None, None, rows, cols])
    found = candidates(aten._unsafe_index.Tensor, index, {}, [Replicate()] * 3, 2)
    assert {c.output for c in found} == {Replicate(), Shard(0), Shard(1)}
    for cand in found:
        check_candidate(aten._unsafe_index.Tensor, index, {}, cand, 2)
    put = (torch.zeros(4, 6, 5, 5), [None, None, rows, cols], torch.randn(4, 6, 8, 8), True)
    found = candidates(aten._unsafe_index_put.default, put, {}, [Replicate()] * 4, 2)
    assert {c.output for c in found} == {Replicate(), Shard(0), Shard(1)}
    for cand in found:
        check_candidate(aten._unsafe_index_put.default, put, {}, cand, 2)
    apart = (x, [None, rows.squeeze(-1)[:5], None, cols[:5]])  # indexed dims not adjacent: result dims move first
    assert {c.output for c in candidates(aten._unsafe_index.Tensor, apart, {}, [Replicate()] * 3, 2)} == {Replicate()}


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no weight or bias"])
def test_eval_mode_batch_norm_keeps_any_dim_sharded_on_real_shards(affine: bool) -> None:
    """BatchNorm with running statistics (eval mode, or frozen) is a per-channel affine map: the batch and spatial
    dims shard with the statistics whole, the channel dim with them sharded alike (before: replicated, the
    dp-sharded input all-gathered)."""
    op = aten._native_batch_norm_legit_no_training.default
    weight, bias = (torch.randn(6), torch.randn(6)) if affine else (None, None)
    args = (torch.randn(4, 6, 5, 5), weight, bias, torch.randn(6), torch.rand(6) + 0.5, 0.1, 1e-5)
    n_tensors = 5 if affine else 3
    found = candidates(op, args, {}, [Replicate()] * n_tensors, 2)
    assert {c.output[0] for c in found} == {Replicate(), Shard(0), Shard(1), Shard(2), Shard(3)}
    for cand in found:
        check_candidate(op, args, {}, cand, 2)


@pytest.mark.parametrize("dim", [0, 2])  # the fused kernel takes the first or the last dim
def test_weight_norm_backward_keeps_a_partial_gradient_partial_on_real_shards(dim: int) -> None:
    """``_weight_norm_interface_backward`` is linear in the weight's gradient and per slice along ``dim``: a dp-partial
    gradient stays partial (before: no rule, a warning, the gradient all-reduced and the op run replicated), and
    with ``dim=0`` every tensor may shard on dim 0 (the kernel refuses the non-contiguous shards of a later dim)."""
    op = aten._weight_norm_interface_backward.default
    g = torch.Generator().manual_seed(0)
    v = torch.randn(6, 4, 3, generator=g)
    keep = [1 if d != dim else v.shape[d] for d in range(3)]
    magnitude = torch.rand(keep, generator=g) + 0.5
    norms = v.square().sum([d for d in range(3) if d != dim], keepdim=True).sqrt()
    args = (torch.randn(6, 4, 3, generator=g), v, magnitude, norms, dim)
    found = candidates(op, args, {}, [Replicate()] * 4, 2)
    sharded = {(Shard(0), Shard(0))} if dim == 0 else set()
    assert {c.output for c in found} == {(Replicate(), Replicate()), (Partial(), Partial())} | sharded
    for cand in found:
        check_candidate(op, args, {}, cand, 2)
