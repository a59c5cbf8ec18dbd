"""Run one training step of a rank: the events ``fxpar.rank_step`` lists for it, in order.

``gather`` all-gathers ZeRO-1/2's parameter shards; ``F``/``B``/``W`` run the stage's lowered
forward, backward (or its input-gradient and weight-gradient halves) graphs on local tensors;
``SEND_*``/``RECV_*`` move stage boundary values with ``torch.distributed`` point-to-point calls, to
the peer and with the tag the event names (sends are asynchronous and awaited at
``wait_sends``; receives block, with the process group's timeout); ``reduce`` runs a stage's
``reduce_grads`` graph (after every backward under ZeRO-2, else once on the summed gradients);
``tied`` sums a weight's gradient over the pipeline ranks holding it; ``loss`` all-reduces the
step's mean loss. ``fxpar.verify`` checks this same list, so the proof covers what runs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from fxpar.backends.comm import bind_groups
from fxpar.compiled import Compiled
from fxpar.rank_step import StepEvent, boundary_meta
from fxpar.split import BATCH_AXIS, batch_weight, splitter


class StageRunner:
    """One stage's bound graphs on this rank, and where its inputs and outputs go."""

    def __init__(self, compiled: Compiled, rank: int, stage: int, names: dict[str, str]) -> None:
        prog, rp = compiled.stages[stage], compiled.rank_program(rank, stage)
        self.prog, self.rp = prog, rp
        self.forward = bind_groups(rp.forward, names)
        self.backward = bind_groups(rp.backward, names)
        self.reduce = bind_groups(rp.reduce_grads, names) if rp.reduce_grads is not None else None
        self.gather = bind_groups(rp.gather_params, names) if rp.gather_params is not None else None
        self.zero_fqns = list(dict.fromkeys(fqn for fqn, _ in prog.signature.params if fqn in rp.zero))
        sig = prog.signature
        self.num_outputs = sig.num_outputs
        self.tangent_outputs = [idx for _, idx in sig.tangents]
        self.param_fqns = [fqn for fqn, _ in sig.params]
        self.zero_positions = [i for i, fqn in enumerate(self.param_fqns) if fqn in rp.zero]
        self.grad_fqn = {idx - sig.num_outputs: fqn for fqn, idx in sig.grads}
        self.input_grad_pos = {name: idx - sig.num_outputs for name, idx in sig.input_grads}
        self.stage = prog.notes.get("stage")
        self.out_meta = [(list(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None
                         for v in (a.meta.get("val") if isinstance(a, fx.Node) else None
                                   for a in rp.forward.graph.output_node().args[0][: sig.num_outputs])]
        self.b = self.w = None
        if compiled.schedule.has_w:
            self.b = bind_groups(compiled.stage_graph(rank, stage, "backward_b"), names)
            self.w = bind_groups(compiled.stage_graph(rank, stage, "backward_w"), names)

    @property
    def received(self) -> list[str]:
        return list(self.stage.received) if self.stage is not None else []

    def reduce_into(self, results: list[Any]) -> None:
        """Replace the deferred gradients in a backward's ``results`` by their reduction (``reduce_grads``)."""
        positions = [pos for pos, _ in self.rp.deferred]
        for pos, g in zip(positions, self.reduce(*[results[p] for p in positions]), strict=True):
            results[pos] = g


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
    losses: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = field(default_factory=dict)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> fqn -> summed local grad
    totals: dict[str, torch.Tensor] | None = None  # fqn -> gradient summed over this rank's stages
    sends: list[Any] = field(default_factory=list)
    loss: torch.Tensor | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)


class StepExecutor:
    """Runs a rank's step events. Built once per ParallelModule; ``run`` is one training step.

    ``events`` is the list it runs (``fxpar.rank_step``); ``fxpar.verify(pm, events=...)`` checks a list.
    """

    def __init__(self, pm: Any, runners: dict[int, StageRunner], events: list[StepEvent], loss_fn: Any) -> None:
        self.pm, self.runners, self.events, self.loss_fn = pm, runners, events, loss_fn
        compiled = pm._compiled
        self.compiled, self.mesh, self.rank = compiled, compiled.mesh, pm._rank
        self.m = compiled.microbatches
        self.reduce_each_microbatch = compiled.plan.zero >= 2  # ZeRO-2: reduce-scatter after every backward
        self.n_stages = len(compiled.stages)
        coord = self.mesh.coord(self.rank)
        self.recv_meta = {s: boundary_meta(p, coord) for s, p in enumerate(compiled.stages) if s > 0}
        self.tie_groups = dict(pm._tie_groups)

    # -- the step ----------------------------------------------------------------------------------
    def run(self, mb_inputs: list[list[Any]], mb_targets: list[Any], trace: str | None) -> torch.Tensor:
        st = StepState(grads={s: {} for s in self.runners})
        t0 = time.perf_counter()
        with torch.no_grad():
            for event in self.events:
                start = time.perf_counter()
                self.dispatch(event, st, mb_inputs, mb_targets)
                if trace is not None:
                    st.trace.append({"name": event.label, "ph": "X", "ts": (start - t0) * 1e6,
                                     "dur": (time.perf_counter() - start) * 1e6, "pid": 0, "tid": self.rank,
                                     "cat": event.kind})
            for fqn, g in self.totals(st).items():
                self.pm.add_local_grad(fqn, g)
        if trace is not None:
            self.write_trace(trace, st.trace)
        assert st.loss is not None, "a step's events end with the loss"
        return st.loss

    def dispatch(self, e: StepEvent, st: StepState, mb_inputs: list[list[Any]], mb_targets: list[Any]) -> None:
        if e.kind == "gather":
            self.gather(e.stage)
        elif e.kind == "F":
            self.forward(e.stage, e.mb, st, mb_inputs[e.mb], mb_targets[e.mb])
        elif e.kind == "B":
            self.backward(e.stage, e.mb, st)
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
        elif e.kind == "wait_sends":
            for work in st.sends:
                work.wait()
            st.sends.clear()
        elif e.kind == "tied":
            dist.all_reduce(self.totals(st)[e.fqn], group=self.tie_groups[e.fqn])
        elif e.kind == "loss":
            st.loss = self.global_loss(st)
        else:
            raise AssertionError(f"unknown step event {e.kind!r}")

    def params(self, runner: StageRunner) -> list[torch.Tensor]:
        return [self.pm.local_param(fqn) for fqn in runner.param_fqns]

    def gather(self, s: int) -> None:
        """ZeRO-1/2: this stage's parameters, all-gathered from their dp shards for the step."""
        self.pm.gather_stage_params(self.runners[s])

    def forward(self, s: int, mb: int, st: StepState, inputs: list[Any], targets: Any) -> None:
        r = self.runners[s]
        received = st.inbox.pop((s, mb), []) if s > 0 else []
        user = [inputs[i] for i in r.stage.user_inputs] if r.stage is not None else inputs
        tensors = [x for x in user if isinstance(x, torch.Tensor)]
        results = r.forward(*self.params(r), *self.pm._buffers_of(s), *received, *tensors)
        outs, st.saved[(s, mb)] = list(results[: r.num_outputs]), list(results[r.num_outputs:])
        if s == self.n_stages - 1:
            st.losses[mb] = self.loss(outs, targets)
        elif self.compiled.schedule.stage_rank(s + 1) == self.compiled.schedule.stage_rank(s):
            st.inbox[(s + 1, mb)] = outs  # the next stage is on this rank: hand over locally
        else:
            st.outputs[(s, mb)] = outs

    def loss(self, outs: list[torch.Tensor], targets: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        leaves = [o.detach().requires_grad_() if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                  for o in outs]
        structured = pytree.tree_unflatten(leaves, self.compiled.out_spec)
        with torch.enable_grad():
            loss = self.loss_fn(structured, targets) if targets is not None else self.loss_fn(structured)
            (loss / self.m).backward()
        return loss.detach(), [x.grad if isinstance(x, torch.Tensor) else None for x in leaves]

    def tangents_for(self, s: int, mb: int, st: StepState) -> list[torch.Tensor]:
        r = self.runners[s]
        if s == self.n_stages - 1:
            grads = st.losses[mb][1]
        else:
            by_name = st.tangents.pop((s, mb), {})
            grads = [by_name.get(name) for name in r.stage.sent]
        out = []
        for idx in r.tangent_outputs:
            g = grads[idx]
            out.append(g if g is not None else torch.zeros(r.out_meta[idx][0], dtype=r.out_meta[idx][1]))
        return out

    def backward(self, s: int, mb: int, st: StepState) -> None:
        r = self.runners[s]
        tangents = self.tangents_for(s, mb, st)
        if r.b is not None:
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
        if self.compiled.schedule.stage_rank(s - 1) == self.compiled.schedule.stage_rank(s):
            names = [b.value for b in self.recv_meta[s] if b.has_grad]
            st.tangents[(s - 1, mb)] = dict(zip(names, grads, strict=True))
        else:
            st.input_grads[(s, mb)] = grads

    def param_grads(self, r: StageRunner, s: int, mb: int, results: Any, st: StepState) -> None:
        """A backward's parameter gradients: ZeRO-2 keeps them for this microbatch's ``reduce`` event (so a whole
        gradient never outlives the backward that produced it); otherwise they are added to the stage's sums."""
        if self.reduce_each_microbatch and r.reduce is not None:
            st.unreduced[(s, mb)] = list(results)
        else:
            self.accumulate(r, s, results, st)

    def accumulate(self, r: StageRunner, s: int, results: Any, st: StepState) -> None:
        """Add one microbatch's parameter gradients to the stage's sums."""
        acc = st.grads[s]
        for pos, fqn in r.grad_fqn.items():
            g = results[pos]
            if g is not None:
                acc[fqn] = g.clone() if fqn not in acc else acc[fqn].add_(g)

    def reduce(self, s: int, mb: int | None, st: StepState) -> None:
        """Run the stage's ``reduce_grads``: on one microbatch's gradients (ZeRO-2), or on the step's sums."""
        r = self.runners[s]
        if mb is not None:
            results = st.unreduced.pop((s, mb))
            r.reduce_into(results)
            self.accumulate(r, s, results, st)
            return
        acc = st.grads[s]
        names = [fqn for _, fqn in r.rp.deferred]
        acc.update(zip(names, r.reduce(*[acc[fqn] for fqn in names]), strict=True))

    def totals(self, st: StepState) -> dict[str, torch.Tensor]:
        """Each gradient summed over this rank's stages (once every reduction has run)."""
        if st.totals is None:
            st.totals = {}
            for s in sorted(self.runners):
                for fqn, g in st.grads[s].items():
                    st.totals[fqn] = g if fqn not in st.totals else st.totals[fqn] + g
        return st.totals

    # -- point-to-point --------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], e: StepEvent, st: StepState) -> None:
        for t, c in zip(tensors, e.comms, strict=True):
            st.sends.append(dist.isend(t.contiguous(), c.ranks[1], tag=c.tag))

    def recv(self, e: StepEvent) -> list[torch.Tensor]:
        out = []
        for c in e.comms:
            buf = torch.empty(c.shape, dtype=c.dtype)
            dist.irecv(buf, c.ranks[0], tag=c.tag).wait()
            out.append(buf)
        return out

    # -- end of step ---------------------------------------------------------------------------
    def global_loss(self, st: StepState) -> torch.Tensor:
        """The mean loss over microbatches and dp ranks, on every rank (one world all-reduce of a scalar)."""
        value = torch.zeros((), dtype=torch.float64)
        if st.losses:
            per_rank = self.mesh.size // self.compiled.pp
            value = torch.stack([loss.double() for loss, _ in st.losses.values()]).mean() / per_rank
            value = value * self.uneven_batch_weight()
        dist.all_reduce(value)
        return value.float()

    def uneven_batch_weight(self) -> float:
        """How much this rank's batch-mean loss weighs against ``1 / dp`` (``fxpar.split.batch_weight``)."""
        if self.mesh.axes.get(BATCH_AXIS, 1) == 1:
            return 1.0
        coord = self.mesh.coord(self.rank)[self.mesh.axis_index(BATCH_AXIS)]
        return batch_weight(splitter(self.compiled.stages[-1]), coord, self.mesh)

    def write_trace(self, path: str, events: list[dict[str, Any]]) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, events)
        if self.rank == 0:
            flat = [e for rank_events in gathered for e in rank_events]
            with open(path, "w") as f:
                json.dump({"traceEvents": flat, "displayTimeUnit": "ms"}, f)
