"""Writability: the decision follows the note, even when the note is wrong (paper Appendix C (iv)).

Into an otherwise-consistent cache (the stale prefill: its field and everything before it still imply the
old answer) we inject the opposite conclusion's notes: the oracle's K/V on downstream positions only, the
field excluded. Dose over the top-k note positions (ranked by single-position effect, K = 0, 1, 2, ...,
all). Recovery toward the injected conclusion is the usual stale -> oracle recovery; ``follows`` says
whether the decision agrees with the donor's (the sign of the action logit difference matches the
oracle's; None on instances where stale and oracle decide alike, so the follow rate is over instances whose
decision the oracle flips). The paper: continuous recovery 0.99/0.98/1.02, follow rate 1.0, top-8 notes already flip most
instances.

Where our setting differs: small models (pretrained embedded models gate weakly; the organism
``smollm2-135m-gated`` strongly); one direction per instance (the instances' old/new values are already
balanced between the allow and block value).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvprobe.claims import KVPROBE_RATE_BOUND, Claim, near
from kvprobe.patching.ranking import count_grid, describe_positions, rank_downstream, sweep_recovery
from kvprobe.patching.sweep import KVPatch
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.probes.common import (case_row, curve_summary, curves_table, ld_from_recovery, probe_case,
                                         same_decision)
from kvprobe.probes.summary import gate_summary, headline_stats
from kvprobe.paper import headlines as paper_headlines


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ks: list[int] = Field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    decode_top: int = Field(8, ge=0)


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p = ctx.lm, ctx.params
    case = probe_case(ctx, inst)
    pp, anchor = case.pp, case.anchor
    ranking = rank_downstream(lm, pp, anchor, ctx.cfg.batch_size)
    grid = count_grid([0, *p.ks], len(pp.downstream_slots))
    rec = sweep_recovery(lm, pp, anchor, [KVPatch.of(ranking.top(k)) for _, k in grid], ctx.cfg.batch_size).tolist()
    lds = ld_from_recovery(anchor, rec)
    return {**case_row(ctx, inst, case),
            "inject": {label: rec[i] for i, (label, _) in enumerate(grid)},
            "follows": dict(zip([label for label, _ in grid], same_decision(anchor, lds, "oracle"))),
            "top": describe_positions(lm.tokenizer, case.pair.ids_old, ranking, p.decode_top, pp.field_slots[-1])}


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = gate_summary(rows, ctx.cfg.gate)
    out["inject"] = curve_summary(rows, "inject", ctx.cfg.seed)
    out["follows"] = curve_summary(rows, "follows", ctx.cfg.seed)
    return out


def table(s: dict[str, Any]) -> str:
    return curves_table(s, [("recovery toward the injected note, top-K notes (field left stale)", "inject"),
                            ("follow rate (decision agrees with the note's donor)", "follows")])


EXPERIMENT = Experiment(name="writability", doc=__doc__, params=Params, run_instance=run_instance,
                        section="appC", section_order=4,
                        summarize=summarize_rows, table=table,
                        headline=lambda s: headline_stats(s, "inject", {"8": "top-8", "all": "all notes"})
                        + "; follow rate: " + headline_stats(s, "follows", {"all": "all notes"}),
                        paper=paper_headlines("writability"),
                        claims=(near("inject_all_one", "injecting every note recovers toward the note ~ 1", "inject.all", 1.0,
                                     in_paper_range=True, role="control"),
                                Claim("follow_rate_all", "the decision follows the injected note (all notes)",
                                      "at_least", "follows.all", bound=KVPROBE_RATE_BOUND,
                                      role="effect"),
                                Claim("follow_rate_top8", "the top-8 notes already flip most instances",
                                      "at_least", "follows.8", bound=0.5, role="effect")))
