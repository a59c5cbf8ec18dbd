"""Resolve a recompute byte budget (``Plan(recompute=<int>)``) on a lowered program.

The ``recompute`` pass marks every value ``"full"`` would recompute and records the budget; how many
bytes a choice saves depends on the lowered per-rank graph (its collectives, its ZeRO-3 re-gathers),
so the choice is made here, after the passes, by lowering rank 0 once.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import Program
from fxpar.lower import from_zero3_shards, lower
from fxpar.memory import nbytes, storage_root
from fxpar.passes.recompute import SAVED_BY_SELECTIVE

aten = torch.ops.aten


def resolve_recompute_budget(prog: Program) -> Program:
    """``prog`` with ``notes["recompute"]`` narrowed to its byte budget; unchanged without one.

    Requires: the ``recompute`` pass ran (``notes["recompute_budget"]`` set for a budget).
    Ensures: ``notes["recompute"]`` fits the budget on rank 0; ``"recompute_budget"`` is consumed.
    """
    budget = prog.notes.get("recompute_budget")
    if budget is None:
        return prog
    notes = {k: v for k, v in prog.notes.items() if k != "recompute_budget"}
    notes["recompute"] = budgeted(prog, prog.notes["recompute"], budget)
    return prog.replace(notes=notes)


def budgeted(prog: Program, full: frozenset[str], budget: int) -> frozenset[str]:
    """The recompute set under a budget of saved bytes on rank 0 (which holds the largest uneven pieces).

    Starts from ``full`` (the least memory), then saves matmul and attention outputs in order of FLOPs
    recomputed per byte saved, each only if rank 0's saved bytes stay within ``budget``: a greedy
    knapsack, exact in bytes because each trial is measured on rank 0's lowered joint graph (lowering
    emits the same graph whatever is recomputed, so one lowering serves every trial).
    """
    joint = lower(prog.replace(notes={**prog.notes, "recompute": full, "recompute_policy": "full"}), 0).joint.graph
    n_out = prog.signature.num_outputs
    least = joint_saved_bytes(joint, full, n_out)
    if least > budget:
        stage = prog.notes.get("stage")
        where = (f"stage {stage.index}'s forward (one microbatch, on its first rank) can save"
                 if stage is not None and stage.n_stages > 1 else "rank 0 can save")
        raise PlanError(f"recompute budget {budget:,} B is below the minimum {where}: {least:,} B (every "
                        "block's input, plus what the model saves outside its blocks); raise the budget or use "
                        "recompute='full'")
    keep = set(full)
    by_name = {n.name: n for n in prog.graph.nodes}
    position = {name: i for i, name in enumerate(by_name)}
    # ties (equal FLOPs per byte) go in graph order: iterating the frozenset would follow string hashing,
    # which differs between processes, and pick a different set each run
    worth = sorted((n for n in full if by_name[n].target in SAVED_BY_SELECTIVE),
                   key=lambda n: (-_flops(by_name[n]) / max(1, _out_bytes(by_name[n])), position[n]))
    for name in worth:
        trial = keep - {name} - {u.name for u in by_name[name].users if u.target is operator.getitem}
        if joint_saved_bytes(joint, frozenset(trial), n_out) <= budget:
            keep = trial
    return frozenset(keep)


def joint_saved_bytes(joint: fx.Graph, recompute: frozenset[str], num_outputs: int) -> int:
    """Bytes ``split_joint`` would save on this lowered joint graph if the nodes lowered for ``recompute`` (their
    ``meta["for_node"]``) and everything computed from ZeRO-3 shards alone were recomputed."""
    redone = from_zero3_shards(joint) | {n for n in joint.nodes if n.meta.get("for_node") in recompute
                                          and n.meta.get("phase") != "bwd" and n.op == "call_function"}
    saved: set[fx.Node] = set()
    seen: set[fx.Node] = set()
    stack = [a for n in joint.nodes if n.meta.get("phase") == "bwd" and n.op != "placeholder"
             for a in n.all_input_nodes if a.meta.get("phase") != "bwd"]
    grads = joint.output_node().args[0][num_outputs:]
    stack += [a for a in grads if isinstance(a, fx.Node) and a.meta.get("phase") != "bwd"]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in redone:
            stack.extend(n.all_input_nodes)
        else:
            saved.add(storage_root(n))
    return sum(nbytes(r) for r in saved if r.op != "placeholder")


def _out_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _flops(node: fx.Node) -> float:
    """FLOPs of a matmul (2 m n k) or an attention (4 b h s s d) from its global shapes."""
    vals = [a.meta.get("val") for a in node.args[:3] if isinstance(a, fx.Node)]
    if node.target in (aten.mm.default, aten.bmm.default):
        a, b = vals[0], vals[1]
        return 2.0 * a.numel() * b.shape[-1]
    if node.target in (aten.addmm.default, aten.baddbmm.default):
        a, b = vals[1], vals[2]
        return 2.0 * a.numel() * b.shape[-1]
    q, k = vals[0], vals[1]
    return 4.0 * q.numel() * k.shape[-2]
