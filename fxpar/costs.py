"""Closed-form costs of one node of a rank program on a ``fxpar.Cluster``: compute and collectives.

The formulas are sympy expressions (``FORMULAS``), printed by ``pm.estimate`` and evaluated through
``lambdify``:

* a compute node takes ``max(F / (P f), M / (W h)) + o``: its FLOPs over the achievable matmul rate in its
  dtype, or the bytes it reads and writes over the achievable memory bandwidth, whichever is longer, plus the
  cluster's per-op dispatch overhead ``o`` (measured on CPU; 0 on the GPU presets);
* a collective over a group of ``n`` ranks moving a tensor of ``B`` bytes (the full tensor it reduces
  or produces) runs the ring algorithm: ``2 (n-1)`` steps for an all-reduce, ``n-1`` for all-gather,
  reduce-scatter and all-to-all, each paying the link latency ``a`` and ``B / n`` bytes at bandwidth ``b``;
  a point-to-point transfer pays ``a + B / b``.
"""

from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from fxpar.cluster import Cluster
from fxpar.memory import VIEW_OPS

aten = torch.ops.aten
F_, P_, f_, M_, W_, h_, o_ = sympy.symbols("F P f M W h o", nonnegative=True)
n_, B_, a_, b_ = sympy.symbols("n B a b", positive=True)

FORMULAS: dict[str, sympy.Expr] = {
    "compute": sympy.Max(F_ / (P_ * f_), M_ / (W_ * h_)) + o_,
    "all_reduce": 2 * (n_ - 1) * (a_ + B_ / (n_ * b_)),
    "all_gather": (n_ - 1) * (a_ + B_ / (n_ * b_)),
    "reduce_scatter": (n_ - 1) * (a_ + B_ / (n_ * b_)),
    "all_to_all": (n_ - 1) * (a_ + B_ / (n_ * b_)),
    "send": a_ + B_ / b_,
}
_RING = {op: sympy.lambdify((n_, B_, a_, b_), expr) for op, expr in FORMULAS.items() if op != "compute"}
_RING["recv"] = _RING["send"]

_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
            aten.matmul.default, aten._scaled_mm.default}
_FREE = VIEW_OPS | {aten.t.default, aten.reshape.default, aten.lift_fresh_copy.default}


def formula_text() -> list[str]:
    """The closed forms, one line each, with what the symbols mean."""
    lines = [f"  {op:<15} t = {expr}" for op, expr in FORMULAS.items()]
    lines.append("  (F FLOPs, P peak FLOP/s in the node's dtype, f achievable fraction, M bytes read+written, W memory "
                 "bandwidth, h its fraction, o per-op overhead; n group size, B bytes of the full tensor, a link "
                 "latency per step, b link bandwidth)")
    return lines


def collective_time(op: str, ranks: tuple[int, ...], nbytes: int, cluster: Cluster) -> float:
    """Seconds for one collective (or ``send``/``recv``) of ``nbytes`` over the group ``ranks``."""
    latency, bandwidth = cluster.link(ranks)
    n = max(len(ranks), 2) if op in ("send", "recv") else len(ranks)
    if n < 2 and op not in ("send", "recv"):
        return 0.0
    return float(_RING[op](n, nbytes, latency, bandwidth))


