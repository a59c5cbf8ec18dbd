"""Mixed precision, ``Plan(param_dtype=..., reduce_dtype=...)``: FSDP2's ``MixedPrecisionPolicy`` semantics.

Equivalence is against the single-device model making the same casts (``fxpar.mixed_precision.computing_in``:
bf16 forward and backward from fp32 master weights, fp32 gradients) at bf16 tolerance
(``fxpar.testing.tolerance``: rtol 3.2e-2, atol 2e-2 x max|ref| at step 0; 5e-2 later; parameters within
2 lr): a sharded matmul rounds its partial products to bf16 before they are summed, the single device
rounds the sum once.
"""

from __future__ import annotations

from fnmatch import fnmatch
from functools import partial

import pytest
import torch

import fxpar
from fxpar.errors import PlanError
from fxpar.models.llama import llama, llama_plan
from fxpar.testing import assert_equivalent, default_pool
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.probes import grad_storage_after_backward, measured_memory

aten = torch.ops.aten

BF16, FP32 = torch.bfloat16, torch.float32
TOKENS = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
MIXED = {"param_dtype": BF16, "reduce_dtype": FP32}


def _compile(axes: dict[str, int], **plan: object) -> fxpar.ParallelModule:
    tp = llama_plan() if "tp" in axes else {}
    return fxpar.parallelize(llama(n_layers=2), fxpar.Mesh(axes, fake=True), (TOKENS,),
                             plan=fxpar.Plan(tp=tp, **plan), loss_fn=next_token_loss, example_targets=TOKENS)


def _local_elements(model: torch.nn.Module, tp: int) -> int:
    """Psi per rank in elements: a parameter of a colwise/rowwise module holds 1/tp of its elements."""
    def sharded(name: str) -> bool:
        return any(fnmatch(name.rsplit(".", 1)[0], glob) for glob in llama_plan())

    return sum(p.numel() // tp if sharded(name) else p.numel() for name, p in model.named_parameters())


def test_plan_refuses_what_is_not_a_compute_dtype() -> None:
    with pytest.raises(PlanError, match="param_dtype must be None or a floating dtype"):
        _compile({"dp": 2}, param_dtype=torch.int8)
    with pytest.raises(PlanError, match="reduce_dtype"):
        _compile({"dp": 2}, reduce_dtype=torch.float8_e4m3fn)
    with pytest.raises(PlanError, match="compile must be True or False"):
        _compile({"dp": 2}, compile="yes")


def test_casts_sit_in_the_module_that_owns_the_parameter_and_are_printed() -> None:
    program = _compile({"dp": 2}, **MIXED).program(0)
    assert "mixed_precision" in program.splitlines()[2]  # the passes line of the header
    q_cast = [line for line in program.splitlines() if "_to_copy(layers_0_attn_q_weight, dtype=torch.bfloat16)" in line]
    assert q_cast and q_cast[0].rstrip().endswith("layers.0.attn.q")
    # master weights stay fp32: the forward takes them as they are; the backward hands fp32 gradients over
    pm = _compile({"dp": 2}, **MIXED)
    assert all(p.dtype == FP32 for p in pm.parameters())


def test_zero3_gathers_bf16_and_reduces_in_reduce_dtype() -> None:
    model = llama(n_layers=2)
    psi = _local_elements(model, tp=2)
    for reduce_dtype, grad_bytes in ((FP32, 4), (None, 2)):  # None: FSDP2's default, param_dtype
        pm = _compile({"dp": 2, "tp": 2}, zero=3, param_dtype=BF16, reduce_dtype=reduce_dtype)
        rows = [r for r in pm.ledger(0) if r.axis == "dp"]
        gathers = [r for r in rows if r.op == "all_gather"]
        scatters = [r for r in rows if r.op == "reduce_scatter"]
        assert gathers and all(r.dtype == BF16 for r in gathers)
        assert scatters and all(r.dtype == (reduce_dtype or BF16) for r in scatters)
        # every parameter gathered whole once in the forward (and again in the backward), in 2 bytes, one flat
        # all-gather per block (the casts of its weights) plus the root's parameters
        fwd = [r for r in gathers if r.phase == "fwd"]
        assert sum(r.bytes for r in fwd) == 2 * psi and len(fwd) <= 2 + 2
        assert sum(r.bytes for r in scatters) == grad_bytes * psi
    assert all(r.op not in ("all_reduce", "reduce_scatter") or r.dtype == FP32
               for r in _compile({"dp": 2}, **MIXED).ledger(0) if r.axis == "dp")


def test_zero3_gathers_a_tied_table_once_per_forward() -> None:
    """The tied table is cast twice (embedding, head): both casts are served by one gather in the root's flat bucket
    (each cast was gathered on its own, and the root's other parameters apart from it)."""
    model = llama(n_layers=2, tie_embeddings=True)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (TOKENS,), plan=fxpar.Plan(zero=3, **MIXED),
                           loss_fn=next_token_loss, example_targets=TOKENS)
    fwd = [r for r in pm.ledger(0) if r.axis == "dp" and r.op == "all_gather" and r.phase == "fwd"]
    assert sum(r.bytes for r in fwd) == 2 * sum(p.numel() for p in model.parameters()) and len(fwd) <= 2 + 2


