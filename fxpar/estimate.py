"""``pm.estimate(cluster)``: step time, MFU, tokens/s and peak memory, read off the compiled rank programs.

Nothing here describes the model separately: every second comes from a node of a lowered rank graph.

* **One graph** (``graph_time``) is walked in the order it runs. Compute nodes advance the compute clock
  (``fxpar.costs``); a collective starts on its group's stream once issued and its stream is free; its
  ``wait_tensor`` holds the compute clock until it is done. So a collective the program overlaps costs
  only what the compute between its issue and its wait does not hide, and a synchronous one costs all
  of it. Nodes the ``recompute`` pass re-runs in the backward are counted apart. Under ``Plan(compile=True)``
  pointwise and reduction chains are costed as Inductor fuses them (``fxpar.costs.fused_bytes``).
* **Ranks sharing CPU cores** (``Cluster.measure`` with more ranks than cores): every wait and stage transfer
  also costs ``cluster.sync(group size)`` (peers the OS has not scheduled yet), and a pipeline's idle ranks give
  their cores to the busy ones (``_shared_cores``).
* **One step** is the pipeline schedule (``Schedule.simulate``) with per-(kind, stage) costs of the
  representative rank of each pipeline coordinate (coordinate 0 on every other axis: the largest shards
  when sizes are uneven); each stage boundary transfer is added to the action that sends it. Around it: the
  once-per-step parameter gather (ZeRO-1/2), gradient reduction and tied-weight sums, and the optimizer
  (AdamW reads parameter, gradient and two moments and writes three: 28 bytes per fp32 element).
* **Model FLOPs** are the forward FLOPs of the global (single-device) programs, times 3 for forward and
  backward, times the microbatches: 6 N per token plus attention, no recompute. MFU divides them by the
  step time and the dense bf16 peak of every device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fxpar.backends.comm import COLLECTIVES, group_arg_index
from fxpar.cluster import Cluster
from fxpar.costs import collective_time, compute_time, formula_text, node_flops
from fxpar.errors import PlanError
from fxpar.memory import Memory, zero_numels
from fxpar.memory import predict as predict_memory
from fxpar.rank_step import StepEvent, peer_rank, rank_step

if TYPE_CHECKING:
    from fxpar.compiled import Compiled

ADAM_BYTES_PER_ELEMENT = 7  # reads p, g, m, v; writes p, m, v (times the element size)


@dataclass
class GraphTime:
    """Seconds one graph takes: compute, recompute, and communication the compute did not hide, per axis."""

    compute: float = 0.0
    recompute: float = 0.0
    exposed: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0

    @property
    def total(self) -> float:
        return self.compute + self.recompute + sum(self.exposed.values())

    def add(self, other: GraphTime, times: float = 1.0) -> None:
        self.compute += other.compute * times
        self.recompute += other.recompute * times
        self.flops += other.flops * times
        for axis, t in other.exposed.items():
            self.exposed[axis] = self.exposed.get(axis, 0.0) + t * times


def graph_time(gm: fx.GraphModule, groups: dict[str, tuple[int, ...]], cluster: Cluster,
               fused: bool = False) -> GraphTime:
    """Walk ``gm`` in order with one compute clock and one stream per collective group (module docstring);
    ``fused`` (``Plan(compile=True)``): pointwise chains move only the bytes Inductor's fusion would."""
    out = GraphTime()
    clock = 0.0
    stream_free: dict[str, float] = {}
    done: dict[fx.Node, tuple[float, str, int]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        i = group_arg_index(n.target)
        if i is not None:
            row = n.meta["ledger_row"]
            group = n.args[i]
            start = max(clock, stream_free.get(group, 0.0))
            end = start + collective_time(COLLECTIVES[n.target], groups[group], row.bytes, cluster)
            stream_free[group] = end
            done[n] = (end, row.axis, len(groups[group]))
        elif COLLECTIVES.get(n.target) == "wait":
            end, axis, size = done.get(n.args[0], (clock, "", 1))
            end = max(end, clock) + cluster.sync(size)  # ranks sharing cores: waiting for peers to be scheduled
            if end > clock:
                out.exposed[axis] = out.exposed.get(axis, 0.0) + end - clock
                clock = end
        else:
            seconds, flops = compute_time(n, cluster, fused)
            clock += seconds
            out.flops += flops
            if n.meta.get("fxpar_recompute"):
                out.recompute += seconds
            else:
                out.compute += seconds
    return out


@dataclass
class Estimate:
    """What ``pm.estimate(cluster)`` predicts for one training step (seconds, FLOPs, bytes)."""

    step_time: float
    model_flops: float  # per step, all devices: 6 N per token plus attention, no recompute
    tokens: int  # per step
    devices: int
    peak_flops: float  # dense bf16 peak of one device (the MFU denominator)
    memory: Memory  # of the rank with the largest peak
    hbm_bytes: float
    breakdown: dict[str, float]  # seconds of the slowest pipeline rank's step, by cause
    cluster_name: str = ""
    mesh: str = ""

    @property
    def peak_memory(self) -> int:
        return self.memory.peak

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_time * self.devices * self.peak_flops) if self.step_time else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_time if self.step_time else 0.0

    @property
    def fits(self) -> bool:
        return self.peak_memory <= self.hbm_bytes

    def __str__(self) -> str:
        lines = [f"estimate on {self.cluster_name}, mesh {self.mesh}: step {self.step_time * 1e3:.3f} ms, "
                 f"MFU {self.mfu:.1%}, {self.tokens_per_s:,.0f} tokens/s",
                 f"  model FLOPs per step {self.model_flops:.4g} ({self.tokens:,} tokens)"]
        width = max(len(k) for k in self.breakdown)
        for name, seconds in self.breakdown.items():
            share = seconds / self.step_time if self.step_time else 0.0
            lines.append(f"  {name:<{width}}  {seconds * 1e3:12.3f} ms  {share:6.1%}")
        verdict = "fits" if self.fits else "DOES NOT FIT"
        lines.append(f"  memory per rank (max, rank {self.memory.rank}): {self.peak_memory / 2**30:.2f} GiB of "
                     f"{self.hbm_bytes / 2**30:.2f} GiB: {verdict} (params {self.memory.params / 2**30:.2f}, grads "
                     f"{self.memory.grads / 2**30:.2f}, optimizer {self.memory.optimizer / 2**30:.2f}, activations "
                     f"{self.memory.activations / 2**30:.2f}, transient {self.memory.transient / 2**30:.2f} GiB)")
        lines.append("  formulas:")
        lines += formula_text()
        return "\n".join(lines)


