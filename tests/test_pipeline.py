"""Pipeline parallelism: stage split, schedules, 3D meshes, the step ledger and the collective-order proof.

Equivalence cases run ``pm.step`` on real gloo ranks against the single-device model: the loss of every step,
every gradient and every parameter after 3 AdamW steps (fp32: rtol 1e-5 with an atol floor of 1e-6 x the
tensor's magnitude at step 0, since microbatching only changes the summation order; see
``fxpar.testing.tolerance``). Ledger, verify and bad-input cases compile on fake meshes.
"""

from __future__ import annotations

import json
import re
import time
from functools import partial

import pytest
import torch
from fxpar.schedules import Action, costs_from_trace, make_schedule

import fxpar
from fxpar.models.llama import llama, llama_plan
from fxpar.models.mlp import mlp
from fxpar.testing import assert_equivalent, default_pool, error_models, probes
from fxpar.testing.error_models import next_token_loss
from fxpar.testing.launch import RankFailure, run_ranks
from fxpar.testing.loss_models import mean_square
from fxpar.testing.state_models import spare_state_stack
from fxpar.testing.state_probes import state_keys_after_a_step

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


def _tokens(batch: int = 8, seq: int = 16, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _check(model_fn, mesh: dict[str, int], plan: fxpar.Plan, tokens: torch.Tensor) -> None:  # noqa: ANN001
    reports = assert_equivalent(model_fn, mesh, plan, (tokens,), loss_fn=next_token_loss, targets=tokens)
    assert all(len(r.losses) == 3 and r.compared > 0 for r in reports)


# 1. equivalence on real gloo ranks ---------------------------------------------------------------------


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pp2_each_schedule_matches_single_device(schedule: str) -> None:
    stages = 4 if schedule == "interleaved-1f1b" else 2  # interleaved: v = 2 stages per pp rank
    _check(partial(llama, n_layers=4), {"pp": 2}, fxpar.Plan(stages=stages, schedule=schedule, microbatches=4),
           _tokens())


def test_pp2_dp2_tp2_matches_single_device() -> None:
    _check(partial(llama, n_layers=2), {"pp": 2, "dp": 2, "tp": 2},
           fxpar.Plan(tp=llama_plan(), schedule="1f1b", microbatches=2), _tokens())


def test_pp_with_sequence_parallel_sends_sequence_pieces() -> None:
    """Under SP a stage boundary is sharded on the sequence over tp (Megatron's scatter-gather): each tp rank
    sends its piece, and the pipeline still matches the single device."""
    plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=True, microbatches=2)
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"pp": 2, "tp": 2}, fake=True), (_tokens(),), plan,
                           loss_fn=next_token_loss)
    sends = [r for r in pm.ledger(0) if r.op == "send"]
    assert sends and all(r.shape == (4, 8, 64) for r in sends)  # microbatch 4, sequence 16 over tp=2, hidden 64
    _check(partial(llama, n_layers=2), {"pp": 2, "tp": 2}, plan, _tokens())


def test_pp_cp_tp_with_sequence_parallel_matches_single_device() -> None:
    plan = fxpar.Plan(tp=llama_plan(), sequence_parallel=True, microbatches=2)
    _check(partial(llama, n_layers=2), {"pp": 2, "cp": 2, "tp": 2}, plan, _tokens(batch=4))


def test_split_by_module_path_with_dp() -> None:
    # an MLP has no repeated blocks: name the module that starts stage 1
    torch.manual_seed(1)
    assert_equivalent(mlp, {"pp": 2, "dp": 2}, fxpar.Plan(stages=["down"], microbatches=2), (torch.randn(8, 32),))


def test_hf_llama_pipeline_matches_single_device() -> None:
    pytest.importorskip("transformers")
    from fxpar.models.hf import hf_llama

    _check(partial(hf_llama, layers=4), {"pp": 2}, fxpar.Plan(stages=["model.layers.2"], schedule="zb-h1",
                                                               microbatches=2), _tokens(vocab=128))


