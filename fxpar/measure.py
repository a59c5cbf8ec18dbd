"""``Cluster.measure()``: this machine timed as ``ranks`` one-thread ranks sharing its cores would see it.

* **Rates**: matmul FLOP/s (fp32, bf16) and copy bandwidth of one of ``ranks`` threads running at once (the OS
  time-slicing the cores included), and one eager op's dispatch.
* **Links**: gloo all-reduce latency and bandwidth fitted for groups of 2 and 4 (threads of this process, each a
  rank of its own gloo group on a local store); ``sync_cost``, what a small all-reduce adds while the other ranks
  compute (peers the OS has not scheduled yet: threads and processes measure the same here).
* **The optimizer**: an eager AdamW step's cost per parameter tensor, on DTensors as ``pm.parameters()`` are (in a
  one-rank gloo world set up and torn down here when this process has none; plain tensors on a launched rank).

The fraction of these rates a real block achieves needs the compiler: ``fxpar.calibrate`` measures it.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def machine_fields(ranks: int) -> dict[str, Any]:
    """``Cluster`` fields of this machine as ``ranks`` ranks see it (module docstring); ``Cluster.measure`` builds
    and caches the cluster, then ``fxpar.calibrate`` sets its achieved fractions."""
    with intra_op_threads(1):  # one thread per rank, as launched ranks run, all of them at once
        flops = {dtype: _matmul_flops(dtype, ranks) for dtype in (torch.float32, torch.bfloat16)}
        bandwidth = _copy_bandwidth(ranks)
    fit = {n: _allreduce_fit(n) for n in (2, 4)}
    shared = max(1.0, ranks / (os.cpu_count() or 1))  # ranks beyond the cores queue for one
    overhead = _op_overhead() * shared
    latency, bw = fit[2]
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks if hasattr(os, "sysconf") else 8e9
    with one_rank_world() as owned:
        optimizer = _optimizer_overhead(owned) * shared
    return dict(name="this machine (measured)", gpus=ranks, gpus_per_node=ranks, peak_flops=flops,
                hbm_bytes=memory, hbm_bandwidth=bandwidth, intra_bandwidth=bw, intra_latency=latency,
                inter_bandwidth=bw, inter_latency=latency, device="cpu", op_overhead=overhead, collective_fit=fit,
                oversubscription=shared, sync_cost={g: _sync_cost(ranks, g) for g in (2, 4) if g <= ranks},
                optimizer_overhead=optimizer,
                source=f"Cluster.measure(ranks={ranks}) on {os.cpu_count()} cores, torch {torch.__version__}")


@contextlib.contextmanager
def one_rank_world() -> Iterator[bool]:
    """A one-rank gloo world for the runtime measurements when this process has none (yields whether it made one)."""
    if dist.is_initialized():
        yield False
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield True
    finally:
        dist.destroy_process_group()


def typical(fn: object, repeats: int = 9) -> float:
    """Median seconds of ``fn()``: what a run sees on a machine others share, not its luckiest moment."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, ranks: int, n: int = 256) -> float:
    """FLOP/s of one rank while ``ranks`` one-thread ranks multiply at once (time-slicing the cores included)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    return 2 * n**3 * units_per_second(ranks, lambda: a @ b, 0.3 if dtype == torch.float32 else 0.1)


def units_per_second(ranks: int, unit: Callable[[], object], seconds: float) -> float:
    """How many ``unit()`` calls one of ``ranks`` threads completes per second while all of them run for
    ``seconds``: the machine's total throughput shared by ``ranks`` (robust to how unevenly the OS shares it)."""
    stop = threading.Event()
    counts = [0] * ranks

    def run(r: int) -> None:
        torch.set_num_threads(1)  # OpenMP's thread count is per thread: a new one would use every core
        while not stop.is_set():
            unit()
            counts[r] += 1

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return sum(counts) / (time.perf_counter() - t0) / ranks


def _op_overhead(calls: int = 200) -> float:
    """Seconds of one eager op on a tiny tensor: PyTorch's dispatch, which every node of a rank program pays."""
    a, b = torch.ones(4), torch.ones(4)
    return typical(lambda: [torch.add(a, b) for _ in range(calls)]) / calls


def _optimizer_overhead(as_dtensor: bool, tensors: int = 16, steps: int = 5) -> float:
    """Seconds per parameter tensor of ``torch.optim.AdamW.step`` on tiny parameters: the per-tensor ops of its
    eager (single-tensor) CPU path, on DTensors as ``pm.parameters()`` are (marked as fxpar's, so the step runs
    as on fxpar's parameters: ``fxpar.local_optimizer``), or on plain tensors without a one-rank world."""
    from fxpar.local_optimizer import own_parameter

    wrap = _replicator() if as_dtensor else (lambda t: t)
    params = [torch.nn.Parameter(wrap(torch.randn(64))) for _ in range(tensors)]
    for p in params:
        if as_dtensor:
            own_parameter(p)
        p.grad = wrap(torch.randn(64))
    opt = torch.optim.AdamW(params)
    opt.step()
    with intra_op_threads(1):
        return typical(opt.step, steps) / tensors


