"""Run one training step of a rank: its schedule's actions over its stage programs.

``F``/``B``/``W`` run the stage's lowered forward, backward (or its input-gradient and
weight-gradient halves) graphs on local tensors; ``SEND_*``/``RECV_*`` move stage boundary values
between pipeline neighbours with ``torch.distributed`` point-to-point calls (sends are
asynchronous and awaited at the end of the step; receives block, with the process group's
timeout). Each message has its own tag, so transfers between the same pair of ranks never match
the wrong receive. After the last action, parameter gradients (summed over microbatches, still
partial over dp) are reduced once by each stage's ``reduce_grads`` graph; a weight held by two
stages on different ranks (tied embeddings) has its gradient summed across them.
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
from fxpar.backward_split import split_backward
from fxpar.ir import Program
from fxpar.lower import RankProgram
from fxpar.schedules import Action
from fxpar.split import BATCH_AXIS, batch_weight, splitter


@dataclass(frozen=True)
class Boundary:
    """One value a stage receives from the previous stage."""

    value: str  # the value's name in the model's forward graph (as the sender's ``StageInfo.sent`` lists it)
    placeholder: str  # the receiving program's input placeholder
    shape: list[int]  # local shape on a rank
    dtype: torch.dtype
    has_grad: bool  # the receiver sends its gradient back


def boundary_meta(prog: Program, coord: tuple[int, ...]) -> list[Boundary]:
    """Every value ``prog``'s stage receives on the rank at mesh ``coord``, in order."""
    stage = prog.notes["stage"]
    with_grad = {name for name, _ in prog.signature.input_grads}
    out = []
    for value, name in zip(stage.received, prog.signature.inputs[: len(stage.received)], strict=True):
        val = prog.node(name).meta["val"]
        shape = splitter(prog).local_shape(val.shape, prog.placements[name], coord)  # as annotate placed it
        out.append(Boundary(value, name, shape, val.dtype, name in with_grad))
    return out


class StageRunner:
    """One stage's bound graphs on this rank, and where its inputs and outputs go."""

    def __init__(self, prog: Program, rp: RankProgram, names: dict[str, str], split_w: bool) -> None:
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
        if split_w:
            b, w = split_backward(rp.backward, set(self.input_grad_pos.values()))
            self.b, self.w = bind_groups(b, names), bind_groups(w, names)

    @property
    def received(self) -> list[str]:
        return list(self.stage.received) if self.stage is not None else []


@dataclass
class StepState:
    """What one step keeps between actions, keyed by (stage, microbatch)."""

    inbox: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # received activations
    outputs: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # forward outputs to send
    saved: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    tangents: dict[tuple[int, int], dict[str, torch.Tensor]] = field(default_factory=dict)  # grads of sent values
    input_grads: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # to send back
    stash: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)  # B -> W values
    losses: dict[int, tuple[torch.Tensor, list[torch.Tensor | None]]] = field(default_factory=dict)
    grads: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # stage -> fqn -> summed local grad
    sends: list[Any] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)


