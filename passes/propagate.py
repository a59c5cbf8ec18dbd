"""propagate: a placement for every tensor of the joint graph, one mesh axis at a time.

Candidates come from the rule table (DTensor strategies plus fxpar rules); fxpar's policy
chooses among them:

* Never redistribute into ``Partial`` (that would divide values among ranks).
* A ``Partial`` input stays partial only through linear ops that keep sums exact: views,
  ``add``/``sub`` of partials, scalar scaling, ``sum``, and (up to rounding) casts between 16- and 32-bit
  floating dtypes (mixed precision: a batch axis then reduces a gradient where it is handed over, in
  ``reduce_dtype``, as FSDP2 does). Anything else reduces it first. So the
  input gradients of q, k and v are summed while partial and reduced once (Megatron's
  optimum), and a residual ``add(R, P)`` reduces the partial block output.
* Parameters are never gathered when another strategy exists. A shard need not divide evenly (pieces
  are DTensor's: ``torch.chunk`` sizes), but no rank's piece may be empty.
* Otherwise the cheapest candidate in bytes moved wins; ties keep the inputs as they are. On tp-like axes a
  partial output every reader must complete (a parameter's gradient, a tied weight's gradient sum) also costs
  its all-reduce: SP's embedding gradient all-gathers its incoming gradient rather than all-reduce the table.
* With sequence parallelism, a value ``notes["sequence_parallel"]`` names costs its bytes when
  it is not ``Shard(1)`` over tp (as if it moved them), so those values stay sharded on the sequence dim.
* On a context-parallel axis (``cp``), only sequence dims may be sharded, a value with a sequence dim costs its
  bytes when it is whole, and attention all-gathers k and v (``fxpar.rules.context``).

Every layer is placed, but a node copied from a repeated block (``fxpar.stitch.TEMPLATE``) whose inputs have the
placements, and the parameter-likeness, that an earlier copy of the same node saw takes that copy's decision
(``_Decisions``): the policy above looks at nothing else for such nodes, and an 80-layer model pays for one layer.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from fxpar.passes.usable import Taken, disjoint, fits, plain
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from fxpar.errors import FxparWarning
from fxpar.ir import Program, batch_placements, sp_boundary, tensor_val
from fxpar.pass_context import Context
from fxpar.random_draws import RANDOM_OPS, VALUE_RANDOM
from fxpar.rules import Candidate, candidates
from fxpar.rules.batch_views import batch_view_candidate
from fxpar.rules.context import ContextPolicy, gather_before_repeat
from fxpar.rules.experts import EXPERT_OPS, experts_candidate
from fxpar.rules.partials import PARTIAL_SUMS, is_float_cast, keeps_partial
from fxpar.rules.scatter_add import ZEROS, partial_zeros, scatter_add_candidate
from fxpar.rules.token_local import TokenLocal
from fxpar.split import BATCH_AXES, BATCH_AXIS, CONTEXT_AXIS, Splitter, splitter
from fxpar.stitch import TEMPLATE

aten = torch.ops.aten

MAX_REDUCTIONS = {aten.amax.default}  # may leave a Partial("max") (fp8 scales), completed by a max all-reduce
VIEW_LIKE = {aten.t.default, aten.view.default, aten._unsafe_view.default, aten.transpose.int,
             aten.permute.default, aten.detach.default, aten.alias.default, aten._to_copy.default}
PARAM_PENALTY = 1e6
FRESH_BUFFERS = {torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default}  # values unread
NO_CANDIDATE = math.inf
SEQUENCE = Shard(1)  # where sequence parallelism keeps the residual stream ([batch, seq, hidden]) on tp


def propagate(prog: Program, ctx: Context) -> Program:
    """Placement of every tensor node and required placements of every node's tensor args.

    Requires: ``annotate`` placements on params, buffers and inputs.
    Ensures: ``placements[node]`` for every tensor node (a tuple per output for multi-output
    ops); ``arg_placements[node]`` for every node consuming tensors, forward outputs S(0) on
    dp and replicated elsewhere, gradients placed like their parameters.
    """
    placements: dict[str, Any] = dict(prog.placements)
    arg_placements: dict[str, tuple[Any, ...]] = {}
    params = {name for _, name in prog.signature.params}
    # a weight's fp8 cast (``meta["fp8_weight"]``) is the weight: gathering it re-runs a tp-sharded Linear whole on
    # every rank (its float8 bytes look cheaper than the fp32 all-reduce of the partial product they avoid)
    param_like: set[str] = set(params) | {n.name for n in prog.graph.nodes if n.meta.get("fp8_weight")}
    split = splitter(prog)
    stage = prog.notes.get("stage")
    boundary = stage is not None and stage.index < stage.n_stages - 1  # outputs go to the next stage, cp-sharded
    outputs = _output_targets(prog, placements, split.batch, split.seq if boundary else None,
                              sp_boundary(prog, ctx) if boundary else None)
    stream = prog.notes.get("sequence_parallel", frozenset())
    local = TokenLocal(prog, list(ctx.modules.of_kind("experts")))
    context = ContextPolicy(split.seq) if split.seq else None
    unruled: set[str] = set()  # ops already warned about: warn once per op per compile
    decisions = _Decisions(placements, arg_placements, param_like, local, context,
                           ctx.block_decisions.setdefault((split.batch, split.seq), {}))
    for name, idx in prog.signature.tangents:
        placements[name] = outputs[idx]
    for node in prog.graph.nodes:
        if node.op == "get_attr":
            placements[node.name] = _replicated(prog)
        elif node.op == "call_function" and not decisions.reuse(node, node.name in stream):
            _place_call(prog, node, placements, arg_placements, param_like, split, node.name in stream, local,
                        context, unruled)
            decisions.remember(node, node.name in stream)
        elif node.op == "output":
            arg_placements[node.name] = tuple(outputs)
    if context is not None:
        gather_before_repeat(prog.graph, placements, arg_placements, prog.mesh.axis_index(CONTEXT_AXIS))
    return prog.replace("propagate", placements=placements, arg_placements=arg_placements)


class _Decisions:
    """The placements chosen for copies of repeated-block nodes, by what the choice depended on: the node copied,
    whether it is a sequence-parallel stream value, and its tensor inputs' placements and parameter-likeness.
    Nodes whose rules look further (experts, token-local regions, scatter-add zeros, context parallelism) are
    always placed afresh."""

    def __init__(self, placements: dict[str, Any], arg_placements: dict[str, tuple[Any, ...]],
                 param_like: set[str], local: TokenLocal, context: ContextPolicy | None,
                 seen: dict[tuple[Any, ...], tuple[Any, Any]]) -> None:
        self.placements, self.arg_placements, self.param_like = placements, arg_placements, param_like
        self.local, self.context = local, context
        self.seen = seen  # shared by the stages of one compile (``Context.block_decisions``)

    def _key(self, node: fx.Node, stream: bool) -> tuple[Any, ...] | None:
        template = node.meta.get(TEMPLATE)
        if template is None or self.context is not None or node.target in EXPERT_OPS or node.target in ZEROS \
                or node.target is operator.getitem or node.name in self.local:
            return None
        readers = tuple(tuple(self.placements.get(a.name) for a in u.all_input_nodes if a is not node)
                        for u in node.users if u.target in PARTIAL_SUMS)  # what ``_final_reduction`` reads
        return (template, node.target, id(node.meta.get("val")), stream, readers,
                tuple((self.placements.get(a.name), a.name in self.param_like) for a in node.all_input_nodes))

    def reuse(self, node: fx.Node, stream: bool) -> bool:
        """Place ``node`` as an earlier copy with the same key was placed; False if there is none."""
        key = self._key(node, stream)
        if key is None or key not in self.seen:
            return False
        self.placements[node.name], args = self.seen[key]
        if args is not None:
            self.arg_placements[node.name] = args
        if node.target in VIEW_LIKE:
            first = next((a for a in pytree.tree_leaves((node.args, node.kwargs)) if tensor_val(a) is not None), None)
            if first is not None and first.name in self.param_like:
                self.param_like.add(node.name)
        return True

    def remember(self, node: fx.Node, stream: bool) -> None:
        key = self._key(node, stream)
        if key is not None and node.name in self.placements:
            self.seen[key] = (self.placements[node.name], self.arg_placements.get(node.name))


def _replicated(prog: Program) -> tuple[Placement, ...]:
    return tuple(Replicate() for _ in prog.mesh.names)


def _output_targets(prog: Program, placements: dict[str, Any], batch: int | None, seq: int | None,
                    sp_seq: int | None = None) -> list[Any]:
    """Forward outputs: batch-sharded on dp, sequence-sharded on cp (``seq``) and, under sequence parallelism, on
    tp (``sp_seq``) when they go to another pipeline stage, replicated elsewhere. Gradients: like the param (or
    the received value)."""
    out = prog.graph.output_node().args[0]
    sig = prog.signature
    grad_of = {i: name for (fqn, i) in sig.grads for (f, name) in sig.params if f == fqn}
    grad_of.update({i: name for name, i in sig.input_grads})  # a stage boundary's gradient: like its input
    targets = []
    for i, arg in enumerate(out):
        val = tensor_val(arg)
        if val is None:
            targets.append(None)
        elif i < sig.num_outputs:
            targets.append(batch_placements(val, prog.mesh, batch, seq, sp_seq))
        else:
            targets.append(placements[grad_of[i]])
    return targets


def _place_call(prog: Program, node: fx.Node, placements: dict[str, Any],
                arg_placements: dict[str, tuple[Any, ...]], param_like: set[str], split: Splitter,
                stream: bool = False, local: TokenLocal | None = None, context: ContextPolicy | None = None,
                unruled: set[str] | None = None) -> None:
    if node.target is __import__("operator").getitem:
        src = placements.get(node.args[0].name)
        if src is not None:
            placements[node.name] = src[node.args[1]]
        return
    tensor_args = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if tensor_val(a) is not None]
    val = node.meta.get("val")
    if not _has_tensor_output(val):
        arg_placements[node.name] = tuple(placements[a.name] for a in tensor_args)
        return
    multi = isinstance(val, (tuple, list))
    per_axis_in, per_axis_out = [], []
    for ax, n in enumerate(prog.mesh.shape):
        cur = [placements[a.name][ax] for a in tensor_args]
        in_region = local is not None and node.name in local and prog.mesh.names[ax] == BATCH_AXIS
        region_cand = local.candidate(node, tensor_args, cur) if in_region and n > 1 else None
        if n == 1:
            cand = Candidate(tuple(Replicate() for _ in cur), _all(val, Replicate()))
        elif node.target in EXPERT_OPS:
            cand = experts_candidate(node, prog.mesh.names[ax])
        elif region_cand is not None:
            cand = region_cand
        else:
            sharded = stream and prog.mesh.names[ax] == "tp"
            on_cp = context if prog.mesh.names[ax] == CONTEXT_AXIS else None
            if prog.mesh.names[ax] == BATCH_AXIS and len(cur) == 1 and isinstance(cur[0], Shard):
                extra = batch_view_candidate(node, cur[0], split, ax)
            elif on_cp is not None:
                extra = on_cp.attention(node)
            else:
                extra = scatter_add_candidate(node, cur)
            zeros = partial_zeros(node, lambda a, ax=ax: _placed_on(placements, a, ax), cur)
            nested = _batch_axes_before(prog.mesh.names, ax)  # the batch dim is sharded over dp, then ep
            taken = _taken_dims([p for i, p in enumerate(per_axis_in) if i not in nested],
                                [p for i, p in enumerate(per_axis_out) if i not in nested])
            reduced_here = prog.mesh.names[ax] not in (*BATCH_AXES, CONTEXT_AXIS)
            placed_on = (lambda a, ax=ax: _placed_on(placements, a, ax)) if reduced_here else None
            cand = zeros or _choose(node, tensor_args, cur, n, param_like, taken, sharded, extra, on_cp, unruled,
                                    placed_on)
        per_axis_in.append(cand.inputs)
        per_axis_out.append(cand.output)
    arg_placements[node.name] = tuple(tuple(ins) for ins in zip(*per_axis_in, strict=True)) if tensor_args else ()
    if multi:
        placements[node.name] = tuple(
            None if per_axis_out[0][i] is None else tuple(o[i] for o in per_axis_out) for i in range(len(val)))
    else:
        placements[node.name] = tuple(per_axis_out)
    if node.target in VIEW_LIKE and tensor_args and tensor_args[0].name in param_like:
        param_like.add(node.name)


def _batch_axes_before(names: tuple[str, ...], ax: int) -> set[int]:
    """Earlier mesh axes that, like axis ``ax``, shard the batch (``dp`` before ``ep``): their shards of a dim do not
    take it from ``ax``, which splits each of their pieces again."""
    return {i for i in range(ax) if names[ax] in BATCH_AXES and names[i] in BATCH_AXES}


def _placed_on(placements: dict[str, Any], node: fx.Node, ax: int) -> Placement | None:
    """``node``'s placement on mesh axis ``ax``, or None when it is not placed yet."""
    p = placements.get(node.name)
    return p[ax] if isinstance(p, tuple) and len(p) > ax else None