def node_flops(n: fx.Node) -> float:
    """Matmul and attention FLOPs of one node (0 for everything else)."""
    val = n.meta.get("val")
    if n.target in _MATMULS:
        a = n.args[1] if n.target in (aten.addmm.default, aten.baddbmm.default) else n.args[0]
        out = val[0] if isinstance(val, (tuple, list)) else val
        return 2.0 * out.numel() * _tensor(a).shape[-1]
    name = str(n.target)
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        q, k = _tensor(n.args[0]), _tensor(n.args[1])
        fwd = 4.0 * q.numel() * k.shape[-2]  # QK^T and PV: 2 * (b h s_q s_kv d) each
        return 2 * fwd if "backward" in name else fwd
    out = val[0] if isinstance(val, (tuple, list)) else val
    if "bmm4" in name or "matmul_nd" in name:  # fxpar::bmm4 (4-d batched), fxpar::matmul_nd (a Linear's, un-flattened)
        return 2.0 * out.numel() * _tensor(n.args[0]).shape[-1]
    if "token_contract" in name:  # fxpar::token_contract: a Linear's weight gradient, summed over every token
        a = _tensor(n.args[0])
        return 2.0 * out.numel() * (a.numel() // a.shape[-1])
    return 0.0


def node_bytes(n: fx.Node) -> int:
    """Bytes a node reads and writes (views and shape ops are free)."""
    if n.op != "call_function" or n.target in _FREE or n.target.__class__.__name__ == "builtin_function_or_method":
        return 0
    total = _bytes(n.meta.get("val"))
    for a in n.all_input_nodes:
        total += _bytes(a.meta.get("val"))
    return total


def fused_bytes(n: fx.Node) -> int:
    """Bytes a pointwise or reduction node moves when Inductor fuses it with its neighbours: only what it reads from
    a materialized tensor (a matmul's, attention's or collective's output, an input) and what it writes for a
    consumer outside the fusion."""
    if not _fusible(n):
        return node_bytes(n)
    total = sum(_bytes(a.meta.get("val")) for a in n.all_input_nodes if not _fusible(_source(a)))
    if any(u.op == "output" or not _fusible(_source_user(u)) for u in n.users):
        total += _bytes(n.meta.get("val"))
    return total


def _fusible(n: fx.Node) -> bool:
    return (n.op == "call_function" and n.target not in _FREE and not node_flops(n)
            and not str(n.target).startswith("_c10d_functional")
            and n.target.__class__.__name__ != "builtin_function_or_method")


def _source(a: fx.Node) -> fx.Node:
    while a.op == "call_function" and a.target in _FREE and a.args and isinstance(a.args[0], fx.Node):
        a = a.args[0]
    return a


def _source_user(u: fx.Node) -> fx.Node:
    """A view's first non-view user (what the view feeds), else the user itself."""
    while u.op == "call_function" and u.target in _FREE and u.users:
        u = next(iter(u.users))
    return u


def compute_time(n: fx.Node, cluster: Cluster, fused: bool = False) -> tuple[float, float]:
    """(seconds, FLOPs) of one compute node on one device of ``cluster`` (``fused``: as Inductor compiles it)."""
    flops = node_flops(n)
    moved = fused_bytes(n) if fused else node_bytes(n)
    if not flops and not moved:
        return 0.0, 0.0
    t_math = flops / cluster.flops(_dtype(n)) if flops else 0.0
    return max(t_math, moved / cluster.memory_bandwidth) + cluster.op_overhead, flops


def sample_time(n: fx.Node, cluster: Cluster, weights: set[fx.Node]) -> float:
    """Seconds of a compute node that grow with its batch: all its FLOPs, and the bytes of what is neither a weight
    nor made from weights alone (``weights``); no per-op overhead. What one more sample adds at a large batch."""
    if n in weights:
        return 0.0
    moved = node_bytes(n)
    if moved:
        moved -= sum(_bytes(a.meta.get("val")) for a in n.all_input_nodes if a in weights)
    flops = node_flops(n)
    return max(flops / cluster.flops(_dtype(n)) if flops else 0.0, moved / cluster.memory_bandwidth)


def weight_nodes(gm_nodes: list[fx.Node], params: set[str]) -> set[fx.Node]:
    """The placeholders named in ``params`` and every node computed from them alone (casts, views, transposes)."""
    out: set[fx.Node] = set()
    for n in gm_nodes:
        if n.op == "placeholder":
            if n.name in params:
                out.add(n)
        elif n.op == "call_function" and n.all_input_nodes and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _tensor(x: object) -> torch.Tensor:
    val = x.meta.get("val") if isinstance(x, fx.Node) else x
    if isinstance(val, (tuple, list)):
        val = val[0]
    return val


def _dtype(n: fx.Node) -> torch.dtype:
    if n.target is aten._scaled_mm.default:
        return _tensor(n.args[0]).dtype
    val = _tensor(n)
    return val.dtype if isinstance(val, torch.Tensor) else torch.float32


def _bytes(val: object) -> int:
    if isinstance(val, torch.Tensor):
        return val.numel() * val.element_size()
    if isinstance(val, (tuple, list)):
        return sum(_bytes(v) for v in val)
    return 0
