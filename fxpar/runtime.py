"""ParallelModule: runs one rank's lowered forward and backward graphs.

Parameters are DTensors (so optimizers, ``state_dict`` and DCP work unchanged); compute runs
on their local shards through the generated graphs, with explicit collectives inside them.
No DTensor dispatch happens in the step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, distribute_tensor

from fxpar.backends.comm import bind_groups
from fxpar.ir import Program
from fxpar.lower import LedgerRow, RankProgram, lower


class _RankStep(torch.autograd.Function):
    """Forward graph in ``forward``; backward graph, fed the saved values, in ``backward``."""

    @staticmethod
    def forward(ctx: Any, runner: _Runner, *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        results = runner.forward(*flat)
        n = runner.num_outputs
        ctx.runner, ctx.saved = runner, results[n:]
        ctx.n_inputs = len(flat)
        return tuple(results[:n])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        runner = ctx.runner
        tangents = [grads[idx] if grads[idx] is not None else torch.zeros_like(runner.out_like[idx])
                    for idx in runner.tangent_outputs]
        param_grads = runner.backward(*ctx.saved, *tangents)
        ctx.saved = None
        out: list[torch.Tensor | None] = [None] * ctx.n_inputs
        for pos, out_idx in runner.grad_positions:
            out[pos] = param_grads[out_idx - runner.num_outputs]
        return (None, *out)


class _Runner:
    """The bound graphs of one rank and how their inputs/outputs map to the module."""

    def __init__(self, prog: Program, rp: RankProgram, names: dict[str, str]) -> None:
        self.forward: fx.GraphModule = bind_groups(rp.forward, names)
        self.backward: fx.GraphModule = bind_groups(rp.backward, names)
        sig = prog.signature
        self.num_outputs = sig.num_outputs
        self.tangent_outputs = [idx for _, idx in sig.tangents]
        order = [name for _, name in sig.params]
        fqn_pos = {fqn: order.index(name) for fqn, name in sig.params}
        self.grad_positions = [(fqn_pos[fqn], out_idx) for fqn, out_idx in sig.grads]
        self.out_like: list[torch.Tensor] = []


class ParallelModule(torch.nn.Module):
    """The model compiled for one rank of a mesh. Call it with this rank's shard of the batch."""

    def __init__(self, prog: Program, model: torch.nn.Module | None, rank: int | None) -> None:
        super().__init__()
        self._prog = prog
        self._programs: dict[int, RankProgram] = {}
        self._runner: _Runner | None = None
        self._rank = rank
        self.timings: dict[str, float] = dict(prog.notes.get("timings", {}))
        if rank is not None and model is not None:
            self._materialize(model)

    # -- inspection --------------------------------------------------------------------------
    @property
    def mesh(self):  # noqa: ANN201 - fxpar.Mesh
        return self._prog.mesh

    def rank_program(self, rank: int) -> RankProgram:
        """The lowered program of ``rank`` (built on first use and cached)."""
        if rank not in self._programs:
            self._programs[rank] = lower(self._prog, rank)
        return self._programs[rank]

    def program(self, rank: int = 0, verbosity: int = 1) -> str:
        """The rank's forward and backward programs as readable, runnable Python."""
        from fxpar.printer import print_rank_program

        return print_rank_program(self._prog, self.rank_program(rank), verbosity)

    def ledger(self, rank: int = 0) -> list[LedgerRow]:
        """Every collective the rank issues in one step, with its bytes (see ``ledger_table``)."""
        return list(self.rank_program(rank).ledger)

    def ledger_table(self, rank: int = 0) -> str:
        from fxpar.printer import ledger_table

        return ledger_table(self.ledger(rank))

    def output_placements(self) -> list[Any]:
        """Placements (one per mesh axis) of each forward output, as this rank returns them."""
        out = self._prog.graph.output_node()
        return list(self._prog.arg_placements[out.name][: self._prog.signature.num_outputs])

    def executed_graphs(self) -> tuple[fx.GraphModule, fx.GraphModule]:
        """The forward and backward graphs this rank runs, with process groups bound.

        Editing them (then ``recompile()``) changes what runs: fault-injection tests use this.
        """
        if self._runner is None:
            raise RuntimeError("this ParallelModule was compiled for a fake mesh (or no rank): it has no bound graphs")
        return self._runner.forward, self._runner.backward

    def save(self, folder: str) -> list[str]:
        """Write each rank's program as a standalone Python file plus ``manifest.json``."""
        from fxpar.backends.emit import save_programs

        return save_programs(self, folder)

    # -- execution ----------------------------------------------------------------------------
    def _materialize(self, model: torch.nn.Module) -> None:
        mesh = self._prog.mesh
        dm = mesh.device_mesh()
        on_cuda = mesh.device == "cuda"
        device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
        state = dict(model.named_parameters())
        for fqn, name in self._prog.signature.params:
            p = state[fqn]
            if p.is_meta:
                raise ValueError(f"parameter {fqn!r} is on the meta device: initialize it before running")
            placements = self._prog.placements[name]
            dt = distribute_tensor(p.detach().to(device), dm, list(placements))
            _register_path(self, fqn, torch.nn.Parameter(dt, requires_grad=p.requires_grad))
        buffers = dict(model.named_buffers())
        self._buffers_local = [buffers[fqn].detach().to(device) for fqn, _ in self._prog.signature.buffers]
        rp = self.rank_program(self._rank)
        names = {sym: dm.get_group(sym.split("[")[0]).group_name for sym in rp.groups}
        self._runner = _Runner(self._prog, rp, names)

    def forward(self, *inputs: Any) -> Any:
        if self._runner is None:
            raise RuntimeError("this ParallelModule was compiled for a fake mesh (or no rank): it cannot run")
        params = [self.get_parameter(fqn) for fqn, _ in self._prog.signature.params]
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        flat_inputs = [x for x in pytree.tree_leaves(inputs) if isinstance(x, torch.Tensor)]
        outs = _RankStep.apply(self._runner, *local, *self._buffers_local, *flat_inputs)
        self._runner.out_like = [o.detach() for o in outs]
        return pytree.tree_unflatten(list(outs), self._prog.signature.out_spec)


def _register_path(root: torch.nn.Module, fqn: str, param: torch.nn.Parameter) -> None:
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part) or not isinstance(getattr(mod, part), torch.nn.Module):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    mod.register_parameter(leaf, param)

