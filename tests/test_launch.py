"""Tests for fxpar.testing.launch (real gloo ranks on 127.0.0.1)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fxpar.testing.launch import RankFailure, free_port, run_ranks

# Helpers are module-level so that spawned children can unpickle them.


def _all_reduce_sum(base: float) -> tuple[int, list[float], str, str, int]:
    rank = dist.get_rank()
    t = torch.full((3,), base + rank)
    dist.all_reduce(t)
    return rank, t.tolist(), os.environ["RANK"], os.environ["FXPAR_TEST_VAR"], torch.get_num_threads()


def _raise_on_rank1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank 1")
    return dist.get_rank()


def _exit_mid_step(dying_rank: int, died_at: str) -> int:
    t = torch.ones(4)
    dist.all_reduce(t)  # one healthy step
    if dist.get_rank() == dying_rank:
        with open(died_at, "w") as f:  # CLOCK_MONOTONIC: one clock for every process of the machine
            f.write(repr(time.monotonic()))
        os._exit(3)
    dist.all_reduce(t)  # the peer is gone: must fail (gloo error or collective timeout), not hang
    return dist.get_rank()


def _hang_on_rank1() -> int:
    if dist.get_rank() == 1:
        time.sleep(60)  # alive but never joins the collective
    dist.all_reduce(torch.ones(2))
    return dist.get_rank()


def _sleep_forever() -> None:
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _run_ranks_children() -> list[mp.process.BaseProcess]:
    """Live children started by ``run_ranks`` (the session's rank pool workers are long-lived by design)."""
    return [p for p in mp.active_children() if p.name.startswith("fxpar-rank")]


def test_free_port() -> None:
    port = free_port()
    assert 0 < port < 65536


def test_all_reduce_two_ranks() -> None:
    out = run_ranks(_all_reduce_sum, 2, 10.0, timeout=60, env={"FXPAR_TEST_VAR": "x"})
    assert out == [(0, [21.0] * 3, "0", "x", 1), (1, [21.0] * 3, "1", "x", 1)]
    assert _run_ranks_children() == []


def test_rank_raises() -> None:
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank1, 2, timeout=60, collective_timeout=5)
    msg = str(info.value)
    assert "rank 1" in msg and "ValueError" in msg and "boom from rank 1" in msg
    assert "Traceback" in msg and "_raise_on_rank1" in msg
    assert info.value.ranks == [1]
    assert _run_ranks_children() == []


def _leftover_children(before: set[int]) -> list[int]:
    me = os.getpid()
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if p not in before and _parent_of(p) == me and _alive(p)]


def _children_now() -> set[int]:
    resource_tracker.ensure_running()  # spawn starts this long-lived helper; it is not a rank
    me = os.getpid()
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and _parent_of(int(p)) == me}


@pytest.mark.parametrize("dying_rank", [0, 1])
def test_rank_exits_mid_collective(dying_rank: int, tmp_path: Path) -> None:
    """The failure is reported within the collective timeout (5 s) plus slack of the rank's death, however long
    the ranks took to start (spawning two interpreters that import torch takes 10 s and more on a loaded machine)."""
    before = _children_now()
    died_at = tmp_path / "died_at"
    with pytest.raises(RankFailure) as info:
        run_ranks(_exit_mid_step, 2, dying_rank, str(died_at), timeout=30, collective_timeout=5)
    elapsed = time.monotonic() - float(died_at.read_text())
    assert elapsed < 5 + 8, elapsed
    msg = str(info.value)
    assert f"rank {dying_rank} exited with code 3" in msg, msg
    assert info.value.ranks[0] == dying_rank
    assert _run_ranks_children() == []
    assert _leftover_children(before) == []


def test_hung_peer_bounded_by_collective_timeout() -> None:
    before = _children_now()
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_hang_on_rank1, 2, timeout=30, collective_timeout=3)
    elapsed = time.monotonic() - t0
    # bounded by the 3 s collective timeout plus spawning two ranks (slow on a loaded 2-core machine), well
    # below the 30 s overall deadline a hang would run into
    assert 3 <= elapsed < 3 + 20, elapsed
    msg = str(info.value)
    assert "rank 0 raised" in msg and "Timed out" in msg, msg
    assert _leftover_children(before) == []


def test_overall_deadline() -> None:
    before = _children_now()
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[0, 1\] timed out after 4s"):
        run_ranks(_sleep_forever, 2, timeout=4, collective_timeout=30)
    assert time.monotonic() - t0 < 4 + 6
    assert _leftover_children(before) == []


def _parent_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return -1
