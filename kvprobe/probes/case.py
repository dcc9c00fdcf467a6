"""One Case type for every field-change probe: the pair, its two prefills, the stale/oracle anchors, any named
states read in the same batch, and the row every record carries under the inclusion rule.

"Inclusion" is the per-instance filter (an instance enters the summary when the oracle moves the decision by at
least ``min_flip`` nats, optionally only when the oracle decides correctly): the config's ``inclusion:`` section,
stored and hashed as ``gate`` so that committed records keep their names. ``kvprobe gate`` is the RoPE exactness
check.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvprobe.errors import KVProbeError
from kvprobe.interop.unwrap import ModelLike, as_lm
from kvprobe.kv.state import KVState
from kvprobe.patching.pairs import Anchors, PairPrefill, measure, prefill_pair
from kvprobe.tasks.gated import TokenizedPair, tokenize_pair

StatesFn = Callable[[PairPrefill], dict[str, KVState]]


@dataclass(frozen=True)
class Case:
    """One instance, prefilled: ``lds`` / ``rec`` hold the logit difference and recovery of each named state."""

    pair: TokenizedPair
    pp: PairPrefill
    anchor: Anchors
    lds: dict[str, float]
    rec: dict[str, float]

    @classmethod
    def build(cls, lm: ModelLike, inst: Any, states: StatesFn | None = None, batch_size: int = 16,
              readout_tokens: int = 1) -> "Case":
        """Tokenize and prefill one instance; read stale, oracle and ``states(pp)`` in one batched readout.
        ``lm``: a LoadedModel (or any HookableModel), TransformerLens bridge, nnsight LanguageModel or Hugging Face
        model, converted here, at the boundary."""
        lm = as_lm(lm)
        if lm.tokenizer is None:
            raise KVProbeError(f"{lm.name} has no tokenizer: pass kvprobe.interop.as_lm(model, tokenizer)")
        pair = tokenize_pair(lm.tokenizer, inst, lm.has_chat_template)
        pp = prefill_pair(lm, pair, readout_tokens)
        anchor, lds, rec = measure(lm, pp, states(pp) if states else {}, batch_size)
        return cls(pair, pp, anchor, lds, rec)

    def included(self, min_flip: float, require_oracle_correct: bool = False) -> bool:
        """The inclusion rule: the oracle flips the decision by at least ``min_flip`` nats (and, if required,
        the oracle decides correctly and stale does not)."""
        return self.anchor.gate(min_flip, require_oracle_correct)

    def row(self, inst: Any, min_flip: float, require_oracle_correct: bool = False) -> dict[str, Any]:
        """Instance fields, sizes, anchors, inclusion, and each named state's ld and recovery."""
        return {**inst.row(), "n_tokens": len(self.pair), "field_slots": self.pair.field_slots,
                "n_downstream": len(self.pp.downstream_slots), **self.anchor.row(),
                "included": self.included(min_flip, require_oracle_correct),
                **{f"{k}_ld": v for k, v in self.lds.items()}, **self.rec}


def probe_case(ctx: Any, inst: Any, states: StatesFn | None = None, readout_tokens: int = 1) -> Case:
    """:meth:`Case.build` with the run's model and batch size."""
    return Case.build(ctx.lm, inst, states, ctx.cfg.batch_size, readout_tokens)


def case_row(ctx: Any, inst: Any, case: Case) -> dict[str, Any]:
    """The shared row under the run's inclusion rule (the config's ``inclusion:`` section)."""
    return case.row(inst, ctx.cfg.gate.min_flip, ctx.cfg.gate.require_oracle_correct)


def ld_from_recovery(anchor: Anchors, rec: Sequence[float]) -> list[float]:
    return [anchor.stale_ld + r * anchor.flip for r in rec]


def same_decision(anchor: Anchors, lds: Sequence[float], target: str) -> list[bool | None]:
    """Per ld, whether its decision (sign of the action logit difference) is the ``target`` anchor's
    ('stale' or 'oracle'); None where stale and oracle decide alike (nothing to follow or revert to)."""
    ref = anchor.stale_ld if target == "stale" else anchor.oracle_ld
    if (anchor.stale_ld > 0) == (anchor.oracle_ld > 0):
        return [None] * len(lds)
    return [(ld > 0) == (ref > 0) for ld in lds]


def cell_throughput(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``{cells, cells_per_second}`` of a probe whose rows count their patched cells (``n_cells``) and time
    themselves (``seconds``, written by the runner)."""
    seconds = sum(r.get("seconds", 0.0) for r in rows)
    cells = sum(r["n_cells"] for r in rows)
    return {"cells": cells, "cells_per_second": cells / seconds if seconds else None}
