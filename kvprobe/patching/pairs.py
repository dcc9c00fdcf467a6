"""The common core every field-change probe builds on (paper Section 3, Setup).

For one old -> new instance: prefill the old and the new context once each, keep both as KVStates, then
build any cache state (stale, field-only, full-downstream, oracle, top-K, knockout ...) by mixing them and
read the decision for all of them in batched one-token forwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


import torch

from kvprobe.backends import HookableModel
from kvprobe.kv.readout import prefill, read_logits
from kvprobe.kv.state import KVState
from kvprobe.metrics import logit_diff, recovery
from kvprobe.tasks.gated import TokenizedPair


@dataclass
class PairPrefill:
    """The two prefills of one instance. ``suffix`` is the query the decision is read after."""

    pair: TokenizedPair
    old: KVState
    new: KVState
    suffix: list[int]

    @property
    def context_length(self) -> int:
        return self.old.length

    @property
    def field_slots(self) -> list[int]:
        return self.pair.field_slots

    @property
    def downstream_slots(self) -> list[int]:
        """Every context slot after the field (the notes live here)."""
        return list(range(self.pair.field_slots[-1] + 1, self.context_length))

    # The paper's four states.
    def stale(self) -> KVState:
        return self.old

    def oracle(self) -> KVState:
        return self.new

    def field_only(self) -> KVState:
        return self.old.mix(self.new, self.field_slots)

    def full_downstream(self) -> KVState:
        return self.old.mix(self.new, range(self.pair.field_start, self.context_length))


def prefill_pair(lm: HookableModel, pair: TokenizedPair, readout_tokens: int = 1) -> PairPrefill:
    """Prefill both contexts, leaving the last ``readout_tokens`` tokens as the query suffix."""
    if pair.ids_old[-readout_tokens:] != pair.ids_new[-readout_tokens:] or \
            pair.field_slots[-1] >= len(pair) - readout_tokens:
        raise ValueError("the query suffix must lie after the field")
    ctx = len(pair) - readout_tokens
    return PairPrefill(pair, prefill(lm, pair.ids_old[:ctx]), prefill(lm, pair.ids_new[:ctx]),
                       pair.ids_old[ctx:])


def decision_ld(lm: HookableModel, pp: PairPrefill, states: Sequence[KVState], batch_size: int = 16) -> torch.Tensor:
    """Action logit difference (new-correct minus old-correct action) for each state, float64."""
    logits = read_logits(lm, list(states), pp.suffix, batch_size=batch_size)
    return logit_diff(logits, pp.pair.new_action_id, pp.pair.old_action_id).double()


@dataclass(frozen=True)
class Anchors:
    """Stale and oracle decisions of one instance: what every recovery is measured between."""

    stale_ld: float
    oracle_ld: float

    @property
    def flip(self) -> float:
        return self.oracle_ld - self.stale_ld

    def recovery(self, ld: torch.Tensor | float) -> torch.Tensor:
        return recovery(ld, self.stale_ld, self.oracle_ld)

    def gate(self, min_flip: float, require_oracle_correct: bool = False) -> bool:
        ok = self.flip >= min_flip
        if require_oracle_correct:
            ok = ok and self.oracle_ld > 0 and self.stale_ld < 0
        return bool(ok)

    def row(self) -> dict[str, float]:
        return {"stale_ld": self.stale_ld, "oracle_ld": self.oracle_ld, "flip": self.flip,
                "oracle_correct": self.oracle_ld > 0, "stale_correct": self.stale_ld < 0}


def measure(lm: HookableModel, pp: PairPrefill, states: dict[str, KVState], batch_size: int = 16
            ) -> tuple[Anchors, dict[str, float], dict[str, float]]:
    """Read stale, oracle and every named state in one batched readout.

    Returns the anchors, each state's logit difference and each state's recovery. Stale and oracle ride in
    the same batch as the states they normalize, so batch composition cannot shift one against the other.
    """
    names = list(states)
    lds = decision_ld(lm, pp, [pp.stale(), pp.oracle(), *states.values()], batch_size)
    anchor = Anchors(float(lds[0]), float(lds[1]))
    rec = anchor.recovery(lds[2:])
    return anchor, {n: float(lds[2 + i]) for i, n in enumerate(names)}, {n: float(rec[i]) for i, n in enumerate(names)}
