"""Gloo corrupts the heap now and then through the functional collectives: once in about 70,000 batches with several
in flight on one group, more rarely with fewer in flight, never in 1,140,000 batches through the classic API
(bench/README.md section 12 counts every setting).

Four gloo ranks on a 2 x 2 mesh run ``--iters`` batches of 1-8 functional collectives (reduce-scatters,
all-gathers and all-reduces of small tensors, as ZeRO with overlap issues them), with allocations between
issue and wait as compute makes. ``--policy many`` issues a whole batch on the ``dp`` group before waiting for
any of it, in a shuffled order: what ``fxpar.lower.overlap`` did on every backend before. ``--policy one-per-group``
alternates the batch between the ``dp`` and ``pp`` groups and keeps at most one collective in flight on each
(the next issue on a group first waits for its previous one): what ``fxpar.lower.overlap`` did on gloo from
session 18. ``--policy one-per-process`` alternates the groups too but keeps one collective in flight in the whole
process: what it does on gloo since session 38;
``--policy off`` waits for each collective right after issuing it (``Plan(overlap=False)``); ``--policy
classic`` is one-per-process through the classic ``torch.distributed`` API (``async_op=True`` and
``work.wait()``, as DDP and FSDP2 call gloo, and as fxpar's gloo rank programs do since session 48) instead of
the functional collectives. A run
survives or a rank dies natively (glibc: "malloc(): unaligned tcache chunk detected", "free(): invalid
pointer"); the script prints how many runs survived. About 5 minutes per run of 30,000 batches on 2 cores::

    .venv/bin/python bench/gloo_in_flight.py --policy many --runs 3
    .venv/bin/python bench/gloo_in_flight.py --policy one-per-group --runs 3
"""

from __future__ import annotations

import argparse
import random
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fxpar.testing.launch import RankFailure, run_ranks

c10d = torch.ops._c10d_functional
SIZES = [2, 4, 6, 8, 16, 30, 64, 200]  # rows of 3 floats


def _issue(rng: random.Random, group: str) -> torch.Tensor:
    x = torch.randn(rng.choice(SIZES), 3)
    kind = rng.choice(["reduce_scatter", "all_gather", "all_reduce"])
    if kind == "reduce_scatter":
        return c10d.reduce_scatter_tensor(x, "sum", 2, group)
    if kind == "all_gather":
        return c10d.all_gather_into_tensor(x, 2, group)
    return c10d.all_reduce(x, "sum", group)


def _issue_classic(rng: random.Random, group: dist.ProcessGroup) -> dist.Work:
    """The same draw as ``_issue``, through the classic ``torch.distributed`` API (what DDP and FSDP2 call)."""
    x = torch.randn(rng.choice(SIZES), 3)
    kind = rng.choice(["reduce_scatter", "all_gather", "all_reduce"])
    if kind == "reduce_scatter":
        return dist.reduce_scatter_tensor(x.new_empty(x.shape[0] // 2, 3), x, group=group, async_op=True)
    if kind == "all_gather":
        return dist.all_gather_into_tensor(x.new_empty(x.shape[0] * 2, 3), x, group=group, async_op=True)
    return dist.all_reduce(x, group=group, async_op=True)


def _classic(iters: int, groups: list[dist.ProcessGroup]) -> None:
    """``one-per-process`` through the classic API: each work waited before the next issue."""
    warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames the two calls (``*_single``)
    rng = random.Random(0)
    for _ in range(iters):
        pending: dist.Work | None = None
        for i in range(rng.randint(1, 8)):
            if pending is not None:
                pending.wait()
            pending = _issue_classic(rng, groups[i % 2])
            torch.randn(rng.randint(1, 300))
        if pending is not None:
            pending.wait()


def _batches(iters: int, policy: str) -> str:
    """One rank: ``iters`` batches, the same sequence of collectives on every rank."""
    mesh = DeviceMesh("cpu", torch.arange(4).reshape(2, 2), mesh_dim_names=("pp", "dp"))
    if policy == "classic":
        _classic(iters, [mesh.get_group("dp"), mesh.get_group("pp")])
        return f"rank {dist.get_rank()} survived"
    groups = [mesh.get_group("dp").group_name, mesh.get_group("pp").group_name]
    rng = random.Random(0)
    for _ in range(iters):
        if policy == "many":
            pending = []
            for _ in range(rng.randint(1, 8)):
                pending.append(_issue(rng, groups[0]))
                torch.randn(rng.randint(1, 300))  # allocations between issue and wait, as compute makes
            rng.shuffle(pending)
            for p in pending:
                c10d.wait_tensor(p)
        elif policy in ("one-per-process", "off"):
            pending_one: torch.Tensor | None = None
            for i in range(rng.randint(1, 8)):
                if pending_one is not None:
                    c10d.wait_tensor(pending_one)
                pending_one = _issue(rng, groups[i % 2])
                if policy == "off":  # overlap=False: every wait right after its issue
                    c10d.wait_tensor(pending_one)
                    pending_one = None
                torch.randn(rng.randint(1, 300))
            if pending_one is not None:
                c10d.wait_tensor(pending_one)
        else:
            in_flight: dict[str, torch.Tensor] = {}
            for i in range(rng.randint(1, 8)):
                group = groups[i % 2]
                if group in in_flight:
                    c10d.wait_tensor(in_flight.pop(group))
                in_flight[group] = _issue(rng, group)
                torch.randn(rng.randint(1, 300))
            for p in in_flight.values():
                c10d.wait_tensor(p)
    return f"rank {dist.get_rank()} survived"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", choices=["many", "one-per-group", "one-per-process", "off", "classic"],
                        required=True)
    parser.add_argument("--iters", type=int, default=30000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    survived = 0
    for run in range(args.runs):
        start = time.monotonic()
        try:
            run_ranks(_batches, 4, args.iters, args.policy, timeout=900, collective_timeout=60)
            survived += 1
            outcome = "all ranks survived"
        except RankFailure as e:
            outcome = "a rank died: " + str(e).splitlines()[1][:120]
        print(f"run {run + 1}: {args.iters} batches, {outcome} ({time.monotonic() - start:.0f} s)", flush=True)
    print(f"policy={args.policy}: {survived}/{args.runs} runs survived {args.iters} batches of collectives")


if __name__ == "__main__":
    main()