def _replicator() -> Callable[[torch.Tensor], torch.Tensor]:
    """Wraps a tensor as a DTensor replicated on a one-rank mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = DeviceMesh("cpu", [0])
    return lambda t: DTensor.from_local(t, mesh, [Replicate()], run_check=False)


def _copy_bandwidth(ranks: int, numel: int = 1 << 23) -> float:
    """Bytes/s one rank copies while ``ranks`` one-thread ranks copy at once (one read, one write per element;
    32 MiB tensors, beyond the caches)."""
    src, dst = torch.randn(numel), torch.empty(numel)
    dst.copy_(src)
    return 2 * 4 * numel * units_per_second(ranks, lambda: dst.copy_(src), 0.3)


def _allreduce_fit(n: int, small: int = 1, large: int = 1 << 22, iters: int = 8) -> tuple[float, float]:
    """(latency per ring step, bandwidth) of a gloo all-reduce among ``n`` threads of this process.

    The ring model ``2 (n-1) (latency + B / (n bandwidth))`` is fitted to a 4-byte and a 16 MiB all-reduce.
    """
    t_small, t_large = _time_allreduce(n, small, iters), _time_allreduce(n, large, iters)
    steps = 2 * (n - 1)
    latency = t_small / steps
    moved = steps * 4 * large / n  # bytes through each rank's link
    return latency, moved / max(t_large - t_small, 1e-9)


def _time_allreduce(n: int, numel: int, iters: int) -> float:
    """Median seconds of one all-reduce of ``numel`` floats among ``n`` threads (the slowest thread's)."""

    def work(pg: dist.ProcessGroup) -> list[float]:
        x = torch.ones(numel)
        pg.allreduce([x]).wait()
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            pg.allreduce([x]).wait()
            times.append(time.perf_counter() - t0)
        return times

    per_thread = _on_threads(n, work, f"measure{n}")
    return statistics.median(max(ts) for ts in zip(*per_thread, strict=True))


def _sync_cost(ranks: int, group: int, iters: int = 12, rounds: int = 3) -> float:
    """Seconds one small all-reduce in groups of ``group`` adds to ``ranks`` threads that compute (about 1 ms of
    matmuls) between them, over the same loop without it (median of ``rounds``)."""
    a = torch.randn(160, 160)

    def loop(pg: dist.ProcessGroup | None) -> list[float]:
        x = torch.ones(1024)
        if pg is not None:
            pg.allreduce([x]).wait()
        t0 = time.perf_counter()
        for _ in range(iters):
            for _ in range(8):
                a @ a
            if pg is not None:
                pg.allreduce([x]).wait()
        return [time.perf_counter() - t0]

    extra = []
    for r in range(rounds):
        alone = max(t[0] for t in _on_threads(ranks, lambda pg: loop(None), f"alone{group}.{r}", group))
        synced = max(t[0] for t in _on_threads(ranks, loop, f"sync{group}.{r}", group))
        extra.append(max(synced - alone, 0.0) / iters)
    return statistics.median(extra)


def _on_threads(n: int, work: Callable[[dist.ProcessGroup | None], list[float]], tag: str,
                group: int | None = None) -> list[list[float]]:
    """``work(pg)`` on ``n`` threads of this process, ranks of gloo groups of ``group`` (default: all ``n``)
    consecutive threads, each group on its own local store; the threads past the last whole group (3 ranks in
    groups of 2) run ``work(None)``: they load the machine as a rank does, in no group."""
    group = group or n
    stores = [dist.HashStore() for _ in range(n // group)]
    results: dict[int, list[float]] = {}
    failures: list[BaseException] = []

    def run(rank: int) -> None:
        torch.set_num_threads(1)  # one thread per rank (OpenMP's count is per thread)
        try:
            if rank // group == len(stores):
                results[rank] = work(None)
                return
            store = dist.PrefixStore(tag, stores[rank // group])
            results[rank] = work(dist.ProcessGroupGloo(store, rank % group, group, timedelta(seconds=60)))
        except BaseException as e:  # noqa: BLE001 - reported below, on the calling thread
            failures.append(e)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if failures:
        raise RuntimeError(f"Cluster.measure: a measuring thread of {n} failed: {failures[0]!r}") from failures[0]
    if len(results) < n:
        raise RuntimeError(f"Cluster.measure: a gloo all-reduce among {n} local threads did not finish in 120 s")
    return [results[r] for r in range(n)]