def test_hf_qwen2_pp2_tp2_with_its_kv_cache_default_matches_single_device() -> None:
    # Qwen2 keeps use_cache=True: fxpar compiles the training step without the KV cache output
    pytest.importorskip("transformers")
    tp = {"model.layers.*.self_attn.[qkv]_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise",
          "model.layers.*.mlp.[gu]*_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise"}
    _check(error_models.qwen2, {"pp": 2, "tp": 2}, fxpar.Plan(tp=tp, stages=["model.layers.2"], schedule="1f1b",
                                                             microbatches=2), _tokens(vocab=128))


def test_nn_sequential_split_by_count_and_by_path() -> None:
    # parameter names that are not identifiers (0.weight) and blocks that are a Sequential's children
    x = torch.randn(8, 16)
    assert_equivalent(error_models.sequential, {"pp": 2}, fxpar.Plan(stages=2, microbatches=2), (x,), steps=2)
    assert_equivalent(error_models.sequential, {"pp": 2, "dp": 2},
                      fxpar.Plan(stages=["4"], schedule="zb-h1", microbatches=2), (x,), steps=2)


def test_gpt2_tied_embeddings_across_stages() -> None:
    # wte is used by stage 0 (embedding) and stage 1 (lm_head): both hold it, its gradient is summed over pp
    pytest.importorskip("transformers")
    _check(error_models.gpt2, {"pp": 2}, fxpar.Plan(microbatches=2), _tokens(vocab=128))
    pm = fxpar.parallelize(error_models.gpt2(), fxpar.Mesh({"pp": 2}, fake=True), (_tokens(vocab=128),),
                           plan=fxpar.Plan(microbatches=2), loss_fn=next_token_loss)
    ties = [r for r in pm.ledger(0) if r.axis == "pp" and r.op == "all_reduce"]
    assert [r.shape for r in ties] == [(128, 64)] and ties == [r for r in pm.ledger(1) if r.op == "all_reduce"]


@pytest.mark.parametrize("zero", [1, 3])
def test_a_tied_weights_ledger_row_is_the_dp_shard_the_step_sums(zero: int) -> None:
    """Under ZeRO the tied-weight sum over pp runs on this rank's dp shard of the gradient: the ledger listed the
    whole table (twice the bytes that ran, and twice what ``pm.estimate`` priced)."""
    pytest.importorskip("transformers")
    pm = fxpar.parallelize(error_models.gpt2(), fxpar.Mesh({"pp": 2, "dp": 2}, fake=True), (_tokens(vocab=128),),
                           plan=fxpar.Plan(microbatches=2, zero=zero), loss_fn=next_token_loss)
    for rank in range(4):
        ties = [r for r in pm.ledger(rank) if r.axis == "pp" and r.op == "all_reduce"]
        assert [(r.shape, r.bytes) for r in ties] == [((64, 64), 64 * 64 * 4)]


def test_traced_step_writes_every_ranks_actions(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "step.json")
    results = default_pool().run(error_models.pipeline_step_with_trace, 4, path, timeout=300)
    assert len({round(r["loss"], 6) for r in results}) == 1  # the same global loss on every rank
    events = json.load(open(path))["traceEvents"]
    assert {e["tid"] for e in events} == {0, 1, 2, 3}
    assert {e["name"] for e in events if e["tid"] == 0} >= {"F0.0", "F0.1", "B0.0", "B0.1", "SEND_F0.0>1"}
    assert all(e["dur"] >= 0 for e in events)


# 2. the ledger: exactly what must cross a boundary ------------------------------------------------------


