"""Shared test setup: one gloo rank pool per session (per pytest-xdist worker: ``make test`` runs two), the
hypothesis profile, and the property-suite report (the workers' counts summed).

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


POOL_COUNTS: Counter[str] = Counter()  # under pytest-xdist: the workers' rank pools, summed at the controller


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its example and rank-pool counts to the controller, which prints the summary."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        pool = default_pool()
        out["fxpar_property_examples"] = dict(PROPERTY_EXAMPLES)
        out["fxpar_pool"] = {"tasks": pool.tasks_run, "restarts": pool.restarts, "recycles": pool.recycles}


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    out = getattr(node, "workeroutput", {})
    PROPERTY_EXAMPLES.update(out.get("fxpar_property_examples", {}))
    POOL_COUNTS.update(out.get("fxpar_pool", {}))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not PROPERTY_EXAMPLES:
        return
    total = sum(PROPERTY_EXAMPLES.values())
    per_test = ", ".join(f"{name} {n}" for name, n in sorted(PROPERTY_EXAMPLES.items()))
    terminalreporter.write_line(
        f"property suite: {total} hypothesis examples ({per_test}); seed {PROPERTY_SEED} "
        f"(replay: FXPAR_SEED={PROPERTY_SEED} make test)")
    if POOL_COUNTS:
        counts = POOL_COUNTS
    else:
        pool = default_pool()
        counts = Counter(tasks=pool.tasks_run, restarts=pool.restarts, recycles=pool.recycles)
    terminalreporter.write_line(f"rank pool: {counts['tasks']} multi-rank tasks, {counts['restarts']} restarts, "
                                f"{counts['recycles']} recycles")
