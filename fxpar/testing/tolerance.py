"""Default tolerances of the equivalence check, by dtype, and why they are what they are.

A parallel program sums the same terms in a different order (a sharded matmul adds partial
products across ranks, a dp mean adds per-rank gradients), so its results differ from the
single-device model's by rounding, never by more:

* **Step 0 (outputs, gradients)**: ``rtol`` plus an absolute floor ``atol * max(1, max|ref|)``.
  A float sum of ``k`` terms errs by about ``k * eps * max|term|``, so the floor scales with the
  tensor's magnitude. fp32: rtol 1e-5, atol 1e-6.
* **Parameters after optimizer steps**: AdamW moves each element by about ``lr`` whatever its
  size (it divides by the element's own RMS). An element whose gradient sits at the rounding
  floor gets a different relative value from a different reduction order, and Adam turns that
  into up to a few 1e-3 x ``lr`` of movement. Parameters are held to ``param_lr_fraction * lr``
  per step taken (2% of one step, in fp32), since each step can add its own. The harness runs
  AdamW with ``eps=1e-6``: with 1e-8 such an element can move anywhere within +-lr, which no
  tolerance can tell from a bug. Each element is also allowed what its own gradient difference can
  move it (``fxpar.testing.equivalence.adam_sensitivity``: ``|dg| eps / (|g| + eps)^2`` steps of
  ``lr``, summed over the steps, at most 2 a step): nothing measurable where the gradient is large,
  up to a few % of ``lr`` where the exact gradient is zero and both sides compute noise (a key
  projection's bias: softmax ignores a shift of every score).
* **Outputs and gradients at later steps** are computed from parameters that may differ by that
  bound, summed over a fan-in of tens to hundreds: fp32 1e-4. A missing or doubled reduction is
  still an O(1) relative error.

Low-precision dtypes scale these by their machine epsilon (bf16 eps = 7.8e-3, fp16 9.8e-4). In bf16 (a bf16
model, or mixed precision computing in bf16) a gradient element at the rounding floor can take the other sign on
either side, and each Adam step moves it by ``lr`` one way or the other: parameters are held to ``2 lr`` per
step taken (measured: up to 3.5 ``lr`` after 2 steps of the tied-embedding Llama at dp=2 x tp=2 with ZeRO-3;
fp16 likewise). Parameters after a step then catch only gross errors; the gradients are the check (Adam hides
a constant factor anyway). At step 0, bf16 holds gradients to rtol 3.2e-2 and atol 2e-2 x max|ref| (four bf16
ulps, twice ``torch.testing``'s 1.6e-2): tp's row-parallel all-reduces round each layer's forward output once more
than one device does, and that compounds over layers into sums with cancellation. Measured: a 5-layer GPT with a
tied head at dp=2 x tp=2, ZeRO-3, bf16 compute, erred by 0.0625 on a LayerNorm bias gradient of 2.09 (3.0%; the
single-device bf16 reference itself is 0.019 from fp32, and splitting its batch in two moves it 0.023). The same
model in fp32 matches at rtol 1e-5, and a missing or doubled reduction is still a 50-100% error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    """How close a parallel tensor must be to its reference (see the module docstring)."""

    rtol: float
    atol: float  # multiplied by max(1, max|reference|)
    later_steps: float  # rtol and atol floor for outputs and gradients of steps >= 1
    param_lr_fraction: float  # atol of parameters after a step, as a fraction of lr


DEFAULTS: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(rtol=1e-10, atol=1e-12, later_steps=1e-8, param_lr_fraction=1e-4),
    torch.float32: Tolerance(rtol=1e-5, atol=1e-6, later_steps=1e-4, param_lr_fraction=2e-2),
    torch.bfloat16: Tolerance(rtol=3.2e-2, atol=2e-2, later_steps=5e-2, param_lr_fraction=2.0),
    torch.float16: Tolerance(rtol=2e-3, atol=1e-3, later_steps=1e-2, param_lr_fraction=2.0),
}


def default_tolerance(dtype: torch.dtype, rtol: float | None = None, atol: float | None = None) -> Tolerance:
    """The tolerance for tensors of ``dtype``; ``rtol``/``atol`` override the step-0 values."""
    base = DEFAULTS.get(dtype, DEFAULTS[torch.float32])
    rtol = base.rtol if rtol is None else rtol
    atol = base.atol if atol is None else atol
    return Tolerance(rtol, atol, max(base.later_steps, rtol, atol), base.param_lr_fraction)


# Adam's eps used by the equivalence check (see the module docstring).
ADAM_EPS = 1e-6


def adam_sensitivity(grad: torch.Tensor, difference: torch.Tensor) -> torch.Tensor:
    """How many ``lr`` a gradient ``difference`` can move an element under Adam, at most 2: its first step moves by
    ``lr * g / (|g| + eps)``, whose slope is ``eps / (|g| + eps)**2``. Where the gradient is large that is nothing;
    where it sits at the rounding floor (a key projection's bias, whose exact gradient is zero: softmax ignores a
    shift of every score) a difference of 3e-8 moves the element 0.03 ``lr``, past the 2% of ``lr`` allowed."""
    return (difference * ADAM_EPS / (grad.abs() + ADAM_EPS) ** 2).clamp(max=2.0)


def as_float64(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float64 for comparing; a complex tensor as its real and imaginary parts (``.double()`` would drop
    the imaginary part)."""
    t = t.detach()
    return torch.view_as_real(t.resolve_conj()).double() if t.is_complex() else t.double()