def _has_tensor_output(val: Any) -> bool:
    if isinstance(val, torch.Tensor):
        return True
    return isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


def _all(val: Any, p: Placement) -> Any:
    if isinstance(val, (tuple, list)):
        return tuple(p if isinstance(v, torch.Tensor) else None for v in val)
    return p


def _taken_dims(per_axis_in: list[tuple[Placement, ...]], per_axis_out: list[Any]) -> Taken:
    """Dims that earlier mesh axes already shard, per tensor input and per output."""
    ins: dict[int, set[int]] = {}
    outs: dict[int, set[int]] = {}
    for chosen_in, chosen_out in zip(per_axis_in, per_axis_out, strict=True):
        for i, p in enumerate(chosen_in):
            if isinstance(p, Shard):
                ins.setdefault(i, set()).add(p.dim)
        for i, p in enumerate(chosen_out if isinstance(chosen_out, tuple) else (chosen_out,)):
            if isinstance(p, Shard):
                outs.setdefault(i, set()).add(p.dim)
    return ins, outs


def _choose(node: fx.Node, tensor_args: list[fx.Node], cur: list[Placement], n: int,
            param_like: set[str], taken: Taken, sharded: bool = False, extra: Candidate | None = None,
            context: ContextPolicy | None = None, unruled: set[str] | None = None,
            placed_on: Callable[[fx.Node], Placement | None] | None = None) -> Candidate:
    """The cheapest allowed candidate on one axis; replicate everything if none is known.

    ``placed_on`` (the placement of an already placed node on this axis; given on tp-like axes): a partial sum
    that must be completed where it is read (by the program's outputs, as a parameter's gradient, or by an ``add``
    whose other operand is not partial, as a tied weight's second gradient) costs that all-reduce now: SP's
    embedding gradient then all-gathers its b x s x h incoming gradient instead of all-reducing V x h. Batch axes
    defer their gradient reductions to once per step, and cp keeps sequences sharded: there the choice is left
    to the inputs' costs.

    ``sharded``: the node is a sequence-parallel stream value on this axis (any placement but ``SEQUENCE``
    costs its bytes). ``extra``: one more candidate from a rule outside DTensor's (``batch_views``).
    ``context``: this is a cp axis (only sequence dims shard; a whole sequence costs its bytes).
    """
    args = pytree.tree_map_only(fx.Node, lambda a: a.meta.get("val"), node.args)
    kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta.get("val"), node.kwargs)
    if node.target in VALUE_RANDOM:  # inputs gathered, drawn whole, as the single device draws (fxpar.random_draws)
        return Candidate(tuple(Replicate() for _ in cur), _all(node.meta["val"], Replicate()))
    if node.target in FRESH_BUFFERS and any(u.target in RANDOM_OPS for u in node.users):
        return Candidate(tuple(cur), Replicate())  # Dropout2d's mask shape: drawn whole, its source left as it is
    found = None
    if tensor_args:
        try:
            found = candidates(node.target, args, kwargs, cur, n)
        except Exception:  # noqa: BLE001 - a rule that cannot handle these shapes offers nothing
            found = None
    else:  # factory ops (arange, full, scalar_tensor, ...) produce replicated values
        return Candidate((), _all(node.meta["val"], Replicate()))
    if sharded and tensor_args:  # also ask how the op runs with its stream-shaped inputs already sequence-sharded
        hint = [SEQUENCE if _stream_shaped(a, node) else c for a, c in zip(tensor_args, cur, strict=True)]
        if hint != cur:
            try:
                found = (found or []) + (candidates(node.target, args, kwargs, hint, n) or [])
            except Exception:  # noqa: BLE001 - as above
                pass
    if context is not None and tensor_args and any(isinstance(c, Partial) for c in cur):
        # DTensor offers few ways out of a partial sum: also ask how the op runs with the partial sums
        # reduce-scattered onto their sequence dim (a k/v gradient of all-gathered attention)
        hint = [context.sequence_shard(a) if isinstance(c, Partial) else c
                for a, c in zip(tensor_args, cur, strict=True)]
        if hint != cur:
            try:
                found = (found or []) + (candidates(node.target, args, kwargs, hint, n) or [])
            except Exception:  # noqa: BLE001 - as above
                pass
    if extra is not None:
        found = [*(found or []), extra]
    if found is None and unruled is not None and str(node.target) not in unruled and node.target not in RANDOM_OPS:
        unruled.add(str(node.target))
        warnings.warn(f"fxpar: no sharding rule for {node.target}; it runs replicated (inputs gathered)",
                      FxparWarning, stacklevel=2)
    fallback = Candidate(tuple(Replicate() for _ in cur), _all(node.meta["val"], Replicate()))
    replica = float(_nbytes(node, first=True)) if sharded else 0.0
    whole = context.penalty(fallback, node) if context is not None else 0.0
    tp_like = placed_on is not None
    best, best_key = fallback, (_cost(node, fallback, tensor_args, cur, n, param_like, tp_like) + replica + whole, 1, 0)
    for i, cand in enumerate(found or []):
        usable = fits(node, cand, len(cur)) and disjoint(cand, taken) and plain(cand)
        if usable and context is not None:
            usable = context.allowed(cand, tensor_args, node)
        if not usable:
            continue
        cost = _cost(node, cand, tensor_args, cur, n, param_like, tp_like)
        cost += replica if _first(cand.output) != SEQUENCE else 0.0
        cost += _final_reduction(node, cand, placed_on) if placed_on is not None and cost < NO_CANDIDATE else 0.0
        cost += context.penalty(cand, node) if context is not None else 0.0
        key = (cost, sum(c != r for c, r in zip(cur, cand.inputs, strict=True)), i)
        if cost < NO_CANDIDATE and key < best_key:
            best, best_key = cand, key
    return best