def estimate(c: Compiled, cluster: Cluster) -> Estimate:
    """Predict one ``pm.step`` of ``c`` on ``cluster`` (module docstring). Raises PlanError when the cluster
    has fewer devices than the mesh has ranks."""
    if cluster.gpus < c.mesh.size:
        raise PlanError(f"Cluster.gpus={cluster.gpus} but the mesh {c.mesh.describe()} has {c.mesh.size} ranks: "
                        f"cost it on a cluster with gpus={c.mesh.size}")
    ranks = [peer_rank(c, 0, p) if c.pp > 1 else 0 for p in range(c.pp)]
    per_rank = {r: _rank_costs(c, r, cluster) for r in ranks}
    sim = c.schedule.simulate(_action_costs(c, [per_rank[r].actions for r in ranks]))
    slowest = max(range(len(ranks)), key=lambda i: per_rank[ranks[i]].outside + sim.busy[i] if sim.busy else 0.0)
    costs = per_rank[ranks[slowest]]
    busy = sim.busy[slowest] if sim.busy else 0.0
    breakdown = {"compute": costs.inside.compute, "recompute": costs.inside.recompute}
    for axis, t in sorted(costs.inside.exposed.items()):
        breakdown[f"exposed comm {axis or '?'}"] = t
    breakdown["pp transfers"] = costs.transfers
    pipeline = _shared_cores(sim.makespan, sim.busy, cluster)
    breakdown["pipeline bubble"] = max(pipeline - busy, 0.0)
    if pipeline < busy:
        breakdown["cores idle ranks free"] = pipeline - busy
    for axis, t in sorted(costs.once.exposed.items()):
        key = f"exposed comm {axis} (once per step)"
        breakdown[key] = breakdown.get(key, 0.0) + t
    breakdown["once-per-step compute"] = costs.once.compute
    breakdown["optimizer"] = costs.optimizer
    breakdown = {k: v for k, v in breakdown.items() if v or k in ("compute", "pipeline bubble")}
    memory = max((predict_memory(c, r) for r in ranks), key=lambda m: m.peak)
    return Estimate(step_time=sum(breakdown.values()), model_flops=model_flops(c), tokens=tokens_per_step(c),
                    devices=c.mesh.size, peak_flops=cluster.peak_flops.get(torch.bfloat16,
                                                                           cluster.peak_flops[torch.float32]),
                    memory=memory, hbm_bytes=cluster.hbm_bytes, breakdown=breakdown, cluster_name=cluster.name,
                    mesh=c.mesh.describe())


def _shared_cores(makespan: float, busy: list[float], cluster: Cluster) -> float:
    """Seconds of the pipeline. With one device per rank, the simulated makespan. With ``k`` ranks per core
    (every cost above at a rank's 1/k share of the cores), a rank's idle time is CPU the others use: the larger
    of the critical path at full speed (makespan / k) and the ranks' total work over the cores (their mean)."""
    k = cluster.oversubscription
    if k <= 1 or not busy:
        return makespan
    return max(makespan / k, sum(busy) / len(busy))


@dataclass
class _RankCosts:
    actions: dict[tuple[str, int], float]  # (kind, stage) -> seconds, for the schedule simulator
    inside: GraphTime  # summed over the step's F/B/W events
    once: GraphTime  # once-per-step graphs (gather, reduce, tied)
    transfers: float
    optimizer: float

    @property
    def outside(self) -> float:
        return self.once.total + self.optimizer


