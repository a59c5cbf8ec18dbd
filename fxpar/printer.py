"""Printing rank programs: valid Python bodies with types, placements and provenance as comments.

Printing is canonical (the same program gives the same text), so programs can be diffed
between versions and checked in as golden files.
"""

from __future__ import annotations

import functools
import operator
import re
from typing import Any

import torch
import torch.fx as fx
from tabulate import tabulate
from torch.distributed.tensor import Partial, Replicate, Shard

from fxpar.backends.comm import c10d, rank_sizes
from fxpar.compiled import Compiled
from fxpar.gc_pause import without_gc_pauses
from fxpar.ir import Program, block_entry, entry_path
from fxpar.lower import LedgerRow, RankProgram
from fxpar.lower.collectives import COORD_SLICE
from fxpar.memory import saved_bytes
from fxpar.rank_step import backward_halves
from fxpar.roles import coord_slice_args

_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.float8_e4m3fn: "f8e4m3",
           torch.float8_e5m2: "f8e5m2", torch.uint8: "u8", torch.int8: "i8"}
_COMM = {c10d.all_reduce.default: "comm.all_reduce", c10d.all_gather_into_tensor.default: "comm.all_gather",
         c10d.reduce_scatter_tensor.default: "comm.reduce_scatter", c10d.wait_tensor.default: "comm.wait",
         c10d.all_to_all_single.default: "comm.all_to_all", rank_sizes: "comm.rank_sizes"}
CODE_WIDTH = 64
# id(fake value) -> (the value, its type text): lowering shares one fake value among the copies of a repeated layer's
# op, so a deep program prints a few hundred distinct values over tens of thousands of lines
_TENSOR_TYPES: dict[int, tuple[torch.Tensor, str]] = {}
_TENSOR_TYPES_LIMIT = 100_000


def type_str(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        known = _TENSOR_TYPES.get(id(val))
        if known is None or known[0] is not val:  # the entry holds its tensor: no other can take its id meanwhile
            if len(_TENSOR_TYPES) > _TENSOR_TYPES_LIMIT:
                _TENSOR_TYPES.clear()
            known = _TENSOR_TYPES[id(val)] = (val, f"{_DTYPES.get(val.dtype, str(val.dtype))}"
                                                   f"[{','.join(map(str, val.shape))}]")
        return known[1]
    if isinstance(val, (tuple, list)) and val and all(type(v) is int for v in val):
        return f"int[{len(val)}]"  # a list of ints known at run time (all-to-all split sizes)
    if isinstance(val, (tuple, list)):
        return "(" + ", ".join(type_str(v) for v in val) + ")"
    return ""


def placement_str(p: Any) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    return "?"


def placements_str(placements: Any, axes: tuple[str, ...]) -> str:
    if placements is None:
        return ""
    known = _PLACEMENTS_SEEN.get(id(placements))  # (hashing DTensor placements runs Python: look up the object first)
    if known is not None and known[0] is placements and known[1] == axes:
        return known[2]
    try:  # a program repeats a few placements over thousands of nodes
        text = _placements_text(placements, axes)
    except TypeError:  # not hashable (a list)
        return _placements_text.__wrapped__(placements, axes)
    if len(_PLACEMENTS_SEEN) > _TENSOR_TYPES_LIMIT:
        _PLACEMENTS_SEEN.clear()
    _PLACEMENTS_SEEN[id(placements)] = (placements, axes, text)
    return text


_PLACEMENTS_SEEN: dict[int, tuple[Any, tuple[str, ...], str]] = {}  # id -> (placements, axes, text), as type_str's


@functools.lru_cache(maxsize=4096)
def _placements_text(placements: Any, axes: tuple[str, ...]) -> str:
    if placements and isinstance(placements[0], tuple) or (placements and placements[0] is None):
        return "(" + ", ".join(placements_str(p, axes) for p in placements) + ")"
    return " ".join(f"{a}:{placement_str(p)}" for a, p in zip(axes, placements, strict=True))


def _arg(a: Any, groups: dict[str, str]) -> str:
    if isinstance(a, fx.Node):
        return a.name
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, groups) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, str):
        return groups.get(a, repr(a))
    if isinstance(a, torch.dtype):
        return str(a)
    if isinstance(a, torch.device):
        return f"torch.device({str(a)!r})"
    if isinstance(a, torch.memory_format):
        return f"torch.{str(a).split('.')[-1]}"
    if isinstance(a, torch.layout):
        return str(a)
    return repr(a)


