"""recompute: choose the forward values the backward recomputes instead of saving (activation checkpointing)."""

from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx

from fxpar.errors import PlanError
from fxpar.ir import Program
from fxpar.pipeline import Context

aten = torch.ops.aten
# ops whose outputs "selective" saves (Korthikanti et al.; torchtitan's op-level policy): the matmuls and attention
SAVED_BY_SELECTIVE = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.linear.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default,
}
# a recomputed random op would draw different numbers: its outputs are always saved
RANDOM = {aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli_.float, aten.rand.default,
          aten.randn.default, aten.rand_like.default, aten.randn_like.default}
BLOCK = re.compile(r"^(.*?\.\d+)(?:\.|$)")  # the first ``name.<index>`` in a module path: a repeated block
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
    """
    policy = ctx.plan.recompute
    if policy is None:
        return prog
    if policy not in POLICIES:
        raise PlanError(f"recompute must be None, 'selective' or 'full', got {policy!r}")
    block_of = {n: _block(prog, n) for n in prog.graph.nodes}
    chosen = {n for n in prog.graph.nodes if _recomputable(n, block_of, policy == "selective")}
    chosen = {n for n in chosen if n.target is not operator.getitem or n.args[0] in chosen}
    if not chosen:
        raise PlanError("recompute: the model has no repeated blocks (module paths like 'layers.0') to recompute; "
                        "leave recompute=None")
    names = frozenset(n.name for n in chosen)
    return prog.replace("recompute", notes={**prog.notes, "recompute": names, "recompute_policy": policy})


def _block(prog: Program, node: fx.Node) -> str | None:
    prov = prog.provenance.get(node.name)
    match = BLOCK.match(prov.module) if prov is not None and prov.module else None
    return match.group(1) if match else None


def _recomputable(node: fx.Node, block_of: dict[fx.Node, str | None], save_matmuls: bool) -> bool:
    if node.op != "call_function" or node.meta.get("phase") == "bwd" or node.target in RANDOM:
        return False
    block = block_of[node]
    if block is None or (save_matmuls and node.target in SAVED_BY_SELECTIVE):
        return False
    # a value read outside its block (the block output) is what the next block starts from: saved
    return all(block_of[u] == block or u.meta.get("phase") == "bwd" for u in node.users)
