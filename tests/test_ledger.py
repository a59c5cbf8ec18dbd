"""Communication ledgers against the analytic optimum (compile-only: fake meshes)."""

from __future__ import annotations

import pytest
import torch

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, hf_llama_plan, llama_plan


@pytest.mark.parametrize("axes", [{"tp": 2}, {"tp": 4}, {"dp": 2, "tp": 2}])
def test_hf_llama_megatron_optimum(axes: dict[str, int]) -> None:
    """Exactly 2 tp all-reduces forward and 2 backward per layer, each of b*s*h elements."""
    from fxpar.models.hf import hf_llama

    layers, b, s, h = 3, 4, 16, 64
    model = hf_llama(layers=layers, hidden=h, heads=4, kv_heads=4)
    pm = fxpar.parallelize(model, fxpar.Mesh(axes, fake=True), (torch.randint(0, 128, (b, s)),), plan=hf_llama_plan())
    b_local = b // axes.get("dp", 1)
    for rank in (0, pm.mesh.size - 1):
        tp_rows = [r for r in pm.ledger(rank) if r.axis == "tp"]
        for phase in ("fwd", "bwd"):
            rows = [r for r in tp_rows if r.phase == phase]
            assert len(rows) == 2 * layers, pm.ledger_table(rank)
            assert all(r.op == "all_reduce" and r.shape == (b_local, s, h) for r in rows)
            assert all(r.bytes == b_local * s * h * 4 for r in rows)


@pytest.mark.parametrize("overlap", [False, True])
def test_dp_gradient_reduction_moves_exactly_the_parameter_bytes(overlap: bool) -> None:
    # DDP's optimum: every gradient byte all-reduced once; one all-reduce per parameter without overlap,
    # one per bucket with it (the default: 25 MB buckets hold this whole model)
    model = Llama(LlamaConfig())
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 4}, fake=True), (torch.randint(0, 256, (8, 16)),),
                           plan=fxpar.Plan(overlap=overlap))
    rows = pm.ledger(1)
    assert all(r.axis == "dp" and r.op == "all_reduce" and r.phase == "bwd" for r in rows)
    params = list(model.parameters())
    assert len(rows) == (1 if overlap else len(params))
    assert sum(r.bytes for r in rows) == sum(p.numel() * 4 for p in params)


def test_fake_mesh_512_ranks_prints_rank_37() -> None:
    """dp=64 x tp=8 compiles in one process without starting any process group."""
    with torch.device("meta"):
        model = Llama(LlamaConfig(hidden=128, intermediate=256, n_heads=8, n_kv_heads=8))
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 64, "tp": 8}, fake=True), (torch.randint(0, 256, (128, 16)),),
                           plan=llama_plan())
    text = pm.program(rank=37)
    assert text.startswith("# fxpar program | rank 37 of 512 | mesh (dp=64, tp=8) | coord (dp=4, tp=5)")
    assert "TP = tp[32,33,34,35,36,37,38,39]" in text
    assert 'comm.all_reduce(' in text and "TP)" in text
    compile(text, "rank37.py", "exec")  # the printed program is valid Python
    assert not torch.distributed.is_initialized()


def _sdpa_as_cuda_kernel(kernel: str):  # noqa: ANN202 - a stand-in for F.scaled_dot_product_attention
    """SDPA as it decomposes on a GPU: straight to CUDA's flash, memory-efficient or cuDNN kernel."""
    aten = torch.ops.aten

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):  # noqa: ANN001, ANN202
        assert attn_mask is None and not enable_gqa
        if kernel == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
        if kernel == "efficient":
            return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                scale=scale)[0]
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, dropout_p, is_causal, scale=scale)[0]

    return sdpa


def test_cuda_attention_kernels_compile_to_the_cpu_kernels_ledger(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tp plan with sequence parallelism compiles when attention is one of CUDA's kernels (it failed in
    propagation before they had rules), with heads sharded: the same collectives, bytes for bytes, as with the
    CPU kernel, on every role, and a passing proof."""
    cfg = LlamaConfig(n_layers=1, hidden=64, intermediate=128, n_heads=8, n_kv_heads=4, vocab_size=128, max_seq=32)
    tokens = torch.randint(0, 128, (4, 32))
    plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=True, zero=1)
    mesh = fxpar.Mesh({"dp": 2, "tp": 4}, fake=True)

    def ledgers() -> list[list[object]]:
        pm = fxpar.parallelize(Llama(cfg), mesh, (tokens,), plan=plan)
        fxpar.verify(pm)
        return [pm.ledger(rank) for rank in (0, 5)]

    on_cpu = ledgers()
    assert any(r.axis == "tp" for r in on_cpu[0])
    for kernel in ("flash", "efficient", "cudnn"):
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _sdpa_as_cuda_kernel(kernel))
        assert ledgers() == on_cpu, kernel
