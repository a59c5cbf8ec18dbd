"""Testing tools for parallel programs, usable from a user's own pytest.

* ``assert_equivalent``: a parallel program vs the single-device model, on real gloo ranks.
* ``RankPool`` / ``default_pool``: gloo rank processes started once and reused between checks.
* ``fxpar.testing.strategies``: hypothesis strategies over models, meshes and plans.
"""

from fxpar.testing.equivalence import EquivalenceError, Mismatch, RankReport, assert_equivalent
from fxpar.testing.pool import RankPool, close_default_pool, default_pool
from fxpar.testing.tolerance import Tolerance, default_tolerance

__all__ = ["EquivalenceError", "Mismatch", "RankPool", "RankReport", "Tolerance", "assert_equivalent",
           "close_default_pool", "default_pool", "default_tolerance"]