def test_ledger_two_m_transfers_per_boundary_of_the_hidden_state() -> None:
    b, s, h, m, dp, pp = 16, 16, 64, 4, 2, 4
    mesh = fxpar.Mesh({"pp": pp, "dp": dp, "tp": 2}, fake=True)
    pm = fxpar.parallelize(llama(n_layers=4, hidden=h), mesh, (_tokens(b, s),),
                           plan=fxpar.Plan(tp=llama_plan(), microbatches=m), loss_fn=next_token_loss)
    rows = [r for rank in range(0, mesh.size, mesh.size // pp) for r in pm.ledger(rank)]  # dp=0, tp=0 of each stage
    for boundary in range(pp - 1):
        fwd = [r for r in rows if r.op == "send" and r.phase == "fwd" and r.stage == boundary]
        bwd = [r for r in rows if r.op == "send" and r.phase == "bwd" and r.stage == boundary + 1]
        assert len(fwd) + len(bwd) == 2 * m
        assert {r.bytes for r in fwd + bwd} == {(b // dp // m) * s * h * 4}
        assert sorted(r.mb for r in fwd) == sorted(r.mb for r in bwd) == list(range(m))
    recvs = [r for r in rows if r.op == "recv"]
    assert len(recvs) == len([r for r in rows if r.op == "send"])  # every send has its receive
    # rotary tables and the causal mask are recomputed per stage: only the hidden state crosses
    assert all(r.shape == (b // dp // m, s, h) for r in rows if r.axis == "pp" and r.op in ("send", "recv"))


@pytest.mark.parametrize("overlap", [False, True])
def test_dp_gradients_are_reduced_once_per_step_not_per_microbatch(overlap: bool) -> None:
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"pp": 2, "dp": 2}, fake=True), (_tokens(),),
                           plan=fxpar.Plan(microbatches=4, overlap=overlap), loss_fn=next_token_loss)
    for rank in (0, 2):
        dp_rows = [r for r in pm.ledger(rank) if r.axis == "dp"]
        stages = [pm._compiled.stages[s] for s in pm.stages_of(rank)]
        params = [st.node(name).meta["val"] for st in stages for _, name in st.signature.params]
        nbytes = sum(p.numel() * p.element_size() for p in params)
        assert all(r.mb is None and r.op == "all_reduce" for r in dp_rows)
        assert len(dp_rows) == (1 if overlap else len(params))  # overlap: one 25 MB bucket holds the stage
        assert sum(r.bytes for r in dp_rows) == nbytes


@pytest.mark.parametrize("mesh_axes, plan", [
    ({"pp": 2, "dp": 2}, fxpar.Plan(schedule="1f1b", microbatches=2, zero=2)),
    ({"pp": 2, "tp": 2}, fxpar.Plan(tp=llama_plan(), schedule="gpipe", microbatches=2)),
], ids=["1f1b_dp2_zero2", "gpipe_tp2"])
def test_a_sent_input_gradient_leaves_before_w_with_the_whole_backwards_gradients(mesh_axes, plan) -> None:  # noqa: ANN001
    """The last stage's backward runs as B, SEND_B, W (then ZeRO-2's reduce); FXPAR_BACKWARD_HALVES=0 keeps it
    whole. Both run every node once, so losses and gradients are equal to the bit (gloo, 4 ranks)."""
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    results = default_pool().run(probes.backward_halves_against_whole, 4, mesh_axes, plan, tokens, timeout=300)
    for rank, r in enumerate(results):
        last_stage = rank >= 2  # pp is the first mesh axis
        halves, whole = r["kinds_halves"], r["kinds_whole"]
        assert "W" not in whole and ("W" in halves) == last_stage, (rank, halves)
        if last_stage:
            b = halves.index("B")
            assert halves[b:b + 3] == ["B", "SEND_B", "W"], halves
        assert r["loss_diff"] == 0.0 and r["grad_diff"] == 0.0, (rank, r)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_recomputing_plan_keeps_a_sent_backward_whole(recompute: str) -> None:
    """Under 1F1B the last stage's backward runs as B, SEND_B, W only without recompute: W reads every weight
    gradient's input from B, which is most of what recompute frees (the fused backward recomputes a block, runs
    its backward and frees it). With recompute the backward stays whole and ``pm.memory`` holds what the same
    plan holds with ``FXPAR_BACKWARD_HALVES=0``; without recompute the halves hold more (fake mesh)."""
    from fxpar.compiled import HALVES_ENV

    def compiled(plan: fxpar.Plan, halves: str = "1") -> fxpar.ParallelModule:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(HALVES_ENV, halves)
            return fxpar.parallelize(llama(n_layers=4), fxpar.Mesh({"pp": 2}, fake=True), (_tokens(),),
                                     plan=plan, loss_fn=next_token_loss)

    plan = fxpar.Plan(schedule="1f1b", microbatches=4, recompute=recompute)
    pm, whole = compiled(plan), compiled(plan, halves="0")
    assert "W" not in [e.kind for e in pm.step_events(1)]
    assert pm.memory(1).activations == whole.memory(1).activations
    plain = fxpar.Plan(schedule="1f1b", microbatches=4)
    assert "W" in [e.kind for e in compiled(plain).step_events(1)]
    assert compiled(plain).memory(1).activations > compiled(plain, halves="0").memory(1).activations


def test_b_hands_w_tensors_not_the_tuples_of_multi_output_nodes() -> None:
    """A LayerNorm's backward returns (input, weight, bias) gradients: B keeps the input gradient and hands W the
    other items one by one. Handing W the tuple ran eagerly, but Inductor (``compile=True``) compiles graphs that
    return tensors only and refused the B graph."""
    from fxpar.testing.user_models import residual_stack

    x = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(residual_stack(), fxpar.Mesh({"pp": 2}, fake=True), (x,),
                           plan=fxpar.Plan(stages=2, microbatches=2), loss_fn=lambda out, y: out.square().mean(),
                           example_targets=x[:, :5])
    b = pm._compiled.stage_graph(1, 1, "backward_b")
    assert "native_layer_norm_backward" in b.code
    assert all(isinstance(o.meta["val"], torch.Tensor) for o in b.graph.output_node().args[0])


def test_a_step_holds_only_the_boundary_tensors_in_flight() -> None:
    """1F1B on pp=2 with 4 microbatches: the last stage holds one logits gradient at a time (not one per microbatch
    until the step ends), and stage 0 awaits each forward send when its gradient comes back, so it holds the two
    sends of its warm-up, not all four (a hidden state each). The last stage awaits each backward send once a
    later forward from stage 0 proves it arrived (``fxpar.schedules.arrivals``): two at most, not all four."""
    tokens = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(0))
    plan = fxpar.Plan(schedule="1f1b", microbatches=4)
    held = default_pool().run(probes.held_during_step, 2, {"pp": 2}, plan, tokens, timeout=300)
    assert held == [{"output_grads": 0, "forward_sends": 2, "backward_sends": 0},
                    {"output_grads": 1, "forward_sends": 0, "backward_sends": 2}]


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b", "zb-h1"])
def test_memory_held_by_boundary_sends_does_not_grow_with_microbatches(schedule: str) -> None:
    """A backward send was held until the step's end, so a pipeline rank's activations grew with the microbatches
    (on Megatron-LM's 1T layout: 512 microbatches x 2 stages x 105 MB, 100 GiB of a rank's 139). Each send is now
    awaited where a receive proves it arrived: at the same microbatch size, 16 microbatches hold what 4 do."""
    stages = 4 if schedule == "interleaved-1f1b" else 2
    held = []
    for m in (4, 16):
        tokens = torch.randint(0, 256, (2 * m, 16), generator=torch.Generator().manual_seed(0))
        pm = fxpar.parallelize(llama(n_layers=4), fxpar.Mesh({"pp": 2}, fake=True), (tokens,),
                               plan=fxpar.Plan(stages=stages, schedule=schedule, microbatches=m),
                               loss_fn=next_token_loss)
        held.append([pm.memory(rank).activations for rank in (0, 1)])
    assert held[0] == held[1]


def test_int_stages_are_cost_balanced_and_shown_in_the_plan() -> None:
    pm = fxpar.parallelize(llama(n_layers=8), fxpar.Mesh({"pp": 4}, fake=True), (_tokens(),),
                           plan=fxpar.Plan(stages=4, microbatches=4), loss_fn=next_token_loss)
    assert pm.plan.notes["stage starts"] == "layers.2, layers.4, layers.6"
    assert "stage costs" in str(pm.plan)
    text = pm.program(1)
    assert "def forward_stage1(" in text and "# recv" in text and "next stage: rank 2" in text


# 3. the collective-order proof --------------------------------------------------------------------------


def test_verify_on_a_large_fake_mesh_is_fast() -> None:
    mesh = fxpar.Mesh({"pp": 4, "dp": 32, "tp": 8}, fake=True)  # 1,024 ranks
    pm = fxpar.parallelize(llama(n_layers=8), mesh, (_tokens(128, 16),),
                           plan=fxpar.Plan(tp=llama_plan(), stages=8, schedule="interleaved-1f1b", microbatches=4),
                           loss_fn=next_token_loss)
    start = time.perf_counter()
    fxpar.verify(pm)
    assert time.perf_counter() - start < 30


def test_verify_catches_two_swapped_actions() -> None:
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"pp": 2}, fake=True), (_tokens(),),
                           plan=fxpar.Plan(schedule="1f1b", microbatches=4), loss_fn=next_token_loss)
    actions = list(pm.schedule.actions[0])
    first_recv = next(i for i, a in enumerate(actions) if a.kind == "RECV_B")
    actions[0], actions[first_recv] = actions[first_recv], actions[0]  # wait for a gradient before any forward
    with pytest.raises(fxpar.VerifyError, match=r"rank 0"):
        fxpar.verify(pm, actions={0: actions})


