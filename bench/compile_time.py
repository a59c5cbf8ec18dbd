"""Table 2: compile time of ``fxpar.parallelize`` at Llama-3-70B widths against bare export and joint capture.

    .venv/bin/python bench/compile_time.py                  # 2, 8, 32, 80 layers (several minutes)
    .venv/bin/python bench/compile_time.py --layers 2,8     # quick run

The model is the bundled ``Llama`` with Llama-3-70B widths (hidden 8192, intermediate 28672, 64 heads,
8 kv heads, vocab 128256, max_seq 4096), built on the meta device; the input is (8, 4096) tokens and the
mesh a fake ``dp=8 x tp=8`` (64 ranks, ``llama_plan()``). Every measurement runs in a fresh subprocess
(``--worker``), so no trace, fake-tensor or rule cache carries over from one to the next:

* **bare**: ``torch.export.export(model, args, strict=False)``, then
  ``aot_export_joint_with_descriptors(stack, ep.module(), args)``, both under ``FakeTensorMode`` with
  fake parameters swapped in (as ``fxpar/capture.py`` does for a meta model); each timed.
* **parallelize**: ``fxpar.parallelize(...)`` end to end, with ``fxpar.api.capture`` and each pass of the
  pipeline wrapped by a timer (capture is not a pass, so ``pm.timings`` lacks it), then
  ``pm.program(rank=0)`` (lower rank 0 and print it).
* **parallelize, rule cache off** (``--uncached-layers``): the same, with propagate calling the uncached
  rule lookup (``candidates.__wrapped__``), to show what the memoized lookup saves.

Every block records wall and CPU seconds; the table shows CPU seconds, which another process sharing the
cores inflates far less than wall time (this single-threaded tracing work has CPU = wall when idle). Each
measurement runs ``--repeats`` times (default 2), each in a fresh process; the fastest is reported.

Results go to ``bench/results/compile_time.json`` and the ``compile`` section of ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from common import environment, markdown_table, publish

MESH = {"dp": 8, "tp": 8}
BATCH, SEQ = 8, 4096
WIDTHS = {"vocab_size": 128256, "hidden": 8192, "intermediate": 28672, "n_heads": 64, "n_kv_heads": 8,
          "max_seq": 4096, "rope_theta": 500000.0}
COMMAND = ".venv/bin/python bench/compile_time.py"
TIMEOUT_S = 1200


def build(layers: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The meta-device Llama at Llama-3-70B widths with ``layers`` blocks, and its (global) example input."""
    from fxpar.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=layers, **WIDTHS))
    return model, (torch.randint(0, WIDTHS["vocab_size"], (BATCH, SEQ)),)


