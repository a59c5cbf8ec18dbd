"""Capture: ``torch.export`` (non-strict) then AOTAutograd's joint forward+backward graph.

Everything is traced on fake tensors with global shapes, so a model on the meta device (or
far too large for this machine) compiles without allocating its parameters. The user's
model is never modified: fake parameters are swapped in only for the duration of tracing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._export.utils import _compiling_state_context
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar import blocks as _blocks_module
from fxpar.batch_norm import CAPTURE_DECOMPOSITIONS
from fxpar.block_chain import ChainBroken, ChainRouter, chains_enabled, expand_chains, plan_chains
from fxpar.block_reads import no_attribute_writes
from fxpar.block_state import Stripped, detached_state, held_elsewhere, restore_block_state, strip_block_state
from fxpar.blocks import BlockTable, NotShared, find_blocks, opaque_blocks
from fxpar.buffer_writes import buffer_writes_as_copies
from fxpar.creation_order import recording_names
from fxpar.errors import CaptureError
from fxpar.global_means import means_as_sums
from fxpar.ir import SPLIT_ADDMM, Program, Provenance, Signature, fake_empty
from fxpar.mesh import Mesh
from fxpar.mixed_precision import computing_in
from fxpar.moe import experts_as_ops
from fxpar.reparametrize import swapped_in
from fxpar.sharing import Sharing, with_shared_blocks
from fxpar.simplify import (
    bias_after_token_view,
    bmm_over_heads,
    drop_identity_batch_index,
    round_trip_views,
    tokens_unflattened,
)
from fxpar.source import _clean_module_path, traced_provenance, user_source
from fxpar.split import CONTEXT_AXIS
from fxpar.state_guard import model_state_unchanged, uninitialized
from fxpar.stitch import Blocks, Captures, stitch, without_onednn
from fxpar.token_rows import token_rows_unflattened
from fxpar.trace_errors import explain_trace_failure
from fxpar.whole_names import name_as_whole

_BLOCKS_FILE = os.path.abspath(_blocks_module.__file__)
log = logging.getLogger("fxpar.capture")
T = TypeVar("T")

def capture(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...],
            param_dtype: torch.dtype | None = None) -> Program:
    """Trace ``model(*example_inputs)`` into a global joint Program.

    Requires: example inputs with global (unsharded) shapes; parameters on cpu, cuda or meta.
    Ensures: every call_function/placeholder node has provenance (module, source, phase), and
    the signature maps placeholders to parameter names, inputs and tangents. Repeated blocks are
    traced once each (``fxpar.blocks``) unless ``FXPAR_SHARING=0``; the graph is the same either way,
    and ``notes["captures"]`` says which way it was built. With ``param_dtype``, the model computes in it
    (``fxpar.mixed_precision``).
    """
    return with_shared_blocks(lambda share: _capture(model, mesh, example_inputs, share, param_dtype))


def _capture(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...], share: Sharing,
             param_dtype: torch.dtype | None) -> Program:
    exported = export_fake(model, mesh, example_inputs, share=share, param_dtype=param_dtype, detach=True)
    prog = capture_joint(exported.gm, exported, model, mesh, exported.fake_args)
    return prog.replace(notes={**prog.notes, "captures": exported.captures})


@dataclass
class Exported:
    """A non-strict ``torch.export`` of the model on fake tensors, ready to be split or captured."""

    gm: fx.GraphModule  # ep.module(): parameters are attributes, user inputs are placeholders
    fake_mode: FakeTensorMode
    fake_args: tuple[Any, ...]  # flat fake user inputs, in placeholder order
    out_spec: Any  # pytree spec of the model's outputs
    blocks: Blocks | None = None  # repeated blocks called as ``fxpar::block`` (``fxpar.stitch`` copies them in)
    reason: str = ""  # why blocks are not shared
    detached: Stripped | None = None  # the blocks' own state, kept out of ``gm`` (``fxpar.block_state``)

    @property
    def captures(self) -> Captures:
        return self.blocks.summary() if self.blocks is not None else Captures(reason=self.reason)


def export_fake(model: torch.nn.Module, mesh: Mesh, example_inputs: tuple[Any, ...],
                share: Sharing | None = None, keep: tuple[str, ...] = (),
                param_dtype: torch.dtype | None = None, detach: bool = False) -> Exported:
    """Export ``model`` with fake parameters and inputs (the user's model is left as it was).

    ``share``: call repeated blocks (``fxpar.blocks.find_blocks``) as opaque ``fxpar::block`` ops, to be traced
    once each when the joint is captured; ``keep``: module paths that must stay visible (pipeline stage starts);
    ``param_dtype``: each module computes on its parameters cast to it (``fxpar.mixed_precision``); ``detach``:
    the blocks' own parameters and buffers stay out of the export (``Exported.detached``; only for a graph that is
    captured whole, not split into pipeline stages: a stage's split reads the parameters its graph holds).
    """
    uninitialized(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_state = _fake_state(model, fake_mode, mesh.device)
    fake_args = pytree.tree_map_only(torch.Tensor, lambda t: _fake_like(t, fake_mode, mesh.device), example_inputs)

    @contextmanager
    def tracing() -> Iterator[None]:
        # the KV cache off for every trace of the model or its blocks alike: a block traced once after the export
        # reads the config its calls read (``fxpar.block_reads``)
        with model_state_unchanged(model), swapped_in(model, fake_state), without_kv_cache(model), \
                experts_as_ops(model, mesh.axes.get("ep", 1)), computing_in(model, param_dtype):
            yield

    share = share or Sharing(False)
    found = find_blocks(model, keep) if share.on else {}
    if share.on and not found:
        raise NotShared("no repeated blocks")
    blocks = None
    with tracing(), fake_mode:
        if found:
            ep, table = _export_opaque(model, fake_args, found, fake_mode, detach and not held_elsewhere(model, found))
            blocks = Blocks(table, fake_mode, tracing)
        else:
            ep = _export(model, fake_args)
    gm = ep.module()
    detached = None
    if blocks is not None:
        with fake_mode:
            blocks.note_uses(gm.graph)
            if not blocks.used:  # (a block the model reaches in another way than calling it)
                raise NotShared("the model calls none of its repeated blocks")
            name_as_whole(gm, blocks)
        detached = detached_state(gm, model, blocks.table)
    return Exported(gm, fake_mode, fake_args, ep.call_spec.out_spec, blocks, share.reason, detached)


def _export_opaque(model: torch.nn.Module, fake_args: tuple[Any, ...], found: dict[str, torch.nn.Module],
                   fake_mode: FakeTensorMode, detach: bool) -> tuple[torch.export.ExportedProgram, BlockTable]:
    """The export with the ``found`` blocks opaque; with ``detach``, each run of calls the model's loop makes is one
    op (``fxpar.block_chain``), or, where the export does not call them as the plan saw, a call per layer."""
    table = BlockTable(found)

    def opaque(detaching: bool, call: Callable[[], T]) -> T:
        with opaque_blocks(table, fake_mode, detach=detaching), no_attribute_writes(model):
            return call()

    chains = plan_chains(table, lambda: opaque(True, lambda: _called(model, fake_args))) \
        if detach and chains_enabled() else []
    if chains:
        router = ChainRouter(table, chains)
        table.route = router.route
        try:
            ep = opaque(True, lambda: _export(model, fake_args))
            router.finish()
            return ep, table
        except ChainBroken as e:
            log.debug("block runs not exported as one call (%s); a call per layer", e)
            table = BlockTable(found, _runs=table._runs)  # (the blocks' fake runs stay valid)
        finally:
            router.table.route = None
    return opaque(detach, lambda: _export(model, fake_args)), table


def _called(model: torch.nn.Module, args: tuple[Any, ...]) -> Any:
    """``model(*args)`` as the export calls it: a Hugging Face model without its KV cache, and with
    ``torch.compiler.is_compiling()`` and ``is_exporting()`` true, as the export sets them (HF's MoE layers pick their
    kernel by them). Fake-tensor mode's report of an op that fails on fake inputs is not logged: the plan is then
    simply empty."""
    with without_kv_cache(model), _meta_failures_unlogged(), _compiling_state_context():
        return model(*args)


def capture_joint(module: torch.nn.Module, exported: Exported, model: torch.nn.Module, mesh: Mesh,
                  args: tuple[Any, ...]) -> Program:
    """The joint forward+backward Program of ``module`` (the exported model or one pipeline stage of it).

    Floating inputs that require grad (stage boundaries) get their gradients as extra outputs,
    listed in ``signature.input_grads``. Parameter names are the user's model's canonical names.
    """
    with exported.fake_mode:
        try:
            with ExitStack() as stack, without_onednn():
                if exported.blocks is not None:  # stitching takes the names the trace dropped where it made them
                    stack.enter_context(recording_names())
                stripped = _stripped(module, exported)
                joint = aot_export_joint_with_descriptors(stack, stripped.module if stripped else module, args,
                                                          decompositions=CAPTURE_DECOMPOSITIONS)
        except Exception as e:  # noqa: BLE001 - e.g. an op without a derivative
            raise CaptureError(explain_trace_failure(model, e, module.graph)) from e
        gm = joint.graph_module
        if exported.blocks is not None:
            expand_chains(gm, exported.blocks.table, exported.fake_mode)
        if stripped is not None:
            restore_block_state(gm, stripped, exported.fake_mode)
        if exported.blocks is not None:
            gm = stitch(gm, exported.blocks, lambda n: user_source(n.meta.get("stack_trace"), before=_BLOCKS_FILE),
                        stage=module is not exported.gm)
        _split_addmm(gm)
        means_as_sums(gm)
        bias_after_token_view(gm)
        drop_identity_batch_index(gm)
        bmm_over_heads(gm)
        if mesh.axes.get(CONTEXT_AXIS, 1) > 1:  # the sequence is sharded: keep Linear's tokens un-flattened
            tokens_unflattened(gm)
        round_trip_views(gm)
    buffer_writes_as_copies(gm)
    _refuse_mutations(gm, model)
    signature = _signature(gm, joint, args, canonical_names(model))
    provenance = {n.name: _provenance(n) for n in gm.graph.nodes if n.op != "output"}
    return Program(gm=gm, mesh=mesh, signature=signature, provenance=provenance)


def _stripped(module: torch.nn.Module, exported: Exported) -> Stripped | None:
    """``module`` (the exported model or a stage of it) without its blocks' own state, if it has blocks."""
    if exported.blocks is None:
        return None
    if module is exported.gm and exported.detached is not None:
        return exported.detached
    return strip_block_state(module, exported.blocks.table.sites)


def _fake_like(t: torch.Tensor, fake_mode: FakeTensorMode, device: str) -> torch.Tensor:
    """A fake tensor of ``t``'s shape, strides and dtype on ``device``; a parameter stays a parameter (with its
    ``requires_grad``). Wrapped from a fresh meta tensor as the fake mode wraps an op's meta output, and marked a
    parameter as ``nn.Parameter`` marks a tensor subclass: about 18 us a tensor where running ``empty_strided`` in
    the mode and wrapping it in ``nn.Parameter`` took about 220 us (726 tensors at 80 layers of 70B)."""
    fake = fake_empty(fake_mode, t.shape, t.stride(), t.dtype, device)
    if isinstance(t, torch.nn.Parameter):
        fake.requires_grad_(t.requires_grad)
        fake._is_param = True  # what ``nn.Parameter(fake)`` sets on a tensor subclass (after a detach)
    return fake


def _fake_state(model: torch.nn.Module, fake_mode: FakeTensorMode, device: str) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        state[name] = _fake_like(p, fake_mode, device)
    for name, b in model.named_buffers():
        state[name] = _fake_like(b, fake_mode, device)
    return state


@contextmanager
def without_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    """Turn off a Hugging Face model's KV cache (``config.use_cache``) for the duration, then restore it.

    fxpar compiles a training step; HF decoders default to returning a ``DynamicCache``, which is not a
    pytree ``torch.export`` can return and which no training loss reads. Every config a submodule holds is
    turned off too: an encoder-decoder's decoder stack keeps its own copy (T5's reads it for ``use_cache=None``).
    """
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for c in configs.values():
        c.use_cache = False
    try:
        yield
    finally:
        for c in configs.values():
            c.use_cache = True


def _export(model: torch.nn.Module, args: tuple[Any, ...]) -> torch.export.ExportedProgram:
    try:
        with without_kv_cache(model), _meta_failures_unlogged():
            ep = torch.export.export(model, args, strict=False)
        token_rows_unflattened(ep.graph_module)
    except NotShared:
        raise
    except Exception as e:  # noqa: BLE001 - every tracing failure becomes a CaptureError
        raise CaptureError(explain_trace_failure(model, e)) from e
    _refuse_own_collectives(ep.graph_module.graph)
    _refuse_mixed_dtype_products(ep.graph_module.graph)
    return ep


_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "convolution", "conv1d", "conv2d", "conv3d"}


