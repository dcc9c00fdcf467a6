"""Prefill a context into a KVState, and read decisions by running only the query suffix over states.

A decision is read as the next-token logits after a short suffix (often one token) run over a cache state.
States of equal length go through the model as one batch, chunked to ``batch_size``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvprobe.errors import KVProbeError
from kvprobe.interop.unwrap import as_lm
from kvprobe.kv.state import KVState


def _ids_tensor(ids: Sequence[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    return t.to(device)


@torch.no_grad()
def prefill(lm: Any, ids: Sequence[int] | torch.Tensor, positions: Sequence[int] | torch.Tensor | None = None,
            prior: KVState | None = None, return_logits: bool = False):
    """Run ``ids`` (after ``prior`` if given) and return the KVState of all slots.

    ``positions`` sets the absolute positions the new tokens are rotated at (default: right after ``prior``,
    or 0..n-1). With ``return_logits`` also returns the last position's logits ``[batch, vocab]``.
    """
    lm = as_lm(lm)  # a TransformerLens bridge or nnsight model becomes the LoadedModel behind it
    model = lm.model if hasattr(lm, "model") and not isinstance(lm, torch.nn.Module) else lm
    device = next(model.parameters()).device
    input_ids = _ids_tensor(ids, device)
    start = prior.next_position if prior is not None else 0
    if positions is None:
        pos = torch.arange(start, start + input_ids.shape[1])
    else:
        pos = torch.as_tensor(positions, dtype=torch.long)
    if pos.shape[-1] != input_ids.shape[1]:
        raise KVProbeError(f"{pos.shape[-1]} positions for {input_ids.shape[1]} tokens")
    cache = prior.to_cache() if prior is not None else _empty_cache()
    if prior is not None and prior.batch != input_ids.shape[0]:
        if prior.batch == 1:
            cache = KVState.stack([prior] * input_ids.shape[0]).to_cache()
        else:
            raise KVProbeError(f"prior state has batch {prior.batch}, ids batch {input_ids.shape[0]}")
    out = model(input_ids=input_ids, position_ids=pos.unsqueeze(0).expand(input_ids.shape[0], -1).to(device),
                cache=cache, use_cache=True, logits_to_keep=1)
    all_pos = pos if prior is None else torch.cat([prior.positions, pos])
    state = KVState.from_cache(out.cache, all_pos)
    if return_logits:
        return state, out.logits[:, -1].float()
    return state


def _empty_cache():
    from transformers.cache_utils import DynamicCache

    # No config: every layer keeps full per-token KV, sliding-window layers included.
    return DynamicCache()


@torch.no_grad()
def read_logits(lm: Any, states: KVState | Sequence[KVState], suffix_ids: Sequence[int] | torch.Tensor,
                batch_size: int = 16, suffix_positions: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[n_states, vocab]`` (float32, CPU) after running ``suffix_ids`` over each state.

    All states must share slots and positions (they are stacked along the batch axis). The suffix is placed
    at ``suffix_positions`` (default: right after the states' last position).
    """
    lm = as_lm(lm)  # a TransformerLens bridge or nnsight model becomes the LoadedModel behind it
    model = lm.model if hasattr(lm, "model") and not isinstance(lm, torch.nn.Module) else lm
    device = next(model.parameters()).device
    if isinstance(states, KVState):
        states = [states]
    items: list[KVState] = []
    for s in states:
        items.extend([s] if s.batch == 1 else [s.batch_item(i) for i in range(s.batch)])
    suffix = torch.as_tensor(suffix_ids, dtype=torch.long).reshape(-1)
    start = items[0].next_position
    pos = torch.arange(start, start + suffix.numel()) if suffix_positions is None else \
        torch.as_tensor(suffix_positions, dtype=torch.long)
    outs = []
    for lo in range(0, len(items), batch_size):
        chunk = KVState.stack(items[lo:lo + batch_size])
        n = chunk.batch
        out = model(input_ids=suffix.unsqueeze(0).expand(n, -1).to(device),
                    position_ids=pos.unsqueeze(0).expand(n, -1).to(device),
                    cache=chunk.to_cache(), use_cache=True, logits_to_keep=1)
        outs.append(out.logits[:, -1].float().cpu())
    return torch.cat(outs)
