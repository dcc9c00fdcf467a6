"""KVState <-> what transformers, TransformerLens and nnsight hold as a KV cache.

- :func:`to_hf_cache` / :func:`from_hf_cache`: a transformers 5 ``DynamicCache`` (``cache.layers[i].keys`` /
  ``.values``, ``[batch, kv_heads, seq, head_dim]``, keys after RoPE): exactly KVState's layout.
- :func:`from_tl_cache`: a TransformerBridge ``ActivationCache`` from ``run_with_cache``. TL's
  ``blocks.{l}.attn.hook_rot_k`` is the key *after* RoPE (and q/k norm), which is what the cache stores;
  ``hook_k`` is *before* RoPE and is not a cache entry. Both come ``[batch, pos, kv_heads, d_head]``.
- :func:`from_nnsight`: an nnsight model's prefill. nnsight exposes the forward's output, whose ``cache`` is a
  transformers cache; a trace is run with a full (non-windowed) ``DynamicCache`` so sliding-window layers keep
  every token, as kvprobe's own prefill does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState


def to_hf_cache(state: KVState) -> Any:
    """A transformers ``DynamicCache`` holding every slot of ``state`` (tensors shared, not copied)."""
    return state.to_cache()


def from_hf_cache(cache: Any, positions: torch.Tensor | Sequence[int] | None = None) -> KVState:
    """A KVState of a (full, non-truncating) transformers cache; ``positions`` default to 0..n-1."""
    pos = None if positions is None else torch.as_tensor(list(positions) if not isinstance(positions, torch.Tensor)
                                                         else positions, dtype=torch.long)
    return KVState.from_cache(cache, pos)


def from_tl_cache(cache: Any, n_layers: int, positions: torch.Tensor | Sequence[int] | None = None) -> KVState:
    """A KVState from a TransformerBridge ``run_with_cache`` ActivationCache (needs ``hook_rot_k``/``hook_v``
    of every layer; pass ``names_filter`` accordingly)."""
    keys, values = [], []
    for layer in range(n_layers):
        try:
            k, v = cache[f"blocks.{layer}.attn.hook_rot_k"], cache[f"blocks.{layer}.attn.hook_v"]
        except KeyError as exc:
            raise KVProbeError(f"the TL cache lacks layer {layer}'s hook_rot_k / hook_v (hook_k is pre-RoPE and "
                               "cannot stand in for the cached key)") from exc
        keys.append(k.transpose(1, 2).contiguous())
        values.append(v.transpose(1, 2).contiguous())
    n = keys[0].shape[-2]
    pos = torch.arange(n) if positions is None else torch.as_tensor(list(positions) if not isinstance(
        positions, torch.Tensor) else positions, dtype=torch.long)
    return KVState(tuple(keys), tuple(values), pos.cpu())


def tl_kv_hook_filter(name: str) -> bool:
    """``names_filter`` for ``run_with_cache`` that keeps only what :func:`from_tl_cache` needs."""
    return name.endswith("attn.hook_rot_k") or name.endswith("attn.hook_v")


def from_nnsight(model: Any, ids: Sequence[int] | torch.Tensor) -> KVState:
    """Prefill ``ids`` through an nnsight ``LanguageModel`` trace and return the KVState of its cache."""
    from transformers.cache_utils import DynamicCache

    t = torch.as_tensor(ids, dtype=torch.long)
    t = t.unsqueeze(0) if t.dim() == 1 else t
    device = next(model._module.parameters()).device
    pos = torch.arange(t.shape[1])
    with torch.no_grad(), model.trace(t.to(device), position_ids=pos.unsqueeze(0).expand(t.shape[0], -1).to(device),
                                      cache=DynamicCache(), use_cache=True):
        out = model.output.save()
    return KVState.from_cache(out.cache, pos)
