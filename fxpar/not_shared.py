"""The signal that repeated blocks cannot be traced once here (``fxpar.blocks``, ``fxpar.block_state``)."""

from __future__ import annotations


class NotShared(Exception):  # noqa: N818 - a signal to capture the whole model, not an error
    """Sharing cannot be proven here; the caller captures the whole model instead."""