@contextmanager
def timed(out: dict[str, dict[str, float]], name: str) -> Iterator[None]:
    """Record the block's wall and CPU (this process, all threads) seconds as ``out[name]``."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    out[name] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def bare(layers: int) -> dict[str, Any]:
    """Time bare ``torch.export`` and bare joint capture of the meta model, on fake tensors."""
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    model, args = build(layers)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:  # fake cpu tensors in place of meta ones: the joint of a meta model fails or truncates
        state = {n: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
                 for n, t in (*model.named_parameters(), *model.named_buffers())}
        for name, p in model.named_parameters():
            state[name] = torch.nn.Parameter(state[name], requires_grad=p.requires_grad)
        fake_args = tuple(torch.empty_strided(a.shape, a.stride(), dtype=a.dtype) for a in args)
    t: dict[str, dict[str, float]] = {}
    with _reparametrize_module(model, state, tie_weights=True), mode:
        with timed(t, "export"):
            ep = torch.export.export(model, fake_args, strict=False)
        with timed(t, "joint"), ExitStack() as stack:
            joint = aot_export_joint_with_descriptors(stack, ep.module(), fake_args)
    return {"times": t, "export_nodes": len(ep.graph.nodes), "joint_nodes": len(joint.graph_module.graph.nodes)}


def parallelize(layers: int, cached: bool = True) -> dict[str, Any]:
    """Time ``fxpar.parallelize`` (capture and every pass) and ``pm.program(rank=0)``.

    Capture (not a pass) is timed by wrapping ``fxpar.api.capture``, each pass by wrapping the pipeline's
    pass list (for CPU seconds; fxpar's own wall-clock ``pm.timings`` is kept too).
    """
    import fxpar.passes.propagate as propagate

    import fxpar
    import fxpar.api
    import fxpar.pipeline
    from fxpar.models.llama import llama_plan

    if not cached:
        propagate.candidates = propagate.candidates.__wrapped__
    t: dict[str, dict[str, float]] = {}
    seen: dict[str, Any] = {}
    capture, passes = fxpar.api.capture, fxpar.pipeline.passes

    def timed_capture(*args: Any) -> Any:
        with timed(t, "capture"):
            prog = capture(*args)
        seen["nodes"] = len(prog.graph.nodes)
        return prog

    def timed_pass(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(prog: Any, ctx: Any) -> Any:
            with timed(t, name):
                return fn(prog, ctx)
        return run

    fxpar.api.capture = timed_capture
    fxpar.pipeline.passes = lambda: [(name, timed_pass(name, fn)) for name, fn in passes()]
    model, args = build(layers)
    with timed(t, "parallelize"):
        pm = fxpar.parallelize(model, fxpar.Mesh(MESH, fake=True), args, plan=llama_plan())
    with timed(t, "program_rank0"):
        text = pm.program(rank=0)
    return {**seen, "times": t, "pass_names": [name for name, _ in passes()], "fxpar_timings_wall_s": pm.timings,
            "program_lines": text.count("\n"), "ledger_rows": len(pm.ledger(0)), "cached": cached}


WORKERS = {"bare": bare, "parallelize": parallelize,
           "parallelize_uncached": lambda layers: parallelize(layers, cached=False)}


def _children_cpu_s() -> float:
    """CPU seconds (user + sys) used so far by finished child processes."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_worker(kind: str, layers: int) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its result, wall time, CPU share and peak memory.

    ``cpu_share`` (the worker's CPU seconds over its wall seconds) is about 1 for this single-threaded
    tracing work on an idle machine; well below 1 means other processes took the cores and times are inflated.
    """
    cpu0, t0 = _children_cpu_s(), time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--layers", str(layers)],
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"worker {kind} at {layers} layers failed:\n{proc.stderr[-3000:]}")
    line = next(ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("RESULT "))
    return {**json.loads(line[len("RESULT "):]), "process_wall_s": wall,
            "cpu_share": (_children_cpu_s() - cpu0) / wall}


def fastest(kind: str, layers: int, repeats: int) -> dict[str, Any]:
    """The fastest of ``repeats`` fresh-process runs of one measurement (the least disturbed by other load)."""
    runs = [run_worker(kind, layers) for _ in range(repeats)]
    best = min(runs, key=lambda r: sum(v["cpu"] for k, v in r["times"].items() if k != "program_rank0"))
    return {**best, "repeats": repeats, "all_process_wall_s": [r["process_wall_s"] for r in runs]}


def worker_main(kind: str, layers: int) -> None:
    """Entry point of a worker subprocess: print one ``RESULT {json}`` line."""
    out = WORKERS[kind](layers)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(out))


def tables(results: dict[int, dict[str, Any]]) -> list[str]:
    """Markdown (CPU seconds): where parallelize's time goes next to bare capture, per layer count; the rule cache."""
    rows, cache_rows = [], []
    names = next(iter(results.values()))["parallelize"]["pass_names"]
    for layers, r in sorted(results.items()):
        b, p = r["bare"]["times"], r["parallelize"]["times"]
        bare_s = b["export"]["cpu"] + b["joint"]["cpu"]
        rows.append([layers, r["bare"]["joint_nodes"], f"{b['export']['cpu']:.1f}", f"{b['joint']['cpu']:.1f}",
                     f"{bare_s:.1f}", f"{p['capture']['cpu']:.1f}", *(f"{p[k]['cpu']:.2f}" for k in names),
                     f"{p['parallelize']['cpu']:.1f}", f"{p['parallelize']['cpu'] / bare_s:.2f}",
                     f"{p['parallelize']['wall']:.1f}", f"{p['program_rank0']['cpu']:.1f}",
                     f"{r['parallelize']['peak_rss_mb']:,.0f}"])
        if "parallelize_uncached" in r:
            u = r["parallelize_uncached"]["times"]
            cache_rows.append([layers, f"{u['propagate']['cpu']:.2f}", f"{p['propagate']['cpu']:.2f}",
                               f"{u['propagate']['cpu'] / p['propagate']['cpu']:.1f}x",
                               f"{u['parallelize']['cpu']:.1f}", f"{p['parallelize']['cpu']:.1f}"])
    share = min(r["cpu_share"] for per in results.values() for r in per.values())
    header = ["layers", "joint nodes", "export", "joint", "export + joint", "fxpar capture", *names, "parallelize",
              "parallelize / (export + joint)", "parallelize wall s", "program(rank=0)", "peak RSS MB"]
    lines = ["CPU seconds (wall seconds equal them on an idle machine; both are in the JSON):", "",
             *markdown_table(header, rows)]
    lines += ["", f"Lowest CPU share of a measurement process (CPU s / wall s): {share:.2f}"
              + ("" if share > 0.85 else " (the machine was busy: wall times are inflated, CPU times much less)") + "."]
    if cache_rows:
        lines += ["", "Rule lookup memoized vs not (CPU seconds, same run, fresh processes):", "",
                  *markdown_table(["layers", "propagate, uncached", "propagate, cached", "speed-up",
                                   "parallelize, uncached", "parallelize, cached"], cache_rows)]
    return lines


def main() -> None:
    """Run every (layers, worker) measurement in its own subprocess; save, print, update the README."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8,32,80", help="comma-separated layer counts")
    parser.add_argument("--uncached-layers", default="2,8,32",
                        help="layer counts at which to also time parallelize with the rule cache off ('' for none)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="fresh-process runs per measurement; the fastest is reported (default 2)")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker, int(args.layers))
        return
    layer_counts = [int(x) for x in args.layers.split(",")]
    uncached = {int(x) for x in args.uncached_layers.split(",") if x}
    t0 = time.perf_counter()
    results: dict[int, dict[str, Any]] = {}
    for layers in layer_counts:
        kinds = ["bare", "parallelize"] + (["parallelize_uncached"] if layers in uncached else [])
        for kind in kinds:
            results.setdefault(layers, {})[kind] = res = fastest(kind, layers, args.repeats)
            walls = ", ".join(f"{w:.1f}" for w in res["all_process_wall_s"])
            print(f"{layers} layers, {kind}: {walls} s per process", file=sys.stderr, flush=True)
    defaults = {"layers": "2,8,32,80", "uncached_layers": "2,8,32", "repeats": 2}
    command = COMMAND + "".join(f" --{k.replace('_', '-')} {getattr(args, k)!s}" for k, v in defaults.items()
                                if getattr(args, k) != v)
    lines = [f"`{command}` (mesh dp=8 x tp=8 fake, batch {BATCH} x seq {SEQ}, Llama-3-70B widths on meta; "
             f"each cell: the fastest of {args.repeats} fresh processes)", "",
             *tables(results)]
    data = {"env": environment(), "command": command, "mesh": MESH, "batch": BATCH, "seq": SEQ, "widths": WIDTHS,
            "results": results, "wall_s": time.perf_counter() - t0}
    path = publish("compile_time", "compile", lines, data, not args.no_readme)
    print(f"wrote {path} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