def _refuse_mixed_dtype_products(graph: fx.Graph) -> None:
    """A matmul or convolution of two tensors of different dtypes (integer tokens into a float Linear) is a
    ``CaptureError`` at its line: fake tensors do not check it, and the rank program failed when it first ran."""
    for node in graph.nodes:
        name = getattr(node.target, "_opname", "")
        if node.op != "call_function" or name not in _PRODUCTS:
            continue
        first = [a.meta.get("val") for a in node.args if isinstance(a, fx.Node)][-2:] if name.startswith(
            ("addmm", "baddbmm")) else [a.meta.get("val") for a in node.args[:2] if isinstance(a, fx.Node)]
        dtypes = [v.dtype for v in first if isinstance(v, torch.Tensor)]
        if len(dtypes) == 2 and dtypes[0] != dtypes[1]:
            stack = node.meta.get("nn_module_stack") or {}
            path, kind = next(reversed(stack.values()), ("", ""))
            where = user_source(node.meta.get("stack_trace"))
            kind = getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1])
            module = f"{_clean_module_path(path)} ({kind})" if path else "the model"
            raise CaptureError(f"{module} computes {name} of a {dtypes[0]} and a {dtypes[1]} tensor"
                               f"{' at ' + where if where else ''}: torch refuses that when it runs; give example "
                               "inputs (and call the model with inputs) of the dtype its weights have")


