"""Note sites and the interventions on them: the machinery a directional patch needs, below the features
that fit directions (:mod:`kvprobe.features.directions` re-exports it).

A *note site* is one place at the note slots of one layer: ``resid`` (the residual stream at the notes; a
patched residual reaches the decision through the note's own column, re-run over the patched prefix), ``v``
(one KV head's values, exact) or ``k`` (one KV head's keys, pre-RoPE: un-rotated with the model's own RoPE,
edited, rotated back). :func:`patched_logits` runs the decision with the site set to given activations and is
differentiable in them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.kv.state import KVState
from kvprobe.metrics import logit_diff
from kvprobe.patching.hooks import hooked
from kvprobe.patching.sites import Site
from kvprobe.probes.case import Case

SiteKind = Literal["resid", "v", "k"]


@dataclass(frozen=True)
class NoteSite:
    kind: SiteKind
    layer: int
    head: int | None = None  # KV head for v / k

    def __post_init__(self) -> None:
        if self.kind not in ("resid", "v", "k"):
            raise KVProbeError(f"note site kind must be resid, v or k, not {self.kind!r}")
        if (self.head is None) != (self.kind == "resid"):
            raise KVProbeError("v and k sites name a KV head; resid sites do not")

    @property
    def label(self) -> str:
        return f"resid@L{self.layer}" if self.kind == "resid" else f"{self.kind}@L{self.layer}.KV{self.head}"

    def dim(self, spec: Any) -> int:
        return spec.d_model if self.kind == "resid" else spec.head_dim


# -- reading the site -----------------------------------------------------------------------------------------

def _model(lm: HookableModel) -> torch.nn.Module:
    return lm.model


def _rope_info(lm: HookableModel, layer: int) -> Any:
    from kvprobe.kv.rope import rope_layer_info

    return rope_layer_info(lm.model)[layer]


def _expand(state: KVState, batch: int) -> KVState:
    """A batch-1 state viewed as ``batch`` rows (no copy; the cache copies when it appends)."""
    if state.batch == batch:
        return state
    return KVState(tuple(k.expand(batch, -1, -1, -1) for k in state.keys),
                   tuple(v.expand(batch, -1, -1, -1) for v in state.values), state.positions)


def _prompt(case: Case, which: str) -> tuple[list[int], KVState]:
    pp = case.pp
    if which == "stale":
        return pp.pair.ids_old[: pp.context_length], pp.old
    if which == "oracle":
        return pp.pair.ids_new[: pp.context_length], pp.new
    raise ValueError(f"prompt must be stale or oracle, not {which!r}")


def kv_site_acts(lm: HookableModel, state: KVState, site: NoteSite, notes: Sequence[int]) -> torch.Tensor:
    """V (or pre-RoPE K) of the site's KV head at ``notes``: ``[n_notes, head_dim]``, float32 on the CPU (site
    activations live there; they move to the model's device only where they are written back)."""
    idx = torch.as_tensor(list(notes), dtype=torch.long)
    if site.kind == "v":
        values = state.values[site.layer][0, site.head]
        return values.index_select(0, idx.to(values.device)).float().cpu()
    keys = state.keys[site.layer][:, site.head:site.head + 1]
    keys = keys.index_select(2, idx.to(keys.device)).float().cpu()
    from kvprobe.kv.rope import rotate_keys

    pre = rotate_keys(keys, state.positions[idx], torch.zeros(len(idx), dtype=torch.long), _rope_info(lm, site.layer))
    return pre[0, 0].float()


def site_acts(lm: HookableModel, case: Case, site: NoteSite, notes: Sequence[int], which: str,
              resid: torch.Tensor | None = None) -> torch.Tensor:
    """The site's activations ``[n_notes, dim]`` in the stale or oracle prompt. ``resid`` may pass the
    prompt's ``resid_post`` at the notes for the site's layer (``[n_notes, d_model]``) to skip a prefill."""
    ids, state = _prompt(case, which)
    if site.kind != "resid":
        return kv_site_acts(lm, state, site, notes)
    if resid is not None:
        return resid.float().cpu()
    from kvprobe.patching.residuals import resid_stack

    return resid_stack(lm, ids, list(notes), layers=[site.layer])[0].float().cpu()


# -- running the decision with the site set -------------------------------------------------------------------

