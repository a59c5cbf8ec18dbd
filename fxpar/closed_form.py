"""Closed-form step time and memory of a candidate plan, from a ``ModelProfile`` (the planner's pruning model).

A candidate is a mesh (pp, dp, tp) and the plan fields the search varies. With ``S`` samples per
microbatch (``batch / (dp m)``), ``L`` blocks, ``v`` stages per pipeline rank and ``Psi`` parameters
per rank (``(params - L params_block) + L params_block / pp``, the groups' share divided by tp):

* forward of one block per microbatch: ``S (shardable / tp + rest_of_block) + ops o`` (each compute node's
  overhead ``o`` once per microbatch) plus, per sharded group,
  one all-reduce over tp of the block's output (with sequence parallelism the same bytes as a
  reduce-scatter and an all-gather, and the non-group part divided by tp too); the backward costs twice
  the compute and the same communication; ``recompute="full"`` adds one forward;
* a pipeline rank runs ``(m + (pp-1)/v)`` microbatch slots of ``L/pp`` blocks (the 1F1B bubble over
  ``v`` interleaved stages), plus the point-to-point sends of each stage boundary;
* dp: the gradients (fp32) are reduced once per step (all-reduce in ``bucket_mb`` buckets, or under ZeRO-1
  a reduce-scatter per flat group: one per block of the stage and one for the rest, each paying its link
  latency); ZeRO-2 reduce-scatters after every microbatch's backward; ZeRO-1/2 all-gather the working copy
  (in ``param_dtype``) once per step before the forward; ZeRO-3 all-gathers it in the forward and the
  backward of every microbatch. Without pipeline stages the once-per-step reduction overlaps the last backward;
* memory follows ``pm.memory``: ``16 Psi`` bytes without ZeRO; ZeRO-1 ``(8 + 8/N) Psi + 8 Psi / N``;
  ZeRO-2 ``(4 + 4/N) Psi + 12 Psi / N``; ZeRO-3 ``16 Psi / N`` (fp32 master weights); activations
  ``S L/pp`` saved blocks times the microbatches in flight (pp under 1F1B, m under GPipe), divided by tp
  under sequence parallelism; full recompute keeps only each block's input; ZeRO-3 adds every gathered
  parameter and its bf16 cast (the overlap pass issues all of a graph's gathers early).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fxpar.cluster import Cluster
from fxpar.costs import collective_time
from fxpar.plan import Plan
from fxpar.profile import ModelProfile


@dataclass(frozen=True)
class Choice:
    """One candidate: mesh sizes and the plan fields the search varies."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    sharded_groups: int  # how many of the block's tp groups are sharded (0: replicate over tp)
    sequence_parallel: bool
    zero: int
    recompute: str | None
    schedule: str
    stages: int  # total pipeline stages (pp x v)

    @property
    def virtual(self) -> int:
        return self.stages // self.pp if self.pp > 1 else 1


@dataclass(frozen=True)
class ClosedForm:
    """Seconds and bytes the closed forms predict for one ``Choice``."""

    step_time: float
    compute: float
    tp_comm: float
    dp_comm: float
    pp_comm: float
    bubble: float
    optimizer: float
    memory: float
    params_per_rank: float
    model_flops: float = 0.0  # per step
    tokens: int = 0  # per step
    cluster_flops: float = 0.0  # dense bf16 peak of all devices

    @property
    def peak_memory(self) -> float:
        return self.memory

    @property
    def mfu(self) -> float:
        if not self.step_time or not self.cluster_flops:
            return 0.0
        return self.model_flops / (self.step_time * self.cluster_flops)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time else 0.0


