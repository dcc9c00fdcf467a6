"""The labelled sweep: ``sweep(lm, case, {label: patch}) -> {label: value}``.

A patch is a declarative spec of what to take from which prefill; the sweep turns it into cache states and
hooks, reads every decision in batches over a shared base, and returns one value per label, so no experiment
slices a result tensor by offset. Kinds of patch:

- :class:`KV`: a source's K/V at some context slots, on some layers, optionally only on some KV heads
  (under GQA a KV head serves its query group; nothing is expanded to query heads);
- :class:`Joint`: several KV parts applied together (e.g. the top-k (layer, kv_head) write heads);
- :class:`HeadOut`: query heads' outputs (the o_proj input slice of each head) at the decision token, taken
  from the readout over a source state (read heads);
- :class:`BlockOut`: a block's output (``attn_out`` or ``mlp_out``) at context slots of one layer, taken from
  a source prefill; the context is recomputed from the first patched slot on (everything before is shared);
- :class:`Directional`: only the component along one direction of a note site (the residual stream, or V /
  pre-RoPE K of one KV head; :class:`kvprobe.features.directions.NoteSite`) at context slots, taken from the
  source: ``base + u u^T (source - base)`` per slot (the rank-1 interchange of DAS, Geiger et al. 2023).

Sources are named states: ``stale`` (the old prefill) and ``oracle`` (the new prefill) always, plus any extra
KVState a probe passes (an ablation donor, a resampled input). ``base`` names the state the patches go into.
Metrics: ``recovery`` (default; 0 = stale, 1 = oracle), ``logit_diff`` (nats, new-correct minus old-correct
action) and ``decision`` (1.0 where the decision takes the oracle's side, else 0.0).

Engines: plain KV patches of one (source, heads) group go through :func:`kvprobe.patching.sweep.kv_sweep` in
one call (the shared-base engine where the model supports it); joint patches are materialized and read in
batches; head and block patches run plain batched forwards (base cache stacked per row) with per-row hooks. Every path is tested against the
materialized reference to float error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Union

import torch

from kvprobe.backends import HookableModel
from kvprobe.interop.unwrap import ModelLike, as_lm
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.state import KVState
from kvprobe.metrics import logit_diff
from kvprobe.patching.hooks import capture, replace_activations, site_module
from kvprobe.patching.sites import Site
from kvprobe.patching.shared_engine import shared_kv_sweep, supports_shared
from kvprobe.patching.sweep import KVPatch, kv_sweep
from kvprobe.probes.case import Case


def _ints(xs: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if xs is None else tuple(int(x) for x in xs)


@dataclass(frozen=True)
class KV:
    """``source``'s K/V at context ``slots`` on ``layers`` (None = all) and ``heads`` (KV heads; None = all)."""

    slots: tuple[int, ...]
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    source: str = "oracle"

    @staticmethod
    def of(slots: Sequence[int], layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
           source: str = "oracle") -> "KV":
        return KV(tuple(int(s) for s in slots), _ints(layers), _ints(heads), source)


@dataclass(frozen=True)
class Joint:
    """KV parts applied together, in order (a later part wins where two overlap)."""

    parts: tuple[KV, ...]


@dataclass(frozen=True)
class HeadOut:
    """Outputs of query heads ``(layer, q_head)`` at the decision token, from the readout over ``source``."""

    heads: tuple[tuple[int, int], ...]
    source: str = "oracle"

    @staticmethod
    def of(heads: Sequence[tuple[int, int]], source: str = "oracle") -> "HeadOut":
        return HeadOut(tuple((int(a), int(b)) for a, b in heads), source)


@dataclass(frozen=True)
class BlockOut:
    """The ``kind`` block's output (``attn_out`` / ``mlp_out``) of ``layer`` at context ``slots``, from ``source``."""

    kind: str
    layer: int
    slots: tuple[int, ...]
    source: str = "oracle"

    def __post_init__(self) -> None:
        if self.kind not in ("attn_out", "mlp_out"):
            raise ValueError(f"BlockOut kind must be attn_out or mlp_out, not {self.kind!r}")
        if not self.slots:
            raise ValueError("BlockOut needs at least one slot")


