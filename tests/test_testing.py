"""The testing tools themselves: the harness catches wrong programs, the pool survives bad ranks.

Fault injection: a ``rank_hook`` edits one rank's executed graph so that it uses a collective's input
instead of its result (the reduction is issued, keeping the ranks in lockstep, but ignored). The
harness must name the tensor, that rank and the step.
"""

from __future__ import annotations

import os
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import fxpar
from fxpar.models.mlp import mlp, mlp_plan
from fxpar.testing import EquivalenceError, RankPool, assert_equivalent
from fxpar.testing.launch import RankFailure
from fxpar.testing.pool import RemoteError

c10d = torch.ops._c10d_functional


def _skip_first_reduction(graph: str, on_rank: int, pm: fxpar.ParallelModule, rank: int) -> None:
    """On ``on_rank``, make the first all_reduce of the forward or backward pass a no-op for its users.

    The backward pass's dp gradient reduction lives in the once-per-step ``reduce_grads`` graph.
    """
    if rank != on_rank:
        return
    graphs = pm.executed_graphs()
    gm: fx.GraphModule = graphs["reduce_grads" if graph == "backward" and "reduce_grads" in graphs else graph]
    reduce = next(n for n in gm.graph.nodes if n.target in (c10d.all_reduce.default, c10d.all_reduce_.default))
    reduce.target = c10d.all_reduce.default  # a bucket runs in place (``bind_groups``): reduce a copy, keep the input
    wait = next(iter(reduce.users))
    wait.replace_all_uses_with(reduce.args[0])  # the partial sum / the local gradient, unreduced
    gm.recompile()


def test_wrong_gradient_reduction_names_tensor_rank_and_step() -> None:
    torch.manual_seed(0)
    with pytest.raises(EquivalenceError) as info:
        assert_equivalent(mlp, {"dp": 2}, None, (torch.randn(8, 32),), steps=2,
                          rank_hook=partial(_skip_first_reduction, "backward", 1))
    msg = str(info.value)
    first = info.value.mismatches[0]
    # at step 0 only rank 1 is wrong; from step 1 on its drifted parameters pollute rank 0 too
    assert {m.rank for m in info.value.mismatches if m.step == 0} == {1}, msg
    assert first.tensor.startswith("grad of ") and first.step == 0, msg
    assert f"first: {first.tensor} on rank 1 at step 0: max abs err" in msg, msg
    assert "first at step 0" in msg and "max rel err" in msg, msg
    assert "replay: fxpar.testing.assert_equivalent(fxpar.models.mlp.mlp, {'dp': 2}, None" in msg, msg


def test_wrong_forward_reduction_names_output_and_rank() -> None:
    torch.manual_seed(0)
    with pytest.raises(EquivalenceError) as info:
        assert_equivalent(mlp, {"tp": 2}, mlp_plan(), (torch.randn(8, 32),), steps=1,
                          rank_hook=partial(_skip_first_reduction, "forward", 1))
    msg = str(info.value)
    assert "first: output on rank 1 at step 0" in msg, msg
    assert {m.rank for m in info.value.mismatches} == {1}, msg


def test_reports_carry_losses_and_comparisons() -> None:
    torch.manual_seed(0)
    reports = assert_equivalent(mlp, {"dp": 2, "tp": 2}, mlp_plan(), (torch.randn(8, 32),), steps=3)
    assert [r.rank for r in reports] == [0, 1, 2, 3]
    for r in reports:
        assert len(r.losses) == 3 and not r.mismatches
        assert r.compared == 3 * (1 + 2 * 4)  # per step: 1 output, 4 gradients, 4 parameters
        for got, want in r.losses:
            assert got == pytest.approx(want, rel=1e-5)


