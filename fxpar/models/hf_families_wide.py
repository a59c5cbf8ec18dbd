"""More tiny random Hugging Face families for an opt-in wider sweep (``FXPAR_HF_SWEEP=wide``; test-only).

The suite's own sweep (``hf_families``) covers one family per distinct feature; these are the other common
architectures in ``transformers``, built the same way (random weights, ``eval()``, no KV cache) and checked the
same way at dp=2 and, where the config has an HF tensor-parallel plan, at tp=2 with ``Plan(tp="hf")``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from fxpar.models.hf_families import BATCH, SEQ, VOCAB, _build, _decoder_kw


def _kw(**extra: Any) -> dict[str, Any]:
    return {**_decoder_kw(), **extra}


def _encoder_kw(**extra: Any) -> dict[str, Any]:
    return {**dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=128, max_position_embeddings=64, pad_token_id=0), **extra}


def _mha_kw() -> dict[str, Any]:  # families without grouped-query attention
    return {k: v for k, v in _decoder_kw().items() if k != "num_key_value_heads"}


BUILDERS = {
    "gemma": partial(_build, "GemmaConfig", "GemmaForCausalLM", head_dim=16, **_kw()),
    "phi": partial(_build, "PhiConfig", "PhiForCausalLM", **_kw()),
    "gptj": partial(_build, "GPTJConfig", "GPTJForCausalLM", attn="eager", n_embd=64, n_layer=2, n_head=4,
                    rotary_dim=8, n_positions=64, vocab_size=VOCAB, use_cache=False, tie_word_embeddings=False,
                    bos_token_id=1, eos_token_id=2),
    "bloom": partial(_build, "BloomConfig", "BloomForCausalLM", attn="eager", hidden_size=64, n_layer=2, n_head=4,
                     vocab_size=VOCAB, use_cache=False),
    "roberta": partial(_build, "RobertaConfig", "RobertaForMaskedLM", **_encoder_kw(max_position_embeddings=80)),
    "distilbert": partial(_build, "DistilBertConfig", "DistilBertForMaskedLM", vocab_size=VOCAB, dim=64, n_layers=2,
                          n_heads=4, hidden_dim=128, max_position_embeddings=64),
    "electra": partial(_build, "ElectraConfig", "ElectraForMaskedLM", **_encoder_kw(embedding_size=32)),
    "mpt": partial(_build, "MptConfig", "MptForCausalLM", attn="eager", d_model=64, n_heads=4, n_layers=2,
                   vocab_size=VOCAB, max_seq_len=64, use_cache=False),
    "gpt_bigcode": partial(_build, "GPTBigCodeConfig", "GPTBigCodeForCausalLM", n_embd=64, n_layer=2, n_head=4,
                           n_positions=64, vocab_size=VOCAB, use_cache=False),
    "glm": partial(_build, "GlmConfig", "GlmForCausalLM", head_dim=16, **_kw()),
    "helium": partial(_build, "HeliumConfig", "HeliumForCausalLM", head_dim=16, **_kw()),
    "olmo": partial(_build, "OlmoConfig", "OlmoForCausalLM", **_kw()),
    "nemotron": partial(_build, "NemotronConfig", "NemotronForCausalLM", head_dim=16, **_kw()),
    "persimmon": partial(_build, "PersimmonConfig", "PersimmonForCausalLM", **_mha_kw()),
    "codegen": partial(_build, "CodeGenConfig", "CodeGenForCausalLM", attn="eager", n_embd=64, n_layer=2, n_head=4,
                       rotary_dim=8, n_positions=64, n_ctx=64, vocab_size=VOCAB, use_cache=False,
                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "xglm": partial(_build, "XGLMConfig", "XGLMForCausalLM", attn="eager", d_model=64, num_layers=2,
                    attention_heads=4, ffn_dim=128, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False),
    "mbart": partial(_build, "MBartConfig", "MBartForConditionalGeneration", vocab_size=VOCAB, d_model=64,
                     encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                     encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False),
    "phimoe": partial(_build, "PhimoeConfig", "PhimoeForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                      **_kw()),
    "seed_oss": partial(_build, "SeedOssConfig", "SeedOssForCausalLM", head_dim=16, **_kw()),
    "smollm3": partial(_build, "SmolLM3Config", "SmolLM3ForCausalLM", **_kw()),
    "ministral": partial(_build, "MinistralConfig", "MinistralForCausalLM", head_dim=16, **_kw()),
    "exaone4": partial(_build, "Exaone4Config", "Exaone4ForCausalLM", head_dim=16, **_kw()),
    "hunyuan_dense": partial(_build, "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", head_dim=16, **_kw()),
    "arcee": partial(_build, "ArceeConfig", "ArceeForCausalLM", **_kw()),
}
WIDE_FAMILIES = list(BUILDERS)
ENCODER_DECODER = {"mbart"}


def inputs(family: str, seed: int = 0) -> tuple[torch.Tensor, ...] | dict[str, torch.Tensor]:
    """``BATCH x SEQ`` tokens, as keywords with decoder tokens for the encoder-decoder."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    if family in ENCODER_DECODER:
        return {"input_ids": ids, "decoder_input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}
    return (ids,)