def test_verify_catches_a_mismatched_collective_order() -> None:
    pm = fxpar.parallelize(mlp(), fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(8, 32),),
                           plan=fxpar.Plan(overlap=False))  # overlap moves the reduction into the backward
    rp = pm.rank_program(1)
    reduce = rp.reduce_grads.graph
    collectives = [n for n in reduce.nodes if n.name.endswith("_allreduce")]
    last = collectives[-1]
    collectives[0].prepend(last)  # rank 1 reduces its last gradient first
    with pytest.raises(fxpar.VerifyError, match=r"collective mismatch in group \[0, 1\]: rank 0 issues all_reduce .*"
                       r"\(step 3: stage 0 reduce_grads\); rank 1 issues"):
        fxpar.verify(pm, ranks="all")


def test_verify_catches_receives_out_of_order() -> None:
    pm = fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"pp": 2}, fake=True), (_tokens(),),
                           plan=fxpar.Plan(microbatches=2), loss_fn=next_token_loss)
    bad = [Action("RECV_F", 0, 1, peer=0) if a == Action("RECV_F", 0, 0, peer=0) else
           Action("RECV_F", 0, 0, peer=0) if a == Action("RECV_F", 0, 1, peer=0) else a for a in pm.schedule.actions[1]]
    with pytest.raises(fxpar.VerifyError, match=r"rank 1's action list is not runnable"):
        fxpar.verify(pm, actions={1: bad})


