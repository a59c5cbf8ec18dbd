"""fxpar vs hand-written DTensor Megatron TP: collectives, bytes and step time on the bundled Llama.

One command, launches its own gloo ranks (tp=2 on 2 ranks, then dp=2 x tp=2 on 4 ranks), ``--repeats``
times per mesh (default 3) for the spread of the step-time ratio::

    .venv/bin/python bench/compare_dtensor.py

Bytes of a collective are the full tensor it reduces or produces (fxpar's ledger definition): an
all_reduce counts its input, an all_gather its gathered output, a reduce_scatter its unscattered input.
DTensor's counts come from ``count_collectives`` (per-rank input bytes) and are converted to that
definition. On the 2-D mesh the DTensor model is ``parallelize_module``-d on the tp submesh and each
gradient is averaged over dp with one explicit ``all_reduce`` (as DDP without bucketing would).
Results go to ``bench/results/compare_dtensor.json`` and the ``dtensor`` section of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common import environment, publish
from dtensor_baseline import count_collectives, dtensor_megatron
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, llama_plan
from fxpar.testing.launch import run_ranks

BATCH, SEQ, N_LAYERS = 4, 32, 4
WARMUP, STEPS, ROUNDS = 3, 20, 4
MESHES: list[dict[str, int]] = [{"tp": 2}, {"dp": 2, "tp": 2}]
COMMAND = ".venv/bin/python bench/compare_dtensor.py"


def _loss(out: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss: mean of squared logits (as in ``dtensor_baseline.py``)."""
    return out.float().pow(2).mean()


def _split(counts: dict[str, Any], axis: str, size: int) -> dict[str, Any]:
    """``count_collectives`` output on one mesh axis -> ``{"kind@axis": {"count", "bytes"}}`` in full-tensor bytes.

    ``count_collectives`` counts each collective's per-rank input; only for all_gather is that smaller
    than the full tensor (by the group size). all_reduce and reduce_scatter inputs are already full.
    """
    scale = {"all_gather": size}
    kinds = [k for k, n in counts.items() if k not in ("total", "bytes") and n]
    return {f"{k}@{axis}": {"count": counts[k], "bytes": counts["bytes"].get(k, 0) * scale.get(k, 1)} for k in kinds}


class _FuncolCounter(TorchDispatchMode):
    """Counts ``_c10d_functional`` collectives and their full-tensor bytes (max of input and output).

    Used to check fxpar's ledger against what its rank graphs really issue: ``CommDebugMode`` cannot
    follow fxpar's backward (its module tracker raises ``KeyError: 'GraphModule'`` there).
    """

    def __init__(self) -> None:
        super().__init__()
        self.rows: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace == "_c10d_functional" and func._overloadpacket.__name__ != "wait_tensor":
            slot = self.rows.setdefault(func._overloadpacket.__name__, {"count": 0, "bytes": 0})
            slot["count"] += 1
            slot["bytes"] += max(args[0].numel() * args[0].element_size(), out.numel() * out.element_size())
        return out


def _ledger_split(pm: fxpar.ParallelModule, rank: int) -> dict[str, dict[str, Any]]:
    """``pm.ledger(rank)`` summed per phase and per ``op@axis``."""
    out: dict[str, dict[str, Any]] = {"fwd": {}, "bwd": {}}
    for row in pm.ledger(rank):
        slot = out[row.phase].setdefault(f"{row.op}@{row.axis}", {"count": 0, "bytes": 0})
        slot["count"] += 1
        slot["bytes"] += row.bytes
    return out


def _timed(step: Callable[[], None], n: int) -> list[float]:
    """Seconds of each of ``n`` calls to ``step``, after a barrier."""
    dist.barrier()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


def _stats(times: list[float]) -> dict[str, float]:
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times)}


