"""Table 2: compile time of ``fxpar.parallelize`` on HF Llama at Llama-3-70B and 405B widths against bare export.

    .venv/bin/python bench/compile_time.py                   # 70B at 8 and 80 layers, then the 405B case
    .venv/bin/python bench/compile_time.py --layers 2,8 --no-405b   # quick run

Every measurement runs in a fresh subprocess (``--worker``), so no trace, fake-tensor or rule cache
carries over from one to the next; each runs ``--repeats`` times (default 2) and the fastest is kept.

* **70B**: HF ``LlamaForCausalLM`` at Llama-3-70B widths (vocab 128256, hidden 8192, intermediate 28672,
  64 heads, 8 kv heads, max_position 4096, rope_theta 500000, sdpa, ``use_cache=False``) built on meta,
  input (8, 4096) tokens, fake mesh ``dp=8 x tp=8``, ``plan=hf_llama_plan()`` (Megatron tp).
  *export*: bare ``torch.export.export(model, args, strict=False)`` under ``FakeTensorMode`` with fake
  parameters swapped in for the meta ones (as ``fxpar/capture.py`` does); *fxpar*: ``fxpar.parallelize``
  (capture, passes, ``verify``) plus ``pm.program(rank=37)`` (rank 37's program, bound from its role, printed).
* **405B**: the same model at Llama-3-405B widths (hidden 16384, intermediate 53248, 128 heads, 8 kv
  heads) with 126 layers, fake ``pp=16 x dp=128 x tp=8`` (16,384 ranks), input (2048, 4096) tokens,
  ``Plan(tp=hf_llama_plan(), sequence_parallel=True, zero=1, stages=16, microbatches=16)``;
  *fxpar* times ``parallelize`` (``verify`` included), then ``pm.program(rank)`` for three ranks never asked
  before, and reads one rank's ledger and each stage's ``# holds`` line.

Each measured span ends with one ``gc.collect()``, timed inside it (``gc_s`` in the JSON): fxpar compiles with
automatic cyclic collection paused (``fxpar/gc_pause.py``), so the collection it defers is charged to it here rather
than to whatever the user runs next; the export side is charged its own collection, for symmetry.

With two or more layer counts, a ``nodes70`` worker at the lowest and highest counts (untimed) counts every
``torch.fx.Graph.create_node`` call of ``parallelize`` + ``program(rank=37)`` by the fxpar file that made it and
times the call itself: an exact, machine-independent account of where each added layer's cost goes.
A ``replay70`` worker at the highest count lowers rank 37 with lowering replay (``fxpar/lower/replay.py``) off and
on in turn in one process (10 of each) and checks that the two programs print the same.

Times are CPU seconds of the worker process (single-threaded tracing work: CPU = wall on an idle machine;
both are in the JSON). Results go to ``bench/results/compile_time.json`` and the ``compile`` section of
``bench/README.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import Counter
from typing import Any

import torch
from common import environment, markdown_table, publish

COMMAND = ".venv/bin/python bench/compile_time.py"
TIMEOUT_S = 1800
W70 = {"vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
       "num_key_value_heads": 8}
W405 = {"vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248, "num_attention_heads": 128,
        "num_key_value_heads": 8}
MESH70, MESH405 = {"dp": 8, "tp": 8}, {"pp": 16, "dp": 128, "tp": 8}
BATCH70, BATCH405, SEQ = 8, 2048, 4096
NEW_RANKS = (9003, 12345, 16383)


def build(widths: dict[str, int], layers: int, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """HF ``LlamaForCausalLM`` with ``widths`` and ``layers`` on meta, and a (batch, 4096) token input."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=SEQ, rope_theta=500000.0,
                      attn_implementation="sdpa", use_cache=False, **widths)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model, (torch.randint(0, widths["vocab_size"], (batch, SEQ)),)


def clock() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def since(t: tuple[float, float]) -> dict[str, float]:
    return {"cpu": time.process_time() - t[0], "wall": time.perf_counter() - t[1]}


