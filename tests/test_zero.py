"""ZeRO-1/2/3 on dp (``Plan(zero=1|2|3)``): equivalence on gloo ranks, ledger against the optimum, memory."""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch

import fxpar
from fxpar.lower import py_name
from fxpar.models.llama import llama, llama_plan
from fxpar.split import chunk_sizes
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

TOKENS = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(0))


def _hf_llama():  # noqa: ANN202
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    return partial(hf_llama, layers=2)


def _check(model_fn, axes: dict[str, int], plan: fxpar.Plan) -> None:  # noqa: ANN001
    assert_equivalent(model_fn, axes, plan, (TOKENS,), steps=3, loss_fn=next_token_loss, targets=TOKENS)


def test_zero1_hf_llama_dp4_matches_single_device() -> None:
    _check(_hf_llama(), {"dp": 4}, fxpar.Plan(zero=1))


def test_zero1_with_tp_matches_single_device() -> None:
    # tp-sharded weights are dp-sharded on their other dim; a tp-sharded 1-D bias would stay DDP
    _check(partial(llama, n_layers=2, vocab_size=128), {"dp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), zero=1))


def test_zero1_with_pipeline_stages_matches_single_device() -> None:
    # each stage shards its own parameters; gathered once per step, before the first microbatch
    _check(partial(llama, n_layers=2, vocab_size=128), {"pp": 2, "dp": 2},
           fxpar.Plan(zero=1, microbatches=2, schedule="zb-h1"))


def test_zero1_without_pm_step_through_autograd() -> None:
    # pm(x) + loss.backward(): the shards go through the autograd function, gradients come back as shards
    assert_equivalent(partial(llama, n_layers=1, vocab_size=128), {"dp": 2}, fxpar.Plan(zero=1), (TOKENS,), steps=3)


def test_zero1_ledger_is_the_optimum_and_memory_the_formula() -> None:
    # optimum per step: all-gather Psi + reduce-scatter Psi (Psi = parameter bytes), no dp all-reduce
    model = _hf_llama()()
    dp = 4
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": dp}, fake=True), (TOKENS,), plan=fxpar.Plan(zero=1))
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = [r for r in pm.ledger(1) if r.axis == "dp"]
    by_op = {op: sum(r.bytes for r in rows if r.op == op) for op in {r.op for r in rows}}
    assert by_op == {"all_gather": psi, "reduce_scatter": psi}
    assert all(r.phase == "fwd" for r in rows if r.op == "all_gather")
    # one flat all-gather and one flat reduce-scatter per block (FSDP2's groups), plus the root's parameters
    layers = model.config.num_hidden_layers
    for op in ("all_gather", "reduce_scatter"):
        assert layers <= len([r for r in rows if r.op == op]) <= layers + 2
    mem = pm.memory(1)
    assert mem.optimizer == 2 * psi // dp  # 8 Psi / N in elements of 4 bytes
    assert mem.params == psi + psi // dp and mem.grads == psi + psi // dp  # working copies + shards
    assert "def gather_params" in pm.program(1)


def test_zero1_ledger_with_tp_replicates_what_cannot_shard() -> None:
    model = llama(n_layers=2)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=llama_plan(), zero=1))
    rows = [r for r in pm.ledger(0) if r.axis == "dp"]
    gathered = sum(r.bytes for r in rows if r.op == "all_gather")
    assert gathered == sum(r.bytes for r in rows if r.op == "reduce_scatter") > 0
    local_psi = sum(p.numel() for p in model.parameters()) * 4  # every weight of the bundled Llama is 2-D or a norm
    tp_sharded = sum(p.numel() * 4 // 2 for n, p in model.named_parameters()
                     if any(k in n for k in (".q.", ".k.", ".v.", ".o.", ".gate.", ".up.", ".down.")))
    tp_local = local_psi - tp_sharded
    assert gathered == tp_local and not [r for r in rows if r.op == "all_reduce"]


ODD = {"n_layers": 2, "vocab_size": 128, "hidden": 40, "intermediate": 100}  # dp=3 divides none of these widths
ODD_TOKENS = torch.randint(0, 128, (6, 16), generator=torch.Generator().manual_seed(0))


