"""Pipeline stages: split the exported forward graph into one module per stage.

The split happens on the forward graph of ``torch.export``, before the joint is captured: each
stage then gets its own joint forward+backward graph from AOTAutograd, so every backward node
belongs to the stage of its forward node by construction, and the gradient of each value that
crosses a stage boundary is an output of the stage that consumes it (``signature.input_grads``).

What crosses a boundary is only what must: values computed from the user's inputs. Values
that depend only on shapes, constants, parameters or buffers (rotary tables, position ids,
causal masks, a tied weight) are recomputed (or held) by every stage that uses them. A value
needed two or more stages later is passed through the stages in between, so all traffic is
between neighbouring stages. User inputs are available on every rank (``pm.step`` gets the
batch everywhere) and are never sent.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fxpar.blocks import BLOCK_CONTAINERS
from fxpar.capture import _clean_module_path
from fxpar.errors import PlanError, close_matches
from fxpar.ir import graph_module
from fxpar.stage_state import constants_stay_constants, hold_unread_state
from fxpar.structure import structure_of

aten = torch.ops.aten
VIEW_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int, aten.t.default,
            aten.permute.default, aten.slice.Tensor, aten.select.int, aten.expand.default, aten.unsqueeze.default,
            aten.squeeze.dim, aten.squeeze.dims, aten.alias.default, aten.detach.default}


@dataclass
class StageGraph:
    """One stage's forward module and how its inputs and outputs connect to its neighbours."""

    index: int
    gm: fx.GraphModule
    received: list[str]  # boundary values from the previous stage, in placeholder order (first)
    user_inputs: list[int]  # indices of flat user inputs this stage reads (placeholders after ``received``)
    sent: list[str]  # boundary values for the next stage (outputs of a non-last stage)
    first_module: str = ""  # module path where the stage starts (for the plan)
    cost: float = 0.0  # estimated forward cost (see ``node_cost``)


@dataclass
class Split:
    """Every stage of the model, plus the cost table that chose the split points."""

    stages: list[StageGraph]
    starts: list[str]  # module paths that start stages 1..n-1
    costs: list[float] = field(default_factory=list)


