"""Shared helpers of the benchmarks: machine description, exact ratios, markdown, README sections.

Each benchmark writes its JSON under ``bench/results/`` and its markdown table into a marked
section of ``bench/README.md`` (between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``),
so ``make bench`` regenerates the tables in place and the prose around them stays hand-written.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from fractions import Fraction
from typing import Any

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
README = os.path.join(BENCH_DIR, "README.md")


def cpu_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (Linux), else ``platform.machine()``."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


def environment() -> dict[str, Any]:
    """What a result depends on besides the code: torch, Python, CPU model and core count."""
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu_name(),
            "cpus": os.cpu_count()}


def ratio(num: int, den: int) -> str:
    """An exact ratio as text: ``1``, ``3/2`` (shown as ``1.500 (3/2)``); ``-`` when both are 0."""
    if den == 0:
        return "-" if num == 0 else "inf"
    r = Fraction(num, den)
    return str(r.numerator) if r.denominator == 1 else f"{float(r):.3f} ({r})"


def markdown_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    """A GitHub markdown table; ints get thousands separators."""
    def cell(v: Any) -> str:
        return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def save_json(name: str, data: Any) -> str:
    """Write ``data`` to ``bench/results/<name>.json``; return the path."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    path = os.path.join(RESULTS_DIR, f"{name}.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
    return path


def write_readme_section(name: str, lines: list[str], readme: str = README) -> None:
    """Replace the text between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->`` in the README.

    Raises ``ValueError`` if the markers are missing (the README's prose places the section).
    """
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    with open(readme) as f:
        text = f.read()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"{readme} has no {start} ... {end} section")
    body = "\n".join([start, *lines, end])
    with open(readme, "w") as f:
        f.write(pattern.sub(lambda _: body, text))


def publish(name: str, section: str, lines: list[str], data: Any, readme: bool, extra: list[str] = ()) -> str:
    """Save ``data`` as ``results/<name>.json``, print ``lines`` (then ``extra``), and unless ``readme`` is
    False write ``lines`` into the README section ``section``; return the JSON path."""
    path = save_json(name, data)
    print("\n".join([*lines, *extra]))
    if readme:
        write_readme_section(section, lines)
    return path


def bench_args(doc: str, flags: tuple[tuple[str, str], ...] = ()) -> argparse.Namespace:
    """The command line every single-command benchmark takes: ``--no-readme`` (print only), plus the script's own
    boolean ``flags`` (name, help)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--no-readme", action="store_true", help="print only; leave bench/README.md as it is")
    for flag, text in flags:
        parser.add_argument(flag, action="store_true", help=text)
    return parser.parse_args()


def publish_gloo_run(name: str, section: str, command: str, lines: list[str], results: Any, t0: float,
                     readme: bool, config: dict[str, Any], batch: int, seq: int, **data: Any) -> None:
    """``publish`` a gloo-rank benchmark of the bundled Llama: the environment, its ``config`` and batch, the
    wall time since ``t0``, any further ``data``, and every rank's ``results``; print where it went."""
    env = {**environment(), "backend": "gloo", "config": config, "batch": batch, "seq": seq,
           "wall_s": time.perf_counter() - t0}
    path = publish(name, section, lines, {"env": env, "command": command, **data, "ranks": results}, readme)
    print(f"wrote {path} ({env['wall_s']:.0f} s)")


def interleaved_step_times(runs: dict[str, tuple[Any, Any]], steps: int, rounds: int) -> dict[str, list[float]]:
    """Per system, ``steps`` timed training steps (``zero_grad``, ``step()``, ``opt.step``), in ``rounds`` rounds
    that alternate the systems' order; each time is the max over ranks. ``runs``: name -> (step, optimizer).

    Collective over the process group (a barrier before each system's turn, one all-reduce per system).
    """
    import time

    import torch.distributed as dist

    names = list(runs)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            step, opt = runs[name]
            dist.barrier()
            for _ in range(steps // rounds):
                t = time.perf_counter()
                opt.zero_grad()
                step()
                opt.step()
                out[name].append(time.perf_counter() - t)
    for name in names:
        times = torch.tensor(out[name], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out[name] = times.tolist()
    return out


def step_time_table(res: dict[str, Any], base: dict[str, str]) -> list[str]:
    """Markdown rows of each system's median and min step time, its ratio to its baseline (``base[name]``) and
    its first-step loss. ``res[name]`` holds ``"times"`` (seconds) and ``"first_loss"``."""
    import statistics

    rows = []
    for name, r in res.items():
        med = statistics.median(r["times"])
        vs = f"{med / statistics.median(res[base[name]]['times']):.2f} vs {base[name]}" if name in base else ""
        rows.append([name, f"{1e3 * med:.1f}", f"{1e3 * min(r['times']):.1f}", vs, f"{r['first_loss']:.6f}"])
    return markdown_table(["system", "median step ms", "min ms", "step-time ratio", "first-step loss"], rows)



def run_part(res: dict[str, Any], name: str, fn: Any, out: str, shown: int = 6000) -> None:
    """``res[name] = fn()`` (or its error and traceback: each part of a device run reports on its own), its wall
    time in ``res[name + "_wall_s"]``; the whole of ``res`` is written to ``out`` after every part and printed."""
    import traceback

    t = time.perf_counter()
    try:
        res[name] = fn()
    except Exception as e:  # noqa: BLE001 - one part's failure is recorded, the next part still runs
        res[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-4000:]}
    res[name + "_wall_s"] = time.perf_counter() - t
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"== {name} ({res[name + '_wall_s']:.1f} s)\n{json.dumps(res[name], indent=1)[:shown]}", flush=True)


def init_one_rank(device: torch.device, port: int) -> None:
    """A 1-rank process group on 127.0.0.1: NCCL on a GPU, gloo on the CPU (the scripts' ``--smoke``)."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    if device.type == "cpu":
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