def _target(t: Any) -> str:
    text = _TARGETS.get(t)
    if text is None:
        text = _TARGETS[t] = _target_text(t)
    return text


_TARGETS: dict[Any, str] = {}


def _target_text(t: Any) -> str:
    if t in _COMM:
        return _COMM[t]
    if isinstance(t, torch._ops.OpOverload):  # "aten::mm.default" -> aten.mm, "fxpar::bmm4" -> fxpar.bmm4
        namespace, name = t.name().split("::")
        packet, overload = name.split(".", 1) if "." in name else (name, "default")
        return f"{namespace}.{packet}" if overload == "default" else f"{namespace}.{packet}.{overload}"
    return getattr(t, "__name__", str(t))


def _line(n: fx.Node, axes: tuple[str, ...], groups: dict[str, str], verbosity: int = 1,
          coord: tuple[int, ...] | None = None) -> str:
    if n.target is operator.getitem:
        code = f"{n.name} = {n.args[0].name}[{n.args[1]}]"
    else:
        given = coord_slice_args(n, coord) if coord is not None and COORD_SLICE in n.meta else n.args
        args = [a.name if type(a) is fx.Node else _arg(a, groups) for a in given]
        if n.kwargs:
            args += [f"{k}={_arg(v, groups)}" for k, v in n.kwargs.items()]
        code = f"{n.name} = {_target(n.target)}({', '.join(args)})"
    notes = [type_str(n.meta.get("val")), placements_str(n.meta.get("placements"), axes)]
    if n.meta.get("recomputed"):
        notes.append("recomputed")
    if n.target in _COMM and n.target not in (c10d.wait_tensor.default, rank_sizes):
        notes.append(f"inflight {n.name}")
    elif n.meta.get("module"):
        notes.append(n.meta["module"])
    if verbosity >= 2 and n.meta.get("source"):
        notes.append(n.meta["source"])
    comment = "   ".join(x for x in notes if x)
    return f"    {code:<{CODE_WIDTH}}  # {comment}" if comment else f"    {code}"


def graph_source(name: str, gm: fx.GraphModule, axes: tuple[str, ...], groups: dict[str, str],
                 verbosity: int = 1, coord: tuple[int, ...] | None = None) -> str:
    """``def name(...):`` with one line per node and a return; ``coord``: print even slices (``COORD_SLICE``) as the
    rank at ``coord`` takes them (a role's graph printed as another rank's)."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    lines = [f"def {name}({', '.join(p.name for p in phs)}):"]
    for p in phs:
        notes = "   ".join(x for x in (type_str(p.meta.get("val")),
                                       placements_str(p.meta.get("placements"), axes), p.meta.get("module", "")) if x)
        lines.append(f"    # {p.name}: {notes}")
    body: list[tuple[str | None, str]] = []  # (the node's block, its line)
    block = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            body.append((None, f"    {n.name} = constants[{n.target!r}]"))
        elif n.op == "call_function":  # a node lowering made (a collective, a wait) belongs where it stands
            block = _block_of(n.meta["module"]) if n.meta.get("module") else block
            body.append((block, _line(n, axes, groups, verbosity, coord)))
        elif n.op == "output":
            body.append((None, f"    return {_arg(tuple(n.args[0]), groups)}"))
    if verbosity == 0:
        body = fold_identical_blocks(body, {n.name for n in gm.graph.nodes})
    return "\n".join(lines + [line for _, line in body])


_BLOCK_PATH = re.compile(r"^(.*?\.\d+)(?:\.|$)")
_NAME = re.compile(r"(?<![\w.])[A-Za-z_]\w*")  # a name, not an attribute (``aten.sum``)


@functools.lru_cache(maxsize=65536)
def _block_of(module: str | None) -> str | None:
    """A module path's first ``<name>.<index>`` (``model.layers.3``), the unit recompute and sharing use."""
    m = _BLOCK_PATH.match(module or "")
    return m.group(1) if m else None


