"""Hugging Face models from small random configs (test-only; needs ``transformers``)."""

from __future__ import annotations

import torch


def hf_llama(layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
             vocab: int = 128, tie: bool = False) -> torch.nn.Module:
    """``LlamaForCausalLM`` with random weights; returns logits-bearing outputs, no KV cache."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                      tie_word_embeddings=tie, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()
