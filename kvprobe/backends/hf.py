"""The transformers backend: kvprobe's exactness oracle.

The forwards run the Hugging Face module with explicit ``position_ids`` over a ``DynamicCache`` built from a
:class:`KVState`, so every cache state is data and every position is recorded. :class:`HFKVBackend` is the
mixin through which ``LoadedModel`` implements :class:`kvprobe.backends.KVBackend`; the module-level functions
take the torch module itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvprobe.backends.state import KVState
from kvprobe.errors import KVProbeError

if TYPE_CHECKING:
    from kvprobe.models.arch import ArchSpec

Ids = Sequence[int] | torch.Tensor


def _ids_tensor(ids: Ids, device: torch.device) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    return t.to(device)


def _empty_cache() -> Any:
    from transformers.cache_utils import DynamicCache

    # No config: every layer keeps full per-token KV, sliding-window layers included.
    return DynamicCache()


@torch.no_grad()
def hf_prefill(model: torch.nn.Module, ids: Ids, positions: Ids | None = None, prior: KVState | None = None,
               return_logits: bool = False) -> KVState | tuple[KVState, torch.Tensor]:
    """Run ``ids`` (after ``prior`` if given) and return the KVState of all slots (see ``KVBackend.prefill``)."""
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


@torch.no_grad()
def hf_read_logits(model: torch.nn.Module, states: KVState | Sequence[KVState], suffix_ids: Ids,
                   batch_size: int = 16, suffix_positions: Sequence[int] | None = None) -> torch.Tensor:
    """Next-token logits ``[n_states, vocab]`` (float32, CPU) after running ``suffix_ids`` over each state.

    All states must share slots and positions (they are stacked along the batch axis, chunked to
    ``batch_size``). The suffix is placed at ``suffix_positions`` (default: right after the states' last one).
    """
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


def _causal_masks(model: torch.nn.Module, spec: ArchSpec | None, kept_pos: torch.Tensor, new_pos: torch.Tensor,
                  dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """Additive masks ``[1, 1, n_new, n_kept + n_new]``: kept slots strictly before, new tokens at or before
    each query position; sliding-window layers also keep only keys within the window (HF: distance < W)."""
    keys = torch.cat([kept_pos, new_pos])
    q = new_pos[:, None]
    allowed = torch.cat([kept_pos[None, :] < q, new_pos[None, :] <= q], dim=1)
    neg = torch.finfo(dtype).min

    def additive(ok: torch.Tensor) -> torch.Tensor:
        m = torch.zeros(ok.shape, dtype=dtype).masked_fill(~ok, neg)
        return m[None, None].to(next(model.parameters()).device)

    layer_types = spec.layer_types if spec is not None else ("full_attention",)
    if "sliding_attention" not in layer_types:
        return additive(allowed)
    window = spec.sliding_window
    windowed = additive(allowed & ((q - keys[None, :]) < window))
    if getattr(model.config, "layer_types", None) is not None:
        return {"full_attention": additive(allowed), "sliding_attention": windowed}
    if all(t == "sliding_attention" for t in layer_types):
        return windowed
    raise KVProbeError(f"cannot build per-layer recompute masks for {spec.model_type}")


@torch.no_grad()
def hf_recompute(model: torch.nn.Module, spec: ArchSpec | None, state: KVState, ids: Sequence[int],
                 slots: Sequence[int]) -> KVState:
    """``state`` with the K/V of ``slots`` recomputed (see ``KVBackend.recompute``): one forward of the chosen
    tokens, in position order, over the kept slots under a causal mask by recorded position."""
    if state.batch != 1:
        raise KVProbeError("recompute edits one cache at a time (batch 1)")
    if len(ids) != state.length:
        raise KVProbeError(f"{len(ids)} ids for a {state.length}-slot state")
    chosen = sorted({int(s) for s in slots})
    if not chosen:
        return state
    if chosen[0] < 0 or chosen[-1] >= state.length:
        raise KVProbeError(f"slots must lie in [0, {state.length})")
    chosen_set = set(chosen)
    kept = [s for s in range(state.length) if s not in chosen_set]
    new_pos = state.positions[chosen]
    order = torch.argsort(new_pos, stable=True)  # the new tokens go in position order
    chosen = [chosen[i] for i in order.tolist()]
    new_pos = state.positions[chosen]
    kept_state = state.select(kept)
    device = next(model.parameters()).device
    mask = _causal_masks(model, spec, kept_state.positions, new_pos, state.keys[0].dtype)
    input_ids = torch.as_tensor([int(ids[s]) for s in chosen], dtype=torch.long)[None].to(device)
    out = model(input_ids=input_ids, position_ids=new_pos[None].to(device), cache=kept_state.to_cache(),
                attention_mask=mask, use_cache=True, logits_to_keep=1)
    merged = KVState.from_cache(out.cache, torch.cat([kept_state.positions, new_pos]))
    # merged slots are [kept..., chosen...]; put every slot back where it was
    where = {s: i for i, s in enumerate(kept + chosen)}
    return merged.select([where[s] for s in range(state.length)])


class HFKVBackend:
    """The four cache operations of :class:`kvprobe.backends.KVBackend` on a transformers model held as
    ``self.model`` (with its layout ``self.spec``): mixed into ``LoadedModel``."""

    model: torch.nn.Module
    spec: ArchSpec

    def prefill(self, ids: Ids, positions: Ids | None = None, prior: KVState | None = None,
                return_logits: bool = False) -> KVState | tuple[KVState, torch.Tensor]:
        return hf_prefill(self.model, ids, positions, prior, return_logits)

    def read_logits(self, states: KVState | Sequence[KVState], suffix_ids: Ids, batch_size: int = 16,
                    suffix_positions: Sequence[int] | None = None) -> torch.Tensor:
        return hf_read_logits(self.model, states, suffix_ids, batch_size, suffix_positions)

    def slot_kv(self, state: KVState, slots: Sequence[int]) -> KVState:
        return state.select(slots)

    def recompute(self, state: KVState, ids: Sequence[int], slots: Sequence[int]) -> KVState:
        return hf_recompute(self.model, self.spec, state, ids, slots)