def fold_identical_blocks(body: list[tuple[str | None, str]], names: set[str]) -> list[tuple[str | None, str]]:
    """``pm.program(rank, verbosity=0)``: each run of consecutive blocks whose lines equal the run's first block's,
    up to renaming its values and the block index, printed as one comment line naming them.

    Requires: ``body`` the graph's lines in order, each with its node's block (or None); ``names`` the graph's node
    names. Ensures: a block is folded only when every one of its lines equals the first block's line for line once
    values are numbered in order of appearance and the index is taken out; anything else is printed in full."""
    segments: list[tuple[str | None, list[str]]] = []
    for block, line in body:
        if segments and block is not None and segments[-1][0] == block:
            segments[-1][1].append(line)
        else:
            segments.append((block, [line]))
    out: list[tuple[str | None, str]] = []
    i = 0
    while i < len(segments):
        block, seg = segments[i]
        out += [(block, line) for line in seg]
        j = i + 1
        if block is not None:
            shape = _shape(block, seg, names)
            while j < len(segments) and segments[j][0] is not None and _same_family(block, segments[j][0]) \
                    and _shape(segments[j][0], segments[j][1], names) == shape:
                j += 1
        if j > i + 1:
            first, last, count = segments[i + 1][0], segments[j - 1][0], j - i - 1
            span = first if count == 1 else f"{first}-{_index(last)}"
            out.append((None, f"    # {span}: as {block} above, values and parameters renamed "
                              f"({count} block{'s' if count > 1 else ''} folded)"))
        i = j
    return out


def _index(block: str) -> str:
    return block.rsplit(".", 1)[1]


def _same_family(a: str, b: str) -> bool:
    return a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]


def _shape(block: str, lines: list[str], names: set[str]) -> tuple[str, ...]:
    """``lines`` with the block's index taken out of paths and parameter names, values numbered by appearance."""
    prefix, index = block.rsplit(".", 1)
    dotted = re.compile(re.escape(f"{prefix}.{index}") + r"\b")
    flat = f"{prefix.replace('.', '_')}_{index}_"
    numbering: dict[str, str] = {}

    def rename(m: re.Match[str]) -> str:
        word = m.group(0)
        if word.startswith(flat):
            return "P_" + word[len(flat):]
        if word in names:
            return numbering.setdefault(word, f"v{len(numbering)}")
        return word

    return tuple(" ".join(_NAME.sub(rename, dotted.sub("BLOCK", line)).split()) for line in lines)


def group_vars(rp: RankProgram) -> dict[str, str]:
    """Symbolic group name -> the variable that names it in printed code (``TP``)."""
    return {sym: sym.split("[")[0].upper() for sym in rp.groups}


def header(prog: Program, rp: RankProgram, extra: list[str] | None = None) -> str:
    mesh = prog.mesh
    coord = ", ".join(f"{a}={c}" for a, c in zip(mesh.names, rp.coord, strict=True))
    groups = "   ".join(f"{v} = {s}" for s, v in sorted(group_vars(rp).items(), key=lambda kv: kv[1]))
    return "\n".join([
        f"# fxpar program | rank {rp.rank} of {mesh.size} | mesh {mesh.describe()} | coord ({coord})",
        f"# groups  {groups or '(none)'}",
        *(extra or []),
        *_recompute_line(prog, rp),
        f"# passes  {' > '.join((*prog.passes, 'lower'))}",
    ])


def _recompute_line(prog: Program, rp: RankProgram) -> list[str]:
    """What the recompute pass chose: the policy, how many forward ops the backward reruns, the bytes saved."""
    policy = prog.notes.get("recompute_policy")
    if policy is None:
        return []
    redone = sum(1 for n in rp.backward.graph.nodes if n.meta.get("recomputed"))
    saved = saved_bytes(rp.forward, prog.signature.num_outputs)
    return [f"# recompute  {policy}: the backward reruns {redone} forward ops; the forward saves {saved:,} B"]


def print_rank_program(prog: Program, rp: RankProgram, verbosity: int = 1, extra: list[str] | None = None,
                       suffix: str = "", body: RankProgram | None = None) -> str:
    """The rank's header, forward program, backward program and (if any) the once-per-step gradient reduction.

    ``body``: the program whose graphs are printed, when ``rp`` is bound from its role without graphs
    (``Roles.printable``): the role's graphs with ``rp``'s slices; the text is what ``rp``'s bound graphs print."""
    axes = prog.mesh.names
    coord = None if body is None or body is rp else tuple(rp.coord)
    body = body or rp
    groups = group_vars(body)
    parts = [header(prog, rp, extra)]
    if verbosity >= 2:
        plan = prog.notes.get("plan", {})
        parts.append("# plan    " + (", ".join(f"{k}: {v}" for k, v in sorted(plan.items())) or "(none)"))
    if rp.gather_params is not None:  # ZeRO: once per step, before the first forward
        parts.append(graph_source(f"gather_params{suffix}", body.gather_params, axes, groups, verbosity, coord))
    parts += [graph_source(f"forward{suffix}", body.forward, axes, groups, verbosity, coord),
              graph_source(f"backward{suffix}", body.backward, axes, groups, verbosity, coord)]
    if rp.reduce_grads is not None:
        parts.append(graph_source(f"reduce_grads{suffix}", body.reduce_grads, axes, groups, verbosity, coord))
    return "\n\n".join(parts) + "\n"


