"""KV edit operations: what to do with a cache after a field upstream changed (paper Section 4, Appendix E).

Every operation returns an :class:`EditResult`: the cache state to read the decision from, the query suffix
to run over it, and the exact number of context tokens the edit ran through the model, out of the context
length of the prompt it answers (recompute % = recomputed / total). The query suffix is run by every method
and counted by none, so stale = 0% and full reprefill = 100%.

In-context edits (the state keeps the original slots):

- ``stale``: reuse the old cache;
- ``in_place``: recompute the field's tokens with the new value (the field-only state of Section 3);
- ``field_selective(K)``: the field plus the K downstream slots with the highest causal effect, recomputed;
- ``cacheblend(ratio)``: the field plus the downstream slots whose KV deviates most at a check layer
  (CacheBlend's HKVD selection), recomputed, ``ratio`` of the context in all;
- ``full_downstream``: everything from the field on, recomputed;
- ``full_reprefill``: a clean prefill of the new context (the oracle).

"Recomputed" is a real forward of the chosen tokens at their own positions over the current mixed cache
(:func:`recompute_slots`), never a copy from the oracle: a token at position p sees the kept slots before p
and the recomputed tokens at or before p, as in a prefill. Recomputing every slot from the field on is
therefore the full-downstream state, and recomputing the field alone is the field-only state (tested).

Appending edits (the prompt grows; only the new tokens are new work):

- ``erratum``: the stale cache up to the end of the conversation, plus one salient line and the decision
  prompt; ``field_erratum``: the same over the in-place-refreshed cache;
- ``hoist_to_end``: prompt surgery (flagged): the field moved next to the question, the value-independent
  prefix cached once, the field line and decision prompt new work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvprobe.errors import KVProbeError
from kvprobe.kv.readout import prefill
from kvprobe.backends import HookableModel, KVBackend
from kvprobe.kv.state import KVState
from kvprobe.tasks.edits import common_prefix_len


@dataclass(frozen=True)
class EditResult:
    state: KVState
    suffix_ids: list[int]
    recomputed_tokens: int  # tokens run through every layer
    total_tokens: int
    needs_prompt_surgery: bool = False
    detail: dict[str, Any] = field(default_factory=dict, compare=False)
    # Tokens run through only some layers, weighted by the fraction of layers they cross (CacheBlend's
    # deviation pass: every token from the field on, through layers 0..check_layer). Counted in the recompute.
    partial_pass_tokens: float = 0.0

    @property
    def recompute_fraction(self) -> float:
        """(full-depth tokens + layer-weighted partial-pass tokens) / tokens of the prompt answered."""
        done = self.recomputed_tokens + self.partial_pass_tokens
        return done / self.total_tokens if self.total_tokens else 0.0

    def row(self) -> dict[str, Any]:
        return {"recomputed_tokens": self.recomputed_tokens, "partial_pass_tokens": self.partial_pass_tokens,
                "total_tokens": self.total_tokens, "recompute_fraction": self.recompute_fraction,
                "needs_prompt_surgery": self.needs_prompt_surgery, **self.detail}


@dataclass(frozen=True)
class FieldEdit:
    """One field change: the stale cache of the old context and the new context's token ids."""

    stale: KVState
    stale_ids: list[int]  # the old context the stale cache holds
    ids: list[int]  # the new context (same length)
    field_slots: list[int]
    suffix: list[int]

    def __post_init__(self) -> None:
        if not len(self.ids) == len(self.stale_ids) == self.stale.length:
            raise KVProbeError(f"{len(self.stale_ids)} old and {len(self.ids)} new context ids for a "
                               f"{self.stale.length}-slot cache")

    @classmethod
    def from_pair(cls, pp: Any) -> "FieldEdit":
        """From a :class:`kvprobe.patching.pairs.PairPrefill` (its new prefill is not used)."""
        ctx = pp.context_length
        return cls(pp.old, list(pp.pair.ids_old[:ctx]), list(pp.pair.ids_new[:ctx]), list(pp.field_slots),
                   list(pp.suffix))

    @property
    def length(self) -> int:
        return self.stale.length

    @property
    def field_start(self) -> int:
        return self.field_slots[0]

    @property
    def downstream_slots(self) -> list[int]:
        return list(range(self.field_slots[-1] + 1, self.length))


