"""Rank downstream positions by their causal effect on the decision (paper Section 3 probe (2)).

One cell per downstream slot: the stale cache with the oracle's K/V at that slot on every layer, read in
one shared-base sweep. The recovery of each cell is that position's effect; suffix concentration,
specificity, knockout, note injection and selective@K edits all start from this ranking, and the helpers
below build the position sets those probes patch (top-K doses, seeded random draws, contiguous bands).

The ranking uses the instance it is measured on (in-sample, as in the paper), so a top-k set evaluated on
the same instance is an optimistic estimate of what a pre-chosen set would do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvprobe.backends import HookableModel
from kvprobe.metrics import logit_diff
from kvprobe.patching.pairs import Anchors, PairPrefill
from kvprobe.patching.sweep import KVPatch, kv_sweep


def sweep_recovery(lm: HookableModel, pp: PairPrefill, anchor: Anchors, cells: list[KVPatch], batch_size: int = 64,
                   base: Any = None, donor: Any = None) -> torch.Tensor:
    """Recovery (float64) of each cell: by default the stale base with the oracle's K/V on the cell's slots
    and layers (pass ``base=pp.new, donor=pp.old`` for knockout)."""
    base = pp.old if base is None else base
    donor = pp.new if donor is None else donor
    if not cells:
        return torch.empty(0, dtype=torch.float64)
    logits = kv_sweep(lm, base, donor, cells, pp.suffix, batch_size=batch_size)
    return anchor.recovery(logit_diff(logits, pp.pair.new_action_id, pp.pair.old_action_id).double())


@dataclass(frozen=True)
class PositionRanking:
    positions: list[int]  # candidate slots, highest effect first (lowest first for an ascending ranking)
    effects: list[float]  # single-position recovery of each, same order

    def top(self, k: int) -> list[int]:
        return self.positions[: max(k, 0)]

    def effect_by_slot(self) -> dict[int, float]:
        return dict(zip(self.positions, self.effects))


def rank_downstream(lm: HookableModel, pp: PairPrefill, anchor: Anchors, batch_size: int = 64, base: Any = None,
                    donor: Any = None, candidates: Sequence[int] | None = None, descending: bool = True
                    ) -> PositionRanking:
    """Rank ``candidates`` (default: every downstream slot) by the recovery of patching each one alone from
    ``donor`` into ``base`` on every layer (default: oracle into stale). For a knockout ranking (the oracle
    with one slot put back) pass ``base=pp.new, donor=pp.old, descending=False``: the strongest knockout is
    the lowest recovery."""
    slots = list(pp.downstream_slots if candidates is None else candidates)
    rec = sweep_recovery(lm, pp, anchor, [KVPatch.of([p]) for p in slots], batch_size, base, donor)
    key = rec.nan_to_num(float("-inf") if descending else float("inf"))
    order = torch.argsort(key, descending=descending, stable=True).tolist()
    return PositionRanking([slots[i] for i in order], [float(rec[i]) for i in order])


def describe_positions(tokenizer: Any, ids: Sequence[int], ranking: PositionRanking, n: int,
                       field_end: int) -> list[dict[str, Any]]:
    """The ``n`` top slots as rows: slot, offset after the field's last slot, decoded token, effect."""
    return [{"slot": s, "offset": s - field_end, "token": decode_token(tokenizer, ids[s]), "effect": e}
            for s, e in zip(ranking.positions[:n], ranking.effects[:n])]


def decode_token(tokenizer: Any, token_id: int) -> str:
    return f"<{int(token_id)}>" if tokenizer is None else tokenizer.decode([int(token_id)])


def random_positions(pool: Sequence[int], k: int, n_draws: int, seed: Sequence[int] | int,
                     exclude: Iterable[int] = ()) -> list[list[int]]:
    """``n_draws`` sorted random ``k``-subsets of ``pool`` minus ``exclude``, fixed by ``seed`` (e.g.
    (run seed, instance index, k), so each instance and count gets its own reproducible draws)."""
    banned = set(exclude)
    avail = np.asarray([p for p in pool if p not in banned], dtype=np.int64)
    rng = np.random.default_rng(list(seed) if not isinstance(seed, int) else seed)
    k = min(int(k), avail.size)
    return [sorted(int(x) for x in rng.choice(avail, size=k, replace=False)) for _ in range(n_draws)]


def count_grid(counts: Sequence[int], available: int, with_all: bool = True) -> list[tuple[str, int]]:
    """(label, count) pairs of a dose sweep: the requested counts below ``available``, then 'all'."""
    out = [(str(k), k) for k in sorted({int(k) for k in counts}) if k < available]
    if with_all:
        out.append(("all", available))
    return out


def layer_bands(n_layers: int, n_bands: int) -> list[list[int]]:
    """Contiguous layer bands splitting ``n_layers`` as evenly as possible (empty bands dropped)."""
    n_bands = max(1, min(n_bands, n_layers))
    return [list(range(round(b * n_layers / n_bands), round((b + 1) * n_layers / n_bands))) for b in range(n_bands)]


def position_bands(slots: Sequence[int], n_bands: int) -> list[list[int]]:
    """Contiguous bands of ``slots`` in order: early ... late downstream positions."""
    slots = list(slots)
    n_bands = max(1, min(n_bands, len(slots)))
    return [slots[round(b * len(slots) / n_bands): round((b + 1) * len(slots) / n_bands)] for b in range(n_bands)]


def rank_downstream_by_effect(lm: HookableModel, pp: PairPrefill, batch_size: int = 64) -> list[int]:
    """Downstream slots, highest single-position causal effect first (oracle K/V patched into the stale
    cache on every layer, ranked by recovery): :func:`kvprobe.patching.ranking.rank_downstream`."""
    from kvprobe.patching.pairs import measure

    anchor, _, _ = measure(lm, pp, {}, batch_size)
    return rank_downstream(lm, pp, anchor, batch_size).positions