class StepExecutor:
    """Runs a rank's action list. Built once per ParallelModule; ``run`` is one training step."""

    def __init__(self, pm: Any, runners: dict[int, StageRunner], actions: list[Action], loss_fn: Any) -> None:
        self.pm, self.runners, self.actions, self.loss_fn = pm, runners, actions, loss_fn
        compiled = pm._compiled
        self.compiled, self.mesh, self.rank = compiled, compiled.mesh, pm._rank
        self.m = compiled.microbatches
        self.reduce_each_microbatch = compiled.plan.zero >= 2  # ZeRO-2: reduce-scatter after every backward
        self.n_stages = len(compiled.stages)
        coord = self.mesh.coord(self.rank)
        self.recv_meta = {s: boundary_meta(p, coord) for s, p in enumerate(compiled.stages) if s > 0}

    # -- the step ----------------------------------------------------------------------------------
    def run(self, mb_inputs: list[list[Any]], mb_targets: list[Any], trace: str | None) -> torch.Tensor:
        st = StepState(grads={s: {} for s in self.runners})
        t0 = time.perf_counter()
        with torch.no_grad():
            for action in self.actions:
                start = time.perf_counter()
                self.dispatch(action, st, mb_inputs, mb_targets)
                if trace is not None:
                    st.events.append({"name": str(action), "ph": "X", "ts": (start - t0) * 1e6,
                                      "dur": (time.perf_counter() - start) * 1e6, "pid": 0, "tid": self.rank,
                                      "cat": action.kind})
            for work in st.sends:
                work.wait()
            self.finish_grads(st)
        loss = self.global_loss(st)
        if trace is not None:
            self.write_trace(trace, st.events)
        return loss

    def dispatch(self, a: Action, st: StepState, mb_inputs: list[list[Any]], mb_targets: list[Any]) -> None:
        if a.kind == "F":
            self.forward(a.stage, a.mb, st, mb_inputs[a.mb], mb_targets[a.mb])
        elif a.kind == "B":
            self.backward(a.stage, a.mb, st)
        elif a.kind == "W":
            self.weight_grads(a.stage, a.mb, st)
        elif a.kind == "SEND_F":
            self.send(st.outputs.pop((a.stage, a.mb)), a, st)
        elif a.kind == "RECV_F":
            meta = self.recv_meta[a.stage + 1]
            st.inbox[(a.stage + 1, a.mb)] = self.recv([(b.shape, b.dtype) for b in meta], a)
        elif a.kind == "SEND_B":
            self.send(st.input_grads.pop((a.stage, a.mb)), a, st)
        elif a.kind == "RECV_B":
            meta = [b for b in self.recv_meta[a.stage] if b.has_grad]
            grads = self.recv([(b.shape, b.dtype) for b in meta], a)
            st.tangents[(a.stage - 1, a.mb)] = {b.value: g for b, g in zip(meta, grads, strict=True)}

    def params(self, runner: StageRunner) -> list[torch.Tensor]:
        return [self.pm.local_param(fqn) for fqn in runner.param_fqns]

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
            self.accumulate(r, s, results, st)
            in_grads = {name: results[pos] for name, pos in r.input_grad_pos.items()}
        if s > 0:
            self.hand_back(s, mb, [in_grads[b.placeholder] for b in self.recv_meta[s] if b.has_grad], st)

    def weight_grads(self, s: int, mb: int, st: StepState) -> None:
        r = self.runners[s]
        stash = st.stash.pop((s, mb))
        n_t = len(r.tangent_outputs)
        results = r.w(*st.saved.pop((s, mb)), *stash[:n_t], *stash[n_t:])
        self.accumulate(r, s, results, st)

    def hand_back(self, s: int, mb: int, grads: list[torch.Tensor], st: StepState) -> None:
        if self.compiled.schedule.stage_rank(s - 1) == self.compiled.schedule.stage_rank(s):
            names = [b.value for b in self.recv_meta[s] if b.has_grad]
            st.tangents[(s - 1, mb)] = dict(zip(names, grads, strict=True))
        else:
            st.input_grads[(s, mb)] = grads

    def accumulate(self, r: StageRunner, s: int, results: Any, st: StepState) -> None:
        """Add one microbatch's parameter gradients to the stage's sums. ZeRO-2 reduces them first (over dp,
        into shards), so a whole gradient never outlives the backward that produced it."""
        acc = st.grads[s]
        if self.reduce_each_microbatch and r.reduce is not None:
            results = list(results)
            positions = [pos for pos, _ in r.rp.deferred]
            for pos, g in zip(positions, r.reduce(*[results[p] for p in positions]), strict=True):
                results[pos] = g
        for pos, fqn in r.grad_fqn.items():
            g = results[pos]
            if g is not None:
                acc[fqn] = g.clone() if fqn not in acc else acc[fqn].add_(g)

    # -- point-to-point --------------------------------------------------------------------------
    def peer_rank(self, pp_peer: int) -> int:
        coord = list(self.mesh.coord(self.rank))
        coord[self.mesh.axis_index("pp")] = pp_peer
        return self.mesh.rank_of(tuple(coord))

    def tag(self, a: Action, i: int) -> int:
        direction = 0 if a.kind.endswith("_F") else 1
        return ((a.stage * self.m + a.mb) * 2 + direction) * 64 + i

    def send(self, tensors: list[torch.Tensor], a: Action, st: StepState) -> None:
        dst = self.peer_rank(a.peer)
        for i, t in enumerate(tensors):
            st.sends.append(dist.isend(t.contiguous(), dst, tag=self.tag(a, i)))

    def recv(self, meta: list[tuple[list[int], torch.dtype]], a: Action) -> list[torch.Tensor]:
        src = self.peer_rank(a.peer)
        out = []
        for i, (shape, dtype) in enumerate(meta):
            buf = torch.empty(shape, dtype=dtype)
            dist.irecv(buf, src, tag=self.tag(a, i)).wait()
            out.append(buf)
        return out

    # -- end of step ---------------------------------------------------------------------------
    def finish_grads(self, st: StepState) -> None:
        """Reduce each stage's accumulated gradients over dp once, sum tied weights, write ``p.grad``."""
        total: dict[str, torch.Tensor] = {}
        for s in sorted(self.runners):
            r, acc = self.runners[s], st.grads[s]
            if r.reduce is not None and not self.reduce_each_microbatch:
                names = [fqn for _, fqn in r.rp.deferred]
                reduced = r.reduce(*[acc[fqn] for fqn in names])
                acc.update(zip(names, reduced, strict=True))
            for fqn, g in acc.items():
                total[fqn] = g if fqn not in total else total[fqn] + g
        for fqn, group in self.pm._tie_groups:
            dist.all_reduce(total[fqn], group=group)
        for fqn, g in total.items():
            self.pm.add_local_grad(fqn, g)

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