def module_path(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    return _clean_module_path(list(stack.values())[-1][0]) if stack else ""


def data_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes whose value depends on a user input: the only values that may cross a stage boundary."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder" or (n.op == "call_function" and any(a in out for a in n.all_input_nodes)):
            out.add(n)
    return out


def assign_stages(graph: fx.Graph, starts: list[str]) -> dict[fx.Node, int]:
    """Stage of every data node, and of every in-place write to model state that no input reaches (BatchNorm's
    ``num_batches_tracked += 1``, a call counter: kept by the stage whose code writes it, not dropped): the latest
    start module seen so far, never before its inputs' stages."""
    data = data_nodes(graph)
    stage: dict[fx.Node, int] = {}
    current = 0
    for n in graph.nodes:
        if n.op != "call_function" or (n not in data and not _writes_state(n)):
            continue
        path = module_path(n)
        for k, start in enumerate(starts, start=1):
            if path == start or path.startswith(start + "."):
                current = max(current, k)
        stage[n] = max([current, *(stage.get(a, 0) for a in n.all_input_nodes)])
    return stage


def _writes_state(n: fx.Node) -> bool:
    """An op that mutates model state (``add_``, ``copy_`` into a buffer, a parameter or a view of one): where no user
    input reaches it, that effect is all it does. An in-place op on a tensor the forward made itself (DeBERTa's
    ``detach_`` of a fresh relative-position table) is plain computation: staged with its users, not pinned."""
    target = n.target
    if not (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable):
        return False
    written = [a for a, spec in zip(n.args, target._schema.arguments, strict=False)
               if spec.alias_info is not None and spec.alias_info.is_write]
    return any(_state_root(a) for a in written)


def _state_root(x: object) -> bool:
    """``x`` is a placeholder or attribute (a parameter, buffer or constant of the model), or a view of one."""
    while isinstance(x, fx.Node):
        if x.op in ("placeholder", "get_attr"):
            return True
        target = x.target
        if not (isinstance(target, torch._ops.OpOverload) and target._schema.returns
                and target._schema.returns[0].alias_info is not None and x.args):
            return False
        x = x.args[0]
    return False


def stage_costs(stages: list[Any], has_w: bool) -> dict[tuple[str, int], float]:
    """Cost-model seconds per (action kind, stage) of a compiled model's stage ``Program``s, for
    ``Schedule.simulate(costs=...)``. F is the stage's forward estimate (max of FLOPs / peak and bytes / bandwidth per
    node, as the stage split uses); a backward costs twice its forward, split evenly into B and W (``has_w``)."""
    out: dict[tuple[str, int], float] = {}
    for prog in stages:
        info = prog.notes.get("stage")
        if info is not None:
            s, f = info.index, info.cost
        else:  # one stage: its forward nodes of the joint graph
            s, f = 0, sum(node_cost(n) for n in prog.graph.nodes
                          if n.name in prog.provenance and prog.provenance[n.name].phase == "fwd")
        out[("F", s)] = f
        if has_w:
            out[("B", s)] = out[("W", s)] = f
        else:
            out[("B", s)] = 2 * f
    return out


def node_cost(n: fx.Node) -> float:
    """Forward cost of a node in seconds on a nominal accelerator: max(FLOPs / peak, bytes / bandwidth).

    Matmul-like ops count 2*M*N*K FLOPs; everything else counts the bytes it writes. The constants
    (50 TFLOP/s, 2 TB/s) only set the ratio between the two terms.
    """
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return 0.0
    nbytes = val.numel() * val.element_size()
    flops = 0.0
    if n.target in (aten.linear.default, aten.mm.default, aten.matmul.default, aten.bmm.default, aten.addmm.default):
        a = n.args[1] if n.target is aten.addmm.default else n.args[0]
        k = a.meta["val"].shape[-1]
        flops = 2.0 * val.numel() * k
    elif "scaled_dot_product" in str(n.target):
        q = n.args[0].meta["val"]
        flops = 4.0 * q.numel() * q.shape[-2]
    return max(flops / 50e12, nbytes / 2e12)


def block_paths(model: torch.nn.Module) -> list[str]:
    """Module paths of the repeated blocks: the children of the ``BLOCK_CONTAINERS`` container with the most
    structurally identical children (same class and parameter shapes; ``model.layers`` rather than a block's own
    ``Sequential(Linear, GELU, Linear)``); on a tie, one whose children are all alike, then the longest."""
    best: list[str] = []
    best_key = (0, False, 0)
    for name, mod in model.named_modules():
        if isinstance(mod, BLOCK_CONTAINERS) and len(mod):
            alike = _most_alike(mod)
            key = (alike, alike == len(mod), len(mod))
            if key > best_key:
                best_key = key
                best = [f"{name}.{child}" if name else child for child, _ in mod.named_children()]
    return best


def _most_alike(container: torch.nn.Module) -> int:
    """How many children share the most common structure (class and parameter shapes)."""
    counts: dict[tuple, int] = {}
    for child in container.children():
        key = structure_of(child)
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0)


def _reused_note(model: torch.nn.Module) -> str:
    """Say so when a container holds one module object several times (ALBERT-style shared layers): a stage holds
    a module, so its uses cannot be split among stages."""
    for name, mod in model.named_modules():
        if isinstance(mod, BLOCK_CONTAINERS) and len(mod) > len(dict(mod.named_children())):
            return (f"; {name or type(model).__name__} has {len(mod)} entries but only "
                    f"{len(dict(mod.named_children()))} distinct module object(s), and the uses of one module cannot "
                    "be split among stages")
    return ""


