"""Context parallelism: a ``cp`` mesh axis shards the sequence of every activation (issue 10).

Every cp rank is called with the same dp-local batch; fxpar shards the sequence inside, load-balanced (rank ``i``
holds chunks ``i`` and ``2 * cp - 1 - i`` of ``2 * cp``), runs Linear layers on their own tokens
(``fxpar::matmul_nd``/``token_contract``), and attention against k and v all-gathered over cp, with a causal mask
of each rank's own query positions. Checked here: the graph rewrite keeps values exactly, the new rules hold on
real shards, the ledger equals the all-gather formula, equivalence with the single device on gloo (cp=2 and cp=4,
HF Llama with a padding mask, an encoder and an encoder-decoder, and dp=2 x cp=2 x tp=2), and bad input.
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.distributed.tensor import Partial, Replicate, Shard

import fxpar
from fxpar.capture import capture
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.rules import candidates
from fxpar.rules.validate import check_candidate
from fxpar.split import Splitter, splitter
from fxpar.testing import assert_equivalent

CFG = LlamaConfig(n_layers=2)  # hidden 64, 4 heads, 2 kv heads, head_dim 16, vocab 256


def _tokens(batch: int = 4, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))


def test_load_balanced_pieces() -> None:
    split = Splitter(("dp", "cp"), (2, 2), batch=4, seq=16)
    assert split.indices(16, 1, 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert split.indices(16, 1, 1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert split.sizes(16, 1) == [8, 8]
    assert split.indices(4, 1, 1) == [2, 3]  # any other dim over cp: a plain chunk
    assert not split.balanced(16, 0)  # the same size over dp is the batch split


def test_linear_on_unflattened_tokens_keeps_every_value() -> None:
    """Capture with a cp axis rewrites each Linear's three matmuls (and bias gradients); the joint graph computes
    bit-identical values to the one captured without it."""
    model = Llama(LlamaConfig(n_layers=1, bias=True))
    x = _tokens(2, 16)
    plain = capture(model, fxpar.Mesh({"dp": 2}, fake=True), (x,))
    rewritten = capture(model, fxpar.Mesh({"cp": 2}, fake=True), (x,))
    targets = [str(n.target) for n in rewritten.graph.nodes]
    linears = 8  # q, k, v, o, gate, up, down, lm_head
    assert targets.count("fxpar.matmul_nd.default") == 2 * linears and "aten.mm.default" not in targets
    assert targets.count("fxpar.token_contract.default") == linears
    gen = torch.Generator().manual_seed(1)
    args = []
    for n in plain.graph.nodes:
        if n.op == "placeholder":
            v = n.meta["val"]
            args.append(torch.randint(0, 256, v.shape, generator=gen) if not v.is_floating_point()
                        else torch.randn(v.shape, generator=gen))
    want = pytree.tree_leaves(torch.fx.Interpreter(plain.gm).run(*args))
    got = pytree.tree_leaves(torch.fx.Interpreter(rewritten.gm).run(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g is None and w is None or torch.equal(g, w)


@pytest.mark.parametrize("n", [2, 3])
def test_token_matmul_rules_hold_on_real_shards(n: int) -> None:
    import fxpar.ops  # noqa: F401

    x, w, g = torch.randn(2, 6, 8), torch.randn(8, 12), torch.randn(2, 6, 12)
    for op, args in ((torch.ops.fxpar.matmul_nd.default, (x, w)), (torch.ops.fxpar.token_contract.default, (g, x))):
        found = candidates(op, args, {}, [Replicate(), Replicate()], n)
        assert len({c.output for c in found}) >= 4
        for cand in found:
            check_candidate(op, args, {}, cand, n)


def test_context_attention_candidate_holds_on_real_shards() -> None:
    """Queries sharded on the sequence, k and v whole: forward outputs sharded, k/v gradients partial sums."""
    from fxpar.rules.context import ContextPolicy

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = fwd(q, k, v, 0.0, False)
    policy = ContextPolicy(seq=8)
    graph = torch.fx.Graph()
    nodes = []
    for name, t in (("q", q), ("k", k), ("v", v), ("g", out), ("o", out), ("l", lse)):
        nodes.append(graph.placeholder(name))
        nodes[-1].meta["val"] = t
    f = graph.call_function(fwd, (*nodes[:3], 0.0, False))
    f.meta["val"] = (out, lse)
    check_candidate(fwd, (q, k, v, 0.0, False), {}, policy.attention(f), 2)
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    b = graph.call_function(bwd, (nodes[3], *nodes[:3], nodes[4], nodes[5], 0.0, False))
    cand = policy.attention(b)
    assert cand.output == (Shard(2), Partial(), Partial())
    check_candidate(bwd, (torch.randn_like(out), q, k, v, out, lse, 0.0, False), {}, cand, 2)


def _cp_ledger(axes: dict[str, int], batch: int, seq: int, plan: object = None) -> list:
    pm = fxpar.parallelize(Llama(CFG), fxpar.Mesh(axes, fake=True), (_tokens(batch, seq),), plan=plan)
    return pm, [r for r in pm.ledger(0) if r.axis == "cp"]


@pytest.mark.parametrize("axes", [{"cp": 2}, {"cp": 4}, {"dp": 2, "cp": 2, "tp": 2}])
def test_ledger_is_the_all_gather_formula(axes: dict[str, int]) -> None:
    """Per layer, the forward all-gathers k and v over cp (kv heads, not the repeated query heads) and the
    backward reduce-scatters their gradients; the logits are gathered once for the output; every parameter
    gradient is all-reduced over cp, as data parallelism would. Nothing else moves over cp."""
    batch, seq = 4, 32
    tp = axes.get("tp", 1)
    pm, rows = _cp_ledger(axes, batch, seq, llama_plan() if tp > 1 else None)
    b = batch // axes.get("dp", 1)
    kv = b * seq * (CFG.n_kv_heads // tp) * (CFG.hidden // CFG.n_heads) * 4  # bytes of whole k (or v)
    logits = b * seq * CFG.vocab_size * 4
    gathers = sorted(r.bytes for r in rows if r.phase == "fwd")
    assert [r.op for r in rows if r.phase == "fwd"] == ["all_gather"] * (2 * CFG.n_layers + 1)
    assert gathers == sorted([kv] * 2 * CFG.n_layers + [logits])
    scattered = [r.bytes for r in rows if r.op == "reduce_scatter"]
    assert scattered == [kv] * 2 * CFG.n_layers
    reduced = sum(r.bytes for r in rows if r.op == "all_reduce")
    prog = pm._compiled.stages[0]
    local = splitter(prog)
    coord = prog.mesh.coord(0)
    assert reduced == sum(4 * math.prod(local.local_shape(prog.node(name).meta["val"].shape, prog.placements[name],
                                                           coord)) for _, name in prog.signature.params)
    assert len(rows) == 4 * CFG.n_layers + 1 + sum(r.op == "all_reduce" for r in rows)
    text = pm.program(rank=0)
    assert "cp_causal_mask" in text and "attn_mask=cp_causal_mask" in text


def test_activations_are_sequence_sharded() -> None:
    """Every forward value with a sequence dim is a cp shard except the rope tables (sliced per rank where they are
    used) and the k and v that attention reads whole (the layout and repeat ops after their all-gather): each rank
    computes only its share of the tokens."""
    from fxpar.rules.context import REPEATS

    seq = 48  # no other width of the model is 48
    pm, _ = _cp_ledger({"cp": 2}, 4, seq)
    prog = pm._compiled.stages[0]
    whole = [n for n in prog.graph.nodes if n.op == "call_function" and prog.provenance[n.name].phase == "fwd"
             and isinstance(n.meta.get("val"), torch.Tensor) and seq in n.meta["val"].shape
             and prog.placements[n.name] == (Replicate(),)]
    rope = [n for n in whole if n.target is torch.ops.aten.slice.Tensor and n.args[0].op == "placeholder"]
    repeats = [n for n in whole if n.target in REPEATS]
    # per layer: k's repeat_kv (unsqueeze, expand, clone, view) after rope; v's head split (view, transpose) too,
    # since nothing computes between v's projection and its repeat: its gather moves the projection output
    assert len(rope) == 2 and len(repeats) == (4 + 6) * CFG.n_layers and len(whole) == len(rope) + len(repeats)


def test_bundled_llama_matches_single_device() -> None:
    # cp=4 and cp with microbatches run in the property suite (tests/test_properties.py)
    assert_equivalent(partial(Llama, CFG), {"cp": 2}, None, (_tokens(4, 16),), steps=3)


def test_dp_cp_tp_matches_single_device() -> None:
    """The 3-D combination: the batch over dp, the sequence over cp, heads and MLP widths over tp (8 gloo ranks)."""
    assert_equivalent(partial(Llama, CFG), {"dp": 2, "cp": 2, "tp": 2}, llama_plan(), (_tokens(4, 16),), steps=3)


def _next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def test_pipeline_stages_send_sequence_shards_and_match_single_device() -> None:
    """pp=2 x cp=2 under 1f1b with 2 microbatches and a shifted next-token loss: each stage boundary carries only
    the rank's cp piece of the sequence ([mb, seq / cp, hidden]), and the step matches the single device."""
    x = _tokens(4, 16)
    plan = fxpar.Plan(stages=2, microbatches=2)
    pm = fxpar.parallelize(Llama(CFG), fxpar.Mesh({"pp": 2, "cp": 2}, fake=True), (x,), plan=plan,
                           loss_fn=_next_token_loss, example_targets=x)
    sends = [r for r in pm.ledger(0) if r.op == "send"]
    assert sends and all(r.shape == (2, 8, CFG.hidden) for r in sends)
    assert_equivalent(partial(Llama, CFG), {"pp": 2, "cp": 2}, plan, (x,), steps=3, loss_fn=_next_token_loss,
                      targets=x)


