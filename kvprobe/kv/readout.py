"""Prefill a context into a KVState, and read decisions by running only the query suffix over states.

A decision is read as the next-token logits after a short suffix (often one token) run over a cache state.
States of equal length go through the model as one batch, chunked to ``batch_size``. The forwards belong to
the backend (:class:`kvprobe.backends.KVBackend`); a TransformerLens bridge or nnsight model is converted at the
public boundary (``kvprobe.prefill``, ``kvprobe.read_logits``), not here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvprobe.backends import KVBackend
from kvprobe.backends.hf import Ids
from kvprobe.kv.state import KVState


def prefill(lm: KVBackend[KVState], ids: Ids, positions: Ids | None = None, prior: KVState | None = None,
            return_logits: bool = False) -> KVState | tuple[KVState, torch.Tensor]:
    """Run ``ids`` (after ``prior`` if given) and return the KVState of all slots.

    ``positions`` sets the absolute positions the new tokens are rotated at (default: right after ``prior``,
    or 0..n-1). With ``return_logits`` also returns the last position's logits ``[batch, vocab]``.
    """
    return lm.prefill(ids, positions, prior, return_logits)


def read_logits(lm: KVBackend[KVState], states: KVState | Sequence[KVState], suffix_ids: Ids,
                batch_size: int = 16, suffix_positions: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[n_states, vocab]`` (float32, CPU) after running ``suffix_ids`` over each state.

    All states must share slots and positions (they are stacked along the batch axis). The suffix is placed
    at ``suffix_positions`` (default: right after the states' last position).
    """
    return lm.read_logits(states, suffix_ids, batch_size, suffix_positions)
