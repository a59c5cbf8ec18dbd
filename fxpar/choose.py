"""``python -m fxpar.choose``: the top plans for a bundled Llama on a preset cluster, and why the first wins.

    python -m fxpar.choose                                   # Llama-3-8B widths, 64 H100, seq 8192, 512 sequences
    python -m fxpar.choose --preset a100-80g --gpus 256 --layers 32 --batch 1024 --fixed tp=8 zero=1
"""

from __future__ import annotations

import argparse
import ast
import time

import torch

import fxpar
from fxpar.models.llama import Llama, LlamaConfig
from fxpar.testing.error_models import next_token_loss

WIDTHS_8B = {"vocab_size": 128256, "hidden": 4096, "intermediate": 14336, "n_heads": 32, "n_kv_heads": 8,
             "rope_theta": 500000.0}


def _fixed(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="h100-sxm", help="cluster preset: h100-sxm | a100-80g")
    parser.add_argument("--gpus", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=512, help="sequences per step")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--fixed", nargs="*", default=[], help="pinned mesh axes or Plan fields, e.g. tp=8 zero=1")
    args = parser.parse_args(argv)
    with torch.device("meta"):
        model = Llama(LlamaConfig(n_layers=args.layers, max_seq=args.seq, **WIDTHS_8B))
    tokens = torch.randint(0, WIDTHS_8B["vocab_size"], (args.batch, args.seq))
    cluster = fxpar.Cluster.preset(args.preset, gpus=args.gpus)
    print(f"Llama at Llama-3-8B widths, {args.layers} layers, {args.batch} x {args.seq} tokens per step on {cluster}")
    t = time.perf_counter()
    cands = fxpar.search(model, (tokens,), cluster, loss_fn=next_token_loss, fixed=_fixed(args.fixed), top=args.top)
    print(f"searched in {time.perf_counter() - t:.1f} s; top {len(cands)}:")
    for i, c in enumerate(cands):
        how = "compiled estimate" if c.confirmed else "closed form"
        print(f"  {i + 1}. mesh {c.mesh}: step {c.step_time:.3f} s, MFU {c.estimate.mfu:.1%} ({how})")
        print(f"     {str(c.plan).splitlines()[0]}")
    print()
    print(cands[0].explain())


if __name__ == "__main__":
    main()