def _refuse_own_collectives(graph: fx.Graph) -> None:
    """A collective the model's code issues itself (``dist.all_reduce``) is a ``CaptureError`` at its line: fxpar
    places every collective from the plan, and lowering had failed on it with an internal assertion."""
    for node in graph.nodes:
        namespace = getattr(node.target, "namespace", "")
        if node.op == "call_function" and namespace in ("_c10d_functional", "c10d") and "wait" not in str(node.target):
            where = user_source(node.meta.get("stack_trace"))
            raise CaptureError(f"the model issues its own collective ({node.target.__name__}"
                               f"{' at ' + where if where else ''}): fxpar inserts every collective itself, from the "
                               "plan; run that code only outside fxpar")


class _MetaFailureFilter(logging.Filter):
    """Drops fake-tensor mode's own report of an op that failed on fake inputs (a 40-line traceback logged at
    ERROR): the failure reaches the user once, as the ``CaptureError`` that names their line and module."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.msg.startswith("failed while attempting to run meta")


@contextmanager
def _meta_failures_unlogged() -> Iterator[None]:
    logger, dropped = logging.getLogger("torch._subclasses.fake_tensor"), _MetaFailureFilter()
    logger.addFilter(dropped)
    try:
        yield
    finally:
        logger.removeFilter(dropped)


def _split_addmm(gm: fx.GraphModule) -> None:
    """``addmm(b, x, w)`` -> ``add(mm(x, w), b)``: a row-parallel Linear then reduces its partial
    product before adding the (replicated) bias, instead of gathering its inputs. Lowering fuses the pair back
    where the product needs no collective (``fxpar.lower.fuse_bias``)."""
    aten = torch.ops.aten
    for n in list(gm.graph.nodes):
        if n.target is aten.addmm.default and not n.kwargs:
            bias, x, w = n.args
            with gm.graph.inserting_before(n):
                mm = gm.graph.call_function(aten.mm.default, (x, w))
                mm.meta.update({k: v for k, v in n.meta.items() if k != "val"})
                mm.meta["val"] = n.meta["val"].new_empty(n.meta["val"].shape)
                add = gm.graph.call_function(aten.add.Tensor, (mm, bias))
                add.meta.update(n.meta)
                add.meta[SPLIT_ADDMM] = True  # fused again where no collective comes between (fxpar.lower.fuse_bias)
            n.replace_all_uses_with(add)
            gm.graph.erase_node(n)
    gm.recompile()


def canonical_names(model: torch.nn.Module) -> dict[str, str]:
    """Every name of every parameter -> the name ``model.named_parameters()`` uses (tied weights once)."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _refuse_mutations(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """A ``CaptureError`` naming each input or parameter the model's forward writes in place, at the user's line
    (written buffers are copies in the graph by now: ``fxpar.buffer_writes``): a rank program holds shards of
    the caller's tensors and of the parameters, and dropping the write would silently leave them stale."""
    out = gm.graph.output_node()
    written = [(desc.mutated_input, value) for value, desc in zip(out.args[0], out.meta["desc"], strict=True)
               if type(desc).__name__ == "InputMutationAOTOutput"]
    if not written:
        return
    lines = []
    for what, value in written:
        name = getattr(what, "target", None) or f"input {getattr(what, 'idx', '?')}"
        module = _provenance(value).module if isinstance(value, fx.Node) else ""
        source = _provenance(value).source if isinstance(value, fx.Node) else ""
        lines.append(f"  {name}" + (f" (in {module})" if module else "") + (f" at {source}" if source else ""))
    params = sum(type(what).__name__ == "ParamAOTInput" for what, _ in written)
    hint = ("a parameter is the optimizer's to change: renormalize it outside forward (under torch.no_grad(), "
            "e.g. nn.Embedding's max_norm as a step after opt.step())" if params else
            "return the new value instead, or keep it in a buffer of the model (fxpar updates written buffers)")
    raise CaptureError(
        f"cannot compile {type(model).__name__}: its forward writes {len(written)} "
        f"{'parameter' if params else 'input'}(s) in place:\n" + "\n".join(lines) + f"\nhint: {hint}")