def evaluate(p: ModelProfile, ch: Choice, cluster: Cluster) -> ClosedForm:
    """The closed forms of the module docstring for ``ch``."""
    samples = p.batch / (ch.dp * ch.microbatches)
    tp = ch.tp if ch.sharded_groups else 1
    share = ch.sharded_groups / max(len(p.groups), 1)
    shardable = p.block_shardable * share
    other = p.block_time - shardable
    block_f = samples * (shardable / tp + (other / tp if ch.sequence_parallel and tp > 1 else other)) \
        + p.block_ops * cluster.op_overhead
    tp_group = list(range(ch.tp))  # tp is the innermost axis: its ranks share a node when it fits
    tp_bytes = samples * p.boundary_bytes
    per_group = samples * p.reduced_bytes / max(len(p.groups), 1)
    comm_f = ch.sharded_groups * collective_time("all_reduce", tuple(tp_group), int(per_group), cluster) \
        if tp > 1 else 0.0
    blocks = p.n_blocks / ch.pp
    rest = samples * p.rest_time + p.rest_ops * cluster.op_overhead
    recompute = block_f if ch.recompute == "full" else 0.0
    f_rank = blocks * (block_f + comm_f) + rest
    b_rank = blocks * (2 * block_f + comm_f + recompute) + 2 * rest
    slots = ch.microbatches + (ch.pp - 1) / ch.virtual
    pipe = slots * (f_rank + b_rank)
    stride = ch.dp * ch.tp
    send_bytes = tp_bytes / (tp if ch.sequence_parallel else 1)
    # a middle stage sends activations forward and gradients back; at pp=2 without interleaving each rank one way
    directions = 1 if ch.pp == 2 and ch.virtual == 1 else 2
    pp_comm = directions * ch.virtual * ch.microbatches * collective_time("send", (0, stride), int(send_bytes),
                                                                          cluster) if ch.pp > 1 else 0.0
    psi = _params_per_rank(p, ch, tp, share)
    dp_comm = _dp_time(p, ch, psi, cluster, b_rank)
    optimizer = psi * p.param_bytes * 7 / (ch.dp if ch.zero else 1) / cluster.memory_bandwidth
    compute = ch.microbatches * (blocks * 3 * block_f + 3 * rest + blocks * recompute)
    bubble = (ch.pp - 1) / ch.virtual * (f_rank + b_rank)
    tp_comm = ch.microbatches * blocks * 2 * comm_f
    step = pipe + pp_comm + dp_comm + optimizer
    peak = cluster.peak_flops.get(torch.bfloat16, cluster.peak_flops[torch.float32])
    return ClosedForm(step, compute, tp_comm, dp_comm, pp_comm, bubble, optimizer, memory(p, ch, psi, samples, tp),
                      psi, p.flops_per_sample * p.batch, p.tokens_per_sample * p.batch,
                      peak * ch.pp * ch.dp * ch.tp)


def _params_per_rank(p: ModelProfile, ch: Choice, tp: int, share: float) -> float:
    block_params = p.params_block * p.n_blocks / ch.pp
    return (p.params_total - p.params_block * p.n_blocks) + block_params * (share / tp + (1 - share))


def _dp_time(p: ModelProfile, ch: Choice, psi: float, cluster: Cluster, last_backward: float) -> float:
    """Exposed dp communication of one step. ZeRO reduces and gathers one flat group per block of the stage and
    one for the rest (each collective pays its link latency); without ZeRO the gradients go in buckets of the
    default ``bucket_mb``. ZeRO-1/2 gather the working copy once per step, before the forward."""
    if ch.dp < 2:
        return 0.0
    group = tuple(range(0, ch.dp * ch.tp * ch.pp, ch.tp))[: ch.dp]  # dp sits outside tp: ranks tp apart
    grads = psi * 4  # reduced in fp32
    work = psi * (p.working_bytes or p.param_bytes)
    groups = max(round(p.n_blocks / ch.pp), 1) + 1

    def split(op: str, nbytes: float, count: int) -> float:
        return count * collective_time(op, group, int(nbytes / count), cluster)

    if ch.zero == 3:
        gathers = 2 * ch.microbatches * split("all_gather", work, groups)
        scatters = ch.microbatches * split("reduce_scatter", grads, groups)
        return max(gathers + scatters - 0.5 * ch.microbatches * last_backward, scatters / ch.microbatches)
    gather = split("all_gather", work, groups) if ch.zero else 0.0
    if ch.zero == 2:  # every microbatch's backward reduce-scatters its gradients
        return ch.microbatches * split("reduce_scatter", grads, groups) + gather
    buckets = max(math.ceil(grads / (Plan().bucket_mb * 2**20)), 1)
    reduce = split("reduce_scatter", grads, groups) if ch.zero == 1 else split("all_reduce", grads, buckets)
    if ch.pp > 1:
        return reduce + gather  # reduced once per step, after the pipeline drains
    return max(reduce - 0.8 * last_backward, 0.0) + gather


def memory(p: ModelProfile, ch: Choice, psi: float, samples: float, tp: int) -> float:
    """Peak bytes of one rank: weights, gradients and Adam state by ZeRO level, activations in flight."""
    n = ch.dp
    per = {0: 16.0, 1: 8 + 8 / n + 8 / n, 2: 4 + 4 / n + 12 / n, 3: 16 / n}[ch.zero if n > 1 else 0]
    states = psi * per * p.param_bytes / 4
    in_flight = ch.microbatches if ch.schedule == "gpipe" else min(ch.pp, ch.microbatches) if ch.pp > 1 else 1
    blocks = math.ceil(p.n_blocks / ch.pp)
    if ch.recompute == "full":
        saved = p.boundary_bytes / (tp if ch.sequence_parallel else 1)
    else:
        saved = p.block_saved / tp if ch.sequence_parallel else p.block_saved * (0.5 + 0.5 / tp)
    activations = samples * in_flight * blocks * saved + samples * p.rest_saved
    transient = samples * (p.block_saved / tp + p.rest_saved)
    if ch.zero == 3 and n > 1:  # the overlap pass issues every block's gather early: all are alive at once
        transient += psi * (p.param_bytes + 2)
    return states + activations + transient
