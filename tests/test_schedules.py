"""Pipeline schedules as data (``fxpar.schedules``): closed-form bubbles, memory, text form, deadlocks, errors.

Pure Python: no processes, no torch.distributed.
"""

from __future__ import annotations

import re

import pytest
from fxpar.schedules import SCHEDULES, Action, DeadlockError, Schedule, make_schedule

SIZES = [(p, m) for p in (2, 4, 8) for m in (p, 2 * p, 4 * p)]
V = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": 2, "zb-h1": 1}
SMALL = [(name, p, m) for name in SCHEDULES for p, m in [(1, 1), (1, 3), (2, 2), (2, 4), (4, 8)]]


def _closed_form(name: str, p: int, m: int) -> tuple[float, float]:
    """(makespan, bubble) with default unit costs: F=1, B=2 (F=B=W=1 for zb-h1), zero-latency transfers."""
    if name == "zb-h1":
        return 3 * m + p - 1, (p - 1) / (3 * m + p - 1)
    v = V[name]
    return 3 * (v * m + p - 1), (p - 1) / (v * m + p - 1)


def _with(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    """A copy of ``schedule`` with rank ``rank``'s list replaced."""
    lists = [list(a) for a in schedule.actions]
    lists[rank] = actions
    return Schedule(schedule.name, schedule.pp, schedule.stages, schedule.microbatches, lists)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_closed_form_bubble(name: str, p: int, m: int) -> None:
    schedule = make_schedule(name, p, V[name] * p, m)
    result = schedule.simulate()
    makespan, bubble = _closed_form(name, p, m)
    assert result.makespan == pytest.approx(makespan, rel=1e-12)
    assert result.bubble == pytest.approx(bubble, rel=1e-12)
    assert result.bubble == pytest.approx(1 - sum(result.busy) / (p * result.makespan), rel=1e-12)


@pytest.mark.parametrize(("name", "p", "m"), SMALL)
def test_every_compute_action_once_on_its_rank(name: str, p: int, m: int) -> None:
    stages = V[name] * p
    schedule = make_schedule(name, p, stages, m)
    seen = [(a.kind, a.stage, a.mb) for r in range(p) for a in schedule.compute(r)]
    kinds = ("F", "B", "W") if name == "zb-h1" else ("F", "B")
    assert sorted(seen) == sorted((k, s, mb) for k in kinds for s in range(stages) for mb in range(m))
    assert schedule.has_w == (name == "zb-h1")
    for rank in range(p):
        assert schedule.stages_of(rank) == list(range(rank, stages, p))
        assert all(schedule.stage_rank(a.stage) == rank for a in schedule.compute(rank))
    timeline = [a for entries in schedule.simulate().timeline for _, _, a in entries]
    assert sorted((a.kind, a.stage, a.mb) for a in timeline) == sorted(seen)


@pytest.mark.parametrize(("name", "p", "m"), SMALL)
def test_transfers_match_neighbours(name: str, p: int, m: int) -> None:
    schedule = make_schedule(name, p, V[name] * p, m)
    comm = [a for acts in schedule.actions for a in acts if a.is_comm]
    if p == 1:
        assert comm == []
        return
    transfers_per_kind = (schedule.stages - 1) * m
    for kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        assert sum(a.kind == kind for a in comm) == transfers_per_kind
    for acts in schedule.actions:
        for i, a in enumerate(acts):
            if a.kind == "SEND_F":
                assert acts[i - 1] == Action("F", a.stage, a.mb) and a.peer == (a.stage + 1) % p
            if a.kind == "RECV_F":
                assert acts[i + 1] == Action("F", a.stage + 1, a.mb) and a.peer == a.stage % p
            if a.kind == "RECV_B":
                assert acts[i + 1] == Action("B", a.stage - 1, a.mb) and a.peer == a.stage % p


def test_1f1b_peak_in_flight_is_pp_minus_rank() -> None:
    for p, m in SIZES:
        assert make_schedule("1f1b", p, p, m).peak_in_flight() == [p - r for r in range(p)]
        assert make_schedule("gpipe", p, p, m).peak_in_flight() == [m] * p
        assert max(make_schedule("zb-h1", p, p, m).peak_in_flight()) == p


def test_interleaved_with_one_chunk_is_1f1b() -> None:
    assert make_schedule("interleaved-1f1b", 4, 4, 8).actions == make_schedule("1f1b", 4, 4, 8).actions


@pytest.mark.parametrize(("name", "p", "m"), SMALL)
def test_text_round_trip(name: str, p: int, m: int) -> None:
    schedule = make_schedule(name, p, V[name] * p, m)
    back = Schedule.from_text(name, p, schedule.stages, m, schedule.text())
    assert back.actions == schedule.actions
    assert schedule.text().splitlines()[0].startswith("rank 0: F0.0")


def test_action_text() -> None:
    cases = {"F0.1": Action("F", 0, 1), "W1.0": Action("W", 1, 0), "SEND_F0.1>1": Action("SEND_F", 0, 1, 1)}
    cases["RECV_B12.3<4"] = Action("RECV_B", 12, 3, 4)
    for text, action in cases.items():
        assert str(action) == text and Action.parse(text) == action
    for bad in ("F0", "X0.1", "SEND_F0.1", "RECV_F0.1>0", "F0.1<2", "B-1.0"):
        with pytest.raises(ValueError, match="cannot parse action"):
            Action.parse(bad)
    with pytest.raises(ValueError, match="needs a peer"):
        Action("SEND_B", 1, 0)
    with pytest.raises(ValueError, match="takes no peer"):
        Action("F", 1, 0, 2)


def test_from_text_errors() -> None:
    with pytest.raises(ValueError, match="no line for rank"):
        Schedule.from_text("x", 2, 2, 1, "rank 0: F0.0 B0.0")
    with pytest.raises(ValueError, match="cannot parse schedule line"):
        Schedule.from_text("x", 1, 1, 1, "r0: F0.0 B0.0")


def test_str_and_grid() -> None:
    schedule = make_schedule("1f1b", 4, 4, 8)
    text = str(schedule)
    assert "rank 0" in text and "rank 3" in text
    assert f"bubble={schedule.simulate().bubble:.4f}" in text
    assert str(schedule) == text  # deterministic
    grid = schedule.grid().splitlines()
    assert grid[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    rows = grid[2:]  # header and rule
    assert len(rows) == 2 * (8 + 4 - 1)  # every compute action takes one step: 2m per rank plus p - 1 to fill/drain
    assert rows[0].split() == ["0", "F0.0"] and rows[-1].split() == [str(len(rows) - 1), "B0.7"]


def test_pp1() -> None:
    for name in SCHEDULES:
        schedule = make_schedule(name, 1, V[name], 4)
        result = schedule.simulate()
        assert result.bubble == 0.0 and "rank 0" in str(schedule)
        assert all(not a.is_comm for a in schedule.actions[0])
    interleaved = make_schedule("interleaved-1f1b", 1, 3, 2)
    assert interleaved.simulate().makespan == 3 * 3 * 2


def test_costs() -> None:
    schedule = make_schedule("gpipe", 2, 2, 4)
    assert schedule.simulate({"F": 1, "B": 2}).makespan == schedule.simulate().makespan == 15
    per_stage = {("F", 0): 1, ("B", 0): 1, ("F", 1): 10, ("B", 1): 10}
    # rank 1 runs F1.* back to back from t=1, then B1.* until 81; B0.3 follows at 81.
    result = schedule.simulate(per_stage)
    assert result.makespan == 82 and result.busy == [8, 80]
    assert schedule.simulate(lambda a: 1.0).makespan == 2 * (4 + 2 - 1)
    with pytest.raises(ValueError, match=r"no entry for \('B', 1\)"):
        schedule.simulate({("F", 0): 1, ("B", 0): 1, ("F", 1): 1})
    with pytest.raises(ValueError, match="cost keys"):
        schedule.simulate({"X": 1})


def test_deadlock_recv_b_before_recv_f() -> None:
    schedule = make_schedule("1f1b", 4, 4, 8)
    acts = list(schedule.actions[1])
    recv_b = next(i for i, a in enumerate(acts) if a.kind == "RECV_B")
    moved = [acts[recv_b]] + acts[:recv_b] + acts[recv_b + 1 :]
    with pytest.raises(DeadlockError, match=re.escape("rank 1 waits at step 0 on RECV_B2.0<2")) as info:
        _with(schedule, 1, moved).simulate()
    assert str(info.value).startswith("deadlock: rank 0 waits at step")


def test_deadlock_swapped_f_and_b_on_last_rank() -> None:
    schedule = make_schedule("1f1b", 4, 4, 8)
    acts = list(schedule.actions[3])
    f = acts.index(Action("F", 3, 0))
    acts[f], acts[f + 1] = acts[f + 1], acts[f]
    with pytest.raises(DeadlockError, match=re.escape(f"rank 3 waits at step {f} on B3.0")):
        _with(schedule, 3, acts).simulate()


def test_deadlock_recv_from_wrong_peer_or_missing_send() -> None:
    schedule = make_schedule("1f1b", 4, 4, 4)
    acts = [Action("RECV_F", 0, 0, 2) if a == Action("RECV_F", 0, 0, 0) else a for a in schedule.actions[1]]
    with pytest.raises(DeadlockError, match=re.escape("rank 1 waits at step 0 on RECV_F0.0<2")):
        _with(schedule, 1, acts).simulate()
    acts = [a for a in schedule.actions[0] if a != Action("SEND_F", 0, 1, 1)]
    with pytest.raises(DeadlockError, match=re.escape("rank 1 waits at step 3 on RECV_F0.1<0")):
        _with(schedule, 0, acts).simulate()


def test_send_before_its_value_deadlocks() -> None:
    schedule = make_schedule("gpipe", 2, 2, 2)
    acts = list(schedule.actions[0])
    acts[0], acts[1] = acts[1], acts[0]
    with pytest.raises(DeadlockError, match=re.escape("rank 0 waits at step 0 on SEND_F0.0>1")):
        _with(schedule, 0, acts).simulate()


def test_invalid_action_lists() -> None:
    schedule = make_schedule("1f1b", 2, 2, 2)
    with pytest.raises(ValueError, match="F0.1 appears 2 times"):
        _with(schedule, 0, schedule.actions[0] + [Action("F", 0, 1)]).simulate()
    with pytest.raises(ValueError, match="B0.1 appears 0 times"):
        _with(schedule, 0, [a for a in schedule.actions[0] if a != Action("B", 0, 1)]).simulate()
    with pytest.raises(ValueError, match="belongs on rank 0"):
        _with(schedule, 1, schedule.actions[1] + [Action("W", 0, 0)]).simulate()
    with pytest.raises(ValueError, match="needs RECV_F0.0 earlier"):
        _with(schedule, 1, [a for a in schedule.actions[1] if a.kind != "RECV_F"]).simulate()
    with pytest.raises(ValueError, match="out of range"):
        _with(schedule, 0, schedule.actions[0] + [Action("F", 0, 5)]).simulate()
    with pytest.raises(ValueError, match="sends SEND_F0.0>1 twice"):
        _with(schedule, 0, schedule.actions[0] + [Action("SEND_F", 0, 0, 1)]).simulate()
    compute_only = Schedule("c", 2, 2, 2, [schedule.compute(0), schedule.compute(1)])
    assert compute_only.simulate().makespan == schedule.simulate().makespan


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("1f1f", 2, 2, 2), "unknown schedule '1f1f'; did you mean '1f1b'"),
        (("gpip", 2, 2, 2), "did you mean 'gpipe'"),
        (("zb-h1", 4, 6, 4), r"stages \(6\) must be a multiple of pp \(4\)"),
        (("gpipe", 2, 4, 4), "needs one stage per rank"),
        (("zb-h1", 2, 4, 4), "use 'interleaved-1f1b'"),
        (("interleaved-1f1b", 2, 4, 3), "multiple of pp=2"),
        (("1f1b", 2, 2, 0), "microbatches must be an integer >= 1"),
        (("1f1b", 0, 2, 2), "pp must be an integer >= 1"),
        (("1f1b", 2, 2, 2.0), "microbatches must be an integer"),
    ],
)
def test_bad_arguments(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_schedule(*args)
