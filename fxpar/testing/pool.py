"""A pool of long-lived gloo rank processes, started once and reused by many multi-rank tasks.

Spawning ranks costs seconds each on a small machine (every child imports torch); a property
suite that runs hundreds of parallel programs cannot pay that per example. A ``RankPool``
keeps its worker processes alive between tasks. For each task, the first ``world`` workers
form a fresh gloo process group of exactly ``world`` ranks (so ``fxpar.Mesh`` sees the world
size it expects), run the function, and destroy the group again.

Failure handling keeps tests from hanging:

* every collective has ``collective_timeout`` and every task a deadline;
* a task whose ranks all report (results or exceptions) leaves the pool healthy;
* a worker that dies, or a task with ranks still silent after the deadline (or shortly after a
  peer failed), restarts the pool: all workers are killed and respawned on the next task.

Workers die with the parent (``PR_SET_PDEATHSIG``) and are reaped by ``close()`` and at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any, TypeVar

from fxpar.testing.launch import RankFailure, free_port, reap

T = TypeVar("T")
_FAILURE_GRACE_S = 2.0
# A worker keeps the gloo threads of every distinct mesh it ran (DTensor's sharding caches, some in C++,
# hold DeviceMeshes and with them their ProcessGroups): about five threads per new mesh. Past this
# many threads in one worker the pool starts fresh workers before the next task, which costs one
# startup (seconds) instead of a session that slows down under thousands of threads.
RECYCLE_THREADS = 300


def _worker(index: int, conn: Connection, parent: int, env: dict[str, str], preload: tuple[str, ...]) -> None:
    """Worker body: import ``preload``, say ready, then run tasks from ``conn`` until told to stop."""
    if sys.platform == "linux":  # die with the parent even if it is SIGKILLed (PR_SET_PDEATHSIG = 1)
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))
        if os.getppid() != parent:
            os._exit(1)
    os.environ.update(env)
    import importlib

    import torch

    torch.set_num_threads(1)
    for name in preload:
        importlib.import_module(name)
    conn.send("ready")
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send(_run_task(index, *task))


def _run_task(rank: int, fn: Callable[..., Any], args: tuple, world: int, port: int,
              collective_timeout: float) -> tuple:
    """One rank of one task, in a process group of ``world`` ranks made for it."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        msg: tuple = ("ok", fn(*args))
    except BaseException as e:  # noqa: B036 - report everything, incl. KeyboardInterrupt/SystemExit
        msg = ("err", f"{type(e).__name__}: {e}", traceback.format_exc(), _picklable(e))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_meshes()
    return (*msg, _thread_count())


def _forget_meshes() -> None:
    """DTensor caches sharding decisions by mesh layout, with the ``DeviceMesh`` of the task that made them: a later
    task's mesh of the same layout would get the earlier one's, whose process groups are destroyed ("Could not
    resolve the process group registered under the name 7" in a gradient-norm reduction). Each task starts clean."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()


def _thread_count() -> int:
    """Threads of this process (Linux), else 0."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/task"))
    except OSError:
        return 0


def _picklable(e: BaseException) -> BaseException | None:
    """``e`` if it survives a pickle round trip (so the parent can re-raise its type), else None."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - many exception types do not pickle
        return None


def _ready(conn: Connection, deadline: float) -> bool:
    """Whether a new worker said "ready" before ``deadline`` (False if it died or stayed silent)."""
    try:
        return conn.poll(max(0.0, deadline - time.monotonic())) and conn.recv() == "ready"
    except (EOFError, OSError):
        return False


class RemoteError(RankFailure):
    """Every rank raised; ``original`` is rank 0's exception object when it could be pickled."""

    def __init__(self, message: str, ranks: list[int], original: BaseException | None) -> None:
        super().__init__(message, ranks)
        self.original = original


