"""``torchrun -m fxpar.run --device cuda``: a saved rank program trains on a GPU as it trained in process.

Run on a machine with a CUDA GPU (``--smoke`` runs the same on the CPU with gloo, to check the script), from
outside the source tree when fxpar is installed there non-editable (``python -m fxpar.run`` would import the
tree's ``fxpar/``, whose ``fxpar.backends`` lives at the top level)::

    cd /tmp && python3 <repo>/bench/cuda_run.py --out <repo>/bench/results/cuda_run.json

1. In process, on a 1-rank NCCL mesh (``Mesh({"dp": 1}, device="cuda")``): the bundled Llama of ``cuda_path.py``
   (4 layers, hidden 256, fp32) is compiled, saved with ``pm.save`` and checkpointed, then trained 3 AdamW steps
   on batches of a token file; the trained weights are checkpointed.
2. ``torchrun --nproc_per_node 1 -m fxpar.run <folder> --checkpoint <initial> --data <tokens> --steps 3
   --device cuda --save <replayed>``: the saved program trains from the same weights on the same batches, without
   the model's code.
3. The two runs' losses and final weights are compared (bitwise where the GPU's kernels are deterministic).

Results: one JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from cuda_path import SMALL, TINY, next_token_loss

import fxpar
from fxpar import checkpoint
from fxpar.models.llama import Llama, LlamaConfig
from fxpar.testing.launcher import launch, logged_losses, read_checkpoint, token_batch, write_tokens

ROWS, STEPS, LR = 8, 3, 1e-3


def in_process(device: str, cfg: dict[str, int], folder: str, data: str, init: str, final: str) -> list[float]:
    """Compile, save the folder and the initial weights, train ``STEPS`` steps, save the trained weights."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**cfg))
    seq = cfg["max_seq"] - 1
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 1}, device=device),
                           (torch.zeros(ROWS, seq, dtype=torch.int64),), loss_fn=next_token_loss)
    pm.save(folder)
    checkpoint.save(pm, None, init)
    opt = torch.optim.AdamW(pm.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        tokens = token_batch(data, step, ROWS, seq).to(device)
        losses.append(float(pm.step(tokens[:, :-1], tokens[:, 1:])))
        opt.step()
        opt.zero_grad()
    checkpoint.save(pm, opt, final)
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/cuda_run.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo")
    args = p.parse_args()
    smoke = args.smoke or not torch.cuda.is_available()
    device = "cpu" if smoke else "cuda"
    cfg = TINY if smoke else SMALL
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    res: dict[str, Any] = {"torch": torch.__version__, "device": "cpu (smoke)" if smoke else
                           torch.cuda.get_device_name(0), "config": cfg, "steps": STEPS}
    with tempfile.TemporaryDirectory() as tmp:
        folder, data = os.path.join(tmp, "programs"), os.path.join(tmp, "train.bin")
        init, final, replayed = (os.path.join(tmp, n) for n in ("init", "final", "replayed"))
        write_tokens(data, 64 * ROWS * cfg["max_seq"], cfg["vocab_size"])
        if smoke:
            dist.init_process_group("gloo", rank=0, world_size=1)
        else:
            torch.cuda.set_device(0)
            dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
        res["in_process_losses"] = in_process(device, cfg, folder, data, init, final)
        dist.destroy_process_group()
        t = time.perf_counter()
        run = launch(folder, 1, "--checkpoint", init, "--data", data, "--steps", str(STEPS), "--device", device,
                     "--save", replayed, timeout=300)
        res["launch_s"] = time.perf_counter() - t
        res["returncode"] = run.returncode
        if run.returncode:
            res["stderr"] = run.stderr[-4000:]
        else:
            res["launched_losses"] = logged_losses(run.stdout)
            want, got = read_checkpoint(final), read_checkpoint(replayed)
            res["weights_compared"] = len(want)
            res["weights_not_bitwise"] = sorted(k for k in want if not torch.equal(want[k], got[k]))
            res["max_weight_diff"] = max(float((want[k].float() - got[k].float()).abs().max()) for k in want)
        res["losses_bitwise"] = res.get("launched_losses") == res["in_process_losses"]
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1), flush=True)
    sys.exit(0 if res["losses_bitwise"] else 1)


if __name__ == "__main__":
    main()
