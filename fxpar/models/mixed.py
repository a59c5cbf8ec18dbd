"""Models whose repeated layers differ, for trace-once capture (``fxpar.blocks``): picklable factories.

* ``gemma2_alternating``: HF Gemma2, sliding-window and global attention layers alternating
  (the same code and shapes; a read attribute, ``sliding_window``, differs): 2 distinct blocks.
* ``qwen3_moe_mixed``: HF Qwen3-MoE with dense MLP layers among the sparse ones
  (``mlp_only_layers``): 2 distinct blocks.
* ``llama_wide_layers``: the bundled Llama with a wider MLP in every other layer (a per-layer
  config change): 2 distinct blocks.
* ``llama4_interleaved``: HF Llama 4 text, MoE layers between dense ones (``interleave_moe_layer_step=2``) and
  chunked attention; its masks index a tensor by the batch positions alone (``x[arange(B)[:, None, ..]]``).
"""

from __future__ import annotations

import torch

from fxpar.models import hf_families
from fxpar.models.llama import MLP, Llama, LlamaConfig


def gemma2_alternating(layers: int = 4) -> torch.nn.Module:
    kw = {**hf_families._decoder_kw(), "num_hidden_layers": layers}
    return hf_families._build("Gemma2Config", "Gemma2ForCausalLM", attn="eager", head_dim=16, query_pre_attn_scalar=16,
                              sliding_window=8, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **kw)


def qwen3_moe_mixed(layers: int = 4) -> torch.nn.Module:
    kw = {**hf_families._decoder_kw(), "num_hidden_layers": layers}
    return hf_families._build("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[1, 3], **kw)


def llama4_interleaved(layers: int = 4) -> torch.nn.Module:
    kw = {**hf_families._decoder_kw(), "num_hidden_layers": layers}
    return hf_families._build("Llama4TextConfig", "Llama4ForCausalLM", num_local_experts=4, num_experts_per_tok=1,
                              interleave_moe_layer_step=2, intermediate_size_mlp=96, head_dim=16,
                              attention_chunk_size=8, **kw)


def llama_wide_layers(layers: int = 4, wide: int = 96, **config: int) -> Llama:
    """``Llama`` whose odd layers have intermediate size ``wide`` instead of the config's."""
    cfg = LlamaConfig(n_layers=layers, **config)
    model = Llama(cfg)
    for i in range(1, layers, 2):
        model.layers[i].mlp = MLP(LlamaConfig(n_layers=layers, **{**config, "intermediate": wide}))
    return model