def _final_reduction(node: fx.Node, cand: Candidate, placed_on: Callable[[fx.Node], Placement | None]) -> float:
    """What completing ``cand``'s partial output costs when every reader needs it complete (0 otherwise)."""
    def completes(user: fx.Node, through: fx.Node = node) -> bool:
        if _only_output_reads(user) or (is_float_cast(user) and user.users  # mixed precision: the cast back to fp32
                                        and all(completes(u, user) for u in user.users)):
            return True
        others = [a for a in user.all_input_nodes if a is not through]
        return user.target in PARTIAL_SUMS and any(isinstance(placed_on(a), (Replicate, Shard)) for a in others)

    if isinstance(cand.output, Partial) and node.users and all(completes(u) for u in node.users):
        return transition_cost(cand.output, Replicate(), _nbytes(node))
    return 0.0


def _only_output_reads(user: fx.Node) -> bool:
    """``user`` is the program's output, or views of it only the output reads (a parameter's gradient transposed back
    by cp's weight path: ``t(t(token_contract))``)."""
    if user.op == "output":
        return True
    return user.target in VIEW_LIKE and bool(user.users) and all(_only_output_reads(u) for u in user.users)


def _stream_shaped(arg: fx.Node, node: fx.Node) -> bool:
    """``arg`` is a ``[batch, seq, hidden]`` tensor with the same batch and sequence sizes as ``node``'s output."""
    a, out = tensor_val(arg), _first(node.meta.get("val"))
    return a is not None and isinstance(out, torch.Tensor) and a.ndim == 3 == out.ndim and a.shape[:2] == out.shape[:2]


