"""Run one training step of a rank: the events ``fxpar.rank_step`` lists for it, in order.

``gather`` all-gathers ZeRO-1/2's parameter shards; ``F``/``B``/``W`` run the stage's lowered
forward, backward (or its input-gradient and weight-gradient halves) graphs on local tensors;
``SEND_*``/``RECV_*`` move stage boundary values with ``torch.distributed`` point-to-point calls, to
the peer and with the tag the event names (sends are asynchronous: a forward send is awaited when its
gradient comes back, which proves it arrived, so its buffer is not held to the step's end; the rest at
``wait_sends``; receives block, with the process group's timeout); ``reduce`` runs a stage's
``reduce_grads`` graph (after every backward under ZeRO-2, else once on the summed gradients);
``tied`` sums a weight's gradient over the pipeline ranks holding it; ``loss`` all-reduces the
step's mean loss. ``fxpar.verify`` checks this same list, so the proof covers what runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fxpar.grad_sums import GradSums
from fxpar.rank_spec import RankSpec, StageSpec
from fxpar.rank_step import StepEvent
from fxpar.step_loss import StepLosses, transfer_device


class StageRunner:
    """One stage's graphs on this rank (any callables: bound ``GraphModule``s in process, functions of a saved rank
    file under ``fxpar.run``) and its calling convention (``StageSpec``)."""

    # ``pm(...)``'s backward: the parameters no gradient of the outputs outside ``dead`` reaches (``fxpar.unreached``)
    unreached: Callable[[frozenset[int]], frozenset[str]] | None = None

    def __init__(self, spec: StageSpec, graphs: dict[str, Callable[..., Any]]) -> None:
        self.spec = spec
        self.forward, self.backward = graphs["forward"], graphs["backward"]
        self.reduce = graphs.get("reduce_grads")
        self.gather = graphs.get("gather_params")
        self.b, self.w = graphs.get("backward_b"), graphs.get("backward_w")
        self.stage = spec.stage
        self.param_fqns, self.zero_fqns, self.zero_positions = spec.param_fqns, spec.zero_fqns, spec.zero_positions
        self.num_outputs, self.tangent_outputs = spec.num_outputs, spec.tangent_outputs
        self.grad_fqn, self.input_grad_pos = spec.grad_fqn, spec.input_grad_pos
        self.out_meta = spec.out_meta

    def reduce_into(self, results: list[Any]) -> None:
        """Replace the deferred gradients in a backward's ``results`` by their reduction (``reduce_grads``)."""
        positions = [pos for pos, _ in self.spec.deferred]
        for pos, g in zip(positions, self.reduce(*[results[p] for p in positions]), strict=True):
            results[pos] = g


class RankState(Protocol):
    """Where the executor finds a rank's parameters and buffers and leaves its gradients (``fxpar.params``)."""

    def local_param(self, fqn: str) -> torch.Tensor: ...
    def stage_buffers(self, stage: int) -> list[torch.Tensor]: ...
    def gather_stage_params(self, runner: StageRunner) -> None: ...
    def add_local_grad(self, fqn: str, g: torch.Tensor) -> None: ...


@dataclass
class StepState:
    """What one step keeps between events, keyed by (stage, microbatch)."""

    inbox: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # received activations
    outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # forward outputs to send
    saved: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    tangents: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # grads of sent values
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # to send back
    stash: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # B -> W values
    unreduced: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # ZeRO-2: a backward's raw grads
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # the last stage's loss per microbatch
    output_grads: dict[int, list[torch.Tensor | None]] = field(default_factory=dict)  # its outputs' grads, until B
    grads: GradSums = field(default_factory=lambda: GradSums([]))  # each stage's gradients summed over microbatches
    totals: dict[str, torch.Tensor] | None = None  # fqn -> gradient summed over this rank's stages
    sends: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # SEND_B: at wait_SEND_B or wait_sends
    forward_sends: dict[tuple[int, int], list[Any]] = field(default_factory=dict)  # at wait_SEND_F or RECV_B
    loss: torch.Tensor | None = None
    forward_only: bool = False  # an evaluation step (``forward_events``)
    trace: list[dict[str, Any]] = field(default_factory=list)


