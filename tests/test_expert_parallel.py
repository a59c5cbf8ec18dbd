"""Expert parallelism: an ``ep`` mesh axis shards HF experts modules and, with dp, the batch (issue 10).

On an ep mesh each experts module is one op (``fxpar::moe_experts``) whose lowering routes every (token, expert)
pair to its expert's rank with all-to-alls whose split sizes are the run-time counts. Checked here: the op computes
HF's experts (forward and gradients), nested dp x ep batch redistribution, the rank program and the ledger against
the formula, equivalence with the single device on gloo (ep=2, dp=2 x ep=2, a 3D dp x ep x tp mesh, Qwen2-MoE,
routing that leaves experts and ranks without tokens, microbatches), and bad input.
"""

from __future__ import annotations

import pytest
import torch
from fxpar.passes.insert_collectives import steps_between
from torch.distributed.tensor import Partial, Replicate, Shard

import fxpar
from fxpar.models import hf_families
from fxpar.moe import experts_forward
from fxpar.testing import assert_equivalent

E, K = 4, 2  # hf_families' MoE configs: 4 experts, top-2


def _experts(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = getattr(hf_families, family)()
    return next(m for p, m in model.named_modules() if p.endswith("mlp.experts"))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_moe_op_computes_hf_experts(family: str) -> None:
    """``moe_experts`` and its backward against the HF module's own forward and autograd (fp32: sums over at most
    ``I`` terms in another order, so 1e-6 relative)."""
    experts = _experts(family)
    g = torch.Generator().manual_seed(1)
    tokens, hidden = 24, experts.hidden_dim
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    weights, index = torch.topk(torch.softmax(torch.randn(tokens, E, generator=g), -1), K)
    weights.requires_grad_()
    index[0] = torch.tensor([3, 2])  # experts 0 and 1 keep tokens; every expert gets at least one here
    grad = torch.randn(tokens, hidden, generator=g)
    params = (x, weights, experts.gate_up_proj, experts.down_proj)
    want = experts(x, index, weights)
    want_grads = torch.autograd.grad(want, params, grad)
    got = experts_forward(experts)(x, index, weights)
    got_grads = torch.autograd.grad(got, params, grad)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_experts_without_tokens_get_zero_gradients() -> None:
    experts = _experts("mixtral")
    x = torch.randn(6, experts.hidden_dim)
    index = torch.tensor([[0, 1]] * 6)
    weights = torch.full((6, 2), 0.5, requires_grad=True)
    out = experts_forward(experts)(x, index, weights)
    up, down = torch.autograd.grad(out.sum(), (experts.gate_up_proj, experts.down_proj))
    assert up[2:].abs().max() == 0 and down[2:].abs().max() == 0 and up[:2].abs().max() > 0


def test_nested_batch_redistribution() -> None:
    """The batch over dp then ep: only the inner axis changes alone; gathers run innermost first."""
    axes = ("dp", "ep")
    s0, r = Shard(0), Replicate()
    (step,) = steps_between(axes, (s0, s0), (s0, r))
    assert (step.op, step.axis) == ("all_gather", "ep")
    assert [(st.op, st.axis) for st in steps_between(axes, (s0, s0), (r, r))] == [("all_gather", "ep"),
                                                                                  ("all_gather", "dp")]
    assert [(st.op, st.axis) for st in steps_between(axes, (r, r), (s0, s0))] == [("slice", "dp"), ("slice", "ep")]
    with pytest.raises(NotImplementedError, match="an outer one changes"):
        steps_between(axes, (s0, s0), (r, s0))
    assert [(st.op, st.axis) for st in steps_between(axes, (Partial(), Partial()), (r, r))] == [
        ("all_reduce", "dp"), ("all_reduce", "ep")]


def _compile(axes: dict[str, int], batch: int = 4, family: str = "mixtral", plan: object = None
             ) -> fxpar.ParallelModule:
    ids = torch.randint(3, hf_families.VOCAB, (batch, hf_families.SEQ), generator=torch.Generator().manual_seed(0))
    loss_fn = _token_loss if "pp" in axes else None
    return fxpar.parallelize(getattr(hf_families, family)(), fxpar.Mesh(axes, fake=True), (ids,), plan,
                             loss_fn=loss_fn)


@pytest.mark.parametrize("axes", [{"ep": 2}, {"dp": 2, "ep": 2}, {"ep": 4}])
def test_ledger_is_the_all_to_all_formula(axes: dict[str, int]) -> None:
    """Per MoE layer: forward all-to-alls of the counts (``E`` int64), the dispatched rows and the expert outputs,
    backward two of rows; each rows transfer is the rank's ``T * k`` rows of ``H`` floats at uniform routing
    (the real split is data-dependent; the total a rank sends is always ``T * k`` rows). No token is gathered."""
    batch = 8
    pm = _compile(axes, batch)
    tokens = batch * hf_families.SEQ // (axes.get("dp", 1) * axes["ep"])
    rows = tokens * K * hf_families.HIDDEN * 4
    ledger = pm.ledger(0)
    a2a = [(r.phase, r.bytes) for r in ledger if r.op == "all_to_all"]
    per_layer = [("fwd", E * 8), ("fwd", rows), ("fwd", rows), ("bwd", rows), ("bwd", rows)]
    assert sorted(a2a) == sorted(per_layer * hf_families.LAYERS)
    assert all(r.axis == "ep" for r in ledger if r.op == "all_to_all")
    assert not [r for r in ledger if r.op == "all_gather"]


def test_gradients_reduce_over_the_batch_axes() -> None:
    """Non-expert gradients are all-reduced over dp and ep (both shard the batch); each rank's expert gradients
    come back whole for its own experts from the all-to-alls and are all-reduced over dp only. Both reductions are
    bucketed and deferred to once per step, as dp's alone are."""
    pm = _compile({"dp": 2, "ep": 2})
    prog = pm._prog
    params = dict(prog.signature.params)
    expert = [f for f in params if "experts" in f]
    assert len(expert) == 2 * hf_families.LAYERS
    for fqn, name in params.items():
        assert prog.placements[name] == ((Replicate(), Shard(0)) if fqn in expert else (Replicate(), Replicate()))
    reduced = [r for r in pm.ledger(0) if r.op == "all_reduce"]
    shape_of = {fqn: tuple(prog.node(name).meta["val"].shape) for fqn, name in params.items()}
    expert_bytes = sum(4 * torch.Size(shape_of[f]).numel() // 2 for f in expert)
    other_bytes = sum(4 * torch.Size(s).numel() for f, s in shape_of.items() if f not in expert)
    assert sum(r.bytes for r in reduced if r.axis == "dp") == expert_bytes + other_bytes
    assert sum(r.bytes for r in reduced if r.axis == "ep") == other_bytes
    assert [r.axis for r in reduced] == ["dp", "ep"]  # one bucket per axis (the model is far below bucket_mb)


def test_rank_program_shows_the_route() -> None:
    pm = _compile({"ep": 2})
    text = pm.program(1)
    assert "fxpar.moe_route(" in text and "comm.all_to_all(" in text and "comm.rank_sizes(" in text
    assert "f32[2,256,64]   ep:S(0)" in text  # rank 1 holds 2 of the 4 experts' gate_up_proj


# --- equivalence on gloo ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,axes", [
    ("mixtral", {"ep": 2}),
    ("mixtral", {"dp": 2, "ep": 2}),
    ("qwen2_moe", {"ep": 2}),  # a shared expert beside the routed ones, and a sigmoid-gated shared output
    ("qwen3_moe", {"ep": 2}),
])
def test_expert_parallel_matches_single_device(family: str, axes: dict[str, int]) -> None:
    assert_equivalent(getattr(hf_families, family), axes, None, hf_families.inputs(family, seed=1))


