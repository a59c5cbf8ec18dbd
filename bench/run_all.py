"""``make bench``: the five benchmarks, one after the other, each writing its JSON and README table.

    .venv/bin/python bench/run_all.py                    # full run (about 10-15 min on 2 cores)
    .venv/bin/python bench/run_all.py --layers 2,8       # quick: compile time at 2 and 8 layers only

1. ``ledger_optimum.py``: communication ledger vs analytic optimum, every supported plan (compile-only);
2. ``compile_time.py``: parallelize vs bare export and joint capture at Llama-3-70B widths;
3. ``compare_dtensor.py``: step time and collectives vs hand-written DTensor on real gloo ranks;
4. ``pipeline.py``: pipeline bubble from real traces vs the simulator, and fxpar vs torch.distributed.pipelining;
5. ``zero.py``: fxpar zero=0 vs DDP and zero=1/2/3 vs FSDP2: bytes vs optimum, memory per rank, step time;
6. ``sequence_parallel.py``: fxpar tp and tp+SP vs DTensor's: bytes vs optimum, saved activations, step time.
7. ``recompute.py``: saved activations per recompute policy (predicted, measured, formula) and step time.
8. ``overlap.py``: overlap on vs off: step time and the fraction of collective bytes hidden behind compute.
9. ``fp8.py``: FP8 SNR against fp32 and tensor-parallel FP8 against single-device FP8.
10. ``context_parallel.py``: cp activation memory, bytes against the all-gather formula, causal balance.
11. ``expert_parallel.py``: ep parameter memory, all-to-all and all-reduce bytes against their formulas, routing.
13. ``mixed_precision.py``: bf16 mixed precision vs FSDP2's MixedPrecisionPolicy: bytes by dtype, step time.
14. ``compiled.py``: Plan(compile=True) vs eager, DDP eager and DDP + torch.compile: step time.
22. ``train_mode.py``: BatchNorm, dropout under SP and F.interpolate: ledger bytes vs optimum (compile-only).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def commands(layers: str, repeats: int) -> list[list[str]]:
    """The benchmark command lines, in the order they run."""
    py = sys.executable
    return [[py, os.path.join(HERE, "ledger_optimum.py")],
            [py, os.path.join(HERE, "compile_time.py"), "--layers", layers],
            [py, os.path.join(HERE, "compare_dtensor.py"), "--repeats", str(repeats)],
            [py, os.path.join(HERE, "pipeline.py")],
            [py, os.path.join(HERE, "zero.py")],
            [py, os.path.join(HERE, "sequence_parallel.py")],
            [py, os.path.join(HERE, "recompute.py")],
            [py, os.path.join(HERE, "overlap.py")],
            [py, os.path.join(HERE, "fp8.py")],
            [py, os.path.join(HERE, "context_parallel.py")],
            [py, os.path.join(HERE, "expert_parallel.py")],
            [py, os.path.join(HERE, "mixed_precision.py")],
            [py, os.path.join(HERE, "compiled.py")],
            [py, os.path.join(HERE, "train_mode.py")]]


def main() -> None:
    """Run every benchmark; stop at the first failure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="8,80", help="layer counts for compile_time.py")
    parser.add_argument("--repeats", type=int, default=3, help="launches per mesh for compare_dtensor.py")
    args = parser.parse_args()
    t0 = time.perf_counter()
    for cmd in commands(args.layers, args.repeats):
        print(f"\n== {' '.join(os.path.relpath(c) if c.endswith('.py') else c for c in cmd)}", flush=True)
        subprocess.run(cmd, check=True)
    print(f"\nall benchmarks done in {time.perf_counter() - t0:.0f} s; tables in bench/README.md")


if __name__ == "__main__":
    main()
