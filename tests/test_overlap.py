"""Overlap (``Plan(overlap=True, bucket_mb=...)``): dp gradient buckets issued during the backward, ZeRO-3
gathers prefetched a block ahead, every wait as late as its first use; results bitwise those without it."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from fxpar.backends.comm import bind_groups, group_arg_index

import fxpar
from fxpar.lower.overlap import GLOO_ENV
from fxpar.models.llama import llama, llama_plan
from fxpar.testing import assert_equivalent
from fxpar.testing.error_models import next_token_loss

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _compile(axes: dict[str, int], layers: int = 2, **plan: object) -> fxpar.ParallelModule:
    return fxpar.parallelize(llama(n_layers=layers), fxpar.Mesh(axes, fake=True), (TOKENS,),
                             plan=fxpar.Plan(tp=llama_plan() if "tp" in axes else {}, **plan))


def _check(axes: dict[str, int], **plan: object) -> list:
    return assert_equivalent(partial(llama, n_layers=2), axes, fxpar.Plan(tp=llama_plan(), **plan), (TOKENS,),
                             steps=3, loss_fn=next_token_loss, targets=TOKENS)


@pytest.mark.parametrize("extra", [{}, {"zero": 3, "sequence_parallel": True}, {"zero": 2, "recompute": "full"}],
                         ids=["dp2xtp2", "zero3+sp", "zero2+recompute"])
def test_overlap_matches_single_device_and_is_bitwise_the_unoverlapped_program(extra: dict) -> None:
    on = _check({"dp": 2, "tp": 2}, overlap=True, bucket_mb=0.05, **extra)
    off = _check({"dp": 2, "tp": 2}, overlap=False, **extra)
    assert [r.losses for r in on] == [r.losses for r in off]  # same arithmetic, reordered issue and wait


def test_overlap_with_pipeline_microbatches_matches_single_device() -> None:
    # several microbatches: the buckets stay in the once-per-step reduction, still bucketed
    plan = fxpar.Plan(stages=2, microbatches=2, overlap=True, bucket_mb=0.05)
    assert_equivalent(partial(llama, n_layers=2), {"pp": 2, "dp": 2}, plan, (TOKENS,), steps=2,
                      loss_fn=next_token_loss, targets=TOKENS)


def test_dp_collectives_per_step_equal_the_bucket_count() -> None:
    for mb in (0.01, 0.05, 0.2, 25):
        pm = _compile({"dp": 2, "tp": 2}, overlap=True, bucket_mb=mb)
        buckets = pm._compiled.stages[0].notes["overlap"]["buckets"]
        rows = [r for r in pm.ledger(0) if r.axis == "dp"]
        assert len(rows) == len(buckets), (mb, len(rows), buckets)
        plain = _compile({"dp": 2, "tp": 2}, overlap=False).ledger(0)
        assert sum(r.bytes for r in rows) == sum(r.bytes for r in plain if r.axis == "dp")  # the parameter bytes
    one_bucket = _compile({"dp": 2, "tp": 2}, overlap=True, bucket_mb=25).ledger(0)
    assert len([r for r in one_bucket if r.axis == "dp"]) == 1


def test_every_bucket_but_the_last_is_in_flight_across_a_later_matmul() -> None:
    pm = _compile({"dp": 2, "tp": 2}, overlap=True, bucket_mb=0.05)
    nodes = list(pm.rank_program(0).backward.graph.nodes)
    dp_group = next(n for n, ranks in pm.rank_program(0).groups.items() if n.startswith("dp"))
    issues = [n for n in nodes if n.target is c10d.all_reduce.default and n.args[2] == dp_group]
    assert len(issues) >= 3
    for c in issues[:-1]:
        wait = next(u for u in c.users if u.target is c10d.wait_tensor.default)
        between = nodes[nodes.index(c) + 1: nodes.index(wait)]
        assert any(n.target is aten.mm.default for n in between), c.name


def test_zero3_gathers_of_the_next_block_are_issued_before_this_blocks_matmuls() -> None:
    pm = _compile({"dp": 2}, layers=3, zero=3, overlap=True)
    nodes = list(pm.rank_program(0).forward.graph.nodes)

    def block(n: torch.fx.Node) -> str:
        return ".".join(str(n.meta.get("module", "")).split(".")[:2])

    for i in range(2):
        gathers = [nodes.index(n) for n in nodes
                   if n.target is c10d.all_gather_into_tensor.default and block(n) == f"layers.{i + 1}"]
        first_mm = min(nodes.index(n) for n in nodes if n.target is aten.mm.default and block(n) == f"layers.{i}")
        assert gathers and max(gathers) < first_mm, (i, gathers, first_mm)


def test_overlap_keeps_every_groups_collective_order_and_prints_in_flight_work() -> None:
    pm = _compile({"dp": 2, "tp": 2}, zero=3, sequence_parallel=True, overlap=True)
    fxpar.verify(pm)  # every group issues the same sequence on every rank
    text = pm.program(0)
    assert "inflight" in text and "comm.wait(" in text


def test_bad_bucket_size_is_a_clear_error() -> None:
    with pytest.raises(fxpar.PlanError, match="bucket_mb must be a positive number"):
        _compile({"dp": 2}, overlap=True, bucket_mb=0)


def _most_in_flight(graph: torch.fx.Graph, per_group: bool = True) -> int:
    """The most collectives in flight at once on one group (``per_group``) or in the whole graph."""
    in_flight: dict[str, set[torch.fx.Node]] = {}
    most = 0
    for n in graph.nodes:
        index = group_arg_index(n.target)
        if index is not None:
            group = n.args[index] if per_group else ""
            in_flight.setdefault(group, set()).add(n)
            most = max(most, len(in_flight[group]))
        elif n.target is c10d.wait_tensor.default:
            for issued in in_flight.values():
                issued.discard(n.args[0])
    return most


def _waits_at_once(graph: torch.fx.Graph) -> bool:
    """Whether every collective's wait is the node right after its issue."""
    nodes = list(graph.nodes)
    return all(nodes[i + 1].target is c10d.wait_tensor.default and nodes[i + 1].args[0] is n
               for i, n in enumerate(nodes) if group_arg_index(n.target) is not None)