# 4. bad input ----------------------------------------------------------------------------------------


def _compile(plan: fxpar.Plan, mesh: dict[str, int], model: torch.nn.Module | None = None, **kw: object):  # noqa: ANN202
    kw.setdefault("loss_fn", next_token_loss)
    return fxpar.parallelize(model or llama(n_layers=4), fxpar.Mesh(mesh, fake=True), (_tokens(),), plan=plan, **kw)


def test_stages_not_a_multiple_of_pp() -> None:
    with pytest.raises(fxpar.PlanError, match=r"stages=3 gives 3 stages, not a multiple of pp=2"):
        _compile(fxpar.Plan(stages=3), {"pp": 2})


def test_split_path_that_matches_no_module() -> None:
    with pytest.raises(fxpar.PlanError, match=r"'layer.2' matches no module of Llama; did you mean: layers.2"):
        _compile(fxpar.Plan(stages=["layer.2"]), {"pp": 2})


@pytest.mark.parametrize(("stages", "pp", "message"), [
    # a stage holding nothing compiled; the user's optimizer then failed on an empty parameter list
    (["embed"], 2, r"stage 0 computes nothing: the first split path 'embed' is where the model's computation begins"),
    (["layers.1", "layers.1", "layers.3"], 4, r"'layers.1' is listed more than once"),
])
def test_split_paths_that_leave_a_stage_empty(stages: list[str], pp: int, message: str) -> None:
    with pytest.raises(fxpar.PlanError, match=message):
        _compile(fxpar.Plan(stages=stages), {"pp": pp})


def test_microbatches_not_dividing_the_local_batch() -> None:
    with pytest.raises(fxpar.PlanError, match=r"microbatches=3 does not divide the local batch: .* 4 per rank"):
        _compile(fxpar.Plan(microbatches=3), {"pp": 2, "dp": 2})


def test_pp_axis_without_loss_fn() -> None:
    with pytest.raises(fxpar.PlanError, match=r"'pp' axis needs loss_fn"):
        _compile(fxpar.Plan(), {"pp": 2}, loss_fn=None)