def choose_starts(gm: fx.GraphModule, model: torch.nn.Module, n_stages: int,
                  cost: Callable[[fx.Node], float] = node_cost) -> tuple[list[str], list[float]]:
    """Split points for ``n_stages`` cost-balanced stages, at block boundaries (min over splits of max stage cost).
    A model without a list of repeated blocks (a CNN, a recurrent net, an encoder and a head) is split at the
    boundaries of the modules its data flows through (``call_order_modules``); one with fewer blocks than stages is
    refused."""
    blocks = block_paths(model)
    repeated = _repeated(model, blocks)
    if not repeated and (split := _balanced_at_module_boundaries(gm, n_stages, cost)) is not None:
        return split
    if repeated:
        blocks = every_block_list(model, gm.graph) or blocks
    if n_stages > max(len(blocks), 1):
        found = (f"the {len(blocks)} splittable blocks of {type(model).__name__} ({', '.join(blocks[:3])}"
                 f"{', ...' if len(blocks) > 3 else ''}{_reused_note(model)})" if blocks else
                 f"the splittable blocks of {type(model).__name__}: it has no nn.ModuleList, nn.Sequential or "
                 "nn.ModuleDict of repeated blocks (a block applied several times is one module)")
        through = "" if repeated else f", and its data flows through fewer than {n_stages} submodules"
        raise PlanError(f"stages={n_stages} is more than {found}{through}; use fewer stages, or name the modules that "
                        "start each stage (Plan(stages=[...]))")
    return _balanced(gm, blocks, n_stages, cost)


def every_block_list(model: torch.nn.Module, graph: fx.Graph) -> list[str]:
    """The entries of every list of repeated blocks (a ``BLOCK_CONTAINERS`` container with two alike children) that
    is not inside another's entries, in the order the graph first calls them: an encoder's and a decoder's layers
    (BART, T5, Whisper), a U-Net's down and up blocks; not the experts inside a layer. Empty when some entry is
    never called (its position in the data flow is unknown)."""
    lists = [name for name, mod in model.named_modules()
             if isinstance(mod, BLOCK_CONTAINERS) and len(mod) and _most_alike(mod) >= 2]
    outer = [name for name in lists if not any(name.startswith(o + ".") for o in lists if o != name and o)]
    entries = [f"{name}.{child}" if name else child
               for name in outer for child, _ in model.get_submodule(name).named_children()]
    wanted, first = set(entries), {}
    for i, n in enumerate(graph.nodes):
        parts = module_path(n).split(".")
        for k in range(1, len(parts) + 1):
            prefix = ".".join(parts[:k])
            if prefix in wanted:
                first.setdefault(prefix, i)
                break
    return sorted(entries, key=first.__getitem__) if len(first) == len(entries) else []


def _repeated(model: torch.nn.Module, blocks: list[str]) -> bool:
    """Whether two of ``blocks`` are alike (a list of layers, not a ``Sequential(conv, norm, relu)`` that won the
    search for want of one)."""
    structures = [structure_of(model.get_submodule(b)) for b in blocks]
    return len(set(structures)) < len(structures)


