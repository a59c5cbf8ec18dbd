"""Table 1: fxpar's communication ledger against the analytic optimum, for every supported plan.

Compile-only (``fxpar.Mesh(axes, fake=True)``), so the counts are exact and machine-independent::

    .venv/bin/python bench/ledger_optimum.py

For each (model, mesh, plan) row, ``pm.ledger(rank)`` of rank 0 and of the last rank is summed per
phase and per ``op@axis`` and compared with an optimum derived from first principles (below, one
function per parallelism; bytes are the full tensor a collective reduces, as in the ledger):

* **Megatron tp** (column-parallel q, k, v, gate, up; row-parallel o, down): each block has two
  row-parallel outputs (attention ``o`` and MLP ``down``) whose partial sums must be reduced once in
  forward, and two points where a replicated activation fans out into column-parallel Linears (the
  attention and MLP inputs) whose input gradients are partial sums, reduced once in backward. So per
  layer 2 forward + 2 backward all-reduces over tp of ``b_local * s * h`` elements. Embedding, final
  norm and ``lm_head`` are replicated on tp and need nothing.
* **MLP colwise/rowwise**: 1 forward all-reduce of the ``b_local x out`` output; the backward one (of
  the input gradient, ``b_local x in``) exists only if the input requires a gradient.
* **dp** (DDP without bucketing): one all-reduce per parameter gradient in backward, over dp, of the
  parameter as a rank holds it (a tp-sharded weight counts ``numel / tp``; computed from the plan's
  styles, not from fxpar).

Results go to ``bench/results/ledger_optimum.json`` and the ``ledger`` section of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import fnmatch
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from common import environment, markdown_table, publish, ratio
from torch import nn

import fxpar
from fxpar.models.llama import Llama, LlamaConfig, hf_llama_plan, llama_plan
from fxpar.models.mlp import MLP, mlp_plan

Split = dict[str, dict[str, dict[str, int]]]  # phase -> "op@axis" -> {"count", "bytes"}
COMMAND = ".venv/bin/python bench/ledger_optimum.py"


@dataclass
class Case:
    """One (model, mesh, plan) row and the parallelism that gives its optimum."""

    model: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple[torch.Tensor, ...]]
    axes: dict[str, int]
    plan: dict[str, str] | None
    plan_name: str
    tp_optimum: Callable[[nn.Module, tuple[torch.Tensor, ...], int], Split]  # (model, inputs, dp) -> tp traffic


def _add(split: Split, phase: str, kind: str, count: int, nbytes: int) -> None:
    """Add ``count`` collectives of ``nbytes`` in all to ``split[phase][kind]`` (nothing if count is 0)."""
    if count:
        slot = split.setdefault(phase, {}).setdefault(kind, {"count": 0, "bytes": 0})
        slot["count"] += count
        slot["bytes"] += nbytes


def megatron_optimum(model: nn.Module, inputs: tuple[torch.Tensor, ...], dp: int) -> Split:
    """Per layer 2 tp all-reduces forward and 2 backward, each of ``b_local * s * h`` activation elements."""
    layers, h = _layers_hidden(model)
    b, s = inputs[0].shape
    act = (b // dp) * s * h * _itemsize(model)
    out: Split = {}
    for phase in ("fwd", "bwd"):
        _add(out, phase, "all_reduce@tp", 2 * layers, 2 * layers * act)
    return out


def _layers_hidden(model: nn.Module) -> tuple[int, int]:
    """(layers, hidden) of the bundled ``Llama`` (``model.cfg``) or an HF ``LlamaForCausalLM`` (``model.config``)."""
    if isinstance(model, Llama):
        return model.cfg.n_layers, model.cfg.hidden
    return model.config.num_hidden_layers, model.config.hidden_size


def mlp_optimum(model: nn.Module, inputs: tuple[torch.Tensor, ...], dp: int) -> Split:
    """1 forward all-reduce of the row-parallel output; 1 backward of the input gradient if one is needed."""
    x = inputs[0]
    b_local = x.shape[0] // dp
    out: Split = {}
    _add(out, "fwd", "all_reduce@tp", 1, b_local * model.down.out_features * _itemsize(model))
    if x.requires_grad:
        _add(out, "bwd", "all_reduce@tp", 1, b_local * model.up.in_features * _itemsize(model))
    return out


def dp_optimum(model: nn.Module, plan: dict[str, str] | None, tp: int) -> Split:
    """One backward all-reduce per parameter, totalling the parameter bytes one rank holds."""
    params = dict(model.named_parameters())  # tied weights once
    local = {name: p.numel() * p.element_size() for name, p in params.items()}
    for mod_name, mod in model.named_modules():
        style = next((st for glob, st in (plan or {}).items() if fnmatch.fnmatchcase(mod_name, glob)), None)
        for pname, _ in mod.named_parameters(recurse=False):
            full = f"{mod_name}.{pname}" if mod_name else pname
            sharded = style == "colwise" or (style == "rowwise" and pname == "weight")
            if sharded and full in local:
                local[full] //= tp
    out: Split = {}
    _add(out, "bwd", "all_reduce@dp", len(local), sum(local.values()))
    return out


def _itemsize(model: nn.Module) -> int:
    return next(model.parameters()).element_size()


def optimum(case: Case, model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> Split:
    """The analytic optimum of ``case``: tp traffic from its plan's formula plus, with dp, the gradient sync."""
    dp, tp = case.axes.get("dp", 1), case.axes.get("tp", 1)
    out: Split = case.tp_optimum(model, inputs, dp) if tp > 1 else {}
    if dp > 1:
        for phase, kinds in dp_optimum(model, case.plan, tp).items():
            for kind, v in kinds.items():
                _add(out, phase, kind, v["count"], v["bytes"])
    return out


