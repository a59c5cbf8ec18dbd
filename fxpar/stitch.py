"""Stitch: one joint graph per distinct block, copied in at every call of it.

``fxpar.blocks`` exported the model with each repeated block as one ``fxpar::block`` call;
AOTAutograd then gave a joint graph with a ``fxpar::block`` node per layer in the forward and a
``fxpar::block_backward`` node per layer in the backward. Here each distinct block (a ``Site``
key plus the outputs the model uses) is exported and captured once, as AOTAutograd would see
it inside the model: its tensor inputs, parameters and buffers as inputs, and a tangent per
output whose gradient flows. ``stitch`` then rebuilds the model's joint graph node by node,
copying the block's forward nodes at each ``fxpar::block`` and its backward nodes at the
matching ``fxpar::block_backward``, with each node asking ``torch.fx`` for the name the tracer
asked for (``mm``, not ``mm_12``): the graph, names included, is the one a whole-model capture
gives. Provenance is the block's, under the layer's own path (``layers.37.mlp.down_proj``).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

from fxpar.batch_norm import CAPTURE_DECOMPOSITIONS
from fxpar.block_chain import chain_members
from fxpar.block_reads import check_reads_unchanged, recording_reads
from fxpar.blocks import BLOCK_OPS, TENSOR, BlockTable, NotShared, Site, out_meta
from fxpar.creation_order import dead_names_before, recording_names
from fxpar.grad_accumulation import absorbed, accumulation_chains, added_after, emitted_after
from fxpar.ir import Provenance, graph_module
from fxpar.source import _clean_module_path, user_source
from fxpar.token_rows import token_rows_unflattened
from fxpar.whole_names import Names

_BLOCK, _BLOCK_BACKWARD = BLOCK_OPS
_THIS_FILE = os.path.abspath(__file__)
WRAPPED = "block"  # the block's attribute name in the wrapper traced once
# node meta of a copied block node: (its block's capture, the node it copies). Copies of one node share its ``val``
# and arguments up to renaming, so a pass may decide for one copy as for another whose inputs it sees the same way
TEMPLATE = "fxpar_template"


@dataclass(frozen=True)
class Captures:
    """How a model was captured (``Program.notes["captures"]``): ``blocks`` calls of repeated blocks traced as
    ``distinct`` captures, or the whole model traced (``whole``, with the reason when sharing was tried);
    ``stages_copied``: pipeline stages whose joint is an earlier stage's with paths moved (``fxpar.capture_twins``);
    ``chained``: block calls the model's own trace saw as runs, one op for each run (``fxpar.block_chain``)."""

    blocks: int = 0
    distinct: int = 0
    whole: bool = True
    reason: str = ""
    stages_copied: int = 0
    chained: int = 0


@dataclass
class Representative:
    """A block's joint graph, traced once, and how its inputs and outputs map to a ``fxpar::block`` call."""

    gm: fx.GraphModule
    inputs: dict[fx.Node, int]  # placeholder -> index in the op's tensor inputs
    tangents: dict[fx.Node, int]  # placeholder -> index of the block's tensor output it is the gradient of
    forward: list[fx.Node]  # the nodes a forward call copies, in order
    backward: list[fx.Node]
    outputs: dict[int, fx.Node]  # block tensor output -> node
    grads: dict[int, fx.Node]  # op input -> its gradient's node
    provenance: dict[fx.Node, Provenance]  # module relative to the block ("", ".mlp.up"; None: none), source, phase
    forward_graph: fx.Graph  # the exported forward (pipeline stage costs)
    n_user_inputs: int
    # names the block's trace dropped (``fxpar.creation_order``): before each copied node, and after the last
    # forward and backward node (a dropped name between the two is taken with the forward)
    dead_before: dict[str, list[str]]
    dead_after: tuple[list[str], list[str]]
    sums: dict[int, fx.Node]  # op input -> the first add of the block's own sum of its gradient (grad_accumulation)
    kept_meta: dict[fx.Node, dict[str, Any]] = field(default_factory=dict)  # each node's meta every copy keeps

    @property
    def read_inputs(self) -> set[int]:
        """The op inputs the block's graph reads (forward or backward)."""
        return {i for ph, i in self.inputs.items() if ph.users}


