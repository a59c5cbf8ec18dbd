"""A Llama written the way torchtitan (and Meta's reference code) writes it, for ``tests/test_user_models.py``.

What sets it apart from HF's: the layers live in an ``nn.ModuleDict`` keyed ``"0"``, ``"1"``, ... (so a pipeline
stage can drop layers and keep every path), the rotary embedding multiplies complex numbers (``torch.polar``,
``view_as_complex``, ``view_as_real``) from a complex buffer, and attention is ``F.scaled_dot_product_attention``
with ``is_causal=True`` after ``repeat_interleave`` of the kv heads. Module-level so that spawned gloo ranks can
unpickle it; it imports nothing from fxpar (it stands for user code).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

TITAN_TP = {"layers.*.attention.wq": "colwise", "layers.*.attention.wk": "colwise",
            "layers.*.attention.wv": "colwise", "layers.*.attention.wo": "rowwise",
            "layers.*.feed_forward.w1": "colwise", "layers.*.feed_forward.w3": "colwise",
            "layers.*.feed_forward.w2": "rowwise"}


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """``exp(i * t * f)`` for positions ``t < end`` and the head's frequencies ``f``: a complex (end, head_dim / 2)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (batch, seq, heads, head_dim) as complex pairs."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[: xq_.shape[1]].view(1, xq_.shape[1], 1, xq_.shape[-1])
    xq_out = torch.view_as_real(xq_ * freqs).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        xq = self.wq(x).view(b, s, -1, self.head_dim)  # -1: the heads this rank holds under tensor parallelism
        xk = self.wk(x).view(b, s, -1, self.head_dim)
        xv = self.wv(x).view(b, s, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        repeats = xq.shape[2] // xk.shape[2]
        xk, xv = xk.repeat_interleave(repeats, dim=2), xv.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim)
        self.ffn_norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 4, n_heads: int = 4, n_kv_heads: int = 2,
                 hidden: int = 64, max_seq: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(dim // n_heads, max_seq * 2), persistent=False)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, n_heads, n_kv_heads, hidden)
                                     for i in range(n_layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


def titan_llama() -> TitanLlama:
    torch.manual_seed(0)
    return TitanLlama()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of every token's logits against its target token."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
