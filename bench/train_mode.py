"""Training-mode layers on fake meshes: BatchNorm, dropout and ``F.interpolate``, ledger bytes against the optimum.

One command, one process, a few seconds (compile only: the counts are exact and machine-independent)::

    .venv/bin/python bench/train_mode.py

* **BatchNorm** (a ResNet of 10 BatchNorms, widths 64/128, batch 64 x 3 x 32 x 32, fake ``dp=8``): every dp
  collective of a step against SyncBatchNorm's optimum in the ledger's definition (the tensor a collective
  reduces): per BatchNorm two ``C``-sized statistics forward (mean, variance) and two backward (the sums of the
  input gradient), plus one all-reduce of every gradient but BatchNorm's own weight and bias gradients, which are
  those two sums (torch's ``SyncBatchNorm`` under DDP all-reduces both again).
* **Dropout under sequence parallelism** (the bundled Llama, 4 layers, hidden 256, dropout 0.1 after attention
  and MLP, batch 8 x 128, fake ``dp=2 x tp=4``, ``Plan(tp=llama_plan(), sequence_parallel=True)``): tp bytes per
  step with dropout against the same model without it (Megatron keeps dropout in the sequence-parallel region:
  no extra bytes).
* **A U-Net** (BatchNorm, transposed convolution, bilinear ``F.interpolate``, ``Dropout2d``; batch 64 x 3 x 32 x 32,
  fake ``dp=8``): dp bytes against the same optimum as the ResNet (no activation gathered).

Results go to ``bench/results/train_mode.json`` and the ``train_mode`` section of ``bench/README.md``.
"""

from __future__ import annotations

from typing import Any

import torch
from common import bench_args, markdown_table, publish, ratio

import fxpar
from fxpar.models.llama import llama, llama_plan
from fxpar.testing.user_models import SegmentationNet, TinyResNet

COMMAND = ".venv/bin/python bench/train_mode.py"
IMAGES = (64, 3, 32, 32)


def batch_norm_optimum(model: torch.nn.Module) -> int:
    """SyncBatchNorm's statistics (4 ``C``-sized fp32 tensors per BatchNorm) plus one all-reduce of every gradient
    but BatchNorm's own (its bias and weight gradients, ``sum(dy)`` and ``sum(dy * xhat)``, are two of the
    backward's statistics, already reduced), in bytes."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    stats = sum(4 * m.num_features * 4 for m in norms)
    own = sum(p.numel() * p.element_size() for m in norms for p in (m.weight, m.bias))
    return stats + sum(p.numel() * p.element_size() for p in model.parameters()) - own


def dp_bytes(model: torch.nn.Module, dp: int) -> dict[str, Any]:
    """Every dp collective of rank 0's step on a fake ``dp`` mesh: bytes and ops."""
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": dp}, fake=True), (torch.randn(IMAGES),))
    rows = [r for r in pm.ledger(0) if r.axis == "dp"]
    return {"bytes": sum(r.bytes for r in rows), "ops": sorted({r.op for r in rows}), "collectives": len(rows)}


def tp_bytes(dropout: float) -> int:
    model = llama(n_layers=4, hidden=256, intermediate=512, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq=128,
                  dropout=dropout)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2, "tp": 4}, fake=True), (torch.randint(0, 512, (8, 128)),),
                           plan=fxpar.Plan(tp=llama_plan(), sequence_parallel=True))
    return sum(r.bytes for r in pm.ledger(0) if r.axis == "tp")


def main() -> None:
    args = bench_args(__doc__)
    torch.manual_seed(0)
    rows, data = [], {}
    for name, model in (("ResNet, 10 BatchNorms", TinyResNet(width=64)), ("U-Net", SegmentationNet())):
        got, want = dp_bytes(model, 8), batch_norm_optimum(model)
        data[name] = {**got, "optimum": want}
        rows.append([name, "dp=8", ", ".join(got["ops"]), got["collectives"], got["bytes"], want,
                     ratio(got["bytes"], want)])
    with_dropout, without = tp_bytes(0.1), tp_bytes(0.0)
    data["llama dropout SP"] = {"with": with_dropout, "without": without}
    rows.append(["Llama 4 layers, dropout 0.1, SP", "dp=2 x tp=4 (tp bytes)", "all_gather, reduce_scatter, all_reduce",
                 "", with_dropout, without, ratio(with_dropout, without)])
    lines = [f"`{COMMAND}` (fake meshes, rank 0's ledger; optimum: SyncBatchNorm's 4 C-sized statistics per "
             "BatchNorm plus one all-reduce of every gradient but BatchNorm's own, or for dropout the same model "
             "without it)", "",
             *markdown_table(["model", "mesh", "ops", "collectives", "bytes", "optimum", "ratio"], rows), ""]
    publish("train_mode", "train_mode", lines, data, not args.no_readme)


if __name__ == "__main__":
    main()