def test_zero_shards_dims_dp_does_not_divide_as_fsdp2_does() -> None:
    """dp=3 divides no width of a power-of-two model: every parameter stayed replicated (plain data parallelism and
    its memory) behind a warning. Now each is a DTensor ``Shard`` split as ``torch.chunk`` splits it (pieces of
    ``ceil(size / 3)`` first), so every rank holds about a third, and no warning."""
    tokens = torch.randint(0, 256, (6, 16))
    model = llama(n_layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", fxpar.FxparWarning)
        pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 3}, fake=True), (tokens,), plan=fxpar.Plan(zero=3))
    params = dict(model.named_parameters())
    zero = pm._compiled.stages[0].notes["zero"]
    assert set(zero) == set(params)
    for rank in range(3):
        own = sum(p.numel() // p.shape[zero[n]] * chunk_sizes(p.shape[zero[n]], 3)[rank] for n, p in params.items())
        mem = pm.memory(rank)
        assert (mem.params, mem.grads, mem.optimizer) == (4 * own, 4 * own, 8 * own)
    # the ledger moves every parameter's padded pieces: 3 x ceil(size / 3) rows each
    padded = sum(p.numel() // p.shape[zero[n]] * 3 * -(-p.shape[zero[n]] // 3) for n, p in params.items())
    scattered = sum(r.bytes for r in pm.ledger(2) if r.op == "reduce_scatter")
    assert scattered == 4 * padded


def test_zero_with_a_batch_dp_does_not_divide_keeps_uneven_dims_replicated_and_says_so() -> None:
    """With an uneven batch (7 at dp=3) the dp pieces of a dim dp does not divide follow the batch's split
    (``torch.tensor_split``), not DTensor's: ZeRO shards such a dim only where the two agree (128 rows: 43, 43, 42
    either way; 64 rows: 22, 21, 21 against 22, 22, 20), keeps the rest replicated (pm.memory counts them) and
    says why."""
    tokens = torch.randint(0, 256, (7, 16))
    message = r"Plan\(zero=3\) keeps 11 of 21 parameters .* dp=3: .* global batch.* 'embed.weight' \(256, 64\)"
    with pytest.warns(fxpar.FxparWarning, match=message):
        pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"dp": 3}, fake=True), (tokens,), plan=fxpar.Plan(zero=3))
    replicated = pm._compiled.stages[0].notes["zero_replicated"]
    assert all(p.shape[-1] == 64 and p.shape[0] != 128 for n, p in llama(n_layers=2).named_parameters()
               if n in replicated)


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_on_dims_dp_does_not_divide_matches_single_device(zero: int) -> None:
    assert_equivalent(partial(llama, **ODD), {"dp": 3}, fxpar.Plan(zero=zero, microbatches=2 if zero == 2 else 1),
                      (ODD_TOKENS,), steps=3, loss_fn=next_token_loss, targets=ODD_TOKENS)


def test_zero2_hf_llama_dp4_microbatched_matches_single_device() -> None:
    _check(_hf_llama(), {"dp": 4}, fxpar.Plan(zero=2, microbatches=2))


def test_zero2_with_pipeline_and_tp_matches_single_device() -> None:
    _check(partial(llama, n_layers=2, vocab_size=128), {"pp": 2, "dp": 2, "tp": 2},
           fxpar.Plan(tp=llama_plan(), zero=2, microbatches=2, schedule="zb-h1"))


def test_zero2_reduce_scatters_every_microbatch_and_never_holds_whole_gradients() -> None:
    model = _hf_llama()()
    dp, m = 4, 2
    psi = sum(p.numel() * p.element_size() for p in model.parameters())
    pms = {z: fxpar.parallelize(model, fxpar.Mesh({"dp": dp}, fake=True), (TOKENS,),
                                plan=fxpar.Plan(zero=z, microbatches=m), loss_fn=next_token_loss) for z in (1, 2)}
    for z, pm in pms.items():
        rows = [r for r in pm.ledger(0) if r.axis == "dp"]
        assert sum(r.bytes for r in rows if r.op == "all_gather") == psi
        assert sum(r.bytes for r in rows if r.op == "reduce_scatter") == (psi if z == 1 else m * psi)
        assert {r.mb for r in rows if r.op == "reduce_scatter"} == ({None} if z == 1 else set(range(m)))
    one, two = pms[1].memory(0), pms[2].memory(0)
    assert two.grads == psi // dp and one.grads == psi + psi // dp  # 4 + 12/N (+ the gathered working copy)
    assert two.optimizer == one.optimizer == 2 * psi // dp
    assert two.transient >= psi  # one backward's whole gradients, reduce-scattered right away


def test_zero3_hf_llama_dp4_matches_single_device() -> None:
    _check(_hf_llama(), {"dp": 4}, fxpar.Plan(zero=3))


def test_zero3_with_tp_microbatched_matches_single_device() -> None:
    _check(partial(llama, n_layers=2, vocab_size=128), {"dp": 2, "tp": 2},
           fxpar.Plan(tp=llama_plan(), zero=3, microbatches=2))


def test_zero3_with_pipeline_stages_matches_single_device() -> None:
    # zb-h1 splits the backward into B and W: the re-gathered weights serve both halves
    _check(partial(llama, n_layers=2, vocab_size=128), {"pp": 2, "dp": 2},
           fxpar.Plan(zero=3, microbatches=2, schedule="zb-h1"))


def test_zero3_without_pm_step_through_autograd() -> None:
    assert_equivalent(partial(llama, n_layers=1, vocab_size=128), {"dp": 2}, fxpar.Plan(zero=3), (TOKENS,), steps=3)


