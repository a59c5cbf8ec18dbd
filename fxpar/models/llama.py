"""A small, readable Llama-style decoder written as a plain ``nn.Module``.

This file deliberately imports nothing from fxpar: it is the demo's model and a
test model, and fxpar has to parallelize it unmodified.

Attention computes its number of heads from the projected tensor's last dim
(``q.view(b, s, -1, head_dim)``), the way torchtitan does. The model is still an
ordinary single-device model, but the same code also runs on tensor-parallel
shards where ``q``/``k``/``v`` only produce the local heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden: int = 64
    intermediate: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_seq: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    norm: str = "rms"  # "rms" (RMSNorm) | "layer" (nn.LayerNorm)
    bias: bool = False  # biases on every attention and MLP Linear
    mlp: str = "swiglu"  # "swiglu" (gate, up, down) | "gelu" (up, down)
    dropout: float = 0.0  # after attention and MLP; 0 builds no dropout at all

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def make_norm(cfg: LlamaConfig) -> nn.Module:
    """The configured normalization over ``cfg.hidden``."""
    if cfg.norm == "layer":
        return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)
    if cfg.norm != "rms":
        raise ValueError(f"LlamaConfig.norm must be 'rms' or 'layer', got {cfg.norm!r}")
    return RMSNorm(cfg.hidden, cfg.norm_eps)


def rope_cos_sin(cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (max_seq, head_dim), rotate-half layout."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(cfg.max_seq, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (b, heads, s, head_dim); cos/sin: (s, head_dim), float32 tables used in x's dtype (as HF Llama does)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.k = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v = nn.Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: works on the full model and on tensor-parallel local shards alike.
        q = self.q(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n_rep = q.shape[1] // k.shape[1]  # GQA: query heads per kv head
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU ``down(silu(gate(x)) * up(x))``, or with ``cfg.mlp == "gelu"`` ``down(gelu(up(x)))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.mlp not in ("swiglu", "gelu"):
            raise ValueError(f"LlamaConfig.mlp must be 'swiglu' or 'gelu', got {cfg.mlp!r}")
        if cfg.mlp == "swiglu":
            self.gate = nn.Linear(cfg.hidden, cfg.intermediate, bias=cfg.bias)
        self.up = nn.Linear(cfg.hidden, cfg.intermediate, bias=cfg.bias)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "gate"):
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.attn_drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.mlp_drop = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn_drop(self.attn(self.attn_norm(x), cos, sin))
        return x + self.mlp_drop(self.mlp(self.mlp_norm(x)))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig | None = None) -> None:
        super().__init__()
        cfg = cfg or LlamaConfig()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_cos_sin(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: LongTensor (b, s) -> logits (b, s, vocab_size)."""
        s = tokens.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


_MEGATRON = {
    "attn.q": "colwise",
    "attn.k": "colwise",
    "attn.v": "colwise",
    "attn.o": "rowwise",
    "mlp.gate": "colwise",
    "mlp.up": "colwise",
    "mlp.down": "rowwise",
}

_HF_NAMES = {
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.o": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
}


def llama_plan() -> dict[str, str]:
    """Megatron tensor-parallel plan for :class:`Llama`, as module-path globs."""
    return {f"layers.*.{name}": style for name, style in _MEGATRON.items()}


def hf_llama_plan() -> dict[str, str]:
    """The same Megatron plan for HF ``LlamaForCausalLM`` module paths."""
    return {f"model.layers.*.{_HF_NAMES[name]}": style for name, style in _MEGATRON.items()}


def llama(**config: int | float | bool | str) -> Llama:
    """A fresh ``Llama(LlamaConfig(**config))`` (a picklable factory for multi-rank tests)."""
    return Llama(LlamaConfig(**config))