# -- recompute --------------------------------------------------------------------------------------------
def recompute_slots(lm: KVBackend[KVState], state: KVState, ids: Sequence[int], slots: Sequence[int]) -> KVState:
    """``state`` with the K/V of ``slots`` recomputed: the tokens ``ids[slot]`` run through the model at their
    recorded positions over every other slot, causally (kept slots < p, recomputed tokens <= p). The backend
    does the forward (:meth:`kvprobe.backends.KVBackend.recompute`)."""
    return lm.recompute(state, ids, slots)


# -- in-context edits ---------------------------------------------------------------------------------------
def _recomputed(lm: HookableModel, e: FieldEdit, slots: Sequence[int], **detail: Any) -> EditResult:
    slots = sorted({int(s) for s in slots})
    return EditResult(recompute_slots(lm, e.stale, e.ids, slots), e.suffix, len(slots), e.length, detail=detail)


def stale(e: FieldEdit) -> EditResult:
    return EditResult(e.stale, e.suffix, 0, e.length)


def in_place(lm: HookableModel, e: FieldEdit) -> EditResult:
    """Refresh the field's own KV and nothing else (~1% compute; ignored without a reasoning chain)."""
    return _recomputed(lm, e, e.field_slots)


def field_selective(lm: HookableModel, e: FieldEdit, ranked_downstream: Sequence[int], k: int) -> EditResult:
    """The field plus the top ``k`` of ``ranked_downstream`` (highest causal effect first), recomputed."""
    top = [int(p) for p in ranked_downstream[:k]]
    if any(p <= e.field_slots[-1] or p >= e.length for p in top):
        raise KVProbeError("field_selective ranks downstream slots only (after the field, inside the context)")
    return _recomputed(lm, e, [*e.field_slots, *top], k=k)


def full_downstream(lm: HookableModel, e: FieldEdit) -> EditResult:
    return _recomputed(lm, e, range(e.field_start, e.length))


def full_reprefill(lm: HookableModel, e: FieldEdit) -> EditResult:
    return EditResult(prefill(lm, e.ids), e.suffix, e.length, e.length)


class _Stop(Exception):
    pass


@torch.no_grad()
def kv_deviation(lm: HookableModel, e: FieldEdit, check_layer: int) -> torch.Tensor:
    """Per slot from the field on: ||K_new - K_stale||^2 + ||V_new - V_stale||^2 at ``check_layer``, where
    the new K/V come from running the new context from the field on through layers 0..check_layer only
    (CacheBlend's partial first pass; the forward stops after that layer)."""
    model = lm.model
    layers = model.get_submodule(lm.spec.layers_path)
    if not 0 <= check_layer < len(layers):
        raise KVProbeError(f"cacheblend check layer {check_layer} outside [0, {len(layers)})")
    prior = e.stale.slice(0, e.field_start)
    cache = prior.to_cache()
    device = next(model.parameters()).device
    pos = e.stale.positions[e.field_start:]

    def stop(*_: Any) -> None:
        raise _Stop

    handle = layers[check_layer].register_forward_hook(stop)
    try:
        model(input_ids=torch.as_tensor(e.ids[e.field_start:])[None].to(device), position_ids=pos[None].to(device),
              cache=cache, use_cache=True, logits_to_keep=1)
    except _Stop:
        pass
    finally:
        handle.remove()
    layer = cache.layers[check_layer]
    k_new, v_new = layer.keys[:, :, e.field_start:], layer.values[:, :, e.field_start:]
    k_old = e.stale.keys[check_layer][:, :, e.field_start:]
    v_old = e.stale.values[check_layer][:, :, e.field_start:]
    dev = (k_new - k_old).float().pow(2).sum(dim=(0, 1, 3)) + (v_new - v_old).float().pow(2).sum(dim=(0, 1, 3))
    return dev.cpu()


