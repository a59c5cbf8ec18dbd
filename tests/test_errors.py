"""Bad inputs: each one fails early with a message that says what to fix, or is survived correctly.

Compile-only cases use fake meshes (one process, no execution); the rest run on real gloo ranks. Rank
bodies and the models live in ``fxpar.testing.error_models`` so that spawned ranks can unpickle them.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import time
import warnings

import pytest
import torch
import torch.nn as nn

import fxpar
from fxpar.models.llama import llama, llama_plan
from fxpar.models.mlp import mlp, mlp_plan
from fxpar.testing import assert_equivalent, default_pool, error_models
from fxpar.testing.launch import RankFailure, run_ranks


def _tokens() -> tuple[torch.Tensor]:
    return (torch.randint(0, 256, (4, 16)),)


# 1. plans ------------------------------------------------------------------------------------------


def test_plan_glob_matching_nothing_lists_close_matches() -> None:
    plan = {**llama_plan(), "layers.*.mlp.upp": "colwise"}
    with pytest.raises(fxpar.PlanError) as info:
        fxpar.parallelize(llama(), fxpar.Mesh({"tp": 2}, fake=True), _tokens(), plan=plan)
    msg = str(info.value)
    assert "layers.*.mlp.upp" in msg
    assert "layers.0.mlp.up" in msg  # a real module, offered as "did you mean"
    assert isinstance(info.value, ValueError)


def test_plan_unknown_style() -> None:
    with pytest.raises(fxpar.PlanError) as info:
        fxpar.parallelize(llama(), fxpar.Mesh({"tp": 2}, fake=True), _tokens(), plan={"layers.*.mlp.up": "columnwise"})
    msg = str(info.value)
    assert "columnwise" in msg and "colwise" in msg and "rowwise" in msg


# 2. mesh vs world ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("plan", "axes", "message"), [
    (fxpar.Plan(zero=3), {"tp": 2}, r"Plan\(zero=3\) shards .* over the dp axis, but the mesh \(tp=2\) has no dp"),
    (fxpar.Plan(zero=1), {"dp": 1, "tp": 2}, r"has no dp axis of size > 1"),
    (fxpar.Plan(zero=4), {"dp": 2}, r"zero must be 0, 1, 2 or 3, got 4"),
    (fxpar.Plan(sequence_parallel=True), {"dp": 2}, r"sequence_parallel=True\) shards activations over the tp"),
])
def test_plan_field_without_its_mesh_axis(plan: fxpar.Plan, axes: dict[str, int], message: str) -> None:
    with pytest.raises(fxpar.PlanError, match=message):
        fxpar.parallelize(mlp(), fxpar.Mesh(axes, fake=True), (torch.randn(8, 32),), plan=plan)


def test_mesh_size_differs_from_world_size() -> None:
    messages = run_ranks(error_models.mesh_size_mismatch, 2, {"tp": 4}, timeout=60, collective_timeout=10)
    for msg in messages:
        assert msg.startswith("ValueError"), msg
        assert re.search(r"\b4 ranks\b", msg) and re.search(r"world size is 2\b", msg), msg


class _CreatesItsParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.cache: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache = x.detach()  # a tensor attribute the code rebinds: put back after tracing
        if not hasattr(self, "scale"):
            self.scale = nn.Parameter(torch.ones(16))
        return self.fc(x) * self.scale


def test_a_parameter_created_in_forward_is_refused_and_the_model_left_as_it_was() -> None:
    """It stayed on the user's model as a fake tensor (the model's own calls then returned fake tensors) and the
    program read it as a constant, never trained."""
    model = _CreatesItsParameter()
    with pytest.raises(fxpar.CaptureError, match=r"creates parameters while it runs \(scale\)"):
        fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(4, 16),))
    assert not hasattr(model, "scale") and model.cache is None
    assert type(model(torch.randn(2, 16))) is torch.Tensor  # noqa: E721 - a plain tensor, not a fake one


def test_arguments_of_the_wrong_type_are_named() -> None:
    # each failed on an attribute deep in fxpar (or in DCP, for a fake mesh's module)
    model, x = nn.Sequential(nn.Linear(16, 8)), (torch.randn(4, 16),)
    with pytest.raises(TypeError, match=r"takes a fxpar.Mesh, got dict: did you mean fxpar.Mesh\(\{'dp': 2\}\)"):
        fxpar.parallelize(model, {"dp": 2}, x)
    with pytest.raises(TypeError, match=r"Mesh takes a dict of axis names to sizes"):
        fxpar.Mesh(["dp", "tp"], fake=True)
    with pytest.raises(TypeError, match=r"parallelize takes an nn.Module, got function"):
        fxpar.parallelize(lambda t: t * 2, fxpar.Mesh({"dp": 2}, fake=True), x)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), x)
    with pytest.raises(fxpar.CheckpointError, match=r"compiled for a fake mesh: it holds no weights to save"):
        fxpar.checkpoint.save(pm, None, "/nonexistent/checkpoint")


@pytest.mark.parametrize("x", [torch.randint(0, 3, (4, 32)), torch.randn(4, 32, dtype=torch.float64)],
                         ids=["int64", "float64"])
def test_inputs_of_another_dtype_than_the_weights_are_refused_at_compile(x: torch.Tensor) -> None:
    # fake tensors do not check a matmul's dtypes: it compiled, and the rank program failed when it first ran
    with pytest.raises(fxpar.CaptureError, match=rf"0 \(Linear\) computes linear of a {x.dtype} and a torch.float32"):
        fxpar.parallelize(nn.Sequential(nn.Linear(32, 16), nn.ReLU()), fxpar.Mesh({"dp": 2}, fake=True), (x,))


def test_an_uninitialized_lazy_module_is_refused_by_name() -> None:
    model = nn.Sequential(nn.LazyLinear(16), nn.ReLU())
    with pytest.raises(fxpar.CaptureError, match=r"'0.weight' is uninitialized .* run the model once"):
        fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(4, 8),))


def test_a_model_issuing_its_own_collective_is_refused_at_its_line() -> None:
    # lowering failed on it with an internal assertion ("has no ledger row")
    for msg in default_pool().run(error_models.compile_error_on_dp, 2, error_models.OwnCollective, timeout=120):
        assert re.match(r"CaptureError: the model issues its own collective \(all_reduce.default at "
                        r"error_models.py:\d+\)", msg), msg


def test_ranks_whose_models_trace_differently_are_refused_before_running() -> None:
    """Rank 1's model centers over the batch (an extra dp all-reduce in its forward), rank 0's does not: their
    collectives would have paired wrongly. Every rank now refuses at ``parallelize``, naming rank 1."""
    for msg in default_pool().run(error_models.compile_error_on_dp, 2, error_models.RankDependent,
                                   timeout=120):
        assert msg.startswith("VerifyError: ranks [1] compiled programs whose collectives differ"), msg


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_cuda_mesh_without_a_gpu_is_a_clear_error() -> None:
    # tracing CUDA kernels without a GPU used to abort the process inside torch (c10::Error, no Python traceback)
    with pytest.raises(ValueError, match=r"device='cuda'\) needs a CUDA GPU .*device='cpu', fake=True"):
        fxpar.parallelize(mlp(), fxpar.Mesh({"dp": 2}, device="cuda", fake=True), (torch.randn(8, 32),))


# 3. divisibility -----------------------------------------------------------------------------------


def test_sharded_dim_smaller_than_axis() -> None:
    # a dim the axis does not divide is split unevenly, as DTensor does (tests/test_uneven.py); one with fewer
    # rows than ranks would leave a rank empty
    with pytest.raises(ValueError) as info:
        fxpar.parallelize(mlp(hidden=3), fxpar.Mesh({"tp": 4}, fake=True), (torch.randn(8, 32),), plan=mlp_plan())
    msg = str(info.value)
    assert "'up.weight'" in msg and "module 'up'" in msg
    assert re.search(r"dim 0 has size 3, fewer than the mesh axis size 4\b", msg), msg


def test_batch_smaller_than_dp() -> None:
    # a batch dp does not divide is split unevenly (tests/test_uneven.py); one smaller than dp leaves a rank empty
    with pytest.raises(ValueError) as info:
        fxpar.parallelize(mlp(), fxpar.Mesh({"dp": 4}, fake=True), (torch.randn(3, 32),))
    msg = str(info.value)
    assert "input 0" in msg and re.search(r"a batch of 3 over dp=4\b", msg), msg
    assert "without a sample" in msg


def test_uneven_batch_with_microbatches() -> None:
    with pytest.raises(fxpar.PlanError, match=r"microbatches=2 does not divide the local batch.*microbatches=1 only"):
        fxpar.parallelize(mlp(), fxpar.Mesh({"dp": 4}, fake=True), (torch.randn(6, 32),),
                          plan=fxpar.Plan(microbatches=2), loss_fn=lambda out, y: out.mean(),
                          example_targets=torch.randn(6, 32))


# 4. capture ----------------------------------------------------------------------------------------


def _branch_line() -> tuple[str, int]:
    """File and line number of the data-dependent ``if`` in ``DataDependentBranch.forward``."""
    lines, start = inspect.getsourcelines(error_models.DataDependentBranch.forward)
    (offset,) = [i for i, line in enumerate(lines) if "if h.sum() > 0" in line]
    return inspect.getsourcefile(error_models.DataDependentBranch), start + offset


def test_data_dependent_control_flow_names_the_line() -> None:
    path, line = _branch_line()
    with pytest.raises(fxpar.CaptureError) as info:
        fxpar.parallelize(error_models.data_dependent_branch(), fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(4, 8),))
    msg = str(info.value)
    assert f"{path}:{line}" in msg or f"error_models.py:{line}" in msg, msg


@pytest.mark.parametrize("op", ["item", "nonzero"])
def test_a_value_read_from_a_tensor_names_the_line(op: str) -> None:
    # the failure comes while the joint is traced, after export: no user frame was on the stack
    lines, start = inspect.getsourcelines(error_models.ValueRead.forward)
    line = start + next(i for i, text in enumerate(lines) if f"# {op.upper()}" in text)
    with pytest.raises(fxpar.CaptureError, match=rf"error_models.py:{line}: .*# {op.upper()}\n.*hint:"):
        fxpar.parallelize(error_models.ValueRead(op), fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(4, 8),))


def test_a_shape_mismatch_inside_a_library_module_names_the_module_and_is_reported_once(
        caplog: pytest.LogCaptureFixture) -> None:
    """An input of the wrong width fails inside ``nn.Linear`` under an ``nn.Sequential``: no frame of the user's
    file is on the stack, so the error names the module path; fake-tensor mode's own 40-line report of the
    failed op is not logged besides."""
    model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Sequential(nn.Linear(24, 24), nn.Linear(20, 5)))
    with caplog.at_level(logging.DEBUG), pytest.raises(fxpar.CaptureError) as info:
        fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(4, 12),))
    msg = str(info.value)
    assert "in module 2.1 (Linear)" in msg and "[4, 24] X [20, 5]" in msg, msg
    assert not [r for r in caplog.records if "failed while attempting to run meta" in r.getMessage()]


def test_input_written_in_forward_names_it_and_the_line() -> None:
    """A forward that writes its own input in place: a rank program holds a shard of the caller's tensor, so the
    write cannot reach it; fxpar refuses with the input and the user's line (buffers it writes are fine:
    tests/test_batch_norm.py)."""
    path = inspect.getsourcefile(error_models)
    with open(path) as f:
        line = next(i for i, text in enumerate(f.read().splitlines(), 1) if "# WRITES INPUT" in text)
    with pytest.raises(fxpar.CaptureError) as info:
        fxpar.parallelize(error_models.WritesItsInput(), fxpar.Mesh({"dp": 2}, fake=True), (torch.randn(4, 8),))
    msg = str(info.value)
    assert "writes 1 input(s) in place" in msg and f"error_models.py:{line}" in msg, msg


def test_parameter_written_in_forward_is_refused_with_a_way_out() -> None:
    """``nn.Embedding(max_norm=...)`` renormalizes rows of its weight in place during forward."""
    model = nn.Sequential(nn.Embedding(64, 16, max_norm=1.0), nn.Linear(16, 4))
    with pytest.raises(fxpar.CaptureError) as info:
        fxpar.parallelize(model, fxpar.Mesh({"dp": 2}, fake=True), (torch.randint(0, 64, (4, 8)),))
    msg = str(info.value)
    assert "writes 1 parameter(s) in place" in msg and "0.weight" in msg and "max_norm" in msg, msg


def test_batch_norm_without_running_stats_matches_single_device() -> None:
    """Batch statistics only, computed over the whole dp-sharded batch (fp32, rtol 1e-5)."""
    assert_equivalent(functools.partial(error_models.batch_norm_conv, track_running_stats=False), {"dp": 2},
                      fxpar.Plan(zero=3), (torch.randn(6, 3, 6, 6, generator=torch.Generator().manual_seed(0)),),
                      steps=2)


# 5. an op without a sharding rule ------------------------------------------------------------------

NO_RULE_OPS = ("aten.searchsorted.Tensor", "aten.hardswish_backward.default")


def test_op_without_sharding_rule_warns() -> None:
    # fxpar warns once per op per compile
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._decompositions import DecompShardingStrategy

    prop = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.searchsorted.Tensor
    known = (prop.op_strategy_funcs, prop.op_single_dim_strategy_funcs, prop.op_to_rules)
    assert not any(op in table for table in known) and not DecompShardingStrategy.has_decomp(op), "pick another op"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxpar.parallelize(error_models.no_rule_mlp(), fxpar.Mesh({"tp": 2}, fake=True), (torch.randn(8, 32),),
                          plan=error_models.MLP_PLAN)
    messages = [str(w.message) for w in caught if issubclass(w.category, fxpar.FxparWarning)]
    for name in NO_RULE_OPS:
        assert [m for m in messages if name in m], (name, messages)


def test_op_without_sharding_rule_still_equivalent() -> None:
    # the fallback gathers the ops' inputs, runs them replicated and slices the results back to shards
    torch.manual_seed(5)
    reports = assert_equivalent(error_models.no_rule_mlp, {"tp": 2}, error_models.MLP_PLAN, (torch.randn(8, 32),),
                                steps=2)
    assert [len(r.losses) for r in reports] == [2, 2]


# 6. a rank that dies mid-step ----------------------------------------------------------------------


def test_a_loss_fn_that_returns_no_scalar_is_refused_by_name() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(error_models.step_with_a_non_scalar_loss, 2, timeout=120, collective_timeout=20)
    msg = str(info.value)
    assert "loss_fn returned a tensor of shape (30,): it must return a scalar tensor" in msg, msg
    assert "step completed" not in msg


@pytest.mark.parametrize(("how", "call"), [("step", "pm.step"), ("call", "pm(...)")])
def test_the_global_batch_where_a_rank_takes_its_shard_is_refused_by_name(how: str, call: str) -> None:
    # the commonest mistake with a dp mesh; it used to fail inside the rank graph's first view
    with pytest.raises(RankFailure) as info:
        run_ranks(error_models.call_with_the_global_batch, 2, how, timeout=120, collective_timeout=20)
    msg = str(info.value)  # whichever rank raises first: the other is terminated
    assert re.search(re.escape(f"{call}: input 0 has shape (4, 16), but rank ") + r"[01]" + re.escape(
        "'s program was compiled for (2, 16): its share of the batch over dp=2"), msg), msg
    assert "'ran'" not in msg


def test_float_token_ids_are_refused_by_name() -> None:
    # they failed inside the rank program, in torch's embedding, pointing at generated code
    with pytest.raises(RankFailure) as info:
        run_ranks(error_models.call_with_the_global_batch, 2, "float", timeout=120, collective_timeout=20)
    msg = str(info.value)
    assert "pm(...): input 0 has dtype torch.float32, but rank 0's program was compiled for torch.int64" in msg, msg


@pytest.mark.parametrize("plan", [None, "auto", fxpar.Plan()], ids=["none", "auto", "plan"])
def test_an_unknown_mesh_axis_is_named_before_any_plan_search(plan: object) -> None:
    # plan="auto" searched the axes it knows and said "fixed pp x dp x cp x ep x tp = 1 but the cluster has 2 GPUs"
    x = torch.randn(4, 16)
    for axes, hint in (({"data": 2}, ""), ({"DP": 2}, " (did you mean 'dp'?)")):
        with pytest.raises(fxpar.PlanError, match=re.escape(f"mesh axis {next(iter(axes))!r} is not supported; use "
                                                             f"('pp', 'dp', 'ep', 'cp', 'tp'){hint}")):
            fxpar.parallelize(error_models.sequential(), fxpar.Mesh(axes, fake=True), (x,), plan=plan,
                              cluster=fxpar.Cluster.preset("h100-sxm", gpus=2))


def test_a_style_on_a_module_without_a_weight_of_its_own_names_the_linears_under_it() -> None:
    # {"layers.*.attn": "colwise"} matched the attention modules: every weight stayed replicated, silently
    tokens = torch.randint(0, 256, (4, 16))
    with pytest.raises(fxpar.PlanError, match=r"layers.0.attn \(Attention\): style 'colwise' is supported on "
                                              r"nn.Linear.* holds none itself; style its modules instead: "
                                              r"layers.0.attn.q, layers.0.attn.k"):
        fxpar.parallelize(llama(n_layers=2), fxpar.Mesh({"tp": 2}, fake=True), (tokens,),
                          plan={"layers.*.attn": "colwise"})


def test_a_tied_weight_given_two_layouts_is_refused() -> None:
    # embed colwise shards the table's hidden dim, lm_head colwise its vocab dim: one of the two was dropped silently
    tokens = torch.randint(0, 256, (4, 16))
    with pytest.raises(fxpar.PlanError, match=r"parameter 'embed.weight' is tied under the names embed.weight, "
                                              r"lm_head.weight, and the plan gives it two layouts \(embed 'colwise' "
                                              r"-> S\(1\) and lm_head 'colwise' -> S\(0\)\)"):
        fxpar.parallelize(llama(n_layers=2, tie_embeddings=True), fxpar.Mesh({"tp": 2}, fake=True), (tokens,),
                          plan={"embed": "colwise", "lm_head": "colwise"})
    # replicate on one name gives way to the other's sharding style (HF plans say "replicate" for some embeddings)
    pm = fxpar.parallelize(llama(n_layers=2, tie_embeddings=True), fxpar.Mesh({"tp": 2}, fake=True), (tokens,),
                           plan={"embed": "replicate", "lm_head": "colwise"})
    assert "# embed_weight: f32[128,64]   tp:S(0)" in pm.program(0)


@pytest.mark.parametrize(("plan", "message"), [
    (fxpar.Plan(zero=True), "zero must be 0, 1, 2 or 3 (an int), got True"),  # it ran as ZeRO-1
    (fxpar.Plan(stages="4"), "did you mean stages=['4']?"),  # read letter by letter
    (fxpar.Plan(stages=2.0), "stages must be None, a positive int or a list of module paths (str), got 2.0"),
    (fxpar.Plan(overlap=None), "overlap must be True or False, got None"),  # accepted
    (fxpar.Plan(tp="HF"), "got 'HF' (did you mean 'hf'?)"),
    ({"zero": 3}, "did you mean fxpar.Plan(zero=3)?"),
])
def test_plan_fields_of_the_wrong_type_are_refused_by_name(plan: object, message: str) -> None:
    with pytest.raises(fxpar.PlanError, match=re.escape(message)):
        fxpar.parallelize(error_models.sequential(), fxpar.Mesh({"pp": 2, "dp": 2}, fake=True), (torch.randn(4, 16),),
                          plan=plan, loss_fn=error_models.mean_square)


def test_stray_arguments_and_inputs_needing_grad_are_refused_by_name() -> None:
    # an argument after the inputs (pm) or the targets (pm.step) was dropped, and an input that requires grad got
    # no gradient: both silently
    out = default_pool().run(error_models.misused_calls, 2, timeout=120)[0]
    assert out["extra_call"].startswith("TypeError: pm(inputs...) got 2 arguments where the program takes at most 1")
    assert out["extra_step"].startswith("TypeError: pm.step(inputs..., targets) got 3 arguments")
    assert out["grad_input"].startswith("ValueError: model input 0 requires grad, but fxpar computes gradients of the "
                                        "model's parameters only")
    # both failed inside the rank program (a dtype mismatch in mm; torch's device check)
    assert out["double"] == ("ValueError: pm(...): input 0 has dtype torch.float64, but rank 0's program was "
                             "compiled for torch.float32 (the dtype example_inputs had)"), out["double"]
    assert out["meta"].startswith("ValueError: pm(...): input 0 is on device meta, but rank 0's program runs on cpu")


def test_rank_dies_mid_step() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(error_models.die_before_first_forward, 2, 1, timeout=60, collective_timeout=5)
    elapsed = time.monotonic() - start
    assert elapsed < 30, f"took {elapsed:.1f}s to report a dead rank"
    msg = str(info.value)
    assert 1 in info.value.ranks and "rank 1 exited with code 1" in msg, msg
    # rank 0 never reported success: its collective raised (listed as failed) or it was reaped
    assert 0 in info.value.ranks or re.search(r"ranks \[0\] were terminated", msg), msg
    assert "step completed" not in msg