LossFn = Callable[[list[Any], Any], torch.Tensor]  # (the last stage's output leaves, targets) -> a batch-mean loss


class StepExecutor(StepLosses):
    """Runs a rank's step events. Built once per rank; ``run`` is one training step.

    ``events`` is the list it runs (``fxpar.rank_step``); ``fxpar.verify(pm, events=...)`` checks a list.
    Requires: ``runners`` for every stage the events name; ``loss_fn`` takes the output leaves (not the
    model's output structure: the caller rebuilds it, so a saved program needs no model class).
    Ensures: after ``run``, each gradient this rank holds was handed to ``state.add_local_grad`` once, except
    those of ``unreached`` (parameters the loss does not reach, ``fxpar.unreached``: their ``.grad`` stays as it was).
    """

    unreached: frozenset[str] | None = None  # set by the module before its first training step

    def __init__(self, state: RankState, runners: dict[int, StageRunner], events: list[StepEvent], spec: RankSpec,
                 loss_fn: LossFn, tie_groups: dict[str, Any]) -> None:
        self.state, self.runners, self.events, self.spec = state, runners, events, spec
        self.loss_fn, self.tie_groups = loss_fn, tie_groups
        self.warned_uneven_mean = False  # ``fxpar.loss_watch``: said once per module
        self.checked_split_mean = False  # ``fxpar.loss_watch.split_mean_gap``: tested once per module
        self.rank, self.m = spec.rank, spec.microbatches
        self.recv_meta = spec.recv_meta
        self.device = transfer_device()  # received buffers, a missing gradient's zeros, the loss of a rank without one

    # -- the step ----------------------------------------------------------------------------------
    def run(self, mb_inputs: list[list[Any]], mb_targets: list[Any], trace: str | None,
            forward_only: bool = False) -> torch.Tensor:
        """One step: every event, or (``forward_only``, an evaluation) only the forwards, their transfers and the
        loss (``forward_events``): no backward, no gradient."""
        st = StepState(grads=GradSums(list(self.runners)), forward_only=forward_only)
        events = forward_events(self.events) if forward_only else self.events
        t0 = time.perf_counter()
        with torch.no_grad():
            for event in events:
                start = time.perf_counter()
                self.dispatch(event, st, mb_inputs, mb_targets)
                if trace is not None:
                    st.trace.append({"name": event.label, "ph": "X", "ts": (start - t0) * 1e6,
                                     "dur": (time.perf_counter() - start) * 1e6, "pid": 0, "tid": self.rank,
                                     "cat": event.kind})
            for fqn, g in ({} if forward_only else self.totals(st)).items():
                if fqn not in (self.unreached or ()):
                    self.state.add_local_grad(fqn, g)
        if trace is not None:
            write_trace(trace, st.trace, self.rank)
        assert st.loss is not None, "a step's events end with the loss"
        return st.loss

    def dispatch(self, e: StepEvent, st: StepState, mb_inputs: list[list[Any]], mb_targets: list[Any]) -> None:
        if e.kind == "gather":
            self.gather(e.stage)
        elif e.kind == "F":
            self.forward(e.stage, e.mb, st, mb_inputs[e.mb], mb_targets[e.mb])
        elif e.kind == "B":
            self.backward(e.stage, e.mb, st, halves=e.graph == "backward_b")
        elif e.kind == "W":
            self.weight_grads(e.stage, e.mb, st)
        elif e.kind == "reduce":
            self.reduce(e.stage, e.mb, st)
        elif e.kind == "SEND_F":
            self.send(st.outputs.pop((e.stage, e.mb)), e, st)
        elif e.kind == "SEND_B":
            self.send(st.input_grads.pop((e.stage, e.mb)), e, st)
        elif e.kind == "RECV_F":
            st.inbox[(e.stage + 1, e.mb)] = self.recv(e)
        elif e.kind == "RECV_B":
            meta = [b for b in self.recv_meta[e.stage] if b.has_grad]
            st.tangents[(e.stage - 1, e.mb)] = dict(zip([b.value for b in meta], self.recv(e), strict=True))
            for work in st.forward_sends.pop((e.stage - 1, e.mb), []):  # its gradient is back: the send arrived
                work.wait()
        elif e.kind in ("wait_SEND_F", "wait_SEND_B"):  # a receive proved it arrived (``fxpar.schedules.arrivals``)
            for work in (st.forward_sends if e.kind == "wait_SEND_F" else st.sends).pop((e.stage, e.mb), []):
                work.wait()
        elif e.kind == "wait_sends":
            for work in [w for works in (*st.sends.values(), *st.forward_sends.values()) for w in works]:
                work.wait()
            st.sends.clear()
            st.forward_sends.clear()
        elif e.kind == "tied":
            all_reduce_in_place(self.totals(st)[e.fqn], self.tie_groups[e.fqn])
        elif e.kind == "loss":
            st.loss = self.global_loss(st)
        else:
            raise AssertionError(f"unknown step event {e.kind!r}")

    def params(self, runner: StageRunner) -> list[torch.Tensor]:
        return [self.state.local_param(fqn) for fqn in runner.param_fqns]

    def gather(self, s: int) -> None:
        """ZeRO-1/2: this stage's parameters, all-gathered from their dp shards for the step."""
        self.state.gather_stage_params(self.runners[s])

    def forward(self, s: int, mb: int, st: StepState, inputs: list[Any], targets: Any) -> None:
        r = self.runners[s]
        received = st.inbox.pop((s, mb), []) if s > 0 else []
        user = [inputs[i] for i in r.spec.user_inputs] if r.spec.user_inputs is not None else inputs
        tensors = [x for x in user if isinstance(x, torch.Tensor)]
        results = r.forward(*self.params(r), *self.state.stage_buffers(s), *received, *tensors)
        outs = list(results[: r.num_outputs])
        if not st.forward_only:  # an evaluation keeps nothing for a backward
            st.saved[(s, mb)] = list(results[r.num_outputs:])
        if s == self.spec.n_stages - 1 and st.forward_only:
            st.losses[mb] = self.loss_value(outs, targets)
        elif s == self.spec.n_stages - 1:
            st.losses[mb], st.output_grads[mb] = self.loss(outs, targets)
            self.check_dead_outputs(st.output_grads[mb])
        elif s in self.spec.local_next:
            st.inbox[(s + 1, mb)] = outs  # the next stage is on this rank: hand over locally
        else:
            st.outputs[(s, mb)] = outs

    def tangents_for(self, s: int, mb: int, st: StepState) -> list[torch.Tensor]:
        r = self.runners[s]
        if s == self.spec.n_stages - 1:
            grads = st.output_grads.pop(mb)  # the step keeps the loss, not the logits' gradient
        else:
            by_name = st.tangents.pop((s, mb), {})
            grads = [by_name.get(name) for name in r.spec.sent]
        out = []
        for idx in r.tangent_outputs:
            g = grads[idx]
            out.append(g if g is not None else torch.zeros(r.out_meta[idx][0], dtype=r.out_meta[idx][1],
                                                           device=self.device))
        return out

    def backward(self, s: int, mb: int, st: StepState, halves: bool) -> None:
        """The whole backward, or (``halves``) its input-gradient half, stashing what the ``W`` event reads."""
        r = self.runners[s]
        tangents = self.tangents_for(s, mb, st)
        if halves:
            results = r.b(*st.saved[(s, mb)], *tangents)
            n_in = len(r.input_grad_pos)
            in_grads = dict(zip(sorted(r.input_grad_pos, key=r.input_grad_pos.get), results[:n_in], strict=True))
            st.stash[(s, mb)] = [*tangents, *results[n_in:]]
        else:
            results = r.backward(*st.saved.pop((s, mb)), *tangents)
            self.param_grads(r, s, mb, results, st)
            in_grads = {name: results[pos] for name, pos in r.input_grad_pos.items()}
        if s > 0:
            self.hand_back(s, mb, [in_grads[b.placeholder] for b in self.recv_meta[s] if b.has_grad], st)

    def weight_grads(self, s: int, mb: int, st: StepState) -> None:
        r = self.runners[s]
        stash = st.stash.pop((s, mb))
        n_t = len(r.tangent_outputs)
        results = r.w(*st.saved.pop((s, mb)), *stash[:n_t], *stash[n_t:])
        self.param_grads(r, s, mb, results, st)

    def hand_back(self, s: int, mb: int, grads: list[torch.Tensor], st: StepState) -> None:
        if s - 1 in self.spec.local_next:
            names = [b.value for b in self.recv_meta[s] if b.has_grad]
            st.tangents[(s - 1, mb)] = dict(zip(names, grads, strict=True))
        else:
            st.input_grads[(s, mb)] = grads

    def param_grads(self, r: StageRunner, s: int, mb: int, results: Any, st: StepState) -> None:
        """A backward's parameter gradients: ZeRO-2 keeps them for this microbatch's ``reduce`` event (so a whole
        gradient never outlives the backward that produced it); otherwise they are added to the stage's sums."""
        if self.spec.reduce_each_microbatch and r.reduce is not None:
            st.unreduced[(s, mb)] = list(results)
        else:
            self.accumulate(r, s, results, st)

    def accumulate(self, r: StageRunner, s: int, results: Any, st: StepState) -> None:
        """Add one microbatch's parameter gradients to the stage's sums (``fxpar.grad_sums``)."""
        st.grads.add(s, {fqn: results[pos] for pos, fqn in r.grad_fqn.items()})

    def reduce(self, s: int, mb: int | None, st: StepState) -> None:
        """Run the stage's ``reduce_grads``: on one microbatch's gradients (ZeRO-2), or on the step's sums."""
        r = self.runners[s]
        if mb is not None:
            results = st.unreduced.pop((s, mb))
            r.reduce_into(results)
            self.accumulate(r, s, results, st)
            return
        acc = st.grads.stage(s)
        names = [fqn for _, fqn in r.spec.deferred]
        st.grads.replace(s, dict(zip(names, r.reduce(*[acc[fqn] for fqn in names]), strict=True)))

    def totals(self, st: StepState) -> dict[str, torch.Tensor]:
        """Each gradient summed over this rank's stages (once every reduction has run)."""
        if st.totals is None:
            st.totals = st.grads.totals()
        return st.totals

    # -- point-to-point --------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], e: StepEvent, st: StepState) -> None:
        works = [dist.isend(t.contiguous(), c.ranks[1], tag=c.tag) for t, c in zip(tensors, e.comms, strict=True)]
        if e.kind == "SEND_F":
            st.forward_sends[(e.stage, e.mb)] = works
        else:
            st.sends[(e.stage, e.mb)] = works

    def recv(self, e: StepEvent) -> list[torch.Tensor]:
        out = []
        for c in e.comms:
            buf = torch.empty(c.shape, dtype=c.dtype, device=self.device)
            dist.irecv(buf, c.ranks[0], tag=c.tag).wait()
            out.append(buf)
        return out