def test_memory_formula_under_zero3() -> None:
    # fp32 master weights, fp32 gradients, two fp32 Adam moments: (4 + 4 + 8) Psi / N; the bf16 working copies
    # are gathered inside the graphs (transient) or saved for the backward (activations)
    pm = _compile({"dp": 2, "tp": 2}, zero=3, **MIXED)
    psi = _local_elements(llama(n_layers=2), tp=2)
    mem = pm.memory(0)
    assert (mem.params, mem.grads, mem.optimizer) == (4 * psi // 2, 4 * psi // 2, 8 * psi // 2)
    assert mem.transient >= 2 * max(p.numel() for p in llama(n_layers=2).parameters()) // 2


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_memory_equals_local_storage_after_a_real_step(zero: int) -> None:
    # ZeRO-1: fp32 shards and Adam state, the whole fp32 gradient until the step's end, and the working copy
    # gathered in bf16 (2 bytes per parameter, FSDP2's): 4 Psi / N + 2 Psi of params
    plan = fxpar.Plan(tp=llama_plan(), zero=zero, **MIXED)
    psi = _local_elements(llama(), tp=2)
    for r in default_pool().run(measured_memory, 4, llama, {"dp": 2, "tp": 2}, plan, TOKENS, next_token_loss,
                                timeout=300):
        mem = r["predicted"]
        copy = 2 * psi if zero == 1 else 0
        whole_grads = 4 * psi if zero == 1 else 0
        assert r["working_copy"] == copy
        assert (mem.params - copy, mem.grads - whole_grads, mem.optimizer) == (r["params"], r["grads"], r["optimizer"])
        assert mem.activations == r["held"] > r["saved_per_microbatch"]  # the logits' gradient besides
        if zero == 1:
            assert (mem.params, mem.optimizer) == (4 * psi // 2 + 2 * psi, 8 * psi // 2)


@pytest.mark.parametrize("zero", [1, 3])
def test_moe_expert_gradient_shards_hold_only_their_own_bytes(zero: int) -> None:
    """An HF MoE's experts under mixed precision: the storage a real step leaves is what ``pm.memory`` says (the
    ZeRO-1 working copy and whole gradient live inside the step). Each rank once computed the experts' gradients
    whole, on all ranks' tokens (``test_hf_families.py::test_moe_experts_stay_on_each_ranks_own_tokens_in_mixed_
    precision``), and ``.grad`` kept its shard as a slice of that whole: dp times the bytes ``pm.memory`` counted."""
    pytest.importorskip("transformers")
    from fxpar.models import hf_families

    plan, tokens = fxpar.Plan(zero=zero, **MIXED), hf_families.inputs("mixtral")[0]
    for r in default_pool().run(measured_memory, 2, hf_families.mixtral, {"dp": 2}, plan, tokens, next_token_loss,
                                timeout=300):
        mem, copy = r["predicted"], r["working_copy"]
        whole_grads = 2 * copy if zero == 1 else 0  # fp32 gradients of the bf16 working copy's elements
        assert (mem.params - copy, mem.grads - whole_grads, mem.optimizer) == (r["params"], r["grads"], r["optimizer"])
        assert mem.optimizer == 2 * r["params"]  # Adam's two fp32 moments per fp32 shard
    if zero == 3:  # pm(x) + loss.backward() hands autograd the same shards
        for grads, params in default_pool().run(grad_storage_after_backward, 2, hf_families.mixtral, {"dp": 2}, plan,
                                                tokens, next_token_loss, timeout=300):
            assert grads == params


def test_biased_linears_round_as_eager_f_linear_does() -> None:
    """Capture splits ``addmm`` into ``mm`` + ``add`` (a row-parallel product is reduced before its bias is added);
    where no collective comes between them, lowering fuses them back (``fxpar.lower.fuse_bias``). In bf16 the split
    pair rounds the product and then the sum, where eager's ``F.linear`` rounds once: one unit in the last place on
    some outputs, enough to flip an MoE router's top-k (GPT-OSS at 4 layers). On one rank the two are bitwise."""
    from fxpar.models.mlp import mlp, mlp_plan

    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    plan = fxpar.Plan(param_dtype=BF16, reduce_dtype=FP32)
    assert_equivalent(partial(mlp, dim=32, hidden=256, out=64), {"dp": 1}, plan, (x,), steps=1, rtol=0.0, atol=0.0)
    text = fxpar.parallelize(mlp(), fxpar.Mesh({"tp": 2}, fake=True), (torch.zeros(4, 32),),
                             plan=fxpar.Plan(tp=mlp_plan(), **MIXED)).program(0).split("def backward")[0]
    assert "aten.addmm(" in text  # the column-parallel up projection: its bias joins the matmul
    assert "aten.add.Tensor(mm_default_1_reduced" in text  # the row-parallel down projection: reduced, then added


def test_dp2_tp2_matches_the_single_device_casts() -> None:
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), **MIXED),
                      (TOKENS,), steps=2)