def _balanced(gm: fx.GraphModule, blocks: list[str], n_stages: int,
              cost: Callable[[fx.Node], float]) -> tuple[list[str], list[float]]:
    """The starts among ``blocks`` (in call order) whose largest stage cost is smallest, and each stage's cost."""
    stage = assign_stages(gm.graph, blocks[1:])
    seg_costs = [0.0] * len(blocks)
    for n, s in stage.items():
        seg_costs[s] += cost(n)
    cuts = _balanced_cuts(seg_costs, n_stages)
    starts = [blocks[c] for c in cuts]
    bounds = [0, *cuts, len(blocks)]
    return starts, [sum(seg_costs[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]


def call_order_modules(graph: fx.Graph, depth: int) -> list[str]:
    """The module paths, cut to ``depth`` components, of the nodes that compute on the model's inputs, in the order
    they are first called; a module whose own forward computes beside its children's gives way to them."""
    order: dict[str, None] = {}
    data = data_nodes(graph)
    for n in graph.nodes:
        if n.op == "call_function" and n in data and (path := module_path(n)):
            order.setdefault(".".join(path.split(".")[:depth]), None)
    return [p for p in order if not any(o.startswith(p + ".") for o in order)]


def _balanced_at_module_boundaries(gm: fx.GraphModule, n_stages: int,
                                   cost: Callable[[fx.Node], float]) -> tuple[list[str], list[float]] | None:
    """Cost-balanced starts among the modules the data flows through (``call_order_modules``), at the shallowest
    depth whose largest stage is within 10% of the best any depth gives (deeper cuts can fall inside a residual
    block, so that its skip crosses the boundary); None when the model has too few such modules."""
    deepest = max((module_path(n).count(".") + 1 for n in gm.graph.nodes if module_path(n)), default=0)
    options = []
    for depth in range(1, deepest + 1):
        modules = call_order_modules(gm.graph, depth)
        if len(modules) >= n_stages:
            options.append(_balanced(gm, modules, n_stages, cost))
    if not options:
        return None
    best = min(max(costs) for _, costs in options)
    return next(o for o in options if max(o[1]) <= 1.1 * best)


def _balanced_cuts(costs: list[float], k: int) -> list[int]:
    """Indices where stages 1..k-1 start so that the largest contiguous group sum is smallest (exact DP)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for p in range(j - 1, i):
                v = max(best[j - 1][p], prefix[i] - prefix[p])
                if v < best[j][i] - 1e-18:
                    best[j][i], arg[j][i] = v, p
    cuts, i = [], n
    for j in range(k, 0, -1):
        i = arg[j][i]
        cuts.append(i)
    return sorted(cuts)[1:]


def resolve_starts(model: torch.nn.Module, stages: list[str] | tuple[str, ...]) -> list[str]:
    """Validate user split paths against the model's modules (with close-match hints)."""
    paths = [name for name, _ in model.named_modules() if name]
    repeated = sorted({p for p in stages if list(stages).count(p) > 1}, key=str)
    if repeated:
        raise PlanError(f"stage split path {repeated[0]!r} is listed more than once: each path starts one stage")
    for p in stages:
        if not isinstance(p, str) or p not in paths:
            hint = close_matches(str(p), paths)
            raise PlanError(f"stage split path {p!r} matches no module of {type(model).__name__}"
                            + (f"; did you mean: {', '.join(hint)}?" if hint else ""))
    return list(stages)


def split_stages(gm: fx.GraphModule, model: torch.nn.Module, stages: int | list[str] | tuple[str, ...],
                 cost: Callable[[fx.Node], float] = node_cost,
                 op_of: Callable[[fx.Node], Any] = lambda n: n.target) -> Split:
    """Split the exported forward graph into stages (an int: cost-balanced; a list: module paths starting stages).
    ``cost``: a node's forward cost (``node_cost``; a repeated block's call costs its nodes). ``op_of``: the op that
    computes a node's value (a repeated block's output: the block's own op, which a whole-model export would show)."""
    if isinstance(stages, int):
        starts, costs = choose_starts(gm, model, stages, cost) if stages > 1 else ([], [])
    else:
        starts, costs = resolve_starts(model, stages), []
    stage = assign_stages(gm.graph, starts)
    n = len(starts) + 1
    _check_nonempty(stage, starts, n)
    needed = _crossing(gm.graph, stage, n)
    graphs = [_build_stage(gm, stage, s, needed, n, op_of) for s in range(n)]
    hold_unread_state(gm, graphs)
    for s, g in enumerate(graphs):
        g.first_module = starts[s - 1] if s else "the model inputs"
        g.cost = costs[s] if costs else sum(cost(x) for x, k in stage.items() if k == s)
    return Split(graphs, starts, [g.cost for g in graphs])


def _check_nonempty(stage: dict[fx.Node, int], starts: list[str], n: int) -> None:
    counts = [0] * n
    for s in stage.values():
        counts[s] += 1
    if n > 1 and counts[0] == 0:
        raise PlanError(f"stage 0 computes nothing: the first split path {starts[0]!r} is where the model's "
                        "computation begins; name the module that starts the second stage")
    for s in range(1, n):
        if counts[s] == 0:
            raise PlanError(f"stage {s} (starting at {starts[s - 1]!r}) computes nothing from the model's inputs: "
                            "its split path starts no computation, or comes after a later one; "
                            "list split paths in execution order")


def _crossing(graph: fx.Graph, stage: dict[fx.Node, int], n: int) -> list[list[fx.Node]]:
    """``needed[s]``: data values produced at or before stage s and used after it (sent from s to s+1)."""
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        users_stage = n - 1 if node.op == "output" else stage.get(node)
        if users_stage is None:
            continue
        for a in node.all_input_nodes:
            if a in stage:
                last_use[a] = max(last_use.get(a, 0), users_stage)
    needed: list[list[fx.Node]] = [[] for _ in range(n)]
    for node in graph.nodes:  # graph order keeps the send order deterministic
        if node in stage:
            for s in range(stage[node], last_use.get(node, stage[node])):
                needed[s].append(node)
    return needed


def _build_stage(gm: fx.GraphModule, stage: dict[fx.Node, int], s: int, needed: list[list[fx.Node]],
                 n: int, op_of: Callable[[fx.Node], Any]) -> StageGraph:
    received = needed[s - 1] if s else []
    out_node = gm.graph.output_node()
    roots = [x for x in gm.graph.nodes if stage.get(x) == s and not _is_guard(x)]
    roots += [a for a in out_node.all_input_nodes] if s == n - 1 else needed[s]
    keep = _closure(roots, set(received))
    for a in keep:
        assert a not in stage or stage[a] == s or a in received, f"{a.name} (stage {stage[a]}) reached stage {s} unsent"
    user_phs = [p for p in gm.graph.nodes if p.op == "placeholder"]
    used_inputs = [i for i, p in enumerate(user_phs) if p in keep]
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: _placeholder(g, a) for a in received}
    env.update({user_phs[i]: _placeholder(g, user_phs[i]) for i in used_inputs})
    for x in gm.graph.nodes:
        if x in keep and x not in env:
            env[x] = g.node_copy(x, lambda b: env[b])
    if s == n - 1:
        outs = [env[a] if isinstance(a, fx.Node) else a for a in out_node.args[0]]
        sent: list[str] = []
    else:
        outs = [_fresh(g, env[a], a in received or op_of(a) in VIEW_OPS) for a in needed[s]]
        sent = [a.name for a in needed[s]]
    g.output(tuple(outs))
    g.eliminate_dead_code()
    sub = graph_module(gm, g)
    constants_stay_constants(sub, gm)
    return StageGraph(s, sub, [a.name for a in received], used_inputs, sent)


def _closure(roots: list[fx.Node], stop: set[fx.Node]) -> set[fx.Node]:
    """``roots`` and everything they read, not looking past ``stop`` (values received from the previous stage)."""
    keep: set[fx.Node] = set()
    todo = list(roots)
    while todo:
        a = todo.pop()
        if a in keep:
            continue
        keep.add(a)
        if a not in stop:
            todo.extend(a.all_input_nodes)
    return keep


def _placeholder(g: fx.Graph, a: fx.Node) -> fx.Node:
    ph = g.placeholder(re.sub(r"\W", "_", a.name))
    ph.meta.update(a.meta)
    return ph


def _fresh(g: fx.Graph, v: fx.Node, alias: bool) -> fx.Node:
    """A boundary output that is not an input or a view (``alias``: AOTAutograd would treat it as one)."""
    if not alias:
        return v
    out = g.call_function(aten.clone.default, (v,))
    out.meta.update(v.meta)
    return out


def _is_guard(n: fx.Node) -> bool:
    return n.op == "call_module" and str(n.target).startswith("_guards")