def test_more_stages_than_blocks() -> None:
    with pytest.raises(fxpar.PlanError, match=r"stages=6 is more than the 4 splittable blocks of Llama"):
        _compile(fxpar.Plan(stages=6), {"pp": 2})


def test_a_schedule_that_cannot_run_the_layout_is_a_plan_error() -> None:
    with pytest.raises(fxpar.PlanError, match=r"schedule '1f1b' needs one stage per rank .* use 'interleaved-1f1b'"):
        _compile(fxpar.Plan(stages=4, schedule="1f1b", microbatches=4), {"pp": 2})
    with pytest.raises(fxpar.PlanError, match=r"'interleaved-1f1b' needs microbatches to be a multiple of pp=2"):
        _compile(fxpar.Plan(stages=4, schedule="interleaved-1f1b", microbatches=1), {"pp": 2})


def test_unknown_schedule_suggests_a_name() -> None:
    with pytest.raises(fxpar.PlanError, match=r"unknown schedule '1F1B'.*did you mean '1f1b'"):
        _compile(fxpar.Plan(schedule="1F1B"), {"pp": 2})
    with pytest.raises(fxpar.PlanError, match=r"unknown schedule None; choose one of"):  # not a crash in difflib
        _compile(fxpar.Plan(schedule=None), {"pp": 2})


def test_dead_rank_mid_schedule_fails_the_others_within_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(error_models.die_mid_schedule, 2, 1, timeout=90, collective_timeout=10)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert elapsed < 60, f"took {elapsed:.1f}s to report a dead rank"
    assert 1 in info.value.ranks and "step completed" not in msg, msg
    assert 0 in info.value.ranks or re.search(r"ranks \[0\] were terminated", msg), msg


def test_simulate_with_cost_model_and_measured_costs(tmp_path) -> None:  # noqa: ANN001
    pm = fxpar.parallelize(llama(n_layers=4), fxpar.Mesh({"pp": 2}, fake=True), (_tokens(),),
                           plan=fxpar.Plan(stages=2, schedule="zb-h1", microbatches=4), loss_fn=next_token_loss)
    model_costs = pm.stage_costs()
    assert set(model_costs) == {(k, s) for k in "FBW" for s in (0, 1)} and all(c > 0 for c in model_costs.values())
    assert model_costs[("B", 1)] == model_costs[("W", 1)] == model_costs[("F", 1)]
    assert 0 < pm.schedule.simulate(model_costs).makespan
    path = str(tmp_path / "step.json")
    default_pool().run(error_models.pipeline_step_with_trace, 4, path, timeout=300)  # 1f1b, 2 stages, m=2
    measured = costs_from_trace(path)
    assert set(measured) == {(k, s) for k in "FB" for s in (0, 1)} and all(c > 0 for c in measured.values())
    assert 0 <= make_schedule("1f1b", 2, 2, 2).simulate(measured).bubble < 1


def test_pipeline_transfers_and_the_step_loss_live_on_the_nccl_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Received activations, a missing gradient's zeros and the step loss of a rank without the last stage were
    allocated on the CPU: NCCL takes no CPU tensor, so pp > 1 on CUDA failed on its first receive. They follow the
    default process group's backend now (no GPU here: the choice itself is checked)."""
    from fxpar import step_loss

    monkeypatch.setattr(step_loss.dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(step_loss.torch.cuda, "current_device", lambda: 3)
    assert step_loss.transfer_device() == torch.device("cuda", 3)
    monkeypatch.setattr(step_loss.dist, "get_backend", lambda group=None: "gloo")
    assert step_loss.transfer_device() == torch.device("cpu")


def test_an_in_place_write_to_a_tensor_the_forward_made_is_staged_with_its_readers() -> None:
    """Every in-place op counted as a write to model state and was pinned to stage 0; DeBERTa-v2 writes its relative
    position table in place (``detach_``), so stage 1 read a value nobody sent (an internal AssertionError). Only
    writes to parameters and buffers are pinned now."""
    from fxpar.testing.block_models import FreshTableInPlace

    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(0))
    assert_equivalent(FreshTableInPlace, {"pp": 2}, fxpar.Plan(stages=2, microbatches=2), (x,), steps=2,
                      loss_fn=torch.nn.functional.mse_loss, targets=x)