def cacheblend(lm: HookableModel, e: FieldEdit, ratio: float, check_layer: int = 1) -> EditResult:
    """CacheBlend-style selective recompute: rank the slots from the field on by KV deviation at
    ``check_layer`` and recompute the top ``ratio`` of the context (the field always among them)."""
    if not 0 < ratio <= 1:
        raise KVProbeError(f"cacheblend ratio must lie in (0, 1]; got {ratio}")
    check_layer = min(check_layer, lm.spec.n_layers - 1)
    dev = kv_deviation(lm, e, check_layer)
    n = max(len(e.field_slots), min(e.length - e.field_start, round(ratio * e.length)))
    ranked = [e.field_start + int(i) for i in torch.argsort(dev, descending=True, stable=True).tolist()]
    chosen = list(e.field_slots) + [s for s in ranked if s not in set(e.field_slots)][: n - len(e.field_slots)]
    check_pass = e.length - e.field_start
    res = _recomputed(lm, e, chosen, ratio=ratio, check_layer=check_layer, check_pass_tokens=check_pass,
                      field_in_top_deviation=bool(set(ranked[: len(e.field_slots)]) == set(e.field_slots)))
    return replace(res, partial_pass_tokens=check_pass * (check_layer + 1) / lm.spec.n_layers)


# -- appending edits ------------------------------------------------------------------------------------------
def append_edit(lm: HookableModel, cached: KVState, cached_ids: Sequence[int], prompt: Sequence[int], readout_tokens: int,
                already_recomputed: int = 0, needs_prompt_surgery: bool = False, **detail: Any) -> EditResult:
    """Reuse ``cached`` for the longest token prefix it shares with ``prompt`` and prefill the rest of the
    prompt's context over it; the last ``readout_tokens`` tokens are the query suffix."""
    ctx = len(prompt) - readout_tokens
    if len(cached_ids) != cached.length:
        raise KVProbeError(f"{len(cached_ids)} cached ids for a {cached.length}-slot cache")
    cut = min(common_prefix_len(cached_ids, prompt), ctx)
    if cut == 0:
        raise KVProbeError("the edited prompt shares no prefix with the cache")
    state = prefill(lm, list(prompt[cut:ctx]), prior=cached.slice(0, cut)) if cut < ctx else cached.slice(0, cut)
    return EditResult(state, list(prompt[ctx:]), already_recomputed + ctx - cut, ctx, needs_prompt_surgery,
                      detail={"reused_tokens": cut, "appended_tokens": ctx - cut, **detail})


def erratum(lm: HookableModel, e: FieldEdit, erratum_prompt: Sequence[int], readout_tokens: int) -> EditResult:
    """Stale cache + a salient erratum and the decision prompt as new tokens. ``erratum_prompt`` is the
    erratum prompt's full token ids with the OLD value still in the field (the cache's text)."""
    return append_edit(lm, e.stale, e.stale_ids, erratum_prompt, readout_tokens)


def field_erratum(lm: HookableModel, e: FieldEdit, erratum_prompt: Sequence[int], readout_tokens: int) -> EditResult:
    """In-place field refresh, then the erratum appended. ``erratum_prompt`` holds the NEW value in the field."""
    refreshed = in_place(lm, e)
    return append_edit(lm, refreshed.state, e.ids, erratum_prompt, readout_tokens,
                       already_recomputed=refreshed.recomputed_tokens)


def hoist_to_end(lm: HookableModel, old_hoisted: Sequence[int], new_hoisted: Sequence[int], readout_tokens: int,
                 prefix: KVState | None = None) -> EditResult:
    """Prompt surgery: the prompts with the field next to the question. Their shared, value-independent
    prefix is what a system caches once (``prefix``; prefilled here when not given, never counted); the
    rest is new work."""
    cut = common_prefix_len(old_hoisted, new_hoisted)
    if prefix is None:
        prefix = prefill(lm, list(new_hoisted[:cut]))
    if prefix.length != cut:
        raise KVProbeError(f"the cached hoisted prefix has {prefix.length} slots; the prompts share {cut} tokens")
    return append_edit(lm, prefix, list(new_hoisted[:cut]), new_hoisted, readout_tokens, needs_prompt_surgery=True)
