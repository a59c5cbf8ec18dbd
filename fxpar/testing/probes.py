"""Rank bodies that measure what a real step holds, for tests that compare them with predictions.

Module-level functions so the rank pool can run them (``default_pool().run(fn, world, ...)``). Each builds its
module with ``parallelize_once`` (rank 0 compiles for all; ``fxpar.testing.compile_once``): what they measure is
the step, not the compile, which ``tests/test_run.py`` and ``tests/test_launch.py`` run on every launched rank.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fxpar.testing.compile_once import parallelize_once


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: list[torch.Tensor], exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (each counted once), minus those in ``exclude``."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in exclude:
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def built_for_steps(model_fn: Any, mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor,
                    loss_fn: Any) -> tuple[Any, torch.Tensor, torch.optim.Optimizer]:
    """Rank body helper: (this rank's module compiled once on rank 0, its dp shard of ``tokens``, AdamW over it)."""
    import fxpar

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(model_fn, mesh, (tokens,), plan, loss_fn=loss_fn)
    dp = mesh_axes.get("dp", 1)
    local = tokens.chunk(dp)[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] if dp > 1 else tokens
    return pm, local, torch.optim.AdamW(pm.parameters(), lr=1e-3)


def measured_memory(model_fn: Any, mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor,
                    loss_fn: Any) -> dict[str, Any]:
    """Rank body: one ``pm.step`` plus an AdamW step, then the local storage of params, grads and Adam state, of
    ZeRO-1/2's gathered working copies, and of the values one forward of this rank's first stage saves for backward;
    the peak the step held between graphs (``watching_what_is_held``); with ``pm.memory(rank)``."""
    rank = dist.get_rank()
    pm, local, opt = built_for_steps(model_fn, mesh_axes, plan, tokens, loss_fn)
    with watching_what_is_held(pm, [local]) as held:
        pm.step(local, local)
    opt.step()
    params = [_local(p) for p in pm.parameters()]
    state = [_local(v) for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    first = min(pm._runners)
    runner = pm._runners[first]
    saved_bytes = None
    pm.gather_params()  # ZeRO-1/2: the step's working copies, as pm.step gathers them
    working_copy = storage_bytes(list(pm._gathered.values()))
    pm.release_params()
    if first == 0:  # the first stage runs on the user's inputs alone: one forward of microbatch 0
        mb = local.chunk(pm._compiled.microbatches)[0]
        bufs = pm.stage_buffers(first)
        with torch.no_grad():
            pm.gather_params()  # ZeRO-1/2: the step's working copies (ZeRO-3 gathers inside the graph)
            inputs = [pm.local_param(f) for f in runner.param_fqns]
            results = runner.forward(*inputs, *bufs, mb)
            pm.release_params()
        saved = [t for t in results[runner.num_outputs:] if isinstance(t, torch.Tensor)]
        saved_bytes = storage_bytes(saved, {t.untyped_storage().data_ptr() for t in [*inputs, *bufs, mb]})
    return {"predicted": pm.memory(rank), "params": storage_bytes(params),
            "grads": storage_bytes([_local(p.grad) for p in pm.parameters() if p.grad is not None]),
            "optimizer": storage_bytes(state),
            "saved_per_microbatch": saved_bytes, "working_copy": working_copy, "held": held[0],
            "buffers": storage_bytes(list(pm.buffers())),
            "in_flight": pm.schedule.peak_in_flight()[pm._compiled.pp_coord(rank)]}


def grad_storage_after_backward(model_fn: Any, mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor,
                                loss_fn: Any) -> tuple[int, int]:
    """Rank body: ``loss_fn(pm(x), x).backward()`` (autograd's path, not ``pm.step``), then the bytes of the distinct
    storages behind the local gradients and behind the local parameters."""
    import fxpar

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(model_fn, mesh, (tokens,), plan)
    dp = mesh_axes.get("dp", 1)
    local = tokens.chunk(dp)[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] if dp > 1 else tokens
    loss_fn(pm(local), local).backward()
    params = [p for p in pm.parameters() if p.grad is not None]
    return storage_bytes([_local(p.grad) for p in params]), storage_bytes([_local(p) for p in params])


def _train(pm: Any, opt: Any, mesh: Any, tokens: torch.Tensor, steps: int) -> list[float]:
    rank = dist.get_rank()
    dp = mesh.axes.get("dp", 1)
    local = tokens.chunk(dp)[mesh.coord(rank)[mesh.axis_index("dp")]] if dp > 1 else tokens
    losses = []
    for _ in range(steps):
        losses.append(pm.step(local, local).item())
        opt.step()
        opt.zero_grad()
    return losses


def checkpoint_round(folder: str, save: bool, model_fn: Any, mesh_axes: dict[str, int], plan: Any,
                     tokens: torch.Tensor, loss_fn: Any, steps_before: int, steps_after: int) -> dict[str, Any]:
    """Rank body: build ``pm`` on ``mesh_axes``; either train ``steps_before`` AdamW steps and DCP-save the model and
    optimizer state to ``folder`` (``save``), or DCP-load them from ``folder``; then train ``steps_after`` steps.

    Returns the full parameter tensors right after the save or load, and the losses of the steps after it.
    """
    import fxpar
    from fxpar import checkpoint

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(model_fn, mesh, (tokens,), plan, loss_fn=loss_fn)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    if save:
        _train(pm, opt, mesh, tokens, steps_before)
        checkpoint.save(pm, opt, folder)
    else:
        checkpoint.load(pm, opt, folder)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in pm.named_parameters()}
    return {"params": full, "losses": _train(pm, opt, mesh, tokens, steps_after)}


def fp8_step(config: Any, mesh_axes: dict[str, int], plan: Any, x: torch.Tensor) -> dict[str, Any]:
    """Rank body: the bundled Llama MLP (``config``, seed 0) under ``plan`` on ``mesh_axes``, one forward on this
    rank's dp piece of ``x`` and a backward of ``mean(out ** 2)``; the full output (dp pieces gathered) and full
    parameter gradients (DTensors gathered)."""
    import fxpar
    from fxpar.models.llama import MLP

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(functools.partial(MLP, config), mesh, (x,), plan)
    dp = mesh_axes.get("dp", 1)
    local = x.tensor_split(dp)[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] if dp > 1 else x
    out = pm(local)
    out.pow(2).mean().backward()
    if dp > 1:  # the dp pieces, in dp order, from the ranks at the first coordinate of every other axis
        pieces = [torch.empty_like(out) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, out.detach().contiguous())
        ax = mesh.axis_index("dp")
        firsts = [r for r in range(mesh.size) if all(c == 0 for i, c in enumerate(mesh.coord(r)) if i != ax)]
        out = torch.cat([pieces[r] for r in sorted(firsts, key=lambda r: mesh.coord(r)[ax])])
    grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in
             pm.named_parameters()}
    return {"output": out.detach(), "grads": grads}


