"""A gathered or sliced value laid out as the traced global value was (the kernels below the dispatcher assume it)."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten


class TracedLayout:
    """The method ``Lowerer`` uses to restore a value's traced memory layout (state lives on the lowerer)."""

    def restore_layout(self, x: fx.Node, like: torch.Tensor, placements: Any, module: str) -> fx.Node:
        """``x`` laid out in the dim order of the global value ``like``.

        A gather along dim d returns the collective's buffer moved back by ``movedim``, so its
        memory order differs from the global tensor's; kernels called below the dispatcher (the
        CPU flash-attention kernel reads the last dim as contiguous) assume the traced layout.
        A slice of a contiguous value on a dim other than the first is not contiguous either, and
        ``native_layer_norm_backward`` reads its ``mean``/``rstd`` as if it were: a value traced
        contiguous is made contiguous again.
        """
        val = x.meta["val"]
        big = [i for i in range(val.ndim) if val.shape[i] > 1 and like.shape[i] > 1]
        order = stride_order(like)
        same_order = [i for i in stride_order(val) if i in big] == [i for i in order if i in big]
        if same_order and (val.is_contiguous() or not like.is_contiguous()):
            return x
        contiguous = {"memory_format": torch.contiguous_format}
        if order == list(range(like.ndim)):
            return self.emit(aten.clone.default, (x,), contiguous, placements=placements, module=module)
        y = self.emit(aten.permute.default, (x, order), module=module)
        y = self.emit(aten.clone.default, (y,), contiguous, module=module)
        inverse = [order.index(i) for i in range(like.ndim)]
        return self.emit(aten.permute.default, (y, inverse), placements=placements, module=module)


def stride_order(t: torch.Tensor) -> list[int]:
    """Dims from outermost to innermost in memory (ties, e.g. size-1 dims, by index)."""
    return sorted(range(t.ndim), key=lambda i: (-t.stride()[i], i))
