"""Tiny random Hugging Face models, one per architecture family, for the family sweep (test-only).

Each family is a zero-argument module-level builder (picklable for ``assert_equivalent``) and a batch of
inputs. What each family brings that the others do not is in ``FEATURES``. Models are in ``eval()`` (no
dropout) and without a KV cache.
"""

from __future__ import annotations

from typing import Any

import torch

HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, VOCAB, POSITIONS = 64, 2, 4, 2, 128, 128, 64
BATCH, SEQ = 4, 16


def _decoder_kw() -> dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=POSITIONS,
                use_cache=False, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _build(config_name: str, model_name: str, attn: str = "sdpa", **kw: Any) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, config_name)(**kw)
    config._attn_implementation = attn
    return getattr(transformers, model_name)(config).eval()


def llama() -> torch.nn.Module:
    return _build("LlamaConfig", "LlamaForCausalLM", **_decoder_kw())


def mistral() -> torch.nn.Module:
    return _build("MistralConfig", "MistralForCausalLM", sliding_window=8, **_decoder_kw())


def gemma2() -> torch.nn.Module:
    return _build("Gemma2Config", "Gemma2ForCausalLM", attn="eager", head_dim=16, query_pre_attn_scalar=16,
                  sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **_decoder_kw())


def gemma3() -> torch.nn.Module:
    return _build("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                  **_decoder_kw())


def qwen2() -> torch.nn.Module:
    return _build("Qwen2Config", "Qwen2ForCausalLM", **_decoder_kw())


def qwen3() -> torch.nn.Module:
    return _build("Qwen3Config", "Qwen3ForCausalLM", head_dim=16, **_decoder_kw())


def phi3() -> torch.nn.Module:
    return _build("Phi3Config", "Phi3ForCausalLM", **_decoder_kw())


def gpt_neox() -> torch.nn.Module:
    kw = {k: v for k, v in _decoder_kw().items() if k != "num_key_value_heads"}
    return _build("GPTNeoXConfig", "GPTNeoXForCausalLM", use_parallel_residual=True, rotary_pct=0.25, **kw)


def cohere() -> torch.nn.Module:
    return _build("CohereConfig", "CohereForCausalLM", **_decoder_kw())


def falcon() -> torch.nn.Module:
    return _build("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_kv_heads=1, multi_query=True, ffn_hidden_size=INTERMEDIATE,
                  new_decoder_architecture=False, parallel_attn=True, bias=False, max_position_embeddings=POSITIONS,
                  use_cache=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def gpt2() -> torch.nn.Module:
    return _build("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                  n_inner=INTERMEDIATE, n_positions=POSITIONS, use_cache=False, bos_token_id=1, eos_token_id=2,
                  tie_word_embeddings=False)


def opt() -> torch.nn.Module:
    return _build("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  ffn_dim=INTERMEDIATE, num_attention_heads=HEADS, max_position_embeddings=POSITIONS,
                  word_embed_proj_dim=HIDDEN, use_cache=False, pad_token_id=1, bos_token_id=2, eos_token_id=2,
                  tie_word_embeddings=False)


def bert() -> torch.nn.Module:
    return _build("BertConfig", "BertForMaskedLM", vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, intermediate_size=INTERMEDIATE, max_position_embeddings=POSITIONS,
                  type_vocab_size=2, pad_token_id=0)


def t5() -> torch.nn.Module:
    return _build("T5Config", "T5ForConditionalGeneration", attn="eager", vocab_size=VOCAB, d_model=HIDDEN, d_kv=16,
                  d_ff=INTERMEDIATE, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS, use_cache=False,
                  pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False)


def t5_with_cache() -> torch.nn.Module:
    """``t5`` with the config's default ``use_cache=True``, as HF builds it: on in the model's config and in the
    decoder stack's own copy of it (the encoder's copy is always off)."""
    model = t5()
    model.config.use_cache = model.decoder.config.use_cache = True
    return model


def bart() -> torch.nn.Module:
    return _build("BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN,
                  encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=INTERMEDIATE, decoder_ffn_dim=INTERMEDIATE,
                  max_position_embeddings=POSITIONS, use_cache=False, pad_token_id=1, bos_token_id=0,
                  eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2, tie_word_embeddings=False)


def mixtral() -> torch.nn.Module:
    """Mixtral with HF's default experts (``grouped_mm``: tokens sorted by expert, one grouped matmul)."""
    return _build("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **_decoder_kw())


def mixtral_batched() -> torch.nn.Module:
    """Mixtral with HF's ``batched_mm`` experts: each token's expert weights picked by index, so the expert
    weights' gradients are scatter-adds over tokens."""
    return _build("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                  experts_implementation="batched_mm", **_decoder_kw())


def qwen2_moe() -> torch.nn.Module:
    return _build("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=64, shared_expert_intermediate_size=128, decoder_sparse_step=1,
                  mlp_only_layers=[], **_decoder_kw())


def qwen3_moe() -> torch.nn.Module:
    return _build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[], **_decoder_kw())


def olmoe() -> torch.nn.Module:
    return _build("OlmoeConfig", "OlmoeForCausalLM", num_experts=4, num_experts_per_tok=2, **_decoder_kw())


def mixtral_eager_experts() -> torch.nn.Module:
    """Mixtral with HF's eager experts: a Python loop over the experts that got tokens (data-dependent)."""
    return _build("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                  experts_implementation="eager", **_decoder_kw())


def olmo2() -> torch.nn.Module:
    return _build("Olmo2Config", "Olmo2ForCausalLM", **_decoder_kw())


def stablelm() -> torch.nn.Module:
    return _build("StableLmConfig", "StableLmForCausalLM", **_decoder_kw())


def granite() -> torch.nn.Module:
    return _build("GraniteConfig", "GraniteForCausalLM", **_decoder_kw())


def starcoder2() -> torch.nn.Module:
    return _build("Starcoder2Config", "Starcoder2ForCausalLM", sliding_window=8, **_decoder_kw())


FEATURES = {
    "llama": "baseline decoder, GQA, RoPE",
    "mistral": "sliding-window attention",
    "gemma2": "logit soft-capping, sliding window, eager attention",
    "gemma3": "q/k norms, sliding window",
    "qwen2": "qkv biases",
    "qwen3": "q/k norms",
    "phi3": "fused qkv and gate_up projections",
    "gpt_neox": "parallel attention + MLP, fused qkv, partial rotary",
    "cohere": "parallel attention + MLP, LayerNorm without bias",
    "falcon": "parallel attention, multi-query attention",
    "gpt2": "learned positions, Conv1D layers",
    "opt": "learned positions with offset",
    "bert": "encoder: token-type and position embeddings, padding mask",
    "t5": "encoder-decoder, relative position bias",
    "bart": "encoder-decoder, learned positions",
    "mixtral": "MoE, top-2 of 4 experts, HF's default grouped_mm experts",
    "mixtral_batched": "MoE with batched_mm experts (scatter-add weight gradients)",
    "qwen2_moe": "MoE with a gated shared expert",
    "qwen3_moe": "MoE with q/k norms, no shared expert",
    "olmoe": "MoE with q/k norms",
    "olmo2": "q/k norms over the full width, post-norms",
    "stablelm": "partial rotary, LayerNorm",
    "granite": "scaled residuals and logits",
    "starcoder2": "sliding window, biases, LayerNorm",
}
FAMILIES = list(FEATURES)
# Megatron plans by module glob for families whose config has no HF tensor-parallel plan
TP_PLANS = {
    "gpt2": {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"},
    "bert": {"bert.encoder.layer.*.attention.self.*": "colwise",
             "bert.encoder.layer.*.attention.output.dense": "rowwise",
             "bert.encoder.layer.*.intermediate.dense": "colwise", "bert.encoder.layer.*.output.dense": "rowwise"},
    "opt": {"model.decoder.layers.*.self_attn.[qkv]_proj": "colwise",
            "model.decoder.layers.*.self_attn.out_proj": "rowwise", "model.decoder.layers.*.fc1": "colwise",
            "model.decoder.layers.*.fc2": "rowwise"},
    "t5": {"*.SelfAttention.[qkv]": "colwise", "*.SelfAttention.o": "rowwise", "*.EncDecAttention.[qkv]": "colwise",
           "*.EncDecAttention.o": "rowwise", "*.DenseReluDense.wi": "colwise", "*.DenseReluDense.wo": "rowwise"},
}
ENCODER_DECODER = {"t5", "bart"}


def builder(family: str) -> Any:
    return globals()[family]


def inputs(family: str, seed: int = 0) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """A batch of ``BATCH x SEQ`` tokens: positional for decoders; keyword for the encoder (with token types and a
    padding mask) and the encoder-decoders."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    if family == "bert":
        token_types = (torch.arange(SEQ) >= SEQ // 2).long().expand(BATCH, SEQ).contiguous()
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        mask[1, SEQ - 4:] = 0
        return {"input_ids": ids, "token_type_ids": token_types, "attention_mask": mask}
    if family in ENCODER_DECODER:
        return {"input_ids": ids, "decoder_input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}
    return (ids,)