def all_reduce_in_place(grad: torch.Tensor, group: Any) -> None:
    """Sum ``grad`` (a tied parameter's gradient) over ``group``, in place. A collective reduces a tensor's storage
    in memory order, so a gradient that is a transposed view (a head reading the tied weight as ``w.t()`` inside a
    ``cat``) is reduced as a contiguous copy and written back: reduced as it lay, gloo summed each rank's elements
    at the other's positions."""
    flat = grad.contiguous()
    dist.all_reduce(flat, group=group)
    if flat is not grad:
        grad.copy_(flat)


FORWARD_KINDS = frozenset({"gather", "F", "SEND_F", "RECV_F", "wait_sends", "loss"})


def forward_events(events: list[StepEvent]) -> list[StepEvent]:
    """A step's events as an evaluation runs them: the parameter gathers, forwards, their transfers, the wait for
    the sends and the loss, in the step's order. Sends never block (``isend``), so a rank waits only on the
    forward receives, which keep the order the full step proved deadlock-free; the groups inside a forward see
    the same forwards in the same order on every rank."""
    return [e for e in events if e.kind in FORWARD_KINDS]


def write_trace(path: str, events: list[dict[str, Any]], rank: int) -> None:
    """Every rank's step events, gathered, as one Chrome trace written by rank 0 (collective)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, events)
    if rank == 0:
        flat = [e for rank_events in gathered for e in rank_events]
        with open(path, "w") as f:
            json.dump({"traceEvents": flat, "displayTimeUnit": "ms"}, f)