def test_zero3_with_cp_matches_single_device() -> None:
    assert_equivalent(partial(Llama, CFG), {"dp": 2, "cp": 2}, fxpar.Plan(zero=3), (_tokens(4, 16),), steps=3)


@pytest.mark.parametrize("family", ["llama", "t5", "bert", "gemma2", "mixtral"])
def test_hf_models_match_single_device(family: str) -> None:
    """HF Llama with a padding mask (keyword inputs), T5 (encoder-decoder, eager attention, relative position
    bias over the sequence), BERT (encoder, bidirectional with a padding mask), Gemma2 (eager attention with
    soft-capping and a sliding window) and Mixtral (MoE: its experts gather the tokens over cp)."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    batch = hf_families.inputs(family)
    if family == "llama":
        mask = torch.ones_like(batch[0])
        mask[1, -3:] = 0
        batch = {"input_ids": batch[0], "attention_mask": mask}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fxpar.FxparWarning)  # MoE: HF's grouped_mm has no rule over cp
        assert_equivalent(hf_families.builder(family), {"cp": 2}, None, batch, steps=3)


def test_sequence_the_axis_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"sequence length 18 .* not a multiple of 4; pad the sequence"):
        fxpar.parallelize(Llama(CFG), fxpar.Mesh({"cp": 2}, fake=True), (_tokens(4, 18),))


@pytest.mark.parametrize("batch", [4, 1])
def test_sequence_parallel_with_cp_matches_single_device(batch: int) -> None:
    # cp shards the sequence dim, so SP keeps the tp stream sharded on another dim (the batch, or with one
    # sequence the hidden dim): reduce-scatter / all-gather over tp instead of all-reduce, fewer saved bytes
    x = (_tokens(batch, 16),)
    plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=True)
    pm = fxpar.parallelize(Llama(CFG), fxpar.Mesh({"cp": 2, "tp": 2}, fake=True), x, plan=plan)
    plain = fxpar.parallelize(Llama(CFG), fxpar.Mesh({"cp": 2, "tp": 2}, fake=True), x,
                              plan=fxpar.Plan(tp=llama_plan()))
    fwd_tp = {r.op for r in pm.ledger(0) if r.axis == "tp" and r.phase == "fwd"}
    assert fwd_tp == {"reduce_scatter", "all_gather"}
    assert pm.memory(0).activations < plain.memory(0).activations
    assert_equivalent(partial(Llama, CFG), {"cp": 2, "tp": 2}, plan, x, steps=2)


def test_cp_refuses_what_it_does_not_compose_with() -> None:
    with pytest.raises(fxpar.PlanError, match="no two-dim|no input has two dims"):
        fxpar.parallelize(torch.nn.Linear(8, 8), fxpar.Mesh({"cp": 2}, fake=True), (torch.randn(4, 8)[0],))


def test_ep_axis_on_a_model_without_experts_is_a_clear_error() -> None:
    with pytest.raises(fxpar.PlanError, match="'ep' shards the experts of MoE layers, but Llama has no experts"):
        fxpar.parallelize(Llama(CFG), fxpar.Mesh({"dp": 2, "ep": 2}, fake=True), (_tokens(4, 16),))


def _hf_loss(out: object) -> torch.Tensor:
    return out.loss


def test_hf_in_model_loss_with_labels_matches_single_device() -> None:
    """HF computes its loss inside the model from ``labels`` (shifted along the sequence, which cp shards):
    ``model(input_ids=..., labels=...)`` at dp=2 x cp=2, compared on the model's own loss."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    ids = hf_families.inputs("llama")[0]
    assert_equivalent(hf_families.builder("llama"), {"dp": 2, "cp": 2}, None, {"input_ids": ids, "labels": ids},
                      steps=3, loss_fn=_hf_loss)


def test_a_buffer_filled_by_slice_copies_runs_on_sequence_and_batch_shards() -> None:
    """DeepSeek-V3's MLA concat (``new_empty`` then two slice copies): at cp=2 the backward's ``new_empty_strided``
    kept its global shape on a sequence shard (a crash in the fake copy); at dp=2 the buffer, replicated by DTensor's
    factory rule, gathered the batch into it twice a step."""
    from fxpar.testing.block_models import ConcatBySliceCopies

    x = torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0))
    assert_equivalent(ConcatBySliceCopies, {"cp": 2}, fxpar.Plan(), (x,), steps=2)
    pm = fxpar.parallelize(ConcatBySliceCopies(), fxpar.Mesh({"dp": 2}, fake=True), (x,))
    assert [r.op for r in pm.ledger(0)] == ["all_reduce"]  # DDP's gradient bucket alone
