"""Dissociation: it is the conclusion, not the field content (paper Appendix C (i), Table 4 left;
Appendix B "The dissociation pair").

On the polarity 2x2 task (kvprobe.tasks.polarity) the field value is byte-identical across the pair and a
single rule token, the trigger, flips, so only the conclusion inverts. The pair's varying span is the
trigger, so the usual cache states read: trigger_only = the new cache's K/V on the trigger token alone;
notes = the new cache's K/V on every slot after the trigger (the post-trigger notes, trigger left old);
trigger_and_notes = both (equal to the oracle by construction: the prefix before the trigger is identical).
The paper: trigger-only -0.007..+0.007, notes 0.998..1.009 -- with the field constant, the decision reads a
memoized conclusion, not field content.

Where our setting differs: small models, which may not follow a polarity rule at all (few instances pass
the gate; both gated and all-instance summaries are kept).
"""

from __future__ import annotations

from typing import Any

from kvprobe.patching.pairs import PairPrefill
from kvprobe.patching.ranking import decode_token
from kvprobe.claims import Claim, near
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.probes.common import case_row, polarity_instances, probe_case
from kvprobe.probes.summary import format_recovery_table, gate_summary, headline_stats, recovery_summary
from kvprobe.paper import headlines as paper_headlines

STATES = ("stale", "trigger_only", "notes", "trigger_and_notes", "oracle")


def states(pp: PairPrefill) -> dict[str, Any]:
    return {"stale": pp.stale(), "trigger_only": pp.field_only(), "notes": pp.old.mix(pp.new, pp.downstream_slots),
            "trigger_and_notes": pp.full_downstream(), "oracle": pp.oracle()}


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    case = probe_case(ctx, inst, states)
    tok, pair = ctx.lm.tokenizer, case.pair
    return {**case_row(ctx, inst, case),
            "trigger_tokens": [[decode_token(tok, pair.ids_old[s]), decode_token(tok, pair.ids_new[s])]
                               for s in pair.field_slots]}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = gate_summary(rows, ctx.cfg.gate)
    out["recovery"] = recovery_summary(rows, STATES, seed=ctx.cfg.seed)
    return out


def claims_on(template: str) -> tuple[Claim, ...]:
    """The Tab. 4 (left) claims on one polarity template: polarity.yaml's 12 scenarios, or polarity_wide.yaml's
    36 (the same 12 plus 24), which gives the cluster-level test the scenarios it needs."""
    return (near("trigger_only_zero", "trigger-only recovery ~ 0 (field held identical)",
                 "trigger_only", 0.0, template=template, in_paper_range=True, role="effect"),
            near("notes_one", "notes recovery ~ 1 (field held identical)",
                 "notes", 1.0, template=template, in_paper_range=True, role="effect"),
            Claim("trigger_and_notes_one", "trigger+notes = oracle", "identity",
                  "trigger_and_notes", template=template, role="control"))


EXPERIMENT = Experiment(name="dissociation", doc=__doc__, run_instance=run_instance, summarize=summarize_rows,
                        section="appC", section_order=1,
                        make_instances=polarity_instances, table=lambda s: format_recovery_table(s, STATES),
                        headline=lambda s: headline_stats(s, "recovery", {"trigger_only": "trigger-only",
                                                                        "notes": "notes"}),
                        paper=paper_headlines("dissociation"),
                        claims=claims_on("polarity") + claims_on("polarity_wide"))
