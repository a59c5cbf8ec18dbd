"""recompute: choose the forward values the backward recomputes instead of saving (activation checkpointing)."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import Program, block_entry, entry_path
from fxpar.pass_context import Context
from fxpar.random_draws import RANDOM_OPS

aten = torch.ops.aten
# ops whose outputs "selective" saves (Korthikanti et al.; torchtitan's op-level policy): the matmuls and attention
SAVED_BY_SELECTIVE = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten._scaled_mm.default, aten.convolution.default,  # fp8's matmuls; convolutions
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
}
# a recomputed random op would draw different numbers: its outputs are always saved
RANDOM = RANDOM_OPS
POLICIES = ("selective", "full")


def recompute(prog: Program, ctx: Context) -> Program:
    """Mark the forward nodes whose values the backward recomputes.

    Requires: the joint Program (forward nodes carry ``phase != "bwd"`` and a provenance module);
    ``ctx.plan.recompute`` is ``None``, ``"full"`` or ``"selective"``.
    Ensures: ``notes["recompute"]`` = the names of those nodes, ``notes["recompute_policy"]`` = the policy.
    A block is a module path's first ``<name>.<index>`` (``layers.3``), i.e. one entry of a repeated
    ``ModuleList``. ``"full"``: inside each block every value is recomputed except those a node outside the
    block reads (the block's output, which is the next block's input, is saved). ``"selective"``: as full,
    but the outputs of matmuls, attention and collectives are saved too, so only cheap elementwise and
    norm ops rerun (and no communication).
    Random ops (dropout) are never recomputed. Lowering copies the marked nodes (and the collectives that
    feed them, e.g. a sequence-parallel all-gather) into the backward, where the printed program marks
    them ``recomputed`` and the ledger re-counts their collectives. With ``None`` the Program is unchanged.
    A byte budget (an int) marks as ``"full"`` and records ``notes["recompute_budget"]``: the budget is
    measured on a lowered program, which a pass never builds, so ``fxpar.recompute_budget`` (run by the
    compile driver after the passes) narrows the set.
    """
    policy = ctx.plan.recompute
    if policy is None:
        return prog
    if policy not in POLICIES and (not isinstance(policy, int) or isinstance(policy, bool) or policy < 0):
        raise PlanError(f"recompute must be None, 'selective', 'full' or a byte budget (int), got {policy!r}")
    block_of = {n: _block(prog, n) for n in prog.graph.nodes}
    backward = {n for n in prog.graph.nodes if is_backward(prog, n)}
    chosen = _closed({n for n in prog.graph.nodes if _recomputable(n, block_of, backward, policy == "selective")})
    if not chosen:
        raise PlanError("recompute: the model has no repeated blocks (module paths like 'layers.0') to recompute; "
                        "leave recompute=None")
    notes = {**prog.notes, "recompute": frozenset(n.name for n in chosen), "recompute_policy": policy}
    if isinstance(policy, int):  # measured on rank 0's lowered program: the compile driver resolves it
        notes.update(recompute_policy=f"budget {policy} B", recompute_budget=policy)
    return prog.replace("recompute", notes=notes)


def _closed(chosen: set[fx.Node]) -> set[fx.Node]:
    """Drop items of multi-output nodes that are saved (an item is recomputed only with its producer)."""
    return {n for n in chosen if n.target is not operator.getitem or n.args[0] in chosen}


def _block(prog: Program, node: fx.Node) -> str | None:
    prov = prog.provenance.get(node.name)
    entry = block_entry(prov.module) if prov is not None and prov.module else None
    return entry_path(*entry) if entry else None


def is_backward(prog: Program, node: fx.Node) -> bool:
    """Whether a node of the Program's joint graph belongs to the backward (its capture provenance says so)."""
    prov = prog.provenance.get(node.name)
    return prov is not None and prov.phase == "bwd"


def _recomputable(node: fx.Node, block_of: dict[fx.Node, str | None], backward: set[fx.Node],
                  save_matmuls: bool) -> bool:
    if node.op != "call_function" or node in backward or node.target in RANDOM:
        return False
    block = block_of[node]
    if block is None or (save_matmuls and node.target in SAVED_BY_SELECTIVE):
        return False
    # a value a forward node outside its block reads (the block output) is what the next block starts from: saved
    return all(block_of[u] == block or u in backward for u in node.users)
