"""A repeated block's parameters and buffers, kept out of the model's own trace and put back into its joint graph.

``torch.export`` and AOTAutograd cost time for every input they trace, not only for every op: at Llama-3-70B
widths and 80 layers, the 720 parameters the ``fxpar::block`` calls took made up most of the model's own (outer)
export and joint trace, though each is only handed to one block call and its gradient handed back. Two ways keep
them out:

* a model captured whole: ``opaque_blocks(detach=True)`` takes each block's state off it while the model is
  exported (``detached_state`` says what it took); the export neither lifts nor passes it;
* a pipeline stage (its split graph reads the parameters it holds): ``strip_block_state`` copies the stage's graph
  without the parameters and buffers that exactly one block call reads, and nothing else.

Either way a block call takes only its activations, and ``restore_block_state`` then puts the state back into the
joint graph as AOTAutograd traces it with the state in: a placeholder per tensor at its place among the inputs
(``primals_<i>`` renumbered), appended to the call's inputs (and its backward's), and each parameter's gradient,
taken from the block's backward, as the joint's output for it. ``fxpar.stitch`` then sees the graph it would have
seen: the stitched program, names included, is the whole-model capture's (the process-replay tests compare them).
"""

from __future__ import annotations

import copy
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.descriptors import BufferAOTInput, GradAOTOutput, ParamAOTInput

from fxpar.blocks import BLOCK_OPS, BlockTable, NotShared, Site
from fxpar.creation_order import put_first
from fxpar.ir import fake_empty
from fxpar.state_paths import non_persistent_buffers, owner_module

_BLOCK, _BLOCK_BACKWARD = BLOCK_OPS
_STATE = "_fxpar_block_state"  # the base name of a restored placeholder until it is numbered
_STATE_GRAD = "_fxpar_block_state_grad"  # a restored parameter gradient (skipped by stitching, like any call output)


@dataclass
class Stripped:
    """What ``strip_block_state`` took out of a module, and where it goes back."""

    module: fx.GraphModule  # the module AOTAutograd traces: block calls take only their activations
    rank: dict[str, int]  # every parameter, then buffer, name of the original module -> its place among them
    hidden: dict[str, tuple[bool, torch.Tensor]]  # a removed attribute -> (is a parameter, its tensor)
    layout: dict[int, tuple[str | None, ...]]  # site id -> per input of its call: the removed attribute, or None


def strip_block_state(module: fx.GraphModule, sites: dict[int, Site]) -> Stripped | None:
    """``module`` without the parameters and buffers only one ``fxpar::block`` call reads (None: there are none).

    Requires: ``module`` is an exported forward whose block calls read parameters through ``get_attr`` nodes.
    Ensures: the returned module's graph is ``module``'s with those inputs dropped from their calls, and holds
    only the other attributes; ``module`` itself is left as it was.
    """
    attrs = {**{n: (True, t) for n, t in module.named_parameters(remove_duplicate=False)},
             **{n: (False, t) for n, t in module.named_buffers(remove_duplicate=False)}}
    aliases = Counter(id(t) for _, t in attrs.values())
    hidden = {n.target: attrs[n.target] for n in module.graph.find_nodes(op="get_attr")
              if n.target in attrs and aliases[id(attrs[n.target][1])] == 1 and _only_block_state(n, sites)}
    for n in module.graph.find_nodes(op="call_function", target=_BLOCK):
        token = next((a for a in n.args[1] if _is_hidden(a, hidden) and hidden[a.target][0]
                      and hidden[a.target][1].requires_grad), None)
        if token is not None:  # stays in: autograd must still differentiate the call (``fxpar.blocks._BlockState``)
            del hidden[token.target]
    if not hidden:
        return None
    graph = _copy(module.graph)
    layout = {}
    for n in graph.find_nodes(op="call_function", target=_BLOCK):
        site, tensors = n.args
        removed = tuple(a.target if _is_hidden(a, hidden) else None for a in tensors)
        layout[site] = removed
        n.args = (site, [a for a, r in zip(tensors, removed, strict=True) if r is None])
    for n in graph.find_nodes(op="get_attr"):
        if n.target in hidden:
            graph.erase_node(n)
    rank = {name: i for i, name in enumerate(attrs)}
    stripped = fx.GraphModule(module, graph)
    _keep_unread_state(stripped, module, attrs, hidden)
    return Stripped(stripped, rank, hidden, layout)