@dataclass(frozen=True)
class Directional:
    """The component along ``direction`` of ``site`` (a NoteSite) at context ``slots``, from ``source``."""

    site: Any
    slots: tuple[int, ...]
    direction: torch.Tensor = field(compare=False, hash=False)
    source: str = "oracle"

    def __post_init__(self) -> None:
        if not self.slots:
            raise ValueError("Directional needs at least one slot")
        if self.direction.dim() != 1:
            raise ValueError(f"Directional takes one direction [dim], got shape {tuple(self.direction.shape)}")


Patch = Union[KV, Joint, HeadOut, BlockOut, Directional]


# -- metrics -------------------------------------------------------------------------------------------------

def _lds(case: Case, logits: torch.Tensor) -> torch.Tensor:
    """Action logit difference; ``logits`` is ``[n, vocab]``, or ``[n, 2]`` = (new action, old action) columns."""
    if logits.shape[-1] == 2:
        return (logits[..., 0] - logits[..., 1]).double()
    return logit_diff(logits, case.pair.new_action_id, case.pair.old_action_id).double()


METRICS: dict[str, Callable[[Case, torch.Tensor], torch.Tensor]] = {
    "recovery": lambda case, logits: case.anchor.recovery(_lds(case, logits)),
    "logit_diff": _lds,
    "decision": lambda case, logits: ((_lds(case, logits) > 0) == (case.anchor.oracle_ld > 0)).double(),
}


# -- the sweep ---------------------------------------------------------------------------------------------

def sweep(lm: ModelLike, case: Case, patches: Mapping[str, Patch], metric: str = "recovery", batch_size: int = 64,
          base: str = "stale", sources: Mapping[str, KVState] | None = None, actions_only: bool = False
          ) -> dict[str, float]:
    """Value of ``metric`` for every labelled patch applied to the ``base`` state (see the module doc).

    ``actions_only`` computes only the two action logits (every metric here needs no more; the shared engine
    then skips the rest of the unembedding, equal to the full logits to float error)."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
    ids = (case.pair.new_action_id, case.pair.old_action_id) if actions_only else None
    logits = sweep_logits(lm, case, patches, batch_size, base, sources, token_ids=ids)
    if not logits:
        return {}
    labels = list(logits)
    values = METRICS[metric](case, torch.stack([logits[k] for k in labels]))
    return {k: float(values[i]) for i, k in enumerate(labels)}


def sweep_logits(lm: ModelLike, case: Case, patches: Mapping[str, Patch], batch_size: int = 64, base: str = "stale",
                 sources: Mapping[str, KVState] | None = None, token_ids: Sequence[int] | None = None
                 ) -> dict[str, torch.Tensor]:
    """Next-token logits ``[vocab]`` after each labelled patch (the sweep before its metric); with
    ``token_ids`` only those columns. ``lm`` may be a TransformerLens bridge or an nnsight model: converted
    here, at the boundary."""
    lm = as_lm(lm)
    pp = case.pp
    states = {"stale": pp.old, "oracle": pp.new, **(sources or {})}
    for name in {base, *(_source_names(p) for p in patches.values())} - {None}:
        for n in (name if isinstance(name, tuple) else (name,)):
            if n not in states:
                raise ValueError(f"unknown source state {n!r}: choose from {', '.join(states)}")
    base_state = states[base]
    out: dict[str, torch.Tensor] = {}
    kv_groups: dict[tuple[str, tuple[int, ...] | None], list[str]] = {}
    joint, heads, blocks, directional = [], [], [], []
    for label, patch in patches.items():
        if isinstance(patch, KV):
            kv_groups.setdefault((patch.source, patch.heads), []).append(label)
        elif isinstance(patch, Joint):
            joint.append(label)
        elif isinstance(patch, HeadOut):
            heads.append(label)
        elif isinstance(patch, BlockOut):
            blocks.append(label)
        elif isinstance(patch, Directional):
            directional.append(label)
        else:
            raise TypeError(f"patch {label!r} is a {type(patch).__name__}, not KV, Joint, HeadOut, BlockOut or "
                            "Directional")
    for (source, kv_heads), labels in kv_groups.items():
        donor = states[source] if kv_heads is None else base_state.mix_heads(states[source], kv_heads)
        cells = [KVPatch(patches[k].slots, patches[k].layers) for k in labels]
        _store(out, labels, kv_sweep(lm, base_state, donor, cells, pp.suffix, batch_size=batch_size,
                                     token_ids=token_ids))
    for lo in range(0, len(joint), batch_size):
        labels = joint[lo:lo + batch_size]
        built = [_materialize(base_state, patches[k], states) for k in labels]
        _store(out, labels, _columns(read_logits(lm, built, pp.suffix, batch_size=batch_size), token_ids))
    if heads:
        _store(out, heads, _head_out_logits(lm, case, base_state, [patches[k] for k in heads], states, batch_size,
                                            token_ids))
    if blocks:
        _store(out, blocks, _columns(_block_out_logits(lm, case, base, [patches[k] for k in blocks], batch_size),
                                     token_ids))
    if directional:
        _store(out, directional, _columns(_directional_logits(lm, case, base, [patches[k] for k in directional],
                                                              batch_size), token_ids))
    return {k: out[k] for k in patches}


def _columns(logits: torch.Tensor, token_ids: Sequence[int] | None) -> torch.Tensor:
    return logits if token_ids is None else logits[:, list(token_ids)]


def _source_names(patch: Patch) -> str | tuple[str, ...]:
    return tuple(p.source for p in patch.parts) if isinstance(patch, Joint) else patch.source


def _store(out: dict[str, torch.Tensor], labels: Sequence[str], logits: torch.Tensor) -> None:
    for i, k in enumerate(labels):
        out[k] = logits[i]


def _apply_kv(state: KVState, part: KV, donor: KVState) -> KVState:
    if part.heads is None:
        return state.mix(donor, part.slots, part.layers)
    return state.mix_heads(donor, part.heads, part.slots, part.layers)


def _materialize(base: KVState, patch: Joint, states: Mapping[str, KVState]) -> KVState:
    state = base
    for part in patch.parts:
        state = _apply_kv(state, part, states[part.source])
    return state


def materialize(case: Case, patch: KV | Joint, base: str = "stale",
                sources: Mapping[str, KVState] | None = None) -> KVState:
    """The cache state a KV or joint patch builds (the reference every engine is tested against)."""
    states = {"stale": case.pp.old, "oracle": case.pp.new, **(sources or {})}
    parts = patch.parts if isinstance(patch, Joint) else (patch,)
    return _materialize(states[base], Joint(parts), states)


# -- per-row hooks ---------------------------------------------------------------------------------------------

def _row_hooks(modules: Mapping[torch.nn.Module, Callable[[torch.Tensor], torch.Tensor]], where: str) -> Any:
    """Replace each module's input (``where='pre'``) or output (``'post'``) by ``fn(activation)``."""
    return replace_activations([(module, where, fn) for module, fn in modules.items()])


