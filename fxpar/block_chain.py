"""A run of repeated blocks the model's loop calls one after another, exported as one ``fxpar::block`` call.

``torch.export`` and AOTAutograd cost a few milliseconds for every op they trace, and an opaque block call is an
op: at 80 layers the model's own trace spent about 10 ms a layer on its 80 calls. A transformer's loop
(``for layer in self.layers: h = layer(h, mask, rope)``) hands each layer the previous one's output and the same
other tensors, so the 80 calls are one function of the first call's inputs and the layers' parameters. This module
proves that from the model's own run and exports the run as one call:

* ``plan_chains`` runs the model once on fake tensors with every block call answered by fresh outputs (no trace)
  and a torch-function mode watching every op. Calls ``j`` and ``j + 1`` link when they are calls of the same block
  variant (``Site.key``: structure, arguments, read attributes) of one container, call ``j + 1`` takes each of call
  ``j``'s tensor outputs exactly once and every other tensor from call ``j`` unchanged (none of those requiring a
  gradient), and nothing but call ``j + 1`` reads call ``j``'s outputs: no op, and not the model's outputs (a list
  of hidden states kept for later is read later, or returned, and then breaks the run there).
* ``ChainRouter`` answers, during the export, the first call of each run with one ``fxpar::block`` op over the
  first call's inputs and every layer's token parameter, and each later call with that op's outputs, after checking
  that the export makes the calls the plan saw (same variant, carried outputs and shared tensors). Anything else
  raises ``ChainBroken`` and the export runs again with a call per layer.
* ``expand_chains`` turns the joint graph's run op and its backward back into the ``fxpar::block`` and
  ``fxpar::block_backward`` nodes a call per layer gives, so ``fxpar.block_state`` and ``fxpar.stitch`` see the
  graph they always see (the process-replay tests compare the programs).
"""

from __future__ import annotations

import operator
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from fxpar.blocks import (
    BLOCK_OPS,
    BlockTable,
    Site,
    block_call,
    drop_out_meta,
    new_site_id,
    out_meta,
    set_out_meta,
)
from fxpar.mixed_precision import raw_parameter
from fxpar.not_shared import NotShared

_BLOCK, _BLOCK_BACKWARD = BLOCK_OPS
CHAINS_ENV = "FXPAR_CHAINS"  # "0": export a call per layer (the programs must be byte-identical either way)
_LINK = "_fxpar_chain_link"  # base name of a node ``expand_chains`` makes (stitching skips every such name)
_PLAIN = (int, float, bool, str, type(None))


def chains_enabled() -> bool:
    return os.environ.get(CHAINS_ENV, "1") != "0"


class ChainBroken(NotShared):
    """The export did not make the calls the plan saw: export again with a call per layer."""


@dataclass
class Chain:
    """Calls of ``paths`` (in call order) exported as the one call ``id``."""

    id: int
    paths: tuple[str, ...]
    carry: tuple[int, ...]  # carry[o]: the input leaf that tensor output o becomes in the next call
    n_args: int  # tensor leaves of one call's arguments
    key: tuple[Any, ...]  # every call's ``Site.key`` as the plan saw it
    sites: list[int] = field(default_factory=list)  # each call's own site id, filled in by the export
    outputs: list[torch.Tensor] | None = None
    first: list[torch.Tensor] | None = None  # the first call's tensor leaves

    @property
    def shared(self) -> list[int]:
        """Input leaves every call takes unchanged from the first."""
        return [p for p in range(self.n_args) if p not in self.carry]


# -- the plan: one run of the model, every block call answered without a trace --------------------------------------


@dataclass
class _Call:
    site: Site
    tensors: list[torch.Tensor]
    outs: list[torch.Tensor]


class _Recorder(TorchFunctionMode):
    """Answers every block call with fresh fake outputs and notes which calls' outputs an op reads."""

    def __init__(self, table: BlockTable) -> None:
        super().__init__()
        self.table = table
        self.calls: list[_Call] = []
        self.producer: dict[int, int] = {}  # id(output) -> its call's index
        self.read: set[int] = set()

    def route(self, site: Site, tensors: list[torch.Tensor], issue: Callable[[], Any]) -> list[torch.Tensor]:
        with torch._C.DisableTorchFunction():  # its own reads are not the model's
            grad = any(t.requires_grad for t in tensors) or _token(self.table, site.path) is not None
            outs = []
            for shape, stride, dtype in out_meta(site.id):
                t = torch.empty_strided(shape, stride, dtype=dtype)
                outs.append(t.requires_grad_(grad) if t.is_floating_point() else t)
        self.calls.append(_Call(site, list(tensors), outs))
        for t in outs:
            self.producer[id(t)] = len(self.calls) - 1
        return outs

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for x in pytree.tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor) and id(x) in self.producer:
                self.read.add(self.producer[id(x)])
        return func(*args, **kwargs)


