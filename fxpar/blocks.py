"""Repeated blocks as opaque calls: trace each distinct block once, not once per layer.

A transformer's layers are the children of one ``nn.ModuleList`` (``nn.Sequential``, or torchtitan's
``nn.ModuleDict`` keyed by layer number): the same code, the same parameter shapes. While the model is
exported, every such block is called through ``torch.ops.fxpar.block(site, tensors)``, an op whose output
shapes are known from one fake run of the block, so the export and the joint graph of the whole model cost a
few nodes per layer.
``fxpar.stitch`` then traces each distinct block once and copies its joint graph in at every
call. What makes two calls the same (a ``Site``'s key):

* the block's structure: for every submodule its class and ``forward``, its parameters' and
  buffers' names, shapes, strides, dtypes and ``requires_grad`` (no hooks anywhere);
* the call: the pytree of arguments, each tensor's shape, stride, dtype and ``requires_grad``,
  which arguments are the same tensor, and every non-tensor argument;
* every plain attribute the block's code reads while it runs (recorded on the fake run), by
  value for plain data and by identity for anything else: ``self.sliding_window`` splits
  Gemma2's sliding and global layers, an unread ``self.layer_idx`` does not.

Only the first call of each variant is run: a later call with the same structure, arguments and global
modes whose module holds the same values for every attribute that run read would run the same code
the same way, so its outputs' shapes are taken from the first (80 layers cost one fake run each, not 80).

A block whose parameters are shared with another block, or that has hooks, is called as usual.
"""

from __future__ import annotations

import itertools
import os
import re
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

from fxpar.block_reads import PLAIN, reads_hold, recording_reads, value_key
from fxpar.mixed_precision import raw_parameter
from fxpar.not_shared import NotShared
from fxpar.taken_off import BlockState

# the containers whose children are a model's repeated blocks (layers): torchtitan keeps its layers in a ModuleDict
# keyed "0", "1", ... so that a pipeline stage can drop layers and keep every path
BLOCK_CONTAINERS = (torch.nn.ModuleList, torch.nn.Sequential, torch.nn.ModuleDict)
SHARING_ENV = "FXPAR_SHARING"  # "0": trace every layer (the escape hatch; the programs must be byte-identical)
_site_ids = itertools.count()


class _Slot:
    """Where a tensor goes among a call's (or an output's) flat pytree leaves."""

    def __repr__(self) -> str:
        return "TENSOR"


TENSOR = _Slot()
_OUT_META: dict[int, tuple[tuple[Any, ...], ...]] = {}  # site id -> (shape, stride, dtype) of each tensor output


SHARE_MIN_ENV = "FXPAR_SHARE_MIN"  # the fewest copies of a block worth tracing once (default 4)


def share_min() -> int:
    """Blocks repeated fewer times than this are traced in place: for a 2- or 3-layer model the block's own
    export and joint cost more than tracing its copies."""
    return int(os.environ.get(SHARE_MIN_ENV, "4"))


def sharing_enabled() -> bool:
    """Whether repeated blocks are traced once (default) or every layer is traced (``FXPAR_SHARING=0``)."""
    return os.environ.get(SHARING_ENV, "1") != "0"


