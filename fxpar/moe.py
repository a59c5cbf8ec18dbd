"""Expert parallelism: HF experts modules as one op, and the pieces its ``ep`` lowering routes tokens with.

On a mesh with an ``ep`` axis, capture traces every Hugging Face experts module (``is_hf_experts``) as one op,
``fxpar::moe_experts(x [T, H], top_k_index [T, k], top_k_weights [T, k], gate_up_proj [E, 2I, H],
down_proj [E, H, I], act) -> [T, H]``, with ``fxpar::moe_experts_backward`` as its gradient. Each token's row of the
output is ``sum_j w[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t]))`` over its ``k`` experts ``e``: HF's
experts math (every implementation: eager, ``grouped_mm``, ``batched_mm``), with no capacity and no dropped token.

``fxpar.lower`` lowers the op on ``ep`` as torchtitan and Megatron do (each ep rank holds ``E / ep`` experts and
its own tokens):

1. ``moe_route``: sort this rank's ``T * k`` (token, expert) pairs by expert and count them per expert;
2. all-to-all the counts, so each rank learns how many rows every other rank sends each of its experts;
3. ``moe_dispatch`` (each pair's token row, in expert order), then all-to-all the rows; the split sizes are the
   counts summed per destination rank (data-dependent: the all-to-all's split sizes, no padding);
4. ``expert_mlp`` on the received rows with the rank's own experts;
5. all-to-all the results back, and ``moe_combine`` (each token's ``k`` rows weighted by its routing weights).

The backward runs the same route in reverse with the forward's split sizes: ``moe_combine_backward``, all-to-all,
``expert_mlp_backward``, all-to-all, ``moe_dispatch_backward``. The single-device op is the same pieces with one
rank, so the two compute the same sums per expert row.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fxpar.errors import PlanError
from fxpar.rules.token_local import is_hf_experts

aten = torch.ops.aten

# activations HF configs name (``hidden_act``) -> the gradient of each, given the output gradient and the input
ACTIVATION_GRADS = {
    "silu": lambda g, x: aten.silu_backward(g, x),
    "swish": lambda g, x: aten.silu_backward(g, x),
    "gelu": lambda g, x: aten.gelu_backward(g, x),
    "gelu_pytorch_tanh": lambda g, x: aten.gelu_backward(g, x, approximate="tanh"),
    "relu": lambda g, x: aten.threshold_backward(g, x, 0),
}


def _activation(name: str):  # noqa: ANN202  (a transformers activation module)
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _expert_of_rows(counts: torch.Tensor, num_local: int) -> torch.Tensor:
    """Each row's local expert when rows come in blocks (one per source rank) of ``num_local`` expert groups."""
    experts = torch.arange(num_local, device=counts.device).repeat(counts.numel() // num_local)
    return torch.repeat_interleave(experts, counts.to(torch.long))


def _expert_rows(counts: torch.Tensor, num_local: int) -> list[tuple[int, torch.Tensor]]:
    """``(expert, row indices)`` of every local expert that has rows."""
    expert = _expert_of_rows(counts, num_local)
    groups = [(e, (expert == e).nonzero().squeeze(1)) for e in range(num_local)]
    return [(e, rows) for e, rows in groups if rows.numel()]


@torch.library.custom_op("fxpar::expert_mlp", mutates_args=())
def expert_mlp(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, act: str) -> torch.Tensor:
    """The gated MLP of expert ``e`` on each row of ``x [R, H]``: ``w2[e] @ (act(gate) * up)``, ``gate, up`` the two
    halves of ``w1[e] @ x``. Rows come in blocks of ``w1.shape[0]`` expert groups; ``counts`` (flat ``[blocks *
    experts]``) holds each group's row count."""
    act_fn = _activation(act)
    out = x.new_zeros(x.shape[0], w2.shape[1])
    for e, rows in _expert_rows(counts, w1.shape[0]):
        gate, up = torch.nn.functional.linear(x[rows], w1[e]).chunk(2, dim=-1)
        out[rows] = torch.nn.functional.linear(act_fn(gate) * up, w2[e])
    return out


@expert_mlp.register_fake
def _expert_mlp_fake(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                     act: str) -> torch.Tensor:
    return x.new_empty((x.shape[0], w2.shape[1]))


@torch.library.custom_op("fxpar::expert_mlp_backward", mutates_args=())
def expert_mlp_backward(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                        w2: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``expert_mlp`` for ``x``, ``w1`` and ``w2``. The experts' hidden rows are recomputed here rather
    than saved (they are ``2I / H`` times the input rows)."""
    act_fn, act_grad = _activation(act), ACTIVATION_GRADS[act]
    gx, g1, g2 = torch.zeros_like(x), torch.zeros_like(w1), torch.zeros_like(w2)
    for e, rows in _expert_rows(counts, w1.shape[0]):
        xe, ge = x[rows], grad[rows]
        gate, up = torch.nn.functional.linear(xe, w1[e]).chunk(2, dim=-1)
        a = act_fn(gate)
        g2[e] = ge.t() @ (a * up)
        gm = ge @ w2[e]
        gh = torch.cat([act_grad(gm * up, gate), gm * a], dim=-1)
        g1[e] = gh.t() @ xe
        gx[rows] = gh @ w1[e]
    return gx, g1, g2


@expert_mlp_backward.register_fake
def _expert_mlp_backward_fake(grad: torch.Tensor, x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor,
                              w2: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


@torch.library.custom_op("fxpar::moe_route", mutates_args=())
def moe_route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)``: the ``T * k`` (token, expert) pairs (flat index ``t * k + j``) sorted by expert, stably,
    and the number of pairs per expert ``[num_experts]``."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    return order, counts


@moe_route.register_fake
def _moe_route_fake(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (top_k_index.new_empty(top_k_index.numel(), dtype=torch.long),
            top_k_index.new_empty(num_experts, dtype=torch.long))


@torch.library.custom_op("fxpar::moe_dispatch", mutates_args=())
def moe_dispatch(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    """Row ``i`` is the token of pair ``order[i]``: ``x[order // k]``."""
    return x[torch.div(order, k, rounding_mode="floor")]


@moe_dispatch.register_fake
def _moe_dispatch_fake(x: torch.Tensor, order: torch.Tensor, k: int) -> torch.Tensor:
    return x.new_empty((order.shape[0], x.shape[1]))


@torch.library.custom_op("fxpar::moe_dispatch_backward", mutates_args=())
def moe_dispatch_backward(grad: torch.Tensor, order: torch.Tensor, k: int, tokens: int) -> torch.Tensor:
    """The gradient of ``moe_dispatch`` for ``x``: each pair's row added into its token's."""
    out = grad.new_zeros((tokens, grad.shape[1]))
    return out.index_add_(0, torch.div(order, k, rounding_mode="floor"), grad)


@moe_dispatch_backward.register_fake
def _moe_dispatch_backward_fake(grad: torch.Tensor, order: torch.Tensor, k: int, tokens: int) -> torch.Tensor:
    return grad.new_empty((tokens, grad.shape[1]))


def _unsorted(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape).index_copy_(0, order, rows)


@torch.library.custom_op("fxpar::moe_combine", mutates_args=())
def moe_combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * row of pair (t, j)``, ``rows`` in ``order`` (as ``moe_dispatch`` left them)."""
    tokens, k = weights.shape
    pairs = _unsorted(rows, order).view(tokens, k, rows.shape[1])
    return (pairs * weights.unsqueeze(-1)).sum(dim=1).to(rows.dtype)


@moe_combine.register_fake
def _moe_combine_fake(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((weights.shape[0], rows.shape[1]))


@torch.library.custom_op("fxpar::moe_combine_backward", mutates_args=())
def moe_combine_backward(grad: torch.Tensor, rows: torch.Tensor, order: torch.Tensor,
                         weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``moe_combine`` for ``rows`` (in ``order``) and for ``weights``."""
    tokens, k = weights.shape
    pairs = _unsorted(rows, order).view(tokens, k, rows.shape[1])
    grad_weights = (pairs * grad.unsqueeze(1)).sum(dim=-1)
    grad_pairs = (grad.unsqueeze(1) * weights.unsqueeze(-1)).reshape(tokens * k, rows.shape[1])
    return grad_pairs[order], grad_weights.to(weights.dtype)


@moe_combine_backward.register_fake
def _moe_combine_backward_fake(grad: torch.Tensor, rows: torch.Tensor, order: torch.Tensor,
                               weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(rows), torch.empty_like(weights)


def _moe_forward(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                 down_proj: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    order, counts = moe_route(top_k_index, gate_up_proj.shape[0])
    rows = moe_dispatch(x, order, top_k_index.shape[1])
    return order, counts, rows, expert_mlp(rows, counts, gate_up_proj, down_proj, act)


@torch.library.custom_op("fxpar::moe_experts", mutates_args=())
def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, act: str) -> torch.Tensor:
    """An HF experts module's forward (see the module docstring); ``act`` names its activation in ``ACT2FN``."""
    order, _, _, out_rows = _moe_forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    return moe_combine(out_rows, order, top_k_weights).to(x.dtype)


@moe_experts.register_fake
def _moe_experts_fake(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                      gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fxpar::moe_experts_backward", mutates_args=())
def moe_experts_backward(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                         gate_up_proj: torch.Tensor, down_proj: torch.Tensor, act: str
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of ``moe_experts`` for ``x``, ``top_k_weights``, ``gate_up_proj`` and ``down_proj``."""
    order, counts, rows, out_rows = _moe_forward(x, top_k_index, top_k_weights, gate_up_proj, down_proj, act)
    grad_rows, grad_weights = moe_combine_backward(grad, out_rows, order, top_k_weights)
    grad_in, grad_up, grad_down = expert_mlp_backward(grad_rows, rows, counts, gate_up_proj, down_proj, act)
    return moe_dispatch_backward(grad_in, order, top_k_index.shape[1], x.shape[0]), grad_weights, grad_up, grad_down


@moe_experts_backward.register_fake
def _moe_experts_backward_fake(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                               act: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(top_k_weights), torch.empty_like(gate_up_proj), \
        torch.empty_like(down_proj)


def _moe_setup(ctx, inputs, output) -> None:  # noqa: ANN001  (torch.library's autograd context)
    x, top_k_index, top_k_weights, gate_up_proj, down_proj, act = inputs
    ctx.save_for_backward(x, top_k_index, top_k_weights, gate_up_proj, down_proj)
    ctx.act = act


def _moe_backward(ctx, grad: torch.Tensor) -> tuple:  # noqa: ANN001
    x, top_k_index, top_k_weights, gate_up_proj, down_proj = ctx.saved_tensors
    gx, gw, g1, g2 = moe_experts_backward(grad, x, top_k_index, top_k_weights, gate_up_proj, down_proj, ctx.act)
    return gx, None, gw, g1, g2, None


moe_experts.register_autograd(_moe_backward, setup_context=_moe_setup)

MOE_FORWARD = torch.ops.fxpar.moe_experts.default
MOE_BACKWARD = torch.ops.fxpar.moe_experts_backward.default


def check_experts_module(path: str, module: torch.nn.Module, ep: int) -> None:
    """Raise PlanError unless ``module`` is an HF experts module ``moe_experts`` computes, with ``ep`` dividing
    its experts."""
    from transformers.integrations.moe import _default_apply_gate

    layout = (module.has_gate, module.is_concatenated, module.is_transposed, module.has_bias,
              module.has_post_expert_norm)
    if layout != (True, True, False, False, False) or type(module)._apply_gate is not _default_apply_gate:
        raise PlanError(f"expert parallelism supports HF experts with concatenated, untransposed gate_up_proj and "
                        f"down_proj weights, no bias, no post-expert norm and the default gate; {path!r} "
                        f"({type(module).__name__}) is not one: use 'dp' for its model")
    if module.num_experts % ep:
        raise PlanError(f"ep={ep} does not divide the {module.num_experts} experts of {path!r}; use an ep axis "
                        "that divides the number of experts")
    if activation_name(module.act_fn) is None:
        raise PlanError(f"expert parallelism supports the experts activations {sorted(ACTIVATION_GRADS)}; {path!r} "
                        f"uses {module.act_fn!r}")


def activation_name(act_fn: Any) -> str | None:
    """The ``ACT2FN`` name of an experts module's ``act_fn`` (an activation module or function), if supported."""
    functions = {torch.nn.functional.silu: "silu", torch.nn.functional.gelu: "gelu", torch.nn.functional.relu: "relu"}
    if act_fn in functions:
        return functions[act_fn]
    return next((name for name in ACTIVATION_GRADS if type(_activation(name)) is type(act_fn)), None)


@contextmanager
def experts_as_ops(model: torch.nn.Module, ep: int) -> Iterator[None]:
    """While tracing on an ep mesh (``ep > 1``), every HF experts module of ``model`` runs as one ``moe_experts``
    call (the module itself is restored after)."""
    experts = [(p, m) for p, m in model.named_modules() if p and is_hf_experts(m)] if ep > 1 else []
    for path, module in experts:
        check_experts_module(path, module, ep)
        module.forward = experts_forward(module)
    try:
        yield
    finally:
        for _, module in experts:
            del module.forward, module._fxpar_activation


def experts_forward(module: torch.nn.Module) -> types.MethodType:
    """The forward capture traces for an HF experts module on an ep mesh: one ``moe_experts`` call. One function
    bound to each module (not a closure per module), so identical layers keep one structure and are traced once
    (``fxpar.blocks.structure_key``)."""
    module._fxpar_activation = activation_name(module.act_fn)  # named now: a traced block's class is a subclass
    return types.MethodType(_experts_as_op, module)


def _experts_as_op(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                       self._fxpar_activation)
