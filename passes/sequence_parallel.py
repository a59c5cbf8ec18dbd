"""sequence_parallel: mark the activations between tensor-parallel blocks for sharding on the sequence dim."""

from __future__ import annotations

import warnings

import torch

from fxpar.errors import FxparWarning
from fxpar.ir import Program
from fxpar.modules import ModuleTable
from fxpar.pass_context import Context


def sequence_parallel(prog: Program, ctx: Context) -> Program:
    """Megatron sequence parallelism: name the values ``propagate`` should keep ``Shard(1)`` over tp.

    Requires: an annotated Program; ``ctx.plan.sequence_parallel`` with a tp axis of size > 1
    (checked by the Plan); the model's activations laid out ``[batch, seq, hidden]``.
    Ensures: ``notes["sequence_parallel"]`` = the names of every floating-point node, forward and
    backward, of shape ``[b, s, h]`` where ``h`` is a hidden width of the tp plan (the ``in_features`` of a
    colwise Linear or the ``out_features`` of a rowwise one) and ``s`` a length tp divides: the residual
    stream, its norms, dropouts and adds, and their gradients. The lengths are read from those values, not
    from an input (a ViT's first input is an image; an encoder-decoder has two streams of two lengths).
    ``propagate`` charges a replicated placement of these values on tp as if it moved their bytes,
    so the cheapest program keeps them sequence-sharded: the input of a colwise Linear is then
    all-gathered (not sliced from a replica) and a rowwise Linear's partial output is
    reduce-scattered (not all-reduced), the two collectives each Megatron SP block boundary needs.
    A plan with no colwise/rowwise ``nn.Linear``, or no such value whose length tp divides, turns it off
    with a ``FxparWarning`` (a correct program, without the saving); a length tp does not divide (a ViT's
    pooled class token, ``[b, 1, h]``) stays replicated. Without ``sequence_parallel`` the Program is
    returned unchanged.
    """
    if not ctx.plan.sequence_parallel:
        return prog
    off = prog.replace("sequence_parallel", notes={**prog.notes, "sequence_parallel": frozenset()})
    widths = hidden_widths(ctx.modules, prog.notes.get("plan", {}))
    shaped = [(n.name, v.shape[1]) for n in prog.graph.nodes
              if n.op == "call_function" and _is_stream(v := _stream_value(n), widths)]
    if not shaped:
        warnings.warn("fxpar: sequence_parallel is off: it needs [batch, seq, hidden] activations and a tp plan with "
                      "colwise or rowwise nn.Linear modules (their widths name the residual stream)", FxparWarning,
                      stacklevel=2)
        return off
    tp = prog.mesh.axes["tp"]
    lengths = {length for _, length in shaped if length % tp == 0}
    if not lengths:
        found = sorted({length for _, length in shaped if length > 1}) or [1]  # [b, 1, h]: a pooled token
        what = f"sequence length {found[0]}" if len(found) == 1 else f"sequence lengths {', '.join(map(str, found))}"
        warnings.warn(f"fxpar: sequence_parallel is off: the {what} {'is' if len(found) == 1 else 'are'} not "
                      f"divisible by tp={tp} (the [batch, seq, hidden] activations stay replicated over tp, as without "
                      "it)", FxparWarning, stacklevel=2)
        return off
    stream = frozenset(name for name, length in shaped if length in lengths)
    return prog.replace("sequence_parallel", notes={**prog.notes, "sequence_parallel": stream})


def hidden_widths(modules: ModuleTable, styles: dict[str, str]) -> set[int]:
    """Widths of the residual stream a tp plan implies: colwise Linears read it, rowwise Linears write it (HF GPT-2's
    ``Conv1D`` is a Linear with its weight stored transposed)."""
    widths = set()
    for path, style in styles.items():
        mod = modules.get(path)
        if mod is not None and mod.kind in ("linear", "conv1d"):
            if style == "colwise":
                widths.add(mod.in_features)
            elif style == "rowwise":
                widths.add(mod.out_features)
    return widths


def _is_stream(val: object, widths: set[int]) -> bool:
    return (isinstance(val, torch.Tensor) and val.ndim == 3 and val.dtype.is_floating_point
            and val.shape[2] in widths)


def _stream_value(n: torch.fx.Node) -> object:
    """The value of ``n`` that may be the stream: dropout's output (not its mask); other multi-output ops (a layer
    norm's output, mean and rstd) are placed through their ``getitem`` readers."""
    val = n.meta.get("val")
    return val[0] if n.target is torch.ops.aten.native_dropout.default and isinstance(val, tuple) else val