def test_zero3_matches_the_single_device_casts() -> None:
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2}, fxpar.Plan(zero=3, **MIXED), (TOKENS,), steps=2)


def test_pipeline_dp_matches_the_single_device_casts() -> None:
    plan = fxpar.Plan(stages=2, microbatches=2, schedule="1f1b", **MIXED)
    assert_equivalent(partial(llama, n_layers=2), {"pp": 2, "dp": 2}, plan, (TOKENS,), steps=2,
                      loss_fn=next_token_loss, targets=TOKENS)


def test_hf_gemma2_dp2_tp2_zero3_matches_the_single_device_casts() -> None:
    # a Hugging Face model's own dtype handling (Gemma's embedding scale and soft-capping, its fp32 RMSNorm)
    from fxpar.models import hf_families

    plan = fxpar.Plan(tp="hf", zero=3, **MIXED)
    assert_equivalent(hf_families.gemma2, {"dp": 2, "tp": 2}, plan, hf_families.inputs("gemma2", seed=1), steps=2)


def test_fp16_and_tied_weights_match_the_single_device_casts() -> None:
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2}, fxpar.Plan(zero=3, param_dtype=torch.float16),
                      (TOKENS,), steps=2)
    plan = fxpar.Plan(tp=llama_plan(), zero=3, **MIXED)  # the tied table cast twice (embedding, head)
    assert_equivalent(partial(llama, n_layers=2, tie_embeddings=True), {"dp": 2, "tp": 2}, plan, (TOKENS,),
                      steps=2)