def test_a_gradient_at_the_rounding_floor_may_move_its_parameter_but_a_wrong_update_is_caught() -> None:
    """A key projection's bias has an exact gradient of zero (softmax ignores a shift of every score): each side
    computes rounding noise (1e-8), and Adam's first step, ``lr * g / (|g| + eps)``, turns a noise difference of
    3e-8 into 0.03 ``lr``, past the 2% of ``lr`` parameters are held to. The harness allows each element what its
    own gradient difference can move it (``adam_sensitivity``): next to nothing where the gradient is large, so a
    wrong update there is still caught. HF CLIP at dp=2 ZeRO-3 was flagged on ``k_proj.bias`` before."""
    from fxpar.testing.equivalence import RankReport as Report
    from fxpar.testing.equivalence import _compare, adam_sensitivity
    from fxpar.testing.loss_models import clip_batch, hf_clip, model_loss
    from fxpar.testing.tolerance import default_tolerance

    grads = torch.tensor([1e-8, 0.1], dtype=torch.float64)
    moved = adam_sensitivity(grads, torch.tensor([3e-8, 1e-6], dtype=torch.float64))
    assert 0.02 < moved[0] < 0.04 and moved[1] < 1e-9
    lr, tol = 1e-3, default_tolerance(torch.float32)
    param_tol = type(tol)(tol.rtol, tol.param_lr_fraction * lr, tol.later_steps, tol.param_lr_fraction)
    want = torch.tensor([0.5, 0.5], dtype=torch.float64)
    for got, flagged in (([0.5 + 0.03 * lr, 0.5], False), ([0.5, 0.5 + 0.5 * lr], True)):
        report = Report(0)
        _compare("p", torch.tensor(got, dtype=torch.float64), want, 0, param_tol, report, absolute=True,
                 extra_atol=lr * moved)
        assert bool(report.mismatches) == flagged, (got, report.mismatches)
    assert_equivalent(hf_clip, {"dp": 2}, fxpar.Plan(zero=3), clip_batch(), loss_fn=model_loss, steps=2)


def test_a_complex_value_is_compared_with_its_imaginary_part() -> None:
    """A complex buffer or output off only in its imaginary part (a conjugated rotary table) is a mismatch: the
    comparison cast both sides to float64, which keeps the real part only."""
    from fxpar.testing.equivalence import RankReport, _compare
    from fxpar.testing.tolerance import default_tolerance

    want = torch.polar(torch.ones(8), torch.linspace(0.1, 1.5, 8))
    for got, flagged in ((want.clone(), False), (want.conj(), True)):
        report = RankReport(0)
        _compare("freqs_cis", got, want, 0, default_tolerance(torch.float32), report)
        assert bool(report.mismatches) == flagged, report.mismatches


def test_tolerance_follows_the_least_precise_dtype_of_the_plan_and_the_model() -> None:
    """Gradients reduced in bf16 (``reduce_dtype`` without ``param_dtype``, as FSDP2 allows) were judged at fp32
    tolerance: false mismatches. The tolerance is for the least precise of ``param_dtype``, ``reduce_dtype`` and the
    model's parameters."""
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    plan = fxpar.Plan(zero=3, reduce_dtype=torch.bfloat16)
    assert_equivalent(partial(mlp, dim=32, hidden=256, out=32), {"dp": 2}, plan, (x,), steps=2)


def test_user_error_keeps_its_type() -> None:
    with pytest.raises(fxpar.PlanError, match=r"did you mean: up") as info:
        assert_equivalent(mlp, {"tp": 2}, {"upp": "colwise"}, (torch.randn(8, 32),))
    assert "raised on every rank" in str(info.value) and "replay:" in str(info.value)


def test_model_fn_must_be_picklable() -> None:
    with pytest.raises(TypeError, match="model_fn must be picklable"):
        assert_equivalent(lambda: mlp(), {"tp": 2}, None, (torch.randn(8, 32),))


def _nondeterministic_mlp() -> torch.nn.Module:
    model = mlp()
    model.up.weight.data += time.perf_counter_ns() % 1000
    return model


def test_nondeterministic_model_fn_is_refused() -> None:
    with pytest.raises(ValueError, match=r"model_fn is not deterministic.*'up.weight'"):
        assert_equivalent(_nondeterministic_mlp, {"dp": 2}, None, (torch.randn(8, 32),))