def _cost(node: fx.Node, cand: Candidate, tensor_args: list[fx.Node], cur: list[Placement], n: int,
          param_like: set[str], tp_like: bool = False) -> float:
    if len(cand.inputs) != len(cur) or not _allowed(node, cand, cur, n):
        return NO_CANDIDATE
    total = 0.0
    for arg, src, dst in zip(tensor_args, cur, cand.inputs, strict=True):
        shared = tp_like and isinstance(dst, Replicate) and _gathered_anyway(node, arg)
        c = 0.0 if shared else transition_cost(src, dst, _nbytes(arg))
        if c > 1 and arg.name in param_like:
            c *= PARAM_PENALTY
        total += c
    return total


def _gathered_anyway(node: fx.Node, arg: fx.Node) -> bool:
    """On a tp-like axis: ``node`` is an embedding's backward, and ``arg`` (the incoming gradient) is gathered whole
    for another embedding's backward reading it, one whose table is larger than the gradient (it gathers, rather than
    all-reduce the table, ``_final_reduction``): lowering gathers once for both, so a small table (BERT's token
    types) adds no bytes that way."""
    if node.target is not aten.embedding_dense_backward.default or node.args[0] is not arg:
        return False
    return any(u is not node and u.target is aten.embedding_dense_backward.default and u.args[0] is arg
               and _nbytes(u) > _nbytes(arg) for u in arg.users)


