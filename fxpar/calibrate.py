"""``Cluster.measure``'s calibration: the fraction of the measured rates that a reference block achieves.

``fxpar.measure`` times matmuls, copies and collectives; a real rank program also pays autograd, allocation,
attention kernels and cache sharing between ranks, which those micro-benchmarks leave out. This module runs the
forward and backward of a one-layer bundled Llama (hidden 256, 2 x 128 tokens) eagerly on ``ranks`` threads at once,
and once through fxpar's runtime against eager mode, and compares that with its compute as ``pm.estimate`` costs it
on the measured cluster. The ratio becomes ``flops_fraction`` and ``hbm_fraction``. It needs ``parallelize``, so it
registers itself with ``fxpar.cluster`` (imported by ``fxpar``'s ``__init__``) rather than being imported by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from fxpar.api import parallelize
from fxpar.cluster import Cluster, register_calibration
from fxpar.measure import intra_op_threads, one_rank_world, typical, units_per_second
from fxpar.mesh import Mesh


def calibrated(cluster: Cluster, ranks: int) -> Cluster:
    """``cluster`` with ``flops_fraction`` and ``hbm_fraction`` set to ``achieved_fraction``."""
    fraction = achieved_fraction(cluster, ranks)
    return dataclasses.replace(cluster, flops_fraction=fraction, hbm_fraction=fraction)


def achieved_fraction(cluster: Cluster, ranks: int) -> float:
    """Predicted over measured compute of the reference block: its forward and backward run eagerly by ``ranks``
    threads at once, times how much slower fxpar's runtime runs it than eager mode (one thread, in a one-rank
    world; 1 on a launched rank, where none can be made), against its compute as ``pm.estimate`` costs it."""
    model, tokens, loss = _reference_block()
    predicted = parallelize(model, Mesh({"dp": 1}, fake=True), (tokens,), loss_fn=loss) \
        .estimate(dataclasses.replace(cluster, gpus=1)).breakdown["compute"]
    eager = 1 / units_per_second(ranks, lambda: loss(model(tokens), tokens).backward(), 1.0)
    slowdown = 1.0
    with one_rank_world() as owned:
        if owned:
            pm = parallelize(model, Mesh({"dp": 1}), (tokens,), loss_fn=loss)
            with intra_op_threads(1):
                slowdown = typical(lambda: pm.step(tokens, tokens), 5) / typical(
                    lambda: loss(model(tokens), tokens).backward(), 5)
    return min(max(predicted / (eager * max(slowdown, 1.0)), 0.05), 1.0)


def _reference_block() -> tuple[torch.nn.Module, torch.Tensor, Callable[..., torch.Tensor]]:
    """A one-layer bundled Llama (hidden 256), 2 x 128 tokens and its next-token loss (imported here: ``fxpar.run``
    must start without the bundled models)."""
    from fxpar.models.llama import Llama, LlamaConfig

    def loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1, hidden=256, intermediate=512, n_heads=8, n_kv_heads=4, vocab_size=512,
                              max_seq=128))
    return model, torch.randint(0, 512, (2, 128)), loss


register_calibration(calibrated)
