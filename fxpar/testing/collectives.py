"""Count the collectives and transfers a rank really issues, to hold ``pm.ledger(rank)`` to what runs.

``CollectiveCounter`` is a ``TorchDispatchMode``: every communication op that reaches the
dispatcher while it is active (the collectives inside the rank's graphs, functional or, on gloo, classic, the
point-to-point ``send``/``recv`` of the pipeline, the ``all_reduce`` of tied gradients and of the
loss) is recorded in issue order as ``(kind, dtype, elements)``, the elements counted as the ledger counts them
(the whole tensor a gather makes or a scatter reads). ``ledger_calls`` turns ledger rows into the same form;
``ledger_mismatch`` compares the two and says where they first differ. An all-to-all's elements depend on the
routing (the ledger lists uniform routing's), so they are not compared.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.backends.comm import COLLECTIVES
from fxpar.lower import LedgerRow

Call = tuple[str, torch.dtype, int | None]

_c10d = torch.ops.c10d
_F = torch.ops._c10d_functional
RUNTIME_KINDS = {
    **{op: kind for op, kind in COLLECTIVES.items() if kind != "wait"},  # the graphs' functional collectives
    _c10d.send.default: "send", _c10d.recv_.default: "recv",  # pipeline transfers
    _c10d.allreduce_.default: "all_reduce",  # tied-weight gradient sums, the loss report, gloo's graph collectives
    # the rest of what gloo rank graphs issue through the classic API (fxpar.backends.classic)
    _c10d._allgather_base_.default: "all_gather", _c10d._reduce_scatter_base_.default: "reduce_scatter",
    _c10d.alltoall_base_.default: "all_to_all",
    # what Inductor's generated code calls for them (Plan(compile=True))
    torch.ops._c10d_functional.all_reduce_.default: "all_reduce",
    torch.ops._c10d_functional.all_gather_into_tensor_out.default: "all_gather",
}
LEDGER_KINDS = {"all_reduce": "all_reduce", "all_reduce_max": "all_reduce", "all_gather": "all_gather",
                "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all", "send": "send", "recv": "recv"}
FLOAT8 = {torch.float8_e4m3fn, torch.float8_e5m2}
LOSS_REPORT: Call = ("all_reduce", torch.float64, 1)  # pm.step's mean loss over the world: not a ledger row
# ops whose first tensor argument is a shard of what the ledger counts (times the group size), and ops whose
# whole tensor is their second argument (the classic API's output comes first)
_TIMES_GROUP = {_F.all_gather_into_tensor.default, _F.all_gather_into_tensor_out.default}
_SECOND = {_c10d._reduce_scatter_base_.default}


class CollectiveCounter(TorchDispatchMode):
    """Records ``(kind, dtype, elements)`` of every communication op issued while active
    (``with CollectiveCounter() as c``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kind = RUNTIME_KINDS.get(func)
        if kind is not None:
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]  # c10d ops take tensor lists
            whole = args[1] if func in _SECOND else first
            elements = whole.numel() * (args[1] if func in _TIMES_GROUP else 1)
            self.calls.append((kind, first.dtype, None if kind == "all_to_all" else elements))
        return func(*args, **(kwargs or {}))


def ledger_calls(rows: list[LedgerRow]) -> list[Call]:
    """The ``(kind, dtype, elements)`` each ledger row issues at run time (float8 moves as uint8: gloo has no
    float8)."""
    return [(LEDGER_KINDS[r.op], torch.uint8 if r.dtype in FLOAT8 else r.dtype,
             None if r.op == "all_to_all" else math.prod(r.shape)) for r in rows]


def ledger_mismatch(rows: list[LedgerRow], issued: list[Call], extra: list[Call] = ()) -> str | None:
    """``None`` when ``issued`` is exactly the ledger's calls (then ``extra``), in order; else where they part."""
    want = [*ledger_calls(rows), *extra]
    if want == issued:
        return None
    first = next((i for i, (a, b) in enumerate(zip(want, issued, strict=False)) if a != b), min(len(want), len(issued)))
    return (f"the ledger lists {len(want)} calls, the step issued {len(issued)}; first difference at call {first}: "
            f"ledger {want[first] if first < len(want) else 'nothing'}, issued "
            f"{issued[first] if first < len(issued) else 'nothing'}")
