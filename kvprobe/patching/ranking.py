"""Rank downstream positions by their causal effect on the decision (paper Section 3 probe (2)).

One cell per downstream slot: the stale cache with the oracle's K/V at that slot on every layer, read in
one shared-base sweep. The recovery of each cell is that position's effect; suffix concentration,
specificity, knockout and selective@K edits all start from this ranking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvprobe.metrics import logit_diff
from kvprobe.patching.pairs import Anchors, PairPrefill
from kvprobe.patching.sweep import KVPatch, kv_sweep


def sweep_recovery(lm: Any, pp: PairPrefill, anchor: Anchors, cells: list[KVPatch], batch_size: int = 64,
                   base: Any = None, donor: Any = None) -> torch.Tensor:
    """Recovery (float64) of each cell: by default the stale base with the oracle's K/V on the cell's slots
    and layers (pass ``base=pp.new, donor=pp.old`` for knockout)."""
    base = pp.old if base is None else base
    donor = pp.new if donor is None else donor
    logits = kv_sweep(lm, base, donor, cells, pp.suffix, batch_size=batch_size)
    return anchor.recovery(logit_diff(logits, pp.pair.new_action_id, pp.pair.old_action_id).double())


@dataclass(frozen=True)
class PositionRanking:
    positions: list[int]  # downstream slots, highest effect first
    effects: list[float]  # single-position recovery of each, same order


def rank_downstream(lm: Any, pp: PairPrefill, anchor: Anchors, batch_size: int = 64) -> PositionRanking:
    slots = pp.downstream_slots
    rec = sweep_recovery(lm, pp, anchor, [KVPatch.of([p]) for p in slots], batch_size)
    order = torch.argsort(rec.nan_to_num(0.0), descending=True).tolist()
    return PositionRanking([slots[i] for i in order], [float(rec[i]) for i in order])


def ranked_instance(lm: Any, inst: Any, batch_size: int = 16) -> tuple[PairPrefill, Anchors, PositionRanking]:
    """Tokenize and prefill one instance, read its anchors and rank its downstream positions: the shared
    start of every probe that patches sets of top-ranked notes."""
    from kvprobe.patching.pairs import measure, prefill_pair
    from kvprobe.tasks.gated import tokenize_pair

    pp = prefill_pair(lm, tokenize_pair(lm.tokenizer, inst, lm.has_chat_template))
    anchor, _, _ = measure(lm, pp, {}, batch_size)
    return pp, anchor, rank_downstream(lm, pp, anchor)