def llama_losses(mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor, steps: int) -> list[float]:
    """Rank body: the bundled 2-layer Llama (seed 0) trained ``steps`` AdamW steps with ``pm.step``; the losses."""
    import fxpar
    from fxpar.models.llama import llama
    from fxpar.testing.error_models import next_token_loss

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(functools.partial(llama, n_layers=2), mesh, (tokens,), plan, loss_fn=next_token_loss)
    return _train(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), mesh, tokens, steps)


def backward_halves_against_whole(mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor) -> dict[str, Any]:
    """Rank body: one ``pm.step`` of the bundled 2-layer Llama (seed 0) compiled twice, with a sent input
    gradient's backward in halves (the default) and whole (``FXPAR_BACKWARD_HALVES=0``): each one's step event
    kinds, and the largest difference between their losses and gradients."""
    import os

    import fxpar
    from fxpar.compiled import HALVES_ENV
    from fxpar.models.llama import llama
    from fxpar.testing.error_models import next_token_loss

    mesh = fxpar.Mesh(mesh_axes)
    local = tokens.chunk(mesh.axes.get("dp", 1))[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] \
        if "dp" in mesh.axes else tokens
    runs = {}
    for halves in ("1", "0"):
        os.environ[HALVES_ENV] = halves
        try:
            torch.manual_seed(0)
            pm = parallelize_once(functools.partial(llama, n_layers=2), mesh, (tokens,), plan,
                                  loss_fn=next_token_loss)
        finally:
            del os.environ[HALVES_ENV]
        loss = pm.step(local, local)
        runs[halves] = (pm, loss, {n: _local(p.grad).clone() for n, p in pm.named_parameters()})
    (halved, loss_h, grads_h), (whole, loss_w, grads_w) = runs["1"], runs["0"]
    return {"kinds_halves": [e.kind for e in halved.step_events()],
            "kinds_whole": [e.kind for e in whole.step_events()],
            "loss_diff": abs(loss_h.item() - loss_w.item()),
            "grad_diff": max((grads_h[n] - grads_w[n]).abs().max().item() for n in grads_h)}