@contextmanager
def frozen_weights(model: torch.nn.Module) -> Iterator[None]:
    """No gradients for the model's own parameters (only the intervention's)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _forward(lm: HookableModel, ids: torch.Tensor, positions: torch.Tensor, prior: KVState) -> tuple[KVState, torch.Tensor]:
    """A grad-enabled forward of ``ids [batch, t]`` at ``positions`` over ``prior``: (the state, last logits)."""
    model = _model(lm)
    device = next(model.parameters()).device
    batch = ids.shape[0]
    prior = _expand(prior, batch)
    out = model(input_ids=ids.to(device), position_ids=positions.unsqueeze(0).expand(batch, -1).to(device),
                cache=prior.to_cache(), use_cache=True, logits_to_keep=1)
    return KVState.from_cache(out.cache, torch.cat([prior.positions, positions.cpu()])), out.logits[:, -1].float()


def _put_slot_heads(t: torch.Tensor, head: int, notes: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``t [batch, kv, slots, hd]`` with ``[head, notes]`` replaced by ``new [batch, n, hd]`` (differentiable)."""
    batch = new.shape[0]
    out = t.expand(batch, -1, -1, -1).clone()
    out[:, head, notes.to(out.device)] = new.to(device=out.device, dtype=out.dtype)
    return out


def patched_state(lm: HookableModel, case: Case, site: NoteSite, notes: Sequence[int], acts: torch.Tensor,
                  base: str = "stale") -> KVState:
    """The base prompt's cache with the site at ``notes`` set to ``acts [batch, n_notes, dim]``."""
    ids, state = _prompt(case, base)
    idx = torch.as_tensor(list(notes), dtype=torch.long)
    if acts.dim() == 2:
        acts = acts.unsqueeze(0)
    layer, batch = site.layer, acts.shape[0]
    if site.kind == "v":
        return _expand(state, batch).with_layers({}, {layer: _put_slot_heads(state.values[layer], site.head, idx, acts)})
    if site.kind == "k":
        from kvprobe.kv.rope import rotate_keys

        rot = rotate_keys(acts.unsqueeze(1), torch.zeros(len(idx), dtype=torch.long), state.positions[idx],
                          _rope_info(lm, layer))[:, 0]
        return _expand(state, batch).with_layers({layer: _put_slot_heads(state.keys[layer], site.head, idx, rot)}, {})
    # resid: re-run each note's own column, in slot order, over the prefix as patched so far
    order = sorted(range(len(idx)), key=lambda i: int(idx[i]))
    cur = _expand(state, batch)
    for i in order:
        s = int(idx[i])
        value = acts[:, i]

        def put(_site: Site, act: torch.Tensor, value: torch.Tensor = value) -> torch.Tensor:
            return value.to(device=act.device, dtype=act.dtype).unsqueeze(1).expand_as(act)

        with hooked(lm, [Site("resid_post", layer)], put):
            col, _ = _forward(lm, torch.full((batch, 1), ids[s], dtype=torch.long), cur.positions[s:s + 1],
                              cur.slice(0, s))
        cur = col.concat(cur.slice(s + 1)) if s + 1 < cur.length else col
    return cur


def patched_logits(lm: HookableModel, case: Case, site: NoteSite, notes: Sequence[int], acts: torch.Tensor,
                   base: str = "stale") -> torch.Tensor:
    """Decision logits ``[batch, vocab]`` with the site at the notes set to ``acts``; differentiable in ``acts``
    under ``torch.enable_grad()`` (no grad otherwise)."""
    state = patched_state(lm, case, site, notes, acts, base)
    suffix = torch.as_tensor(case.pp.suffix, dtype=torch.long)
    pos = torch.arange(state.next_position, state.next_position + len(suffix))
    _, logits = _forward(lm, suffix.unsqueeze(0).expand(state.batch, -1), pos, state)
    return logits


def decision_ld(case: Case, logits: torch.Tensor) -> torch.Tensor:
    """New-correct minus old-correct action logit (positive: the oracle's decision)."""
    return logit_diff(logits, case.pair.new_action_id, case.pair.old_action_id)


# -- interventions on activations ---------------------------------------------------------------------------

def unit(v: torch.Tensor) -> torch.Tensor:
    return v / v.norm().clamp_min(1e-12)


def interchange(base: torch.Tensor, source: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Swap the subspace spanned by ``basis`` rows (orthonormal, ``[r, dim]``) from source into base."""
    basis = basis.to(base.dtype)
    return base + (source - base) @ basis.T @ basis


def directional_patch(base: torch.Tensor, source: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """Base with its component along ``direction`` taken from source (the rank-1 interchange)."""
    u = unit(direction.to(base.dtype))
    return base + ((source - base) @ u)[..., None] * u
