"""Pipeline schedules as data: per-rank lists of compute and transfer actions, with a simulator.

``make_schedule(name, pp, stages, microbatches)`` builds one of ``SCHEDULES``; ``Schedule.simulate`` times it
and detects deadlocks; ``str(schedule)`` shows its bubble and a step x rank grid. Costs come from units, the
cost model (``pm.stage_costs()``) or a measured step (``costs_from_trace(path)``).
"""

from .actions import Action
from .schedule import SCHEDULES, Schedule, make_schedule
from .simulate import DeadlockError, SimResult
from .trace_costs import costs_from_trace

__all__ = ["Action", "Schedule", "SimResult", "DeadlockError", "make_schedule", "SCHEDULES", "costs_from_trace"]
