"""``fxpar.local_optimizer``: elementwise optimizers over fxpar's DTensor parameters compute on local shards,
bitwise as the DTensor path does, with parameters, gradients and state still DTensors to the user.

One in-process gloo world of one rank (a ``HashStore``, no sockets): the placements below are real DTensor
layouts on a one-rank mesh, which is all the localization checks read. The multi-rank equivalence suite
(``fxpar.testing.equivalence``: AdamW over ``pm.parameters()`` on tp, ZeRO-3's uneven shards, pipelines)
runs through the same path on real gloo ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpar.local_optimizer import ELEMENTWISE, LOCAL_OPTIMIZER_ENV, own_parameter

SHAPES = [(6, 4), (4,), (3, 2, 2)]


@pytest.fixture(scope="module")
def mesh() -> Iterator[DeviceMesh]:
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        if made:
            dist.destroy_process_group()


def _params(mesh: DeviceMesh, placements: list[Any], fxpars: bool = True) -> list[torch.nn.Parameter]:
    """Parameters placed as fxpar places its own (``fxpars``), or as any other DTensor user's."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(DTensor.from_local(torch.randn(s, generator=gen), mesh, [pl], run_check=False))
              for s, pl in zip(SHAPES, placements, strict=True)]
    for p in params:
        if fxpars:
            own_parameter(p)
    return params


def _set_grads(params: list[torch.nn.Parameter], step: int, grad_placements: list[Any] | None = None) -> None:
    """The same gradient values for a step whatever the parameters are (DTensors laid out as each parameter, or
    as ``grad_placements`` say; plain tensors for plain parameters)."""
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen)
        if isinstance(p, DTensor):
            pl = grad_placements[i] if grad_placements else p.placements[0]
            g = DTensor.from_local(g, p.device_mesh, [pl], run_check=False)
        p.grad = g


class _DTensorOps(TorchDispatchMode):
    """Counts the ops called on DTensors (each a DTensor dispatch: sharding propagation, then the local op)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(isinstance(x, DTensor) for x in pytree.tree_leaves((args, kwargs))):
            self.count += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def counting_dtensor_ops() -> Iterator[list[int]]:
    """``[n]``: after the block, how many ops inside were called on DTensors."""
    count = [0]
    with _DTensorOps() as mode:
        yield count
    count[0] = mode.count


def _train(make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], params: list[torch.nn.Parameter],
           steps: int = 3, grad_placements: list[Any] | None = None) -> tuple[torch.optim.Optimizer, int]:
    """``steps`` optimizer steps with fixed gradients; the DTensor ops dispatched by the last step."""
    opt = make(params)
    for step in range(steps):
        _set_grads(params, step, grad_placements)
        with counting_dtensor_ops() as count:
            opt.step()
    return opt, count[0]


def _locals(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _plain(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    """Plain-tensor copies: on a one-rank mesh a local shard is the whole tensor, so these train as the reference."""
    return [torch.nn.Parameter(p._local_tensor.clone()) for p in params]


def _assert_same_training(ours: tuple[list[torch.nn.Parameter], torch.optim.Optimizer],
                          reference: tuple[list[torch.nn.Parameter], torch.optim.Optimizer]) -> None:
    (pa, oa), (pb, ob) = ours, reference
    for x, y in zip(pa, pb, strict=True):
        assert torch.equal(_locals(x), _locals(y))  # bitwise: the same local ops on the same tensors
    for x, y in zip(pa, pb, strict=True):
        sa, sb = oa.state[x], ob.state[y]
        assert sa.keys() == sb.keys()
        for k in sa:
            per_element = sb[k].shape == x.shape and sb[k].dim() > 0
            assert isinstance(sa[k], DTensor) == (per_element or isinstance(sb[k], DTensor)), k  # what the user sees
            assert torch.equal(_locals(sa[k]), _locals(sb[k])), k


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", ELEMENTWISE, ids=lambda c: c.__name__)
def test_elementwise_optimizers_step_on_local_shards_bitwise(mesh: DeviceMesh, cls: type[torch.optim.Optimizer],
                                                            foreach: bool) -> None:
    """Bitwise the plain-tensor optimizer's result (DTensor itself has no rule for Rprop's ``_foreach_copy_``);
    not one op dispatched through DTensor; parameters and per-element state still DTensors."""
    placements = [Shard(0), Replicate(), Shard(1)]

    def make(ps: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        return cls(ps, lr=1e-2, foreach=foreach)

    params = _params(mesh, placements)
    reference = _plain(params)
    opt, ops = _train(make, params)
    ref_opt, _ = _train(make, reference)
    assert ops == 0
    _assert_same_training((params, opt), (reference, ref_opt))
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])


def test_a_gradient_placed_unlike_its_parameter_takes_the_dtensor_path(mesh: DeviceMesh) -> None:
    params = _params(mesh, [Replicate(), Replicate(), Replicate()])
    _, ops = _train(lambda ps: torch.optim.AdamW(ps, lr=1e-2), params,
                    grad_placements=[Shard(0), Replicate(), Replicate()])
    assert ops > 0  # redistributed by DTensor, as without fxpar


def test_the_escape_hatch_dispatches_through_dtensor(mesh: DeviceMesh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCAL_OPTIMIZER_ENV, "0")
    params = _params(mesh, [Replicate()] * 3)
    reference = _plain(params)
    opt, ops = _train(lambda ps: torch.optim.Adam(ps, lr=1e-2), params)
    ref_opt, _ = _train(lambda ps: torch.optim.Adam(ps, lr=1e-2), reference)
    assert ops > 0
    _assert_same_training((params, opt), (reference, ref_opt))


def test_another_librarys_dtensors_are_left_to_dtensor(mesh: DeviceMesh) -> None:
    _, ops = _train(lambda ps: torch.optim.AdamW(ps, lr=1e-2), _params(mesh, [Replicate()] * 3, fxpars=False))
    assert ops > 0


def test_momentum_sgd_is_left_to_dtensor_and_its_state_stays_dtensor(mesh: DeviceMesh) -> None:
    params = _params(mesh, [Shard(0), Replicate(), Replicate()])
    opt, ops = _train(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), params)
    assert ops > 0
    assert all(isinstance(opt.state[p]["momentum_buffer"], DTensor) for p in params)


def test_state_dict_round_trips_after_local_steps(mesh: DeviceMesh) -> None:
    params = _params(mesh, [Shard(0), Replicate(), Shard(1)])
    opt, _ = _train(lambda ps: torch.optim.AdamW(ps, lr=1e-2), params)
    saved = opt.state_dict()
    assert sorted(saved["state"]) == [0, 1, 2]
    assert all(isinstance(saved["state"][i]["exp_avg"], DTensor) for i in range(3))
    fresh = torch.optim.AdamW(params, lr=1e-2)
    fresh.load_state_dict(saved)
    _set_grads(params, 7)
    before = [p._local_tensor.clone() for p in params]
    with counting_dtensor_ops() as count:
        fresh.step()  # the restored optimizer's first step already runs on local shards
    assert count[0] == 0
    assert all(not torch.equal(b, p._local_tensor) for b, p in zip(before, params, strict=True))
