"""Causal scrubbing of field -> notes -> decision (paper App. D (4), Figure 15d, Table 5 "scrub").

Target: the oracle prefill (new field value). A hypothesis names the KV slots that carry the field's effect;
the scrubbed cache keeps the target's K/V there and resamples every other slot from a position-aligned input
that differs in what the hypothesis calls irrelevant (the filler rules' order), prefilled with either field
value (kvprobe.probes.scrub). Hypotheses: the paper's (field + top-K notes, all layers), nested ones (field +
top-k for smaller k), ablated ones (notes only, field only, notes at the early or late half of the layers),
everything but the notes, and random hypotheses of the same size (field + K random downstream slots).

Reported per hypothesis: recovery (0 = stale, 1 = oracle) averaged over all donors, over same-conclusion
donors and over opposite-conclusion donors, and the fraction of the effect recovered,
(rec(H) - rec(empty)) / (1 - rec(empty)). The paper's three scrub numbers read from these: drift = 1 -
rec_same(empty) (faithfulness: resampling everything from a same-conclusion input), note = 1 -
rec_opposite(all_but_notes) (only the notes from an opposite-conclusion input) and rest = 1 -
rec_opposite(paper) (everything but field and notes from it).

Identities, labelled as such in the record: ``full`` recovers 1 (float error) and ``empty`` is the resampling
baseline. Where our setting differs: the gated template instead of the polarity task; resampled inputs differ
only in filler order (position-aligned KV needs equal token counts); notes are each instance's top-effect
downstream slots, ranked in-sample.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.claims import Claim, near
from kvprobe.patching.ranking import random_positions, rank_downstream
from kvprobe.probes import cell_throughput, probe_case, sweep
from kvprobe.probes.scrub import hypotheses, hypothesis_size, resampled_donors
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.probes.common import case_row, curve_summary, curves_table
from kvprobe.probes.summary import gate_summary, headline_stats
from kvprobe.paper import headlines as paper_headlines

IDENTITIES = ("full", "empty")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    top_notes: int = Field(8, ge=1, description="the paper hypothesis keeps the field + this many top notes")
    nested: list[int] = Field(default_factory=lambda: [1, 2, 4])
    random_draws: int = Field(4, ge=1)
    variants: int = Field(2, ge=1, description="resampled filler orders; each gives a same- and an "
                                                "opposite-conclusion donor")


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p, bs = ctx.lm, ctx.params, ctx.cfg.batch_size
    case = probe_case(ctx, inst)
    pp, n_layers = case.pp, lm.spec.n_layers
    notes = rank_downstream(lm, pp, case.anchor, bs).top(p.top_notes)
    rand = random_positions(pp.downstream_slots, len(notes), p.random_draws, (ctx.cfg.seed, inst.index))
    hyp = hypotheses(pp, notes, p.nested, rand, n_layers)
    donors = resampled_donors(lm, inst, pp, p.variants, (ctx.cfg.seed, inst.index))
    per_donor = {d: sweep(lm, case, hyp, batch_size=bs, base=d, sources=donors, actions_only=True) for d in donors}

    def mean_over(names: list[str]) -> dict[str, float]:
        out = {h: sum(per_donor[d][h] for d in names) / len(names) for h in hyp if not h.startswith("random:")}
        out["random"] = sum(sum(per_donor[d][f"random:{j}"] for d in names) / len(names)
                            for j in range(len(rand))) / len(rand)
        return out

    rec = mean_over(list(donors))
    same = mean_over([d for d in donors if d.endswith(".same")])
    opposite = mean_over([d for d in donors if d.endswith(".opposite")])
    gap = 1 - rec["empty"]
    return {**case_row(ctx, inst, case), "note_slots": notes, "donors": list(donors),
            "sizes": {h: hypothesis_size(v, n_layers) for h, v in hyp.items() if not h.startswith("random:")},
            "scrub": {h: v for h, v in rec.items() if h not in IDENTITIES},
            "scrub_same": {h: v for h, v in same.items() if h not in IDENTITIES},
            "scrub_opposite": {h: v for h, v in opposite.items() if h not in IDENTITIES},
            "fraction": {h: (v - rec["empty"]) / gap if abs(gap) > 1e-9 else None for h, v in rec.items()
                         if h not in IDENTITIES},
            "identity": {"full": rec["full"], "baseline_empty": rec["empty"], "baseline_same": same["empty"],
                         "baseline_opposite": opposite["empty"]},
            "paper_metrics": {"drift": 1 - same["empty"], "note": 1 - opposite["all_but_notes"],
                              "rest": 1 - opposite["paper"]},
            "n_cells": len(hyp) * len(donors)}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    seed = ctx.cfg.seed
    out = gate_summary(rows, ctx.cfg.gate)
    out["top_notes"] = ctx.params.top_notes
    for key in ("scrub", "scrub_same", "scrub_opposite", "fraction", "identity", "paper_metrics"):
        out[key] = curve_summary(rows, key, seed)
    out["identity_note"] = ("full: every slot kept from the target, recovers 1 by construction (deviation = float "
                            "error); baseline_*: the empty hypothesis, i.e. the resampled donors themselves")
    out.update(cell_throughput(rows))
    return out


def table(s: dict[str, Any]) -> str:
    return curves_table(s, [("fraction of the effect recovered, (rec - rec_empty) / (1 - rec_empty)", "fraction"),
                            ("recovery, all donors", "scrub"),
                            ("recovery, opposite-conclusion donors", "scrub_opposite"),
                            ("identities (full = 1 by construction; baselines = donors alone)", "identity"),
                            ("paper's scrub numbers (drift / note / rest)", "paper_metrics")]) + \
        f"\n{s['cells']} cells, {s['cells_per_second'] or 0:.1f} cells/s"


def headline(s: dict[str, Any]) -> str:
    return (headline_stats(s, "paper_metrics", {"drift": "drift", "note": "note", "rest": "rest"}) + "; fraction "
            + headline_stats(s, "fraction", {"paper": "paper hyp.", "random": "random same-size"}))


EXPERIMENT = Experiment(name="scrubbing", doc=__doc__, params=Params, run_instance=run_instance,
                        section="appD", section_order=3,
                        summarize=summarize_rows, table=table, headline=headline,
                        paper=paper_headlines("scrubbing"),
                        claims=(near("drift_zero", "same-conclusion resampling is faithful: drift ~ 0",
                                     "paper_metrics.drift", 0.0, in_paper_range=True, role="control"),
                                # paper_value: the mean note - rest difference over the four families
                                Claim("note_vs_rest", "an opposite-conclusion note moves the decision more than an "
                                      "opposite-conclusion rest (paired)", "greater", "paper_metrics.note", "paper_metrics.rest",
                                      role="effect"),
                                Claim("full_one", "keeping every slot from the target recovers 1",
                                      "identity", "identity.full", role="control")))