def ledger_split(pm: fxpar.ParallelModule, rank: int) -> Split:
    """``pm.ledger(rank)`` summed per phase and per ``op@axis``."""
    out: Split = {}
    for row in pm.ledger(rank):
        _add(out, row.phase, f"{row.op}@{row.axis}", 1, row.bytes)
    return out


def with_step(split: Split) -> Split:
    """``split`` plus a ``step`` phase merging fwd and bwd (kinds kept apart)."""
    out: Split = {"fwd": split.get("fwd", {}), "bwd": split.get("bwd", {}), "step": {}}
    for phase in ("fwd", "bwd"):
        for kind, v in out[phase].items():
            _add(out, "step", kind, v["count"], v["bytes"])
    return out


def _totals(kinds: dict[str, dict[str, int]]) -> tuple[int, int]:
    return sum(v["count"] for v in kinds.values()), sum(v["bytes"] for v in kinds.values())


def _kinds(kinds: dict[str, dict[str, int]]) -> str:
    return ", ".join(f"{v['count']} {k}" for k, v in sorted(kinds.items())) or "-"


def cases() -> list[Case]:
    """Every supported plan: MLP and bundled/HF Llama under tp, dp and dp x tp, plus a 512-rank fake mesh."""
    from fxpar.models.hf import hf_llama

    def mlp_in() -> tuple[torch.Tensor, ...]:
        return (torch.randn(8, 32),)

    def tok(vocab: int, b: int = 4, s: int = 16) -> Callable[[], tuple[torch.Tensor, ...]]:
        return lambda: (torch.randint(0, vocab, (b, s)),)

    def meta_llama(**cfg: int) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            with torch.device("meta"):
                return Llama(LlamaConfig(**cfg))
        return build

    llama, kv4 = (lambda: Llama(LlamaConfig())), (lambda: Llama(LlamaConfig(n_kv_heads=4)))
    big = meta_llama(hidden=128, intermediate=256, n_heads=8, n_kv_heads=8)
    lp, hp, mp = llama_plan(), hf_llama_plan(), mlp_plan()
    return [
        Case("MLP 32-64-16", MLP, mlp_in, {"tp": 2}, mp, "mlp_plan", mlp_optimum),
        Case("MLP 32-64-16", MLP, mlp_in, {"dp": 2}, None, "-", mlp_optimum),
        Case("MLP 32-64-16", MLP, mlp_in, {"dp": 2, "tp": 2}, mp, "mlp_plan", mlp_optimum),
        Case("Llama 2L h64 kv2", llama, tok(256), {"tp": 2}, lp, "llama_plan", megatron_optimum),
        Case("Llama 2L h64 kv2", llama, tok(256), {"tp": 4}, lp, "llama_plan", megatron_optimum),
        Case("Llama 2L h64 kv4", kv4, tok(256), {"tp": 4}, lp, "llama_plan", megatron_optimum),
        Case("Llama 2L h64 kv2", llama, tok(256), {"dp": 2}, None, "-", megatron_optimum),
        Case("Llama 2L h64 kv2", llama, tok(256), {"dp": 2, "tp": 2}, lp, "llama_plan", megatron_optimum),
        Case("HF Llama 2L h64 kv2", hf_llama, tok(128), {"tp": 2}, hp, "hf_llama_plan", megatron_optimum),
        Case("HF Llama 2L h64 kv2", hf_llama, tok(128), {"dp": 2, "tp": 2}, hp, "hf_llama_plan", megatron_optimum),
        Case("Llama 2L h128 kv8 (meta)", big, tok(256, b=128), {"dp": 64, "tp": 8}, lp, "llama_plan",
             megatron_optimum),
    ]