def held_during_step(mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor) -> dict[str, int]:
    """Rank body: one ``pm.step`` of the bundled 2-layer Llama (seed 0); the most the step held at once, counted
    before each event, of the last stage's output gradients (the logits' gradient for a language model) and of
    the forward and backward sends not yet awaited."""
    import fxpar
    from fxpar.models.llama import llama
    from fxpar.testing.error_models import next_token_loss

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(functools.partial(llama, n_layers=2), mesh, (tokens,), plan, loss_fn=next_token_loss)
    executor = pm.step_executor()
    dispatch, most = executor.dispatch, {"output_grads": 0, "forward_sends": 0, "backward_sends": 0}

    def counting(e: Any, st: Any, *args: Any) -> None:
        most["output_grads"] = max(most["output_grads"], len(st.output_grads))
        most["forward_sends"] = max(most["forward_sends"], len(st.forward_sends))
        most["backward_sends"] = max(most["backward_sends"], len(st.sends))
        dispatch(e, st, *args)

    executor.dispatch = counting
    pm.step(tokens, tokens)
    return most


def gloo_apis_against_each_other(mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor) -> dict[str, Any]:
    """Rank body: two ``pm.step``s and AdamW steps of the bundled 2-layer Llama (seed 0) from one compile, its
    collectives run through the classic ``torch.distributed`` API (the gloo default) and through the functional ops
    (``FXPAR_GLOO_COLLECTIVES=functional``): the losses and gradients of each, and the collectives each issued
    through the classic API."""
    import os

    import fxpar
    from fxpar.backends import classic
    from fxpar.models.llama import llama
    from fxpar.testing.error_models import next_token_loss

    mesh = fxpar.Mesh(mesh_axes)
    dp = mesh.axes.get("dp", 1)
    local = tokens.chunk(dp)[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] if dp > 1 else tokens
    runs: dict[str, Any] = {}
    for setting in ("classic", "functional"):
        os.environ[classic.GLOO_COLLECTIVES_ENV] = setting
        issued = classic.issued()
        try:
            torch.manual_seed(0)
            pm = parallelize_once(functools.partial(llama, n_layers=2), mesh, (tokens,), plan,
                                  loss_fn=next_token_loss)
            losses = _train(pm, torch.optim.AdamW(pm.parameters(), lr=1e-3), mesh, tokens, 2)
            losses.append(pm.step(local, local).item())  # its gradients are compared below
        finally:
            del os.environ[classic.GLOO_COLLECTIVES_ENV]
        runs[setting] = {"losses": losses, "grads": {n: _local(p.grad).clone() for n, p in pm.named_parameters()},
                         "issued": classic.issued() - issued, "pending": classic.pending()}
    return runs


