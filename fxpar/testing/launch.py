"""Run a function on ``world_size`` real gloo ranks (separate processes) on 127.0.0.1.

Used by tests and demos. Children are always reaped: on success, on a rank failure, on the overall
deadline, and when the parent itself is interrupted.
"""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

T = TypeVar("T")

_KILL_GRACE_S = 5.0
_FAILURE_GRACE_S = 1.0


class RankFailure(RuntimeError):
    """A rank raised, exited without a result, or the run exceeded its deadline.

    ``ranks`` lists the failing ranks; the message names them with the exception type, message and
    traceback text, or "timed out after Ns" / "exited with code C".
    """

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free when checked (another process may grab it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable[..., Any], args: tuple, rank: int, world_size: int, port: int, parent: int,
           env: dict[str, str], collective_timeout: float, conn: Connection) -> None:
    """Child body: set up env and the gloo group, run ``fn(*args)``, send ("ok", result) or ("err", ...)."""
    if sys.platform == "linux":  # die with the parent even if it is SIGKILLed (PR_SET_PDEATHSIG = 1)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
        if os.getppid() != parent:
            os._exit(1)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=collective_timeout))
            msg: tuple = ("ok", fn(*args))
        except BaseException as e:  # noqa: B036 - report everything, incl. KeyboardInterrupt/SystemExit
            msg = ("err", f"{type(e).__name__}: {e}", traceback.format_exc())
        try:
            conn.send(msg)
        except Exception as e:  # e.g. unpicklable result
            conn.send(("err", f"result not sendable: {type(e).__name__}: {e}", traceback.format_exc()))
        conn.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(conns: dict[int, Connection], procs: list[mp.process.BaseProcess], results: dict[int, Any],
             failures: list[tuple[int, str]], timeout: float, stop_on_failure: bool) -> None:
    """Record results/failures of ranks not yet heard from, until all reported, ``timeout`` s passed,
    or (if ``stop_on_failure``) some rank failed."""
    end = time.monotonic() + max(0.0, timeout)
    while not (stop_on_failure and failures):
        heard = results.keys() | {r for r, _ in failures}
        pending = {c: r for r, c in conns.items() if r not in heard}
        if not pending or not (ready := wait(list(pending), timeout=max(0.0, end - time.monotonic()))):
            return
        for c in ready:
            rank = pending[c]
            try:
                msg = c.recv()
            except (EOFError, OSError):  # died without sending: get its exit code
                procs[rank].join(_KILL_GRACE_S)
                code = procs[rank].exitcode
                failures.append((rank, f"rank {rank} exited with code {code} without a result"))
                continue
            if msg[0] == "ok":
                results[rank] = msg[1]
            else:
                failures.append((rank, f"rank {rank} raised {msg[1]}\n{msg[2]}"))


def reap(procs: list[mp.process.BaseProcess]) -> None:
    """Terminate every live child, kill those still alive after a grace period, and join all of them."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + _KILL_GRACE_S
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()


def run_ranks(fn: Callable[..., T], world_size: int, *args: Any, timeout: float = 120.0,
              collective_timeout: float = 30.0, env: dict[str, str] | None = None) -> list[T]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes, each in a gloo process group.

    Requires: ``fn`` and ``args`` picklable (``fn`` a module-level function importable by the children),
    results picklable, ``world_size >= 1``.
    Ensures: returns the results ordered by rank, or raises ``RankFailure`` if a rank raises, exits without
    a result, or ``timeout`` seconds pass; in every case (also on KeyboardInterrupt) no child is left
    running when this returns. ``collective_timeout`` bounds each gloo collective and the rendezvous.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    deadline = time.monotonic() + timeout
    common = (world_size, free_port(), os.getpid(), dict(env or {}), collective_timeout)
    procs: list[mp.process.BaseProcess] = []
    conns: dict[int, Connection] = {}
    results: dict[int, Any] = {}
    try:
        for rank in range(world_size):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"fxpar-rank{rank}", args=(fn, args, rank, *common, send))
            p.start()
            send.close()  # only the child holds the write end, so its death shows as EOF
            procs.append(p)
            conns[rank] = recv
        failures: list[tuple[int, str]] = []
        _collect(conns, procs, results, failures, deadline - time.monotonic(), stop_on_failure=True)
        if failures:
            # Peers of a crashed rank fail within milliseconds; give them a moment so the message names
            # the root cause (a rank that exited without a result is listed first).
            grace = min(_FAILURE_GRACE_S, deadline - time.monotonic())
            _collect(conns, procs, results, failures, grace, stop_on_failure=False)
            failures.sort(key=lambda f: (" raised " in f[1], f[0]))
            ranks = [r for r, _ in failures]
            quiet = [r for r in range(world_size) if r not in results and r not in ranks]
            note = f"; ranks {quiet} were terminated" if quiet else ""
            text = "\n".join(m for _, m in failures)
            raise RankFailure(f"ranks {ranks} failed{note}\n{text}", ranks)
        if len(results) < world_size:
            missing = [r for r in range(world_size) if r not in results]
            raise RankFailure(f"ranks {missing} timed out after {timeout:g}s", missing)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        return [results[r] for r in range(world_size)]
    finally:
        reap(procs)
        for c in conns.values():
            c.close()