def test_recompute_reissues_the_route() -> None:
    """Full recompute reruns each MoE layer's forward in the backward, all-to-alls included (3 more per layer)."""
    rows = [r for r in _compile({"ep": 2}, plan=fxpar.Plan(recompute="full")).ledger(0) if r.op == "all_to_all"]
    assert sum(r.phase == "bwd" for r in rows) == 5 * hf_families.LAYERS
    assert_equivalent(hf_families.mixtral, {"dp": 2, "ep": 2}, fxpar.Plan(recompute="full"),
                      hf_families.inputs("mixtral", seed=1))


def test_dp_ep_tp_matches_single_device() -> None:
    """The 3D case: batch over dp x ep, experts over ep, attention heads over tp with HF's own plan."""
    assert_equivalent(hf_families.mixtral, {"dp": 2, "ep": 2, "tp": 2}, fxpar.Plan(tp="hf"),
                      hf_families.inputs("mixtral", seed=1))


def test_routing_that_leaves_experts_and_ranks_empty() -> None:
    """Every token the same (id 36): layer 0 routes every row to experts 0 and 1, layer 1 to experts 2 and 3, so
    at ep=2 one rank's experts receive all rows and the other's none (zero split sizes, zero expert gradients)."""
    ids = torch.full((4, hf_families.SEQ), 36)
    assert _routed_experts(ids) == [{0, 1}, {2, 3}]  # the premise, on the model the check builds (seed 0)
    assert_equivalent(hf_families.mixtral, {"ep": 2}, None, (ids,))


