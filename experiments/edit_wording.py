"""Erratum wording: is the note a copy of the field or a committed conclusion? (paper Section 3, "What the
note contains", Figure 3d)

For each instance we prefill the old context once and append, after the cached conversation and ahead of
the decision prompt, one erratum line in each wording: a bare restatement of the new value, a tagged update,
the explicit override of Appendix B, and the aggressive "disregard your earlier conclusion and re-evaluate".
Only the erratum and the decision prompt are new work. By default the erratum rides on the stale cache (the
field still holds the old value); the field+erratum arm refreshes the field in place first. P(correct) is
the fraction of instances whose decision (argmax of the two action tokens) is the new value's action;
recovery is measured between the instance's stale and oracle anchors, and each arm is compared with a full
reprefill of its byte-identical text. The paper finds bare value, tagged update and explicit override all at
~1.0 P(safe), the aggressive wording lower (0.81).

Where our setting differs: small embedded models; the wordings live in the config (format strings over
{field}, {new_value}, {old_value}; null is the template's erratum, or for generated
instances the generator's correction line), and every row records the exact line.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvprobe.claims import Claim
from kvprobe.kv import edit
from kvprobe.kv.readout import prefill
from kvprobe.probes.edit_summary import (base_row, edit_case, edit_gate_summary, format_methods_table,
                                         method_entry, methods_headline, methods_summary, read_ld)
from kvprobe.runner.experiment import Context, Experiment
from kvprobe.tasks.edits import WORDINGS, erratum_body, erratum_line, prompt_ids
from kvprobe.paper import headlines as paper_headlines

ARMS = ("erratum", "field_erratum")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    readout_tokens: int = Field(1, ge=1)
    wordings: dict[str, str | None] = Field(default_factory=lambda: dict(WORDINGS),
                                            description="name -> format string; null: the template's erratum "
                                                        "(generated instances: the generator's correction line)")
    arms: list[str] = Field(default_factory=lambda: ["erratum"], description="erratum and/or field_erratum")
    reference: bool = Field(True, description="also read a full reprefill of each byte-identical erratum text")

    @field_validator("arms")
    @classmethod
    def _arms(cls, v: list[str]) -> list[str]:
        bad = [a for a in v if a not in ARMS]
        if bad or not v:
            raise ValueError(f"arms must be a non-empty subset of {list(ARMS)}; got {v}")
        return v


def key(arm: str, wording: str) -> str:
    return f"{arm}/{wording}"


def run_instance(ctx: Context, inst: Any) -> dict[str, Any]:
    lm, p, tok, chat, r = ctx.lm, ctx.params, ctx.lm.tokenizer, ctx.lm.has_chat_template, ctx.params.readout_tokens
    c = edit_case(ctx, inst, r)
    pair, e, anchor = c.pair, c.edit, c.anchor
    methods, lines = {}, {}
    for wording, fmt in p.wordings.items():
        lines[wording] = erratum_line(ctx.template, inst, inst.new_value, fmt)
        for arm in p.arms:
            field_value = inst.old_value if arm == "erratum" else inst.new_value
            ids = prompt_ids(tok, inst, erratum_body(ctx.template, inst, field_value, [lines[wording]]), chat)
            res = (edit.erratum(lm, e, ids, r) if arm == "erratum"
                   else edit.field_erratum(lm, e, ids, r))
            reference = read_ld(lm, pair, prefill(lm, ids[:-r]), ids[-r:]) if p.reference else None
            methods[key(arm, wording)] = method_entry(anchor, read_ld(lm, pair, res.state, res.suffix_ids), res,
                                                      reference)
    return {**base_row(ctx, inst, c), "erratum_lines": lines, "methods": methods}


def names(params: Params) -> list[str]:
    return [key(a, w) for a in params.arms for w in params.wordings]


def summarize_rows(ctx: Context, rows: list[dict[str, Any]]) -> dict[str, Any]:
    out = edit_gate_summary(ctx, rows)
    out["methods"] = methods_summary(rows, names(ctx.params), seed=ctx.cfg.seed)
    out["wordings"] = dict(ctx.params.wordings)
    out["arms"] = list(ctx.params.arms)
    return out


EXPERIMENT = Experiment(name="edit_wording", doc=__doc__, params=Params, run_instance=run_instance,
                        section="sec4",
                        summarize=summarize_rows, table=lambda s: format_methods_table(s, list(s["methods"])),
                        headline=lambda s: methods_headline(s),
                        paper=paper_headlines("edit_wording"),
                        # Fig. 3d appends the wording to a context that already holds the new value, read after a chain (Qwen3-8B,
                        # thinking on, n = 36); kvprobe appends it as an erratum over a stale cache and reads
                        # directly. The paper has no number for that condition: these rows are described only.
                        claims=(*(Claim(f"{w}_correct", f"erratum ({w.replace('_', ' ')}) over a stale cache: "
                                        "P(correct) (described)", "describe", f"methods.erratum/{w}.correct",
                                        role="effect")
                                  for w in ("bare_value", "tagged_update", "explicit_override")),
                                Claim("override_vs_aggressive", "explicit override minus the aggressive \"re-evaluate\" "
                                      "wording, P(correct) over a stale cache (described)",
                                      "describe", "methods.erratum/explicit_override.correct",
                                      "methods.erratum/aggressive.correct", role="effect")))
