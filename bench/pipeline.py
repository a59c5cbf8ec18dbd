"""fxpar pipeline parallelism on real gloo ranks: traced bubble vs the schedule simulator, and fxpar vs
``torch.distributed.pipelining`` (P2P bytes, step time, loss), on the bundled Llama split in two stages.

One command, two launches of 2 gloo ranks (``pp=2``); about 35 seconds on 2 cores::

    .venv/bin/python bench/pipeline.py

1. **Bubble.** For each schedule (gpipe, 1f1b, zb-h1 on 2 stages split at ``layers.2``; interleaved-1f1b on
   4 stages split at ``layers.1/2/3``), ``WARMUP`` untraced steps, then ``TRACED`` steps with
   ``pm.step(..., trace=path)``, each after a barrier. From a trace: per-(kind, stage) mean compute time,
   busy time per rank, and the real bubble ``1 - sum(busy) / (ranks * makespan)``. The trace's ``ts`` is
   relative to each rank's own step start, so every rank also records ``time.perf_counter()`` just before
   ``pm.step`` (CLOCK_MONOTONIC: one clock for all processes of the machine) and events are placed on that
   common clock; the makespan runs from the earliest rank's start to the latest event end. The start skew
   between ranks is reported. ``pm.schedule.simulate(costs={(kind, stage): measured})`` gives the bubble the
   same compute times would have with free, instant transfers; ``pm.schedule.simulate()`` the unit-cost
   bubble, checked against the closed form in ``textbook_bubble``.
2. **fxpar vs torch.distributed.pipelining**, same model and weights, same split, same schedule (1f1b and
   gpipe) and microbatches. The torch baseline splits the model by hand (``StageModule``: stage 0 = embed +
   layers 0-1, stage 1 = layers 2-3 + norm + lm_head, rope tables as buffers, exactly ``Llama.forward``),
   wrapped in ``PipelineStage`` and ``Schedule1F1B``/``ScheduleGPipe``. P2P per step: fxpar from
   ``pm.ledger(rank)`` (checked against the ``dist.isend``/``dist.irecv`` calls of a real step), torch counted
   by wrapping ``torch.distributed.pipelining.schedules._batch_p2p`` (every P2P op of its single-stage
   schedules goes through it) during a steady-state step; both against the optimum ``2 * b * s * h * 4``
   bytes per boundary per step. Step time: ``zero_grad`` + one pipeline step (forward and backward of every
   microbatch, gradients in ``p.grad``; no optimizer, which is not part of pipelining), max over ranks;
   ``WARMUP`` steps each, then ``STEPS`` timed steps per system in ``ROUNDS`` interleaved rounds.
   Loss and gradients of the first step are compared with each other and with a single-device reference.

Results go to ``bench/results/pipeline.json`` and the ``pipeline`` section of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from fractions import Fraction
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as pp_schedules
import torch.nn.functional as F
from common import environment, markdown_table, publish, ratio
from fxpar.schedules import costs_from_trace
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor

import fxpar
from fxpar.models.llama import Llama, LlamaConfig
from fxpar.testing.launch import run_ranks

CONFIG = {"n_layers": 4, "hidden": 256, "intermediate": 512, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 512,
          "max_seq": 64}
BATCH, SEQ, MICROBATCHES, PP = 16, 64, 4, 2
SPLIT = ["layers.2"]
# (schedule, stage split): interleaved-1f1b needs 2 stages per rank
BUBBLE_RUNS: list[tuple[str, list[str]]] = [("gpipe", SPLIT), ("1f1b", SPLIT), ("zb-h1", SPLIT),
                                            ("interleaved-1f1b", ["layers.1", "layers.2", "layers.3"])]
COMPARE_SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
WARMUP, TRACED = 2, 3
STEPS, ROUNDS = 20, 4
COMMAND = ".venv/bin/python bench/pipeline.py"
COMPUTE = ("F", "B", "W")


def next_token_loss(logits: Any, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, a batch mean (the loss both fxpar and torch.pipelining are given)."""
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v), tokens[:, 1:].reshape(-1))


