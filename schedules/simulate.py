"""Event simulation of a schedule: static checks, cost models, timing and deadlock detection.

Every rank runs its action list in order. A compute action takes its cost; SEND_* takes no time and never
blocks (buffered); RECV_* waits for the matching SEND (zero latency). Data dependencies are checked even
between compute actions without transfers: F(s, mb) after F(s-1, mb); B(s, mb) after F(s, mb) and
B(s+1, mb); W(s, mb) after B(s, mb); a SEND after the compute action that produced its value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .actions import Action

Costs = None | Mapping[str, float] | Mapping[tuple[str, int], float] | Callable[[Action], float]
Key = tuple[str, int, int]


class DeadlockError(RuntimeError):
    """No rank can run its next action while some rank has actions left."""


@dataclass
class SimResult:
    """Outcome of ``simulate``: ``bubble = 1 - sum(busy) / (pp * makespan)`` (0 when makespan is 0)."""

    makespan: float
    busy: list[float]
    bubble: float
    timeline: list[list[tuple[float, float, Action]]] = field(default_factory=list)


def cost_function(costs: Costs, has_w: bool) -> Callable[[Action], float]:
    """Turn a cost spec into ``Action -> float`` for compute actions.

    Accepts None (unit costs: F=1, B=2, W=0; with W actions F=B=W=1), ``{"F": f, "B": b, "W": w}`` (missing
    kinds keep their default), ``{(kind, stage): cost}`` (every compute (kind, stage) must be present) or a
    callable. Raises ValueError for anything else.
    """
    default = {"F": 1.0, "B": 1.0, "W": 1.0} if has_w else {"F": 1.0, "B": 2.0, "W": 0.0}
    if costs is None:
        return lambda a: default[a.kind]
    if callable(costs):
        return costs
    if not isinstance(costs, Mapping):
        raise ValueError(f"costs must be None, a dict or a callable, got {type(costs).__name__}")
    if all(isinstance(k, str) for k in costs):
        unknown = set(costs) - set(default)
        if unknown:
            raise ValueError(f"cost keys must be 'F', 'B' or 'W', got {sorted(unknown)}")
        merged = {**default, **{k: float(v) for k, v in costs.items()}}
        return lambda a: merged[a.kind]
    if all(isinstance(k, tuple) and len(k) == 2 for k in costs):
        table = dict(costs)

        def per_stage(a: Action) -> float:
            if (a.kind, a.stage) not in table:
                raise ValueError(f"costs has no entry for ({a.kind!r}, {a.stage}) needed by {a}")
            return float(table[(a.kind, a.stage)])

        return per_stage
    raise ValueError("costs dict must be keyed by kind ('F'/'B'/'W') or by (kind, stage) tuples, not a mix")


def _deps(action: Action, stages: int) -> list[Key]:
    """Compute keys (kind, stage, mb) that must be done before ``action`` can start."""
    s, mb = action.stage, action.mb
    if action.kind == "F":
        return [("F", s - 1, mb)] if s > 0 else []
    if action.kind == "B":
        return [("F", s, mb)] + ([("B", s + 1, mb)] if s < stages - 1 else [])
    if action.kind == "W":
        return [("B", s, mb)]
    if action.is_send:
        return [(action.payload, s, mb)]
    return []


def _comm_key(action: Action, rank: int) -> tuple[str, int, int, int, int]:
    """Key that a SEND and its matching RECV share: (payload, stage, mb, src, dst)."""
    if action.is_send:
        return (action.payload, action.stage, action.mb, rank, action.peer or 0)
    return (action.payload, action.stage, action.mb, action.peer or 0, rank)


class _Sim:
    """State of one simulation run; see ``simulate``."""

    def __init__(self, actions: list[list[Action]], stages: int, cost: Callable[[Action], float]) -> None:
        self.actions, self.stages, self.cost = actions, stages, cost
        pp = len(actions)
        self.pos = [0] * pp
        self.clock = [0.0] * pp
        self.busy = [0.0] * pp
        self.done: dict[Key, float] = {}
        self.sent: dict[tuple[str, int, int, int, int], float] = {}
        self.received: set[tuple[str, int, int, int, int]] = set()
        self.timeline: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]

    def ready_time(self, action: Action, rank: int) -> float | None:
        """Earliest start of ``action`` given what has run so far, or None if it must still wait."""
        times = [self.done.get(key) for key in _deps(action, self.stages)]
        if action.is_recv:
            times.append(self.sent.get(_comm_key(action, rank)))
        if any(t is None for t in times):
            return None
        return max([self.clock[rank]] + [t for t in times if t is not None])

    def advance(self, rank: int) -> bool:
        """Run ``rank`` until it blocks or finishes; return whether it ran anything."""
        ran = False
        while self.pos[rank] < len(self.actions[rank]):
            action = self.actions[rank][self.pos[rank]]
            start = self.ready_time(action, rank)
            if start is None:
                break
            end = start
            if action.is_compute:
                end = start + self.cost(action)
                self.done[(action.kind, action.stage, action.mb)] = end
                self.busy[rank] += end - start
                self.timeline[rank].append((start, end, action))
            elif action.is_send:
                if _comm_key(action, rank) in self.sent:
                    raise ValueError(f"rank {rank} sends {action} twice")
                self.sent[_comm_key(action, rank)] = end
            else:
                if _comm_key(action, rank) in self.received:
                    raise ValueError(f"rank {rank} receives {action} twice")
                self.received.add(_comm_key(action, rank))
            self.clock[rank] = end
            self.pos[rank] += 1
            ran = True
        return ran

    def stuck_message(self) -> str:
        """Describe every unfinished rank: its position and the action it waits on."""
        parts = [
            f"rank {r} waits at step {self.pos[r]} on {self.actions[r][self.pos[r]]}"
            for r in range(len(self.actions))
            if self.pos[r] < len(self.actions[r])
        ]
        return "deadlock: " + "; ".join(parts)


def run(actions: list[list[Action]], stages: int, cost: Callable[[Action], float]) -> SimResult:
    """Simulate per-rank action lists (already validated).

    Ensures: every action ran, or raises DeadlockError naming each stuck rank, its index, and its action;
    raises ValueError if a SEND is never received.
    """
    sim = _Sim(actions, stages, cost)
    progress = True
    while progress:
        progress = False
        for rank in range(len(actions)):
            progress = sim.advance(rank) or progress
    if any(sim.pos[r] < len(actions[r]) for r in range(len(actions))):
        raise DeadlockError(sim.stuck_message())
    lost = sorted(set(sim.sent) - sim.received)
    if lost:
        payload, stage, mb, src, dst = lost[0]
        raise ValueError(f"SEND_{payload}{stage}.{mb}>{dst} on rank {src} is never received ({len(lost)} unmatched)")
    makespan = max(sim.clock, default=0.0)
    total = len(actions) * makespan
    bubble = 1.0 - sum(sim.busy) / total if total > 0 else 0.0
    return SimResult(makespan=makespan, busy=sim.busy, bubble=bubble, timeline=sim.timeline)