class _BlockCall(torch.nn.Module):
    """The block called on its flat tensor inputs, returning the tensor outputs the model uses."""

    def __init__(self, site: Site, used: tuple[int, ...]) -> None:
        super().__init__()
        setattr(self, WRAPPED, site.module)
        self._site, self._used = site, used

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        given = iter(tensors)
        flat = [next(given) if c is TENSOR else c for c in self._site.constants]
        args, kwargs = pytree.tree_unflatten(flat, self._site.in_spec)
        outs = [x for x in pytree.tree_leaves(getattr(self, WRAPPED)(*args, **kwargs)) if isinstance(x, torch.Tensor)]
        return tuple(outs[i] for i in self._used)


class Blocks:
    """The sites of one export and their representatives, traced on first use (``of``)."""

    def __init__(self, table: BlockTable, fake_mode: Any, trace_context: Any) -> None:
        self.table, self.fake_mode, self.trace_context = table, fake_mode, trace_context
        self.used: dict[int, tuple[int, ...]] = {}  # site id -> tensor outputs the model reads
        self.reps: dict[tuple[Any, ...], Representative] = {}

    def note_uses(self, graph: fx.Graph) -> None:
        """Record which tensor outputs of every ``fxpar::block`` node of the exported forward ``graph`` are read.
        A block module called more than once (ALBERT's one layer, ``layers[i % 2]``) is not shared: its parameters'
        gradients are sums over its calls, in an order only the whole-model trace knows."""
        if len({site.path for site in self.table.sites.values()}) < len(self.table.sites):
            raise NotShared("a block is called more than once")
        calls = graph.find_nodes(op="call_function", target=_BLOCK)
        if sum(len(chain_members(self.table, n.args[0])) for n in calls) < len(self.table.sites):
            raise NotShared("a block is called inside a region the export keeps as a subgraph (torch.autocast, "
                            "torch.no_grad inside the model's forward)")
        for n in calls:
            used = sorted({u.args[1] for u in n.users if u.target is operator.getitem and u.users})
            if len(used) != len(n.users) and any(u.target is not operator.getitem for u in n.users):
                raise NotShared("a block's outputs are read as a list")
            *before, last = chain_members(self.table, n.args[0])
            for site_id in before:  # a run's calls before its last: the next call reads every output
                self.used[site_id] = tuple(range(len(out_meta(site_id))))
            self.used[last] = tuple(used)

    def key(self, site_id: int) -> tuple[Any, ...]:
        return (self.table.sites[site_id].key, self.used[site_id])

    def of(self, site_id: int) -> Representative:
        key = self.key(site_id)
        if key not in self.reps:
            with self.trace_context():
                self.reps[key] = _trace(self.table.sites[site_id], self.used[site_id], self.fake_mode)
        return self.reps[key]

    def summary(self) -> Captures:
        return Captures(blocks=len(self.used), distinct=len(self.reps), whole=False,
                        chained=sum(len(chain.sites) for chain in self.table.chains.values()))

    def output_op(self, site_id: int, index: int) -> Any:
        """The op that computes tensor output ``index`` of a call (a run's one op: its last call's)."""
        last = chain_members(self.table, site_id)[-1]
        out = self.of(last).forward_graph.output_node().args[0][self.used[last].index(index)]
        return getattr(out, "target", None)

    def cost(self, site_id: int, data: tuple[bool, ...], node_cost: Any) -> float:
        """The forward cost of a call (``fxpar.stages.node_cost`` summed over the block's nodes that depend on the
        model's inputs, as in a whole-model export): ``data[i]`` says if the call's input ``i`` does."""
        rep = self.of(site_id)
        placeholders = [n for n in rep.forward_graph.nodes if n.op == "placeholder"]
        users = placeholders[len(placeholders) - rep.n_user_inputs:]
        seen = {p for p, d in zip(users, data, strict=False) if d}
        total = 0.0
        for n in rep.forward_graph.nodes:
            if n.op == "call_function" and any(a in seen for a in n.all_input_nodes):
                seen.add(n)
                total += node_cost(n)
        return total


def _trace(site: Site, used: tuple[int, ...], fake_mode: Any) -> Representative:
    """Export and capture one block call as the whole model's capture would see it."""
    wrapper = _BlockCall(site, used)
    with fake_mode:
        made: list[torch.Tensor] = []
        for i, (shape, stride, dtype, requires_grad, first, _, device) in enumerate(site.templates):
            if first != i:
                made.append(made[first])
                continue
            t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
            made.append(t.requires_grad_(requires_grad))
        args = tuple(made)
        with recording_reads(site.module) as reads:
            ep = torch.export.export(wrapper, args, strict=False)
    check_reads_unchanged(site.path, site.reads, reads)
    with fake_mode:
        token_rows_unflattened(ep.graph_module)
        with ExitStack() as stack, without_onednn(), recording_names():
            joint = aot_export_joint_with_descriptors(stack, ep.module(), args, decompositions=CAPTURE_DECOMPOSITIONS)
    return _representative(joint.graph_module, site, used, ep.graph_module.graph, len(args))