@without_gc_pauses  # a deep model's program is tens of thousands of lines: see ``fxpar.gc_pause``
def print_rank_programs(c: Compiled, rank: int, verbosity: int = 1) -> str:
    """Every stage program ``rank`` holds (one without pipeline stages), each with its boundary transfers."""
    stages = c.stage_of_rank(rank)
    if len(c.stages) == 1:
        rp, body = c.roles.printable(rank, 0)
        return print_rank_program(c.stages[0], rp, verbosity, body=body)
    texts = []
    halves = backward_halves(c, rank)
    for s in stages:
        prog = c.stages[s]
        info = prog.notes["stage"]
        peers = _stage_peers(c, rank, s)
        extra = [f"# stage   {s} of {len(c.stages)} (starts at {info.first_module}) | schedule {c.schedule.name}, "
                 f"{c.microbatches} microbatches | {peers}",
                 f"# holds   {held_modules(prog)}",
                 f"# recv    {', '.join(info.received) or '(user inputs only)'}",
                 f"# send    {', '.join(info.sent) or '(outputs to loss_fn)'}"]
        if s in halves:
            extra.append("# bwd     in halves: " + ("B (input gradients) and W (weight gradients), where the schedule "
                                                 "places them" if c.schedule.has_w else
                                                 "B (input gradients, sent back at once), then W (weight gradients)"))
        rp, body = c.roles.printable(rank, s)
        texts.append(print_rank_program(prog, rp, verbosity, extra, suffix=f"_stage{s}", body=body))
    return "\n".join(texts)


def held_modules(prog: Program) -> str:
    """The modules whose parameters a stage program holds, repeated blocks as ranges: ``embed, layers.0-7``."""
    runs: list[list[Any]] = []  # [prefix, first, last] of block ranges, or [module] for the rest
    for fqn, _ in prog.signature.params:
        entry = block_entry(fqn)
        if entry:
            prefix, i = entry
            if runs and len(runs[-1]) == 3 and runs[-1][0] == prefix and i in (runs[-1][2], runs[-1][2] + 1):
                runs[-1][2] = i
                continue
            runs.append([prefix, i, i])
            continue
        module = fqn.rsplit(".", 1)[0] if "." in fqn else fqn
        if not runs or runs[-1] != [module]:
            runs.append([module])
    return ", ".join(r[0] if len(r) == 1 else entry_path(r[0], r[1]) + (f"-{r[2]}" if r[2] != r[1] else "")
                     for r in runs)


def _stage_peers(c: Compiled, rank: int, stage: int) -> str:
    mesh = c.mesh
    coord = list(mesh.coord(rank))
    out = []
    for label, other in (("prev stage", stage - 1), ("next stage", stage + 1)):
        if 0 <= other < len(c.stages):
            coord[mesh.axis_index("pp")] = c.schedule.stage_rank(other)
            out.append(f"{label}: rank {mesh.rank_of(tuple(coord))}")
    return "   ".join(out)


def ledger_table(rows: list[LedgerRow]) -> str:
    """The ledger as a table, with per-phase totals (stage, microbatch and peer columns when pipelined)."""
    piped = any(r.peer is not None or r.stage or r.mb for r in rows)
    body = []
    for r in rows:
        row = [r.phase, r.op, r.axis, "x".join(map(str, r.shape)), _DTYPES.get(r.dtype, str(r.dtype)), r.bytes]
        body.append([*row, r.stage, "" if r.mb is None else r.mb, "" if r.peer is None else r.peer] if piped else row)
    headers = ["phase", "op", "axis", "shape", "dtype", "bytes"] + (["stage", "mb", "peer"] if piped else [])
    total = {ph: sum(r.bytes for r in rows if r.phase == ph) for ph in ("fwd", "bwd")}
    table = tabulate(body, headers=headers, tablefmt="simple")
    return f"{table}\n# {len(rows)} collectives; bytes fwd={total['fwd']} bwd={total['bwd']}"
