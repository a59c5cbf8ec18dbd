"""Per-(kind, stage) action costs measured from a Chrome trace written by ``pm.step(..., trace=path)``."""

from __future__ import annotations

import json
import statistics
from typing import Any

COMPUTE_KINDS = ("F", "B", "W")


def costs_from_trace(trace: str | dict[str, Any]) -> dict[tuple[str, int], float]:
    """Mean duration in seconds of each compute action kind per stage, over the trace's ranks and microbatches.
    A schedule's ``B`` that ran as two halves (``W3.1 (of B3.1)`` follows ``B3.1``) counts both.

    ``trace``: the JSON file path or its loaded content. The result feeds ``Schedule.simulate(costs=...)``.
    Raises ValueError when the trace holds no compute actions.
    """
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    per_action: dict[tuple[Any, str, int, str], float] = {}  # (rank, kind, stage, microbatch) -> seconds
    for event in trace.get("traceEvents", []):
        if event.get("cat") in COMPUTE_KINDS:
            action = event["name"].split(" (of ")[-1].rstrip(")")  # "W1.3 (of B1.3)": a split B's second half
            stage, mb = action[1:].split(".")[:2]  # "F1.3": stage 1, microbatch 3
            key = (event.get("tid"), action[0], int(stage), mb)
            per_action[key] = per_action.get(key, 0.0) + event["dur"] * 1e-6
    durations: dict[tuple[str, int], list[float]] = {}
    for (_, kind, stage, _), seconds in per_action.items():
        durations.setdefault((kind, stage), []).append(seconds)
    if not durations:
        raise ValueError("the trace has no F/B/W actions: write it with pm.step(..., trace=path)")
    return {key: statistics.mean(values) for key, values in sorted(durations.items())}
