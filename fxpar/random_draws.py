"""Random ops in rank programs: every rank draws what the single device draws.

A random op (dropout's mask, ``rand_like``, ``bernoulli``, ...) whose output is sharded would, run on the local
shard, draw a local-shaped tensor from each rank's generator: every shard the same numbers (a mask repeating
across tp ranks' columns and dp ranks' rows), and none of them the single device's. Lowering instead draws the
op's *whole* (global) tensor on every rank and keeps the rank's piece (``fxpar.lower.random_draws``), so with
every rank's generator in the same state a parallel program draws exactly the single device's numbers, bitwise
(JAX's partitionable RNG and DTensor's offset-based CUDA RNG promise the same). The cost is the draw of the global
tensor on each rank (the random numbers only: the op's real input stays local).

Ranks must agree on the generator's state, or ranks holding copies of one value (a dropout after a tp all-reduce)
would compute different values: ``sync_generators`` copies rank 0's state to every rank when a ParallelModule is
built for a program that draws (as DTensor's RNG tracker does when it starts).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpar.errors import FxparWarning

aten = torch.ops.aten

# Random ops whose numbers do not depend on their tensor inputs' values (only on their shape, dtype and the
# generator): lowering can draw them on a global-shaped stand-in and keep the rank's piece. ``native_dropout``'s
# input only scales its output (``out = x * mask * scale``): its mask is drawn whole, the output computed locally.
DRAWS_ON_SHAPE = {
    aten.native_dropout.default, aten.bernoulli.p, aten.rand_like.default, aten.randn_like.default,
    aten.randint_like.default, aten.randint_like.low_dtype, aten.uniform.default, aten.normal_functional.default,
    aten.exponential.default, aten.random.default, getattr(aten.random, "from"), aten.random.to, aten.cauchy.default,
    aten.log_normal.default, aten.geometric.default, aten.rand.default, aten.randn.default, aten.randint.default,
    aten.randint.low,
}
# random ops whose numbers depend on their inputs' values (probabilities, means): propagation runs them whole
VALUE_RANDOM = {
    aten.bernoulli.default, aten.bernoulli.Tensor, aten.bernoulli_.float, aten.bernoulli_.Tensor,
    aten.multinomial.default, aten.normal.Tensor_float, aten.normal.float_Tensor, aten.normal.Tensor_Tensor,
    aten.normal.float_float, aten.poisson.default, aten.binomial.default, aten.randperm.default,
    aten.rrelu_with_noise.default, aten.rrelu_with_noise_functional.default, aten._standard_gamma.default,
}
# every random op a traced graph may hold (recompute never reruns them: a rerun would draw new numbers)
RANDOM_OPS = DRAWS_ON_SHAPE | VALUE_RANDOM


def draws_random(graphs: list[fx.Graph]) -> bool:
    """Whether any of ``graphs`` (a compiled model's global stage graphs) holds a random op."""
    return any(n.op == "call_function" and n.target in RANDOM_OPS for g in graphs for n in g.nodes)


def is_sharded(placements: Any) -> bool:
    """Whether a value placed as ``placements`` (one per mesh axis; a tuple of them for a multi-output op: its
    first output's) is split over some axis."""
    if placements and isinstance(placements[0], tuple):
        placements = placements[0]
    return any(p.is_shard() for p in placements or ())


def sync_generators(device: str) -> None:
    """Copy rank 0's default generator state (CPU, and the current CUDA device's on ``device == "cuda"``) to every
    rank of the default process group (collective; on CUDA meshes the states travel as CUDA tensors, for NCCL)."""
    torch.set_rng_state(_from_rank0(torch.get_rng_state(), device))
    if device == "cuda":
        torch.cuda.set_rng_state(_from_rank0(torch.cuda.get_rng_state(), device))


def _from_rank0(state: torch.Tensor, device: str) -> torch.Tensor:
    on = state.to(torch.device("cuda", torch.cuda.current_device())) if device == "cuda" else state.clone()
    dist.broadcast(on, src=0)
    return on.cpu()


def warn_if_not_the_single_devices(graphs: list[fx.Graph], stages: int, compiled: bool) -> None:
    """Say where a program that draws random numbers draws valid ones that are not the single device's: pipeline
    stages (each stage's ranks draw only their own stage's numbers, so later stages start from other generator
    states) and ``compile=True`` (Inductor draws with its own generator, as under ``torch.compile``)."""
    if not (stages > 1 or compiled) or not draws_random(graphs):
        return
    why = ("with pipeline stages each stage's ranks draw only their stage's numbers" if stages > 1
           else "Inductor (compile=True) draws them with its own generator, as torch.compile does")
    warnings.warn(f"fxpar: the model draws random numbers (dropout) in training mode, and {why}: copies of a value "
                  "still agree on every rank, but the numbers are not the single device's (model.eval() or p=0 "
                  "to compare with it)", FxparWarning, stacklevel=3)
