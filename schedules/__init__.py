"""Pipeline schedules as data: per-rank lists of compute and transfer actions, with a simulator.

``make_schedule(name, pp, stages, microbatches)`` builds one of ``SCHEDULES``; ``Schedule.simulate`` times it
and detects deadlocks; ``str(schedule)`` shows its bubble and a step x rank grid.
"""

from .actions import Action
from .schedule import SCHEDULES, Schedule, make_schedule
from .simulate import DeadlockError, SimResult

__all__ = ["Action", "Schedule", "SimResult", "DeadlockError", "make_schedule", "SCHEDULES"]