def _allowed(node: fx.Node, cand: Candidate, cur: list[Placement], n: int) -> bool:
    outs = cand.output if isinstance(cand.output, tuple) else (cand.output,)
    vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
    for p in cand.inputs:
        if isinstance(p, Partial) and not is_plain_sum(p):
            return False  # avg/max partials and DTensor's masked partials need more than a sum
    for p in outs:
        if isinstance(p, Partial) and not is_plain_sum(p) and not (node.target in MAX_REDUCTIONS and is_max(p)):
            return False  # a max over shards (an fp8 amax) is completed by a max all-reduce; nothing else is
    for p, v in zip(outs, vals, strict=False):
        if isinstance(p, Shard) and isinstance(v, torch.Tensor) and v.shape[p.dim] < n:
            return False  # an empty piece on some rank; uneven pieces are fine (DTensor's split)
    kept_partial = [isinstance(s, Partial) and isinstance(d, Partial) for s, d in zip(cur, cand.inputs, strict=True)]
    for src, dst in zip(cur, cand.inputs, strict=True):
        if isinstance(dst, Partial) and not isinstance(src, Partial):
            return False
    return not any(kept_partial) or keeps_partial(node, cand, kept_partial)


def is_plain_sum(p: Placement) -> bool:
    """A partial that an all-reduce(sum) completes: exactly ``Partial("sum")``."""
    return type(p) is Partial and p.reduce_op == "sum"


def is_max(p: Placement) -> bool:
    return type(p) is Partial and p.reduce_op == "max"


def transition_cost(src: Placement, dst: Placement, nbytes: int) -> float:
    """Relative cost of changing one tensor's placement on one axis (bytes of the full tensor)."""
    if src == dst:
        return 0.0
    if isinstance(dst, Partial) or (is_max(src) and not isinstance(dst, Replicate)):
        return NO_CANDIDATE  # a max partial is only ever all-reduced
    if isinstance(src, Replicate):
        return 1.0  # a local slice: free of communication, but not nothing
    if isinstance(src, Partial):
        return 2.0 * nbytes if isinstance(dst, Replicate) else float(nbytes)
    return float(nbytes)  # all-gather or all-to-all


def _nbytes(node: fx.Node, first: bool = False) -> int:
    """Bytes of ``node``'s tensor value (``first``: of the first output of a multi-output op, dropout's)."""
    v = _first(node.meta.get("val")) if first else tensor_val(node)
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _first(value: Any) -> Any:
    """A multi-output op's first output (its value or placement: dropout's output before its mask); else itself."""
    return value[0] if isinstance(value, (tuple, list)) and value else value
