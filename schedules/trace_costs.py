"""Per-(kind, stage) action costs measured from a Chrome trace written by ``pm.step(..., trace=path)``."""

from __future__ import annotations

import json
import statistics
from typing import Any

COMPUTE_KINDS = ("F", "B", "W")


def costs_from_trace(trace: str | dict[str, Any]) -> dict[tuple[str, int], float]:
    """Mean duration in seconds of each compute action kind per stage, over the trace's ranks and microbatches.

    ``trace``: the JSON file path or its loaded content. The result feeds ``Schedule.simulate(costs=...)``.
    Raises ValueError when the trace holds no compute actions.
    """
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    durations: dict[tuple[str, int], list[float]] = {}
    for event in trace.get("traceEvents", []):
        kind = event.get("cat")
        if kind in COMPUTE_KINDS:
            stage = int(event["name"][1:].split(".")[0])  # "F1.3": stage 1, microbatch 3
            durations.setdefault((kind, stage), []).append(event["dur"] * 1e-6)
    if not durations:
        raise ValueError("the trace has no F/B/W actions: write it with pm.step(..., trace=path)")
    return {key: statistics.mean(values) for key, values in sorted(durations.items())}
