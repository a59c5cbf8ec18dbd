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
BLOCK = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")  # the first ``name.<index>`` in a module path: a repeated block
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
    if policy not in POLICIES and (not isinstance(policy, int) or isinstance(policy, bool) or policy < 0):
        raise PlanError(f"recompute must be None, 'selective', 'full' or a byte budget (int), got {policy!r}")
    block_of = {n: _block(prog, n) for n in prog.graph.nodes}
    backward = {n for n in prog.graph.nodes if is_backward(prog, n)}
    chosen = _closed({n for n in prog.graph.nodes if _recomputable(n, block_of, backward, policy == "selective")})
    if not chosen:
        raise PlanError("recompute: the model has no repeated blocks (module paths like 'layers.0') to recompute; "
                        "leave recompute=None")
    names = frozenset(n.name for n in chosen)
    if isinstance(policy, int):
        names = budgeted(prog, names, policy)
        policy = f"budget {policy} B"
    return prog.replace("recompute", notes={**prog.notes, "recompute": names, "recompute_policy": policy})


def _closed(chosen: set[fx.Node]) -> set[fx.Node]:
    """Drop items of multi-output nodes that are saved (an item is recomputed only with its producer)."""
    return {n for n in chosen if n.target is not operator.getitem or n.args[0] in chosen}


def budgeted(prog: Program, full: frozenset[str], budget: int) -> frozenset[str]:
    """The recompute set under a budget of saved bytes on rank 0 (which holds the largest uneven pieces).

    Starts from ``full`` (the least memory), then saves matmul and attention outputs in order of FLOPs
    recomputed per byte saved, each only if rank 0's saved bytes stay within ``budget``: a greedy
    knapsack, exact in bytes because each trial is measured on rank 0's lowered joint graph (lowering
    emits the same graph whatever is recomputed, so one lowering serves every trial).
    """
    from fxpar.lower import lower

    joint = lower(prog.replace(notes={**prog.notes, "recompute": full, "recompute_policy": "full"}), 0).joint.graph
    n_out = prog.signature.num_outputs
    least = joint_saved_bytes(joint, full, n_out)
    if least > budget:
        raise PlanError(f"recompute budget {budget:,} B is below the minimum rank 0 can save: {least:,} B (every "
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
    from fxpar.lower import _from_zero3_shards
    from fxpar.memory import nbytes, storage_root

    redone = _from_zero3_shards(joint) | {n for n in joint.nodes if n.meta.get("for_node") in recompute
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


def _block(prog: Program, node: fx.Node) -> str | None:
    prov = prog.provenance.get(node.name)
    match = BLOCK.match(prov.module) if prov is not None and prov.module else None
    return f"{match.group(1)}.{match.group(2)}" if match else None


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