def _signature(gm: fx.GraphModule, joint: Any, fake_args: tuple[Any, ...], canonical: dict[str, str]) -> Signature:
    params, buffers, inputs, tangents = [], [], [], []
    for n in gm.graph.find_nodes(op="placeholder"):
        desc = n.meta["desc"]
        kind = type(desc).__name__
        if kind == "ParamAOTInput":
            params.append((canonical.get(desc.target, desc.target), n.name))
        elif kind == "BufferAOTInput":
            buffers.append((desc.target, n.name))
        elif kind == "PlainAOTInput":
            inputs.append(n.name)
        elif kind == "TangentAOTInput":
            tangents.append((n.name, desc.output.idx))
        else:
            raise CaptureError(f"unsupported graph input {n.name}: {desc}")
    out = gm.graph.output_node()
    descs = out.meta["desc"]
    num_outputs = sum(type(d).__name__ == "PlainAOTOutput" for d in descs)
    grads = tuple(
        (canonical.get(d.grad_of.target, d.grad_of.target), i)
        for i, d in enumerate(descs)
        if type(d).__name__ == "GradAOTOutput" and type(d.grad_of).__name__ == "ParamAOTInput"
        and out.args[0][i] is not None
    )
    input_grads = tuple(
        (inputs[d.grad_of.idx], i)
        for i, d in enumerate(descs)
        if type(d).__name__ == "GradAOTOutput" and type(d.grad_of).__name__ == "PlainAOTInput"
        and out.args[0][i] is not None
    )
    _, in_spec = pytree.tree_flatten(fake_args)
    return Signature(
        params=tuple(params), buffers=tuple(buffers), inputs=tuple(inputs), tangents=tuple(tangents),
        num_outputs=num_outputs, grads=grads, input_grads=input_grads, out_spec=joint.out_spec, in_spec=in_spec,
    )




def _provenance(n: fx.Node) -> Provenance:
    if "fxpar_provenance" in n.meta:  # copied from a repeated block's graph (``fxpar.stitch``)
        return n.meta["fxpar_provenance"]
    return traced_provenance(n)