def rank_main(axes: dict[str, int]) -> dict[str, Any]:
    """Run in every rank: build both models, count, check losses, time; return this rank's results."""
    torch.set_num_threads(1)
    rank, dp, tp = dist.get_rank(), axes.get("dp", 1), axes["tp"]
    cfg = LlamaConfig(n_layers=N_LAYERS)
    torch.manual_seed(0)
    reference = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ))
    dp_idx = rank // tp  # row-major mesh (dp, tp): last axis fastest
    local = tokens.chunk(dp)[dp_idx]
    ref_loss = _loss(reference(tokens)).item()

    pm = fxpar.parallelize(copy.deepcopy(reference), fxpar.Mesh(axes), (tokens,), plan=llama_plan())
    dmesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    dt = dtensor_megatron(copy.deepcopy(reference), dmesh["tp"], llama_plan())
    dp_group = dmesh["dp"].get_group()

    def sync_grads() -> None:
        """Average every gradient over dp: one all_reduce per parameter, in module order."""
        if dp == 1:
            return
        for p in dt.parameters():
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=dp_group)
            g.div_(dp)

    def global_loss(loss: torch.Tensor) -> float:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        return (loss / dist.get_world_size()).item()  # every tp rank holds its dp shard's loss

    # 1. collectives per step, forward and backward (DTensor's backward: autograd on tp, then the dp grad sync)
    state: dict[str, torch.Tensor] = {}
    with _FuncolCounter() as fx_fwd:
        state["fx"] = _loss(pm(local))
    with _FuncolCounter() as fx_bwd:
        state["fx"].backward()
    dt_fwd = count_collectives(lambda: state.update(dt=_loss(dt(local))))
    dt_bwd = count_collectives(lambda: state["dt"].backward())
    dt_sync = count_collectives(sync_grads)
    result: dict[str, Any] = {
        "fxpar": _ledger_split(pm, rank),
        "fxpar_observed": {"fwd": fx_fwd.rows, "bwd": fx_bwd.rows},
        "dtensor": {"fwd": _split(dt_fwd, "tp", tp), "bwd": {**_split(dt_bwd, "tp", tp), **_split(dt_sync, "dp", dp)}},
    }
    # 4. sanity: both equal the single-device reference loss (first step, before any update)
    result["loss"] = {"reference": ref_loss, "fxpar": global_loss(state["fx"]), "dtensor": global_loss(state["dt"])}
    # 2. analytic optimum for the Megatron plan
    act_bytes = (BATCH // dp) * SEQ * cfg.hidden * 4
    local_params = [p.to_local() if isinstance(p, DTensor) else p for p in dt.parameters()]
    param_bytes = sum(p.numel() * p.element_size() for p in local_params)
    tp_ar = {"all_reduce@tp": {"count": 2 * N_LAYERS, "bytes": 2 * N_LAYERS * act_bytes}}
    dp_ar = {"all_reduce@dp": {"count": len(local_params), "bytes": param_bytes}} if dp > 1 else {}
    result["optimum"] = {"fwd": tp_ar, "bwd": {**tp_ar, **dp_ar}}

    # 3. step time: forward + backward + AdamW, interleaved rounds
    fx_opt, dt_opt = torch.optim.AdamW(pm.parameters(), lr=1e-4), torch.optim.AdamW(dt.parameters(), lr=1e-4)

    def fx_step() -> None:
        fx_opt.zero_grad()
        _loss(pm(local)).backward()
        fx_opt.step()

    def dt_step() -> None:
        dt_opt.zero_grad()
        _loss(dt(local)).backward()
        sync_grads()
        dt_opt.step()

    _timed(fx_step, WARMUP)
    _timed(dt_step, WARMUP)
    times: dict[str, list[float]] = {"fxpar": [], "dtensor": []}
    per_round = STEPS // ROUNDS
    for r in range(ROUNDS):
        order = [("fxpar", fx_step), ("dtensor", dt_step)][:: 1 if r % 2 == 0 else -1]
        for name, step in order:
            times[name] += _timed(step, per_round)
    # a step lasts as long as its slowest rank
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    result["time"] = {name: _stats(ts) for name, ts in times.items()}
    result["time"]["ratio_fxpar_over_dtensor"] = (result["time"]["fxpar"]["median_ms"]
                                                  / result["time"]["dtensor"]["median_ms"])
    return result


def _totals(split: dict[str, dict[str, Any]]) -> dict[str, int]:
    """``{"count", "bytes"}`` summed over the kinds of one phase."""
    return {"count": sum(v["count"] for v in split.values()), "bytes": sum(v["bytes"] for v in split.values())}


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Per system and phase (fwd, bwd, step = both): totals, kinds, and ratios to the optimum."""
    out: dict[str, Any] = {}
    for who in ("optimum", "fxpar", "dtensor"):
        phases = {**res[who], "step": {}}
        for ph in ("fwd", "bwd"):  # "step" merges the phases, keeping kinds apart
            for kind, n in res[who][ph].items():
                slot = phases["step"].setdefault(kind, {"count": 0, "bytes": 0})
                slot["count"], slot["bytes"] = slot["count"] + n["count"], slot["bytes"] + n["bytes"]
        out[who] = {}
        for ph, split in phases.items():
            tot = _totals(split)
            opt = out["optimum"][ph] if who != "optimum" else tot
            out[who][ph] = {**tot, "kinds": ", ".join(f"{n['count']} {k}" for k, n in sorted(split.items())),
                            "count_ratio": tot["count"] / opt["count"], "bytes_ratio": tot["bytes"] / opt["bytes"]}
    return out


def report(axes: dict[str, int], res: dict[str, Any]) -> list[str]:
    """Markdown lines for one mesh: per-phase counts/bytes vs the optimum, step times over the runs, loss check."""
    name = " x ".join(f"{k}={v}" for k, v in axes.items())
    lines = [f"**{name}** ({math.prod(axes.values())} ranks; collectives of rank 0)", "",
             "| | phase | collectives | bytes | by kind | count / opt | bytes / opt |", "|---|---|---|---|---|---|---|"]
    for who in ("fxpar", "dtensor", "optimum"):
        phases = res["summary"][who]
        lines += [f"| {who} | {ph} | {r['count']} | {r['bytes']:,} | {r['kinds']} | {r['count_ratio']:.2f} | "
                  f"{r['bytes_ratio']:.2f} |" for ph, r in phases.items()]
    runs, loss = res["runs"], res["loss"]
    lines += ["", "| step time (fwd+bwd+AdamW) | median ms (median of runs) | per-run medians ms | min ms | max ms |",
              "|---|---|---|---|---|"]
    for who in ("fxpar", "dtensor"):
        medians = [r[who]["median_ms"] for r in runs]
        lines.append(f"| {who} | {statistics.median(medians):.1f} | {', '.join(f'{m:.1f}' for m in medians)} | "
                     f"{min(r[who]['min_ms'] for r in runs):.1f} | {max(r[who]['max_ms'] for r in runs):.1f} |")
    ratios = [r["ratio_fxpar_over_dtensor"] for r in runs]
    lines += ["", f"fxpar/DTensor median step time: **{statistics.median(ratios):.2f}** (median of {len(runs)} runs; "
              f"per run: {', '.join(f'{x:.2f}' for x in ratios)}).  ",
              f"Loss: reference {loss['reference']:.6f}; |fxpar - ref| = {abs(loss['fxpar'] - loss['reference']):.2e}; "
              f"|DTensor - ref| = {abs(loss['dtensor'] - loss['reference']):.2e}", ""]
    return lines


def run_mesh(axes: dict[str, int], repeats: int) -> dict[str, Any]:
    """``repeats`` independent launches on one mesh: collectives and loss of the first, step times of all."""
    runs = [run_ranks(rank_main, math.prod(axes.values()), axes, timeout=300, collective_timeout=120)[0]
            for _ in range(repeats)]
    res = runs[0]
    observed = {ph: _totals(res["fxpar_observed"][ph]) for ph in ("fwd", "bwd")}
    res["ledger_matches_observed"] = observed == {ph: _totals(res["fxpar"][ph]) for ph in ("fwd", "bwd")}
    res["collectives_same_in_every_run"] = all(r["fxpar"] == res["fxpar"] and r["dtensor"] == res["dtensor"]
                                               for r in runs)
    res["summary"] = summarize(res)
    res["runs"] = [r["time"] for r in runs]
    return res


def main() -> None:
    """Run every mesh ``--repeats`` times, check the ledger against what fxpar issued, print, save, update README."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="independent launches per mesh (default 3)")
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    args = parser.parse_args()
    t0 = time.perf_counter()
    results, lines = [], []
    for axes in MESHES:
        res = run_mesh(axes, args.repeats)
        lines += report(axes, res)
        results.append({"mesh": axes, **res})
    command = COMMAND + ("" if args.repeats == 3 else f" --repeats {args.repeats}")
    lines = [f"`{command}` ({args.repeats} launches per mesh, {ROUNDS} rounds of {STEPS // ROUNDS} timed steps "
             f"per system in each)", "", *lines]
    env = {**environment(), "backend": "gloo", "threads_per_rank": 1, "batch": BATCH, "seq": SEQ,
           "n_layers": N_LAYERS, "warmup": WARMUP, "steps": STEPS, "rounds": ROUNDS, "repeats": args.repeats,
           "wall_s": time.perf_counter() - t0}
    checks = [f"mesh {r['mesh']}: fxpar ledger == collectives fxpar issued at run time: "
              f"{r['ledger_matches_observed']}; collectives identical in every run: "
              f"{r['collectives_same_in_every_run']}" for r in results]
    path = publish("compare_dtensor", "dtensor", lines, {"env": env, "command": command, "results": results},
                   not args.no_readme, checks)
    print(f"wrote {path} ({env['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