def plan_chains(table: BlockTable, run_model: Callable[[], Any]) -> list[Chain]:
    """The runs of block calls ``run_model()`` (the model's forward with ``table``'s blocks opaque) makes that can
    be exported as one call each. Leaves ``table`` without the run's sites; a failure plans nothing."""
    recorder = _Recorder(table)
    table.route = recorder.route
    try:
        with recorder:
            out = run_model()
    except Exception:  # noqa: BLE001 - the export itself reports what is wrong with the model
        return []
    finally:
        table.route = None
        drop_out_meta(list(table.sites))
        table.sites.clear()
    leaves = pytree.tree_leaves(out)
    if any(not isinstance(x, (torch.Tensor, *_PLAIN)) for x in leaves):
        return []  # outputs torch.export cannot flatten either: the export reports them
    returned = {recorder.producer[id(x)] for x in leaves if isinstance(x, torch.Tensor) and id(x) in recorder.producer}
    return _runs(recorder, returned | recorder.read)


def _runs(recorder: _Recorder, seen: set[int]) -> list[Chain]:
    """The maximal runs of at least two calls, each pair of neighbours linked the same way."""
    calls, chains = recorder.calls, []
    run, carry = [0], None
    for j in range(1, len(calls) + 1):
        link = _link(recorder.table, calls[j - 1], calls[j], j - 1 in seen) if j < len(calls) else None
        if link is not None and carry in (None, link):
            run.append(j)
            carry = link
            continue
        if carry is not None:
            first = calls[run[0]].site
            chains.append(Chain(new_site_id(), tuple(calls[i].site.path for i in run), carry, first.n_args, first.key))
        run, carry = [j], None
    return chains


def _link(table: BlockTable, a: _Call, b: _Call, a_seen: bool) -> tuple[int, ...] | None:
    """How call ``b`` takes call ``a``'s outputs (``Chain.carry``), if the two can be one run; else None."""
    if a_seen or a.site.key != b.site.key or a.site.path.rsplit(".", 1)[0] != b.site.path.rsplit(".", 1)[0]:
        return None
    if not a.outs or any(not t.is_floating_point() for t in a.outs) or len({id(t) for t in b.tensors}) < len(b.tensors):
        return None
    if _token(table, a.site.path) is None or _token(table, b.site.path) is None:
        return None  # a call that differentiates nothing of its own: a call per layer
    where = {id(t): o for o, t in enumerate(a.outs)}
    carry = [-1] * len(a.outs)
    for p, t in enumerate(b.tensors):
        o = where.get(id(t))
        if o is not None:
            carry[o] = p
        elif t is not a.tensors[p] or t.requires_grad:  # a shared input needing a gradient: sums over the calls
            return None
    return tuple(carry) if -1 not in carry else None


def _token(table: BlockTable, path: str) -> str | None:
    state = table.detached.get(path)
    return state.token if state is not None else None


# -- the export: one op for each run ---------------------------------------------------------------------------------


class ChainRouter:
    """``BlockTable.route`` during the export: the first call of a run issues the run's op, the others take its
    outputs; each call is checked against the plan (``ChainBroken`` otherwise)."""

    def __init__(self, table: BlockTable, chains: list[Chain]) -> None:
        self.table = table
        self.at = {path: (chain, k) for chain in chains for k, path in enumerate(chain.paths)}
        table.chains.update({chain.id: chain for chain in chains})

    def route(self, site: Site, tensors: list[torch.Tensor], issue: Callable[[], Any]) -> list[torch.Tensor]:
        if site.path not in self.at:
            return issue()
        chain, k = self.at[site.path]
        if k != len(chain.sites) or site.key != chain.key:
            raise ChainBroken(f"{site.path} is not called as the plan saw (order, arguments or attributes read)")
        if k == 0:
            chain.first = list(tensors)
            set_out_meta(chain.id, out_meta(site.id))
            tokens = [raw_parameter(self.table.blocks[p], _token(self.table, p)) for p in chain.paths]
            chain.outputs = list(block_call(chain.id, [*tensors, *tokens]))
        else:
            self._check(chain, site, tensors)
        chain.sites.append(site.id)
        return chain.outputs

    def _check(self, chain: Chain, site: Site, tensors: list[torch.Tensor]) -> None:
        carried = all(tensors[p] is chain.outputs[o] for o, p in enumerate(chain.carry))
        shared = all(tensors[p] is chain.first[p] for p in chain.shared)
        if not carried or not shared:
            raise ChainBroken(f"{site.path} is not called as the plan saw")

    def finish(self) -> None:
        """After the export: every run was called through."""
        for chain, _ in self.at.values():
            if len(chain.sites) != len(chain.paths):
                raise ChainBroken(f"{chain.paths[len(chain.sites)]} was not called as the plan saw")


# -- the joint: a call per layer again -------------------------------------------------------------------------------


