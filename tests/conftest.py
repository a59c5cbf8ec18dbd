"""Shared test setup: one gloo rank pool per session, the hypothesis profile, and the property-suite report.

The property suite's seed is fixed (so CI is reproducible) unless ``FXPAR_SEED`` is set; ``FXPAR_SEED=random``
draws a fresh one. The terminal summary prints the seed and how many examples ran.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from fxpar.testing import RankPool, default_pool

DEFAULT_SEED = 20261122
_seed_env = os.environ.get("FXPAR_SEED", str(DEFAULT_SEED))
PROPERTY_SEED = random.randrange(2**32) if _seed_env == "random" else int(_seed_env)
PROPERTY_EXAMPLES: Counter[str] = Counter()

settings.register_profile(
    "fxpar",
    deadline=None,  # multi-rank examples take seconds, and vary with the machine's load
    database=None,  # no .hypothesis/ folder: CI and local runs see the same examples for a seed
    print_blob=True,  # a failure prints @reproduce_failure(...) to replay it exactly
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("fxpar")


@pytest.fixture(scope="session", autouse=True)
def rank_pool() -> Iterator[RankPool]:
    """The gloo rank processes every multi-rank test of the session shares; stopped at the end."""
    pool = default_pool()
    yield pool
    pool.close()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not PROPERTY_EXAMPLES:
        return
    total = sum(PROPERTY_EXAMPLES.values())
    per_test = ", ".join(f"{name} {n}" for name, n in sorted(PROPERTY_EXAMPLES.items()))
    terminalreporter.write_line(
        f"property suite: {total} hypothesis examples ({per_test}); seed {PROPERTY_SEED} "
        f"(replay: FXPAR_SEED={PROPERTY_SEED} make test)")
    pool = default_pool()
    terminalreporter.write_line(f"rank pool: {pool.tasks_run} multi-rank tasks, {pool.restarts} restarts, "
                                f"{pool.recycles} recycles")
