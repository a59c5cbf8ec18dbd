"""Tensor-parallel styles found from the graph, not from module names.

In the forward graph of a repeated block, the *residual stream* is the block's own ``add`` nodes (those
whose provenance is the block itself, not one of its children) and wherever the block's value leaves it
(a residual ``add`` in the parent's forward reads it there). Following each matmul module's output
through everything that is not another matmul module:

* a module whose output reaches the residual stream is ``rowwise`` (it writes back to the stream);
* a module whose output reaches a rowwise module is ``colwise`` (everything between them, activations,
  attention over heads, rotary embeddings, gating, runs on its shard of the features);
* the rowwise module and the colwise modules that reach it form one *group*: sharding a group costs one
  reduction of the rowwise output over tp in the forward and one in the backward (Megatron's f/g pair).

This finds Megatron's layout in Llama (q/k/v -> o, gate/up -> down), GPT-2 (fused ``c_attn`` -> ``c_proj``,
``c_fc`` -> ``c_proj``) and any block built the same way, whatever its modules are called.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch.fx as fx

from fxpar.ir import Program
from fxpar.modules import ModuleTable

MATMUL_KINDS = ("linear", "conv1d")


@dataclass(frozen=True)
class TpGroup:
    """Colwise modules feeding one rowwise module, as module paths relative to the block."""

    colwise: tuple[str, ...]
    rowwise: str

    def styles(self, parent: str | None) -> dict[str, str]:
        """Plan globs over every block under ``parent`` (``model.layers``); module paths when the block is the
        whole model (``parent is None``)."""
        where = "" if parent is None else f"{parent}.*." if parent else "*."
        out = {f"{where}{rel}": "colwise" for rel in self.colwise}
        out[f"{where}{self.rowwise}"] = "rowwise"
        return out

    def regions(self) -> tuple[str, ...]:
        """Relative module paths whose nodes run on a tp shard when the group is sharded: the modules' closest
        common parent inside the block (attention, MLP), or the modules themselves when the block holds them."""
        paths = [*self.colwise, self.rowwise]
        common = paths[0].split(".")[:-1]
        for p in paths[1:]:
            parts = p.split(".")[:-1]
            n = 0
            while n < min(len(common), len(parts)) and common[n] == parts[n]:
                n += 1
            common = common[:n]
        return (".".join(common),) if common else tuple(paths)

    def __str__(self) -> str:
        return f"{', '.join(self.colwise)} (colwise) -> {self.rowwise} (rowwise)"


def find_groups(prog: Program, modules: ModuleTable, block: str) -> list[TpGroup]:
    """The Megatron groups of ``block`` (a module path such as ``model.layers.0``; ``""``: the whole model, whose
    output then counts as its residual stream) in ``prog``'s forward."""
    prefix = block + "." if block else ""
    matmuls = {p for p, m in modules.modules.items() if p.startswith(prefix) and m.kind in MATMUL_KINDS}
    fwd = [n for n in prog.graph.nodes if n.name in prog.provenance and prog.provenance[n.name].phase == "fwd"]
    owner = {n: _owner(prog.provenance[n.name].module, matmuls) for n in fwd}
    outputs: dict[str, fx.Node] = {}
    for n in fwd:
        if owner[n] is not None:
            outputs[owner[n]] = n  # the module's last node in graph order
    spine = {n for n in fwd if "add" in str(n.target) and prog.provenance[n.name].module == block}
    spine |= _exits(fwd, prog, block)
    reach = {m: _reached(out, owner, m, spine) for m, out in outputs.items()}
    rowwise = [m for m in outputs if "spine" in reach[m]]
    groups = []
    for r in sorted(rowwise, key=lambda m: list(outputs).index(m)):
        cols = tuple(m[len(prefix):] for m in outputs if m not in rowwise and r in reach[m])
        if cols:
            groups.append(TpGroup(cols, r[len(prefix):]))
    return groups


def _exits(fwd: list[fx.Node], prog: Program, block: str) -> set[fx.Node]:
    """Where the block's value leaves it: the graph output (whole model), or the first nodes outside ``block`` that
    read a node inside it (a block whose residual ``add`` sits in its parent's forward, a ``Sequential``)."""
    if not block:
        return {prog.graph.output_node()}

    def inside(n: fx.Node) -> bool:
        prov = prog.provenance.get(n.name)
        return prov is not None and (prov.module == block or prov.module.startswith(block + "."))

    return {n for n in fwd if not inside(n) and any(inside(a) for a in n.all_input_nodes)}


def _owner(module: str, matmuls: set[str]) -> str | None:
    """The matmul module a node belongs to (its own path or a child path of it), if any."""
    while module:
        if module in matmuls:
            return module
        module = module.rpartition(".")[0]
    return None


def _reached(start: fx.Node, owner: dict[fx.Node, str | None], me: str, spine: set[fx.Node]) -> set[str]:
    """Matmul modules (and ``"spine"``) that ``start``'s value reaches without passing through another one."""
    found: set[str] = set()
    seen = {start}
    todo = deque(start.users)
    while todo:
        n = todo.popleft()
        if n in seen:
            continue
        seen.add(n)
        if n in spine:
            found.add("spine")
            continue
        if n not in owner:
            continue
        other = owner[n]
        if other is not None and other != me:
            found.add(other)
            continue
        todo.extend(n.users)
    return found