@contextmanager
def without_onednn() -> Iterator[None]:
    """oneDNN off while a joint is traced: torch's decomposition of ``nn.LSTM``/``nn.GRU`` picks oneDNN's
    inference-only RNN kernel whenever the input needs no gradient, even when the weights do, and its backward
    then fails at run time. (``torch.backends.mkldnn.flags`` would also set TF32 and warn on every call.)"""
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(enabled)


def _representative(gm: fx.GraphModule, site: Site, used: tuple[int, ...], forward_graph: fx.Graph,
                    n_inputs: int) -> Representative:
    n_args, n_params = site.n_args, len(site.params)
    where = {f"{WRAPPED}.{p}": n_args + i for i, p in enumerate(site.params)}
    where.update({f"{WRAPPED}.{b}": n_args + n_params + i for i, b in enumerate(site.buffers)})
    inputs, tangents = {}, {}
    for n in gm.graph.find_nodes(op="placeholder"):
        desc = n.meta["desc"]
        kind = type(desc).__name__
        if kind in ("ParamAOTInput", "BufferAOTInput"):
            inputs[n] = where[desc.target]
        elif kind == "PlainAOTInput":
            inputs[n] = desc.idx
        elif kind == "TangentAOTInput":
            tangents[n] = used[desc.output.idx]
        else:
            raise NotShared(f"a block has an input AOTAutograd calls {kind}")
    if gm.graph.find_nodes(op="get_attr"):
        raise NotShared("a block's graph reads constants")
    out = gm.graph.output_node()
    outputs, grads = {}, {}
    for value, desc in zip(out.args[0], out.meta["desc"], strict=True):
        kind = type(desc).__name__
        if value is None:
            continue
        if kind == "PlainAOTOutput":
            outputs[used[desc.idx]] = value
        elif kind == "GradAOTOutput":
            of = desc.grad_of
            grads[where[of.target] if hasattr(of, "target") else of.idx] = value
        else:
            raise NotShared(f"a block has an output AOTAutograd calls {kind}")
    body = [n for n in gm.graph.nodes if n.op == "call_function"]
    backward = [n for n in body if n.meta.get("partitioner_tag") == "is_backward"]
    forward = [n for n in body if n.meta.get("partitioner_tag") != "is_backward"]
    if body != forward + backward:
        raise NotShared("a block's joint graph interleaves forward and backward nodes")
    provenance = {n: _relative_provenance(n) for n in body}
    dead_before, trailing, _ = dead_names_before(gm.graph)
    forward_tail = dead_before.pop(backward[0].name, []) if backward else []
    backward_tail = dead_before.pop(out.name, []) + trailing
    if not backward:
        forward_tail, backward_tail = backward_tail, []
    return Representative(gm, inputs, tangents, forward, backward, outputs, grads, provenance, forward_graph,
                          n_inputs, dead_before, (forward_tail, backward_tail), accumulation_chains(inputs, grads))


def _relative_provenance(n: fx.Node) -> Provenance:
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
    module = _clean_module_path(list(stack.values())[-1][0]) if stack else ""
    # inside the block: relative to it ("" or ".mlp.up"); else (no module, or the wrapper's root) outside: None
    inside = module == WRAPPED or module.startswith(WRAPPED + ".")
    module = module[len(WRAPPED):] if inside else None
    phase = "bwd" if n.meta.get("partitioner_tag") == "is_backward" else "fwd"
    return Provenance(module, user_source(n.meta.get("stack_trace"), skip=(_THIS_FILE,)), phase)


