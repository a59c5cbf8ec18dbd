"""``Schedule``: per-rank action lists of a pipeline schedule, with text form, simulation and a grid view."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from functools import cached_property

from tabulate import tabulate

from .actions import Action
from .orders import ORDERS, add_comm
from .simulate import Costs, SimResult, cost_function, run
from .validate import validate

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


@dataclass
class Schedule:
    """A pipeline schedule: ``actions[r]`` is what pipeline rank ``r`` runs, in order (compute and transfers).

    Stage ``s`` lives on rank ``s % pp``. Requires ``pp >= 1`` and ``stages`` a positive multiple of ``pp``;
    the action lists are checked by ``validate`` (``simulate`` calls it).
    """

    name: str
    pp: int
    stages: int
    microbatches: int
    actions: list[list[Action]]

    def __post_init__(self) -> None:
        _check_layout(self.pp, self.stages, self.microbatches)

    def stage_rank(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``. Requires ``0 <= stage < stages``."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} out of range [0, {self.stages})")
        return stage % self.pp

    def stages_of(self, rank: int) -> list[int]:
        """The stages held by ``rank``, ascending. Requires ``0 <= rank < pp``."""
        if not 0 <= rank < self.pp:
            raise ValueError(f"rank {rank} out of range [0, {self.pp})")
        return list(range(rank, self.stages, self.pp))

    @cached_property
    def has_w(self) -> bool:
        """True when backward is split into B (input grad) and W (weight grad), as in zb-h1 (computed once: a
        step's events ask per action)."""
        return any(a.kind == "W" for rank_actions in self.actions for a in rank_actions)

    def compute(self, rank: int) -> list[Action]:
        """The F/B/W actions of ``rank`` in execution order (transfers left out)."""
        return [a for a in self.actions[rank] if a.is_compute]

    def validate(self) -> None:
        """Raise ValueError unless the action lists are well formed (see ``validate.validate``)."""
        validate(self.actions, self.pp, self.stages, self.microbatches)

    def text(self) -> str:
        """One line per rank, ``rank R: A A ...``. Ensures ``Schedule.from_text(...).actions == actions``."""
        return "\n".join(f"rank {r}:" + "".join(f" {a}" for a in acts) for r, acts in enumerate(self.actions))

    @staticmethod
    def from_text(name: str, pp: int, stages: int, microbatches: int, text: str) -> Schedule:
        """Parse ``text()`` output. Requires one ``rank R:`` line per rank (blank lines are skipped).

        Ensures the result round-trips; it is not validated (``simulate`` does that).
        """
        actions: dict[int, list[Action]] = {}
        for line in text.splitlines():
            if not line.strip():
                continue
            head, sep, body = line.partition(":")
            words = head.split()
            if not sep or len(words) != 2 or words[0] != "rank" or not words[1].isdigit():
                raise ValueError(f"cannot parse schedule line {line!r}; expected 'rank R: F0.0 SEND_F0.0>1 ...'")
            rank = int(words[1])
            if rank in actions or rank >= pp:
                raise ValueError(f"schedule line for rank {rank} is repeated or out of range [0, {pp})")
            actions[rank] = [Action.parse(word) for word in body.split()]
        missing = [r for r in range(pp) if r not in actions]
        if missing:
            raise ValueError(f"schedule text has no line for rank(s) {missing}")
        return Schedule(name, pp, stages, microbatches, [actions[r] for r in range(pp)])

    def simulate(self, costs: Costs = None) -> SimResult:
        """Validate, then run every rank's list in order (see ``simulate``); raises DeadlockError if stuck.

        ``costs``: None (F=1, B=2, W=0; F=B=W=1 with W actions), ``{"F": f, "B": b, "W": w}``,
        ``{(kind, stage): cost}`` or a callable ``Action -> float``.
        """
        self.validate()
        return run(self.actions, self.stages, cost_function(costs, self.has_w))

    def peak_in_flight(self) -> list[int]:
        """Per rank, the most (stage, mb) pairs whose F has run but whose last backward action (W if the
        schedule has W, else B) has not: the number of activation sets held at once."""
        release = "W" if self.has_w else "B"
        peaks = []
        for rank in range(self.pp):
            live = peak = 0
            for action in self.compute(rank):
                live += 1 if action.kind == "F" else -1 if action.kind == release else 0
                peak = max(peak, live)
            peaks.append(peak)
        return peaks

    def grid(self, costs: Costs = None) -> str:
        """Time x rank table of compute actions; a row per distinct start time, blank cells are idle.

        With ``costs=None`` every compute action takes 1 unit, so row ``i`` is time step ``i``.
        """
        result = self.simulate(costs if costs is not None else (lambda a: 1.0))
        cells: dict[float, list[str]] = {}
        for rank, entries in enumerate(result.timeline):
            for start, _end, action in entries:
                cells.setdefault(start, [""] * self.pp)[rank] = str(action)
        times = [float(t) for t in range(round(result.makespan))] if costs is None else sorted(cells)
        rows = [[f"{t:g}"] + cells.get(t, [""] * self.pp) for t in times]
        return tabulate(rows, headers=["step"] + [f"rank {r}" for r in range(self.pp)], tablefmt="simple")

    def header(self) -> str:
        """One line: name, sizes and the bubble simulated with default unit costs."""
        bubble = self.simulate().bubble
        return (
            f"{self.name}: pp={self.pp} stages={self.stages} microbatches={self.microbatches} "
            f"bubble={bubble:.4f} ({bubble:.1%})"
        )

    def __str__(self) -> str:
        return f"{self.header()}\n{self.grid()}"


def _check_int(label: str, value: object, minimum: int) -> None:
    """``value`` is an int (not bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{label} must be an integer >= {minimum}, got {value!r}")


def _check_layout(pp: int, stages: int, microbatches: int) -> None:
    """pp, stages and microbatches are positive ints and stages is a multiple of pp."""
    _check_int("pp", pp, 1)
    _check_int("stages", stages, 1)
    _check_int("microbatches", microbatches, 1)
    if stages % pp:
        raise ValueError(f"stages ({stages}) must be a multiple of pp ({pp}): each rank holds stages // pp stages")


def _check_args(name: str, pp: int, stages: int, microbatches: int) -> None:
    """Raise ValueError with a hint unless ``make_schedule`` can build this schedule."""
    if name not in SCHEDULES:
        close = difflib.get_close_matches(str(name), SCHEDULES, n=2, cutoff=0.4)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown schedule {name!r}{hint} (known: {', '.join(SCHEDULES)})")
    _check_layout(pp, stages, microbatches)
    v = stages // pp
    if name != "interleaved-1f1b" and v != 1:
        raise ValueError(
            f"schedule {name!r} needs one stage per rank (stages == pp), got stages={stages}, pp={pp} "
            f"({v} per rank); use 'interleaved-1f1b' for several stages per rank"
        )
    if name == "interleaved-1f1b" and microbatches % pp:
        raise ValueError(
            f"'interleaved-1f1b' needs microbatches to be a multiple of pp={pp} (microbatches run in groups "
            f"of pp), got {microbatches}"
        )


def make_schedule(name: str, pp: int, stages: int, microbatches: int) -> Schedule:
    """Build schedule ``name`` (one of ``SCHEDULES``) for ``pp`` ranks, ``stages`` stages and ``microbatches``.

    Requires: ``stages`` a multiple of ``pp``; ``stages == pp`` except for interleaved-1f1b; for
    interleaved-1f1b, ``microbatches % pp == 0``. Raises ValueError otherwise.
    Ensures: a validated schedule with every transfer in place (none when ``pp == 1``).
    """
    _check_args(name, pp, stages, microbatches)
    order = ORDERS[name]
    compute = [order(rank, pp, stages, microbatches) for rank in range(pp)]
    schedule = Schedule(name, pp, stages, microbatches, add_comm(compute, pp, stages))
    schedule.validate()
    return schedule