class RankPool:
    """Reusable gloo ranks on 127.0.0.1. ``run(fn, world, *args)`` runs ``fn(*args)`` on ranks ``0..world-1``.

    Requires: ``fn`` a module-level (picklable) function, picklable ``args`` and results.
    Ensures: ``run`` returns results by rank or raises ``RankFailure`` (``RemoteError`` when all ranks
    raised) within ``timeout`` plus a few seconds; no worker outlives ``close()`` or the parent.
    """

    def __init__(self, collective_timeout: float = 60.0, env: dict[str, str] | None = None,
                 preload: tuple[str, ...] = ("fxpar",), startup_timeout: float = 180.0) -> None:
        self.collective_timeout = collective_timeout
        self.env = dict(env or {})
        self.preload = preload
        self.startup_timeout = startup_timeout
        self._procs: list[mp.process.BaseProcess] = []
        self._conns: list[Connection] = []
        self.tasks_run = 0
        self.restarts = 0
        self.recycles = 0
        self._threads = 0  # the most threads a worker reported since they started

    @property
    def size(self) -> int:
        return len(self._procs)

    def _grow(self, world: int) -> None:
        """Start workers until there are ``world``; wait until each has imported torch (and ``preload``)."""
        ctx = mp.get_context("spawn")
        new = []
        while len(self._procs) < world:
            parent_end, child_end = ctx.Pipe(duplex=True)
            index = len(self._procs)
            p = ctx.Process(target=_worker, name=f"fxpar-pool-rank{index}",
                            args=(index, child_end, os.getpid(), self.env, self.preload), daemon=True)
            p.start()
            child_end.close()
            self._procs.append(p)
            self._conns.append(parent_end)
            new.append(parent_end)
        deadline = time.monotonic() + self.startup_timeout
        for c in new:  # a rendezvous must not wait on a worker that is still importing torch
            if not _ready(c, deadline):
                rank = self._conns.index(c)
                code = self._procs[rank].exitcode
                self.close()
                raise RankFailure(f"pool worker {rank} did not start within {self.startup_timeout:g}s (exit code "
                                  f"{code}; a script that uses the pool needs `if __name__ == '__main__':`)", [rank])

    def run(self, fn: Callable[..., T], world: int, *args: Any, timeout: float = 120.0) -> list[T]:
        """Run ``fn(*args)`` on ``world`` ranks; see the class docstring."""
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if any(not p.is_alive() for p in self._procs):
            self.close()
            self.restarts += 1
        conns = self._start(fn, args, world)
        self.tasks_run += 1
        results, failures = self._collect(conns, time.monotonic() + timeout)
        died = any(f[0] == "died" for f in failures.values())
        if died or len(results) + len(failures) < world:  # a worker is gone or stuck: start afresh next task
            self.close()
            self.restarts += 1
        elif self._threads > RECYCLE_THREADS:  # see RECYCLE_THREADS: fresh workers on the next task
            self.close()
            self.recycles += 1
        if failures:
            raise self._failure(world, results, failures, timeout)
        return [results[r] for r in range(world)]

    def _start(self, fn: Callable[..., Any], args: tuple, world: int) -> list[Connection]:
        """Send the task to ranks ``0..world-1``. A worker that died after its last report (a native crash can
        close its pipe only after ``run`` checked it) breaks the pipe: then the pool restarts and sends once more."""
        for attempt in range(2):
            self._grow(world)
            port = free_port()
            conns = self._conns[:world]
            try:
                for c in conns:
                    c.send((fn, args, world, port, self.collective_timeout))
                return conns
            except (BrokenPipeError, ConnectionResetError, EOFError) as e:
                self.close()
                self.restarts += 1
                if attempt:
                    raise RankFailure(f"pool workers could not be reached after a restart: {e}",
                                      list(range(world))) from e
        raise AssertionError("unreachable")

    def _collect(self, conns: list[Connection], deadline: float) -> tuple[dict[int, Any], dict[int, tuple]]:
        """Results and failures by rank until all reported, the deadline, or a grace after a failure."""
        results: dict[int, Any] = {}
        failures: dict[int, tuple] = {}
        index = {c: r for r, c in enumerate(conns)}
        while len(results) + len(failures) < len(conns):
            end = min(deadline, time.monotonic() + _FAILURE_GRACE_S) if failures else deadline
            pending = [c for c in conns if index[c] not in results and index[c] not in failures]
            ready = wait(pending, timeout=max(0.0, end - time.monotonic()))
            if not ready:
                break
            for c in ready:
                rank = index[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(_FAILURE_GRACE_S)  # its pipe closes before it is reaped
                    code = self._procs[rank].exitcode
                    failures[rank] = ("died", f"exited with code {code} without a result", "", None)
                    continue
                self._threads = max(self._threads, msg[-1])
                if msg[0] == "ok":
                    results[rank] = msg[1]
                else:
                    failures[rank] = msg[:-1]
        return results, failures

    @staticmethod
    def _failure(world: int, results: dict[int, Any], failures: dict[int, tuple], timeout: float) -> RankFailure:
        ranks = sorted(failures, key=lambda r: (failures[r][0] != "died", r))
        silent = [r for r in range(world) if r not in results and r not in failures]
        lines = [f"rank {r} {'raised ' + failures[r][1] if failures[r][0] == 'err' else failures[r][1]}"
                 for r in ranks]
        text = "\n".join(lines)
        first = failures[ranks[0]]
        detail = f"\n{first[2]}" if first[2] else ""
        note = (f"; ranks {silent} did not report (task timeout {timeout:g}s, or {_FAILURE_GRACE_S:g}s after a "
                "peer failed) and the pool was restarted") if silent else ""
        msg = f"ranks {ranks} failed{note}\n{text}{detail}"
        if len(failures) == world and all(f[0] == "err" for f in failures.values()):
            return RemoteError(msg, ranks, failures[0][3])
        return RankFailure(msg, ranks + silent)

    def close(self) -> None:
        """Stop every worker (politely, then by force) and forget them."""
        for c in self._conns:
            try:
                c.send(None)
            except (BrokenPipeError, OSError):
                pass
        end = time.monotonic() + 2.0
        for p in self._procs:
            p.join(max(0.0, end - time.monotonic()))
        reap(self._procs)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
        self._threads = 0


_DEFAULT: RankPool | None = None


def default_pool() -> RankPool:
    """The process-wide pool used by ``fxpar.testing.assert_equivalent`` (started on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = RankPool()
        atexit.register(_DEFAULT.close)
    return _DEFAULT


def close_default_pool() -> None:
    """Stop the default pool's workers now (a later task starts new ones)."""
    if _DEFAULT is not None:
        _DEFAULT.close()
