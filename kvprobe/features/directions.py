"""Conclusion directions at the note positions: difference of means, DAS, and directional/subspace patches
(paper App. D (2); DAS: Geiger et al. 2023, boundless DAS: Wu et al. 2023).

A *note site* is one place at the note slots (the downstream context slots that carry the field's effect) of
one layer:

- ``resid``: the residual stream (``resid_post``) at the notes. A patched residual reaches the decision through
  the note's own column: each note token is re-run over the (patched) prefix with its layer-``L`` output
  replaced, which rewrites that note's K/V at every later layer; the other context tokens keep their cached
  K/V (the decision-time reading of the notes that every KV patch of this project measures; a full re-prefill
  of the tail, where later context tokens would also re-read the patched note, is not done);
- ``v``: one KV head's values at the notes (exact: the cache is edited, the decision token reads it);
- ``k``: one KV head's keys at the notes, pre-RoPE (un-rotated to position 0 with the model's own RoPE,
  edited, rotated back), so directions are shared across instances whose notes sit at different positions.

Every intervention is a function of the site's activations ``[n_notes, dim]``: the interchange of a subspace
(``base + (source - base) B^T B``, rows of ``B`` orthonormal), its rank-1 case the directional patch, and
additive steering. :func:`patched_logits` runs the decision with the site set to given activations and is
differentiable in them, so DAS learns its rotation by interchange intervention through the real model.

Identities (tests, not findings): a full-rank interchange is the vanilla site patch; a rank-1 interchange
with ``B`` = the unit difference of means is the directional patch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvprobe.backends import HookableModel
from kvprobe.errors import KVProbeError
from kvprobe.patching.hooks import hooked
from kvprobe.patching.sites import Site
from kvprobe.probes.case import Case
from kvprobe.probes.directional import (NoteSite, _model, decision_ld, directional_patch, frozen_weights,  # noqa: F401
                                         interchange, kv_site_acts, patched_logits, patched_state, site_acts, unit)


def steer(base: torch.Tensor, direction: torch.Tensor, alpha: float) -> torch.Tensor:
    return base + alpha * unit(direction.to(base.dtype))


def diff_of_means(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """Unit difference of means, ``pos - neg``, over all leading dimensions (``[..., dim]``)."""
    return unit(pos.reshape(-1, pos.shape[-1]).double().mean(0) - neg.reshape(-1, neg.shape[-1]).double().mean(0)).float()


def random_direction(dim: int, seed: Sequence[int]) -> torch.Tensor:
    rng = np.random.default_rng(list(seed))
    return unit(torch.as_tensor(rng.standard_normal(dim), dtype=torch.float32))


def span_direction(examples: Sequence["Example"], seed: Sequence[int]) -> torch.Tensor:
    """A random unit direction in the span of the examples' source - base differences at the notes (Gaussian
    weights on the difference rows): a control that lives where the interventions move the site, unlike a
    random direction of the whole space, which catches ~1/d of any difference by geometry alone."""
    diffs = torch.cat([(ex.source_acts - ex.base_acts).reshape(-1, ex.base_acts.shape[-1]) for ex in examples])
    w = torch.as_tensor(np.random.default_rng(list(seed)).standard_normal(diffs.shape[0]), dtype=torch.float64)
    return unit(w @ diffs.double()).float()


def subspace_cosine(basis: torch.Tensor, direction: torch.Tensor) -> float:
    """|cos| between ``direction`` and the subspace of ``basis`` rows: the norm of its projection there."""
    return float((basis.double() @ unit(direction.double())).norm())


# -- DAS ---------------------------------------------------------------------------------------------------

class RotatedSubspace(torch.nn.Module):
    """A learned rank-``rank`` subspace: rows of an orthogonally parametrized ``[rank, dim]`` matrix.

    ``boundless``: a full rotation ``[dim, dim]`` and a learned soft mask over its rows (Wu et al. 2023);
    :meth:`basis` then keeps the rows whose mask is above one half."""

    def __init__(self, dim: int, rank: int = 1, boundless: bool = False, seed: int = 0):
        super().__init__()
        from torch.nn.utils.parametrizations import orthogonal

        n = dim if boundless else rank
        with torch.random.fork_rng(devices=[]):  # the parametrization draws from the global RNG: seed it
            torch.manual_seed(seed)
            lin = torch.nn.Linear(dim, n, bias=False)
            torch.nn.init.normal_(lin.weight, std=dim ** -0.5)
            self.rot = orthogonal(lin)
        self.boundless = boundless
        self.mask_logits = torch.nn.Parameter(torch.zeros(dim)) if boundless else None
        self.temperature = 1.0

    @property
    def weight(self) -> torch.Tensor:
        return self.rot.weight

    def mask(self) -> torch.Tensor | None:
        return None if self.mask_logits is None else torch.sigmoid(self.mask_logits / self.temperature)

    def forward(self, base: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.mask_logits is None:
            return interchange(base, source, w)
        return base + ((source - base) @ w.T * self.mask()) @ w

    @torch.no_grad()
    def basis(self) -> torch.Tensor:
        w = self.weight.detach().clone()
        if self.mask_logits is None:
            return w
        keep = self.mask() > 0.5
        return w[keep] if keep.any() else w[self.mask_logits.argmax()].unsqueeze(0)


@dataclass
class Example:
    """One interchange: the base prompt's site activations, the source's, and the decision the source holds
    (+1: the oracle's action, -1: the stale action)."""

    case: Case
    site: NoteSite
    notes: list[int]
    base: str
    base_acts: torch.Tensor
    source_acts: torch.Tensor

    @property
    def target(self) -> float:
        return 1.0 if self.base == "stale" else -1.0


def examples_of(lm: HookableModel, case: Case, site: NoteSite, notes: Sequence[int],
                resid: dict[str, torch.Tensor] | None = None) -> list[Example]:
    """Both interchanges of one pair: stale base <- oracle source, and oracle base <- stale source."""
    acts = {w: site_acts(lm, case, site, notes, w, None if resid is None else resid[w]) for w in ("stale", "oracle")}
    return [Example(case, site, list(notes), "stale", acts["stale"], acts["oracle"]),
            Example(case, site, list(notes), "oracle", acts["oracle"], acts["stale"])]


def intervened_ld(lm: HookableModel, ex: Example, acts: torch.Tensor) -> torch.Tensor:
    return decision_ld(ex.case, patched_logits(lm, ex.case, ex.site, ex.notes, acts, ex.base))


@dataclass
class DASResult:
    basis: torch.Tensor
    losses: list[float]
    seconds: float
    steps: int
    rank: int


def train_das(lm: HookableModel, train: Sequence[Example], rank: int = 1, steps: int = 200,
              batch: int = 4, lr: float = 1e-2, boundless: bool = False, sparsity: float = 1e-3,
              seed: int = 0) -> DASResult:
    """Learn the subspace by interchange intervention: patch it from the source, and minimize the binary
    cross-entropy of the source's decision (over the two action tokens) on the base run."""
    if not train:
        raise KVProbeError("DAS needs training examples")
    t0 = time.perf_counter()
    model = RotatedSubspace(train[0].site.dim(lm.spec), rank, boundless, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    rng = np.random.default_rng([seed, 1])
    losses: list[float] = []
    with frozen_weights(_model(lm)), torch.enable_grad():
        for step in range(steps):
            if boundless:  # anneal the mask from soft to nearly hard
                model.temperature = float(np.interp(step, [0, steps - 1], [1.0, 0.05]))
            pick = rng.choice(len(train), size=min(batch, len(train)), replace=False)
            opt.zero_grad()
            total = torch.zeros(())
            for i in pick:
                ex = train[int(i)]
                ld = intervened_ld(lm, ex, model(ex.base_acts, ex.source_acts))
                total = total + torch.nn.functional.softplus(-ex.target * ld).mean() / len(pick)
            if boundless:
                total = total + sparsity * model.mask().sum()
            total.backward()
            opt.step()
            losses.append(float(total.detach()))
    basis = model.basis()
    return DASResult(basis, losses, time.perf_counter() - t0, steps, int(basis.shape[0]))


@torch.no_grad()
def evaluate(lm: HookableModel, examples: Sequence[Example],
             intervene: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[float]:
    """The intervened decision's signed logit difference per example (> 0: the source's decision, i.e. the
    interchange succeeded)."""
    return [float(ex.target * intervened_ld(lm, ex, intervene(ex.base_acts, ex.source_acts))[0]) for ex in examples]


@torch.no_grad()
def signed_lds(lm: HookableModel, ex: Example, acts: Sequence[torch.Tensor]) -> list[float]:
    """Signed decision logit differences for several activation settings of one example, in one batch."""
    lds = decision_ld(ex.case, patched_logits(lm, ex.case, ex.site, ex.notes, torch.stack(list(acts)), ex.base))
    return [float(ex.target * v) for v in lds]


# -- what the next component reads ---------------------------------------------------------------------------

def _layers(lm: HookableModel) -> Any:
    from kvprobe.patching.hooks import _get

    return _get(lm.model, lm.spec.layers_path)


@torch.no_grad()
def reader_matrix(lm: HookableModel, site: NoteSite) -> torch.Tensor:
    """The linear map through which the next component reads the site (``[out, dim]``).

    resid at layer L: layer L+1's q/k/v projections after its input norm's gain (the norm's scalar
    rescaling aside); v: the o_proj columns of the query heads that read this KV head; k: those heads'
    query projections, transposed (a key is dotted with W_q x)."""
    spec = lm.spec
    if site.kind == "resid":
        if site.layer + 1 >= spec.n_layers:
            raise KVProbeError("the last layer's residual is read by the final norm, not by a next layer")
        layer = _layers(lm)[site.layer + 1]
        attn = layer.self_attn
        gain = layer.input_layernorm.weight.float()
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).float()
        return (w * gain[None, :]).cpu()
    from kvprobe.probes.heads import query_group

    attn = _layers(lm)[site.layer].self_attn
    d = spec.head_dim
    if site.kind == "v":
        return torch.cat([attn.o_proj.weight[:, q * d:(q + 1) * d] for q in query_group(spec, site.head)]).float().cpu()
    # a key direction u is read as q . u = x . (W_q^T u): the transposed query projections of the group
    return torch.cat([attn.q_proj.weight[q * d:(q + 1) * d].T for q in query_group(spec, site.head)]).float().cpu()


def read_gain(matrix: torch.Tensor, direction: torch.Tensor, n_random: int = 256, seed: int = 0) -> float:
    """``||W u||`` relative to the root-mean-square of ``||W r||`` over random unit directions r: 1 is a typical
    direction, near 0 a direction the reader barely sees (a dormant subspace, Makelov et al. 2024)."""
    u = unit(direction.float())
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(n_random, matrix.shape[1], generator=gen)
    r = r / r.norm(dim=1, keepdim=True)
    typical = (matrix @ r.T).norm(dim=0).pow(2).mean().sqrt()
    return float((matrix @ u).norm() / typical)


def variance_ratio(acts: torch.Tensor, direction: torch.Tensor) -> float:
    """Variance of the activations along ``direction`` over the mean variance per dimension: how much the
    clean distribution moves along it (a dormant direction is one the activations barely use)."""
    x = acts.reshape(-1, acts.shape[-1]).double()
    x = x - x.mean(0)
    u = unit(direction.double())
    return float((x @ u).var() / x.var(0).mean())


# -- one site, held out ----------------------------------------------------------------------------------------

@torch.no_grad()
def held_out_lds(lm: HookableModel, ex: Example, directions: dict[str, torch.Tensor], bases: dict[str, torch.Tensor],
                 steering: dict[str, torch.Tensor], alphas: Sequence[float], sign: float) -> dict[str, float]:
    """Signed decision logit differences (> 0: the source's decision) of one held-out interchange under:
    ``none`` (the base itself), ``full`` (the whole site from the source), ``dir:<name>`` (the source's
    component along each direction), ``sub:<name>`` (the source's subspace of each basis), and
    ``steer:<name>:<alpha>`` (``alpha`` times each unit direction added toward the source's conclusion)."""
    acts = {"none": ex.base_acts, "full": ex.source_acts}
    acts.update({f"dir:{k}": directional_patch(ex.base_acts, ex.source_acts, u) for k, u in directions.items()})
    acts.update({f"sub:{k}": interchange(ex.base_acts, ex.source_acts, b) for k, b in bases.items()})
    acts.update({f"steer:{k}:{a:g}": steer(ex.base_acts, sign * u, a) for k, u in steering.items() for a in alphas})
    labels = list(acts)
    lds = signed_lds(lm, ex, [acts[k] for k in labels])
    return dict(zip(labels, lds))


# -- the notes -----------------------------------------------------------------------------------------------------

def find_notes(lm: HookableModel, case: Case, n: int, n_bands: int = 24, keep_bands: int = 3, batch_size: int = 64
               ) -> list[int]:
    """The ``n`` downstream slots whose oracle K/V alone (all layers) moves the stale decision most, found
    coarse to fine: contiguous bands of the downstream first, then single slots inside the ``keep_bands``
    strongest bands (about ``n_bands + keep_bands * len/n_bands`` readouts instead of one per slot). A slot
    whose effect shows only alone, outside every strong band, can be missed; ``keep_bands >= n_bands`` is the
    exhaustive ranking."""
    from kvprobe.patching.ranking import position_bands, rank_downstream

    down = case.pp.downstream_slots
    bands = position_bands(down, min(n_bands, len(down)))
    if keep_bands < len(bands):
        from kvprobe.patching.ranking import sweep_recovery
        from kvprobe.patching.sweep import KVPatch

        rec = sweep_recovery(lm, case.pp, case.anchor, [KVPatch.of(b) for b in bands], batch_size)
        order = torch.argsort(rec.nan_to_num(float("-inf")), descending=True, stable=True).tolist()
        down = sorted(s for i in order[:keep_bands] for s in bands[i])
    ranking = rank_downstream(lm, case.pp, case.anchor, batch_size, candidates=down)
    return sorted(ranking.top(n))


def case_with_resid(ctx: Any, inst: Any, layers: Sequence[int]) -> tuple[Case, dict[str, torch.Tensor]]:
    """:func:`kvprobe.probes.probe_case` with ``resid_post`` of ``layers`` kept from its two context
    prefills (no extra forward): ``{"stale"|"oracle": [len(layers), context, d_model]}``."""
    from kvprobe.probes import probe_case

    got: list[tuple[int, torch.Tensor]] = []

    def keep(site: Site, act: torch.Tensor) -> None:
        if act.shape[1] > 1:  # the prefills, not the one-token readouts
            got.append((site.layer, act[0].detach().float().cpu()))

    with hooked(ctx.lm, [Site("resid_post", layer) for layer in layers], keep):
        case = probe_case(ctx, inst)
    n = len(layers)
    if len(got) != 2 * n:
        raise KVProbeError(f"expected two prefills of {n} layers, saw {len(got)} captures")
    out = {}
    for w, part in (("stale", got[:n]), ("oracle", got[n:])):
        by_layer = dict(part)
        out[w] = torch.stack([by_layer[layer] for layer in layers])
    return case, out


def note_instances(ctx: Any) -> list[Any]:
    """The pairs of a note-site experiment: the polarity 2x2 pairs when the template's rules name a
    ``{trigger}`` (the field stays byte-identical and only the conclusion flips: the paper's App. D setting),
    else the gated or generated pairs; held-out families checked."""
    from kvprobe.probes.common import polarity_instances
    from kvprobe.runner.experiment import default_instances
    from kvprobe.tasks.gated import load_template
    from kvprobe.tasks.polarity import is_polarity

    task = ctx.cfg.task
    polarity = task.generator is None and is_polarity(load_template(task.template))
    insts = polarity_instances(ctx) if polarity else default_instances(ctx)
    check_eval_families(ctx, insts)
    return insts


def check_eval_families(ctx: Any, insts: Sequence[Any]) -> None:
    """Refuse held-out families the instances do not have (a misspelt or absent family would silently shrink
    the held-out set) and a split that leaves no training or no held-out instance."""
    families = sorted({i.family for i in insts})
    missing = [f for f in ctx.params.eval_families if f not in families]
    if missing:
        raise KVProbeError(f"params.eval_families: {', '.join(missing)} not among this task's families "
                           f"({', '.join(families)}); name families of task.template, or widen task.scenarios")
    held = sum(i.family in ctx.params.eval_families for i in insts)
    if held in (0, len(insts)):
        raise KVProbeError(f"params.eval_families leaves {'no held-out' if held == 0 else 'no training'} instance "
                           f"among {len(insts)}; raise task.n_instances or hold out fewer families")


def note_row(ctx: Any, inst: Any, case: Case, notes: Sequence[int]) -> dict[str, Any]:
    """The row every note-site experiment (directions, sae) records: the shared case row, the chosen notes
    and their tokens, whether the instance's family is held out, which conclusion the old prompt holds
    (1 = block, 0 = allow) and whether the field change flips the decision."""
    from kvprobe.patching.ranking import decode_token
    from kvprobe.probes import case_row

    return {**case_row(ctx, inst, case), "notes": list(notes),
            "note_tokens": [decode_token(ctx.lm.tokenizer, case.pair.ids_old[s]) for s in notes],
            "held_out": inst.family in ctx.params.eval_families,
            # the old prompt concludes "allow" when the change goes to block (gated: allow_to_block; polarity:
            # to_block)
            "conclusion_old": 0 if inst.meta["direction"] in ("allow_to_block", "to_block") else 1,
            "flipping": (case.anchor.stale_ld > 0) != (case.anchor.oracle_ld > 0)}