def _routed_experts(ids: torch.Tensor) -> list[set[int]]:
    torch.manual_seed(0)
    model = hf_families.mixtral()
    routed: list[set[int]] = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_hook(lambda m, args, out: routed.append(set(args[1].flatten().tolist())))
    model(ids)
    return routed


def test_microbatched_step_matches_single_device() -> None:
    ids = torch.randint(3, hf_families.VOCAB, (8, hf_families.SEQ), generator=torch.Generator().manual_seed(2))
    targets = torch.randint(3, hf_families.VOCAB, (8, hf_families.SEQ), generator=torch.Generator().manual_seed(3))
    assert_equivalent(hf_families.mixtral, {"dp": 2, "ep": 2}, fxpar.Plan(microbatches=2), (ids,),
                      targets=targets, loss_fn=_token_loss)


def _token_loss(out: object, targets: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out[0]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


# --- bad input ----------------------------------------------------------------------------------------------------

def test_batch_that_dp_ep_does_not_divide() -> None:
    with pytest.raises(ValueError, match=r"dp x ep = 4 ranks .* batch of 6 is not a multiple of 4"):
        _compile({"dp": 2, "ep": 2}, batch=6)


def test_ep_that_does_not_divide_the_experts() -> None:
    with pytest.raises(fxpar.PlanError, match="ep=3 does not divide the 4 experts of 'model.layers.0.mlp.experts'"):
        _compile({"ep": 3}, batch=6)


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_with_ep_matches_single_device(zero: int) -> None:
    # ZeRO shards dense and expert parameters over dp; a dense gradient is reduce-scattered over dp, then its shard
    # all-reduced over ep (the ep ranks hold the same dense parameters and saw other tokens)
    pm = _compile({"dp": 2, "ep": 2}, plan=fxpar.Plan(zero=zero))
    assert {r.op for r in pm.ledger(0) if r.axis == "ep"} == {"all_to_all", "all_reduce"}
    assert_equivalent(hf_families.mixtral, {"dp": 2, "ep": 2}, fxpar.Plan(zero=zero),
                      hf_families.inputs("mixtral", seed=1), steps=2)


def test_pipeline_with_ep_matches_single_device() -> None:
    # each stage routes its own MoE layers over its ep group; the boundary activation is sent over pp
    ids = hf_families.inputs("mixtral", seed=1)[0]
    pm = _compile({"pp": 2, "ep": 2}, plan=fxpar.Plan(stages=2, microbatches=2))
    assert {(r.op, r.axis) for r in pm.ledger(0)} >= {("send", "pp"), ("all_to_all", "ep")}
    assert_equivalent(hf_families.mixtral, {"pp": 2, "ep": 2}, fxpar.Plan(stages=2, microbatches=2), (ids,),
                      steps=2, loss_fn=_token_loss, targets=ids)


def test_pipeline_with_dp_and_ep_matches_single_device() -> None:
    # DeepSeek-V3's composition at toy size: pp x dp x ep with ZeRO-1 (8 gloo ranks)
    ids = hf_families.inputs("mixtral", seed=1)[0]
    ids = torch.cat([ids, ids.flip(0)])  # a batch dp x ep x microbatches divides
    plan = fxpar.Plan(stages=2, microbatches=2, zero=1)
    assert_equivalent(hf_families.mixtral, {"pp": 2, "dp": 2, "ep": 2}, plan, (ids,), steps=2, loss_fn=_token_loss,
                      targets=ids)


@pytest.mark.parametrize("axes,plan,match", [
    ({"cp": 2, "ep": 2}, None, "ep axis with 'cp'"),
    ({"dp": 2, "ep": 2}, fxpar.Plan(fp8="tensorwise"), r"Plan\(fp8='tensorwise'\) with an ep axis"),
    ({"ep": 2}, fxpar.Plan(compile=True), r"Plan\(compile=True\) with an ep axis"),  # crashed in Inductor at step 1
])
def test_what_ep_does_not_compose_with_yet(axes: dict[str, int], plan: object, match: str) -> None:
    with pytest.raises(fxpar.PlanError, match=match):
        _compile(axes, plan=plan)


def test_experts_layout_ep_cannot_route() -> None:
    """A model whose experts module has another weight layout is refused by name, not silently replicated."""
    model = hf_families.mixtral()
    experts = model.model.layers[0].mlp.experts
    experts.has_bias = True
    ids = torch.randint(3, hf_families.VOCAB, (4, hf_families.SEQ))
    with pytest.raises(fxpar.PlanError, match="'model.layers.0.mlp.experts' .* is not one"):
        fxpar.parallelize(model, fxpar.Mesh({"ep": 2}, fake=True), (ids,))