def _rank_costs(c: Compiled, rank: int, cluster: Cluster) -> _RankCosts:
    """Per-(kind, stage) costs and the step totals of ``rank``, from its step events."""
    graph_cache: dict[tuple[int, str], GraphTime] = {}
    actions: dict[tuple[str, int], float] = {}
    inside, once = GraphTime(), GraphTime()
    transfers = 0.0
    last_compute: dict[int, tuple[str, int]] = {}
    for e in rank_step(c, rank):
        if e.kind in ("F", "B", "W") or (e.kind == "reduce" and e.mb is not None):
            t = _event_graph_time(c, rank, e, cluster, graph_cache)
            inside.add(t)
            kind = e.kind if e.kind != "reduce" else last_compute[e.stage][0]
            key = ("B" if kind == "W" and not c.schedule.has_w else kind, e.stage)  # a split B's W: the schedule's B
            actions[key] = actions.get(key, 0.0) + t.total
            last_compute[e.stage] = key
        elif e.kind.startswith("SEND_"):
            seconds = sum(collective_time("send", cm.ranks, cm.row.bytes, cluster) + cluster.sync(2)
                          for cm in e.comms)
            transfers += seconds
            key = (e.kind[-1], e.stage)
            actions[key] = actions.get(key, 0.0) + seconds
        elif e.kind in ("gather", "reduce"):
            once.add(_event_graph_time(c, rank, e, cluster, graph_cache))
        elif e.kind == "tied":
            cm = e.comms[0]
            t = collective_time("all_reduce", cm.ranks, cm.row.bytes, cluster)
            once.exposed["pp"] = once.exposed.get("pp", 0.0) + t
    _per_microbatch(actions, c)
    return _RankCosts(actions, inside, once, transfers, _optimizer_time(c, rank, cluster))


def _per_microbatch(actions: dict[tuple[str, int], float], c: Compiled) -> None:
    """Summed action costs -> the cost of one action (each (kind, stage) runs once per microbatch)."""
    for key in actions:
        actions[key] /= c.microbatches


def _action_costs(c: Compiled, per_rank: list[dict[tuple[str, int], float]]) -> dict[tuple[str, int], float]:
    """Every (kind, stage) the schedule runs, costed by the rank that holds the stage (0 when it costs nothing)."""
    kinds = ("F", "B", "W") if c.schedule.has_w else ("F", "B")
    out = {(kind, s): 0.0 for kind in kinds for s in range(len(c.stages))}
    for actions in per_rank:
        out.update(actions)
    return out


def _event_graph_time(c: Compiled, rank: int, e: StepEvent, cluster: Cluster,
                      cache: dict[tuple[int, str], GraphTime]) -> GraphTime:
    key = (e.stage, e.graph)
    if key not in cache:
        rp = c.rank_program(rank, e.stage)
        cache[key] = graph_time(c.stage_graph(rank, e.stage, e.graph), rp.groups, cluster, fused=c.plan.compile)
    return cache[key]


def _optimizer_time(c: Compiled, rank: int, cluster: Cluster) -> float:
    """AdamW over the rank's parameter shards: memory-bound, ``ADAM_BYTES_PER_ELEMENT`` element sizes each, plus
    ``cluster.optimizer_overhead`` per parameter tensor (an eager step's per-tensor ops)."""
    moved = 0
    tensors = 0
    seen: set[str] = set()
    for s in c.stage_of_rank(rank):
        prog, rp = c.stages[s], c.rank_program(rank, s)
        placeholders = [n for n in rp.forward.graph.nodes if n.op == "placeholder"]
        trainable = {fqn for fqn, _ in prog.signature.grads}
        for (fqn, name), node in zip(prog.signature.params, placeholders, strict=False):
            if fqn in seen or fqn not in trainable:
                continue
            seen.add(fqn)
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                shard = zero_numels(c, prog, rank, fqn, name)[1] if fqn in rp.zero else val.numel()
                moved += shard * val.element_size() * ADAM_BYTES_PER_ELEMENT
                tensors += 1
    return moved / cluster.memory_bandwidth + tensors * cluster.optimizer_overhead


def model_flops(c: Compiled) -> float:
    """Forward FLOPs of the global programs x 3 x microbatches (no recompute)."""
    fwd = 0.0
    for prog in c.stages:
        for n in prog.graph.nodes:
            if n.op == "call_function" and n.name in prog.provenance and prog.provenance[n.name].phase == "fwd":
                fwd += node_flops(n)
    return 3.0 * fwd * c.microbatches


def tokens_per_step(c: Compiled) -> int:
    """Tokens of one step: the first integer input's elements (token ids) x microbatches, else its batch."""
    prog = c.stages[0]
    sig = prog.signature
    received = len(prog.notes["stage"].received) if "stage" in prog.notes else 0
    first = None
    for name in sig.inputs[received:]:
        val = prog.node(name).meta.get("val")
        if isinstance(val, torch.Tensor):
            first = first if first is not None else val
            if not val.dtype.is_floating_point and val.dim() >= 1:
                return int(val.numel()) * c.microbatches
    return (int(first.shape[0]) if first is not None and first.dim() else 1) * c.microbatches