def _head_out_logits(lm: HookableModel, case: Case, base: KVState, patches: Sequence[HeadOut],
                     states: Mapping[str, KVState], batch_size: int, token_ids: Sequence[int] | None = None
                     ) -> torch.Tensor:
    """Each row reads the base cache with the listed heads' decision-token outputs set to the source's."""
    suffix, d = case.pp.suffix, lm.spec.head_dim
    last = len(suffix) - 1
    donors: dict[tuple[str, int, int], torch.Tensor] = {}
    for source in {p.source for p in patches}:
        sites = sorted({Site("attn_out", layer, last, head) for p in patches if p.source == source
                        for layer, head in p.heads})
        for site, act in capture(lm, suffix, sites, prior=states[source]).items():
            donors[(source, site.layer, site.head)] = act[0]  # [head_dim]
    layers = sorted({layer for p in patches for layer, _ in p.heads})
    shared = supports_shared(lm)
    batch_size = max(batch_size, 64) if shared else batch_size  # shared rows cost no cache copy
    outs = []
    for lo in range(0, len(patches), batch_size):
        chunk = patches[lo:lo + batch_size]

        def make(layer: int, chunk: Sequence[HeadOut] = chunk) -> Callable[[torch.Tensor], torch.Tensor]:
            rows = [(i, h, donors[(p.source, layer, h)]) for i, p in enumerate(chunk) for ly, h in p.heads
                    if ly == layer]

            def fn(act: torch.Tensor) -> torch.Tensor:
                act = act.clone()
                for i, h, value in rows:
                    act[i, last, h * d:(h + 1) * d] = value.to(act.dtype)
                return act
            return fn

        modules = {site_module(lm, Site("attn_out", layer, head=0))[0]: make(layer) for layer in layers}
        with _row_hooks(modules, "pre"):  # one batched forward in which every row runs every layer
            if shared:  # rows share the base cache (no per-row copies)
                outs.append(shared_kv_sweep(lm, base, base, [KVPatch(())] * len(chunk), suffix,
                                            batch_size=len(chunk), token_ids=token_ids, share_layers=False))
            else:
                outs.append(_columns(read_logits(lm, [base] * len(chunk), suffix, batch_size=len(chunk)), token_ids))
    return torch.cat(outs)