def stitch(gm: fx.GraphModule, blocks: Blocks, outer_source: Any, stage: bool = False) -> fx.GraphModule:
    """``gm``'s joint graph with every ``fxpar::block``/``fxpar::block_backward`` node replaced by the block's own
    nodes. ``outer_source(node)``: the user's line of a call, for block nodes that have none inside the block.
    ``stage``: ``gm`` is a pipeline stage's, whose whole-model counterpart had its dead code removed before its trace
    (``fxpar.stages``): what only a block's unread inputs need takes no name there, and may not cross a boundary."""
    g = fx.Graph()
    g._codegen = gm.graph._codegen
    env: dict[fx.Node, Any] = {}
    calls: dict[int, tuple[dict[fx.Node, fx.Node], Site, str, Names]] = {}
    outer = Names(g)
    dead = _dead_without_blocks(gm.graph, blocks)
    # names the trace made for nodes it then dropped; a block call's unused outputs have none in a whole-model trace
    dropped, dropped_last, unpacked = dead_names_before(gm.graph, lambda n: n.target in BLOCK_OPS)
    merged: dict[fx.Node, fx.Node] = {}  # the model's gradient adds a block's own sum starts from instead
    early: dict[fx.Node, fx.Node] = {}  # the model's gradient adds emitted inside a block's backward -> their copy
    for n in gm.graph.nodes:
        outer.take_dropped(dropped.get(n.name, ()), unpacked)
        if n in early:  # emitted where the whole-model trace adds it (fxpar.grad_accumulation)
            env[n] = early[n]
        elif n in merged:  # its sum is the block's, started from this add's accumulator (fxpar.grad_accumulation)
            env[n] = env[n.args[1]]
            outer.skip(n.name)
        elif n.op == "placeholder":
            if stage and n in dead and type(n.meta.get("desc")).__name__ == "PlainAOTInput":
                raise NotShared(f"pipeline stage input {n.name} is read only by blocks that ignore it (the whole "
                                "stage would not take it)")  # (unread state stays on a stage: fxpar.stage_state)
            env[n] = g.placeholder(n.name, type_expr=n.type)
            env[n].meta = dict(n.meta)
        elif n in dead and stage:  # read only by a block that ignores it: the whole stage has no such node
            outer.skip(n.name)
        elif n in dead:  # read only by a block that ignores it: the whole-model trace made it, then dropped it
            g._graph_namespace.create_name(outer.take(n.name), None)
        elif n.op == "output":
            out = g.output(fx.map_arg(n.args[0], lambda a: env[a]), type_expr=n.type)
            out.meta = dict(n.meta)
        elif n.target is _BLOCK:
            site_id, tensors = n.args
            rep, renv = blocks.of(site_id), {}
            for ph, i in rep.inputs.items():
                if ph.users:  # an input the block never reads may have been dropped as dead (``_dead_without_blocks``)
                    renv[ph] = env[tensors[i]]
            site = blocks.table.sites[site_id]
            calls[site_id] = (renv, site, outer_source(n), Names(g))
            _copy_all(g, rep.forward, renv, rep, site.path, *calls[site_id][2:], rep.dead_after[0])
            env[n] = {k: renv[v] for k, v in rep.outputs.items()}
        elif n.target is _BLOCK_BACKWARD:
            site_id, _, grad_outputs, grads, grad_inputs = n.args
            rep = blocks.of(site_id)
            renv, site, source, names = calls[site_id]
            if sorted(grad_outputs) != sorted(rep.tangents.values()) or list(grad_inputs) != sorted(rep.grads):
                raise NotShared(f"{site.path}: the gradients the model passes differ from the block's own")
            for ph, k in rep.tangents.items():
                grad = grads[list(grad_outputs).index(k)]
                if not _same_layout(grad.meta.get("val"), ph.meta.get("val")):
                    raise NotShared(f"{site.path}: a gradient reaches the block in another memory layout than its "
                                    "trace assumed (the ops it picks, a view or a copy, would differ)")
                renv[ph] = env[grad]
            starts = absorbed(n, rep.sums, env)
            merged.update(starts)
            onto = {first: env[add.args[0]] for add, first in starts.items()}
            adds_after = added_after(n, rep.backward, rep.sums, rep.grads, env)
            then = emitted_after(g, adds_after, env, renv, outer.take, early)
            _copy_all(g, rep.backward, renv, rep, site.path, source, names, rep.dead_after[1], onto, then)
            env[n] = {j: renv[rep.grads[i]] for j, i in enumerate(grad_inputs)}
        elif n.target is operator.getitem and isinstance(n.args[0], fx.Node) and n.args[0].target in BLOCK_OPS:
            env[n] = env[n.args[0]][n.args[1]]
            outer.skip(n.name)
        else:
            env[n] = g.create_node(n.op, n.target, fx.map_arg(n.args, lambda a: env[a]),
                                   fx.map_arg(n.kwargs, lambda a: env[a]), name=outer.take(n.name), type_expr=n.type)
            env[n].meta = dict(n.meta)
    outer.take_dropped(dropped_last, unpacked)
    return graph_module(gm, g)