def _keep_unread_state(stripped: fx.GraphModule, module: fx.GraphModule, attrs: dict[str, tuple[bool, torch.Tensor]],
                       hidden: dict[str, tuple[bool, torch.Tensor]]) -> None:
    """Give ``stripped`` the state of ``module`` its graph does not read: ``fx.GraphModule`` copies only the
    attributes a ``get_attr`` names, and a pipeline stage holds unread state too (``fxpar.stage_state``), which the
    trace takes as inputs (a whole-model capture of the stage would: a Qwen2 rotary table's ``original_inv_freq``)."""
    held = {id(t) for t in (*stripped.parameters(), *stripped.buffers())} | {id(t) for _, t in hidden.values()}
    non_persistent = non_persistent_buffers(module)
    for fqn, (is_param, t) in attrs.items():
        if id(t) in held:
            continue
        held.add(id(t))
        owner, leaf = owner_module(stripped, fqn)
        if is_param:
            owner.register_parameter(leaf, t)
        else:
            owner.register_buffer(leaf, t, persistent=fqn not in non_persistent)


def _copy(source: fx.Graph) -> fx.Graph:
    """A copy of ``source`` (nodes, names, meta) sharing its code generator, which nothing here changes
    (``copy.deepcopy`` would also copy its pytree specs, and torch warns on those)."""
    graph = fx.Graph(tracer_cls=source._tracer_cls)
    value, old = graph.graph_copy(source, {}, return_output_node=True)
    graph._codegen = source._codegen
    graph.output(value, type_expr=old.type).meta = copy.copy(old.meta)
    return graph


def held_elsewhere(model: torch.nn.Module, blocks: dict[str, torch.nn.Module]) -> bool:
    """Whether some tensor of a block is also the model's under another name (tied): it stays in the export."""
    aliases = Counter(id(t) for _, t in (*model.named_parameters(remove_duplicate=False),
                                         *model.named_buffers(remove_duplicate=False)))
    return any(aliases[id(t)] > 1 for b in blocks.values() for t in (*b.parameters(), *b.buffers()))


def detached_state(gm: fx.GraphModule, model: torch.nn.Module, table: BlockTable) -> Stripped | None:
    """What ``opaque_blocks(detach=True)`` kept out of the export of ``model`` (None: nothing), as ``Stripped``:
    ``gm`` is already the module AOTAutograd traces."""
    if not table.detached:
        return None
    calls = Counter(site.path for site in table.sites.values())
    if max(calls.values(), default=0) > 1:  # its parameters' gradients would be summed over the calls
        raise NotShared("a block is called more than once")
    hidden = {f"{path}.{name}": (True, t) for path, state in table.detached.items() for name, t in state.params.items()
              if name != state.token}
    hidden.update({f"{path}.{name}": (False, t) for path, state in table.detached.items()
                   for name, t in state.buffers.items()})
    layout = {i: (None,) * site.n_args + tuple(f"{site.path}.{n}" if f"{site.path}.{n}" in hidden else None
                                               for n in (*site.params, *site.buffers))
              for i, site in table.sites.items()}
    names = [n for n, _ in (*model.named_parameters(remove_duplicate=False),
                            *model.named_buffers(remove_duplicate=False))]
    return Stripped(gm, {n: i for i, n in enumerate(names)}, hidden, layout)


def _only_block_state(n: fx.Node, sites: dict[int, Site]) -> bool:
    """``n`` is read by exactly one block call, once, as one of its parameters or buffers."""
    if len(n.users) != 1:
        return False
    user = next(iter(n.users))
    if user.target is not _BLOCK:
        return False
    tensors = user.args[1]
    return sum(a is n for a in tensors) == 1 and all(a is not n for a in tensors[:sites[user.args[0]].n_args])


def _is_hidden(a: Any, hidden: dict[str, Any]) -> bool:
    return isinstance(a, fx.Node) and a.op == "get_attr" and a.target in hidden


def restore_block_state(gm: fx.GraphModule, stripped: Stripped, fake_mode: Any) -> None:
    """Put ``stripped``'s attributes back into the joint graph ``gm`` (in place), as AOTAutograd traces them.

    Requires: ``gm`` is the joint of ``stripped.module``. Ensures: placeholders in AOTAutograd's order (parameters,
    buffers, user inputs, tangents) and named as it names them, every block call and backward with its full
    inputs, and an output per input: a restored parameter's gradient is its block backward's.
    """
    graph = gm.graph
    phs = list(graph.find_nodes(op="placeholder"))
    restored = _restored_placeholders(graph, stripped, fake_mode, phs[0])
    params, buffers, others = [], [], []
    for p in [*phs, *restored.values()]:
        kind = type(p.meta["desc"]).__name__
        (params if kind == "ParamAOTInput" else buffers if kind == "BufferAOTInput" else others).append(p)
    order = sorted(params, key=_rank(stripped)) + sorted(buffers, key=_rank(stripped)) + others
    old_inputs = [p for p in phs if type(p.meta["desc"]).__name__ != "TangentAOTInput"]
    old_names = {p.name for p in phs}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for i, p in enumerate(order):
        first_op.prepend(p)
        if type(p.meta["desc"]).__name__ != "TangentAOTInput":
            p.name = f"primals_{i + 1}"
    put_first(graph, [p.name for p in order], old_names)
    grads = _restore_calls(graph, stripped, restored)
    missing = [t for t in stripped.hidden if _has_grad(stripped, t) and t not in grads]
    if missing:  # the trace with them would have differentiated the call; this one did not
        raise NotShared(f"no backward traced for a block call whose parameters need gradients ({missing[0]})")
    _restore_outputs(graph, old_inputs, [p for p in order if type(p.meta["desc"]).__name__ != "TangentAOTInput"],
                     grads)