def test_zero2_gathers_the_working_copy_in_bf16_and_matches() -> None:
    # a parameter read only through its cast is cast on its shard, crosses the wire in bf16 and stays bf16: the
    # graphs read that working copy where they cast the master weight (the same values), and hold 2 bytes per
    # parameter of it while gathered, FSDP2's
    psi = _local_elements(llama(n_layers=2), tp=2)
    pm = _compile({"dp": 2, "tp": 2}, zero=2, **MIXED)
    gathers = [r for r in pm.ledger(0) if r.axis == "dp" and r.op == "all_gather"]
    assert {r.dtype for r in gathers} == {BF16} and sum(r.bytes for r in gathers) == 2 * psi
    assert pm.memory(0).params == 4 * psi // 2 + 2 * psi
    program = pm.program(0)
    assert "_to_copy(layers_0_attn_q_weight" not in program  # the forward reads the bf16 working copy itself
    assert "# layers_0_attn_q_weight: bf16[" in program
    assert_equivalent(partial(llama, n_layers=2), {"dp": 2}, fxpar.Plan(zero=2, microbatches=2, **MIXED), (TOKENS,),
                      steps=2)


def test_zero1_bf16_working_copy_of_a_tied_weight_matches() -> None:
    # the tied table is read through two casts (embedding and head): both read the one bf16 working copy
    plan = fxpar.Plan(tp=llama_plan(), zero=1, **MIXED)
    assert_equivalent(partial(llama, n_layers=2, tie_embeddings=True), {"dp": 2, "tp": 2}, plan, (TOKENS,), steps=2)


def test_parameters_read_outside_their_modules_forward_are_cast_too() -> None:
    # nn.MultiheadAttention reads out_proj.weight without calling out_proj, and the head reads the embedding's
    # weight from the root: each is handed over in bf16 (FSDP2 casts a whole unit's parameters), not left fp32
    from fxpar.testing.user_models import attention_encoder

    tokens = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    program = fxpar.parallelize(attention_encoder(), fxpar.Mesh({"dp": 2}, fake=True), (tokens,),
                                plan=fxpar.Plan(**MIXED)).program(0)
    assert "_to_copy(layers_0_attn_out_proj_weight, dtype=torch.bfloat16)" in program
    assert "_to_copy(embed_weight, dtype=torch.bfloat16)" in program
    assert_equivalent(attention_encoder, {"dp": 2}, fxpar.Plan(zero=2, **MIXED), (tokens,), steps=2)


