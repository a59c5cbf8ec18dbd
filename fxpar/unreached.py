"""Parameters the loss does not reach keep ``.grad`` as it was (``None``), as on the single device.

A model may return outputs the loss never reads (a value head, hidden states, a pooled vector). On one device
autograd never visits the parameters that only those outputs depend on, so their ``.grad`` stays ``None`` and
``torch.optim`` skips them: no weight decay, no moment update. A captured joint graph takes a gradient for every
output, and the step feeds zeros for the ones the loss left out, so those parameters got a zero gradient: AdamW
then decayed them (a silent drift from the single device, 3e-3 after 20 steps at ``weight_decay=0.1``).

The backward is linear in its incoming gradients, so a parameter's gradient that no live incoming gradient reaches
in the joint graph is zero whatever the data: :func:`unreached_params` finds those statically, across pipeline
stages (a boundary whose gradient no live incoming gradient reaches sends zeros). The step still computes and
reduces them (every rank issues the same collectives as the ledger says); only the gradient is not handed over.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.ir import Program

if TYPE_CHECKING:
    from fxpar.compiled import Compiled
    from fxpar.executor import StageRunner, StepExecutor


def decide_unreached(executor: StepExecutor, compiled: Compiled, loss_fn: Callable[..., torch.Tensor],
                     targets: Any) -> None:
    """Before the first training step: which parameters ``loss_fn`` does not reach (``executor.unreached``), and
    the outputs it leaves out, which it must keep leaving out (``executor.dead_outputs``). Decided once."""
    if executor.unreached is not None or not torch.is_grad_enabled():
        return
    dead = loss_dead_outputs(compiled, loss_fn, targets, microbatch_rows(compiled))
    executor.unreached = unreached_params(compiled, dead) if dead else frozenset()
    executor.dead_outputs = frozenset(dead) if executor.unreached else frozenset()


def watch_unreached(compiled: Compiled, runners: dict[int, StageRunner]) -> None:
    """``pm(x)`` then ``loss.backward()`` (one stage): the runner learns, per set of outputs autograd gives no
    gradient, the parameters to hand none (cached per set)."""
    if len(compiled.stages) == 1 and runners:
        runners[0].unreached = functools.lru_cache(functools.partial(unreached_params, compiled))


def reached_from(prog: Program, dead_outputs: Iterable[int]) -> set[str]:
    """Names of ``prog``'s joint-graph nodes that depend on an incoming gradient of an output not in
    ``dead_outputs`` (forward output indices whose gradient is zero)."""
    dead = set(dead_outputs)
    frontier = [prog.node(name) for name, idx in prog.signature.tangents if idx not in dead]
    seen = {n.name for n in frontier}
    while frontier:
        n = frontier.pop()
        for user in n.users:
            if user.name not in seen and user.op != "output":
                seen.add(user.name)
                frontier.append(user)
    return seen


def _unreached_outputs(prog: Program, reached: set[str], what: Iterable[tuple[str, int]]) -> set[str]:
    """Of ``what`` ((name, index in the output node)), the names whose output value no live gradient reaches."""
    outs = prog.graph.output_node().args[0]
    return {name for name, idx in what if not (isinstance(outs[idx], fx.Node) and outs[idx].name in reached)}


def microbatch_rows(compiled: Compiled) -> int | None:
    """The batch rows of one microbatch as captured (global): dim 0 of the first stage's first user input."""
    prog = compiled.stages[0]
    for name in prog.signature.inputs:
        val = prog.node(name).meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            return int(val.shape[0])
    return None


def unreached_params(compiled: Compiled, dead_outputs: Iterable[int]) -> frozenset[str]:
    """Parameters whose gradient is zero in every stage that holds them when the model outputs ``dead_outputs``
    (indices of the last stage's forward outputs) get a zero gradient."""
    dead, reached_anywhere, held = set(dead_outputs), set(), set()
    for s in range(len(compiled.stages) - 1, -1, -1):
        prog = compiled.stages[s]
        reached = reached_from(prog, dead)
        unreached = _unreached_outputs(prog, reached, [(fqn, idx) for fqn, idx in prog.signature.grads])
        held.update(fqn for fqn, _ in prog.signature.grads)
        reached_anywhere.update(fqn for fqn, _ in prog.signature.grads if fqn not in unreached)
        if s == 0:
            break
        zero_inputs = _unreached_outputs(prog, reached, prog.signature.input_grads)
        without_grad = {name for name in prog.signature.inputs} - {name for name, _ in prog.signature.input_grads}
        zero_values = {value for value, name in zip(prog.notes["stage"].received, prog.signature.inputs, strict=False)
                       if name in zero_inputs or name in without_grad}
        sent = compiled.stages[s - 1].notes["stage"].sent
        dead = {i for i, value in enumerate(sent) if value in zero_values}
    return frozenset(held - reached_anywhere)


def loss_dead_outputs(compiled: Compiled, loss_fn: Callable[..., torch.Tensor], targets: Any,
                      global_batch: int | None) -> set[int]:
    """Indices of the model's outputs whose gradient ``loss_fn`` never makes, judged on fake outputs of the global
    shapes (the same answer on every rank) and fake targets of the global batch; ``set()`` (every output taken as
    used) when the loss cannot run on fake tensors (a data-dependent loss)."""
    if global_batch is None:
        return set()
    prog = compiled.stages[-1]
    outs = prog.graph.output_node().args[0][: prog.signature.num_outputs]
    vals = [o.meta.get("val") if isinstance(o, fx.Node) else o for o in outs]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            leaves = [torch.empty(v.shape, dtype=v.dtype, device=v.device).requires_grad_(v.is_floating_point())
                      if isinstance(v, torch.Tensor) else v for v in vals]
            fake_targets = pytree.tree_map_only(torch.Tensor, lambda t: _global_like(t, global_batch), targets)
            outputs = pytree.tree_unflatten(leaves, compiled.out_spec)
            loss = loss_fn(outputs, fake_targets) if targets is not None else loss_fn(outputs)
            wanting = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and leaf.requires_grad]
            grads = torch.autograd.grad(loss, [leaves[i] for i in wanting], allow_unused=True)
    except Exception:  # noqa: BLE001 - a loss fake tensors cannot run: every output counts as used
        return set()
    return {i for i, g in zip(wanting, grads, strict=True) if g is None}


def _global_like(t: torch.Tensor, global_batch: int) -> torch.Tensor:
    """A fake tensor (the fake mode is on) like ``t`` with ``global_batch`` rows."""
    return torch.empty((global_batch, *t.shape[1:]) if t.dim() > 0 else (), dtype=t.dtype, device=t.device)
