"""fxpar: compile an unmodified PyTorch model into one program per rank of a device mesh."""

import fxpar.calibrate  # noqa: F401  (Cluster.measure's calibration needs parallelize: it registers itself)
import fxpar.fx_leaves  # noqa: F401  (torch.fx graph building without a per-node pytree walk: the same leaves)
import fxpar.ops  # noqa: F401  (registers fxpar::bmm4 before any program runs)
from fxpar import checkpoint  # fxpar.checkpoint.save(pm, opt, folder) right after ``import fxpar``
from fxpar.api import parallelize
from fxpar.cluster import Cluster
from fxpar.errors import CaptureError, CheckpointError, FxparWarning, PlanError
from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.runtime import ParallelModule
from fxpar.search import Candidate, search
from fxpar.verify import VerifyError, verify

__all__ = ["Candidate", "CaptureError", "CheckpointError", "Cluster", "FxparWarning", "Mesh", "ParallelModule", "Plan",
           "PlanError", "VerifyError", "checkpoint", "parallelize", "search", "verify"]