# -- the pool ----------------------------------------------------------------------------------------


def _whoami() -> tuple[int, int, int]:
    t = torch.ones(1)
    dist.all_reduce(t)
    return dist.get_rank(), os.getpid(), int(t.item())


def _raise_value_error() -> None:
    raise ValueError(f"bad input on rank {dist.get_rank()}")


def _hang_on_rank1() -> int:
    if dist.get_rank() == 1:
        time.sleep(60)
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_pool_reuses_processes_across_world_sizes() -> None:
    pool = RankPool(collective_timeout=10)
    try:
        two = pool.run(_whoami, 2)
        four = pool.run(_whoami, 4)
        two_again = pool.run(_whoami, 2)
    finally:
        pool.close()
    assert [(r, n) for r, _, n in four] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [pid for _, pid, _ in two] == [pid for _, pid, _ in two_again] == [pid for _, pid, _ in four[:2]]
    assert pool.restarts == 0 and pool.size == 0


def test_pool_recycles_workers_that_accumulate_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # every worker has more threads than this (gloo's), so each task is followed by fresh workers
    monkeypatch.setattr("fxpar.testing.pool.RECYCLE_THREADS", 1)
    pool = RankPool(collective_timeout=10)
    try:
        first = {pid for _, pid, _ in pool.run(_whoami, 2)}
        second = {pid for _, pid, _ in pool.run(_whoami, 2)}
    finally:
        pool.close()
    assert not first & second and pool.recycles == 2 and pool.restarts == 0


def test_pool_reports_errors_and_stays_usable() -> None:
    pool = RankPool(collective_timeout=10)
    try:
        pids = [pid for _, pid, _ in pool.run(_whoami, 2)]
        with pytest.raises(RemoteError) as info:
            pool.run(_raise_value_error, 2)
        assert isinstance(info.value.original, ValueError) and "bad input on rank 0" in str(info.value)
        assert [pid for _, pid, _ in pool.run(_whoami, 2)] == pids and pool.restarts == 0
    finally:
        pool.close()


def _exit_on_rank1() -> int:
    if dist.get_rank() == 1:
        os._exit(3)  # a native crash: no result, no exception
    dist.all_reduce(torch.ones(1))
    return dist.get_rank()


def test_pool_worker_that_dies_fails_the_task_and_the_pool_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = RankPool(collective_timeout=5)
    try:
        pids = {pid for _, pid, _ in pool.run(_whoami, 2)}
        with pytest.raises(RankFailure, match="rank 1 exited with code 3"):
            pool.run(_exit_on_rank1, 2, timeout=20)
        assert pool.restarts == 1
        again = pool.run(_whoami, 2)
        assert [n for _, _, n in again] == [2, 2] and not pids & {pid for _, pid, _ in again}
        # a crashing worker may still look alive when the next task starts: sending to it breaks the pipe
        dead = pool._procs[1]
        dead.kill()
        dead.join()
        monkeypatch.setattr(type(dead), "is_alive", lambda self: True)
        assert [n for _, _, n in pool.run(_whoami, 2)] == [2, 2] and pool.restarts == 2
    finally:
        pool.close()


def test_pool_hung_rank_fails_within_timeout_and_restarts() -> None:
    pool = RankPool(collective_timeout=3)
    try:
        pids = [pid for _, pid, _ in pool.run(_whoami, 2)]
        start = time.monotonic()
        with pytest.raises(RankFailure) as info:
            pool.run(_hang_on_rank1, 2, timeout=20)
        assert time.monotonic() - start < 3 + 8
        assert "rank 0 raised" in str(info.value) and 1 in info.value.ranks, str(info.value)
        assert pool.restarts == 1
        again = pool.run(_whoami, 2)  # fresh workers
        assert [n for _, _, n in again] == [2, 2] and not set(pids) & {pid for _, pid, _ in again}
    finally:
        pool.close()
