"""Knockout and dose-response: ablating the note positions returns the decision to stale (paper Section 3
probe (4)).

In the oracle (new) cache, the top-effect downstream positions are ablated: their K/V replaced by the
stale prefill's (``ablation: stale``), by the slot-wise mean of the two prefills (``mean``) or by zeros
(``zero``; kvprobe.patching.ablation). Dose-response over how many (top-K for K = 0, 1, 2, ..., all), where
(each contiguous band of downstream positions ablated whole), and a matched-count random control (seeded
draws, averaged). Reported as "toward stale" = 1 - recovery: 0 = the oracle's decision untouched, 1 = fully
back to stale; ``reverts`` says whether the decision went back to stale's (None on instances where stale
and oracle decide alike, so the reversion rate is over instances whose decision the oracle flips).

Positions are ranked by ``rank_by``: ``patch`` (the single-position effect of patching oracle K/V into the
stale cache: the notes the suffix probe finds) or ``knockout`` (the single-position drop when ablating that
position alone from the oracle). Where our setting differs: small models (pretrained embedded models gate
weakly; the organism ``smollm2-135m-gated`` strongly); the ranking is in-sample.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.patching.ablation import ablation_donor
from kvprobe.patching.ranking import (count_grid, describe_positions, position_bands, random_positions,
                                      rank_downstream, sweep_recovery)
from kvprobe.patching.sweep import KVPatch
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.runner.probe_common import (case_row, curve_summary, curves_table, ld_from_recovery, probe_case,
                                         same_decision)
from kvprobe.runner.summary import gate_summary, headline_stats

CURVES = ("knockout_top", "knockout_random", "knockout_band", "reverts_top")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    ablation: Literal["stale", "mean", "zero"] = "stale"
    rank_by: Literal["patch", "knockout"] = "patch"
    random_draws: int = Field(3, ge=1)
    position_bands: int = Field(4, ge=1, description="contiguous bands of downstream positions, ablated whole")
    decode_top: int = Field(8, ge=0)


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p, bs = ctx.lm, ctx.params, ctx.cfg.batch_size
    case = probe_case(ctx, inst)
    pp, anchor = case.pp, case.anchor
    donor = ablation_donor(p.ablation, pp.new, pp.old)
    ranking = rank_downstream(lm, pp, anchor, bs) if p.rank_by == "patch" else \
        rank_downstream(lm, pp, anchor, bs, base=pp.new, donor=donor, descending=False)
    down = pp.downstream_slots
    grid = count_grid([0, *p.ks], len(down))
    draws = {label: random_positions(down, k, p.random_draws, (ctx.cfg.seed, inst.index, k))
             for label, k in grid if 0 < k < len(down)}
    bands = position_bands(down, p.position_bands)
    sets = [ranking.top(k) for _, k in grid] + [d for label in draws for d in draws[label]] + bands
    rec = sweep_recovery(lm, pp, anchor, [KVPatch.of(s) for s in sets], bs, base=pp.new, donor=donor).tolist()
    toward = [1 - r for r in rec]
    lds = ld_from_recovery(anchor, rec)
    n, d = len(grid), p.random_draws
    rand = {label: sum(toward[n + i * d: n + (i + 1) * d]) / d for i, label in enumerate(draws)}
    return {**case_row(ctx, inst, case), "ablation": p.ablation, "rank_by": p.rank_by,
            "knockout_top": {label: toward[i] for i, (label, _) in enumerate(grid)},
            "reverts_top": dict(zip([label for label, _ in grid], same_decision(anchor, lds[:n], "stale"))),
            "knockout_random": rand,
            "knockout_band": {f"B{i}": toward[n + len(draws) * d + i] for i in range(len(bands))},
            "band_slots": [[b[0], b[-1]] for b in bands],
            "top": describe_positions(lm.tokenizer, case.pair.ids_old, ranking, p.decode_top, pp.field_slots[-1])}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = gate_summary(rows, ctx.cfg.gate)
    out.update(ablation=ctx.params.ablation, rank_by=ctx.params.rank_by)
    for key in CURVES:
        out[key] = curve_summary(rows, key, ctx.cfg.seed)
    return out


def table(s: dict[str, Any]) -> str:
    return curves_table(s, [(f"toward stale, top-K knocked out ({s['ablation']}, ranked by {s['rank_by']})",
                             "knockout_top"), ("toward stale, K random", "knockout_random"),
                            ("toward stale, one position band (early .. late)", "knockout_band"),
                            ("decision back to stale's sign, top-K", "reverts_top")])


EXPERIMENT = Experiment(name="knockout", doc=__doc__, params=Params, run_instance=run_instance,
                        summarize=summarize_rows, table=table,
                        headline=lambda s: "return to stale, " + headline_stats(s, "knockout_top", {"1": "top-1", "8": "top-8"})
                        + "; random: " + headline_stats(s, "knockout_random", {"8": "rand-8"}),
                        paper={"gated": "ablating the top-effect tokens returns the decision to stale; the effect "
                                        "grows with their number (Sec. 3 (4), no table)"})