def expand_chains(gm: fx.GraphModule, table: BlockTable, fake_mode: Any) -> None:
    """Each run's op in the joint graph ``gm`` (and its backward) as the calls a call per layer gives, in place.

    Requires: ``gm`` is AOTAutograd's joint of an export ``ChainRouter`` routed, before ``restore_block_state``.
    Ensures: every ``fxpar::block``/``fxpar::block_backward`` node names a call's own site, with the inputs,
    gradients and outputs a trace of that call gives; the graph's inputs and outputs are unchanged.
    """
    if not table.chains:
        return
    graph = gm.graph
    inputs: dict[int, list[list[Any]]] = {}
    for n in list(graph.find_nodes(op="call_function", target=_BLOCK)):
        chain = table.chains.get(n.args[0])
        if chain is not None:
            inputs[chain.id] = _expand_forward(graph, n, chain)
    with fake_mode:
        for n in list(graph.find_nodes(op="call_function", target=_BLOCK_BACKWARD)):
            if n.args[0] in table.chains:
                _expand_backward(graph, n, table.chains[n.args[0]], inputs[n.args[0]])
    gm.recompile()


def _expand_forward(graph: fx.Graph, node: fx.Node, chain: Chain) -> list[list[Any]]:
    """The run's op becomes its first call; the later calls follow it, and its outputs are the last call's. Returns
    each call's inputs. (The op stays where the trace made it: names the trace dropped before it stay there.)"""
    given = list(node.args[1])
    leaves, tokens = given[:chain.n_args], given[chain.n_args:]
    per_call = [[*leaves, tokens[0]]]
    node.args = (chain.sites[0], per_call[0])
    users = [u for u in node.users if u.target is operator.getitem]
    if len(users) != len(node.users):
        raise NotShared("a run's outputs are read as a list")
    call, at = node, node
    for k in range(1, len(chain.sites)):
        outs = []
        for o, v in enumerate(node.meta["val"]):
            with graph.inserting_after(at):
                at = _link_node(graph, operator.getitem, (call, o), {"val": v})
            outs.append(at)
        leaves = list(leaves)
        for o, p in enumerate(chain.carry):
            leaves[p] = outs[o]
        per_call.append([*leaves, tokens[k]])
        with graph.inserting_after(at):
            at = call = _link_node(graph, _BLOCK, (chain.sites[k], per_call[k]), node.meta)
    for u in users:
        u.args = (call, u.args[1])
    return per_call


def _expand_backward(graph: fx.Graph, node: fx.Node, chain: Chain, per_call: list[list[Any]]) -> None:
    """The run's backward becomes its last call's backward; the earlier calls' backwards follow it, each taking its
    carried outputs' gradients from the call after it. The run's gradient outputs stay the nodes they are (a trace
    named them), each now reading its own call's backward."""
    _, _, grad_outputs, grads, grad_inputs = node.args
    n_args, carried, last = chain.n_args, sorted(chain.carry), len(chain.sites) - 1
    users = list(node.users)
    if any(u.target is not operator.getitem for u in users):
        raise NotShared("a run's backward is read as a list")
    own = [i for i in grad_inputs if i < n_args]
    backward_of, at = {}, node
    for k in range(last, -1, -1):
        wanted = [*(carried if k else own), n_args]
        args = (chain.sites[k], per_call[k], list(grad_outputs), list(grads), wanted)
        if k == last:
            call = node
            node.args = args
        else:
            with graph.inserting_after(at):
                at = call = _link_node(graph, _BLOCK_BACKWARD, args, node.meta)
        call.meta["val"] = [torch.empty_like(per_call[k][i].meta["val"]) for i in wanted]
        backward_of[k] = (call, wanted)
        if k:
            outs = []
            for j in range(len(carried)):
                with graph.inserting_after(at):
                    at = _link_node(graph, operator.getitem, (call, j), {"val": call.meta["val"][j]})
                outs.append(at)
            grad_outputs = list(range(len(chain.carry)))
            grads = [outs[carried.index(p)] for p in chain.carry]
    for u in users:
        i = grad_inputs[u.args[1]]
        call, wanted = backward_of[i - n_args] if i > n_args else backward_of[0]
        u.args = (call, wanted.index(min(i, n_args)))


def _link_node(graph: fx.Graph, target: Any, args: tuple, meta: dict[str, Any]) -> fx.Node:
    node = graph.create_node("call_function", target, args, name=_LINK)
    node.meta.update({k: v for k, v in meta.items() if k != "val"})
    if "val" in meta:
        node.meta["val"] = meta["val"]
    return node


def chain_members(table: BlockTable, site_id: int) -> list[int]:
    """The sites a node's ``fxpar::block`` call stands for: its run's calls, or itself."""
    chain = table.chains.get(site_id)
    return list(chain.sites) if chain is not None else [site_id]


__all__ = ["CHAINS_ENV", "Chain", "ChainBroken", "ChainRouter", "chain_members", "chains_enabled",
           "expand_chains", "plan_chains"]