@torch.library.custom_op("fxpar::block", mutates_args=())
def block_call(site: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One call of a repeated block (only ever traced: ``fxpar.stitch`` replaces it by the block's graph)."""
    raise RuntimeError("fxpar::block is a tracing placeholder and never runs")


@block_call.register_fake
def _block_fake(site: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_strided(shape, stride, dtype=dtype, device=inputs[0].device)
            for shape, stride, dtype in _OUT_META[site]]


@torch.library.custom_op("fxpar::block_backward", mutates_args=())
def block_backward(site: int, inputs: list[torch.Tensor], grad_outputs: list[int], grads: list[torch.Tensor],
                   grad_inputs: list[int]) -> list[torch.Tensor]:
    """The backward of one block call: ``grads`` of outputs ``grad_outputs`` in, those of inputs ``grad_inputs``
    out (a tracing placeholder like ``fxpar::block``)."""
    raise RuntimeError("fxpar::block_backward is a tracing placeholder and never runs")


@block_backward.register_fake
def _block_backward_fake(site: int, inputs: list[torch.Tensor], grad_outputs: list[int], grads: list[torch.Tensor],
                         grad_inputs: list[int]) -> list[torch.Tensor]:
    return [torch.empty_like(inputs[i]) for i in grad_inputs]


def _setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    site, tensors = inputs
    ctx.site = site
    ctx.grad_inputs = [i for i, t in enumerate(tensors) if t.requires_grad]
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*tensors)


def _backward(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[None, list[torch.Tensor | None]]:
    tensors = list(ctx.saved_tensors)
    given = [i for i, g in enumerate(grads) if g is not None]
    out = block_backward(ctx.site, tensors, given, [grads[i] for i in given], ctx.grad_inputs)
    full: list[torch.Tensor | None] = [None] * len(tensors)
    for i, g in zip(ctx.grad_inputs, out, strict=True):
        full[i] = g
    return None, full


torch.library.register_autograd("fxpar::block", _backward, setup_context=_setup)
BLOCK_OPS = (torch.ops.fxpar.block.default, torch.ops.fxpar.block_backward.default)


@dataclass
class Site:
    """One call of a repeated block, as the export saw it."""

    id: int
    path: str  # the block's module path, e.g. "model.layers.3"
    module: torch.nn.Module
    in_spec: Any  # pytree spec of (args, kwargs)
    constants: tuple[Any, ...]  # the flat (args, kwargs) leaves, TENSOR where a tensor goes
    n_args: int  # tensor leaves of (args, kwargs); parameters, then buffers, follow them in the op's inputs
    params: tuple[str, ...]  # the block's parameter names (relative), in ``named_parameters`` order
    buffers: tuple[str, ...]
    out_spec: Any
    out_constants: tuple[Any, ...]  # the flat output leaves, TENSOR where a tensor goes
    templates: tuple[tuple[Any, ...], ...]  # shape, stride, dtype, requires_grad, first index, offset, device
    key: tuple[Any, ...]
    reads: dict[tuple[str, ...], Any] = field(default_factory=dict)  # what its code read (``fxpar.block_reads``)


@dataclass
class BlockTable:
    """Every repeated-block call of one export: ``sites`` by id, and what was found."""

    blocks: dict[str, torch.nn.Module]  # path -> block module, the candidates
    sites: dict[int, Site] = field(default_factory=dict)
    _runs: dict[tuple[Any, ...], list[_Run]] = field(default_factory=dict)  # key -> its variants, by reads
    detached: dict[str, BlockState] = field(default_factory=dict)  # path -> state the export did not see
    # where a call's outputs come from: ``route(site, tensors, issue)``; None: ``issue()``, the call's own op
    # (``fxpar.block_chain``: a dry run's fresh outputs, or one op for a run of calls the model's loop makes)
    route: Callable[[Site, list[torch.Tensor], Callable[[], list[torch.Tensor]]], list[torch.Tensor]] | None = None
    chains: dict[int, Any] = field(default_factory=dict)  # the one call of each run of calls (``fxpar.block_chain``)

    def __post_init__(self) -> None:
        weakref.finalize(self, _forget, self.sites, self.chains)


def _forget(*ids: dict[int, Any]) -> None:
    for some in ids:
        for i in some:
            _OUT_META.pop(i, None)


def new_site_id() -> int:
    """An id no call has: a run of calls exported as one op takes one (``fxpar.block_chain``)."""
    return next(_site_ids)


def out_meta(site_id: int) -> tuple[tuple[Any, ...], ...]:
    """Shape, stride and dtype of each tensor output of call ``site_id``."""
    return _OUT_META[site_id]


def set_out_meta(site_id: int, meta: tuple[tuple[Any, ...], ...]) -> None:
    _OUT_META[site_id] = meta


def drop_out_meta(site_ids: list[int]) -> None:
    for i in site_ids:
        _OUT_META.pop(i, None)


def find_blocks(model: torch.nn.Module, exclude: tuple[str, ...] = ()) -> dict[str, torch.nn.Module]:
    """The modules that may be traced once: children of a ``BLOCK_CONTAINERS`` container (through nested lists and
    dicts of modules) with a sibling of the same structure, not nested in another such block, holding no parameter
    another block holds, with no hooks.
    ``exclude``: module paths inside which something must stay visible (a pipeline stage starting there)."""
    found: dict[str, torch.nn.Module] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, BLOCK_CONTAINERS):
            continue
        if any(name == p or name.startswith(p + ".") for p in found):
            continue
        kids = _called_children(name, mod)
        counts: dict[Any, int] = {}
        for m in kids.values():
            counts[structure_key(m)] = counts.get(structure_key(m), 0) + 1
        for path, m in kids.items():
            if counts[structure_key(m)] >= max(2, share_min()) and not _has_hooks(m) and not _inside(exclude, path):
                found[path] = m
    owners: dict[int, set[str]] = {}
    for path, m in found.items():
        for p in m.parameters():
            owners.setdefault(id(p), set()).add(path)
    shared = {path for paths in owners.values() if len(paths) > 1 for path in paths}
    return {p: m for p, m in found.items() if p not in shared}


def _called_children(name: str, container: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The children of ``container`` by path, and in place of a child that is a list or dict of modules (never
    called itself: ``groups.0`` of ``for g in self.groups: for layer in g:``), that child's own, recursively."""
    out: dict[str, torch.nn.Module] = {}
    for c, m in container.named_children():
        path = f"{name}.{c}" if name else c
        if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            out.update(_called_children(path, m))
        else:
            out[path] = m
    return out


def _inside(exclude: tuple[str, ...], path: str) -> bool:
    return any(e.startswith(path + ".") for e in exclude)


def _has_hooks(module: torch.nn.Module) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(m, h, None) for m in module.modules() for h in hooks)


def structure_key(module: torch.nn.Module) -> tuple[Any, ...]:
    """What the block's code and state look like, apart from plain attributes (those are checked as read)."""
    parts: list[Any] = []
    for rel, m in module.named_modules():
        parts.append((rel, type(m), _forward_of(m)))
    for rel, t in (*module.named_parameters(), *module.named_buffers()):
        parts.append((rel, tuple(t.shape), t.stride(), t.dtype, t.requires_grad, isinstance(t, torch.nn.Parameter)))
    return tuple(parts)


def _forward_of(m: torch.nn.Module) -> Any:
    """The function ``m.forward`` runs (the original one while ``opaque_blocks`` or ``computing_in`` replaced it)."""
    f = m.__dict__.get("forward", type(m).forward)
    while hasattr(f, "original"):  # also under ``fxpar.mixed_precision``'s casting forward
        f = f.original
    return getattr(f, "__func__", f)


@contextmanager
def opaque_blocks(table: BlockTable, fake_mode: Any, detach: bool = False) -> Iterator[None]:
    """Inside: every block of ``table`` is called as ``fxpar::block`` (its forward replaced on the instance).

    ``detach``: the blocks' parameters and buffers are taken off them too (``table.detached`` lists them), so the
    export neither lifts nor passes them: a call takes only its activations (``fxpar.block_state`` puts them back
    into the joint graph). They are back on the block whenever its code runs (its one fake run per variant).
    """
    patched = []
    try:
        for path, module in table.blocks.items():
            had = "forward" in module.__dict__
            state = BlockState(module) if detach else None
            module.forward = _opaque_forward(table, path, module, module.forward, fake_mode, state)
            patched.append((module, had, state))
            if state is not None:
                table.detached[path] = state
                state.take_off()
        yield
    finally:
        for module, had, state in patched:
            if state is not None:
                state.put_back()
            if had:
                module.forward = module.forward.original  # type: ignore[attr-defined]
            else:
                del module.forward


def _opaque_forward(table: BlockTable, path: str, module: torch.nn.Module, forward: Callable[..., Any],
                    fake_mode: Any, state: BlockState | None = None) -> Callable[..., Any]:
    structure = structure_key(module)  # the module does not change while it is exported

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():  # reading metadata: not for export's torch-function modes to record
            flat, in_spec = pytree.tree_flatten((args, kwargs))
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            constants = tuple(TENSOR if isinstance(x, torch.Tensor) else x for x in flat)
            params = state.params if state else dict(module.named_parameters())
            buffers = state.buffers if state else dict(module.named_buffers())
            templates = _tensor_keys(tensors)
            if any(isinstance(x, torch.nn.Module) for x in constants):  # its code and state are not the block's
                raise NotShared(f"{path} is passed a module")
            key = (structure, str(in_spec), tuple("TENSOR" if x is TENSOR else value_key(x) for x in constants),
                   templates, _global_state())
        variant, run = _known_run(table, key, module)
        if run is None:
            with state.on() if state else nullcontext():
                out_leaves, out_spec, reads = _fake_run(module, forward, fake_mode, args, kwargs, tensors)
            variant, run = _record_run(table, key, _Run(reads, out_spec, tuple(
                TENSOR if isinstance(x, torch.Tensor) else x for x in out_leaves), tuple(
                (tuple(t.shape), t.stride(), t.dtype) for t in out_leaves if isinstance(t, torch.Tensor))))
        site = Site(next(_site_ids), path, module, in_spec, constants, len(tensors), tuple(params), tuple(buffers),
                    run.out_spec, run.out_constants, templates, (*key, variant), run.reads)
        table.sites[site.id] = site
        _OUT_META[site.id] = run.out_meta

        def issue() -> list[torch.Tensor]:
            return list(block_call(site.id, [*tensors, *_state_inputs(module, state, params, buffers)]))

        outs = iter(table.route(site, tensors, issue) if table.route is not None else issue())
        return pytree.tree_unflatten([next(outs) if c is TENSOR else c for c in site.out_constants], run.out_spec)

    call.original = forward  # type: ignore[attr-defined]
    return call


def _state_inputs(module: torch.nn.Module, state: BlockState | None, params: dict[str, torch.Tensor],
                  buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The block's own tensors a call passes: all of them; detached, only its token (read from the module now:
    the export traces the tensor it put there)."""
    if state is None:
        return (*params.values(), *buffers.values())
    return (raw_parameter(module, state.token),) if state.token else ()


@dataclass(frozen=True)
class _Run:
    """What one fake run of a block showed: the plain attributes its code read and its outputs' structure."""

    reads: dict[tuple[str, ...], Any]  # what its code read -> the value's key (``fxpar.block_reads``)
    out_spec: Any
    out_constants: tuple[Any, ...]  # the flat output leaves, TENSOR where a tensor goes
    out_meta: tuple[tuple[Any, ...], ...]  # shape, stride, dtype of each output tensor


def _global_state() -> tuple[Any, ...]:
    """The global modes a block's code may branch on."""
    return (torch.is_grad_enabled(), torch.is_autocast_enabled(), torch.is_inference_mode_enabled())


def _known_run(table: BlockTable, key: tuple[Any, ...], module: torch.nn.Module) -> tuple[int, _Run | None]:
    """An earlier run with the same ``key`` whose reads (``fxpar.block_reads``) hold the same values now: the
    block's code depends on nothing else, so this call would run the same way (its fake run is skipped)."""
    runs = table._runs.get(key, [])
    for i, run in enumerate(runs):
        if reads_hold(module, run.reads):
            return i, run
    return len(runs), None


def _record_run(table: BlockTable, key: tuple[Any, ...], run: _Run) -> tuple[int, _Run]:
    """Which set of read-attribute values this run has among the runs with the same ``key`` (0, 1, ...)."""
    values = _reads_key(run.reads)
    runs = table._runs.setdefault(key, [])
    for i, known in enumerate(runs):
        if _reads_key(known.reads) == values:
            return i, known
    runs.append(run)
    return len(runs) - 1, run


def _reads_key(reads: dict[tuple[str, ...], Any]) -> tuple[Any, ...]:
    return tuple(sorted(reads.items()))


def _fake_run(module: torch.nn.Module, forward: Callable[..., Any], fake_mode: Any, args: Any, kwargs: Any,
              tensors: list[torch.Tensor]) -> tuple[list[Any], Any, dict[tuple[str, ...], Any]]:
    """Run the block once on fresh fake copies of its inputs, outside the trace: its outputs and the plain
    attributes its code read."""
    with disable_proxy_modes_tracing(), fake_mode:
        copies = {id(t): _fresh(t) for t in tensors}
        a, k = pytree.tree_map_only(torch.Tensor, lambda t: copies[id(t)], (args, kwargs))
        with recording_reads(module) as reads:
            out = forward(*a, **k)
    leaves, spec = pytree.tree_flatten(out)
    for x in leaves:
        if isinstance(x, torch.Tensor) and any(x is c for c in copies.values()):
            raise NotShared("a block returns one of its inputs")
        if isinstance(x, torch.Tensor) and x._version > 0:  # functionalization names the whole model's reads of
            raise NotShared("a block returns a tensor it wrote in place")  # it apart from a stitched block's
        if not isinstance(x, (torch.Tensor, *PLAIN)):
            raise NotShared(f"a block returns a {type(x).__name__}")
    return leaves, spec, reads


def _fresh(t: torch.Tensor) -> torch.Tensor:
    # no ``torch.no_grad()`` here: export records every grad-mode switch, even outside the trace, and inlines
    # each such region with a whole-graph recompile (quadratic in layers); a factory op has no history anyway
    x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return x.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else x


def _tensor_keys(tensors: list[torch.Tensor]) -> tuple[Any, ...]:
    first: dict[int, int] = {}
    return tuple((tuple(t.shape), t.stride(), t.dtype, t.requires_grad, first.setdefault(id(t), i),
                  t.storage_offset(), t.device) for i, t in enumerate(tensors))


_BASE_NAME = re.compile(r"_\d+$")


def base_name(name: str) -> str:
    """The name a tracer asked for before ``torch.fx`` numbered it: ``mm_12`` -> ``mm``."""
    return _BASE_NAME.sub("", name)