def _directional_logits(lm: HookableModel, case: Case, base: str, patches: Sequence[Directional], batch_size: int
                        ) -> torch.Tensor:
    """Rows that share a site and slots run as one batch of patched activations over the base prompt."""
    from kvprobe.probes.directional import directional_patch, patched_logits, site_acts

    for name in {base, *(p.source for p in patches)}:
        if name not in ("stale", "oracle"):
            raise ValueError(f"directional patches read the prompts: base and source must be stale or oracle, "
                             f"not {name!r}")
    acts: dict[tuple[Any, tuple[int, ...], str], torch.Tensor] = {}

    def at(site: Any, slots: tuple[int, ...], which: str) -> torch.Tensor:
        if (site, slots, which) not in acts:
            acts[(site, slots, which)] = site_acts(lm, case, site, list(slots), which)
        return acts[(site, slots, which)]

    groups: dict[tuple[Any, tuple[int, ...]], list[int]] = {}
    for i, p in enumerate(patches):
        groups.setdefault((p.site, p.slots), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(patches)
    with torch.no_grad():
        for (site, slots), rows in groups.items():
            for lo in range(0, len(rows), batch_size):
                chunk = rows[lo:lo + batch_size]
                new = torch.stack([directional_patch(at(site, slots, base), at(site, slots, patches[i].source),
                                                     patches[i].direction) for i in chunk])
                logits = patched_logits(lm, case, site, list(slots), new, base)
                for j, i in enumerate(chunk):
                    out[i] = logits[j]
    return torch.stack(out)


def _block_out_logits(lm: HookableModel, case: Case, base: str, patches: Sequence[BlockOut], batch_size: int) -> torch.Tensor:
    """Each row re-runs the base context from the first patched slot with the listed block outputs set to
    the source prefill's at their slots, then reads the decision over the state it wrote."""
    pp = case.pp
    ids = {"stale": pp.pair.ids_old[: pp.context_length], "oracle": pp.pair.ids_new[: pp.context_length]}
    full = {"stale": pp.old, "oracle": pp.new}
    for name in {base, *(p.source for p in patches)}:
        if name not in ids:
            raise ValueError(f"block patches need token ids: base and source must be stale or oracle, not {name!r}")
    donors: dict[tuple[str, str, int], torch.Tensor] = {}
    for source in {p.source for p in patches}:
        sites = sorted({Site(p.kind, p.layer) for p in patches if p.source == source})
        for site, act in capture(lm, ids[source], sites).items():
            donors[(source, site.kind, site.layer)] = act[0]  # [seq, d]
    outs = []
    for lo in range(0, len(patches), batch_size):
        chunk = patches[lo:lo + batch_size]
        start = min(min(p.slots) for p in chunk)
        prior = full[base].slice(0, start) if start > 0 else None
        tail = torch.as_tensor(ids[base][start:], dtype=torch.long).unsqueeze(0).expand(len(chunk), -1)
        by_module: dict[torch.nn.Module, list[tuple[int, BlockOut]]] = {}
        for i, p in enumerate(chunk):
            by_module.setdefault(site_module(lm, Site(p.kind, p.layer))[0], []).append((i, p))

        def make(rows: list[tuple[int, BlockOut]], start: int = start) -> Callable[[torch.Tensor], torch.Tensor]:
            def fn(act: torch.Tensor) -> torch.Tensor:
                act = act.clone()
                for i, p in rows:
                    slots = torch.as_tensor(p.slots, dtype=torch.long)
                    act[i, slots - start] = donors[(p.source, p.kind, p.layer)][slots].to(act.dtype)
                return act
            return fn

        with _row_hooks({m: make(rows) for m, rows in by_module.items()}, "post"):
            state = prefill(lm, tail, prior=prior) if prior is not None else prefill(lm, tail)
        outs.append(read_logits(lm, state, pp.suffix, batch_size=batch_size))
    return torch.cat(outs)