def collected(spent: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """``spent`` plus one timed ``gc.collect()`` (what the measured work left for the collector), and that part."""
    t = clock()
    gc.collect()
    gc_s = since(t)
    return {k: spent[k] + gc_s[k] for k in spent}, gc_s


def bare_export(widths: dict[str, int], layers: int, batch: int) -> dict[str, Any]:
    """Bare non-strict ``torch.export`` of the meta model on fake parameters and inputs."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    model, args = build(widths, layers, batch)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # fake cpu tensors in place of meta ones, as fxpar's capture does
        state = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                 for n, t in (*model.named_parameters(), *model.named_buffers())}
        for name, p in model.named_parameters():
            state[name] = torch.nn.Parameter(state[name], requires_grad=p.requires_grad)
        fake_args = tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype) for a in args)
    with _reparametrize_module(model, state, tie_weights=True), mode:
        t = clock()
        ep = torch.export.export(model, fake_args, strict=False)
        took, gc_s = collected(since(t))
    return {"export": took, "gc_s": gc_s, "nodes": len(ep.graph.nodes)}


def fxpar_70b(layers: int) -> dict[str, Any]:
    """``parallelize`` + ``program(rank=37)`` at 70B widths on dp=8 x tp=8."""
    import fxpar
    from fxpar.models.llama import hf_llama_plan

    model, args = build(W70, layers, BATCH70)
    t = clock()
    pm = fxpar.parallelize(model, fxpar.Mesh(MESH70, fake=True), args, plan=hf_llama_plan())
    parallelize = since(t)
    t = clock()
    text = pm.program(rank=37)
    program, gc_s = collected(since(t))
    total = {k: parallelize[k] + program[k] for k in parallelize}
    return {"parallelize": parallelize, "program_37": program, "total": total, "gc_s": gc_s,
            "timings_wall_s": pm.timings, "program_lines": text.count("\n"),
            "captures": str(pm.captures), "proof": str(pm.proof)}


def fxpar_405b(layers: int) -> dict[str, Any]:
    """``parallelize`` of the 405B layout on 16,384 fake ranks; new ranks' programs; a ledger; the stage split."""
    import fxpar
    from fxpar.models.llama import hf_llama_plan
    from fxpar.testing.error_models import next_token_loss

    model, args = build(W405, layers, BATCH405)
    plan = fxpar.Plan(tp=hf_llama_plan(), sequence_parallel=True, zero=1, stages=16, microbatches=16)
    t = clock()
    pm = fxpar.parallelize(model, fxpar.Mesh(MESH405, fake=True), args, plan, loss_fn=next_token_loss)
    parallelize, gc_s = collected(since(t))
    programs = {}
    for rank in NEW_RANKS:
        t = clock()
        pm.program(rank=rank)
        programs[rank] = since(t)
    stage_ranks = [s * 128 * 8 for s in range(16)]
    holds = [next(ln for ln in pm.program(rank=r).splitlines() if ln.startswith("# holds"))[9:].strip()
             for r in stage_ranks]
    ledger = pm.ledger(NEW_RANKS[0])
    counts = Counter(f"{r.op}@{r.axis}" + (" per microbatch" if r.mb is not None else " per step") for r in ledger)
    return {"parallelize": parallelize, "gc_s": gc_s, "programs": programs, "holds": holds, "ledger_rank": NEW_RANKS[0],
            "ledger_counts": dict(counts), "proof": str(pm.proof), "timings_wall_s": pm.timings,
            "captures": str(pm.captures)}


def replay_70b(layers: int, pairs: int = 10) -> dict[str, Any]:
    """Lowering rank 37 of the 70B layout with replay (``fxpar/lower/replay.py``) on and off, in turn in one process:
    ``pairs`` of each (CPU s), a ``gc.collect()`` outside each timed span, and whether the two programs print the
    same."""
    import fxpar
    from fxpar.lower import lower, replay
    from fxpar.models.llama import hf_llama_plan
    from fxpar.printer import print_rank_program

    model, args = build(W70, layers, BATCH70)
    prog = fxpar.parallelize(model, fxpar.Mesh(MESH70, fake=True), args, plan=hf_llama_plan())._prog
    made: list[replay.LayerReplay] = []
    init = replay.LayerReplay.__init__

    def kept(self: replay.LayerReplay, lw: Any) -> None:
        init(self, lw)
        made.append(self)

    replay.LayerReplay.__init__ = kept  # type: ignore[method-assign]
    times: dict[str, list[float]] = {"on": [], "off": []}
    texts = {}
    for _ in range(pairs):
        for mode in ("off", "on"):
            os.environ[replay.REPLAY_ENV] = "1" if mode == "on" else "0"
            t = time.process_time()
            rp = lower(prog, 37)
            times[mode].append(time.process_time() - t)
            texts[mode] = print_rank_program(prog, rp)
            gc.collect()
    last = made[-1]
    return {"lower_cpu_s": times, "same_program": texts["on"] == texts["off"], "replayed": last.replayed,
            "recorded": len(last.recorded)}


def nodes_70b(layers: int) -> dict[str, Any]:
    """The fx nodes ``parallelize`` + ``program(rank=37)`` create at 70B widths, by the fxpar file that made them (an
    exact count), and the seconds spent inside ``Graph.create_node`` itself. The compile as a whole is not timed
    here: every call also looks up its caller on the stack."""
    import fxpar
    from fxpar.models.llama import hf_llama_plan

    made: Counter[str] = Counter()
    spent: Counter[str] = Counter()  # seconds inside ``create_node`` itself
    create_node, roots = torch.fx.Graph.create_node, _package_roots()

    def counted(graph: torch.fx.Graph, *args: Any, **kwargs: Any) -> torch.fx.Node:
        maker = _maker(sys._getframe(1), roots)
        made[maker] += 1
        t = time.perf_counter()
        node = create_node(graph, *args, **kwargs)
        spent[maker] += time.perf_counter() - t
        return node

    model, args = build(W70, layers, BATCH70)
    torch.fx.Graph.create_node = counted
    try:
        pm = fxpar.parallelize(model, fxpar.Mesh(MESH70, fake=True), args, plan=hf_llama_plan())
        pm.program(rank=37)
    finally:
        torch.fx.Graph.create_node = create_node
    return {"nodes_by_file": dict(made), "nodes": sum(made.values()), "create_s_by_file": dict(spent),
            "create_s": sum(spent.values())}


_NODE_HELPERS = {"fxpar/ir.py"}  # ``copy_node``: its caller made the node


def _package_roots() -> dict[str, str]:
    """fxpar's four installed packages' folders, each with the repository folder it comes from."""
    import fxpar.backends
    import fxpar.passes
    import fxpar.schedules

    import fxpar

    return {os.path.dirname(m.__file__) + os.sep: m.__name__.split(".")[-1]
            for m in (fxpar, fxpar.passes, fxpar.backends, fxpar.schedules)}


def _maker(frame: Any, roots: dict[str, str]) -> str:
    """The repository file whose code created a node (the innermost one on the stack), marked where torch's tracer
    (anything but ``torch.fx.Graph``'s own helpers: ``node_copy``, ``placeholder``, ...) came between."""
    traced = False
    while frame is not None:
        path = frame.f_code.co_filename
        root = next((r for r in roots if path.startswith(r)), None)
        name = f"{roots[root]}/{path[len(root):]}" if root is not None else None
        if name is not None and name not in _NODE_HELPERS:
            return f"{name} (torch's tracer)" if traced else name
        traced = traced or (name is None and not path.endswith(os.path.join("torch", "fx", "graph.py")))
        frame = frame.f_back
    return "torch"


def worker_main(kind: str, layers: int) -> None:
    """Entry point of a worker subprocess: print one ``RESULT {json}`` line."""
    out = {"export70": lambda: bare_export(W70, layers, BATCH70), "fxpar70": lambda: fxpar_70b(layers),
           "nodes70": lambda: nodes_70b(layers), "replay70": lambda: replay_70b(layers),
           "export405": lambda: bare_export(W405, layers, BATCH405), "fxpar405": lambda: fxpar_405b(layers)}[kind]()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def run_worker(kind: str, layers: int) -> dict[str, Any]:
    """One measurement in a fresh interpreter."""
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--layers", str(layers)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    if proc.returncode:
        raise RuntimeError(f"worker {kind} at {layers} layers failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def seconds(result: dict[str, Any]) -> float:
    """The CPU seconds a measurement is compared by."""
    return (result.get("total") or result.get("parallelize") or result["export"])["cpu"]


def fastest(kind: str, layers: int, repeats: int) -> dict[str, Any]:
    runs = [run_worker(kind, layers) for _ in range(repeats)]
    print(f"{kind} {layers} layers: " + ", ".join(f"{seconds(r):.1f}" for r in runs) + " CPU s", file=sys.stderr)
    return {**min(runs, key=seconds), "all_cpu_s": [seconds(r) for r in runs]}


def table_70b(r70: dict[int, dict[str, Any]]) -> list[str]:
    rows = []
    for layers, r in sorted(r70.items()):
        e, f = r["export70"], r["fxpar70"]
        t = f["timings_wall_s"]
        rows.append([layers, f"{e['export']['cpu']:.2f}", f"{f['parallelize']['cpu']:.2f}",
                     f"{f['program_37']['cpu']:.2f}", f"{f['total']['cpu']:.2f}",
                     f"{f['total']['cpu'] / e['export']['cpu']:.2f}", f"{t.get('capture', 0):.2f}",
                     f"{t.get('propagate', 0):.2f}", f"{f['peak_rss_mb']:,.0f}"])
    lines = ["**70B widths, fake dp=8 x tp=8** (CPU s; capture and propagate: fxpar's own wall-clock timings):", "",
             *markdown_table(["layers", "bare export + gc", "parallelize", "program(rank=37) + gc", "fxpar total",
                              "fxpar / export", "capture", "propagate", "peak RSS MB"], rows)]
    if len(r70) > 1:
        lo, hi = min(r70), max(r70)
        growth = r70[hi]["fxpar70"]["total"]["cpu"] / r70[lo]["fxpar70"]["total"]["cpu"]
        export_growth = r70[hi]["export70"]["export"]["cpu"] / r70[lo]["export70"]["export"]["cpu"]
        lines += ["", f"fxpar at {hi} layers / fxpar at {lo} layers: **{growth:.2f}x** "
                      f"(bare export: {export_growth:.2f}x)."]
    lines += ["", f"Captures at {max(r70)} layers: `{r70[max(r70)]['fxpar70']['captures']}`; "
                  f"proof: `{r70[max(r70)]['fxpar70']['proof']}`."]
    return lines


def table_nodes(counts: dict[int, dict[str, Any]], r70: dict[int, dict[str, Any]]) -> list[str]:
    """fx nodes created per added layer, by the file that made them (exact), and the time ``create_node`` itself
    took per added layer against fxpar's whole time per added layer (table above)."""
    lo, hi = min(counts), max(counts)
    a, b = counts[lo]["nodes_by_file"], counts[hi]["nodes_by_file"]
    per_layer = {f: (b.get(f, 0) - a.get(f, 0)) / (hi - lo) for f in {*a, *b}}
    rows = [[f"`{f}`", a.get(f, 0), b.get(f, 0), f"{n:.0f}"]
            for f, n in sorted(per_layer.items(), key=lambda kv: (-kv[1], kv[0])) if n]
    rows.append(["all", counts[lo]["nodes"], counts[hi]["nodes"],
                 f"{(counts[hi]['nodes'] - counts[lo]['nodes']) / (hi - lo):.0f}"])
    fxpar_s = {n: r70[n]["fxpar70"]["total"]["cpu"] for n in (lo, hi)}
    per_layer_ms = {"create": (counts[hi]["create_s"] - counts[lo]["create_s"]) / (hi - lo) * 1e3,
                    "fxpar": (fxpar_s[hi] - fxpar_s[lo]) / (hi - lo) * 1e3}
    return ["fx nodes `parallelize` + `program(rank=37)` create at 70B widths (an exact count: the same on any "
            "machine), by the fxpar file whose code made them:", "",
            *markdown_table(["made by", f"{lo} layers", f"{hi} layers", "per added layer"], rows), "",
            f"Inside `Graph.create_node` itself (a separate run that times each call): {per_layer_ms['create']:.1f} ms "
            f"per added layer, of the {per_layer_ms['fxpar']:.1f} ms per added layer fxpar's total grows by above "
            f"({per_layer_ms['create'] / per_layer_ms['fxpar']:.0%})."]


def table_replay(r: dict[str, Any], layers: int) -> list[str]:
    med = {mode: statistics.median(v) for mode, v in r["lower_cpu_s"].items()}
    low = {mode: min(v) for mode, v in r["lower_cpu_s"].items()}
    return [f"Lowering replay at {layers} layers (`lower(prog, 37)`, off and on in turn in one process, "
            f"{len(r['lower_cpu_s']['on'])} of each, CPU s): median off {med['off']:.2f}, on {med['on']:.2f} "
            f"(**{med['on'] / med['off']:.2f}x**); fastest off {low['off']:.2f}, on {low['on']:.2f} "
            f"({low['on'] / low['off']:.2f}x); {r['replayed']:,} nodes replayed from {r['recorded']:,} recorded "
            f"lowerings; programs identical: {r['same_program']}."]


def table_405b(e: dict[str, Any], f: dict[str, Any]) -> list[str]:
    new = max(p["cpu"] for p in f["programs"].values())
    rows = [[f"{e['export']['cpu']:.1f}", f"{f['parallelize']['cpu']:.1f}",
             f"{f['parallelize']['cpu'] / e['export']['cpu']:.2f}", f"{f['peak_rss_mb']:,.0f}",
             f"{e['peak_rss_mb']:,.0f}", f"{new:.2f}"]]
    lines = ["**405B widths, 126 layers, fake pp=16 x dp=128 x tp=8 (16,384 ranks)**, "
             "`Plan(tp=hf_llama_plan(), sequence_parallel=True, zero=1, stages=16, microbatches=16)` (CPU s):", "",
             *markdown_table(["bare export + gc", "parallelize (verify included) + gc", "parallelize / export",
                              "peak RSS MB (fxpar)", "peak RSS MB (export)",
                              f"slowest pm.program(rank) of ranks {', '.join(map(str, NEW_RANKS))} (never asked)"],
                             rows),
             "", f"Captures: `{f.get('captures')}`; proof: `{f['proof']}`.", "",
             f"Ledger of rank {f['ledger_rank']} (stage 8): "
             + ", ".join(f"{k} x{v}" for k, v in sorted(f["ledger_counts"].items())) + ".", "",
             "Layers per stage (`# holds` of each stage's program): "
             + "; ".join(f"{i}: {h}" for i, h in enumerate(f["holds"])) + "."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,80", help="comma-separated layer counts at 70B widths")
    parser.add_argument("--repeats", type=int, default=2, help="fresh-process runs per measurement (fastest kept)")
    parser.add_argument("--no-405b", action="store_true", help="skip the 405B case")
    parser.add_argument("--worker", choices=["export70", "fxpar70", "nodes70", "replay70", "export405", "fxpar405"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, int(args.layers))
        return
    t0 = time.perf_counter()
    r70 = {n: {kind: fastest(kind, n, args.repeats) for kind in ("export70", "fxpar70")}
           for n in map(int, args.layers.split(","))}
    lines = [f"`{COMMAND}` (each cell: the fastest of {args.repeats} fresh processes)", "", *table_70b(r70)]
    data: dict[str, Any] = {"env": environment(), "r70": r70}
    if len(r70) > 1:
        data["nodes70"] = {n: run_worker("nodes70", n) for n in (min(r70), max(r70))}
        lines += ["", *table_nodes(data["nodes70"], r70)]
    data["replay70"] = run_worker("replay70", max(r70))
    lines += ["", *table_replay(data["replay70"], max(r70))]
    if not args.no_405b:
        e405, f405 = fastest("export405", 126, args.repeats), fastest("fxpar405", 126, args.repeats)
        lines += ["", *table_405b(e405, f405)]
        data["r405"] = {"export": e405, "fxpar": f405}
    data["wall_s"] = time.perf_counter() - t0
    publish("compile_time", "compile", lines, data, not args.no_readme)


if __name__ == "__main__":
    main()
