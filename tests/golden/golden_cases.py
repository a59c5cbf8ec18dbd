"""The golden cases: a fixed set of (model, mesh, plan) whose printed rank programs are checked in.

This is the one list used by both ``tests/test_golden.py`` (which diffs) and
``tests/golden/regen.py`` (which rewrites ``tests/golden/<case>.txt``). Each golden file holds, for
EVERY rank of the mesh, the rank's program at verbosity 1 (no source paths, so nothing
machine-dependent), its communication ledger for one ``pm.step`` and its predicted memory. A
refactor proves itself by leaving every file unchanged (process replay); a change in programs,
collectives or memory shows up in review as a diff.

The cases cover every feature: data, tensor and sequence parallel, ZeRO 1/2/3, recompute (full,
selective, a byte budget), FP8 (with and without ZeRO-3), overlap on and off, context and expert
parallel (and dp x ep), pipelines under every schedule, uneven widths and batches, and Hugging Face
Llama, GPT-2 and Mixtral. They compile on fake meshes only: no processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import fxpar
from fxpar.models.llama import hf_llama_plan, llama, llama_plan
from fxpar.models.mlp import mlp, mlp_plan
from fxpar.testing.error_models import next_token_loss

GOLDEN_DIR = Path(__file__).resolve().parent
REGEN_COMMAND = "make golden  (or: .venv/bin/python tests/golden/regen.py)"

# Small shapes keep the files readable; GQA (4 query heads, 2 kv heads) keeps repeat_interleave in.
MLP_SHAPE = {"dim": 8, "hidden": 16, "out": 4}
LLAMA_SHAPE = {"n_layers": 2, "vocab_size": 32, "hidden": 16, "intermediate": 32, "n_heads": 4,
               "n_kv_heads": 2, "max_seq": 8}


@dataclass(frozen=True)
class Case:
    """One golden file: ``build`` returns the model and its example inputs (global shapes)."""

    name: str
    about: str
    build: Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]
    axes: dict[str, int]
    plan: Any
    loss: bool = False  # compile with loss_fn=next_token_loss (pipelines need one)
    ranks: tuple[int, ...] | None = None  # None: every rank of the mesh
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def path(self) -> Path:
        return GOLDEN_DIR / f"{self.name}.txt"


def _mlp(**shape: Any) -> Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]:
    config = {**MLP_SHAPE, **shape}
    batch = config.pop("batch", 4)

    def build() -> tuple[torch.nn.Module, tuple[Any, ...]]:
        torch.manual_seed(0)
        return mlp(**config), (torch.zeros(batch, config["dim"]),)

    return build


def _llama(**shape: Any) -> Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]:
    config = {**LLAMA_SHAPE, **shape}
    batch = config.pop("batch", 2)

    def build() -> tuple[torch.nn.Module, tuple[Any, ...]]:
        torch.manual_seed(0)
        return llama(**config), (torch.zeros(batch, config["max_seq"], dtype=torch.long),)

    return build


def _hf(family: str, batch: int = 2, seq: int = 8) -> Callable[[], tuple[torch.nn.Module, tuple[Any, ...]]]:
    def build() -> tuple[torch.nn.Module, tuple[Any, ...]]:
        import transformers

        torch.manual_seed(0)
        common = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, use_cache=False, tie_word_embeddings=False)
        if family == "llama":
            config = transformers.LlamaConfig(intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=seq, **common)
            model_cls = transformers.LlamaForCausalLM
        elif family == "gpt2":
            config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=4, n_positions=seq,
                                             bos_token_id=0, eos_token_id=0, use_cache=False, resid_pdrop=0.0,
                                             embd_pdrop=0.0, attn_pdrop=0.0)
            model_cls = transformers.GPT2LMHeadModel
        else:  # mixtral
            config = transformers.MixtralConfig(intermediate_size=8, num_attention_heads=4, num_key_value_heads=2,
                                                head_dim=4, num_local_experts=4, num_experts_per_tok=2,
                                                max_position_embeddings=seq, **common)
            model_cls = transformers.MixtralForCausalLM
        config._attn_implementation = "sdpa"
        return model_cls(config).eval(), (torch.zeros(batch, seq, dtype=torch.long),)

    return build


def _about(shape: dict[str, Any], extra: dict[str, Any]) -> str:
    merged = {**shape, **extra}
    return ", ".join(f"{k}={v}" for k, v in merged.items())


GPT2_PLAN = {"transformer.h.*.attn.c_attn": "colwise", "transformer.h.*.attn.c_proj": "rowwise",
             "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
P = fxpar.Plan
MEGATRON = llama_plan()
FOUR_LAYERS = {"n_layers": 4}
FP8_HEADS = {"n_heads": 2, "n_kv_heads": 2}  # every Linear 16 x 16 or wider: all run in fp8


def _l(name: str, axes: dict[str, int], plan: Any, loss: bool = False, **shape: Any) -> Case:
    return Case(name, f"llama({_about(LLAMA_SHAPE, shape)}), plan {plan}", _llama(**shape), axes, plan, loss)


def _m(name: str, axes: dict[str, int], plan: Any, **shape: Any) -> Case:
    return Case(name, f"mlp({_about(MLP_SHAPE, shape)}), plan {plan}", _mlp(**shape), axes, plan)


def _h(name: str, family: str, axes: dict[str, int], plan: Any, batch: int = 2) -> Case:
    return Case(name, f"HF {family} (2 layers, hidden 16, vocab 32), batch {batch}, plan {plan}", _hf(family, batch),
                axes, plan)


CASES: list[Case] = [
    # data and tensor parallel
    _m("mlp_tp2", {"tp": 2}, mlp_plan()),
    _m("mlp_dp2", {"dp": 2}, None),
    _m("mlp_dp2_tp2", {"dp": 2, "tp": 2}, mlp_plan()),
    _l("llama_tp2", {"tp": 2}, MEGATRON),
    _l("llama_dp2_tp2", {"dp": 2, "tp": 2}, MEGATRON),
    _l("llama_dp2_tp2_no_overlap", {"dp": 2, "tp": 2}, P(tp=MEGATRON, overlap=False)),
    _l("llama_dp2_tp2_mb2", {"dp": 2, "tp": 2}, P(tp=MEGATRON, microbatches=2), loss=True, batch=4),
    # sequence parallel
    _l("llama_tp2_sp", {"tp": 2}, P(tp=MEGATRON, sequence_parallel=True)),
    _l("llama_dp2_tp2_sp_zero3", {"dp": 2, "tp": 2}, P(tp=MEGATRON, sequence_parallel=True, zero=3)),
    # ZeRO
    _l("llama_dp2_zero1", {"dp": 2}, P(zero=1)),
    _l("llama_dp2_zero1_mb2", {"dp": 2}, P(zero=1, microbatches=2), loss=True, batch=4),
    _l("llama_dp2_zero2_mb2", {"dp": 2}, P(zero=2, microbatches=2), loss=True, batch=4),
    _l("llama_dp2_tp2_zero3", {"dp": 2, "tp": 2}, P(tp=MEGATRON, zero=3)),
    _l("llama_dp2_zero3_no_overlap", {"dp": 2}, P(zero=3, overlap=False)),
    # recompute
    _l("llama_dp2_recompute_full", {"dp": 2}, P(recompute="full")),
    _l("llama_tp2_recompute_selective", {"tp": 2}, P(tp=MEGATRON, recompute="selective")),
    _l("llama_tp2_sp_recompute_full", {"tp": 2}, P(tp=MEGATRON, sequence_parallel=True, recompute="full")),
    _l("llama_dp2_recompute_budget", {"dp": 2}, P(recompute=4000)),
    # fp8
    _l("llama_tp2_fp8_tensorwise", {"tp": 2}, P(tp=MEGATRON, fp8="tensorwise"), **FP8_HEADS),
    _l("llama_dp2_fp8_rowwise_zero3", {"dp": 2}, P(fp8="rowwise", zero=3), **FP8_HEADS),
    _l("llama_dp2_tp2_fp8_zero3", {"dp": 2, "tp": 2}, P(tp=MEGATRON, fp8="tensorwise", zero=3), **FP8_HEADS),
    # context parallel
    _l("llama_cp2", {"cp": 2}, None),
    _l("llama_dp2_cp2_zero3", {"dp": 2, "cp": 2}, P(zero=3)),
    _l("llama_cp2_tp2", {"cp": 2, "tp": 2}, MEGATRON),
    # pipelines, every schedule
    _l("llama_pp2_gpipe", {"pp": 2}, P(schedule="gpipe", microbatches=2), loss=True),
    _l("llama_pp2_dp2_1f1b", {"pp": 2, "dp": 2}, P(schedule="1f1b", microbatches=2), loss=True, batch=4,),
    _l("llama_pp2_dp2_tp2_1f1b", {"pp": 2, "dp": 2, "tp": 2}, P(tp=MEGATRON, schedule="1f1b", microbatches=2),
       loss=True, batch=4),
    _l("llama_pp2_interleaved", {"pp": 2}, P(stages=4, schedule="interleaved-1f1b", microbatches=2), loss=True,
       **FOUR_LAYERS),
    _l("llama_pp2_zbh1", {"pp": 2}, P(schedule="zb-h1", microbatches=2), loss=True),
    _l("llama_pp2_dp2_zero1", {"pp": 2, "dp": 2}, P(zero=1, microbatches=2), loss=True, batch=4),
    _l("llama_pp2_tied", {"pp": 2}, P(microbatches=2), loss=True, tie_embeddings=True),
    # uneven widths and batches
    _m("mlp_tp3_uneven", {"tp": 3}, mlp_plan(), hidden=10, out=5),
    _m("mlp_dp3_uneven_batch", {"dp": 3}, None, batch=4),
    _l("llama_tp4_uneven_vocab", {"tp": 4}, {**MEGATRON, "embed": "colwise", "lm_head": "colwise"}, vocab_size=30,
       n_heads=4, n_kv_heads=4),
    # Hugging Face
    _h("hf_llama_dp2_tp2", "llama", {"dp": 2, "tp": 2}, hf_llama_plan()),
    _h("hf_gpt2_dp2_tp2", "gpt2", {"dp": 2, "tp": 2}, GPT2_PLAN),
    _h("hf_mixtral_ep2", "mixtral", {"ep": 2}, None),
    _h("hf_mixtral_dp2_ep2", "mixtral", {"dp": 2, "ep": 2}, None, batch=4),
]


def render(case: Case) -> str:
    """The golden text of ``case``: a case header, then per rank its program, its step ledger and its memory."""
    return render_module(case)[0]


def render_module(case: Case) -> tuple[str, Any]:
    """``render(case)`` and the ``ParallelModule`` it printed."""
    model, inputs = case.build()
    mesh = fxpar.Mesh(case.axes, fake=True)
    pm = fxpar.parallelize(model, mesh, inputs, plan=case.plan, loss_fn=next_token_loss if case.loss else None)
    parts = [f"# golden case {case.name}: {case.about}\n"]
    for rank in case.ranks if case.ranks is not None else range(mesh.size):
        parts.append(f"{pm.program(rank, verbosity=1)}\n{pm.ledger_table(rank)}\n{pm.memory(rank)}\n")
    return "\n".join(parts), pm