def run_case(case: Case) -> dict[str, Any]:
    """Compile ``case`` on a fake mesh; ledgers of rank 0 and the last rank, and the optimum."""
    torch.manual_seed(0)
    model, inputs = case.build(), case.inputs()
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = fxpar.parallelize(model, fxpar.Mesh(case.axes, fake=True), inputs, plan=case.plan)
        ranks = sorted({0, pm.mesh.size - 1})
        ledgers = {rank: with_step(ledger_split(pm, rank)) for rank in ranks}
    return {"model": case.model, "mesh": case.axes, "plan": case.plan_name, "ranks": ranks,
            "fxpar": ledgers[0], "same_on_ranks": all(led == ledgers[0] for led in ledgers.values()),
            "optimum": with_step(optimum(case, model, inputs)), "compile_s": time.perf_counter() - t0,
            "warnings": sorted({str(w.message) for w in caught})}


def table(results: list[dict[str, Any]]) -> list[str]:
    """Markdown rows per (case, phase): fxpar vs optimum collectives and bytes, with exact ratios."""
    rows = []
    for r in results:
        mesh = " x ".join(f"{k}={v}" for k, v in r["mesh"].items())
        for phase in ("fwd", "bwd", "step"):
            fx, opt = r["fxpar"][phase], r["optimum"][phase]
            (fc, fb), (oc, ob) = _totals(fx), _totals(opt)
            rows.append([r["model"], mesh, r["plan"], phase, _kinds(fx), _kinds(opt), ratio(fc, oc), fb, ob,
                         ratio(fb, ob)])
    header = ["model", "mesh", "plan", "phase", "fxpar collectives", "optimum", "count / opt", "fxpar bytes",
              "optimum bytes", "bytes / opt"]
    return markdown_table(header, rows)


def main() -> None:
    """Run every case, save JSON, print the table and write it into bench/README.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    args = parser.parse_args()
    t0 = time.perf_counter()
    results = [run_case(c) for c in cases()]
    lines = [f"`{COMMAND}` (rank 0; every row also checked on the last rank: "
             f"{'identical' if all(r['same_on_ranks'] for r in results) else 'DIFFERENT, see JSON'})", "",
             *table(results)]
    path = publish("ledger_optimum", "ledger", lines, {"env": environment(), "command": COMMAND, "results": results,
                                                       "wall_s": time.perf_counter() - t0}, not args.no_readme)
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