def _same_layout(a: Any, b: Any) -> bool:
    """Whether two traced values have the same shape and strides (a block's graph was traced for its tangent's)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return a is None and b is None
    return a.shape == b.shape and a.stride() == b.stride()


_STACK_KEYS = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace")


def _dead_without_blocks(graph: fx.Graph, blocks: Blocks) -> set[fx.Node]:
    """Nodes of the model's own graph that only feed block inputs the block's graph never reads (and nodes that
    only feed those): dead code once the block's nodes replace its call (inputs too: they stay, as in a whole-model
    trace, but a pipeline stage's would not have them). Nodes without users (asserts) stay."""
    dead: set[fx.Node] = set()

    def unread(user: fx.Node, n: fx.Node) -> bool:
        if user in dead:
            return True
        if user.target is _BLOCK:
            used = blocks.of(user.args[0]).read_inputs
            return all(a is not n for i, a in enumerate(user.args[1]) if i in used)
        if user.target is _BLOCK_BACKWARD:
            rep = blocks.of(user.args[0])
            grads_read = {user.args[2][j] for j in range(len(user.args[3]))} & set(rep.tangents.values())
            return all(a is not n for i, a in enumerate(user.args[1]) if i in rep.read_inputs) and \
                all(a is not n for j, a in enumerate(user.args[3]) if user.args[2][j] in grads_read)
        return False

    for n in reversed(graph.nodes):
        if n.op in ("call_function", "get_attr", "placeholder") and n.target not in BLOCK_OPS and n.users and \
                all(unread(u, n) for u in n.users):
            dead.add(n)
    return dead


def _copy_all(g: fx.Graph, nodes: list[fx.Node], renv: dict[fx.Node, fx.Node], rep: Representative, path: str,
              source: str, names: Names, dropped_after: list[str], onto: dict[fx.Node, fx.Node] | None = None,
              then: dict[fx.Node, list[Any]] | None = None) -> None:
    """Copy ``nodes`` of ``rep`` into ``g``. ``onto``: the first add of a gradient sum -> the accumulator it starts
    from (``fxpar.grad_accumulation``): its first contribution is added onto it as soon as it is computed.
    ``then``: block node -> what to emit right after its copy (the model's adds ``emitted_after`` places)."""
    then = then or {}
    onto = onto or {}
    copied = set(nodes)
    after = {first.args[0]: first for first in onto if first.args[0] in copied}
    started: dict[fx.Node, fx.Node] = {}
    for first in onto.keys() - set(after.values()):  # the first contribution comes from outside the copy
        started[first] = _start_sum(g, onto[first], renv[first.args[0]], first, rep, path, source)
    for r in nodes:
        names.take_dropped(rep.dead_before.get(r.name, ()))
        args = fx.map_arg(r.args, renv.__getitem__)
        if r in started:
            args = (started[r], *args[1:])
        new = g.create_node("call_function", r.target, args, fx.map_arg(r.kwargs, renv.__getitem__),
                            name=names.take(r.name), type_expr=r.type)
        new.meta.update(_copied_meta(r, rep, path, source))  # (not ``new.meta = ``: fx re-indexes a node set so)
        new.meta[TEMPLATE] = (id(rep), r.name)
        renv[r] = new
        if r in after:
            first = after[r]
            started[first] = _start_sum(g, onto[first], new, first, rep, path, source)
        for emit in then.get(r, ()):
            emit()
    names.take_dropped(dropped_after)


def _start_sum(g: fx.Graph, acc: fx.Node, contribution: fx.Node, first: fx.Node, rep: Representative, path: str,
               source: str) -> fx.Node:
    """``acc + contribution``: where the whole-model trace starts the block's gradient sum."""
    node = g.create_node("call_function", first.target, (acc, contribution), name="add", type_expr=first.type)
    node.meta = _copied_meta(first, rep, path, source)
    return node


def _copied_meta(r: fx.Node, rep: Representative, path: str, source: str) -> dict[str, Any]:
    kept = rep.kept_meta.get(r)
    if kept is None:
        kept = rep.kept_meta[r] = {k: v for k, v in r.meta.items() if k not in _STACK_KEYS}
    meta = dict(kept)
    rel = rep.provenance[r]
    module = "" if rel.module is None else path + rel.module
    meta["fxpar_provenance"] = Provenance(module, rel.source or source, rel.phase)
    return meta