@pytest.mark.parametrize("sharing", ["1", "0"])
def test_state_the_forward_never_reads_is_held_by_the_stage_of_its_module(sharing: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter or buffer no stage's graph reads goes to the stage holding its module's neighbours (the root's to
    stage 0): every tensor of the model is held by exactly one stage, with sharing on or off, and the two print the
    same programs. (Each stage used to hold only what its graph read: an unread parameter was on no rank.)"""
    monkeypatch.setenv("FXPAR_SHARING", sharing)
    model = spare_state_stack()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    pm = fxpar.parallelize(model, fxpar.Mesh({"pp": 2}, fake=True), (x,), plan=fxpar.Plan(stages=2, microbatches=2),
                           loss_fn=mean_square, example_targets=(y,))
    held = [{f for f, _ in (*p.signature.params, *p.signature.buffers)} for p in pm._compiled.stages]
    assert sorted(f for h in held for f in h) == sorted(n for n, _ in (*model.named_parameters(),
                                                                        *model.named_buffers()))
    for i in range(4):
        stage = next(s for s, h in enumerate(held) if f"layers.{i}.lin.weight" in h)
        assert {f"layers.{i}.spare", f"layers.{i}.spare_stat", f"layers.{i}.scratch"} <= held[stage]
    assert "extra" in held[0]
    monkeypatch.setenv("FXPAR_SHARING", "0" if sharing == "1" else "1")
    other = fxpar.parallelize(spare_state_stack(), fxpar.Mesh({"pp": 2}, fake=True), (x,),
                              plan=fxpar.Plan(stages=2, microbatches=2), loss_fn=mean_square,
                              example_targets=(y,))
    assert [pm.program(r) for r in (0, 1)] == [other.program(r) for r in (0, 1)]


def test_unread_state_trains_and_is_in_the_state_dict_of_a_pipeline() -> None:
    """pp=2 x dp=2 with ZeRO-1 on gloo: the same gradients, steps and buffers as the single device (fp32, rtol
    1e-5), and the ranks' ``pm.state_dict()`` keys together are the model's (the unread ones included)."""
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)), torch.randn(8, 4)
    plan = fxpar.Plan(stages=2, microbatches=2, zero=1)
    assert_equivalent(spare_state_stack, {"pp": 2, "dp": 2}, plan, (x,), targets=y, loss_fn=mean_square,
                      steps=2)
    ranks = default_pool().run(state_keys_after_a_step, 2, spare_state_stack, {"pp": 2}, plan.resolved(zero=0), x, y,
                               mean_square)
    assert sorted({k for r in ranks for k in r["state"]}) == sorted(spare_state_stack().state_dict())
    assert "extra" in ranks[0]["params"] and "layers.3.spare" in ranks[1]["params"]



def test_state_no_stage_holds_is_named_in_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard behind ``hold_unread_state``: should a split leave model state on no stage, ``parallelize`` names
    it (``pm.state_dict()`` and checkpoints would leave it out); a non-persistent buffer is in no state dict."""
    import fxpar.stages

    monkeypatch.setattr(fxpar.stages, "hold_unread_state", lambda gm, graphs: None)
    model = spare_state_stack()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    with pytest.warns(fxpar.FxparWarning, match="held by no pipeline stage") as caught:
        pm = fxpar.parallelize(model, fxpar.Mesh({"pp": 2}, fake=True), (x,), plan=fxpar.Plan(stages=2, microbatches=2),
                               loss_fn=mean_square, example_targets=(y,))
    held = {f for p in pm._compiled.stages for f, _ in (*p.signature.params, *p.signature.buffers)}
    state = [fqn for fqn, _ in (*model.named_parameters(), *model.named_buffers())]
    missing = [fqn for fqn in state if fqn not in held and not fqn.endswith("scratch")]
    assert {f"layers.{i}.spare" for i in range(4)} | {"extra"} <= set(missing)
    message = next(str(w.message) for w in caught if "held by no pipeline stage" in str(w.message))
    assert message.startswith(f"fxpar: {len(missing)} parameters or buffers")
    assert all(repr(fqn) in message for fqn in missing[:4]) and f"and {len(missing) - 4} more" in message
    assert not any(repr(fqn) in message for fqn in state if fqn in held or fqn.endswith("scratch"))