@pytest.mark.parametrize("setting", ["default", "none"])
def test_gloo_keeps_one_collective_in_flight_per_process_with_compute_beside_it(
        setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo corrupts the heap now and then, fewest times per batch with one collective in flight per process
    # (bench/gloo_in_flight.py, bench/README.md section 12): on a CPU mesh a rank program has one in flight at a
    # time, over all its groups, with compute beside it; FXPAR_GLOO_IN_FLIGHT=none waits for each at once
    if setting != "default":
        monkeypatch.setenv(GLOO_ENV, setting)
    pm = fxpar.parallelize(llama(n_layers=3), fxpar.Mesh({"dp": 2, "tp": 2}, fake=True), (TOKENS,),
                           plan=fxpar.Plan(tp=llama_plan(), zero=3, overlap=True, bucket_mb=0.05))
    rp = pm.rank_program(0)
    graphs = [rp.forward.graph, rp.backward.graph]
    assert len({n.args[group_arg_index(n.target)] for g in graphs for n in g.nodes
                if group_arg_index(n.target) is not None}) == 2  # dp's and tp's
    assert max(_most_in_flight(g, per_group=False) for g in graphs) == 1
    fxpar.verify(pm)
    assert all(_waits_at_once(g) for g in graphs) == (setting == "none")
    nodes = list(rp.backward.graph.nodes)
    waits = {n.args[0]: n for n in nodes if n.target is c10d.wait_tensor.default}
    assert any(any(m.target is aten.mm.default for m in nodes[nodes.index(c) + 1: nodes.index(w)])
               for c, w in waits.items()) == (setting == "default")


def test_a_gloo_setting_that_does_not_exist_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(GLOO_ENV, "two")
    with pytest.raises(ValueError, match="FXPAR_GLOO_IN_FLIGHT='two': expected one of many, group, process, none"):
        _compile({"dp": 2}).rank_program(0)


@pytest.mark.parametrize("in_flight", ["many", "group", "process", "none"])
def test_overlap_bounds_collectives_in_flight_only_when_asked(in_flight: str) -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    issues = [g.call_function(c10d.all_reduce.default, (x, "sum", "dp")) for _ in range(3)]
    mms = [g.call_function(aten.mm.default, (x, x)) for _ in range(3)]
    waits = [g.call_function(c10d.wait_tensor.default, (c,)) for c in issues]
    other = g.call_function(c10d.all_reduce.default, (x, "sum", "tp"))  # another group: not held back
    g.output((*waits, *mms, g.call_function(c10d.wait_tensor.default, (other,))))
    fxpar.lower.overlap.overlap(g, in_flight)
    assert _most_in_flight(g) == (3 if in_flight == "many" else 1)
    assert _most_in_flight(g, per_group=False) == {"many": 4, "group": 2, "process": 1, "none": 1}[in_flight]
    nodes = list(g.nodes)
    if in_flight == "none":
        assert _waits_at_once(g)
    else:
        assert nodes.index(other) < nodes.index(mms[0])  # tp's collective is issued early in every other mode


def test_bound_gradient_buckets_reduce_in_place_while_the_program_prints_the_functional_op() -> None:
    """Binding a rank's graphs for execution turns each bucket's all-reduce of its private ``cat`` into
    ``all_reduce_`` (no copy of the bucket); tp all-reduces of values others read stay functional."""
    pm = _compile({"dp": 2, "tp": 2}, overlap=True, bucket_mb=0.05)
    rp = pm.rank_program(0)
    functional = [n for n in rp.backward.graph.nodes if n.target is c10d.all_reduce.default]
    buckets = [n for n in functional if n.args[0].target is aten.cat.default]
    bound = bind_groups(rp.backward, {sym: sym for sym in rp.groups}, reinplace=True)
    in_place = [n for n in bound.graph.nodes if n.target is c10d.all_reduce_.default]
    still = [n for n in bound.graph.nodes if n.target is c10d.all_reduce.default]
    assert len(buckets) > 1 and len(in_place) == len(buckets)
    assert len(still) == len(functional) - len(buckets) > 0
    assert "all_reduce_" not in pm.program(0)


def test_issue_order_keeps_its_order_through_many_insertions_at_one_place() -> None:
    """The order lowering reorders a graph with (``fxpar.lower.overlap._Order``) respaces its keys when no key is
    left between two neighbours: 600 insertions right after one anchor run out of room twice."""
    from fxpar.lower.overlap import _Order

    g = torch.fx.Graph()
    base = [g.placeholder(f"x{i}") for i in range(3)]
    order = _Order(base)
    inserted = []
    for i in range(600):  # each right after x0: the newest first, so the list reads x0, n599, ..., n0, x1, x2
        n = g.placeholder(f"n{i}")
        order.insert_after(base[0], n)
        inserted.append(n)
    expected = [base[0], *reversed(inserted), *base[1:]]
    assert list(order) == expected
    assert [order.pos(n) for n in expected] == sorted(order.pos(n) for n in expected)
    assert len({order.pos(n) for n in expected}) == len(expected)


def test_conv_nets_get_gradient_buckets_during_the_backward() -> None:
    """Buckets close where the backward's last matmul is; a convolution's backward was not counted as one, so a conv
    net's gradients all fell into one tail bucket, whatever ``bucket_mb`` said."""
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
    x = torch.randn(4, 3, 8, 8)
    pm = fxpar.parallelize(conv, fxpar.Mesh({"dp": 2}, fake=True), (x,), plan=fxpar.Plan(bucket_mb=0.0001))
    assert len(pm._compiled.stages[0].notes["overlap"]["buckets"]) >= 3


def test_sequence_parallel_norm_gradients_are_reduced_over_tp_during_the_backward() -> None:
    """Under SP a norm weight's gradient is a partial sum over tp. Its all-reduce was issued after the whole backward
    (where the gradient is returned), behind every other tp collective, and the dp bucket holding it waited for it.
    Each is now issued where the gradient is computed: before the backward's last tp reduce-scatter."""
    pm = _compile({"dp": 2, "tp": 2}, layers=3, sequence_parallel=True, overlap=True)
    nodes = list(pm.rank_program(0).backward.graph.nodes)
    tp = [n for n in nodes if group_arg_index(n.target) is not None and str(n.args[group_arg_index(n.target)])
          .startswith("tp")]
    norm_reduces = [i for i, n in enumerate(tp) if n.target is c10d.all_reduce.default]
    scatters = [i for i, n in enumerate(tp) if n.target is c10d.reduce_scatter_tensor.default]
    assert len(norm_reduces) == 2 * 3 + 1 and scatters  # two norms a layer and the final norm
    assert sum(i < scatters[-1] for i in norm_reduces) >= 2 * 2, [n.name for n in tp]