def _rank(stripped: Stripped) -> Any:
    return lambda p: stripped.rank[p.meta["desc"].target]


def _restored_placeholders(graph: fx.Graph, stripped: Stripped, fake_mode: Any, like: fx.Node) -> dict[str, fx.Node]:
    out = {}
    for target, (is_param, t) in stripped.hidden.items():
        with graph.inserting_before(like):
            ph = graph.placeholder(_STATE)
        val = fake_empty(fake_mode, t.shape, t.stride(), t.dtype, t.device)
        ph.meta.update({"desc": (ParamAOTInput if is_param else BufferAOTInput)(target), "val": val,
                        "partitioner_tag": like.meta.get("partitioner_tag")})
        out[target] = ph
    return out


def _restore_calls(graph: fx.Graph, stripped: Stripped, restored: dict[str, fx.Node]) -> dict[str, fx.Node]:
    """Every block call and backward with its full inputs; the restored parameters' gradient nodes."""
    grads: dict[str, fx.Node] = {}
    for n in graph.find_nodes(op="call_function", target=_BLOCK):
        site, kept = n.args
        n.args = (site, _full(kept, stripped.layout[site], restored))
    for n in list(graph.find_nodes(op="call_function", target=_BLOCK_BACKWARD)):
        site, kept, grad_outputs, given, grad_inputs = n.args
        layout = stripped.layout[site]
        full = _full(kept, layout, restored)
        at = [i for i, r in enumerate(layout) if r is None]  # kept input j is full input at[j]
        wanted = sorted({at[j] for j in grad_inputs} | {i for i, r in enumerate(layout) if _has_grad(stripped, r)})
        n.args = (site, full, grad_outputs, given, wanted)
        for u in list(n.users):  # the kept inputs' gradients move to their places in the longer list
            if u.target is operator.getitem:
                u.args = (n, wanted.index(at[grad_inputs[u.args[1]]]))
        had = {at[j] for j in grad_inputs}
        for k, i in enumerate(wanted):  # (no ``val``: stitching reads a call's outputs from the block's graph)
            if i not in had:
                with graph.inserting_after(n):
                    grads[layout[i]] = graph.create_node("call_function", operator.getitem, (n, k), name=_STATE_GRAD)
        n.meta.pop("val", None)  # it listed the kept inputs' gradients only
    return grads


def _has_grad(stripped: Stripped, removed: str | None) -> bool:
    """A removed parameter that requires grad (the block's backward gives its gradient, as for any input)."""
    return removed is not None and stripped.hidden[removed][0] and stripped.hidden[removed][1].requires_grad


def _full(kept: list[Any], layout: tuple[str | None, ...], restored: dict[str, fx.Node]) -> list[Any]:
    given = iter(kept)
    return [next(given) if r is None else restored[r] for r in layout]


def _restore_outputs(graph: fx.Graph, old_inputs: list[fx.Node], inputs: list[fx.Node],
                     grads: dict[str, fx.Node]) -> None:
    """The joint's outputs: the forward's, then one gradient (or None) per input, in the new input order."""
    out = graph.output_node()
    values, descs = list(out.args[0]), list(out.meta["desc"])
    n_fwd = len(values) - len(old_inputs)
    grad_of = {p: (values[n_fwd + i], descs[n_fwd + i]) for i, p in enumerate(old_inputs)}
    new_values, new_descs = values[:n_fwd], descs[:n_fwd]
    for p in inputs:
        if p in grad_of:
            value, desc = grad_of[p]
        else:
            target = p.meta["desc"].target
            value = grads.get(target)
            desc = GradAOTOutput(p.meta["desc"]) if value is not None else None
        new_values.append(value)
        new_descs.append(desc)
    out.args = (type(out.args[0])(new_values),)
    out.meta["desc"] = new_descs