def test_a_float32_buffer_in_the_stream_is_cast_where_it_meets_bf16_weights() -> None:
    """A float32 position table added to bf16 embeddings made the stream float32: every rank died at its first
    step in ``mm`` (float32 input, bf16 weight), and so did the single device's casts. Each module owning
    parameters (and each repeated block, FSDP2's units) casts its floating inputs to ``param_dtype``."""
    from fxpar.testing.user_models import sinusoidal_positions

    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    pm = fxpar.parallelize(sinusoidal_positions(), fxpar.Mesh({"dp": 2}, fake=True), (tokens,),
                           plan=fxpar.Plan(**MIXED))
    matmuls = [n for n in pm.rank_program(0).forward.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    assert matmuls and all(a.meta["val"].dtype == torch.bfloat16 for n in matmuls for a in n.all_input_nodes)
    assert_equivalent(sinusoidal_positions, {"dp": 2}, fxpar.Plan(zero=3, **MIXED), (tokens,), steps=2)


@pytest.mark.parametrize("model_fn", ["tiny_resnet", "tiny_resnet_eval"])
def test_batch_norm_keeps_float32_statistics_and_arithmetic(model_fn: str) -> None:
    """BatchNorm under bf16 computes in its own float32 (input cast up, output back to bf16; apex's
    ``keep_batchnorm_fp32``): torch's kernels refused a bf16 weight beside float32 running statistics, in the rank
    program (evaluation mode) and in the single-device reference (training mode). dp=2 ZeRO-3 matches at bf16
    tolerance; the BatchNorm parameters are gathered as float32, every other weight as bf16."""
    from fxpar.testing import user_models

    images = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    model = getattr(user_models, model_fn)
    assert_equivalent(model, {"dp": 2}, fxpar.Plan(zero=3, **MIXED), (images,), steps=2)
    pm = fxpar.parallelize(model(), fxpar.Mesh({"dp": 2}, fake=True), (images,), plan=fxpar.Plan(zero=3, **MIXED))
    gathered = {r.dtype for r in pm.ledger(0) if r.op == "all_gather"}
    assert gathered == {BF16, FP32}


class _FusedAtRunTime(torch.nn.Module):
    """Blocks that build one weight from three Linears' weights at run time (``F.linear(x, cat([q, k, v]))``)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp, self.out = torch.nn.Linear(8, width), torch.nn.Linear(3 * width, 4)
        self.q, self.k, self.v = (torch.nn.Linear(width, width, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.cat([self.q.weight, self.k.weight, self.v.weight])
        return self.out(torch.relu(torch.nn.functional.linear(self.inp(x), w)))


@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.parametrize("build", ["fused", "tied_transposed_head"])
def test_a_weight_built_from_parameters_has_its_gradient_reduced_in_reduce_dtype(build: str, zero: int) -> None:
    """The gradient of a weight the forward builds (a ``cat`` of parameters, MobileBERT's ``cat([emb.weight.t(),
    extra])``) was all-reduced over dp in bf16, inside the backward, before the ``cat``'s backward sliced it into the
    parameters' gradients: FSDP2 reduces every gradient in ``reduce_dtype``. A slice keeps a partial sum partial
    now, so the reduction is the parameters' own, deferred, in fp32 (reduce-scattered under ZeRO-3)."""
    from fxpar.testing.user_models import tied_transposed_head

    model, x = ((_FusedAtRunTime(), torch.randn(8, 8)) if build == "fused" else
                (tied_transposed_head(), torch.randint(0, 32, (8, 8))))
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (x,), plan=fxpar.Plan(zero=zero, **MIXED))
    reductions = [r for r in pm.ledger(0) if r.axis == "dp" and r.op in ("all_reduce", "reduce_scatter")]
    assert reductions and all(r.dtype == FP32 for r in reductions), [(r.op, r.shape, r.dtype) for r in reductions]
    assert all(r.op == "reduce_scatter" for r in reductions) == (zero == 3)


class _PositionTable(torch.nn.Module):
    """A learned ``[1, S, h]`` position table as a bare Parameter added to the stream (a ViT's), then an MLP."""

    def __init__(self, width: int = 16, seq: int = 8) -> None:
        super().__init__()
        self.patch, self.pos = torch.nn.Linear(12, width), torch.nn.Parameter(torch.randn(1, seq, width))
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 32, bias=False), torch.nn.Linear(32, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x) + self.pos
        return h + self.down(torch.relu(self.up(self.norm(h))))


def test_zero3_casts_a_table_sequence_parallelism_shards_after_its_gather() -> None:
    """ZeRO-3 shards ``[1, S, h]`` on dim 1 (dim 0 is shorter than dp); sequence parallelism shards the stream's
    dim 1 over tp. Casting the table on its dp shard put two axes on one dim, and compiling failed inside
    ``insert_collectives`` (NotImplementedError); such a weight is now gathered, then cast."""
    x = torch.randn(4, 8, 12)
    plan = fxpar.Plan(tp={"up": "colwise", "down": "rowwise"}, sequence_parallel=True, zero=3, **MIXED)
    pm = fxpar.parallelize(_PositionTable(), fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (x,), plan=plan)
    assert "pos" not in pm._compiled.stages[0].notes["cast_gather"]
    assert any(r.op == "all_gather" and r.axis == "dp" and r.dtype == FP32 for r in pm.ledger(0))
