"""Buffers the forward writes (BatchNorm's running statistics, a step counter) as explicit in-place copies.

AOTAutograd returns a written buffer's new value as an extra graph output (``InputMutationAOTOutput``) for the
caller to copy back. A rank program has no such caller, so capture turns each into ``aten.copy_(buffer, value)``
at the end of the forward: the printed program shows the write, lowering makes ``value`` whole on every rank
(the buffer is replicated), and every runner of the forward graph (``pm(...)``, ``pm.step``, ``fxpar.run``)
updates the rank's buffer as the single device updates its own, once per microbatch forward.
"""

from __future__ import annotations

import torch
import torch.fx as fx

aten = torch.ops.aten


def buffer_writes_as_copies(gm: fx.GraphModule) -> None:
    """Rewrite ``gm``'s buffer-mutation outputs as ``aten.copy_`` nodes before its first backward node (in place).
    Mutations of user inputs stay outputs (``fxpar.capture`` refuses them)."""
    out = gm.graph.output_node()
    descs = out.meta["desc"]
    writes = [(desc.mutated_input.target, value) for value, desc in zip(out.args[0], descs, strict=True)
              if _is_buffer_write(desc)]
    if not writes:
        return
    buffers = {n.meta["desc"].target: n for n in gm.graph.find_nodes(op="placeholder")
               if type(n.meta.get("desc")).__name__ == "BufferAOTInput"}
    first_bwd = next((n for n in gm.graph.nodes if n.op == "call_function"
                      and n.meta.get("partitioner_tag") == "is_backward"), out)
    for target, value in writes:
        with gm.graph.inserting_before(first_bwd):
            write = gm.graph.call_function(aten.copy_.default, (buffers[target], value))
        write.meta.update({k: v for k, v in value.meta.items() if k != "val"})
        write.meta["val"] = buffers[target].meta["val"]
    kept = [(value, desc) for value, desc in zip(out.args[0], descs, strict=True) if not _is_buffer_write(desc)]
    out.args = (tuple(value for value, _ in kept),)
    out.meta["desc"] = [desc for _, desc in kept]
    gm.recompile()


def written_buffers(graph: fx.Graph) -> set[str]:
    """Graph names of the buffer placeholders ``graph`` writes in place."""
    return {n.args[0].name for n in graph.find_nodes(op="call_function", target=aten.copy_.default)
            if n.args[0].op == "placeholder"}


def _is_buffer_write(desc: object) -> bool:
    return (type(desc).__name__ == "InputMutationAOTOutput"
            and type(desc.mutated_input).__name__ == "BufferAOTInput")