def build() -> tuple[Llama, torch.Tensor]:
    """The benchmark's model and token batch (same on every rank: seed 0)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**CONFIG))
    tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
    return model, tokens


def parallelize(model: Llama, tokens: torch.Tensor, schedule: str, split: list[str]) -> fxpar.ParallelModule:
    plan = fxpar.Plan(stages=split, schedule=schedule, microbatches=MICROBATCHES)
    return fxpar.parallelize(copy.deepcopy(model), fxpar.Mesh({"pp": PP}), (tokens,), plan=plan,
                             loss_fn=next_token_loss, example_targets=tokens)


# -- 1. bubble: trace vs simulator ------------------------------------------------------------------------------
def textbook_bubble(name: str, pp: int, v: int, m: int) -> Fraction:
    """Closed-form bubble of the unit-cost schedule (F=1, B=2; with a W split F=B=W=1), as a fraction of the
    makespan: idle per rank over (idle + busy). GPipe and 1F1B idle ``(p-1)(F+B)`` against ``m(F+B)`` busy;
    interleaved 1F1B with ``v`` chunks per rank idles ``(p-1)(F+B)`` chunk-units against ``v m (F+B)``;
    ZB-H1 idles ``(p-1)(F+B-W)`` against ``m(F+B+W)``."""
    if name in ("gpipe", "1f1b"):
        return Fraction(pp - 1, m + pp - 1)
    if name == "interleaved-1f1b":
        return Fraction(pp - 1, v * m + pp - 1)
    if name == "zb-h1":
        return Fraction(pp - 1, 3 * m + pp - 1)
    raise ValueError(name)


def analyze(events: list[dict[str, Any]], starts: list[float], schedule: Any) -> dict[str, Any]:
    """One traced step: measured costs, real and simulated bubble and makespan (seconds).

    ``starts[r]``: rank r's ``perf_counter()`` just before ``pm.step``; each event's ``ts`` (us) is relative
    to its rank's own step start, so ``starts[r] + ts`` places it on the machine's common monotonic clock.
    """
    ranks = len(starts)
    t0 = min(starts)
    end_common, end_own = 0.0, 0.0
    busy = [0.0] * ranks
    for e in events:
        r, start, dur = e["tid"], e["ts"] * 1e-6, e["dur"] * 1e-6
        end_common = max(end_common, starts[r] - t0 + start + dur)
        end_own = max(end_own, start + dur)
        if e["cat"] in COMPUTE:
            busy[r] += dur
    costs = costs_from_trace({"traceEvents": events})  # a 1f1b B that ran as halves counts both
    sim = schedule.simulate(costs)
    real = 1.0 - sum(busy) / (ranks * end_common)
    return {"costs": {f"{k}{s}": c for (k, s), c in sorted(costs.items(), key=lambda kv: (kv[0][1], kv[0][0]))},
            "busy_s": busy, "makespan_s": end_common, "makespan_own_t0_s": end_own, "skew_s": max(starts) - t0,
            "real_bubble": real, "real_bubble_own_t0": 1.0 - sum(busy) / (ranks * end_own),
            "sim_bubble": sim.bubble, "sim_makespan_s": sim.makespan, "real_over_sim": real / sim.bubble}


def bubble_main(trace_dir: str) -> dict[str, Any]:
    """Run in every rank: per schedule, warm up, then traced steps; rank 0 analyzes the traces."""
    rank = dist.get_rank()
    model, tokens = build()
    out: dict[str, Any] = {}
    for name, split in BUBBLE_RUNS:
        t = time.perf_counter()
        pm = parallelize(model, tokens, name, split)
        compile_s = time.perf_counter() - t
        for _ in range(WARMUP):
            pm.step(tokens, tokens)
        steps = []
        for i in range(TRACED):
            path = os.path.join(trace_dir, f"{name}-{i}.json")
            dist.barrier()
            start = time.perf_counter()
            pm.step(tokens, tokens, trace=path)
            starts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(starts, start)
            if rank == 0:
                with open(path) as f:
                    steps.append(analyze(json.load(f)["traceEvents"], starts, pm.schedule))
        unit = pm.schedule.simulate()
        sched = pm.schedule
        out[name] = {"split": split, "stages": sched.stages, "microbatches": sched.microbatches,
                     "unit_bubble": unit.bubble,
                     "textbook": str(textbook_bubble(name, sched.pp, sched.stages // sched.pp, sched.microbatches)),
                     "compile_s": compile_s, "steps": steps}
    return out


# -- 2. fxpar vs torch.distributed.pipelining ------------------------------------------------------------------
class StageModule(nn.Module):
    """Layers ``lo..hi-1`` of a ``Llama``, plus the embedding (first stage) or final norm and head (last stage),
    computing exactly what ``Llama.forward`` computes there. Parameter names are the model's
    (``layers.2.attn.q.weight``)."""

    def __init__(self, model: Llama, lo: int, hi: int) -> None:
        super().__init__()
        self.first, self.last = lo == 0, hi == len(model.layers)
        if self.first:
            self.embed = model.embed
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(lo, hi)})
        if self.last:
            self.norm, self.lm_head = model.norm, model.lm_head
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = x.shape[1]
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        if self.first:
            x = self.embed(x)
        for layer in self.layers.values():
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.last else x


class P2PCounter:
    """Counts point-to-point messages and bytes, by op ("send"/"recv"), while active.

    ``torch_pipelining``: wraps ``torch.distributed.pipelining.schedules._batch_p2p``; otherwise wraps
    ``torch.distributed.isend``/``irecv`` (what fxpar's executor calls).
    """

    def __init__(self, torch_pipelining: bool) -> None:
        self.torch_pipelining = torch_pipelining
        self.rows: dict[str, dict[str, int]] = {"send": {"count": 0, "bytes": 0}, "recv": {"count": 0, "bytes": 0}}

    def add(self, op: str, t: torch.Tensor) -> None:
        self.rows[op]["count"] += 1
        self.rows[op]["bytes"] += t.numel() * t.element_size()

    def __enter__(self) -> P2PCounter:
        if self.torch_pipelining:
            self.saved = [(pp_schedules, "_batch_p2p", pp_schedules._batch_p2p)]
            original = pp_schedules._batch_p2p

            def batch_p2p(ops: list[dist.P2POp], desc: str | None = None) -> Any:
                for op in ops:
                    self.add("send" if op.op is dist.isend else "recv", op.tensor)
                return original(ops, desc)

            pp_schedules._batch_p2p = batch_p2p
        else:
            self.saved = [(dist, "isend", dist.isend), (dist, "irecv", dist.irecv)]
            isend, irecv = dist.isend, dist.irecv

            def counted_isend(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.add("send", t)
                return isend(t, *args, **kwargs)

            def counted_irecv(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                self.add("recv", t)
                return irecv(t, *args, **kwargs)

            dist.isend, dist.irecv = counted_isend, counted_irecv
        return self

    def __exit__(self, *exc: Any) -> None:
        for obj, name, value in self.saved:
            setattr(obj, name, value)


def _ledger_p2p(pm: fxpar.ParallelModule, rank: int) -> dict[str, dict[str, int]]:
    rows: dict[str, dict[str, int]] = {"send": {"count": 0, "bytes": 0}, "recv": {"count": 0, "bytes": 0}}
    for row in pm.ledger(rank):
        if row.axis == "pp" and row.op in rows:
            rows[row.op]["count"] += 1
            rows[row.op]["bytes"] += row.bytes
    return rows


def _max_over_ranks(times: list[float]) -> list[float]:
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def compare_main() -> dict[str, Any]:
    """Run in every rank: fxpar and torch pipelines for each schedule; P2P, first-step loss and grads, step times."""
    rank = dist.get_rank()
    model, tokens = build()
    with torch.no_grad():
        reference = next_token_loss(model(tokens), tokens).item()
    layers = len(model.layers)
    cut = int(SPLIT[0].split(".")[1])
    submod = StageModule(copy.deepcopy(model), *((0, cut) if rank == 0 else (cut, layers)))
    result: dict[str, Any] = {"reference_loss": reference, "schedules": {}}
    for name, cls in COMPARE_SCHEDULES.items():
        pm = parallelize(model, tokens, name, SPLIT)
        stage = PipelineStage(submod, rank, PP, torch.device("cpu"))
        sched = cls(stage, n_microbatches=MICROBATCHES, loss_fn=next_token_loss)

        def fx_step(pm: fxpar.ParallelModule = pm) -> float:
            pm.zero_grad()
            return pm.step(tokens, tokens).item()

        def torch_step(sched: Any = sched) -> float:
            submod.zero_grad()
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(tokens)
            else:
                sched.step(target=tokens, losses=losses, return_outputs=False)
            loss = torch.tensor(float(torch.stack(losses).detach().mean()) if losses else 0.0, dtype=torch.float64)
            dist.all_reduce(loss)  # only the last stage has the losses: the sum is its mean
            return loss.item()

        # first step, from the same weights: loss and gradients
        fx_loss, torch_loss = fx_step(), torch_step()
        diff = torch.tensor(0.0, dtype=torch.float64)
        for fqn, p in pm.named_parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            diff = torch.maximum(diff, (g - submod.get_parameter(fqn).grad).abs().max().double())
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
        for _ in range(WARMUP):
            fx_step()
            torch_step()
        # P2P of one steady-state step: counted at run time, and fxpar's ledger
        with P2PCounter(torch_pipelining=False) as fx_count:
            fx_step()
        with P2PCounter(torch_pipelining=True) as torch_count:
            torch_step()
        times: dict[str, list[float]] = {"fxpar": [], "torch": []}
        steps = {"fxpar": fx_step, "torch": torch_step}
        for r in range(ROUNDS):
            for who in (["fxpar", "torch"] if r % 2 == 0 else ["torch", "fxpar"]):
                dist.barrier()
                for _ in range(STEPS // ROUNDS):
                    t = time.perf_counter()
                    steps[who]()
                    times[who].append(time.perf_counter() - t)
        result["schedules"][name] = {
            "loss": {"fxpar": fx_loss, "torch": torch_loss}, "max_abs_grad_diff": diff.item(),
            "p2p": {"fxpar_ledger": _ledger_p2p(pm, rank), "fxpar_observed": fx_count.rows,
                    "torch_observed": torch_count.rows},
            "times_s": {who: _max_over_ranks(ts) for who, ts in times.items()},
        }
    return result


# -- report ----------------------------------------------------------------------------------------------------
def _ms(x: float) -> str:
    return f"{1e3 * x:.1f}"


def _median_step(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The traced step with the median real bubble (odd count: a real step, not a blend)."""
    return sorted(steps, key=lambda s: s["real_bubble"])[len(steps) // 2]


def bubble_report(res: dict[str, Any]) -> list[str]:
    rows = []
    for name, r in res.items():
        med = _median_step(r["steps"])
        costs = ", ".join(f"{k} {_ms(v)}" for k, v in med["costs"].items())
        unit_ok = abs(r["unit_bubble"] - float(Fraction(r["textbook"]))) < 1e-12
        ratios = [s["real_over_sim"] for s in r["steps"]]
        rows.append([name, r["stages"], f"{r['unit_bubble']:.4f}", f"{r['textbook']}{'' if unit_ok else ' (differs!)'}",
                     costs, _ms(med["sim_makespan_s"]), _ms(med["makespan_s"]), f"{med['sim_bubble']:.3f}",
                     f"{med['real_bubble']:.3f}", f"{med['real_over_sim']:.2f}",
                     ", ".join(f"{x:.2f}" for x in ratios)])
    header = ["schedule", "stages", "unit-cost bubble (simulate())", "closed form",
              "measured ms per action (median step)",
              "simulated makespan ms", "real makespan ms", "simulated bubble", "real bubble", "real / simulated",
              f"real / simulated, each of {TRACED} steps"]
    skews = [s["skew_s"] for r in res.values() for s in r["steps"]]
    own = [f"{n} {_median_step(r['steps'])['real_bubble_own_t0']:.3f}" for n, r in res.items()]
    return [*markdown_table(header, rows), "",
            f"Start skew between the ranks' steps (after a barrier): {1e6 * min(skews):.0f}-{1e6 * max(skews):.0f} us. "
            f"Real bubble with each rank's makespan from its own start (max over ranks), same steps: "
            f"{', '.join(own)}.", ""]


def compare_report(res: list[dict[str, Any]]) -> list[str]:
    """``res``: per-rank results of ``compare_main``."""
    cfg = LlamaConfig(**CONFIG)
    optimum = 2 * BATCH * SEQ * cfg.hidden * 4  # activations forward + their gradients backward, one boundary
    p2p_rows, time_rows, notes = [], [], []
    for name in COMPARE_SCHEDULES:
        per_rank = [r["schedules"][name] for r in res]
        for who, key in (("fxpar (ledger)", "fxpar_ledger"), ("fxpar (observed)", "fxpar_observed"),
                         ("torch.pipelining (observed)", "torch_observed")):
            sent = sum(r["p2p"][key]["send"]["bytes"] for r in per_rank)
            received = sum(r["p2p"][key]["recv"]["bytes"] for r in per_rank)
            msgs = sum(r["p2p"][key]["send"]["count"] for r in per_rank)
            p2p_rows.append([name, who, msgs, sent, received, optimum, ratio(sent, optimum)])
        times = per_rank[0]["times_s"]  # already the max over ranks
        med = {who: statistics.median(ts) for who, ts in times.items()}
        for who in ("fxpar", "torch"):
            ts = times[who]
            time_rows.append([name, who, _ms(med[who]), _ms(min(ts)), _ms(max(ts))])
        loss = per_rank[0]["loss"]
        notes.append(f"{name}: fxpar/torch median step time **{med['fxpar'] / med['torch']:.2f}**; first-step loss "
                     f"fxpar {loss['fxpar']:.6f}, torch {loss['torch']:.6f}, |fxpar - torch| = "
                     f"{abs(loss['fxpar'] - loss['torch']):.2e} (single-device reference "
                     f"{res[0]['reference_loss']:.6f}); max |grad fxpar - grad torch| = "
                     f"{per_rank[0]['max_abs_grad_diff']:.2e}.  ")
    return [*markdown_table(["schedule", "system", "messages sent", "bytes sent", "bytes received",
                             "optimum bytes", "sent / opt"], p2p_rows), "",
            *markdown_table(["schedule", "system", "median step ms", "min ms", "max ms"], time_rows), "",
            *notes, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    args = parser.parse_args()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fxpar-pipeline-") as trace_dir:
        bubble = run_ranks(bubble_main, PP, trace_dir, timeout=400, collective_timeout=120)[0]
    compare = run_ranks(compare_main, PP, timeout=400, collective_timeout=120)
    cfg = LlamaConfig(**CONFIG)
    b, s, h, m = BATCH, SEQ, cfg.hidden, MICROBATCHES
    lines = [f"`{COMMAND}` (pp=2, 2 gloo ranks, 1 thread each; Llama {cfg.n_layers} layers, hidden {h}, "
             f"intermediate {cfg.intermediate}, vocab {cfg.vocab_size}; batch {b} x seq {s}, {m} microbatches)", "",
             f"**Bubble: trace vs simulator** ({WARMUP} warm-up steps, then {TRACED} traced steps per schedule; "
             "columns from the traced step with the median real bubble)", "", *bubble_report(bubble),
             f"**fxpar vs torch.distributed.pipelining** (split at `{SPLIT[0]}`; P2P of one steady-state step, both "
             f"ranks; optimum = 2 x {b} x {s} x {h} x 4 B per step; step time = zero_grad + step, max over ranks, "
             f"median of {STEPS} steps per system in {ROUNDS} interleaved rounds)", "", *compare_report(compare)]
    env = {**environment(), "backend": "gloo", "threads_per_rank": 1, "config": CONFIG, "batch": BATCH, "seq": SEQ,
           "microbatches": MICROBATCHES, "warmup": WARMUP, "traced": TRACED, "steps": STEPS, "rounds": ROUNDS,
           "wall_s": time.perf_counter() - t0}
    checks = []
    for name in COMPARE_SCHEDULES:
        per_rank = [r["schedules"][name] for r in compare]
        same = all(r["p2p"]["fxpar_ledger"] == r["p2p"]["fxpar_observed"] for r in per_rank)
        checks.append(f"{name}: fxpar ledger P2P == isend/irecv fxpar issued at run time: {same}")
    path = publish("pipeline", "pipeline", lines,
                   {"env": env, "command": COMMAND, "bubble": bubble, "compare": compare},
                   not args.no_readme, checks)
    print(f"wrote {path} ({env['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