def test_zero3_ledger_gathers_at_each_use_and_again_in_backward() -> None:
    # per step: all-gather Psi in forward, all-gather in backward of every parameter the backward reads,
    # reduce-scatter Psi per microbatch; nothing gathered is saved between forward and backward
    model = _hf_llama()()
    dp, m = 4, 2
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": dp}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(zero=3, microbatches=m), loss_fn=next_token_loss)
    params = dict(model.named_parameters())
    psi = sum(p.numel() * p.element_size() for p in params.values())
    rows = [r for r in pm.ledger(1) if r.axis == "dp"]
    fwd = [r for r in rows if r.op == "all_gather" and r.phase == "fwd"]
    bwd = [r for r in rows if r.op == "all_gather" and r.phase == "bwd"]
    layers = model.config.num_hidden_layers  # one flat all-gather per block, plus the root's parameters (FSDP2's)
    assert sum(r.bytes for r in fwd) == m * psi and m * layers <= len(fwd) <= m * (layers + 2)
    # the embedding's backward is a scatter-add of the output gradient: it never reads the table
    table = params["model.embed_tokens.weight"]
    assert sum(r.bytes for r in bwd) == m * (psi - table.numel() * table.element_size())
    assert sum(r.bytes for r in rows if r.op == "reduce_scatter") == m * psi
    assert not [r for r in rows if r.op == "all_reduce"]
    rp = pm.rank_program(1)
    assert rp.gather_params is None
    saved = {n.name: tuple(n.meta["val"].shape) for n in rp.backward.graph.nodes if n.op == "placeholder"}
    for fqn, p in params.items():  # the backward reads parameters as the stored shards (dim 0 / dp), if at all
        assert saved.get(f"saved_{py_name(fqn)}", (p.shape[0] // dp,))[0] == p.shape[0] // dp, fqn
    assert any(f"saved_{py_name(fqn)}" in saved for fqn in params)
    assert "recomputed" in pm.program(1)
    mem = pm.memory(1)
    assert (mem.params, mem.grads, mem.optimizer) == (psi // dp, psi // dp, 2 * psi // dp)  # 16 Psi / N
    largest = max(p.numel() * p.element_size() for p in params.values())
    assert mem.transient >= largest  # a gathered parameter lives inside the graph that uses it


class _ExpertsBlock(torch.nn.Module):
    """A ``Sequential`` (numbered children of its own) and a list of alike experts, in one repeated block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ff = torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                      torch.nn.Linear(4 * width, width))
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ff(x)
        return x + self.experts[0](x) + self.experts[1](x)


class _SequentialBlocks(torch.nn.Module):
    def __init__(self, width: int = 16, n: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_ExpertsBlock(width) for _ in range(n))
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sequential_blocks() -> _SequentialBlocks:
    torch.manual_seed(0)
    return _SequentialBlocks()


def test_zero3_gathers_a_sequential_block_in_one_collective() -> None:
    """FSDP2's unit is the repeated block: a block holding numbered children (a ``Sequential``'s norm and Linears, a
    list of experts) was gathered in one collective per child, 19 all-gathers for 3 blocks instead of 3 plus the
    root's."""
    pm = fxpar.parallelize(_sequential_blocks(), fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(8, 16),),
                           plan=fxpar.Plan(zero=3))
    fwd = [r for r in pm.ledger(0) if r.op == "all_gather" and r.phase == "fwd"]
    per_block = sum(p.numel() for p in _sequential_blocks().blocks[0].parameters()) * 4  # the gathered block
    assert [r.bytes for r in fwd[:3]] == [per_block] * 3
    assert len(fwd) == 3 + 1  # the head
    assert_equivalent(_sequential_blocks, {"dp": 2}, fxpar.Plan(zero=3), (torch.randn(8, 16),), steps=2)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_zero_with_tied_embeddings(zero: int) -> None:
    # found by the property suite: the tied weight is two placeholders of one stage, gathered once
    model_fn = partial(llama, n_layers=1, vocab_size=128, tie_embeddings=True)
    _check(model_fn, {"dp": 2}, fxpar.Plan(zero=zero, microbatches=2))
    assert_equivalent(model_fn, {"dp": 2}, fxpar.Plan(zero=zero), (TOKENS,), steps=2)


def _forward_gathers(model: torch.nn.Module, x: torch.Tensor) -> int:
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (x,), plan=fxpar.Plan(zero=3))
    return sum(r.op == "all_gather" and r.phase == "fwd" for r in pm.ledger(0))


def test_zero3_gathers_a_blocks_frozen_weights_and_nested_modules_with_the_block() -> None:
    """FSDP2's one group per block holds its frozen weights and its nested modules too. fxpar's groups were cut from
    the gradients, so a frozen weight was gathered alone (10 forward all-gathers for the 5 of a trainable model),
    and a ResNet block's shortcut ``Sequential`` (``layer2.0.shortcut.0``: its stage's two blocks differ) was a
    group of its own."""
    from fxpar.testing.user_models import tiny_resnet

    tokens = TOKENS[:4]
    trainable = _forward_gathers(llama(n_layers=2, vocab_size=128), tokens)
    frozen = llama(n_layers=2, vocab_size=128)
    frozen.layers[0].requires_grad_(False)
    frozen.layers[1].attn.q.weight.requires_grad_(False)
    assert _forward_gathers(frozen, tokens) == trainable
    # four residual blocks, one all-gather each, and the root's stem conv, stem BatchNorm and head
    assert _forward_gathers(tiny_resnet(), torch.randn(4, 3, 8, 8)) == 4 + 3