def clipped_against_single_device(mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor, tie: bool,
                                  max_norm: float) -> dict[str, float]:
    """Rank body: one ``pm.step`` of the bundled 4-layer Llama (seed 0; ``tie``: tied embeddings), then
    ``pm.clip_grad_norm_(max_norm)``, against the single-device model clipped by
    ``torch.nn.utils.clip_grad_norm_``: both norms, and the largest gradient difference after clipping relative to
    the gradient's largest entry."""
    import fxpar
    from fxpar.models.llama import llama
    from fxpar.testing.error_models import next_token_loss

    torch.manual_seed(0)
    reference = llama(n_layers=4, tie_embeddings=tie)
    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(functools.partial(llama, n_layers=4, tie_embeddings=tie), mesh, (tokens,), plan,
                          loss_fn=next_token_loss)
    dp = mesh.axes.get("dp", 1)
    local = tokens.chunk(dp)[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] if dp > 1 else tokens
    pm.step(local, local)
    norm = pm.clip_grad_norm_(max_norm)
    next_token_loss(reference(tokens), tokens).backward()
    want = torch.nn.utils.clip_grad_norm_(list(reference.parameters()), max_norm)
    grads = dict(reference.named_parameters())
    worst = 0.0
    for name, p in pm.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ref = grads[name].grad
        worst = max(worst, ((g - ref).abs().max() / ref.abs().max()).item())
    return {"norm": norm.item(), "want": want.item(), "grad_diff": worst}


def generator_states_after_build(mesh_axes: dict[str, int], tokens: torch.Tensor) -> list[bool]:
    """Rank body: build the bundled Llama with dropout, seed each rank's generator differently (as a script seeding
    per rank would), build its ParallelModule, and report for every rank whether its default generator's state
    equals this rank's (``fxpar.random_draws.sync_generators``)."""
    import fxpar

    pm = parallelize_once(_llama_with_dropout_then_seed_per_rank, fxpar.Mesh(mesh_axes), (tokens,))
    del pm
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, torch.get_rng_state())
    return [bool(torch.equal(s, states[dist.get_rank()])) for s in states]


def _llama_with_dropout_then_seed_per_rank() -> torch.nn.Module:
    from fxpar.models.llama import llama

    torch.manual_seed(0)
    model = llama(n_layers=2, dropout=0.1)
    torch.manual_seed(1000 + dist.get_rank())
    return model


def running_statistics_after_a_step(images: torch.Tensor, labels: torch.Tensor, folder: str) -> dict[str, Any]:
    """Rank body: one dp=2 ``pm.step`` of the tiny ResNet, then ``fxpar.checkpoint.save`` into ``folder``; whether
    the user's model kept its buffers, the module's own running statistics moved and are in its ``state_dict``,
    its step counter, and every buffer it holds (lists)."""
    import fxpar
    import fxpar.checkpoint
    from fxpar.testing.user_models import tiny_resnet

    torch.manual_seed(0)
    model = tiny_resnet()
    before = {name: b.clone() for name, b in model.named_buffers()}
    mesh = fxpar.Mesh({"dp": 2})
    pm = fxpar.parallelize(model, mesh, (images,), loss_fn=torch.nn.functional.cross_entropy)
    r = dist.get_rank()
    pm.step(images.chunk(2)[r], labels.chunk(2)[r])
    held = dict(pm.named_buffers())
    fxpar.checkpoint.save(pm, None, folder)
    return {"model_untouched": all(torch.equal(b, before[name]) for name, b in model.named_buffers()),
            "in_state_dict": "stem.1.running_mean" in pm.state_dict(),
            "counter": int(held["stem.1.num_batches_tracked"]),
            "moved": not torch.equal(held["stem.1.running_var"], before["stem.1.running_var"]),
            "buffers": {name: b.tolist() for name, b in held.items()}}


def warnings_of_a_padded_loss(inputs: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> list[str]:
    """Rank body: one dp=2 ``pm.step`` of a small regression head with an eager cross-entropy ``loss_fn`` whose
    targets hold ``ignore_index`` unevenly across the ranks; the ``FxparWarning`` messages it raised."""
    import warnings

    import fxpar

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(inputs.shape[1], 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    loss_fn = functools.partial(torch.nn.functional.cross_entropy, ignore_index=ignore_index)
    pm = fxpar.parallelize(model, fxpar.Mesh({"dp": 2}), (inputs,), loss_fn=loss_fn)
    rank = dist.get_rank()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.step(inputs.chunk(2)[rank], targets.chunk(2)[rank])
        pm.step(inputs.chunk(2)[rank], targets.chunk(2)[rank])
    return [str(w.message) for w in caught if issubclass(w.category, fxpar.FxparWarning)]


def warnings_of_a_loss(inputs: torch.Tensor, loss_fn: Any, axes: dict[str, int], microbatches: int) -> list[str]:
    """Rank body: two ``pm.step`` of a small encoder with ``loss_fn`` on ``axes`` (dp shards the batch) and
    ``microbatches``; the ``FxparWarning`` messages they raised."""
    import warnings

    import fxpar

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(inputs.shape[1], 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
    pm = fxpar.parallelize(model, fxpar.Mesh(axes), (inputs,), plan=fxpar.Plan(microbatches=microbatches),
                           loss_fn=loss_fn)
    dp = axes.get("dp", 1)
    mine = inputs.chunk(dp)[dist.get_rank() % dp]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.step(mine)
        pm.step(mine)
    return [str(w.message) for w in caught if issubclass(w.category, fxpar.FxparWarning)]


# what a step holds between graphs that ``pm.memory(rank).activations`` counts (ZeRO-2/3's unreduced gradients of one
# backward, reduce-scattered right after it, count in ``transient``)
_STEP_FIELDS = ("inbox", "outputs", "saved", "tangents", "input_grads", "stash", "output_grads", "sends",
                "forward_sends")


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def held_between_events(model_fn: Any, mesh_axes: dict[str, int], plan: Any, tokens: torch.Tensor,
                        loss_fn: Any) -> tuple[int, int]:
    """Rank body: one ``pm.step`` watched by ``watching_what_is_held``; returns (``pm.memory(rank).activations``,
    the peak it measured)."""
    import fxpar

    torch.manual_seed(0)
    mesh = fxpar.Mesh(mesh_axes)
    pm = parallelize_once(model_fn, mesh, (tokens,), plan, loss_fn=loss_fn)
    dp = mesh_axes.get("dp", 1)
    local = tokens.chunk(dp)[mesh.coord(dist.get_rank())[mesh.axis_index("dp")]] if dp > 1 else tokens
    with watching_what_is_held(pm, [local]) as peak:
        pm.step(local, local)
    return pm.memory(dist.get_rank()).activations, peak[0]


@contextlib.contextmanager
def watching_what_is_held(pm: Any, inputs: list[torch.Tensor]) -> Iterator[list[int]]:
    """Inside, ``pm``'s steps are watched: the yielded ``[peak]`` becomes the largest total, over the step's events, of
    the distinct storages its state holds between graphs (received and sent values, saved sets, stashes, gradients
    in transit and the buffers of sends not yet awaited, the last stage's output gradients; each event counts what
    it held before and after it), beside the parameters, the buffers, ``inputs`` and ZeRO-1/2's working copies."""
    from fxpar import executor

    skip = {t.untyped_storage().data_ptr() for t in [*map(_local, pm.parameters()), *pm.buffers(), *inputs]}
    peak = [0]
    sending: dict[int, torch.Tensor] = {}  # a send's buffer, by its work (gloo holds it until the work completes)

    def isend(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = executor_isend(tensor, *args, **kwargs)
        sending[id(work)] = tensor
        return work

    def held(st: Any) -> dict[int, int]:
        found = [t for f in _STEP_FIELDS for t in _tensors(getattr(st, f))]
        found += [sending[id(w)] for works in [*st.sends.values(), *st.forward_sends.values()] for w in works]
        working = {t.untyped_storage().data_ptr() for t in pm._gathered.values()}  # ZeRO-1/2: counted in params
        return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found
                if t.untyped_storage().data_ptr() not in skip | working}

    stepper = pm.step_executor()
    dispatch, executor_isend = stepper.dispatch, executor.dist.isend

    def watched(e: Any, st: Any, *args: Any) -> None:
        before = held(st)
        dispatch(e, st, *args)
        peak[0] = max(peak[0], sum({**before, **held(st)}.values()))

    stepper.dispatch, executor.dist.isend = watched, isend
    try:
        yield peak
    finally:
        del stepper.dispatch
        executor.dist.isend = executor_isend
